"""Reward functions (tasks/rewards.py): bring your own reward, with local files only.

Fast tests (no engine): reward functions from a user module or file (TRL's calling convention, the
per-sample fault rules, weights, a process pool), the math reward on right and wrong answers. The
datasets, prompts and the end-to-end run that scores with the math reward plus a user reward:
tests/test_data.py.
"""

import sys
from pathlib import Path

import pytest

from tasks import datasets
from tasks.rewards import Scorer, load_reward, math_reward, summarize

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(
        "SEEN = []\ndef capture(prompts, completions, completion_ids, **kwargs):\n"
        "    SEEN.append(dict(prompts=prompts, completions=completions, "
        "completion_ids=completion_ids, **kwargs))\n"
        "    return [float(len(c if isinstance(c, str) else c[0]['content'])) for c in "
        "completions]\ndef simple(completions, answer):\n"
        "    return [1.0 if c.endswith(a) else 0.0 for c, a in zip(completions, answer)]\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_user_rewards", None)


def test_reward_functions_load_from_a_user_module_or_file(user_module):
    import my_user_rewards

    assert load_reward("my_user_rewards:capture") is my_user_rewards.capture
    assert load_reward(str(user_module / "my_user_rewards.py") + ":simple").__name__ == "simple"
    assert (
        load_reward(str(REPO / "tasks" / "examples" / "my_rewards.py") + ":format_reward").__name__
        == "format_reward"
    )
    assert load_reward("math") is math_reward
    for spec, needle in [
        ("my_user_rewards:nope", "has no 'nope'"),
        ("my_user_rewards:NOT_CALLABLE", "not callable"),
        ("nowhere_mod:f", "cannot import nowhere_mod"),
        ("missing.py:f", "no such file"),
    ]:
        with pytest.raises(datasets.DataError, match=needle):
            load_reward(spec)


def test_trl_calling_convention_with_extra_columns(user_module):
    import my_user_rewards

    scorer = Scorer(["my_user_rewards:capture", "my_user_rewards:simple"])
    columns = datasets.row_columns({"question": "q?", "sol": "7", "level": 3}, "question", "sol")
    rewards, stats, unscored = scorer.score("q?", ["a 7", "b"], [[1, 2], [3]], columns, step=5)
    seen = my_user_rewards.SEEN[-1]
    assert seen["prompts"] == ["q?", "q?"] and seen["completions"] == ["a 7", "b"]
    assert seen["completion_ids"] == [[1, 2], [3]]
    assert seen["sol"] == ["7", "7"] and seen["answer"] == ["7", "7"] and seen["level"] == [3, 3]
    assert seen["trainer_state"].global_step == 5
    assert rewards == [3.0 + 1.0, 1.0 + 0.0] and unscored == []  # `simple` got only what it takes
    assert set(stats) == {"capture", "simple"} and stats["simple"]["sum"] == 1.0
    # chat prompts: completions come as assistant messages, as in TRL
    chat = [{"role": "user", "content": "q?"}]
    scorer = Scorer(["my_user_rewards:capture"])
    scorer.score(chat, ["xyz"], [[1]], {"answer": "1"})
    assert my_user_rewards.SEEN[-1]["completions"] == [[{"role": "assistant", "content": "xyz"}]]
    assert my_user_rewards.SEEN[-1]["prompts"] == [chat]


def test_fault_rules_none_nan_errors_and_weights(tmp_path, monkeypatch):
    (tmp_path / "faulty_rewards.py").write_text(
        "import math\ndef ok(completions, **kw): return [1.0, 2.0, 3.0, 4.0]\n"
        "def some_none(completions, **kw): return [None, 10.0, None, math.nan]\n"
        "def raises(completions, **kw): raise ValueError('boom')\n"
        "def wrong_count(completions, **kw): return [1.0]\n"
        "def all_none(completions, **kw): return [None] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    logged = []
    scorer = Scorer(
        [f"faulty_rewards:{f}" for f in ("ok", "some_none", "raises", "wrong_count")],
        weights=[1.0, 0.5, 1.0, 1.0],
        log=logged.append,
    )
    rewards, stats, unscored = scorer.score("p", ["a", "b", "c", "d"], [[1]] * 4, {})
    # None/NaN left out of the weighted sum
    assert rewards == [1.0, 2.0 + 5.0, 3.0, 4.0] and unscored == []
    assert (
        stats["some_none"]["none"],
        stats["some_none"]["invalid"],
        stats["some_none"]["count"],
    ) == (2, 1, 1)
    assert stats["raises"]["errors"] == 1 and stats["raises"]["count"] == 0
    assert stats["wrong_count"]["errors"] == 1
    assert any("boom" in m for m in logged) and any("returned 1 values for 4" in m for m in logged)
    scorer.score("p", ["a", "b", "c", "d"], [[1]] * 4, {})
    assert len([m for m in logged if "boom" in m]) == 1  # reported once, counted always
    # a sample no function scored gets its group's mean
    # and is named unscored; a group nobody scored gets 0
    scorer = Scorer(["faulty_rewards:some_none"], log=logged.append)
    rewards, _, unscored = scorer.score("p", list("abcd"), [[1]] * 4, {})
    assert rewards == [10.0] * 4 and unscored == [0, 2, 3]
    rewards, stats, unscored = Scorer(["faulty_rewards:all_none"]).score(
        "p", list("ab"), [[1]] * 2, {}
    )
    assert rewards == [0.0, 0.0] and unscored == [0, 1] and stats["all_none"]["none"] == 2
    metrics = summarize([stats, stats])
    assert metrics["reward/all_none/none_frac"] == 1.0 and metrics["reward/all_none/mean"] is None


def test_reward_functions_in_a_process_pool(tmp_path):
    scorer = Scorer(
        ["math", str(REPO / "tasks" / "examples" / "my_rewards.py") + ":format_reward"], workers=1
    )
    try:
        rewards, stats, _ = scorer.score(
            "q", ["so #### 5", "it is 4"], [[1], [2]], {"answer": "#### 5"}
        )
    finally:
        scorer.close()
    assert rewards == [2.0, 0.0] and stats["math_reward"]["count"] == 2


def test_math_reward_right_and_wrong_answers():
    gold = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Altogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    )
    completions = [
        "48 + 24 = 72\n#### 72",
        "So the answer is $\\boxed{72}$.",
        "She sold 72.0 clips in total.",
        "48 + 24 = 73\n#### 73",
        "I do not know.",
        "#### 72 clips",
        "72 ... no, 71",
    ]
    assert math_reward(completions, answer=[gold] * len(completions)) == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        0.0,
    ]
    assert math_reward(["#### 1,250"], answer=["#### 1250"]) == [1.0]
    assert math_reward(["x = 1/2"], solution=["$\\frac{1}{2}$"]) == [1.0]  # TRL's column name
    assert math_reward([[{"role": "assistant", "content": "#### -7"}]], answer=["#### -7"]) == [1.0]
    # the reward does not apply
    assert math_reward(["#### 3"], answer=["no number at all"]) == [None]
    with pytest.raises(TypeError):
        math_reward(["#### 3"])
