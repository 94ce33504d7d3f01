"""tasks/tool_calls.py — the tool calls of a model turn: vLLM's tool parsers, Hermes by hand.

Role
    `supports_tools(tokenizer)`: the chat template renders tool schemas, tool calls and tool
        messages (`tokenizer_problem`: the one-line refusal when it does not);
    `ToolCallParser(name, tokenizer)`: vLLM's tool-call parser NAME (the names its server's
        --tool-call-parser takes: hermes, llama3_json, qwen3_coder, mistral, ...) on a whole model
        turn -> (calls, failures); `parser_name(cfg_name, template)` picks it from the chat
        template where its format is unambiguous, and `parser_problem` checks it reads the calls
        the template writes (once, before the run);
    `parse_tool_calls(text)` -> (calls, failures): the Hermes format parsed by hand, for a ToolEnv
        built without a parser (a run always hands it vLLM's); `assistant_message(text)`: a turn
        as a chat message.
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

import chat

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION_CALL = re.compile(r"<function=([^\n>]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


PROBE = dict(
    name="probe_tool_a8f3",
    key="probe_arg_b9d4",
    value="probe_value_d6e7",
    result="probe_result_c4f9",
)
PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": PROBE["name"],
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {PROBE["key"]: {"type": "string", "description": "A probe."}},
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
        return name in prompt and all(s in conversation for s in (name, key, value, result))
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


def assistant_message(text: str, parser: "ToolCallParser | None" = None) -> dict:
    """The model's turn as the chat message templates render: the text outside the calls as content,
    the parsed calls as `tool_calls` (the form TRL's `parse_response` gives)."""
    calls, _ = parser.parse(text) if parser is not None else parse_tool_calls(text)
    content = (
        TOOL_CALL.sub("", text)
        if parser is None or not calls
        else text[
            : min(
                [i for i in (text.find(m) for m in parser.markers) if i >= 0]
                or [0 if text.lstrip().startswith("{") else len(text)]
            )
        ]
    )
    message = {"role": "assistant", "content": content.strip()}
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
        "NAME (vLLM's --tool-call-parser names, e.g. hermes, llama3_json, qwen3_coder, mistral, "
        "pythonic)"
    )


class ToolCallParser:
    """vLLM's tool-call parser `name` (vllm/tool_parsers, the names its server's --tool-call-parser
    takes) on whole model turns: `parse(text)` -> (calls, failures). vLLM's parsers answer "no call"
    for a turn whose calls do not parse; a turn that holds the parser's start marker
    (Hermes' <tool_call>, Llama's <|python_tag|> or a leading `{`) without a parsed call counts as a
    failure, as does each marker beyond the calls parsed. Calls are read from text decoded with
    special tokens kept (the turns of a tool episode are: tasks/episodes.py)."""

    def __init__(self, name: str, tokenizer):
        import logging

        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(
                f"--tool-parser {name!r}: vLLM has no tool parser of that name (it has: {known})"
            ) from None
        try:
            self.parser = cls(tokenizer)
        except Exception as e:
            raise ValueError(
                f"--tool-parser {name}: vLLM's parser does not fit this tokenizer "
                f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})"
            ) from None
        # a bad call is counted here, not logged
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)
        self.name = name
        self.request = ChatCompletionRequest(
            model="asyncgrpo", messages=[{"role": "user", "content": ""}]
        )
        self.markers = [
            m
            for m in (
                getattr(self.parser, "tool_call_start_token", None),
                getattr(self.parser, "bot_token", None),
            )
            if isinstance(m, str) and m
        ]

    def attempts(self, text: str) -> int:
        """How many calls the turn tries to make, by the format's markers (1 for a turn that is bare
        JSON)."""
        count = max((text.count(m) for m in self.markers), default=0)
        return count or int(
            self.name in ("llama3_json", "llama4_json") and text.lstrip().startswith("{")
        )

    def parse(self, text: str) -> tuple[list[dict], list[str]]:
        try:
            info = self.parser.extract_tool_calls(text, self.request)
        except Exception as e:  # a parser that raises on odd text: the turn's calls do not parse
            info, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "vLLM's parser read no call from it"
        calls, failures = [], []
        for call in info.tool_calls if info is not None and info.tools_called else []:
            try:
                calls.append(
                    {
                        "name": call.function.name,
                        "arguments": parse_arguments(call.function.arguments),
                    }
                )
            except ValueError as e:
                failures.append(f"the call of {call.function.name!r}: {e}")
        missing = self.attempts(text) - len(calls) - len(failures)
        failures += [f"a {self.name} tool call that does not parse ({why}): {text[:60]!r}"] * max(
            0, missing
        )
        return calls, failures


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
    """Whether `parser` reads back the call the chat template writes (one line if not)."""
    try:
        text = probe_call_text(tokenizer)
    except Exception as e:
        return (
            f"--tools: the chat template of {model} cannot render a tool call "
            f"({type(e).__name__}: {e})"
        )
    calls, _ = parser.parse(text)
    if calls != [{"name": PROBE["name"], "arguments": {PROBE["key"]: PROBE["value"]}}]:
        return (
            f"--tools: vLLM's {parser.name!r} tool parser does not read the tool calls the chat "
            f"template of "
            f"{model} writes ({text.strip()[:80]!r}); give the --tool-parser of its format, or a "
            f"--chat-template whose format a parser reads"
        )
    return None


def tokenizer_problem(tokenizer, model: str = "the model") -> str | None:
    """The one-line refusal of --tools for a tokenizer whose chat template does not render tools."""
    if supports_tools(tokenizer):
        return None
    return (
        f"--tools: the chat template of {model} does not render tools (tool schemas, tool calls "
        f"and tool "
        "messages); give a model whose chat template supports tool calling (e.g. Qwen2.5/Qwen3 "
        "instruct), or --chat-template FILE with one that does"
    )
