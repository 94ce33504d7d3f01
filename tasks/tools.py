"""tasks/tools.py — tool use in episodes: TRL's `tools=` functions, `environment_factory` classes.

Role
    `load_functions("FILE.py:fn1,fn2" | "module:fn1,fn2")` -> the functions of --tools;
    `tool_schemas(functions)` -> the JSON schemas the chat template gets as `tools=`
        (transformers' `get_json_schema`: a type hint on every argument and a Google-style
        docstring, as TRL requires);
    `ToolEnv(functions)`: an environment of the episode contract (reset/step, see the README)
        whose `step` runs the tool calls of the model's turn and returns their results as tool
        messages;
    `from_trl_environment(cls)`: a TRL `environment_factory` class as such an environment,
        unchanged;
    `check(cfg)`: prepare.check's --tools line. Reading the calls out of a model turn (vLLM's tool
        parsers, the Hermes format by hand, the template checks): tasks/tool_calls.py, whose
        names are also here.
Data contract: a call is {"name": str, "arguments": dict}; a tool message is {"role": "tool",
"name": str, "content": str} (a result is `str(result)`; a failure `str({"error": ...})`, as TRL
writes them).
May touch: the modules it loads, and whatever the user's tools do. No engine, no tokens.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from typing import Callable, Sequence

from tasks import chat, rewards
from tasks.datasets import DataError
from tasks.prompts import spec_of, split_list
from tasks.tool_calls import (  # noqa: F401 (also tools.X)
    PROBE_SCHEMA,
    ToolCallParser,
    assistant_message,
    parse_tool_calls,
    parser_name,
    parser_problem,
    reasoning_parser_name,
    supports_tools,
    tokenizer_problem,
)

# lifecycle hooks of an environment class, never tools
RESERVED_METHODS = ("reset", "get_reward", "close")


def load_functions(spec: str) -> list[Callable]:
    """--tools `path/to/file.py:fn1,fn2` or `module:fn1,fn2` -> the functions. Raises ValueError in
    one line."""
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
    """The JSON schema of each function, for the chat template's `tools=`. Raises ValueError in one
    line for a function it cannot describe (what the model would see of it is exactly this
    schema)."""
    from transformers.utils import get_json_schema  # transformers only where tools are used

    schemas = []
    for function in functions:
        try:
            schemas.append(get_json_schema(function))
        except Exception as e:
            raise ValueError(
                f"tool {getattr(function, '__name__', function)!r} cannot be described to the "
                f"model ({e}): give every argument a type hint and the function a Google-style "
                "docstring with an Args: section"
            ) from None
    return schemas


def error_text(message: str) -> str:
    return str({"error": message})


class ToolEnv:
    """An environment (reset/step) that runs tools: `step(action)` parses the turn's tool calls and
    runs each (in order; an unknown tool, bad arguments or a raise is an error text in its tool
    message, counted), and returns (tool messages, 0.0, False); a turn without a call or a call
    attempt (its parser's markers in the content, the reasoning apart: tool_calls.ToolCallParser)
    is the model's answer: (None, 0.0, True). An unparseable call gets an error message too,
    so the model sees what went wrong (TRL instead ends the episode there). Reward comes
    from --reward functions (or the class wrapped by `from_trl_environment`). `tools`: the schemas
    to render the prompt with. Counters, for the metrics: `tool_calls`, `tool_call_parse_failures`,
    `tool_errors`. With an async tool `step` is a coroutine function (the runner awaits it): async
    tools run on its loop, plain ones in a worker thread."""

    def __init__(self, functions: Sequence[Callable] = (), parser: "ToolCallParser | None" = None):
        self.parser = parser  # None: the Hermes format, parsed by hand (parse_tool_calls)
        self.functions: dict[str, Callable] = {}
        for function in functions:
            name = function.__name__
            if name in self.functions:
                raise ValueError(
                    f"two tools are named {name!r}: the model could not tell them apart"
                )
            self.functions[name] = function
        self.tools = tool_schemas(list(self.functions.values()))
        self.tool_calls = self.tool_call_parse_failures = self.tool_errors = 0
        if any(inspect.iscoroutinefunction(f) for f in self.functions.values()):
            self.step = self.step_async

    def reset(self, **row) -> None:
        return None

    def parse(self, action: str) -> tuple[list[dict], list[str]]:
        calls, failures = (
            self.parser.parse(action, self.tools)
            if self.parser is not None
            else parse_tool_calls(action)
        )
        self.tool_calls += len(calls)
        self.tool_call_parse_failures += len(failures)
        return calls, failures

    def invoke(self, call: dict):
        """The tool's return value (a coroutine for an async tool); raises for an unknown tool or
        bad arguments."""
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
        return [
            {
                "role": "tool",
                "name": "unknown",
                "content": error_text(f"could not parse a tool call: {why}"),
            }
            for why in failures
        ]

    def run(self, call: dict) -> dict:
        try:
            return self.message(call, self.invoke(call))
        except Exception as e:
            return self.message(call, error=e)

    async def run_async(self, call: dict) -> dict:
        try:
            if inspect.iscoroutinefunction(self.functions.get(call["name"])):
                return self.message(call, await self.invoke(call))
            # A plain tool may block: it runs in a worker thread.
            return self.message(call, await asyncio.to_thread(self.invoke, call))
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
        return (
            [await self.run_async(call) for call in calls] + self.failure_messages(failures),
            0.0,
            False,
        )


def environment_methods(instance) -> list[Callable]:
    """The tools of a TRL environment instance: its public bound methods but the reserved ones
    (TRL's rule: `inspect.getmembers(..., inspect.ismethod)`, no leading underscore, not
    `reset`/`get_reward`; `close` is reserved here too, as the episode's end hook)."""
    return [
        member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if name not in RESERVED_METHODS and not name.startswith("_")
    ]


class TrlEnvironment(ToolEnv):
    """One instance of a TRL `environment_factory` class, as an environment of the episode contract:
    `reset`, `get_reward` and `close` are the instance's own (each only where it has one, sync or
    async), its public methods are the tools (with any --tools functions), `step` is ToolEnv's.
    `env` is the instance (what reward functions get as `environments=`)."""

    def __init__(
        self,
        factory: Callable,
        functions: Sequence[Callable] = (),
        parser: "ToolCallParser | None" = None,
    ):
        env = factory()
        if not callable(getattr(env, "reset", None)):
            raise ValueError(
                f"{type(env).__name__} has no reset method: an environment class needs reset(**row)"
            )
        super().__init__(list(functions) + environment_methods(env), parser)
        self.env = env
        self.reset = env.reset
        for hook in ("get_reward", "close"):
            if callable(getattr(env, hook, None)):
                setattr(self, hook, getattr(env, hook))


def from_trl_environment(
    cls: Callable, functions: Sequence[Callable] = (), parser: "ToolCallParser | None" = None
) -> Callable[[], TrlEnvironment]:
    """A zero-argument factory of TrlEnvironment around `cls` (a TRL environment class, or a
    zero-argument factory of its instances), plus any --tools `functions`. Picklable when `cls` and
    the functions are."""
    if isinstance(cls, type) and not callable(getattr(cls, "reset", None)):
        raise ValueError(
            f"{cls.__name__} has no reset method: an environment class needs reset(**row)"
        )
    return functools.partial(TrlEnvironment, cls, tuple(functions), parser=parser)


def check(cfg) -> list[str]:
    """prepare.check: --tools imports, every function has a schema, the task and a local model fit
    (one line if not). A hub model's chat template is checked once downloaded (prepare:
    `tokenizer_problem`)."""
    if not cfg.tools:
        return []
    try:
        tool_schemas(load_functions(cfg.tools))
    except ValueError as e:
        return [str(e) if str(e).startswith("--tools") else f"--tools {cfg.tools}: {e}"]
    try:
        copy_task = spec_of(cfg) is None
    except DataError:  # prompts.check_flags reports it
        copy_task = False
    if copy_task:
        return [
            "--tools: the copy task has no chat prompts to offer tools in; give a dataset task "
            "(--dataset, --task gsm8k or --task rg:NAME)"
        ]
    if not cfg.model:
        return [
            "--tools: the default tiny model has no chat template to show tools with; give --model "
            "(a model whose chat template supports tool calling)"
        ]
    if os.path.isdir(os.path.expanduser(cfg.model)):
        try:
            problem = tokenizer_problem(
                chat.load_tokenizer(
                    os.path.expanduser(cfg.model), cfg.chat_template, cfg.chat_template_kwargs
                ),
                cfg.model,
            )
        except Exception:  # prepare reports a tokenizer that does not load
            problem = None
        return [problem] if problem else []
    return []
