"""Chat templates and tool-call formats as their makers ship them (tests/shipped.py: pinned npm
packages).

- Three-turn chat episodes on the shipped Qwen3, Qwen2.5, Llama 3.1 and Gemma 3 templates (a
  scripted engine samples real token ids, each turn ended by the family's stop id): no environment
  error, every turn's request is the sequence so far, the sampled ids sit in the sequence as
  sampled, position by position, and what lies between them is the template's own end of turn,
  observation and generation prompt. On the templates that do not rewrite history, the whole
  sequence is the template's rendering of the whole conversation.
- Tool calls in each family's own format, read by vLLM's parsers: Qwen3's Hermes `<tool_call>` JSON
  after its think block (the qwen3 reasoning parser, chosen from the template), Llama 3.x's bare
  JSON with "parameters" (and `<|python_tag|>` ... `<|eom_id|>`); results in the template's tool
  role. (qwen3_coder calls, reasoning first, prompts as the dataset renders them:
  test_agent_turns.py.)
- The checks made before a run: --tools refused in one line where the shipped template renders no
  tools (Llama 3.1's package, Gemma 3), no parser reads it (the probe's integer argument typed), or
  the parser's format has no call marker; a bad --tool-parser, --reasoning-parser, --chat-template
  or --chat-template-kwargs is one `error:` line; a template that cannot be extended turn by turn is
  refused, naming the way out.
- --chat-template-kwargs '{"enable_thinking": false}' reaches Qwen3's prompts and episodes.
- One real vLLM engine on a tiny Qwen3 with its real vocabulary (151,936): three-turn episodes,
  tokens as sampled.
"""

import asyncio
import contextlib
import inspect
import json
from types import SimpleNamespace

import pytest
from shipped import build_model
from test_tools import add  # the tool the calls below call

import config
from run import prepare
from tasks import chat, envs, episodes, tools

THINK = "<think>\nLet me see.\n</think>\n\n"


class ChatEnv:
    """Three steps; each observation a user message; done after the third."""

    def reset(self, **row):
        self.k = 0
        return [{"role": "user", "content": "Guess a number from 1 to 9."}]

    def step(self, action):
        self.k += 1
        return [{"role": "user", "content": f"Not {self.k}; try again."}], 0.0, self.k >= 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> a tiny random-init model directory with the shipped tokenizer (built on first
    use)."""
    root, built = tmp_path_factory.mktemp("shipped"), {}

    def get(name):
        if name not in built:
            built[name] = build_model(name, str(root / name))
        return built[name]

    return get


class ScriptedEngine:
    """Stands in for vLLM: each request samples the next scripted text, encoded with the real
    tokenizer and ended by `stop` (the family's end-of-turn id), tagged version 0; records the
    prompt ids it was given."""

    def __init__(self, tokenizer, turns, stop):
        self.tokenizer, self.turns, self.prompts, self.sampled = tokenizer, list(turns), [], []
        self.stop = stop

    def generate(self, ids, params, request_id):
        self.prompts.append(list(ids))
        text = self.turns.pop(0)
        stop = self.stop if isinstance(self.stop, int) else self.stop.pop(0)
        sampled = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
        self.sampled.append(sampled)
        out = SimpleNamespace(
            token_ids=sampled,
            text=text,
            finish_reason="stop",
            logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in sampled],
            weight_versions=[SimpleNamespace(start=0, end=len(sampled), version=0)],
        )

        async def stream():
            yield SimpleNamespace(outputs=[out])

        return stream()


def episode(cfg, tokenizer, factory, prompt_row, turns, stop):
    """One episode through episodes.run_episode on a scripted engine: (episode, engine, env)."""
    task = envs.EnvTask(cfg, tokenizer, factory, rows=([prompt_row], [prompt_row]))
    engine = ScriptedEngine(tokenizer, turns, stop)
    gen = SimpleNamespace(
        cfg=cfg,
        task=task,
        max_model_len=4096,
        request_params=lambda **k: k,
        generating_request=contextlib.nullcontext,
        generate=engine.generate,
    )
    env = task.factory()
    episode = asyncio.run(episodes.run_episode(gen, env, task.prompts[0], episodes.Turns({}, "t")))
    return episode, engine, env


def tokens_are_as_sampled(ep, engine):
    """Every turn's request is the whole sequence so far; the sampled ids sit in it as sampled; the
    model mask marks exactly them."""
    assert [t for t, m in zip(ep.ids[ep.start :], ep.model_mask) if m] == sum(engine.sampled, [])
    at = ep.start
    for given, sampled in zip(engine.prompts, engine.sampled):
        assert given == ep.ids[: len(given)] and len(given) >= at
        assert ep.ids[len(given) : len(given) + len(sampled)] == sampled
        # the observation: no loss
        assert not any(ep.model_mask[at - ep.start : len(given) - ep.start])
        assert all(ep.model_mask[len(given) - ep.start : len(given) + len(sampled) - ep.start])
        at = len(given) + len(sampled)
    assert at == len(ep.ids)


# family -> (the stop id a turn ends with, whether the template renders history as it was sampled)
CHAT_FAMILIES = {
    "qwen3": (151_645, False),
    "qwen2_5": (151_645, True),
    "llama3_1": (128_009, True),
    "gemma3": (106, True),
}


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_three_turn_chat_episodes_run_on_the_shipped_templates(family, models):
    path = models(family)
    tokenizer = chat.load_tokenizer(path)
    stop, keeps_history = CHAT_FAMILIES[family]
    cfg = config.Config(model=path, max_turns=5, max_new_tokens=64, system_prompt="Be brief.")
    said = [(THINK if family == "qwen3" else "") + "5", "3", "7"]
    ep, engine, _ = episode(cfg, tokenizer, ChatEnv, {"prompt": "Let us play."}, said, stop)
    assert not ep.error and ep.turns == 3 and ep.reward == 0.0, (ep.error, ep.turns)
    tokens_are_as_sampled(ep, engine)
    text = tokenizer.decode(ep.ids)
    assert all(f"Not {k}; try again." in text for k in (1, 2)) and "Be brief." in text
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Let us play."},
        {"role": "user", "content": "Guess a number from 1 to 9."},
    ]
    for k, answer in enumerate(said):
        conversation.append({"role": "assistant", "content": answer})
        if k < 2:
            conversation.append({"role": "user", "content": f"Not {k + 1}; try again."})
    if family == "gemma3":  # strict alternation: the prompt and reset's message are one user turn
        conversation[1:3] = [
            {"role": "user", "content": "Let us play.\n\nGuess a number from 1 to 9."}
        ]
    # the whole sequence is the template's rendering of the whole conversation (less the
    if keeps_history:
        expected = renderer_ids(tokenizer, conversation)  # separator it writes after the last turn)
        assert (
            ep.ids == expected[: len(ep.ids)]
            and tokenizer.decode(expected[len(ep.ids) :]).strip() == ""
        )
    # Qwen3 rewrites history; between the turns lies
    # exactly its end of turn, the user turn, its prompt
    else:
        between = tokenizer.decode(
            ep.ids[len(engine.prompts[0]) + len(engine.sampled[0]) : len(engine.prompts[1])]
        )
        assert between == "\n<|im_start|>user\nNot 1; try again.<|im_end|>\n<|im_start|>assistant\n"
        with pytest.raises(RuntimeError):  # what the old renderer did on every episode
            old_prefix_rule(tokenizer)


def renderer_ids(tokenizer, conversation):
    # no generation prompt: ends on a turn
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def old_prefix_rule(tokenizer):
    """The renderer before shipped templates were tested: the dummy conversation ending on the
    assistant turn had to be a prefix of the one with the observation."""
    base = chat.render(tokenizer, chat.Renderer.DUMMY, False)
    full = chat.render(tokenizer, chat.Renderer.DUMMY + [{"role": "user", "content": "o"}], True)
    cut = base.rfind(chat.Renderer.MARK) + len(chat.Renderer.MARK)
    if full[:cut] != base[:cut]:
        raise RuntimeError(
            "the chat template renders the conversation differently once an observation follows"
        )


def tool_cfg(path, tmp_path, **changes):
    (tmp_path / "fns.py").write_text(inspect.getsource(add))
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"}) + "\n"
    )
    return config.Config(
        model=path,
        dataset=str(tmp_path / "rows.jsonl"),
        tools=f"{tmp_path / 'fns.py'}:add",
        reward="math",
        max_turns=4,
        max_new_tokens=64,
        group_size=1,
        **changes,
    )


# family -> (the turn that calls add(2, 3), its stop ids, the observation's text after the call)
TOOL_FORMATS = {
    "qwen3": (
        THINK + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        [151_645, 151_645],
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "llama3_2": (
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        [128_009, 128_009],
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "llama3_2-python-tag": (
        '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
        [128_008, 128_009],
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}


@pytest.mark.parametrize("case", TOOL_FORMATS)
def test_a_tool_call_round_trips_in_the_familys_own_format(case, models, tmp_path):
    family = case.split("-")[0]
    path = models(family)
    cfg = tool_cfg(path, tmp_path)
    # the template renders tools, and vLLM's parser reads its calls
    prepare.check_tokenizer(path, cfg)
    tokenizer = chat.load_tokenizer(path)
    assert (
        tools.parser_name("", tokenizer.chat_template)
        == {"qwen3": "hermes", "llama3_2": "llama3_json"}[family]
    )
    call, stops, observation = TOOL_FORMATS[case]
    ep, engine, env = episode(
        cfg,
        tokenizer,
        None,
        {"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"},
        [call, (THINK if family == "qwen3" else "") + "It is 5."],
        list(stops),
    )
    assert not ep.error and ep.turns == 2, ep.error
    assert (env.tool_calls, env.tool_call_parse_failures, env.tool_errors) == (1, 0, 0)
    tokens_are_as_sampled(ep, engine)
    first = tokenizer.decode(engine.prompts[0])
    assert '"name": "add"' in first  # the schema, rendered into the prompt by the template
    between = tokenizer.decode(
        ep.ids[len(engine.prompts[0]) + len(engine.sampled[0]) : len(engine.prompts[1])]
    )
    assert between == observation  # the result in the template's own tool role (Llama: ipython)
    assert ep.transcript[0]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": {"a": 2, "b": 3},
    }
    assert ep.transcript[-1]["content"].strip() == "It is 5."


def test_bad_calls_in_a_familys_format_are_counted_and_shown_to_the_model(models, tmp_path):
    path = models("qwen3")
    tokenizer = chat.load_tokenizer(path)
    parser, schemas = tools.ToolCallParser("hermes", tokenizer), tools.tool_schemas([add])
    assert parser.parse(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', schemas
    ) == ([{"name": "add", "arguments": {"a": 1}}], [])
    calls, failures = parser.parse(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', schemas
    )
    assert calls == [] and len(failures) == 1 and "hermes" in failures[0]
    assert parser.parse("The answer is 5.", schemas) == ([], [])
    llama = tools.ToolCallParser("llama3_json", chat.load_tokenizer(models("llama3_2")))
    assert llama.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', schemas) == (
        [{"name": "add", "arguments": {"a": 1, "b": 2}}],
        [],
    )
    assert len(llama.parse('{"name": "add", "parameters": {"a": 1', schemas)[1]) == 1  # cut
    cfg = tool_cfg(path, tmp_path)
    ep, _, env = episode(
        cfg,
        tokenizer,
        None,
        {"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"},
        ['<tool_call>\n{"name": "add", "arguments": {"a": 2\n</tool_call>', "5"],
        151_645,
    )
    assert (
        not ep.error and ep.turns == 2 and (env.tool_calls, env.tool_call_parse_failures) == (0, 1)
    )
    # the model sees what went wrong
    assert "could not parse a tool call" in tokenizer.decode(ep.ids)


def error_line(call):
    with pytest.raises(SystemExit) as exc:
        call()
    message = str(exc.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_tools_are_refused_in_one_line_where_no_format_or_parser_fits(models, tmp_path):
    for family, reason in (
        ("llama3_1", "does not render tools"),
        ("gemma3", "does not render tools"),
    ):
        path = models(family)
        assert reason in error_line(lambda: prepare.check_tokenizer(path, tool_cfg(path, tmp_path)))
    path = models("qwen3")
    message = error_line(
        lambda: prepare.check_tokenizer(path, tool_cfg(path, tmp_path, tool_parser="nope"))
    )
    assert "no tool parser of that name" in message and "hermes" in message
    message = error_line(
        lambda: prepare.check_tokenizer(path, tool_cfg(path, tmp_path, tool_parser="qwen3_coder"))
    )
    assert "does not read the tool calls" in message
    # a format without a call marker: a malformed call could not be told from an answer
    message = error_line(
        lambda: prepare.check_tokenizer(path, tool_cfg(path, tmp_path, tool_parser="pythonic"))
    )
    assert "no start marker" in message
    message = error_line(
        lambda: prepare.check_tokenizer(path, tool_cfg(path, tmp_path, reasoning_parser="nope"))
    )
    assert "--reasoning-parser 'nope'" in message and "qwen3" in message
    # the right one passes
    prepare.check_tokenizer(path, tool_cfg(path, tmp_path, tool_parser="hermes"))


def test_a_bad_chat_template_or_its_arguments_is_one_error_line(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    cases = {
        "--chat-template nowhere.jinja": "cannot read it",
        f"--chat-template {bad}": "Jinja syntax error",
        "--chat-template-kwargs {not json": "not JSON",
        "--chat-template-kwargs [1]": "a JSON object",
        "--tool-parser hermes": "needs --tools",
        "--reasoning-parser qwen3": "needs --tools",
    }
    for flags, reason in cases.items():
        flag, value = flags.split(" ", 1)
        assert reason in error_line(lambda: prepare.parse_args([flag, value]))


def test_a_template_that_cannot_be_extended_turn_by_turn_is_refused_before_the_run(
    models, tmp_path
):
    path = models("qwen2_5")
    # drops every assistant turn but the last, once a user message follows it
    dropping = tmp_path / "dropping.jinja"
    dropping.write_text(
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role "
        "}}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg = config.Config(
        model=path,
        env="tasks/examples/guess_env.py:GuessEnv",
        dataset="tasks/examples/guess_rows.jsonl",
        chat_template=str(dropping),
    )
    message = error_line(lambda: prepare.check_tokenizer(path, cfg))
    assert "--chat-template FILE" in message and "assistant turn" in message
    # its own is fine
    prepare.check_tokenizer(path, config.Config(model=path, env=cfg.env, dataset=cfg.dataset))


def test_chat_template_kwargs_reach_prompts_and_episodes(models, tmp_path):
    """Qwen3 with enable_thinking false: the generation prompt carries the empty think block that
    tells the model to answer without thinking, in dataset prompts and episodes alike; without the
    argument it does not."""
    from tasks import prompts

    path = models("qwen3")
    (tmp_path / "my.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    for kwargs, ends in (
        ("", "<|im_start|>assistant\n"),
        ('{"enable_thinking": false}', "<think>\n\n</think>\n\n"),
    ):
        tokenizer = chat.load_tokenizer(path, "", kwargs)
        hi = [{"role": "user", "content": "hi"}]
        prompt = tokenizer.decode(prompts.encode_prompt(tokenizer, hi))
        assert prompt.endswith(ends) and (("<think>" in prompt) == bool(kwargs)), prompt
        ids, _ = envs.Renderer(tokenizer).initial([{"role": "user", "content": "hi"}], None)
        assert tokenizer.decode(ids) == prompt
        after = tokenizer.decode(envs.Renderer(tokenizer).observation("more", True, 151_645))
        assert after.endswith(ends) and ("<think>" in after) == bool(kwargs)
    # --chat-template replaces the model's
    tokenizer = chat.load_tokenizer(path, str(tmp_path / "my.jinja"))
    hi = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(prompts.encode_prompt(tokenizer, hi)) == "[user] hi\n[assistant]"


# --------------------------------------------------------------------------------------------------
# The real engine: vLLM serves a tiny Qwen3 with its real
# vocabulary; the Generator runs chat episodes on it
# -----------------------------------------------------------------------------------------------
def test_vllm_runs_three_turn_qwen3_episodes_token_in_token_out(models, monkeypatch):
    import os

    import torch
    import torch.multiprocessing as mp
    from test_engine import drain, settings_for, wait_until
    from test_env import Recording

    import buffer
    import rollout
    from infra import processes

    path = models("qwen3")
    os.environ["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = (
        [{"prompt": "Let us play.", "seed": i} for i in range(8)],
        [{"prompt": "Let us play.", "seed": 99}],
    )
    monkeypatch.setattr(
        rollout,
        "make_task",
        lambda cfg, tokenizer, max_len=None: envs.EnvTask(cfg, tokenizer, ChatEnv, rows),
    )
    settings = settings_for(
        path,
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=6,
        max_turns=5,
        max_lag=0,
        update_mode="drain",
        kv_cache_mb=64,
        env="tasks/examples/guess_env.py:GuessEnv",
    )
    ctx = mp.get_context("spawn")
    gen = rollout.Generator(
        settings, prepare.allocate_shared_weights(path), ctx.Queue(), processes.make_control(ctx)
    )
    engine = gen.build_engine()
    recording, loop = Recording(engine), asyncio.new_event_loop()
    try:
        gen.engine = recording

        async def scenario():
            task = asyncio.create_task(gen.run())
            await wait_until(lambda: gen.stats.groups >= 2 or task.done(), "2 groups", 240)
            if task.done():
                task.result()
            gen.control.stop.set()
            await task

        loop.run_until_complete(scenario())
        groups = drain(gen.queue)
    finally:
        engine.shutdown()
        # no second shutdown from AsyncLLM.__del__ at exit
        gen.engine = recording.engine = engine = None
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:  # (gather of nothing would make a future on another loop)
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
    tokenizer = gen.task.renderer.tokenizer
    assert len(groups) >= 2 and all(g.episode_stats["errors"] == 0 for g in groups)
    for group in groups:
        for j, (ids, mask, lps) in enumerate(
            zip(group.completion_ids, group.model_masks, group.behaviour_logprobs)
        ):
            sequence = group.prompt_ids + ids
            assert group.episode_stats["turns"][j] == 3
            for turn in range(3):
                given, sampled, logprobs = recording.calls[f"group-{group.group_id}-{j}-t{turn}"]
                assert given == sequence[: len(given)]
                # the tokens as sampled
                assert sequence[len(given) : len(given) + len(sampled)] == sampled
                k = len(given) - len(group.prompt_ids)
                assert all(mask[k : k + len(sampled)]) and lps[k : k + len(sampled)] == logprobs
            assert (
                "<|im_start|>user\nNot 2; try again.<|im_end|>\n<|im_start|>assistant\n"
                in tokenizer.decode(sequence)
            )
    batch = buffer.collate(buffer.to_samples(groups, torch.zeros(len(groups), 2)), pad_id=0)
    assert int(batch.mask.sum()) == sum(sum(m) for g in groups for m in g.model_masks)
