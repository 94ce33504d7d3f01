"""The off-policy toolkit (losses.py: grpo_loss, off_policy_masks): sequence and token masks,
mismatch metrics, baselines.

- Each mask (verl's geometric-mean rejection, DeepSeek-V3.2's off-policy sequence masking, IcePop's
  token mask), the k3 mismatch and each advantage estimator against a hand computation written out
  here in plain Python; unscored samples get advantage 0 under every estimator and stay out of its
  statistics.
- In training (`update.update_on_batch` on a tiny real model, behaviour log-probs set to the model's
  own plus known offsets): the shares each rule masked, the k3 by lag and the effective sample size
  match the hand computation from those offsets, and the loss differs from the default config's; all
  masked: a zero loss; a masked token stays in the normalisers (seq-mean-token-mean's |o_i|,
  token-mean's count).
- Bad flag values are refused in one line. The real run with every flag is in test_distill.py (one
  vLLM run for both toolkits).
"""

import dataclasses
import math
import statistics
import time

import pytest
import torch
from test_fsdp import PAD_ID, PROMPT, backward, make_batch

import advantages
import buffer
import losses
import update
from config import Config
from run.flag_checks import parse_args
from tasks import builtin


def padded(rows, fill=0.0):
    """(B, T) float64 tensor and its mask from ragged rows."""
    width = max(len(r) for r in rows)
    values = torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return values, mask


# --------------------------------------------------------------------------------------------------
# The masks and the k3 mismatch, by hand
# --------------------------------------------------------------------------------------------------
LOG_RATIOS = [[0.01, -0.002, 0.004], [0.0005, -0.0003], [-0.003, -0.001], [], [0.9, -0.9, 0.0, 0.1]]


def test_geometric_mean_mask_rejects_a_sequence_by_its_mean_log_ratio():
    behaviour, mask = padded([[-1.0 - 0.1 * t for t in range(len(r))] for r in LOG_RATIOS])
    old = behaviour + padded(LOG_RATIOS)[0]
    for low, high in ((None, 1.001), (0.9, 1.01)):
        lower = 1 / high if low is None else low
        geo = [math.exp(sum(r) / len(r)) if r else None for r in LOG_RATIOS]
        expected = [g is not None and lower <= g <= high for g in geo]
        got = losses.geometric_mean_mask(old, behaviour, mask, low=low, high=high)
        assert [bool(row.any()) for row in got] == expected
        # whole sequences, on the mask
        assert bool((got == (mask & torch.tensor(expected)[:, None])).all())
    # the last row's mean log-ratio 0.025 is past log 1.01
    assert expected == [True, True, True, False, False]
    kept = losses.geometric_mean_mask(old, behaviour, mask)  # the default band, 1/1.001 .. 1.001
    assert [bool(r.any()) for r in kept] == [False, True, False, False, False]
    # empty mask
    assert not losses.geometric_mean_mask(old, behaviour, torch.zeros_like(mask)).any()


def test_dsv32_mask_drops_negative_advantage_sequences_far_from_the_generator():
    # log(mu / pi) per token
    deltas = [[0.3, 0.3], [0.05, 0.05, 0.05], [0.3, 0.3], [0.1, 0.3], [], [-0.5, 0.2]]
    advantages = [-1.0, -1.0, 0.5, -0.2, -1.0, -0.7]
    logp, mask = padded([[-2.0] * len(d) for d in deltas])
    behaviour = logp + padded(deltas)[0]
    got = losses.dsv32_sequence_mask(logp, behaviour, torch.tensor(advantages), mask, 0.1)
    expected = [not (a < 0 and d and sum(d) / len(d) > 0.1) for a, d in zip(advantages, deltas)]
    # A > 0 kept; mean -0.15 kept; empty: nothing
    assert expected == [False, True, True, False, True, True]
    assert [bool(r.any()) or not d for r, d in zip(got, deltas)] == expected
    # per-token advantages: only the tokens with A < 0 of a far sequence
    token_adv = torch.tensor([[1.0, -1.0, -1.0]] + [[-1.0, -1.0, -1.0]] * 5)
    got = losses.dsv32_sequence_mask(logp, behaviour, token_adv, mask, 0.1)
    assert got[0].tolist()[:2] == [True, False] and got[3].tolist()[:2] == [False, False]


def test_icepop_mask_keeps_tokens_whose_ratio_is_in_the_band():
    ratios = [[0.4, 0.6, 4.9, 5.1, 1.0], [0.51, 4.99]]
    behaviour, mask = padded([[-1.5] * len(r) for r in ratios])
    old = behaviour + padded([[math.log(x) for x in r] for r in ratios])[0]
    got = losses.icepop_mask(old, behaviour, mask, 0.5, 5.0)
    expected = [[0.5 <= x <= 5.0 for x in r] for r in ratios]
    assert [row[: len(r)].tolist() for row, r in zip(got, ratios)] == expected
    assert expected == [[False, True, True, False, True], [True, True]]
    assert (
        not got[1, 2:].any()
        and not losses.icepop_mask(old, behaviour, torch.zeros_like(mask)).any()
    )


def test_mismatch_k3_is_r_minus_1_minus_log_r():
    deltas = [[0.2, -0.3, 0.0], [1.0]]
    behaviour, mask = padded([[-2.0] * len(d) for d in deltas])
    got = losses.mismatch_k3(behaviour + padded(deltas)[0], behaviour, mask)
    for row, d in zip(got, deltas):
        assert row[: len(d)].tolist() == pytest.approx([math.exp(x) - 1 - x for x in d], abs=1e-12)
        assert row[len(d) :].abs().sum() == 0


# --------------------------------------------------------------------------------------------------
# Advantage estimators, by hand
# --------------------------------------------------------------------------------------------------
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0]]


def test_rloo_subtracts_the_mean_of_the_others():
    got = advantages.estimate_advantages(torch.tensor(REWARDS), "rloo")
    expected = [[r - (sum(g) - r) / (len(g) - 1) for r in g] for g in REWARDS]
    assert got.flatten().tolist() == pytest.approx([a for g in expected for a in g], abs=1e-6)
    assert expected[0][0] == pytest.approx(2 / 3)
    # G = 1
    assert advantages.estimate_advantages(torch.tensor([[1.0], [3.0]]), "rloo").tolist() == [
        [0.0],
        [0.0],
    ]


def test_reinforce_pp_whitens_over_the_whole_batch():
    flat = [r for g in REWARDS for r in g]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    got = advantages.estimate_advantages(torch.tensor(REWARDS), "reinforce_pp", eps=1e-6)
    assert got.flatten().tolist() == pytest.approx(
        [(r - mean) / (std + 1e-6) for r in flat], abs=1e-5
    )
    assert got[2].abs().sum() > 0  # a group of equal rewards still moves: no per-prompt baseline
    assert advantages.estimate_advantages(torch.tensor([[5.0]]), "reinforce_pp").tolist() == [[0.0]]


def test_reinforce_baseline_subtracts_the_group_mean_then_whitens_over_the_batch():
    centered = [r - statistics.mean(g) for g in REWARDS for r in g]
    mean, std = statistics.mean(centered), statistics.stdev(centered)
    got = advantages.estimate_advantages(torch.tensor(REWARDS), "reinforce_baseline", eps=1e-6)
    assert got.flatten().tolist() == pytest.approx(
        [(c - mean) / (std + 1e-6) for c in centered], abs=1e-5
    )
    # equal rewards: ~0, not whitened
    assert got[2].tolist() == pytest.approx([-mean / (std + 1e-6)] * 4, abs=1e-6)
    whitened_only = advantages.estimate_advantages(torch.tensor(REWARDS), "reinforce_pp")
    # reinforce_pp has no group baseline
    assert got[0, 0] != pytest.approx(whitened_only[0, 0].item())
    assert "reinforce_baseline" in advantages.ADV_ESTIMATORS
    assert (
        parse_args(["--adv-estimator", "reinforce_baseline"]).adv_estimator == "reinforce_baseline"
    )


# Group 0 has two unscored samples (None: a reward or env fault), which rewards.combine fills with
# the mean of the scored ones; group 1 is fully scored; group 2 has nothing scored (filled with 0).
# Counted as scored, the filled values shrank grpo's group std (1.22 for 0.71) and rloo's baseline,
# and reinforce_pp whitened them.
UNSCORED = [[1.0, 0.0, None, None], [1.0, 1.0, 1.0, 0.0], [None] * 4]


def by_hand(estimator, groups):
    """Each estimator over the scored samples alone (None: unscored), written out: unscored samples
    get 0."""
    kept = [[r for r in g if r is not None] for g in groups]
    flat = [r for s in kept for r in s]
    centered = [r - statistics.mean(s) for s in kept for r in s]
    out = []
    for g, s in zip(groups, kept):
        for r in g:
            if r is None or (estimator in ("grpo", "rloo") and len(s) < 2):
                out.append(0.0)
            elif estimator == "grpo":
                out.append((r - statistics.mean(s)) / (statistics.stdev(s) + 1e-6))
            elif estimator == "rloo":
                out.append(r - (sum(s) - r) / (len(s) - 1))
            elif estimator == "reinforce_pp":
                out.append((r - statistics.mean(flat)) / (statistics.stdev(flat) + 1e-6))
            else:  # reinforce_baseline
                c = r - statistics.mean(s)
                out.append((c - statistics.mean(centered)) / (statistics.stdev(centered) + 1e-6))
    return out


@pytest.mark.parametrize("estimator", advantages.ADV_ESTIMATORS)
def test_unscored_samples_get_zero_advantage_and_leave_the_statistics(estimator):
    # as rewards.combine fills them
    filled = torch.tensor([[1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 1.0, 0.0], [0.0] * 4])
    scored = torch.tensor([[v is not None for v in g] for g in UNSCORED])
    got = advantages.estimate_advantages(filled, estimator, scored=scored)
    assert got.flatten().tolist() == pytest.approx(by_hand(estimator, UNSCORED), abs=1e-5)
    # exactly (reinforce_pp had 0.18, -0.89)
    assert got[0, 2:].tolist() == [0.0, 0.0] and got[2].tolist() == [0.0] * 4
    # every sample scored: the same as without `scored`
    full = torch.tensor(REWARDS)
    assert torch.equal(
        advantages.estimate_advantages(
            full, estimator, scored=torch.ones(full.shape, dtype=torch.bool)
        ),
        advantages.estimate_advantages(full, estimator),
    )


def test_the_unscored_samples_reach_the_advantages_by_index():
    from tasks import rewards as rewards_lib

    groups = []
    for values in UNSCORED:
        filled, unscored = rewards_lib.combine([values], [1.0], len(values))
        groups.append(
            buffer.RolloutGroup(
                0, [1], [[2]] * 4, [[0.0]] * 4, [[0]] * 4, filled, unscored=unscored
            )
        )
    assert [g.unscored for g in groups] == [[2, 3], [], [0, 1, 2, 3]]
    # what is logged
    assert [g.rewards for g in groups] == [[1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 1.0, 0.0], [0.0] * 4]
    assert buffer.scored_mask(groups).tolist() == [[v is not None for v in g] for g in UNSCORED]


def test_grpo_is_group_advantages_and_an_unknown_estimator_is_refused():
    rewards = torch.tensor(REWARDS)
    assert torch.equal(
        advantages.estimate_advantages(rewards, "grpo", "batch"),
        advantages.group_advantages(rewards, "batch"),
    )
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        advantages.estimate_advantages(rewards, "ppo")


def test_bad_flags_are_refused_in_one_line_each():
    for argv, message in (
        (
            ["--adv-estimator", "rloo", "--adv-scale", "batch"],
            "applies to --adv-estimator grpo only",
        ),
        (["--adv-estimator", "rloo", "--group-size", "1"], "needs --group-size >= 2"),
        (["--adv-estimator", "reinforce_baseline", "--group-size", "1"], "needs --group-size >= 2"),
        (["--geo-mask-low", "0.99"], "needs --geo-mask-high"),
        (["--geo-mask-high", "0.99"], "0 < low <= 1 <= high"),
        (["--geo-mask-high", "0"], "0 < low <= 1 <= high"),
        (["--icepop-high", "5", "--icepop-low", "0"], "0 < low <= 1 <= high"),
        (["--dsv32-mask-kl", "-0.1"], "must be >= 0"),
    ):
        with pytest.raises(SystemExit, match=message):
            parse_args(argv)
    assert (
        parse_args(["--adv-estimator", "reinforce_pp", "--group-size", "1"]).adv_estimator
        == "reinforce_pp"
    )


# --------------------------------------------------------------------------------------------------
# In training: a tiny real model, behaviour log-probs = the model's own + known offsets
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = builtin.build_tiny_model(str(tmp_path_factory.mktemp("offpolicy") / "tiny"), seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def offset(i, t):
    """log(mu / pi) of row i's token t: both signs, some past IcePop's band (|x| > log 2), none at a
    boundary."""
    return round(0.9 * math.sin(1.7 * i + 2.3 * t + 0.4), 3)


@pytest.fixture(scope="module")
def perturbed(model):
    """make_batch's rows (lengths 5,1,3,0,4,2,5; advantages of both signs), rows 0-2 sampled one
    version ago."""
    batch = make_batch()
    with torch.no_grad():
        own = update.completion_logprobs(model, batch, 1.0).logp.double()
    deltas = [[offset(i, t) for t in range(int(n))] for i, n in enumerate(batch.mask.sum(1))]
    behaviour = own.clone()
    for i, row in enumerate(deltas):
        behaviour[i, batch.mask[i]] += torch.tensor(row, dtype=torch.float64)
    versions = batch.token_versions.clone()
    versions[:3][batch.mask[:3]] = 1  # lag 0 at version 1; the rest lag 1
    return dataclasses.replace(
        batch, behaviour_logp=behaviour.float(), token_versions=versions
    ), deltas


def train_step(model, batch, **changes):
    result = backward(model, None, batch, Config(max_lag=1, **changes), 0, 1, version=1)
    model.zero_grad(set_to_none=True)
    return result


def test_masks_act_in_training_as_computed_by_hand(model, perturbed):
    batch, deltas = perturbed
    advantages = batch.advantages.tolist()
    rows = [d for d in deltas if d]
    tokens = [x for d in deltas for x in d]
    default = train_step(model, batch)
    geo = train_step(model, batch, geo_mask_high=1.05)
    dsv = train_step(model, batch, dsv32_mask_kl=0.05)
    ice = train_step(model, batch, icepop_high=5.0)
    # geometric mean of pi / mu = exp(-mean offset);
    # DeepSeek-V3.2's KL = mean offset; IcePop's k = exp(-offset)
    geo_share = sum(not 1 / 1.05 <= math.exp(-sum(d) / len(d)) <= 1.05 for d in rows) / len(rows)
    dsv_share = sum(
        a < 0 and sum(d) / len(d) > 0.05 for a, d in zip(advantages, deltas) if d
    ) / len(rows)
    ice_share = sum(not 0.5 <= math.exp(-x) <= 5.0 for x in tokens) / len(tokens)
    assert geo.metrics["geo_masked_seq_frac"] == pytest.approx(geo_share) and geo_share > 0
    assert dsv.metrics["dsv32_masked_seq_frac"] == pytest.approx(dsv_share) and dsv_share > 0
    assert ice.metrics["icepop_masked_frac"] == pytest.approx(ice_share) and ice_share > 0
    for result in (geo, dsv, ice):
        assert abs(result.loss - default.loss) > 1e-6
    assert not {"geo_masked_seq_frac", "dsv32_masked_seq_frac", "icepop_masked_frac"} & set(
        default.metrics
    )
    # all masked: nothing left to train on, a zero loss (the normaliser keeps its count: no NaN)
    assert train_step(model, batch, geo_mask_high=1.0001, geo_mask_low=0.9999).loss == 0.0


def test_a_max_lag_that_never_drops_costs_only_the_lags_a_batch_can_have(model, perturbed):
    """--max-lag 10**6 at version 1: the per-lag metrics stop at the version (no lag can exceed it),
    so the step takes no longer and logs the same as with --max-lag 1 (issue 29: a loop to --max-lag
    took ~2 minutes here)."""
    batch, _ = perturbed
    start = time.perf_counter()
    huge = backward(model, None, batch, Config(max_lag=10**6), 0, 1, version=1)
    model.zero_grad(set_to_none=True)
    assert time.perf_counter() - start < 10
    assert huge.metrics == pytest.approx(train_step(model, batch).metrics)
    assert "mismatch_k3/lag1" in huge.metrics


def test_mismatch_metrics_by_lag_and_the_effective_sample_size(model, perturbed):
    batch, deltas = perturbed
    # --is-mode truncate, --is-high 2: w = min(pi / mu, 2) per token
    result = train_step(model, batch)
    k3 = [[math.exp(-x) - 1 + x for x in d] for d in deltas]  # r = pi / mu = exp(-offset)
    by_lag = {0: [x for row in k3[:3] for x in row], 1: [x for row in k3[3:] for x in row]}
    everything = by_lag[0] + by_lag[1]
    assert result.metrics["mismatch_k3"] == pytest.approx(
        sum(everything) / len(everything), rel=1e-4
    )
    for lag, values in by_lag.items():
        assert result.metrics[f"mismatch_k3/lag{lag}"] == pytest.approx(
            sum(values) / len(values), rel=1e-4
        )
    assert "mismatch_k3/lag2" not in result.metrics and "mismatch_tokens/lag0" not in result.metrics
    weights = [min(math.exp(-x), 2.0) for d in deltas for x in d]
    ess = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert result.metrics["is_ess"] == pytest.approx(ess, rel=1e-4) and 0 < ess < 1
    truncated = sum(math.exp(-x) > 2.0 for d in deltas for x in d) / len(weights)
    assert result.metrics["is_truncated_frac"] == pytest.approx(truncated) and truncated > 0
    masked = train_step(model, batch, is_mode="mask")
    assert masked.metrics["is_masked_frac"] == pytest.approx(
        sum(not 0.5 <= math.exp(-x) <= 2.0 for d in deltas for x in d) / len(weights)
    )


def on_policy_batch(model, completions, advantages):
    """Rows with the given completions and advantages whose behaviour log-probs are the model's own
    (ratio 1)."""
    samples = [
        buffer.Sample(list(PROMPT), c, [0.0] * len(c), [1] * len(c), 0.0, a)
        for c, a in zip(completions, advantages)
    ]
    batch = buffer.collate(samples, PAD_ID)
    with torch.no_grad():
        own = update.completion_logprobs(model, batch, 1.0).logp
    return dataclasses.replace(batch, behaviour_logp=own)


def test_seq_mean_token_mean_divides_each_sequence_by_its_tokens_before_the_masks(model):
    """IcePop drops 3 of sequence 0's 4 tokens; every kept token's loss is 1 (A = -1, ratio 1
    against the generator): DeepSeek-V3.2's 1/|o_i| gives sequence 0 1/4 and sequence 1 4/4, so
    (0.25 + 1) / 2 = 0.625 (dividing by the kept tokens gave 1.0); token-mean counts the 8 tokens
    before the mask too: 5/8."""
    batch = on_policy_batch(model, [[5, 6, 7, 8], [9, 10, 11, 12]], [-1.0, -1.0])
    dropped = batch.mask[0].nonzero().flatten()[1:]
    batch.behaviour_logp[0, dropped] += 2.0  # pi / mu = exp(-2) < 0.5: outside IcePop's band
    for agg in ("seq-mean-token-mean", "token-mean"):
        result = train_step(model, batch, is_mode="off", icepop_high=5.0, agg=agg)
        assert result.metrics["icepop_masked_frac"] == pytest.approx(3 / 8)
        assert result.loss == pytest.approx(0.625, abs=1e-6), agg
