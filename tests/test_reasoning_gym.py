"""`--task rg:NAME`: reasoning-gym's procedural datasets as dataset tasks (datasets.rg_rows,
rewards.reasoning_gym_reward).

Fast, in-process, no engine: the task builds with the network cut off, its prompts encode through
the chat template with reasoning-gym's system prompt, its held-out rows are other questions than its
training rows, and its own `score_answer` scores a right answer 1 and wrong ones less, through the
task's `score` path. Bad names and flags that do not apply are one `error:` line each.
"""

import socket

import pytest

from run import prepare
from tasks import builtin, datasets


@pytest.fixture
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_an_rg_task_builds_offline_and_scores_with_reasoning_gyms_scorer(
    offline, ascii_model, tokenizer
):
    cfg = prepare.parse_args(
        ["--model", ascii_model, "--task", "rg:leg_counting", "--max-new-tokens", "16"]
    )
    task = builtin.make_task(cfg, tokenizer, max_len=1024)
    sizes = datasets.RG_SIZES
    assert (len(task.prompts), len(task.held_out)) == (sizes["train"], sizes["test"])
    assert task.names == ["reasoning_gym_reward"]
    train_questions = {p.prompt for p in task.prompts}
    assert not train_questions & {p.prompt for p in task.held_out}  # held out: other questions
    prompt = task.prompts[0]
    text = tokenizer.decode(prompt.prompt_ids)
    assert text.startswith("<|system|>\nGiven a problem") and "<answer>answer here</answer>" in text
    assert (
        text.endswith(f"<|user|>\n{prompt.prompt}\n<|assistant|>\n")
        and "how many legs" in prompt.prompt
    )
    assert (
        prompt.answer.isdigit() and prompt.columns["metadata"]["source_dataset"] == "leg_counting"
    )
    wrong = str(int(prompt.answer) + 1)
    completions = [
        f"Counting... <answer>{prompt.answer}</answer>",
        f"<answer>{wrong}</answer>",
        f"The answer is {prompt.answer}",
        f"<answer>{wrong}</answer> no, <answer>{prompt.answer}</answer>",
    ]
    rewards, stats, unscored = task.score(prompt, completions, [[0]] * 4)
    # no <answer> tags: no answer
    assert rewards[0] == 1.0 and rewards[1] < 1.0 and rewards[2] < 1.0
    assert rewards[3] == 1.0  # the last tagged answer counts (reasoning-gym's extract_answer)
    assert unscored == [] and stats["reasoning_gym_reward"]["count"] == 4
    # a new generator: the same rows (fixed seeds)
    fresh = datasets.rg_dataset("rg:leg_counting", "train")
    assert [fresh[i]["question"] for i in range(5)] == [p.prompt for p in task.prompts[:5]]


def test_another_dataset_with_an_extra_reward_and_a_plain_text_model(
    ascii_model, tokenizer, tmp_path
):
    rewards_file = tmp_path / "fmt.py"
    rewards_file.write_text(
        "def tagged(completions, **kw):\n    return [float('<answer>' in c) for c in completions]\n"
    )
    cfg = prepare.parse_args(
        [
            "--model",
            ascii_model,
            "--task",
            "rg:basic_arithmetic",
            "--reward",
            f"rg,{rewards_file}:tagged",
            "--reward-weights",
            "1,0.5",
        ]
    )
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None  # no chat template: the system prompt is a plain-text prefix
    task = builtin.make_task(cfg, plain, max_len=1024)
    prompt = task.prompts[3]
    text = plain.decode(prompt.prompt_ids)
    assert text.startswith("Given a problem") and text.endswith(f"example.\n\n\n{prompt.prompt}")
    rewards, _, _ = task.score(
        prompt, [f"<answer>{prompt.answer}</answer>", "<answer>x</answer>", "x"], [[0]] * 3
    )
    assert rewards == [1.5, 0.5, 0.0]


def test_bad_rg_flags_are_one_line_each(ascii_model):
    cases = {
        (
            "--task",
            "rg:leg_countin",
        ): "reasoning-gym has no dataset 'leg_countin' \\(e.g. leg_counting",
        ("--task", "rg:composite"): "cannot build it with its default configuration",
        (
            "--task",
            "rg:leg_counting",
            "--dataset",
            "x.jsonl",
        ): "generates its own training and held-out rows",
        ("--task", "rg:leg_counting", "--split", "validation"): "the splits are train and test",
        ("--task", "nonsense"): "must be one of auto, copy, dataset, gsm8k, reveal or rg:NAME",
    }
    for argv, expected in cases.items():
        with pytest.raises(SystemExit, match=f"^error: --task.*{expected}") as info:
            prepare.parse_args(["--model", ascii_model, *argv])
        assert str(info.value).count("\n") == 0
