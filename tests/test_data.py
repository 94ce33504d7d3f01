"""Bring your own model, data and reward (tasks/prompts.py, tasks/datasets.py, rollout's tasks,
plots.py), with local files only.

Fast tests (no engine): JSONL and Parquet datasets with a column mapping, rows missing a field
reported by line, chat-template rendering, a saved Hugging Face model directory, the plot. One
end-to-end run: the GSM8K-style sample, the math reward plus a user reward, the tiny
character-level model saved to disk (random-init: rewards ~0, no learning expected).

Reward functions from a user module (TRL's calling convention, the per-sample fault rules, weights,
a process pool) and the math reward on right and wrong answers: tests/test_rewards.py. The
`ascii_model` and `tokenizer` fixtures: tests/conftest.py.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import config
from run import plots, prepare
from tasks import builtin, datasets, envs, prompts

REPO = Path(__file__).resolve().parent.parent
SAMPLE = str(REPO / "tasks" / "data" / "gsm8k_sample.jsonl")
ROWS = [
    {"question": "What is 2 + 3?", "answer": "#### 5", "level": 1},
    {"question": "What is 10 - 4?", "answer": "#### 6", "level": 2},
    {"question": "What is 3 * 3?", "answer": "#### 9", "level": 1},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---- datasets ------------------------------------------------------------------------------------
def test_jsonl_and_parquet_give_the_same_rows_with_a_column_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    parquet = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    for path in (jsonl, parquet):
        rows = datasets.load_rows(path)
        assert [r for _, r in rows] == ROWS
        datasets.check_rows(rows, "question", "answer")
    assert datasets.load_rows(jsonl)[1][0] == f"{jsonl} line 2"
    assert datasets.load_rows(parquet)[1][0] == f"{parquet} row 2"
    cols = datasets.row_columns(ROWS[0], "question", "answer")
    assert cols == {"answer": "#### 5", "level": 1}  # every column but the prompt, TRL's way
    alias = datasets.row_columns({"q": "x", "sol": "7"}, "q", "sol")
    assert alias == {"sol": "7", "answer": "7"}


def test_dataset_rows_hold_out_in_one_fixed_order_and_check_unless_for_an_env(tokenizer, tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(8)]
    spec = prompts.resolve(
        dataset=write_jsonl(tmp_path / "train.jsonl", rows[:2]),
        reward="math",
        eval_dataset=write_jsonl(tmp_path / "held.jsonl", rows),
    )
    train_rows, held_rows = prompts.dataset_rows(spec)
    assert train_rows == rows[:2]
    assert held_rows == [rows[i] for i in prompts.held_out_order(8)] != rows
    # an env's dataset rows: the same
    assert envs.EnvTask.rows_of(spec, None) == (train_rows, held_rows)
    task = builtin.DatasetTask(spec, tokenizer)  # the order once: encoded in it, not shuffled again
    assert [p.answer for p in task.held_out] == [
        row["answer"] for row in held_rows
    ] and task.dropped_long == 0
    # "pN" is 2 tokens
    assert prompts.encode_rows(held_rows, tokenizer, spec, 1, "held-out") == ([], 8)
    unchecked = prompts.resolve(
        dataset=write_jsonl(tmp_path / "seeds.jsonl", [{"seed": 3}]), env="my_env.py:Env"
    )
    with pytest.raises(datasets.DataError, match="no 'prompt' and no 'answer' field"):
        prompts.dataset_rows(unchecked)
    assert prompts.dataset_rows(unchecked, check=False) == ([{"seed": 3}], [])


def test_rows_missing_a_field_are_reported_with_their_line(tmp_path):
    lines = [ROWS[0], {"question": "no answer here"}, ROWS[1], {"answer": "#### 1", "q": "renamed"}]
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in lines[:2])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in lines[2:])
    )
    with pytest.raises(datasets.DataError) as err:
        datasets.check_rows(datasets.load_rows(str(path)), "question", "answer")
    msg = str(err.value)
    assert (
        "2 of 4 rows" in msg
        and "line 2: no 'answer' field" in msg
        and "line 5: no 'question' field" in msg
    )
    with pytest.raises(SystemExit) as err:  # and before anything starts, from the flags
        prepare.parse_args(
            ["--dataset", str(path), "--prompt-column", "question", "--reward", "math"]
        )
    assert "line 2: no 'answer' field" in str(err.value)
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(datasets.DataError, match="line 2: not valid JSON"):
        datasets.load_rows(str(path))


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--dataset", "missing.jsonl", "--reward", "math"],
            "--dataset missing.jsonl: no such file",
        ),
        (
            ["--dataset", SAMPLE, "--prompt-column", "question", "--reward", "nocolon"],
            "expected module:function",
        ),
        (
            [
                "--dataset",
                SAMPLE,
                "--prompt-column",
                "question",
                "--reward",
                "math,math",
                "--reward-weights",
                "1",
            ],
            "1 value(s) for 2 reward function(s)",
        ),
        (["--dataset", SAMPLE, "--prompt-column", "question"], "needs --reward"),
        (["--reward", "math"], "the copy task has its own data and reward"),
        (["--task", "nope"], "--task must be one of"),
        (
            ["--task", "gsm8k", "--reward", "no_such_module_xyz:f"],
            "cannot import no_such_module_xyz",
        ),
        (
            ["--task", "gsm8k", "--eval-split", "test"],
            "is a file, it has no splits; give the held-out prompts with",
        ),
        (
            ["--eval-every", "-1"],
            "--eval-every, --eval-samples and --max-prompt-tokens must be >= 0",
        ),
    ],
)
def test_bad_data_flags_give_a_clear_line(argv, needle):
    with pytest.raises(SystemExit) as err:
        prepare.parse_args(argv)
    assert needle in str(err.value)


def test_task_resolution():
    assert prompts.resolve() is None  # the default: the built-in copy task
    spec = prompts.resolve("gsm8k")
    assert (spec.dataset, spec.prompt_column, spec.answer_column, spec.rewards) == (
        SAMPLE,
        "question",
        "answer",
        ("tasks.rewards:math_reward",),
    )
    spec = prompts.resolve(
        dataset="x.jsonl",
        reward="math, tasks/examples/my_rewards.py:format_reward",
        reward_weights="1,0.25",
    )
    assert spec.rewards == (
        "tasks.rewards:math_reward",
        "tasks/examples/my_rewards.py:format_reward",
    )
    assert spec.weights == (1.0, 0.25)
    # the shipped sample passes every check
    cfg = prepare.parse_args(["--task", "gsm8k", "--steps", "3"])
    assert cfg.task == "gsm8k"


# GSM8K itself (MIT, openai/grade-school-math): CI keeps a copy beside the checkout
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(
    not all((GSM8K_DIR / name).is_file() for name in prompts.GSM8K_FILES),
    reason=f"no copy of GSM8K at {GSM8K_DIR} (train.jsonl, test.jsonl)",
)
def test_gsm8k_from_a_users_copy_trains_on_its_train_file_and_holds_out_its_test_file(
    ascii_model, tokenizer
):
    """--task gsm8k --data-dir DIR: DIR/train.jsonl's rows to train on, DIR/test.jsonl's held out,
    each scored by the math reward against the number after '#### ' in its `answer`."""
    train, test = (str(GSM8K_DIR / name) for name in prompts.GSM8K_FILES)
    argv = ["--model", ascii_model, "--task", "gsm8k", "--data-dir", str(GSM8K_DIR)]
    cfg = prepare.parse_args(argv + ["--max-new-tokens", "8"])
    spec = prompts.spec_of(cfg)
    assert (spec.dataset, prompts.eval_source(spec), spec.prompt_column) == (
        train,
        (test, ""),
        "question",
    )
    assert spec.system_prompt == prompts.GSM8K_SYSTEM_PROMPT
    rows = {name: datasets.load_rows(path) for name, path in (("train", train), ("test", test))}
    task = builtin.make_task(cfg, tokenizer, max_len=2048)
    assert len(task.prompts) + len(task.held_out) + task.dropped_long == sum(
        map(len, rows.values())
    )
    assert len(task.held_out) > 0.9 * len(rows["test"])
    questions = {row["question"] for _, row in rows["test"]}
    assert all(p.prompt in questions for p in task.held_out[:50])
    prompt = task.held_out[0]
    final = prompt.answer.rsplit("#### ", 1)[1].strip()
    rewards, _, _ = task.score(
        prompt, [f"The answer is below.\n#### {final}", f"#### {final}1"], [[5], [6]]
    )
    assert rewards == [1.0, 0.0]
    # a flag given explicitly still wins: the held-out set from another file
    other = prompts.resolve("gsm8k", eval_dataset=train, data_dir=str(GSM8K_DIR))
    assert (other.dataset, prompts.eval_source(other)) == (train, (train, ""))


def test_data_dir_needs_gsm8k_and_its_two_files_in_one_line(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    for argv, needle in (
        (["--data-dir", str(tmp_path)], "it needs --task gsm8k"),
        (["--task", "gsm8k", "--data-dir", str(tmp_path)], "has no test.jsonl"),
        (["--task", "gsm8k", "--data-dir", str(tmp_path / "none")], "no train.jsonl or test"),
    ):
        with pytest.raises(SystemExit) as err:
            prepare.parse_args(argv)
        assert needle in str(err.value) and str(err.value).count("\n") == 0, str(err.value)


# ---- prompts, the chat template, a saved model ---------------------------------------------------
def test_chat_template_and_plain_text_prompts(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = prompts.render_prompt(tokenizer, messages)
    assert text == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    assert (
        prompts.render_prompt(tokenizer, messages, "Be brief.")
        == "<|system|>\nBe brief.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    )
    assert prompts.render_prompt(tokenizer, "2 + 3 =") == "2 + 3 ="  # plain text as it is
    assert (
        prompts.render_prompt(tokenizer, "2 + 3 =", "Add.")
        == "<|system|>\nAdd.\n<|user|>\n2 + 3 =\n<|assistant|>\n"
    )
    ids = prompts.encode_prompt(tokenizer, messages)
    # every character encoded faithfully (no <pad> for unknowns)
    assert tokenizer.decode(ids) == text
    copy_dir = builtin.build_tiny_model(str(tmp_path / "copy_tiny"))  # no chat template
    copy_tok = AutoTokenizer.from_pretrained(copy_dir)
    assert prompts.render_prompt(copy_tok, "abc=", "sys") == "sys\n\nabc="
    with pytest.raises(datasets.DataError, match="no chat template"):
        prompts.render_prompt(copy_tok, messages)


def test_saved_model_directory_and_dataset_task(ascii_model, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ascii_model).config.vocab_size == 100
    assert prepare.resolve_model(ascii_model) == os.path.abspath(ascii_model)
    cfg = prepare.parse_args(["--model", ascii_model, "--task", "gsm8k", "--max-new-tokens", "8"])
    task = builtin.make_task(cfg, tokenizer, max_len=1024)
    # a file has no test split: no held-out prompts
    assert len(task.prompts) == len(datasets.load_rows(prompts.GSM8K["dataset"]))
    assert task.held_out == []
    prompt = task.prompts[prompts.walk(0, len(task.prompts), seed=0)[1]]
    text = tokenizer.decode(prompt.prompt_ids)
    assert text.startswith("<|system|>\n" + prompts.GSM8K_SYSTEM_PROMPT) and prompt.prompt in text
    assert float(prompt.answer.split("####")[1]) == float(prompt.columns["answer"].split("####")[1])
    rewards, stats, _ = task.score(
        prompt, ["#### " + prompt.answer.split("####")[1].strip(), "hm"], [[5], [6]]
    )
    assert rewards == [1.0, 0.0] and set(stats) == {"math_reward"}
    # a context too small for any prompt is reported, not a hang
    with pytest.raises(RuntimeError, match="longer than 32 tokens"):
        builtin.make_task(cfg, tokenizer, max_len=40)
    copy_task = builtin.make_task(config.Config(max_new_tokens=8), tokenizer)
    assert isinstance(copy_task, builtin.CopyTask)  # the default stays the copy task
    # Reward functions get texts (vLLM detokenizes); the copy task reads ids only (vLLM skips it).
    assert task.needs_text and not copy_task.needs_text


def test_a_chat_dataset_with_a_solution_column(ascii_model, tokenizer):
    cfg = prepare.parse_args(
        [
            "--model",
            ascii_model,
            "--dataset",
            "tasks/examples/chat_prompts.jsonl",
            "--answer-column",
            "solution",
            "--reward",
            "math",
            "--max-new-tokens",
            "8",
        ]
    )
    task = builtin.make_task(cfg, tokenizer, max_len=1024)
    prompt = task.prompts[1]
    assert tokenizer.decode(prompt.prompt_ids).startswith(
        "<|system|>\nAnswer with the number only.\n<|user|>\n"
    )
    assert prompt.columns["solution"] == prompt.columns["answer"] == prompt.answer
    rewards, _, _ = task.score(prompt, [prompt.answer, "0.5"], [[7], [8]])
    assert rewards == [1.0, 0.0]


def test_a_hub_id_that_cannot_be_fetched_fails_with_one_clear_line(monkeypatch):
    import huggingface_hub.constants

    # read per request: no network tried
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(datasets.DataError) as failed:
        prepare.resolve_model("someone/no-such-model")
    assert str(failed.value).startswith(
        "--model someone/no-such-model: not a local directory, and the hub download failed"
    )


def test_plot_from_metrics(tmp_path):
    rows = [
        {
            "step": i,
            "reward": i / 10,
            "reward/math_reward/mean": i / 10,
            "completion_len": 4 + i % 2,
            "completion_len_min": 2,
            "completion_len_max": 6,
            "lag_hist/0": 10,
            "lag_hist/1": i,
            "sync_ms": 30.0 + i,
            "epoch": i // 4,
        }
        for i in range(10)
    ]
    # evaluations land in the row of the step they arrived in
    for i, evaluated in ((1, 0), (6, 5), (9, 10)):
        rows[i].update(
            {
                "eval/step": evaluated,
                "eval/greedy_pass@1": evaluated / 10,
                "eval/reward": 0.5,
                "eval/pass@4": 0.6,
            }
        )
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    assert plots.plot_run(str(tmp_path)) == str(tmp_path / "plots.png")
    assert (tmp_path / "plots.png").stat().st_size > 10_000


# ---- end to end ----------------------------------------------------------------------------------
def test_gsm8k_sample_with_the_math_reward_end_to_end(ascii_model, tmp_path):
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "train.py",
        "--out",
        str(out),
        "--model",
        ascii_model,
        "--task",
        "gsm8k",
        "--reward",
        "math,tasks/examples/my_rewards.py:format_reward",
        "--reward-weights",
        "1,0.5",
        "--reward-workers",
        "1",
        "--steps",
        "3",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "16",
        "--max-lag",
        "1",
    ]
    proc = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        for name in ("math_reward", "format_reward"):
            assert {f"reward/{name}/{k}" for k in ("mean", "std", "none_frac", "errors")} <= set(
                row
            )
            assert row[f"reward/{name}/none_frac"] == 0.0 and row[f"reward/{name}/errors"] == 0
        assert (
            1
            <= row["completion_len_min"]
            <= row["completion_len"]
            <= row["completion_len_max"]
            <= 16
        )
        assert math.isfinite(row["reward"]) and row["unscored"] == 0
        assert sum(v for k, v in row.items() if k.startswith("lag_hist/")) == row["tokens"]
    assert (out / "plots.png").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
