"""tools.py — tool use in episodes: TRL's `tools=` functions and `environment_factory` classes.

Role
    `load_functions("FILE.py:fn1,fn2" | "module:fn1,fn2")` -> the functions of --tools;
    `tool_schemas(functions)` -> the JSON schemas the chat template gets as `tools=` (transformers'
        `get_json_schema`: a type hint on every argument and a Google-style docstring, as TRL requires);
    `supports_tools(tokenizer)`: the chat template renders tool schemas, tool calls and tool messages;
    `ToolCallParser(name, tokenizer)`: vLLM's tool-call parser NAME (the names its server's --tool-call-parser
        takes: hermes, llama3_json, qwen3_coder, mistral, ...) on a whole model turn -> (calls, failures);
        `parser_name(cfg_name, template)` picks it from the chat template where its format is unambiguous, and
        `parser_problem` checks it reads the calls the template writes (once, before the run);
    `parse_tool_calls(text)` -> (calls, failures): the Hermes format parsed by hand, for a ToolEnv built without
        a parser (a run always hands it vLLM's); `assistant_message(text)`: a turn as a chat message;
    `ToolEnv(functions)`: an environment of the episode contract (reset/step, see the README) whose `step`
        runs the tool calls of the model's turn and returns their results as tool messages;
    `from_trl_environment(cls)`: a TRL `environment_factory` class as such an environment, unchanged.
Data contract: a call is {"name": str, "arguments": dict}; a tool message is {"role": "tool", "name": str,
"content": str} (a result is `str(result)`; a failure `str({"error": ...})`, as TRL writes them).
Formats `parse_tool_calls` reads: the Hermes format of Qwen2.5, Qwen3 and most open tool-calling models,
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (the body JSON, its arguments an object or a JSON
string of one, or "parameters"); and Qwen3.5 / Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>VALUE
</parameter></function></tool_call>` (a value read as JSON when it parses, else as text).
May touch: the modules it loads, and whatever the user's tools do; vLLM's parsers (imported by ToolCallParser
only). No engine, no tokens.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import re
from typing import Callable, Sequence

import chat
import data
import rewards
from data import split_list

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION_CALL = re.compile(r"<function=([^\n>]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
RESERVED_METHODS = ("reset", "get_reward", "close")  # lifecycle hooks of an environment class, never tools


def load_functions(spec: str) -> list[Callable]:
    """--tools `path/to/file.py:fn1,fn2` or `module:fn1,fn2` -> the functions. Raises ValueError in one line."""
    module_name, _, names = spec.rpartition(":")
    wanted = split_list(names)
    if not module_name or not wanted or not all(name.isidentifier() for name in wanted):
        raise ValueError(f"--tools {spec!r}: expected path/to/file.py:fn1,fn2 or module:fn1,fn2")
    module = rewards.load_module(module_name, f"--tools {spec}")  # its DataError is a ValueError
    functions = []
    for name in wanted:
        function = getattr(module, name, None)
        if function is None or not callable(function):
            raise ValueError(f"--tools {spec}: {module_name} has no function {name!r}")
        functions.append(function)
    return functions


def tool_schemas(functions: Sequence[Callable]) -> list[dict]:
    """The JSON schema of each function, for the chat template's `tools=`. Raises ValueError in one line for
    a function it cannot describe (what the model would see of it is exactly this schema)."""
    from transformers.utils import get_json_schema  # transformers only where tools are used

    schemas = []
    for function in functions:
        try:
            schemas.append(get_json_schema(function))
        except Exception as e:
            raise ValueError(f"tool {getattr(function, '__name__', function)!r} cannot be described to the model "
                             f"({e}): give every argument a type hint and the function a Google-style docstring "
                             "with an Args: section") from None
    return schemas


PROBE = dict(name="probe_tool_a8f3", key="probe_arg_b9d4", value="probe_value_d6e7", result="probe_result_c4f9")
PROBE_SCHEMA = {"type": "function", "function": {"name": PROBE["name"], "description": "A probe.", "parameters": {
    "type": "object", "properties": {PROBE["key"]: {"type": "string", "description": "A probe."}},
    "required": [PROBE["key"]]}}}


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template really renders tools: a probe schema's name in the prompt, and a
    probe call (name, argument) and tool result in a conversation. Templates that ignore `tools=` or drop
    tool calls or tool messages silently are refused (as TRL's `supports_tool_calling` does)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    name, key, value, result = PROBE["name"], PROBE["key"], PROBE["value"], PROBE["result"]
    schema = PROBE_SCHEMA
    for arguments in ({key: value}, json.dumps({key: value})):  # some templates take arguments as a JSON string
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": name, "arguments": arguments}}]},
                    {"role": "tool", "name": name, "content": result}]
        try:
            prompt = chat.render(tokenizer, messages[:1], True, [schema])
            conversation = chat.render(tokenizer, messages, False)
        except TypeError:
            continue
        except Exception:  # the template rejects tool roles or fields (jinja2's TemplateError and kin)
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
            raise ValueError(f"its arguments are a string that is not a JSON object: {arguments[:60]!r}") from None
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
        return {"name": xml.group(1).strip(),
                "arguments": {k.strip(): json_or_text(v) for k, v in PARAMETER.findall(xml.group(2))}}
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}, column {e.colno}): {body[:60]!r}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError(f"a call needs a \"name\" string: {body[:60]!r}")
    return {"name": call["name"], "arguments": parse_arguments(call.get("arguments", call.get("parameters")))}


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The tool calls of a model turn, in order, and a reason for each `<tool_call>` that does not parse (a
    block left open, as in a turn cut by the token limit, is one)."""
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
    """The model's turn as the chat message templates render: the text outside the calls as content, the
    parsed calls as `tool_calls` (the form TRL's `parse_response` gives)."""
    calls, _ = parser.parse(text) if parser is not None else parse_tool_calls(text)
    content = TOOL_CALL.sub("", text) if parser is None or not calls else text[:min(
        [i for i in (text.find(m) for m in parser.markers) if i >= 0] or [0 if text.lstrip().startswith("{") else
                                                                           len(text)])]
    message = {"role": "assistant", "content": content.strip()}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
    return message


# A chat template's tool-call format, told by what it writes -> the vLLM tool parser that reads it (the first
# marker found decides; `parser_problem` then checks the parser really reads the template's calls)
FORMATS = (("<function=", "qwen3_coder"),  # Qwen3-Coder, Qwen3.5: <tool_call><function=NAME><parameter=K>...
           ("<tool_call>", "hermes"),  # Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": ...}
           ("<|python_tag|>", "llama3_json"),  # Llama 3.1: bare JSON {"name": ..., "parameters": ...} or python_tag
           ('"parameters": dictionary of argument name', "llama3_json"),  # Llama 3.2 / 3.3: the same JSON
           ("[TOOL_CALLS]", "mistral"))


def parser_name(name: str, template: str | None) -> str:
    """--tool-parser NAME as given, else the one FORMATS names for the template; ValueError in one line."""
    if name:
        return name
    for marker, parser in FORMATS:
        if marker in (template or ""):
            return parser
    raise ValueError("--tools: cannot tell which tool-call format the chat template uses; give --tool-parser NAME "
                     "(vLLM's --tool-call-parser names, e.g. hermes, llama3_json, qwen3_coder, mistral, pythonic)")


class ToolCallParser:
    """vLLM's tool-call parser `name` (vllm/tool_parsers, the names its server's --tool-call-parser takes) on whole
    model turns: `parse(text)` -> (calls, failures). vLLM's parsers answer "no call" for a turn whose calls do
    not parse; a turn that holds the parser's start marker (Hermes' <tool_call>, Llama's <|python_tag|> or a
    leading `{`) without a parsed call counts as a failure, as does each marker beyond the calls parsed. Calls
    are read from text decoded with special tokens kept (the turns of a tool episode are: envs.py)."""

    def __init__(self, name: str, tokenizer):
        import logging

        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(f"--tool-parser {name!r}: vLLM has no tool parser of that name (it has: {known})") \
                from None
        try:
            self.parser = cls(tokenizer)
        except Exception as e:
            raise ValueError(f"--tool-parser {name}: vLLM's parser does not fit this tokenizer "
                             f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})") from None
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)  # a bad call is counted here, not logged
        self.name = name
        self.request = ChatCompletionRequest(model="asyncgrpo", messages=[{"role": "user", "content": ""}])
        self.markers = [m for m in (getattr(self.parser, "tool_call_start_token", None),
                                    getattr(self.parser, "bot_token", None)) if isinstance(m, str) and m]

    def attempts(self, text: str) -> int:
        """How many calls the turn tries to make, by the format's markers (1 for a turn that is bare JSON)."""
        count = max((text.count(m) for m in self.markers), default=0)
        return count or int(self.name in ("llama3_json", "llama4_json") and text.lstrip().startswith("{"))

    def parse(self, text: str) -> tuple[list[dict], list[str]]:
        try:
            info = self.parser.extract_tool_calls(text, self.request)
        except Exception as e:  # a parser that raises on odd text: the turn's calls do not parse
            info, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "vLLM's parser read no call from it"
        calls, failures = [], []
        for call in (info.tool_calls if info is not None and info.tools_called else []):
            try:
                calls.append({"name": call.function.name, "arguments": parse_arguments(call.function.arguments)})
            except ValueError as e:
                failures.append(f"the call of {call.function.name!r}: {e}")
        missing = self.attempts(text) - len(calls) - len(failures)
        failures += [f"a {self.name} tool call that does not parse ({why}): {text[:60]!r}"] * max(0, missing)
        return calls, failures


def probe_call_text(tokenizer, tools=None) -> str:
    """What the chat template writes for an assistant turn that calls the probe tool (its tail after the
    generation prompt, else after the user's message)."""
    user = {"role": "user", "content": "probe question 3b8e"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": PROBE["name"], "arguments": {PROBE["key"]: PROBE["value"]}}}]}
    prompt = chat.render(tokenizer, [user], True, tools or [PROBE_SCHEMA])
    full = chat.render(tokenizer, [user, call], False, tools or [PROBE_SCHEMA])
    return full[len(prompt):] if full.startswith(prompt) else full[full.rfind(user["content"]) + len(user["content"]):]


def parser_problem(parser: ToolCallParser, tokenizer, model: str = "the model") -> str | None:
    """Whether `parser` reads back the call the chat template writes (one line if not)."""
    try:
        text = probe_call_text(tokenizer)
    except Exception as e:
        return f"--tools: the chat template of {model} cannot render a tool call ({type(e).__name__}: {e})"
    calls, _ = parser.parse(text)
    if calls != [{"name": PROBE["name"], "arguments": {PROBE["key"]: PROBE["value"]}}]:
        return (f"--tools: vLLM's {parser.name!r} tool parser does not read the tool calls the chat template of "
                f"{model} writes ({text.strip()[:80]!r}); give the --tool-parser of its format, or a --chat-template "
                "whose format a parser reads")
    return None


def error_text(message: str) -> str:
    return str({"error": message})


class ToolEnv:
    """An environment (reset/step) that runs tools: `step(action)` parses the turn's tool calls and runs each
    (in order; an unknown tool, bad arguments or a raise is an error text in its tool message, counted), and
    returns (tool messages, 0.0, False); a turn without any `<tool_call>` is the model's answer: (None, 0.0,
    True). An unparseable `<tool_call>` gets an error message too, so the model sees what went wrong (TRL
    instead ends the episode there). Reward comes from --reward functions (or the class wrapped by
    `from_trl_environment`). `tools`: the schemas to render the prompt with. Counters, for the metrics:
    `tool_calls`, `tool_call_parse_failures`, `tool_errors`. With an async tool `step` is a coroutine
    function (the runner awaits it): async tools run on its loop, plain ones in a worker thread."""

    def __init__(self, functions: Sequence[Callable] = (), parser: "ToolCallParser | None" = None):
        self.parser = parser  # None: the Hermes format, parsed by hand (parse_tool_calls)
        self.functions: dict[str, Callable] = {}
        for function in functions:
            name = function.__name__
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}: the model could not tell them apart")
            self.functions[name] = function
        self.tools = tool_schemas(list(self.functions.values()))
        self.tool_calls = self.tool_call_parse_failures = self.tool_errors = 0
        if any(inspect.iscoroutinefunction(f) for f in self.functions.values()):
            self.step = self.step_async

    def reset(self, **row) -> None:
        return None

    def parse(self, action: str) -> tuple[list[dict], list[str]]:
        calls, failures = self.parser.parse(action) if self.parser is not None else parse_tool_calls(action)
        self.tool_calls += len(calls)
        self.tool_call_parse_failures += len(failures)
        return calls, failures

    def invoke(self, call: dict):
        """The tool's return value (a coroutine for an async tool); raises for an unknown tool or bad arguments."""
        function = self.functions.get(call["name"])
        if function is None:
            raise LookupError(f"Tool {call['name']} not found.")
        return function(**call["arguments"])

    def message(self, call: dict, value=None, error: Exception | None = None) -> dict:
        if error is not None:
            self.tool_errors += 1
        content = error_text(str(error)) if error is not None else str(value)
        return {"role": "tool", "name": call["name"], "content": content}

    @staticmethod
    def failure_messages(failures: list[str]) -> list[dict]:
        return [{"role": "tool", "name": "unknown", "content": error_text(f"could not parse a tool call: {why}")}
                for why in failures]

    def run(self, call: dict) -> dict:
        try:
            return self.message(call, self.invoke(call))
        except Exception as e:
            return self.message(call, error=e)

    async def run_async(self, call: dict) -> dict:
        try:
            if inspect.iscoroutinefunction(self.functions.get(call["name"])):
                return self.message(call, await self.invoke(call))
            return self.message(call, await asyncio.to_thread(self.invoke, call))  # a plain tool may block
        except Exception as e:
            return self.message(call, error=e)

    def step(self, action: str):
        calls, failures = self.parse(action)
        if not calls and not failures:
            return None, 0.0, True
        return [self.run(call) for call in calls] + self.failure_messages(failures), 0.0, False

    async def step_async(self, action: str):
        calls, failures = self.parse(action)
        if not calls and not failures:
            return None, 0.0, True
        return [await self.run_async(call) for call in calls] + self.failure_messages(failures), 0.0, False


def environment_methods(instance) -> list[Callable]:
    """The tools of a TRL environment instance: its public bound methods but the reserved ones (TRL's rule:
    `inspect.getmembers(..., inspect.ismethod)`, no leading underscore, not `reset`/`get_reward`; `close` is
    reserved here too, as the episode's end hook)."""
    return [member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
            if name not in RESERVED_METHODS and not name.startswith("_")]


class TrlEnvironment(ToolEnv):
    """One instance of a TRL `environment_factory` class, as an environment of the episode contract: `reset`,
    `get_reward` and `close` are the instance's own (each only where it has one, sync or async), its public
    methods are the tools (with any --tools functions), `step` is ToolEnv's. `env` is the instance (what
    reward functions get as `environments=`)."""

    def __init__(self, factory: Callable, functions: Sequence[Callable] = (), parser: "ToolCallParser | None" = None):
        env = factory()
        if not callable(getattr(env, "reset", None)):
            raise ValueError(f"{type(env).__name__} has no reset method: an environment class needs reset(**row)")
        super().__init__(list(functions) + environment_methods(env), parser)
        self.env = env
        self.reset = env.reset
        for hook in ("get_reward", "close"):
            if callable(getattr(env, hook, None)):
                setattr(self, hook, getattr(env, hook))


def from_trl_environment(cls: Callable, functions: Sequence[Callable] = (),
                         parser: "ToolCallParser | None" = None) -> Callable[[], TrlEnvironment]:
    """A zero-argument factory of TrlEnvironment around `cls` (a TRL environment class, or a zero-argument
    factory of its instances), plus any --tools `functions`. Picklable when `cls` and the functions are."""
    if isinstance(cls, type) and not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{cls.__name__} has no reset method: an environment class needs reset(**row)")
    return functools.partial(TrlEnvironment, cls, tuple(functions), parser=parser)


def check(cfg) -> list[str]:
    """config.validate(): --tools imports, every function has a schema, the task and a local model fit (one
    line if not). A hub model's chat template is checked once downloaded (prepare: `tokenizer_problem`)."""
    if not cfg.tools:
        return []
    try:
        tool_schemas(load_functions(cfg.tools))
    except ValueError as e:
        return [str(e) if str(e).startswith("--tools") else f"--tools {cfg.tools}: {e}"]
    try:
        copy_task = data.spec_of(cfg) is None
    except data.DataError:  # data.check_flags reports it
        copy_task = False
    if copy_task:
        return ["--tools: the copy task has no chat prompts to offer tools in; give a dataset task (--dataset, "
                "--task gsm8k or --task rg:NAME)"]
    if not cfg.model:
        return ["--tools: the default tiny model has no chat template to show tools with; give --model (a model "
                "whose chat template supports tool calling)"]
    if os.path.isdir(os.path.expanduser(cfg.model)):
        try:
            problem = tokenizer_problem(chat.load_tokenizer(os.path.expanduser(cfg.model), cfg.chat_template,
                                                            cfg.chat_template_kwargs), cfg.model)
        except Exception:  # prepare reports a tokenizer that does not load
            problem = None
        return [problem] if problem else []
    return []


def tokenizer_problem(tokenizer, model: str = "the model") -> str | None:
    """The one-line refusal of --tools for a tokenizer whose chat template does not render tools."""
    if supports_tools(tokenizer):
        return None
    return (f"--tools: the chat template of {model} does not render tools (tool schemas, tool calls and tool "
            "messages); give a model whose chat template supports tool calling (e.g. Qwen2.5/Qwen3 instruct), or "
            "--chat-template FILE with one that does")
