"""Held-out evaluation, the copy task's held-out split, epochs, --max-prompt-tokens, Hugging Face
datasets checked before start, and stop strings (issue 15).

Fast tests (no engine): the pass@k estimator against brute-force enumeration, the copy task's fixed
split, the epoch walk, long prompts dropped up front, datasets written by `datasets` (save_to_disk,
a folder of Parquet files) with their test split, and an unknown hub name failing in one line before
anything starts. Real-engine tests (one vLLM engine for the module, the tiny ASCII model,
rollout.Generator driven directly as in test_engine.py): evaluation answers never reach the training
queue and keep their weights; stop strings end generation, the reward sees the text before the stop
and the trainer's mask covers exactly the tokens vLLM returned.
"""

import asyncio
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_data import write_jsonl
from test_engine import drain
from test_engine import settings_for as engine_settings

import buffer
import devices
import evaluation
import prepare
import processes
import rollout
from tasks import builtin, prompts

REPO = Path(__file__).resolve().parent.parent


def settings_for(model, **changes):
    return engine_settings(
        model,
        **{
            **dict(
                group_size=4, prompts_per_step=4, max_new_tokens=24, max_lag=10**6, kv_cache_mb=128
            ),
            **changes,
        },
    )


# ---- the estimator -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,c,k", [(5, 2, 1), (5, 2, 2), (5, 2, 4), (8, 0, 3), (8, 8, 2), (10, 3, 5), (6, 5, 2)]
)
def test_pass_at_k_is_the_mean_over_all_k_subsets(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    brute = sum(any(s) for s in subsets) / len(subsets)
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_eval_summary_keys():
    assert evaluation.ks_for(0) == [] and evaluation.ks_for(1) == [1]
    assert evaluation.ks_for(4) == [1, 2, 4] and evaluation.ks_for(6) == [1, 2, 4, 6]
    # 3 prompts: greedy rewards 1, 0.5, 0; 4 samples each
    rewards = [[1.0, 1, 0, 0, 1], [0.5, 0, 0, 0, 0], [0.0, 1, 1, 1, 1]]
    result = evaluation.EvalResult(step=50, version=49, rewards=rewards, time_s=0.5, tokens=60)
    keys = evaluation.summarize(result, pass_reward=1.0)
    assert (keys["eval/step"], keys["eval/version"], keys["eval/prompts"]) == (50, 49, 3)
    # only the first greedy completion passes
    assert keys["eval/greedy_pass@1"] == pytest.approx(1 / 3)
    assert keys["eval/greedy_reward"] == pytest.approx(0.5)
    assert keys["eval/reward"] == pytest.approx(6 / 12)
    assert keys["eval/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert keys["eval/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert evaluation.summarize(result, pass_reward=0.5)["eval/greedy_pass@1"] == pytest.approx(
        2 / 3
    )
    empty = evaluation.summarize(evaluation.EvalResult(0, 0, []))
    assert empty["eval/prompts"] == 0 and empty["eval/greedy_pass@1"] is None


# ---- the copy task's held-out split, and the walk ------------------------------------------------
def test_no_training_prompt_of_the_copy_task_is_held_out(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin.build_tiny_model(str(tmp_path / "copy")))
    task, again = builtin.CopyTask(tok), builtin.CopyTask(tok)
    train_set = {p.answer for p in task.prompts}
    held = [p.answer for p in task.held_out]
    assert not train_set & set(held)
    assert len(train_set) + len(held) == len(builtin.LETTERS) ** builtin.COPY_LENGTH
    assert len(set(held)) == len(held)
    assert 50 <= len(held) <= 150  # ~10%
    # a function of the task alone, in a fixed order
    assert held == [p.answer for p in again.held_out]
    assert all(tok.decode(p.prompt_ids) == f"<bos>{p.answer}=" for p in task.held_out[:5])
    # every group the generator starts, over several epochs, takes a training prompt
    walked = {
        task.prompts[prompts.walk(g, len(task.prompts), seed=7)[1]].answer
        for g in range(3 * len(task.prompts))
    }
    assert walked == train_set


def test_the_walk_covers_every_row_once_per_epoch_and_a_resume_continues_it():
    n, seed = 37, 3
    epochs = [[prompts.walk(g, n, seed) for g in range(e * n, (e + 1) * n)] for e in range(3)]
    for e, pairs in enumerate(epochs):
        assert {epoch for epoch, _ in pairs} == {e}
        assert sorted(row for _, row in pairs) == list(range(n))  # each row exactly once
    orders = [[row for _, row in pairs] for pairs in epochs]
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    assert orders[0] != [prompts.walk(g, n, seed + 1)[1] for g in range(n)]  # and by the seed
    # A resumed run starts its generator at step * prompts_per_step + groups dropped so far: the
    # walk continues from the first group id the trainer has not consumed.
    cfg = prepare.parse_args(["--prompts-per-step", "4"])
    settings = prepare.generator_settings(
        prepare.resolve(cfg),
        prepare.Prepared(
            "m", "m", devices.plan("", ""), start_step=20, start_version=20, groups_dropped=3
        ),
    )
    assert settings.first_group_id == 20 * 4 + 3
    assert [prompts.walk(g, n, seed) for g in range(settings.first_group_id, 2 * n)] == (
        epochs[0] + epochs[1]
    )[settings.first_group_id :]


def test_long_prompts_are_dropped_before_training_and_reported_once(
    ascii_model, tokenizer, tmp_path, capfd
):
    rows = [{"prompt": "x" * length, "answer": "1"} for length in (3, 30, 5, 12, 40, 7)]
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    held_file = write_jsonl(tmp_path / "held.jsonl", rows[:3])
    settings = settings_for(
        ascii_model, dataset=train_file, reward="math", eval_dataset=held_file, max_prompt_tokens=10
    )
    task = builtin.make_task(settings.cfg, tokenizer, max_len=1024)
    assert sorted(len(p.prompt_ids) for p in task.prompts) == [3, 5, 7]
    assert sorted(len(p.prompt_ids) for p in task.held_out) == [3, 5]
    assert task.dropped_long == 3 + 1
    err = capfd.readouterr().err
    assert err.count("3 of 6 training prompts are longer than 10 tokens") == 1
    assert err.count("1 of 3 held-out prompts") == 1
    # the model's context bounds prompts too (here: 1024 - max_new_tokens - ... = 20 tokens)
    settings = settings_for(ascii_model, dataset=train_file, reward="math", max_new_tokens=4)
    task = builtin.make_task(settings.cfg, tokenizer, max_len=24)
    assert sorted(len(p.prompt_ids) for p in task.prompts) == [3, 5, 7, 12]
    with pytest.raises(SystemExit, match="--max-prompt-tokens must be >= 0"):
        prepare.parse_args(["--max-prompt-tokens", "-1"])


# ---- Hugging Face datasets -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_datasets(tmp_path_factory):
    """A DatasetDict (train + test) written by save_to_disk, a single saved Dataset (no splits), and
    a folder of Parquet files that `datasets` reads as train/test splits."""
    import datasets

    root = tmp_path_factory.mktemp("hf")
    train_rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(12)]
    test_rows = [{"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"} for i in range(5)]
    both = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(train_rows),
            "test": datasets.Dataset.from_list(test_rows),
        }
    )
    both.save_to_disk(str(root / "saved"))
    both["train"].save_to_disk(str(root / "single"))
    (root / "parquet" / "data").mkdir(parents=True)
    both["train"].to_parquet(str(root / "parquet" / "data" / "train-00000-of-00001.parquet"))
    both["test"].to_parquet(str(root / "parquet" / "data" / "test-00000-of-00001.parquet"))
    return (
        {name: str(root / name) for name in ("saved", "single", "parquet")},
        train_rows,
        test_rows,
    )


def test_datasets_written_by_datasets_load_with_their_test_split(
    saved_datasets, ascii_model, tokenizer
):
    paths, train_rows, test_rows = saved_datasets
    for kind in ("saved", "parquet"):
        argv = [
            "--model",
            ascii_model,
            "--dataset",
            paths[kind],
            "--prompt-column",
            "question",
            "--reward",
            "math",
        ]
        cfg = prepare.parse_args(argv)  # validate() loaded both splits
        assert prompts.has_eval_set(cfg)
        task = builtin.make_task(cfg, tokenizer, max_len=1024)
        assert sorted(p.prompt for p in task.prompts) == sorted(r["question"] for r in train_rows)
        assert sorted(p.prompt for p in task.held_out) == sorted(r["question"] for r in test_rows)
        # an explicit held-out split
        explicit = prompts.spec_of(prepare.parse_args(argv + ["--eval-split", "train"]))
        assert prompts.eval_source(explicit) == (paths[kind], "train")
    single = prepare.parse_args(
        ["--dataset", paths["single"], "--prompt-column", "question", "--reward", "math"]
    )
    # one saved split: training only, no held-out set unless given
    assert not prompts.has_eval_set(single)
    assert prompts.load_rows(paths["single"], "train")[0][1] == train_rows[0]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--eval-split", "validation"],
            "--eval-split validation: {saved} has no such split (splits: train, test)",
        ),
        (["--split", "dev"], "--dataset {saved}: no split 'dev' (splits: train, test)"),
        (
            ["--prompt-column", "prompt"],
            "{saved}[train] row 1: no 'prompt' field (columns: answer, question)",
        ),
        (
            ["--prompt-column", "question", "--eval-dataset", "nowhere.jsonl"],
            "--eval-dataset nowhere.jsonl: no such file",
        ),
    ],
)
def test_a_dataset_that_does_not_load_is_one_line_before_anything_starts(
    saved_datasets, extra, needle
):
    paths = saved_datasets[0]
    with pytest.raises(SystemExit) as err:
        prepare.parse_args(["--dataset", paths["saved"], "--reward", "math", *extra])
    assert needle.format(saved=paths["saved"]) in str(err.value)


def test_an_unknown_hub_dataset_fails_in_one_line_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--dataset",
            "someone/no-such-dataset:main",
            "--reward",
            "math",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --dataset someone/no-such-dataset:main: "
    ), proc.stderr
    assert "not in the local cache" in lines[0]
    assert not out.exists()  # nothing started, nothing written


def test_stop_strings_are_flags_and_the_copy_task_refuses_them():
    cfg = prepare.parse_args(
        [
            "--dataset",
            "tasks/data/gsm8k_sample.jsonl",
            "--prompt-column",
            "question",
            "--reward",
            "math",
            "--stop",
            "####",
            r"\n\n",
        ]
    )
    prepared = prepare.Prepared("m", "m", devices.plan("", ""))
    assert prepare.generator_settings(prepare.resolve(cfg), prepared).stop == ("####", "\n\n")
    with pytest.raises(SystemExit, match="copy task ends its answers with <eos>"):
        prepare.parse_args(["--stop", "x"])


# ---- with the real engine ------------------------------------------------------------------------
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
            lambda: gen.control.ready.is_set() and gen.stats["groups"] >= 2, "training groups", task
        )
        # (the module's engine keeps the weights an earlier test published)
        await wait_until(lambda: gen.loaded_version == old, "the newest weights", task)
        evaluation.request(gen.control, 0, old)
        await wait_until(lambda: gen.eval_task is not None, "the evaluation to start", task)
        env["shared"].publish(new_weights, new)
        if eval_weights == "fixed":  # published mid-evaluation: loaded only once it is done
            await wait_until(lambda: gen.stats["groups"] >= 4, "more training groups", task)
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
    assert gen.stats["eval_tokens"] == first.tokens + second.tokens
    # eval tokens apart
    assert gen.stats["tokens"] == sum(len(ids) for g in groups for ids in g.completion_ids)


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
        await wait_until(lambda: gen.stats["groups"] >= 8, "8 groups", task)
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
            lambda: gen.control.ready.is_set() and gen.stats["groups"] >= 2, "training groups", task
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
