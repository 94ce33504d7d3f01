"""Held-out evaluation and stop strings on the real engine (one vLLM engine for the module, the tiny
ASCII model, rollout.Generator driven directly as in test_engine.py): evaluation answers never
reach the training queue, and a weight load published mid-evaluation waits for it (--eval-weights
fixed) or lands during it (the default); the start's evaluation holds up neither the trainer nor
training; stop strings end generation, the reward sees the text before the stop and the trainer's
mask covers exactly the tokens vLLM returned.
"""

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from test_data import write_jsonl
from test_engine import drain
from test_eval import settings_for

import buffer
import rollout
from infra import processes
from run import prepare
from tasks import evaluation

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine_env(ascii_model, tmp_path_factory):
    import torch.multiprocessing as mp

    os.environ["PYTHONPATH"] = str(REPO)
    shared = prepare.allocate_shared_weights(ascii_model)
    ctx = mp.get_context("spawn")
    builder = rollout.Generator(
        settings_for(ascii_model), shared, ctx.Queue(), processes.make_control(ctx)
    )
    engine = builder.build_engine()
    loop = asyncio.new_event_loop()
    yield {
        "path": ascii_model,
        "shared": shared,
        "engine": engine,
        "loop": loop,
        "ctx": ctx,
        "tmp": tmp_path_factory.mktemp("engine_data"),
    }
    engine.shutdown()
    builder.engine = engine = None
    # see test_engine.py: vLLM's output handler must finish cancelling
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (gather of nothing would make a future on another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def new_generator(env, **changes):
    gen = rollout.Generator(
        settings_for(env["path"], **changes),
        env["shared"],
        env["ctx"].Queue(),
        processes.make_control(env["ctx"]),
    )
    gen.engine = env["engine"]
    return gen


async def wait_until(condition, what, task, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if task.done():
            task.result()  # the generator failed: show why
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def perturbed_weights(model_path, scale=0.05):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(2)
    return {name: p.detach() + torch.randn_like(p) * scale for name, p in model.named_parameters()}


@pytest.mark.parametrize("eval_weights", ["fixed", "inflight"])
def test_evaluation_answers_never_reach_the_training_queue(engine_env, eval_weights, monkeypatch):
    """Evaluation answers come back on their own queue; a weight load published mid-evaluation
    waits for it under --eval-weights fixed, and lands during it by default (the answer names the
    versions at its start and end)."""
    env = engine_env
    gate, real_eval_prompt = [], evaluation.eval_prompt

    async def held_back(*args):
        while not gate:
            await asyncio.sleep(0.01)
        return await real_eval_prompt(*args)

    # the first evaluation's prompts wait for the gate: a load published now finds it in flight
    monkeypatch.setattr(evaluation, "eval_prompt", held_back)
    train_file = write_jsonl(
        env["tmp"] / "train.jsonl", [{"prompt": f"train {i}:", "answer": "1"} for i in range(10)]
    )
    held_file = write_jsonl(
        env["tmp"] / "held.jsonl", [{"prompt": f"held {i}:", "answer": "1"} for i in range(9)]
    )
    gen = new_generator(
        env,
        dataset=train_file,
        eval_dataset=held_file,
        reward="math",
        eval_prompts=6,
        eval_samples=3,
        max_new_tokens=8,
        eval_weights=eval_weights,
    )
    new_weights = perturbed_weights(env["path"])
    old = env["shared"].version()
    new = old + 1
    answers = []

    async def scenario():
        task = asyncio.create_task(gen.run())
        await wait_until(
            lambda: gen.control.ready.is_set() and gen.stats.groups >= 2, "training groups", task
        )
        # (the module's engine keeps the weights an earlier test published)
        await wait_until(lambda: gen.loaded_version == old, "the newest weights", task)
        evaluation.request(gen.control, 0, old)
        await wait_until(lambda: gen.eval_task is not None, "the evaluation to start", task)
        env["shared"].publish(new_weights, new)
        if eval_weights == "fixed":  # published mid-evaluation: loaded only once it is done
            await wait_until(lambda: gen.stats.groups >= 4, "more training groups", task)
            assert gen.loaded_version == old and gen.eval_task is not None
            gate.append(True)
            while gen.eval_task is not None:
                assert gen.loaded_version == old, "weights loaded while an evaluation was in flight"
                await asyncio.sleep(0.002)
        else:  # loaded while the evaluation waits at the gate
            await wait_until(lambda: gen.loaded_version == new, "the load", task)
            assert gen.eval_task is not None
            gate.append(True)
        await wait_until(lambda: gen.loaded_version == new, "the load", task)
        evaluation.request(gen.control, 5, new)
        await wait_until(
            lambda: len(answers.__iadd__(evaluation.collect(gen.control))) >= 2, "two answers", task
        )
        gen.control.stop.set()
        await task

    env["loop"].run_until_complete(scenario())
    groups = drain(gen.queue)
    train_ids = {tuple(p.prompt_ids) for p in gen.task.prompts}
    held_ids = {tuple(p.prompt_ids) for p in gen.task.held_out}
    assert len(held_ids) == 9 and not train_ids & held_ids
    assert len(groups) >= 2 and all(tuple(g.prompt_ids) in train_ids for g in groups)
    # only training groups, in id order
    assert sorted(g.group_id for g in groups) == list(range(len(groups)))
    first, second = answers
    assert (first.step, first.version, second.step, second.version) == (0, old, 5, new)
    assert (first.last_version, second.last_version) == (
        old if eval_weights == "fixed" else new,
        new,
    )
    for answer in answers:
        assert len(answer.rewards) == 6 and all(len(r) == 1 + 3 for r in answer.rewards)
        assert answer.tokens > 0
    assert gen.stats.eval_tokens == first.tokens + second.tokens
    # eval tokens apart
    assert gen.stats.tokens == sum(len(ids) for g in groups for ids in g.completion_ids)


def test_stop_strings_end_generation_and_reach_the_reward_and_the_mask(engine_env, tokenizer):
    env = engine_env
    (env["tmp"] / "capture_rewards.py").write_text(
        "SEEN = []\ndef capture(completions, completion_ids, **kwargs):\n"
        "    SEEN.extend(zip(completions, map(tuple, completion_ids)))\n"
        "    return [0.0] * len(completions)\n"
    )
    prompts = write_jsonl(
        env["tmp"] / "stop_prompts.jsonl",
        [{"prompt": f"say {i}:", "answer": "1"} for i in range(6)],
    )
    stops = ("a", "e", "i", "o", "u", "X", "Q7")  # a random-init model hits one every ~16 tokens
    gen = new_generator(
        env,
        dataset=prompts,
        reward=str(env["tmp"] / "capture_rewards.py") + ":capture",
        stop=stops,
        max_new_tokens=40,
    )

    async def scenario():
        task = asyncio.create_task(gen.run())
        await wait_until(lambda: gen.stats.groups >= 8, "8 groups", task)
        gen.control.stop.set()
        await task

    env["loop"].run_until_complete(scenario())
    seen = dict((ids, text) for text, ids in sys.modules["user_capture_rewards"].SEEN)
    groups = drain(gen.queue)
    tok = tokenizer
    stopped = 0
    for group in groups:
        for ids in group.completion_ids:
            full = tok.decode(ids, skip_special_tokens=True)
            text = seen[tuple(ids)]  # what the reward function was given
            ended = [s for s in stops if full.endswith(s) and text == full[: -len(s)]]
            if ended:
                stopped += 1
                first_end = min(full.find(s) + len(s) for s in stops if s in full)
                assert first_end == len(full), f"generation ran past a stop string: {full!r}"
            else:  # ended by <eos> or the length limit, with no stop string in it
                assert text == full and not any(s in full for s in stops), (full, text)
                assert ids[-1] == tok.eos_token_id or len(ids) == 40
    samples = buffer.to_samples(groups, torch.zeros(len(groups), 4))
    # the rest ended with <eos> (or at 40 tokens)
    assert stopped >= len(samples) // 2 and len(samples) >= 32
    # the trainer trains exactly the token ids vLLM returned (the stop string's tokens included)
    batch = buffer.collate(samples, pad_id=tok.pad_token_id)
    assert batch.mask.sum(1).tolist() == [len(s.completion_ids) for s in samples]
    for row, s in enumerate(samples):
        assert batch.targets[row][batch.mask[row]].tolist() == s.completion_ids
    for group in groups:  # and vLLM's log-probs and versions cover the same tokens
        assert [len(x) for x in group.behaviour_logprobs] == [len(x) for x in group.completion_ids]
        assert [len(x) for x in group.token_versions] == [len(x) for x in group.completion_ids]


def test_the_start_evaluation_holds_up_neither_the_trainer_nor_training(engine_env, monkeypatch):
    """The trainer waits for the engine, not for the held-out evaluation of the start (a long one
    ended real-model runs at --timeout-s): with that evaluation held back, the generator is ready
    and training groups flow; let go, it answers for step 0 on the start's weights."""
    env = engine_env
    held, gate, real_run_eval = [], [], rollout.run_eval

    async def held_back(gen, step):
        held.append(step)
        while not gate:
            await asyncio.sleep(0.01)
        await real_run_eval(gen, step)

    monkeypatch.setattr(rollout, "run_eval", held_back)
    gen = new_generator(env, eval_at_start=True, eval_prompts=3, eval_samples=1)
    answers = []

    async def scenario():
        task = asyncio.create_task(gen.run())
        await wait_until(lambda: held == [0], "the start's evaluation to begin", task)
        await wait_until(
            lambda: gen.control.ready.is_set() and gen.stats.groups >= 2, "training groups", task
        )
        assert gen.eval_task is not None and not evaluation.collect(gen.control)
        gate.append(True)
        await wait_until(
            lambda: len(answers.__iadd__(evaluation.collect(gen.control))) >= 1, "its answer", task
        )
        gen.control.stop.set()
        await task

    env["loop"].run_until_complete(scenario())
    drain(gen.queue)
    # (on the weights loaded when it began: the module's engine may have newer ones than version 0)
    assert [a.step for a in answers] == [0] and len(answers[0].rewards) == 3
    assert answers[0].version == answers[0].last_version == gen.loaded_version
