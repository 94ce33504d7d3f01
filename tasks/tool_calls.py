"""tasks/tool_calls.py — the tool calls of a model turn: read as vLLM's server reads them, Hermes by
hand.

Role
    `supports_tools(tokenizer)`: the chat template renders tool schemas, tool calls and tool
        messages (`tokenizer_problem`: the one-line refusal when it does not);
    `ToolCallParser(name, tokenizer, reasoning)`: a whole model turn read exactly as vLLM's OpenAI
        server reads it for a request carrying the episode's tool schemas: its reasoning parser
        (--reasoning-parser) first, then its tool-call parser NAME (--tool-parser: the names its
        --tool-call-parser takes: hermes, llama3_json, qwen3_coder, mistral, ...) on the content
        -> Reading (reasoning, content, calls, failures); `parser_name` and
        `reasoning_parser_name` pick them from the chat template where its format is
        unambiguous, and `parser_problem` checks the parser reads the calls the template writes,
        typed (once, before the run);
    `parse_tool_calls(text)` -> (calls, failures): the Hermes format parsed by hand, for a ToolEnv
        built without a parser (a run always hands it vLLM's); `assistant_message(text, parser,
        tools)`: a turn as the chat message kept in the conversation.
Data contract: a call is {"name": str, "arguments": dict}. Formats `parse_tool_calls` reads: the
Hermes format of Qwen2.5, Qwen3 and most open tool-calling models,
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (the body JSON, its arguments an
object or a JSON string of one, or "parameters"); and Qwen3.5 / Qwen3-Coder's
`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>` (a value read
as JSON when it parses, else as text).
May touch: vLLM's parsers (imported by ToolCallParser only). No engine, no tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tasks import chat

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION_CALL = re.compile(r"<function=([^\n>]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


# The probe call of the checks before a run: a typed (integer) argument, so a parser that returns
# arguments as text where the schema says integer is caught.
PROBE = dict(
    name="probe_tool_a8f3",
    key="probe_arg_b9d4",
    value=7351,
    result="probe_result_c4f9",
)
PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": PROBE["name"],
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {PROBE["key"]: {"type": "integer", "description": "A probe."}},
            "required": [PROBE["key"]],
        },
    },
}


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template really renders tools: a probe schema's name in the
    prompt, and a probe call (name, argument) and tool result in a conversation. Templates that
    ignore `tools=` or drop tool calls or tool messages silently are refused (as TRL's
    `supports_tool_calling` does)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    name, key, value, result = PROBE["name"], PROBE["key"], PROBE["value"], PROBE["result"]
    schema = PROBE_SCHEMA
    # some templates take arguments as a JSON string
    for arguments in ({key: value}, json.dumps({key: value})):
        messages = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            },
            {"role": "tool", "name": name, "content": result},
        ]
        try:
            prompt = chat.render(tokenizer, messages[:1], True, [schema])
            conversation = chat.render(tokenizer, messages, False)
        except TypeError:
            continue
        # the template rejects tool roles or fields (jinja2's TemplateError and kin)
        except Exception:
            return False
        return name in prompt and all(str(s) in conversation for s in (name, key, value, result))
    return False


def parse_arguments(arguments) -> dict:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(
                f"its arguments are a string that is not a JSON object: {arguments[:60]!r}"
            ) from None
    if not isinstance(arguments, dict):
        raise ValueError(f"its arguments must be an object (got {type(arguments).__name__})")
    return arguments


def json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_call(body: str) -> dict:
    """One `<tool_call>` body -> {"name", "arguments"}; ValueError saying why not."""
    xml = FUNCTION_CALL.match(body)
    if xml:
        return {
            "name": xml.group(1).strip(),
            "arguments": {k.strip(): json_or_text(v) for k, v in PARAMETER.findall(xml.group(2))},
        }
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}, column {e.colno}): {body[:60]!r}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError(f'a call needs a "name" string: {body[:60]!r}')
    return {
        "name": call["name"],
        "arguments": parse_arguments(call.get("arguments", call.get("parameters"))),
    }


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The tool calls of a model turn, in order, and a reason for each `<tool_call>` that does not
    parse (a block left open, as in a turn cut by the token limit, is one)."""
    calls, failures = [], []
    blocks = TOOL_CALL.findall(text)
    for body in blocks:
        try:
            calls.append(parse_call(body.strip()))
        except ValueError as e:
            failures.append(str(e))
    if text.count("<tool_call>") > len(blocks):
        failures.append("a <tool_call> without its </tool_call>")
    return calls, failures


def assistant_message(text: str, parser: "ToolCallParser | None" = None, tools=None) -> dict:
    """The model's turn as the chat message kept in the conversation (the form TRL's
    `parse_response` gives). With `parser`: what vLLM's server returns for it (Reading: content
    without the call text, "" for none; the calls as `tool_calls`; the reasoning as `reasoning`,
    and as `reasoning_content` too, the two keys vLLM hands a template, so a template that keeps
    reasoning renders it). Without: the Hermes format by hand, the text outside the calls."""
    if parser is None:
        calls, _ = parse_tool_calls(text)
        message = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip()}
    else:
        reading = parser.read(text, tools)
        calls = reading.calls
        message = {"role": "assistant", "content": reading.content or ""}
        if reading.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reading.reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
    return message


# A chat template's tool-call format, told by what it writes -> the vLLM tool parser that reads it
# (the first marker found decides; `parser_problem` then checks the parser really reads the
# template's calls) Qwen3-Coder, Qwen3.5: <tool_call><function=NAME><parameter=K>...
FORMATS = (
    ("<function=", "qwen3_coder"),
    # Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": ...}
    ("<tool_call>", "hermes"),
    # Llama 3.1: bare JSON {"name": ..., "parameters": ...} or python_tag
    ("<|python_tag|>", "llama3_json"),
    # Llama 3.2 / 3.3: the same JSON
    ('"parameters": dictionary of argument name', "llama3_json"),
    ("[TOOL_CALLS]", "mistral"),
)


def parser_name(name: str, template: str | None) -> str:
    """--tool-parser NAME as given, else the one FORMATS names for the template; ValueError in one
    line."""
    if name:
        return name
    for marker, parser in FORMATS:
        if marker in (template or ""):
            return parser
    raise ValueError(
        "--tools: cannot tell which tool-call format the chat template uses; give --tool-parser "
        "NAME (vLLM's --tool-call-parser names, e.g. hermes, llama3_json, qwen3_coder, mistral)"
    )


# The call markers of formats whose vLLM parser names none (its engine-based parsers read them
# from a grammar): taken from the format itself. Qwen3-Coder / Qwen3.5 write
# <tool_call><function=NAME>..., and vLLM also reads a <function= without its <tool_call>.
FORMAT_MARKERS = {
    "qwen3_coder": ("<tool_call>", "<function="),
    "qwen3_xml": ("<tool_call>", "<function="),
}
# Formats whose call may be a bare JSON object: content that starts with `{` is a call attempt.
BARE_JSON = ("llama3_json", "llama4_json")
# A chat template's reasoning format, told by what it writes (all of the markers) -> the vLLM
# reasoning parser that reads it. Qwen3 and Qwen3.5: <think>...</think> in ChatML, switched by
# enable_thinking (QwQ and the always-thinking 2507 models lack the switch: ambiguous, asked).
REASONING_FORMATS = ((("<think>", "<|im_start|>", "enable_thinking"), "qwen3"),)


def reasoning_parser_name(name: str, template: str | None) -> str:
    """--reasoning-parser NAME as given ("" for `none`), else the one REASONING_FORMATS names for
    the template, "" for a template without reasoning blocks; ValueError in one line where the
    template writes <think> blocks of a family not in the table."""
    if name:
        return "" if name == "none" else name
    for markers, parser in REASONING_FORMATS:
        if all(marker in (template or "") for marker in markers):
            return parser
    if "<think>" in (template or ""):
        raise ValueError(
            "--tools: the chat template writes <think> blocks, but which reasoning format is not "
            "clear from it; give --reasoning-parser NAME (vLLM's --reasoning-parser names, e.g. "
            "qwen3, deepseek_r1) or --reasoning-parser none"
        )
    return ""


@dataclass
class Reading:
    """A model turn as vLLM's OpenAI server reads it: `reasoning` and `content` as its response
    message carries them (None where it has none; content without the call text), `calls` the
    tool calls it returns; `failures` a reason for each call attempt it did not return."""

    reasoning: str | None
    content: str | None
    calls: list[dict]
    failures: list[str]


def registered(manager, name: str, kind: str):
    """vLLM's `kind` ("tool" or "reasoning") parser class `name` from `manager`; ValueError in one
    line naming the known ones."""
    try:
        if kind == "tool":
            return manager.get_tool_parser(name)
        return manager.get_reasoning_parser(name)
    except KeyError:
        known = ", ".join(sorted(manager.list_registered()))
        flag = "--tool-parser" if kind == "tool" else "--reasoning-parser"
        raise ValueError(
            f"{flag} {name!r}: vLLM has no {kind} parser of that name (it has: {known})"
        ) from None


class ToolCallParser:
    """A model turn read as vLLM's OpenAI chat server reads it, for a request that carries the
    episode's tool schemas (`tools=`, tool_choice auto): its reasoning parser `reasoning` (vLLM's
    --reasoning-parser names; "" for none) separates the reasoning first, then its tool-call parser
    `name` (--tool-call-parser names) reads the calls from the content only, converting arguments
    by the schemas' types (qwen3_coder's `<parameter=a>2</parameter>` of an integer `a` is 2).
    vLLM's own composition of the two (vllm/parser: ParserManager.get_parser, Parser.parse) does
    it, on the tokenizer wrapped as its server wraps it. `read(text, tools)` -> Reading. vLLM
    returns no call for a call that does not parse; here each call attempt, counted by the
    format's markers in the content (the parser's start token: Hermes' <tool_call>, Llama's
    <|python_tag|>, Mistral's [TOOL_CALLS]; FORMAT_MARKERS for parsers that name none; a leading
    `{` for bare-JSON formats), that yields no call is a failure. A parser whose format has no
    marker is refused: a malformed call could not be told from an answer. Calls are read from
    text decoded with special tokens kept (the turns of a tool episode are: tasks/episodes.py)."""

    def __init__(self, name: str, tokenizer, reasoning: str = ""):
        import logging

        from vllm.parser import ParserManager
        from vllm.reasoning import ReasoningParserManager
        from vllm.tokenizers.hf import get_cached_tokenizer
        from vllm.tool_parsers import ToolParserManager

        tool_cls = registered(ToolParserManager, name, "tool")
        if reasoning:
            registered(ReasoningParserManager, reasoning, "reasoning")
        # the server's tokenizer: its vocabulary read once, not on every parser it makes
        self.tokenizer = get_cached_tokenizer(tokenizer)
        self.template_kwargs = dict(getattr(tokenizer, "chat_template_kwargs", None) or {})
        flags = f"--tool-parser {name}" + (f" --reasoning-parser {reasoning}" if reasoning else "")
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=name,
                reasoning_parser_name=reasoning or None,
                enable_auto_tools=True,
            )
            tool_parser = self.new_parser(None).tool_parser
        except Exception as e:
            raise ValueError(
                f"{flags}: vLLM's parser does not fit this tokenizer "
                f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})"
            ) from None
        # a bad call is counted here, not logged
        logging.getLogger(tool_cls.__module__).setLevel(logging.CRITICAL)
        self.name, self.reasoning = name, reasoning
        self.markers = list(
            FORMAT_MARKERS.get(name)
            or dict.fromkeys(
                m
                for m in (
                    getattr(tool_parser, "tool_call_start_token", None),
                    getattr(tool_parser, "bot_token", None),
                )
                if isinstance(m, str) and m
            )
        )
        if not self.markers and name not in BARE_JSON:
            raise ValueError(
                f"--tool-parser {name}: its calls have no start marker to count attempts by (a "
                "malformed call could not be told from an answer); give one whose format has one, "
                "e.g. hermes, qwen3_coder, llama3_json, mistral"
            )
        self.requests: dict[str, object] = {}

    def new_parser(self, request):
        """A fresh vLLM Parser for one turn, made as the server makes one per request."""
        return self.parser_cls(
            self.tokenizer,
            request.tools if request is not None else None,
            chat_template_kwargs=self.template_kwargs,
        )

    def request(self, tools):
        """The chat request the turn answers: the tool schemas, tool_choice auto (vLLM's default
        with tools), made once per set of schemas."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        key = json.dumps(tools or [], sort_keys=True)
        if key not in self.requests:
            self.requests[key] = ChatCompletionRequest(
                model="asyncgrpo",
                messages=[{"role": "user", "content": ""}],
                tools=list(tools) if tools else None,
                chat_template_kwargs=self.template_kwargs or None,
            )
        return self.requests[key]

    def attempts(self, content: str) -> int:
        """How many calls the content tries to make, by the format's markers (1 for content that is
        bare JSON in a bare-JSON format)."""
        count = max((content.count(m) for m in self.markers), default=0)
        return count or int(self.name in BARE_JSON and content.lstrip().startswith("{"))

    def read(self, text: str, tools) -> Reading:
        """The turn `text` as the server reads it for a request with `tools` (the episode's
        schemas). Each read makes its own vLLM parsers (they keep state), so episodes in worker
        threads share this object safely."""
        request, for_tools = self.request(tools), text
        try:
            # what the tool parser is handed: the content once the reasoning is out (the first
            # step of Parser.parse, on a parser of its own: they keep state)
            separate = getattr(self.new_parser(request), "extract_reasoning", None)
            for_tools = separate(text, request)[1] if separate else text
            reasoning, content, found = self.new_parser(request).parse(
                text, request, enable_auto_tools=True
            )
        # a parser that raises on odd text (the server answers an error): no call reads
        except Exception as e:
            reasoning, content, found = None, for_tools, []
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        else:
            why = "vLLM's parser read no call from it"
        calls, failures = [], []
        for call in found or []:
            try:
                calls.append({"name": call.name, "arguments": parse_arguments(call.arguments)})
            except ValueError as e:
                failures.append(f"the call of {call.name!r}: {e}")
        missing = self.attempts(for_tools or "") - len(calls) - len(failures)
        failures += [
            f"a {self.name} tool call that does not parse ({why}): {(for_tools or '')[:60]!r}"
        ] * max(0, missing)
        return Reading(reasoning, content, calls, failures)

    def parse(self, text: str, tools) -> tuple[list[dict], list[str]]:
        """(calls, failures) of `read`."""
        reading = self.read(text, tools)
        return reading.calls, reading.failures


def probe_call_text(tokenizer, tools=None) -> str:
    """What the chat template writes for an assistant turn that calls the probe tool (its tail after
    the generation prompt, else after the user's message)."""
    user = {"role": "user", "content": "probe question 3b8e"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": PROBE["name"], "arguments": {PROBE["key"]: PROBE["value"]}},
            }
        ],
    }
    prompt = chat.render(tokenizer, [user], True, tools or [PROBE_SCHEMA])
    full = chat.render(tokenizer, [user, call], False, tools or [PROBE_SCHEMA])
    return (
        full[len(prompt) :]
        if full.startswith(prompt)
        else full[full.rfind(user["content"]) + len(user["content"]) :]
    )


def parser_problem(parser: ToolCallParser, tokenizer, model: str = "the model") -> str | None:
    """Whether `parser` reads back, typed, the call the chat template writes (one line if not)."""
    try:
        text = probe_call_text(tokenizer)
    except Exception as e:
        return (
            f"--tools: the chat template of {model} cannot render a tool call "
            f"({type(e).__name__}: {e})"
        )
    calls, _ = parser.parse(text, [PROBE_SCHEMA])
    if calls != [{"name": PROBE["name"], "arguments": {PROBE["key"]: PROBE["value"]}}]:
        return (
            f"--tools: vLLM's {parser.name!r} tool parser does not read the tool calls the chat "
            f"template of {model} writes ({text.strip()[:80]!r} read as {calls!r}, the argument "
            "an integer); give the --tool-parser of its format, or a --chat-template whose format "
            "a parser reads"
        )
    return None


def tokenizer_problem(tokenizer, model: str = "the model") -> str | None:
    """The one-line refusal of --tools for a tokenizer whose chat template does not render tools."""
    if supports_tools(tokenizer):
        return None
    return (
        f"--tools: the chat template of {model} does not render tools (tool schemas, tool calls "
        "and tool messages); give a model whose chat template supports tool calling (e.g. "
        "Qwen2.5/Qwen3 instruct), or --chat-template FILE with one that does"
    )
