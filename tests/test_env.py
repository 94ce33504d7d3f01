"""Multi-turn environments (tasks/envs.py, tasks/episodes.py): the --env checks, token in / token
out against the real vLLM engine (every turn's request is the sequence so far; sampled ids trained
as sampled; observations tokenized and appended), no gradient through environment tokens, exact
versions across turns and in-flight swaps, env faults that end only their episode, and the
built-in `reveal` task end to end. One engine for the module."""

import asyncio
import itertools
import os
import time

import pytest
import torch
from test_engine import (
    FORCED_A,
    FORCED_B,
    drain,
    engine_env,  # noqa: F401  (the module-scoped engine: one for this module)
    forcing_weights,
    new_generator,
    wait_until,
)

import buffer
import rollout
import train
from losses import policy_loss
from run import prepare
from run.metrics import episode_metrics
from tasks import builtin, envs
from update import completion_logprobs

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------------
# Envs the tests drive (text mode on the tiny copy model: one token per symbol)
# --------------------------------------------------------------------------------------------------
class CountingEnv:
    """Three steps; observation k is `k=`; reward 1 per step."""

    def reset(self, seed=0, **row):
        self.k = 0
        return "<bos>="

    def step(self, action):
        self.k += 1
        return f"{self.k}=", 1.0, self.k >= 3


class EndlessEnv:
    """Never done: every episode runs to --max-turns."""

    async def reset(self, **row):
        return "<bos>="

    async def step(self, action):
        return "=", 0.5, False


class FaultyEnv:
    """Episode i % 4: 0 plays three steps; 1 raises in step; 2 hangs past the timeout; 3 returns
    garbage."""

    counter = itertools.count()

    def reset(self, **row):
        self.mode, self.k = next(FaultyEnv.counter) % 4, 0
        return "<bos>="

    def step(self, action):
        self.k += 1
        if self.mode == 1:
            raise ValueError("boom\nsecond line")
        if self.mode == 2:
            time.sleep(2.0)
        if self.mode == 3:
            return "oops"
        return "=", 1.0, self.k >= 3


def env_task(monkeypatch, factory, rows=None):
    """rollout.make_task returns an env task of `factory` over seed rows."""
    rows = rows or ([{"seed": i} for i in range(64)], [{"seed": 1000 + i} for i in range(8)])
    monkeypatch.setattr(
        rollout,
        "make_task",
        lambda cfg, tokenizer, max_len=None: envs.EnvTask(cfg, tokenizer, factory, rows),
    )


class Recording:
    """The engine, with every generate request recorded: request id -> (prompt ids given, ids
    sampled, log-probs)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, params, request_id, **kwargs):
        async def stream():
            final = None
            async for out in self.engine.generate(prompt, params, request_id=request_id, **kwargs):
                final = out
                yield out
            c = final.outputs[0]
            self.calls[request_id] = (
                list(prompt["prompt_token_ids"]),
                list(c.token_ids),
                [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
            )

        return stream()


def run_until(env, gen, groups: int, timeout_s=120, during=None):
    async def scenario():
        task = asyncio.create_task(gen.run())
        if during is not None:
            await during(task)
        await wait_until(
            lambda: gen.stats.groups >= groups or task.done(), f"{groups} groups", timeout_s
        )
        if task.done():
            task.result()
        gen.control.stop.set()
        await task

    env["loop"].run_until_complete(scenario())
    return drain(gen.queue)


# --------------------------------------------------------------------------------------------------
# In-process: the checks, the loss
# --------------------------------------------------------------------------------------------------
def test_a_bad_env_is_one_error_line(tmp_path):
    bad = tmp_path / "bad_env.py"
    bad.write_text(
        "class NoReset:\n    def step(self, a): return '', 0.0, True\n"
        "class NoStep:\n    def reset(self, **row): return None\n"
        "class Fine:\n    def reset(self, **row): return 'x'\n    def step(self, a): return 'y', "
        "1.0, True\ndef make_fine():\n    return Fine()\n"
    )
    for name, expected in (
        ("NoReset", "has no reset(**row) method"),
        ("NoStep", "has neither step(action) nor public methods"),
        ("Missing", "has no 'Missing'"),
    ):
        with pytest.raises(SystemExit) as e:
            prepare.parse_args(["--env", f"{bad}:{name}"])
        assert str(e.value).startswith("error: ") and expected in str(e.value)
        assert str(e.value).count("\n") == 0
    with pytest.raises(SystemExit) as e:
        prepare.parse_args(["--env", str(tmp_path / "nope.py") + ":X"])
    assert "no such file" in str(e.value)
    for name in ("Fine", "make_fine"):
        assert prepare.parse_args(["--env", f"{bad}:{name}"]).env.endswith(name)
    with pytest.raises(SystemExit) as e:
        prepare.parse_args(["--task", "copy", "--env", f"{bad}:Fine"])
    assert "--env need" in str(e.value)


EOS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
    # Qwen-like: a turn ends with EOS
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("template", ["tiny", "eos"])
def test_observations_render_only_what_is_new(tmp_path, template):
    """Chat mode: prompt ids + the model's turn (as sampled) + the observation's ids are the
    template's rendering of the whole conversation (the tiny template has no end-of-turn token: the
    sampled <eos> is the one extra)."""
    from transformers import AutoTokenizer

    model = builtin.build_tiny_model(str(tmp_path / "ascii"), alphabet="ascii")
    tokenizer = AutoTokenizer.from_pretrained(model)
    if template == "eos":
        tokenizer.chat_template = EOS_TEMPLATE
    renderer = envs.Renderer(tokenizer)
    eos, encode = tokenizer.eos_token_id, renderer.encode
    prompt = [{"role": "user", "content": "hi"}]
    for obs in ("a hint", [{"role": "tool", "content": "42"}]):
        whole = prompt + [{"role": "assistant", "content": "ok"}] + envs.as_messages(obs)
        expected = encode(
            tokenizer.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
        )
        initial, chat = renderer.initial(prompt, None)
        assert chat and initial == encode(
            tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        )
        turn = encode("ok") + [eos]  # the turn ended by sampling <eos>
        sequence = initial + turn + renderer.observation(obs, True, eos)
        at = len(initial) + 2
        assert sequence == (
            expected if template == "eos" else expected[:at] + [eos] + expected[at:]
        )
        # a turn cut by --max-new-tokens: the template's end of turn comes from the env
        cut = encode("ok")
        assert initial + cut + renderer.observation(obs, True, cut[-1]) == expected


def test_environment_tokens_get_no_gradient(tmp_path):
    """Perturbing the final hidden states (so the logits) at environment-token positions changes
    neither the loss nor the gradient; perturbing a model-token position does."""
    from transformers import AutoModelForCausalLM

    path = builtin.build_tiny_model(str(tmp_path / "tiny"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for j in range(4):
        ids = torch.randint(3, 26, (12,), generator=gen).tolist()
        # turns of 3 model tokens, 2 env tokens between
        mask = [k % 5 not in (2, 3) for k in range(12)]
        samples.append(
            buffer.Sample([1, 12], ids, [-1.0] * 12, [0] * 12, 0.0, 1.0 - j / 2, model_mask=mask)
        )
    batch = buffer.collate(samples, pad_id=0)
    assert batch.mask.sum() == sum(sum(s.model_mask) for s in samples)
    env_positions = torch.zeros_like(batch.mask)
    for i, s in enumerate(samples):
        env_positions[i, 1 : 1 + 12] = ~torch.tensor(s.model_mask)

    def loss_and_grad(perturb=None):
        model.zero_grad()
        hook = None
        if perturb is not None:

            def shift(module, args, out):
                out.last_hidden_state[:, :-1][perturb] += 5.0
                return out

            hook = model.get_decoder().register_forward_hook(shift)
        try:
            scores = completion_logprobs(model, batch, 1.0)
        finally:
            if hook is not None:
                hook.remove()
        loss, _ = policy_loss(scores.logp, scores.logp.detach(), batch.advantages, batch.mask)
        loss.backward()
        return float(loss.detach()), torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        )

    loss, grad = loss_and_grad()
    loss_env, grad_env = loss_and_grad(env_positions)
    assert loss_env == loss and torch.equal(grad_env, grad)
    loss_model, grad_model = loss_and_grad(batch.mask)
    assert not torch.allclose(grad_model, grad)


# --------------------------------------------------------------------------------------------------
# Against the engine
# --------------------------------------------------------------------------------------------------
def test_tokens_trained_are_the_tokens_vllm_was_given_and_sampled(engine_env, monkeypatch):
    env = engine_env
    env_task(monkeypatch, CountingEnv)
    gen = new_generator(
        env,
        max_new_tokens=6,
        group_size=3,
        prompts_per_step=4,
        max_turns=5,
        max_lag=0,
        update_mode="drain",
    )
    recording = Recording(env["engine"])
    gen.engine = recording
    groups = run_until(env, gen, 4)
    tokenizer = gen.task.renderer.tokenizer
    assert len(groups) >= 4
    for group in groups:
        for j, (ids, mask, lps, versions) in enumerate(
            zip(
                group.completion_ids,
                group.model_masks,
                group.behaviour_logprobs,
                group.token_versions,
            )
        ):
            sequence, at = group.prompt_ids + ids, len(group.prompt_ids)
            # three steps of reward 1
            assert group.episode_stats["turns"][j] == 3 and group.rewards[j] == 3.0
            for turn in range(3):
                given, sampled, logprobs = recording.calls[f"group-{group.group_id}-{j}-t{turn}"]
                # each turn's request: the whole sequence so far
                assert given == sequence[: len(given)]
                # what came between: the observation `turn=`, tokenized, environment tokens
                if turn:
                    obs = tokenizer(f"{turn}=", add_special_tokens=False)["input_ids"]
                    assert sequence[at : len(given)] == obs
                    k = at - len(group.prompt_ids)
                    assert mask[k : k + len(obs)] == [False] * len(obs) and versions[
                        k : k + len(obs)
                    ] == [-1] * len(obs)
                assert sequence[len(given) : len(given) + len(sampled)] == sampled
                k = len(given) - len(group.prompt_ids)
                assert mask[k : k + len(sampled)] == [True] * len(sampled)
                assert (
                    lps[k : k + len(sampled)] == logprobs
                    and -1 not in versions[k : k + len(sampled)]
                )
                at = len(given) + len(sampled)
            assert at == len(sequence)  # the last turn ends the episode (done after the third step)
    samples = buffer.to_samples(groups, torch.zeros(len(groups), 3))
    batch = buffer.collate(samples, pad_id=0)
    assert int(batch.mask.sum()) == sum(sum(m) for g in groups for m in g.model_masks)


def test_a_swap_in_the_middle_of_episodes_keeps_every_token_version(engine_env, monkeypatch):
    env = engine_env
    env_task(monkeypatch, EndlessEnv)
    gen = new_generator(env, max_new_tokens=10, group_size=4, prompts_per_step=8, max_turns=4)
    sets = {
        FORCED_A: forcing_weights(env["path"], FORCED_A),
        FORCED_B: forcing_weights(env["path"], FORCED_B),
    }
    env["shared"].publish(sets[FORCED_A], 1)

    async def swaps(task):
        await wait_until(lambda: gen.loaded_version >= 1 or task.done(), "the first weight load")
        version, deadline = 1, time.monotonic() + 5
        while time.monotonic() < deadline or gen.stats.groups < 6:
            await asyncio.sleep(0.03)
            version += 1
            env["shared"].publish(sets[FORCED_A if version % 2 else FORCED_B], version)
            if task.done():
                break

    groups = run_until(env, gen, 6, during=swaps)
    checked = spanning = 0
    for group in groups:
        for ids, mask, versions, turns in zip(
            group.completion_ids,
            group.model_masks,
            group.token_versions,
            group.episode_stats["turns"],
        ):
            assert turns == 4 and len(ids) == len(mask) == len(versions)
            model_versions = [v for v, m in zip(versions, mask) if m]
            assert all(v == -1 for v, m in zip(versions, mask) if not m)
            for token, v, m in zip(ids, versions, mask):
                if m and v >= 1:
                    assert token == (FORCED_A if v % 2 else FORCED_B), f"token {token} tagged v{v}"
                    checked += 1
            spanning += len(set(model_versions)) > 1
    assert checked > 500
    assert spanning > 0, "no episode spanned a weight swap"


def test_a_faulty_env_ends_only_its_episode(engine_env, monkeypatch):
    env = engine_env
    env_task(monkeypatch, FaultyEnv)
    FaultyEnv.counter = itertools.count()
    gen = new_generator(
        env,
        max_new_tokens=4,
        group_size=4,
        prompts_per_step=2,
        max_turns=5,
        env_timeout_s=0.5,
        # one group at a time: episode j of each group has mode j
        max_inflight_groups=1,
    )
    groups = run_until(env, gen, 3)
    assert len(groups) >= 3
    for group in groups:
        stats = group.episode_stats
        assert stats["turns"] == [3, 1, 1, 1]
        assert stats["errors"] == 2 and stats["timeouts"] == 1
        # the mean
        assert (
            group.unscored == [1, 2, 3]
            and group.rewards[0] == 3.0
            and group.rewards[1:] == [3.0] * 3
        )
        assert any(line == "step raised ValueError: boom" for line in stats["error_lines"])
        assert any("timed out after 0.5 s" in line for line in stats["error_lines"])
        assert any("step returned str" in line for line in stats["error_lines"])
    metrics = episode_metrics(groups)
    assert metrics["env/errors"] == 2 * len(groups) and metrics["env/timeouts"] == len(groups)


def test_the_reveal_task_runs_end_to_end(tmp_path):
    """`--task reveal` through train.py: episodes, evaluation of episodes, the env/... metrics."""
    out = tmp_path / "run"
    code = train.main(
        [
            "--task",
            "reveal",
            "--steps",
            "3",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--eval-prompts",
            "4",
            "--eval-samples",
            "2",
            "--out",
            str(out),
            "--kv-cache-mb",
            "64",
        ]
    )
    assert code == 0
    import json

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 3
    assert all(1 <= r["env/turns_mean"] <= 4 and 0 < r["env/token_frac"] < 1 for r in rows)
    assert rows[-1]["eval/prompts"] == 4 and "eval/turns_mean" in rows[-1]
    assert os.path.exists(out / "plots.png")


def test_a_step_whose_every_episode_faulted_is_warned_about():
    from run.metrics import all_faults_warning

    row = {
        "step": 3,
        "env/errors": 6,
        "env/timeouts": 2,
        "env/error": "step raised ValueError: boom",
    }
    warning = all_faults_warning(row, 8)
    assert warning.startswith("warning: every episode of step 3") and "boom" in warning
    assert all_faults_warning(row, 9) is None and all_faults_warning({"step": 0}, 8) is None


def test_stale_tokens_are_masked_not_their_group(monkeypatch):
    """--stale-rule tokens keeps the group of a long sample whose first tokens are too old and masks
    exactly those; --stale-rule group drops it. Either way no trained token is older
    than --max-lag."""
    import queue

    # sample 0: 6 tokens from versions 3..5 (2 env tokens in between), sample 1: fresh
    def group(gid):
        return buffer.RolloutGroup(
            gid,
            [1, 12],
            [[13] * 8, [14] * 2],
            [[-0.5] * 8, [-0.5] * 2],
            [[3, 3, -1, -1, 4, 4, 5, 5], [5, 5]],
            [1.0, 0.0],
            model_masks=[[True, True, False, False, True, True, True, True], [True, True]],
        )

    for rule, kept in (("tokens", 1), ("group", 0)):
        q = queue.Queue()
        for gid in range(2):
            q.put(group(gid))
        taken = (
            buffer.take_groups(q, 1, trainer_version=5, max_lag=1, timeout_s=0.5, stale_rule=rule)
            if kept
            else None
        )
        if not kept:
            with pytest.raises(TimeoutError):  # both groups dropped: none to fill the step
                buffer.take_groups(
                    q, 1, trainer_version=5, max_lag=1, timeout_s=0.5, stale_rule=rule
                )
            continue
        assert taken.groups_dropped == 0 and taken.stale["len"]["4"] == [1, 0, 6, 2, 0]
        batch = buffer.collate(buffer.to_samples(taken.groups, torch.zeros(1, 2)), pad_id=0)
        stale = buffer.stale_mask(batch, 5, 1)
        assert int(stale.sum()) == 2 and bool(stale[0, 1:3].all())  # the two version-3 tokens
        batch.mask &= ~stale
        assert buffer.staleness_stats(batch, 5)["lag_max"] <= 1 and int(batch.mask.sum()) == 6
    assert buffer.sample_lag(5, [-1, 4, 5]) == 1  # environment tokens have no age
