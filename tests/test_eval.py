"""Held-out evaluation, the copy task's held-out split, epochs, --max-prompt-tokens, Hugging Face
datasets checked before start, and stop strings (issue 15).

Fast tests (no engine): the pass@k estimator against brute-force enumeration, the copy task's fixed
split, the epoch walk, long prompts dropped up front, datasets written by `datasets` (save_to_disk,
a folder of Parquet files) with their test split, and an unknown hub name failing in one line before
anything starts. The tests on the real engine are in test_eval_engine.py.
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_data import write_jsonl
from test_engine import settings_for as engine_settings

from infra import devices
from run import prepare
from tasks import builtin, evaluation, prompts

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
