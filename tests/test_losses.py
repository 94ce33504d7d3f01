"""Tests for advantages.py's group advantages and losses.py's loss variants, aggregation, KL and
importance weights: every expected value is computed here by hand (plain python math over the small
cases written out below), never by the code under test.
Token scoring (token_logprobs, chunked_logprobs): tests/test_token_logprobs.py."""

import math
import statistics

import pytest
import torch

import advantages
import losses

# ---------------------------------------------------------------------------
# A small hand case: 2 sequences x 3 tokens, the last token of seq 1 padding.
# old_logp = -1 everywhere, logp = old_logp + log(r), so the ratios are R.
# ---------------------------------------------------------------------------

R = [[1.1, 1.5, 0.7], [0.5, 1.3, 1.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
A = [1.0, -2.0]


def make_case(ratios=R, mask=MASK, adv=A, pad_garbage=True):
    old = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    logp = old + torch.tensor(ratios, dtype=torch.float64).log()
    m = torch.tensor(mask, dtype=torch.bool)
    if pad_garbage:  # unmasked positions must never matter
        logp = torch.where(m, logp, torch.full_like(logp, 80.0))
    logp = logp.clone().requires_grad_(True)
    return logp, old, torch.tensor(adv, dtype=torch.float64), m


def ppo_token(r, a, lo=0.2, hi=0.2):
    return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def masked_tokens(mask=MASK):
    return [(i, t) for i in range(len(mask)) for t in range(len(mask[0])) if mask[i][t]]


# ---------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------

REWARDS = [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]]


def test_group_advantages_group_scale():
    got = advantages.group_advantages(torch.tensor(REWARDS), scale="group", eps=1e-6)
    for g, row in enumerate(REWARDS):
        mu, sd = statistics.mean(row), statistics.stdev(row)  # stdev: unbiased
        for j, x in enumerate(row):
            assert got[g, j].item() == pytest.approx((x - mu) / (sd + 1e-6), rel=1e-5, abs=1e-6)
    # hand numbers: group 0 has mean .5, unbiased std sqrt(1/3)
    assert got[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), rel=1e-5)
    assert torch.all(got[1] == 0)  # identical rewards -> 0, no NaN


def test_group_advantages_batch_scale():
    got = advantages.group_advantages(torch.tensor(REWARDS), scale="batch", eps=1e-6)
    sd = statistics.stdev([x for row in REWARDS for x in row])
    for g, row in enumerate(REWARDS):
        mu = statistics.mean(row)
        for j, x in enumerate(row):
            assert got[g, j].item() == pytest.approx((x - mu) / (sd + 1e-6), rel=1e-5, abs=1e-6)


def test_group_advantages_no_scale_dr_grpo():
    got = advantages.group_advantages(torch.tensor(REWARDS), scale="none")
    assert got.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, -0.75, -0.75, 2.25]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_size_one_group_is_zero(scale):
    got = advantages.group_advantages(torch.tensor([[1.0], [3.0]]), scale=scale)
    assert got.shape == (2, 1)
    assert torch.all(got == 0) and not torch.isnan(got).any()


def test_group_advantages_unknown_scale():
    with pytest.raises(ValueError, match="unknown advantage scale 'foo'.*group"):
        advantages.group_advantages(torch.zeros(2, 2), scale="foo")


# ---------------------------------------------------------------------------
# grpo / dapo / dr_grpo and the aggregation modes
# ---------------------------------------------------------------------------


def test_grpo_token_mean_by_hand():
    logp, old, adv, m = make_case()
    # written out: -1.1, -min(1.5, 1.2) = -1.2, -min(.7, .8) = -.7,
    # A=-2: -min(-1, -1.6) = 1.6, -min(-2.6, -2.4) = 2.6
    expected = (-1.1 - 1.2 - 0.7 + 1.6 + 2.6) / 5
    assert expected == pytest.approx(0.24)
    assert expected == pytest.approx(sum(ppo_token(R[i][t], A[i]) for i, t in masked_tokens()) / 5)
    loss, met = losses.policy_loss(logp, old, adv, m, variant="grpo")
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert met["clip_frac_high"] == pytest.approx(1 / 5)  # r=1.5, A>0
    assert met["clip_frac_low"] == pytest.approx(1 / 5)  # r=0.5, A<0
    assert met["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.7 + 0.5 + 1.3) / 5)
    assert met["ratio_max"] == pytest.approx(1.5)
    k3 = [r - 1 - math.log(r) for r in (1.1, 1.5, 0.7, 0.5, 1.3)]  # KL(old||new), samples from old
    assert met["approx_kl"] == pytest.approx(sum(k3) / 5)
    assert "dual_clip_frac" not in met
    # read back once per step, by the caller
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in met.values())


def test_grpo_gradient_zero_where_clipped():
    logp, old, adv, m = make_case()
    loss, _ = losses.policy_loss(logp, old, adv, m, variant="grpo")
    loss.backward()
    # d/dlogp of -r*A is -r*A (unclipped), 0 where the clipped branch is the min
    expected = [[-1.1 / 5, 0.0, -0.7 / 5], [0.0, 2.6 / 5, 0.0]]
    for i in range(2):
        assert logp.grad[i].tolist() == pytest.approx(expected[i], abs=1e-12)


@pytest.mark.parametrize(
    "agg,expected",
    [
        ("token-mean", 1.2 / 5),
        ("seq-mean-token-mean", ((-1.1 - 1.2 - 0.7) / 3 + (1.6 + 2.6) / 2) / 2),  # 0.55
        ("seq-mean-token-sum", ((-1.1 - 1.2 - 0.7) + (1.6 + 2.6)) / 2),  # 0.6
        ("seq-mean-token-sum-norm", ((-1.1 - 1.2 - 0.7) + (1.6 + 2.6)) / 2 / 3),  # 0.2
    ],
)
def test_agg_modes_by_hand_and_fully_masked_sequence_excluded(agg, expected):
    logp, old, adv, m = make_case()
    loss, _ = losses.policy_loss(logp, old, adv, m, agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    # a third, fully masked sequence does not count in any mean
    logp3, old3, adv3, m3 = make_case(R + [[2.0, 2.0, 2.0]], MASK + [[0, 0, 0]], A + [5.0])
    loss3, _ = losses.policy_loss(logp3, old3, adv3, m3, agg=agg)
    assert loss3.item() == pytest.approx(expected, rel=1e-9)


def test_agg_sum_norm_custom_max_len():
    logp, old, adv, m = make_case()
    loss, _ = losses.policy_loss(
        logp, old, adv, m, variant="dr_grpo", agg="seq-mean-token-sum-norm", max_len=4
    )
    assert loss.item() == pytest.approx(0.6 / 4)


@pytest.mark.parametrize("agg", losses.AGGS)
@pytest.mark.parametrize("variant", losses.VARIANTS)
def test_all_masked_batch_gives_zero_with_graph(variant, agg):
    logp, old, adv, _ = make_case()
    m = torch.zeros(2, 3, dtype=torch.bool)
    loss, met = losses.policy_loss(logp, old, adv, m, variant=variant, agg=agg)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert met["ratio_mean"] == 0.0 and met["clip_frac_high"] == 0.0


def test_float_mask_and_per_token_advantages_match():
    logp, old, adv, m = make_case()
    loss_b, _ = losses.policy_loss(logp, old, adv, m)
    adv_tok = adv[:, None].expand(2, 3).clone()
    adv_tok[1, 2] = 1e6  # padding advantage is ignored
    loss_f, _ = losses.policy_loss(logp, old, adv_tok, m.double())
    assert loss_f.item() == pytest.approx(loss_b.item(), rel=1e-12)


def test_dual_clip():
    logp, old, adv, m = make_case()
    loss, met = losses.policy_loss(logp, old, adv, m, dual_clip=1.25)
    # only the A=-2, r=1.3 token exceeds c: its loss min(2.6, 1.25*2) = 2.5
    expected = (-1.1 - 1.2 - 0.7 + 1.6 + 2.5) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert met["dual_clip_frac"] == pytest.approx(1 / 5)
    loss.backward()
    assert logp.grad[1, 1].item() == 0.0  # bounded -> no gradient
    # a dual clip above every ratio changes nothing
    loss2, met2 = losses.policy_loss(logp, old, adv, m, dual_clip=3.0)
    assert loss2.item() == pytest.approx(0.24) and met2["dual_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        losses.policy_loss(logp, old, adv, m, dual_clip=0.9)


def test_dapo_default_eps_high():
    logp, old, adv, m = make_case()
    loss, met = losses.policy_loss(logp, old, adv, m, variant="dapo")
    # r=1.5 with A>0 is now clipped at 1.28 instead of 1.2
    expected = (-1.1 - 1.28 - 0.7 + 1.6 + 2.6) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert met["clip_frac_high"] == pytest.approx(1 / 5)
    # r=1.25, A>0: clipped by grpo (eps .2), not by dapo (eps_high .28)
    lp, o, a, mm = make_case([[1.25]], [[1]], [1.0])
    assert losses.policy_loss(lp, o, a, mm, variant="grpo")[0].item() == pytest.approx(-1.2)
    assert losses.policy_loss(lp, o, a, mm, variant="dapo")[0].item() == pytest.approx(-1.25)
    # an explicit eps_high wins; eps_low stays as passed
    assert losses.policy_loss(lp, o, a, mm, variant="dapo", eps_high=0.1)[
        0
    ].item() == pytest.approx(-1.1)
    lp2, o2, a2, mm2 = make_case([[0.7]], [[1]], [-1.0])
    assert losses.policy_loss(lp2, o2, a2, mm2, variant="dapo")[0].item() == pytest.approx(0.8)


def test_dr_grpo_equals_grpo_surrogate():
    logp, old, adv, m = make_case()
    a, _ = losses.policy_loss(logp, old, adv, m, variant="dr_grpo", agg="seq-mean-token-sum-norm")
    b, _ = losses.policy_loss(logp, old, adv, m, variant="grpo", agg="seq-mean-token-sum-norm")
    assert a.item() == pytest.approx(b.item()) and a.item() == pytest.approx(0.2)


def test_weights_multiply_per_token_loss():
    logp, old, adv, m = make_case()
    w = torch.tensor([[2.0, 0.0, 1.0], [0.5, 1.0, 7.0]], dtype=torch.float64)
    loss, _ = losses.policy_loss(logp, old, adv, m, weights=w)
    expected = (2 * -1.1 + 0 * -1.2 + 1 * -0.7 + 0.5 * 1.6 + 1 * 2.6) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------------
# gspo
# ---------------------------------------------------------------------------

GR = [[1.1, 1.5, 0.7], [0.5, 1.3, 1.0], [1.5, 1.5, 1.0]]
GMASK = [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
GA = [1.0, -2.0, 1.0]


def gspo_hand():
    s = [
        math.exp(sum(math.log(GR[i][t]) for t in range(3) if GMASK[i][t]) / sum(GMASK[i]))
        for i in range(3)
    ]
    per_seq = [ppo_token(s[i], GA[i]) for i in range(3)]  # one surrogate per sequence
    return s, per_seq


def test_gspo_values_by_hand():
    s, per_seq = gspo_hand()
    assert s[0] == pytest.approx((1.1 * 1.5 * 0.7) ** (1 / 3))  # 1.0492
    assert s[1] == pytest.approx(math.sqrt(0.65))  # 0.8062, unclipped
    assert per_seq[2] == pytest.approx(-1.2)  # s=1.5 > 1.2, A>0: clipped
    logp, old, adv, m = make_case(GR, GMASK, GA)
    loss, met = losses.policy_loss(logp, old, adv, m, variant="gspo", agg="token-mean")
    assert loss.item() == pytest.approx(
        (3 * per_seq[0] + 2 * per_seq[1] + 2 * per_seq[2]) / 7, rel=1e-9
    )
    loss, met = losses.policy_loss(logp, old, adv, m, variant="gspo", agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(sum(per_seq) / 3, rel=1e-9)
    # clip fractions use the sequence ratio (counted per token): seq 2's 2 tokens
    assert met["clip_frac_high"] == pytest.approx(2 / 7)
    assert met["clip_frac_low"] == 0.0
    assert met["ratio_max"] == pytest.approx(1.5)


def test_gspo_gradient_is_the_papers():
    s, _ = gspo_hand()
    logp, old, adv, m = make_case(GR, GMASK, GA)
    loss, _ = losses.policy_loss(logp, old, adv, m, variant="gspo", agg="seq-mean-token-mean")
    loss.backward()
    # paper: grad of J_i = s_i A_i (1/|y_i|) sum_t grad logp_t for unclipped
    # sequences; the loss is -(1/3) sum_i J_i, so dL/dlogp_t = -A_i s_i / |y_i| / 3
    expected = [
        [-GA[0] * s[0] / 3 / 3] * 3,
        [-GA[1] * s[1] / 2 / 3] * 2 + [0.0],
        [0.0, 0.0, 0.0],  # clipped sequence: no gradient
    ]
    for i in range(3):
        assert logp.grad[i].tolist() == pytest.approx(expected[i], rel=1e-9, abs=1e-12)
    # under token-mean each token of an unclipped sequence gets -A_i s_i / N
    logp, old, adv, m = make_case(GR, GMASK, GA)
    losses.policy_loss(logp, old, adv, m, variant="gspo", agg="token-mean")[0].backward()
    assert logp.grad[0].tolist() == pytest.approx([-GA[0] * s[0] / 7] * 3, rel=1e-9)
    assert logp.grad[1, :2].tolist() == pytest.approx([-GA[1] * s[1] / 7] * 2, rel=1e-9)


def test_gspo_gradient_matches_true_sequence_ratio():
    # the token form has the same gradient as differentiating s_i itself
    logp, old, adv, m = make_case(GR, GMASK, GA)
    losses.policy_loss(logp, old, adv, m, variant="gspo", agg="seq-mean-token-mean")[0].backward()
    lp2 = logp.detach().clone().requires_grad_(True)
    total = 0.0
    for i in range(3):
        idx = [t for t in range(3) if GMASK[i][t]]
        s_i = torch.exp((lp2[i, idx] - old[i, idx]).mean())
        total = total + -torch.min(s_i * GA[i], s_i.clamp(0.8, 1.2) * GA[i])
    (total / 3).backward()
    assert torch.allclose(logp.grad, lp2.grad, atol=1e-12)


def test_gspo_per_token_advantages_use_masked_mean():
    logp, old, adv, m = make_case(GR, GMASK, GA)
    ref, _ = losses.policy_loss(logp, old, adv, m, variant="gspo")
    adv_tok = torch.tensor(
        [[0.5, 1.5, 1.0], [-1.0, -3.0, 99.0], [1.0, 1.0, -50.0]], dtype=torch.float64
    )
    got, _ = losses.policy_loss(logp, old, adv_tok, m, variant="gspo")
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)


# ---------------------------------------------------------------------------
# cispo
# ---------------------------------------------------------------------------


def test_cispo_values_and_gradient_through_clipped_tokens():
    logp, old, adv, m = make_case()
    loss, met = losses.policy_loss(logp, old, adv, m, variant="cispo")
    lp = [[-1 + math.log(r) for r in row] for row in R]
    w = [[min(r, 1.2) for r in row] for row in R]
    expected = sum(-w[i][t] * A[i] * lp[i][t] for i, t in masked_tokens()) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    loss.backward()
    grad = logp.grad
    # d/dlogp_t = -min(r, 1+eps_high) * A / N, nonzero where r > 1.2
    for i, t in masked_tokens():
        assert grad[i, t].item() == pytest.approx(-w[i][t] * A[i] / 5, rel=1e-9)
    assert grad[0, 1].item() == pytest.approx(-1.2 / 5)  # r=1.5 > 1.2, A>0: still a gradient
    assert grad[1, 1].item() == pytest.approx(-1.2 * -2 / 5)  # r=1.3, A<0: capped weight
    assert grad[1, 2].item() == 0.0  # padding
    # metrics: the cap is active for r=1.5 and r=1.3 (both signs of A)
    assert met["clip_frac_high"] == pytest.approx(2 / 5)
    # grpo, by contrast, has no gradient on the clipped r=1.5, A>0 token
    logp2, old2, adv2, m2 = make_case()
    losses.policy_loss(logp2, old2, adv2, m2, variant="grpo")[0].backward()
    assert logp2.grad[0, 1].item() == 0.0


def test_unknown_variant_and_agg():
    logp, old, adv, m = make_case()
    with pytest.raises(
        ValueError, match=r"unknown policy-loss variant 'ppo2'.*grpo.*dapo.*dr_grpo.*gspo.*cispo"
    ):
        losses.policy_loss(logp, old, adv, m, variant="ppo2")
    with pytest.raises(ValueError, match=r"unknown agg 'mean'.*token-mean"):
        losses.policy_loss(logp, old, adv, m, agg="mean")


# ---------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------


def test_kl_penalty_kinds():
    lp = [[-1.0, -2.0], [-0.5, -3.0]]
    ref = [[-1.5, -1.0], [-0.5, -2.0]]
    logp, ref_logp = torch.tensor(lp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    for kind, f in [
        ("k1", lambda a, b: a - b),
        ("k2", lambda a, b: 0.5 * (a - b) ** 2),
        ("k3", lambda a, b: math.exp(b - a) - (b - a) - 1),
    ]:
        got = losses.kl_penalty(logp, ref_logp, kind=kind)
        assert got.shape == (2, 2)
        for i in range(2):
            for j in range(2):
                assert got[i, j].item() == pytest.approx(f(lp[i][j], ref[i][j]), abs=1e-12)
    # written out: k3 at logp=-2, ref=-1: e^1 - 1 - 1
    assert losses.kl_penalty(logp, ref_logp)[0, 1].item() == pytest.approx(math.e - 2)
    assert losses.kl_penalty(logp, ref_logp)[1, 0].item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        losses.kl_penalty(logp, ref_logp, kind="k4")


# ---------------------------------------------------------------------------
# behaviour_weights
# ---------------------------------------------------------------------------

BR = [[0.6, 1.0, 3.0], [1.5, 0.2, 1.0]]  # rho = exp(old - behaviour)
BMASK = [[1, 1, 1], [1, 1, 0]]


def behaviour_case():
    beh = torch.full((2, 3), -2.0, dtype=torch.float64)
    old = beh + torch.tensor(BR, dtype=torch.float64).log()
    old[1, 2] = 60.0  # padding garbage (rho would overflow to inf)
    old.requires_grad_(True)
    return old, beh, torch.tensor(BMASK, dtype=torch.bool)


def test_behaviour_weights_token_truncate_and_mask():
    old, beh, m = behaviour_case()
    w = losses.behaviour_weights(old, beh, m, level="token", mode="truncate", high=2.0)
    assert not w.requires_grad
    assert sum(w.tolist(), []) == pytest.approx(sum([[0.6, 1.0, 2.0], [1.5, 0.2, 0.0]], []))
    w = losses.behaviour_weights(old, beh, m, level="token", mode="mask", high=2.0)  # low = 1/2
    assert w.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    w = losses.behaviour_weights(old, beh, m, level="token", mode="mask", low=0.1, high=4.0)
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_behaviour_weights_sequence_truncate_and_mask():
    old, beh, m = behaviour_case()
    # seq 0: 0.6 * 1 * 3 = 1.8; seq 1: 1.5 * 0.2 = 0.3 (padding excluded)
    w = losses.behaviour_weights(old, beh, m, level="sequence", mode="truncate", high=2.0)
    assert sum(w.tolist(), []) == pytest.approx(sum([[1.8, 1.8, 1.8], [0.3, 0.3, 0.0]], []))
    w = losses.behaviour_weights(old, beh, m, level="sequence", mode="truncate", high=1.2)
    assert sum(w.tolist(), []) == pytest.approx(sum([[1.2, 1.2, 1.2], [0.3, 0.3, 0.0]], []))
    w = losses.behaviour_weights(old, beh, m, level="sequence", mode="mask", high=2.0)
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # 0.3 < 1/2 drops seq 1


def test_behaviour_weights_off_and_errors():
    old, beh, m = behaviour_case()
    assert losses.behaviour_weights(old, beh, m, mode="off").tolist() == [[1.0] * 3] * 2
    with pytest.raises(ValueError, match="unknown behaviour-weight mode 'clip'"):
        losses.behaviour_weights(old, beh, m, mode="clip")
    with pytest.raises(ValueError, match="unknown behaviour-weight level 'batch'"):
        losses.behaviour_weights(old, beh, m, level="batch")
