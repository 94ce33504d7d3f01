"""Tools (tasks/tools.py): TRL's `tools=` functions and `environment_factory` classes as episode
environments.

Fast, in-process, no engine and no episode runner: `reset`/`step` are called directly. Schemas
rendered by the tiny tool-capable chat template; a model turn with a tool call parsed, run and its
result rendered back (the round trip the runner does, token for token on the "ascii" tokenizer); the
call formats parsed and the failures counted; templates that cannot show tools refused; --tools
specs loaded or refused in one line; a TRL environment class (the IncrementEnv of TRL's docs) run
unchanged, sync and async.
"""

import asyncio
import contextlib
import inspect
import json

import pytest

import config
from run import prepare
from tasks import builtin, tools

TOOLS_FILE = "tasks/examples/my_tools.py"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The numerator.
        b: The denominator.
    """
    return a / b


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def with_template(tokenizer, template):
    copy = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    copy.chat_template = template
    return copy


# ---- the tiny tool-capable template --------------------------------------------------------------
def test_schemas_render_through_the_tiny_template_and_without_tools_nothing_changes(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 2 / 4?"},
    ]
    schemas = tools.tool_schemas([add, divide])
    assert [s["function"]["name"] for s in schemas] == ["add", "divide"]
    assert schemas[1]["function"]["parameters"]["properties"]["b"] == {
        "type": "number",
        "description": "The denominator.",
    }
    prompt = tokenizer.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=True
    )
    for schema in schemas:
        assert json.dumps(schema) in prompt  # what the model is shown is exactly the schema
    assert prompt.startswith("<|system|>\nBe brief.\n") and prompt.count("Be brief.") == 1
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # ASCII only: the character tokenizer encodes it faithfully
    assert tokenizer.decode(ids) == prompt
    plain = with_template(tokenizer, builtin.TINY_CHAT_TEMPLATE)
    for generation_prompt in (False, True):
        assert tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        ) == plain.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )


def test_a_tool_call_round_trips_parse_run_and_render(tokenizer):
    env = tools.ToolEnv([add, divide])
    assert env.reset(question="2 + 3 and 1 / 4?", answer="5") is None
    prompt = [{"role": "user", "content": "What is 2 + 3, and 1 / 4?"}]
    turn = "Let me compute. " + call("add", a=2, b=3) + call("divide", a=1, b=4)
    observation, reward, done = env.step(turn)
    assert (reward, done) == (0.0, False)
    assert observation == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "divide", "content": "0.25"},
    ]
    assert (env.tool_calls, env.tool_call_parse_failures, env.tool_errors) == (2, 0, 0)
    # The runner's suffix-diff: the conversation so far,
    # then with the tool messages and the generation prompt.
    before = prompt + [tools.assistant_message(turn)]
    head = tokenizer.apply_chat_template(before, tools=env.tools, tokenize=False)
    full = tokenizer.apply_chat_template(
        before + observation, tools=env.tools, tokenize=False, add_generation_prompt=True
    )
    # the calls render back as the model wrote them
    assert turn.split("Let me compute. ")[1] in head
    # prefix-preserving: appending tool messages leaves the past as it was
    assert full.startswith(head)
    suffix = full[len(head) :]
    assert suffix == "<|tool|>\n5\n<|tool|>\n0.25\n<|assistant|>\n"
    assert tokenizer.decode(tokenizer(suffix, add_special_tokens=False)["input_ids"]) == suffix
    # no call: the model answered
    assert env.step("The answers are 5 and 0.25.") == (None, 0.0, True)
    assert env.tool_calls == 2


# ---- parsing and faults --------------------------------------------------------------------------
def test_call_formats_are_parsed_and_failures_counted():
    qwen3_5 = (
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=b>\nthree\n</parameter>\n</function>\n</tool_call>"
    )
    text = (
        "think first "
        + call("add", a=1, b=2)
        + '\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 4}"}'
        '\n</tool_call><tool_call>{"name": "divide", "parameters": {"a": 1}}</tool_call>'
        + qwen3_5
        + '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call><tool_call>{"arguments": '
        "{}}"
        '</tool_call><tool_call>{"name": "add", "arguments": [1, '
        '2]}</tool_call><tool_call>{"name": "ad'
    )
    calls, failures = tools.parse_tool_calls(text)
    assert calls == [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "add", "arguments": {"a": 4}},
        {"name": "divide", "arguments": {"a": 1}},
        {"name": "add", "arguments": {"a": 2, "b": "three"}},
    ]
    assert len(failures) == 4
    assert failures[0].startswith("not JSON") and "name" in failures[1] and "object" in failures[2]
    assert "without its </tool_call>" in failures[3]
    assert tools.parse_tool_calls("no calls at all") == ([], [])
    message = tools.assistant_message("ok " + call("add", a=1, b=2))
    assert message == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
        ],
    }


def test_tool_errors_become_error_messages_and_the_episode_goes_on():
    env = tools.ToolEnv([add, divide])
    turn = (
        call("divide", a=1, b=0)
        + call("nosuch", x=1)
        + call("add", a=1)
        + call("add", a=1, b=1)
        + "<tool_call>{not json</tool_call>"
    )
    observation, reward, done = env.step(turn)
    assert done is False and reward == 0.0
    contents = [m["content"] for m in observation]
    with pytest.raises(ZeroDivisionError) as raised:
        divide(1, 0)
    assert contents[0] == str({"error": str(raised.value)})  # TRL's error text
    assert contents[1] == str({"error": "Tool nosuch not found."})
    assert "missing 1 required positional argument" in contents[2]
    assert contents[3] == "2"
    assert observation[4]["name"] == "unknown" and "could not parse a tool call" in contents[4]
    assert (env.tool_calls, env.tool_errors, env.tool_call_parse_failures) == (4, 3, 1)
    observation, _, done = env.step("<tool_call>{broken")  # only a broken call: told, not ended
    assert done is False and len(observation) == 1 and env.tool_call_parse_failures == 2


def test_async_tools_make_step_a_coroutine_and_plain_tools_still_run():
    async def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        await asyncio.sleep(0)
        return key.upper()

    env = tools.ToolEnv([add, lookup])
    assert inspect.iscoroutinefunction(env.step) and not inspect.iscoroutinefunction(
        tools.ToolEnv([add]).step
    )
    observation, _, done = asyncio.run(
        env.step(call("lookup", key="abc") + call("add", a=1, b=1) + call("lookup"))
    )
    assert [m["content"] for m in observation[:2]] == ["ABC", "2"] and "key" in observation[2][
        "content"
    ]
    assert (done, env.tool_errors) == (False, 1)
    assert asyncio.run(env.step("done")) == (None, 0.0, True)


# ---- templates, specs ----------------------------------------------------------------------------
def test_templates_that_cannot_show_tools_are_refused(tokenizer):
    assert tools.supports_tools(tokenizer)
    # renders tool messages, not schemas or calls
    no_tools = with_template(tokenizer, builtin.TINY_CHAT_TEMPLATE)
    assert not tools.supports_tools(no_tools)
    drops_tool_messages = builtin.TINY_TOOL_CHAT_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages if m['role'] != 'tool' %}"
    )
    assert not tools.supports_tools(with_template(tokenizer, drops_tool_messages))
    assert not tools.supports_tools(
        with_template(tokenizer, "{{ raise_exception('no tools here') }}")
    )
    problem = tools.tokenizer_problem(no_tools, "tiny")
    assert (
        problem.startswith("--tools: the chat template of tiny does not render tools")
        and "\n" not in problem
    )
    assert tools.tokenizer_problem(tokenizer) is None


def test_tools_specs_load_or_fail_in_one_line(ascii_model, tmp_path):
    assert [f.__name__ for f in tools.load_functions(f"{TOOLS_FILE}:add,multiply")] == [
        "add",
        "multiply",
    ]
    assert tools.load_functions("tasks.examples.my_tools:multiply")[0](3, 4) == 12
    (tmp_path / "undocumented.py").write_text("def f(a: int) -> int:\n    return a\n\ng = 3\n")
    bad = {
        "nocolon": "expected path/to/file.py:fn1,fn2",
        f"{tmp_path}/none.py:f": "no such file",
        f"{TOOLS_FILE}:nosuch": "has no function 'nosuch'",
        f"{tmp_path}/undocumented.py:g": "has no function 'g'",
        f"{TOOLS_FILE}:": "expected",
        "no_such_module_x:f": "cannot import no_such_module_x",
    }
    for spec, expected in bad.items():
        with pytest.raises(ValueError, match=expected) as info:
            tools.load_functions(spec)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="cannot be described to the model .*no docstring"):
        tools.tool_schemas(tools.load_functions(f"{tmp_path}/undocumented.py:f"))
    chat = [
        "--dataset",
        "tasks/examples/chat_prompts.jsonl",
        "--answer-column",
        "solution",
        "--reward",
        "math",
    ]
    cfg = prepare.parse_args(
        ["--model", ascii_model, *chat, "--tools", f"{TOOLS_FILE}:add,multiply"]
    )
    assert cfg.tools == f"{TOOLS_FILE}:add,multiply"
    refusals = {
        (
            *chat,
            "--tools",
            f"{tmp_path}/undocumented.py:f",
        ): "--tools .*undocumented.py:f: tool 'f' cannot",
        (
            "--model",
            ascii_model,
            "--tools",
            f"{TOOLS_FILE}:add",
        ): "--tools: the copy task has no chat",
        (
            *chat,
            "--tools",
            f"{TOOLS_FILE}:add",
        ): "--tools: the default tiny model has no chat template",
    }
    for argv, expected in refusals.items():
        with pytest.raises(SystemExit, match=f"^error: {expected}"):
            prepare.parse_args(list(argv))


# ---- TRL's environment_factory -------------------------------------------------------------------
class IncrementEnv:
    """TRL's documented example (grpo_trainer.md, "Environments"), with a private helper and a
    close."""

    def reset(self, target: int = 3, **kwargs) -> str | None:
        self.counter, self.target, self.closed = 0, target, False
        return f"Increment the counter to {target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += self._checked(step)
        return self.counter

    def _checked(self, step: int) -> int:
        if step < 0:
            raise ValueError("step must be >= 0")
        return step

    def close(self):
        self.closed = True


class AsyncEnv:
    def reset(self, **kwargs) -> None:
        self.seen = []

    async def note(self, text: str) -> str:
        """Note some text.

        Args:
            text: What to note.
        """
        self.seen.append(text)
        return f"noted {len(self.seen)}"


def test_a_trl_environment_class_runs_unchanged():
    factory = tools.from_trl_environment(IncrementEnv, [add])
    env, other = factory(), factory()
    assert env.env is not other.env  # one instance of the class per episode
    # public methods, not hooks
    assert [s["function"]["name"] for s in env.tools] == ["add", "increment"]
    assert env.reset(target=5, prompt="ignored") == "Increment the counter to 5."
    observation, reward, done = env.step(call("increment", step=2) + call("increment", step=3))
    assert [m["content"] for m in observation] == ["2", "5"] and (reward, done) == (0.0, False)
    observation, _, _ = env.step(call("increment", step=-1) + call("_checked", step=1))
    assert (
        "step must be >= 0" in observation[0]["content"]
        and "not found" in observation[1]["content"]
    )
    assert env.tool_errors == 2
    assert env.step("It is 5.") == (None, 0.0, True)
    assert env.get_reward() == 1.0
    env.close()
    assert env.env.closed
    other.reset(target=1)
    assert other.get_reward() == 0.0  # the episodes do not share state

    plain = tools.from_trl_environment(AsyncEnv)()
    # only the hooks the class has
    assert not hasattr(plain, "get_reward") and not hasattr(plain, "close")
    assert plain.reset() is None and inspect.iscoroutinefunction(plain.step)
    observation, _, _ = asyncio.run(plain.step(call("note", text="a") + call("note", text="b")))
    assert [m["content"] for m in observation] == ["noted 1", "noted 2"] and plain.env.seen == [
        "a",
        "b",
    ]

    with pytest.raises(ValueError, match="has no reset method"):
        tools.from_trl_environment(type("NoReset", (), {"go": lambda self: 1}))
    with pytest.raises(ValueError, match="two tools are named 'increment'"):
        tools.from_trl_environment(IncrementEnv, [IncrementEnv().increment])()


# --------------------------------------------------------------------------------------------------
# --tools through the episode runner (episodes.run_episode), with a scripted engine
# --------------------------------------------------------------------------------------------------
class ScriptedEngine:
    """Stands in for vLLM: each request "samples" the next scripted text (one token per character on
    the ascii tokenizer), tagged version 0, and records the prompt it was given."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        self.prompts.append(list(prompt["prompt_token_ids"]))
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id
        ]
        out = SimpleNamespace(
            token_ids=ids,
            text=text,
            finish_reason="stop",
            logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids],
            weight_versions=[SimpleNamespace(start=0, end=len(ids), version=0)],
        )

        async def stream():
            yield SimpleNamespace(outputs=[out])

        return stream()


def test_tools_round_trip_through_the_episode_runner(tmp_path, ascii_model, tokenizer):
    """--tools on a tool-capable template: the prompt shows the schemas, the model's call runs, its
    result comes back as a tool message (environment tokens, no loss), the next turn answers and
    ends the episode; the tool counters reach the metrics and the reward function sees the
    transcript and the environments."""
    from types import SimpleNamespace

    from run.metrics import episode_metrics
    from tasks import envs, episodes

    (tmp_path / "fns.py").write_text(inspect.getsource(add) + "\n\n" + inspect.getsource(divide))
    (tmp_path / "r.py").write_text(
        "SEEN = []\n\n\ndef right(completions, environments, **kw):\n"
        "    SEEN.append((completions, environments))\n"
        "    return [1.0 if '5' in c[-1]['content'] else 0.0 for c in completions]\n"
    )
    cfg = config.Config(
        model=ascii_model,
        dataset="tasks/examples/chat_prompts.jsonl",
        answer_column="solution",
        reward=f"{tmp_path / 'r.py'}:right",
        tools=f"{tmp_path / 'fns.py'}:add,divide",
        max_turns=4,
        max_new_tokens=80,
        group_size=1,
    )
    assert tools.check(cfg) == []
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "solution": "5"}
    task = envs.EnvTask(cfg, tokenizer, rows=([row], [row]))
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine(
        tokenizer, [call, '<tool_call>{"name": "nope"</tool_call>', "The sum is 5."]
    )
    gen = SimpleNamespace(
        cfg=cfg,
        task=task,
        engine=engine,
        max_model_len=4096,
        request_params=lambda **k: k,
        generating_request=contextlib.nullcontext,
        generate=lambda ids, params, request_id: engine.generate(
            {"prompt_token_ids": ids}, params, request_id
        ),
    )
    env = task.factory()
    assert isinstance(env, tools.ToolEnv) and [t["function"]["name"] for t in env.tools] == [
        "add",
        "divide",
    ]
    ep = asyncio.run(episodes.run_episode(gen, env, task.prompts[0], episodes.Turns({}, "t")))
    assert not ep.error and ep.turns == 3 and not ep.truncated, (ep.error, ep.turns, ep.truncated)
    first = tokenizer.decode(engine.prompts[0])
    # the schemas, rendered with the prompt
    assert '"name": "add"' in first and "What is 2 + 3?" in first
    # turn 1 as sampled, then the tool's answer, then turn 2 ...
    tail = ep.ids[len(engine.prompts[0]) :]
    sampled = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tail[: len(sampled)] == sampled and ep.model_mask[: len(sampled)] == [True] * len(
        sampled
    )
    observation = tokenizer.decode(
        ep.ids[len(engine.prompts[0]) + len(sampled) : len(engine.prompts[1])]
    )
    assert "5" in observation and "tool" in observation  # add(2, 3), as a tool message
    assert not any(ep.model_mask[len(sampled) : len(engine.prompts[1]) - len(engine.prompts[0])])
    assert ep.transcript[0]["tool_calls"][0]["function"]["name"] == "add"
    assert (env.tool_calls, env.tool_errors, env.tool_call_parse_failures) == (1, 0, 1)
    stats = envs.episode_stats([ep], [env])
    keys = episode_metrics([SimpleNamespace(episode_stats=stats)])
    assert keys["env/tool_calls"] == 1 and keys["env/tool_call_parse_failures"] == 1
    rewards_, _, unscored = task.score_episodes(task.prompts[0], [ep], [env])
    assert rewards_ == [1.0] and unscored == []
    import sys

    completions, environments = sys.modules["user_r"].SEEN[-1]
    assert environments == [env] and completions[0][-1]["content"] == "The sum is 5."
