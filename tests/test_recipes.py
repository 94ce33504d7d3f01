"""The knobs of today's GRPO recipes: the learning-rate schedule, DAPO's overlong penalty and filter, and
the warning for flags that cannot act."""
import math

import pytest
import torch

import buffer
import train
from losses import overlong_penalty


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_learning_rate_schedule_at_warmup_end_and_last_step(schedule):
    cfg = train.Config(steps=100, lr=1e-3, min_lr=1e-4, lr_warmup_steps=10, lr_schedule=schedule)
    lrs = [train.learning_rate(step, cfg) for step in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4)  # 1/10 of the way up
    assert lrs[9] == pytest.approx(1e-3)  # the end of the warmup: the full rate
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    last = 1e-3 if schedule == "constant" else 1e-4
    assert lrs[-1] == pytest.approx(last)
    if schedule == "linear":
        assert lrs[10 + 89 // 2] == pytest.approx(1e-4 + 9e-4 * (1 - 44 / 89))
    if schedule == "cosine":
        assert lrs[10 + 89 // 2] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    assert train.learning_rate(0, train.Config()) == train.Config().lr  # the default: constant, no warmup


def test_overlong_penalty_is_dapos_formula():
    lengths = torch.tensor([0, 10, 12, 13, 16, 19, 20, 21])
    # L_max 20, L_cache 8: free up to 12, then (12 - |y|) / 8 down to -1 at 20, -1 beyond
    expected = torch.tensor([0, 0, 0, -1 / 8, -4 / 8, -7 / 8, -1, -1])
    assert torch.allclose(overlong_penalty(lengths, 20, 8), expected)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


def test_shaped_rewards_add_the_penalty_and_mark_cut_completions():
    group = buffer.RolloutGroup(0, [1], [[5] * 3, [5] * 8, [5] * 10], [[0.0] * 3, [0.0] * 8, [0.0] * 10],
                                [[0] * 3, [0] * 8, [0] * 10], [1.0, 0.5, 0.0],
                                finish_reasons=["stop", "stop", "length"])
    plain, truncated = train.shaped_rewards([group], train.Config(max_new_tokens=10))
    assert plain.tolist() == [[1.0, 0.5, 0.0]] and truncated.tolist() == [[False, False, True]]
    shaped, _ = train.shaped_rewards([group], train.Config(max_new_tokens=10, overlong_penalty=4))
    assert shaped[0].tolist() == pytest.approx([1.0, 0.5 - 2 / 4, -1.0])


def test_a_warning_names_the_flags_that_cannot_act():
    assert train.inactive_flags(train.Config()) == []
    assert train.inactive_flags(train.Config(loss="dapo", dual_clip=3.0)) == ["--loss dapo", "--dual-clip"]
    assert train.inactive_flags(train.Config(loss="cispo", eps_high=5.0, is_mode="off")) == []


def test_recipe_flags_are_validated_in_one_line():
    for argv in (["--overlong-penalty", "5"], ["--min-lr", "1"], ["--lr-warmup-steps", "-1"]):
        with pytest.raises(SystemExit, match="^error: "):
            train.parse_args(argv)
