"""trainer/logprobs.py — log-probs of sampled tokens under the distribution the generator samples
from.

Role: the trainer scores its tokens here (update.py's `completion_logprobs` calls `score_tokens`):
the model's final hidden states through the LM head, with the family's transform (heads.py gives it
as plain numbers), then / temperature and vLLM 0.32's top-k/top-p kept set, a chunk of tokens at a
time, never holding the batch's logits; `token_logprobs` and `entropy_from_logits` do the same from
logits (tests, benchmarks).
Data contract (B sequences, T completion positions, N scored tokens, V vocabulary, H hidden size):
logits (..., V), tokens (...) long -> log-probs (...) float32; hidden (N, H), weight (V, H);
`score_tokens` returns (B, T) tensors, 0 off the mask (packed: the model runs the rows' real tokens
as one row, the results are the same). A sampled token outside the kept set gets
-inf (callers mask or weight it).
May touch: nothing but its arguments (no optimizer, process, I/O or state); copies out alone (torch
only).
"""

from dataclasses import dataclass

import torch


# ---------- The family's head: what vLLM applies between the final hidden state and the logits
# (read from vLLM 0.32's model_executor/models/*.py, `LogitsProcessor(scale=..., soft_cap=...)`,
# and each family's `*ForCausalLM.forward` in transformers 5; trainer/heads.py says why a model
# outside these tables, or a config vLLM would serve otherwise, is refused)
@dataclass(frozen=True)
class HeadTransform:
    """logits = logit_scale * softcap * tanh(((hidden_scale * hidden) @ W.T + b) / softcap), in the
    matmul's dtype as vLLM's LogitsProcessor (logprobs._head_logits); then float32, / temperature,
    top-k/top-p (vLLM's sampler). softcap 0: no soft-capping."""

    hidden_scale: float = 1.0  # on the final hidden state, before the head
    logit_scale: float = 1.0  # on the logits, after the soft cap (vLLM's LogitsProcessor `scale`)
    softcap: float = 0.0  # cap * tanh(x / cap) (Gemma-2/3's final_logit_softcapping)


PLAIN = HeadTransform()

# model_type (config.json) -> the architecture vLLM
# serves it as, and how its head's transform is read
PLAIN_HEADS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "afmoe": "AfmoeForCausalLM",
}
TRANSFORMED_HEADS = {
    # logits / logits_scaling (vLLM: scale = 1 / logits_scaling)
    "granite": ("GraniteForCausalLM", lambda c: HeadTransform(logit_scale=1.0 / c.logits_scaling)),
    "granitemoe": (
        "GraniteMoeForCausalLM",
        lambda c: HeadTransform(logit_scale=1.0 / c.logits_scaling),
    ),
    "granitemoeshared": (
        "GraniteMoeSharedForCausalLM",
        lambda c: HeadTransform(logit_scale=1.0 / c.logits_scaling),
    ),
    # final_logit_softcapping * tanh(logits / final_logit_softcapping), None: off
    "gemma2": (
        "Gemma2ForCausalLM",
        lambda c: HeadTransform(softcap=c.final_logit_softcapping or 0.0),
    ),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        lambda c: HeadTransform(softcap=c.final_logit_softcapping or 0.0),
    ),
    # logits * logit_scale
    "cohere": ("CohereForCausalLM", lambda c: HeadTransform(logit_scale=c.logit_scale)),
    "cohere2": ("Cohere2ForCausalLM", lambda c: HeadTransform(logit_scale=c.logit_scale)),
    "cohere2_moe": ("Cohere2MoeForCausalLM", lambda c: HeadTransform(logit_scale=c.logit_scale)),
}


def head_of(config) -> HeadTransform:
    """The head transform of a Hugging Face config (its `model_type`); ValueError for a family in
    neither table (trainer/heads.head_problem checks a run's models before it starts)."""
    model_type = getattr(config, "model_type", None)
    if model_type in TRANSFORMED_HEADS:
        return TRANSFORMED_HEADS[model_type][1](config)
    if model_type in PLAIN_HEADS:
        return PLAIN
    raise ValueError(f"model type {model_type!r}: its LM head is not one this trainer scores")


# ---------- Log-probs consistent with the generator's sampler -------------------------------------


def token_logprobs(logits, tokens, temperature=1.0, top_k=-1, top_p=1.0, exact_top_k=None):
    """log p(tokens) under the distribution vLLM samples from: logits (..., V), tokens (...) long ->
    (...) float32. Mirrors vLLM 0.32's sampler (v1/sample/sampler.py: float32 logits / temperature;
    then, on CPU, ops/topk_topp_sampler.py apply_top_k_top_p_pytorch), then log_softmax over the
      kept set ("processed_logprobs"). top_k on iff 0 < top_k < V: every logit >= the k-th largest
      is kept (ties at the k-th all kept). top_p on iff top_p < 1, on the top-k set: sort ascending,
        softmax, cumsum; a token is removed iff its cumsum <= 1 - top_p (float32, as vLLM), the
        largest always kept: the smallest top set reaching top_p; boundary ties follow the sort
        order (lower vocabulary indices dropped first).
    A sampled token just outside the kept set here (the two sides' logits differ in the last bits)
    gets -inf: callers mask or weight it. Recorded log-probs match this only with
    logprobs_mode="processed_logprobs". On CUDA (exact_top_k None and CUDA logits, or True) the kept
    set is vLLM's Triton kernel's (topk_topp_triton.py; FlashInfer is never used with processed
    log-probs): exactly k tokens, ties by lowest index (`_cuda_kept_set`); where the kernel is
    inexact (top-p ties within 1e-9, pivot searches of 18 steps) it may differ. Checked on CPU
    tensors against a reading of the kernel, never yet on a GPU."""
    x = sampling_logits(logits, temperature, top_k, top_p, exact_top_k)
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def sampling_logits(logits, temperature=1.0, top_k=-1, top_p=1.0, exact_top_k=None):
    """The float32 logits (..., V) vLLM samples from: / temperature, -inf outside the top-k/top-p
    set (rules in `token_logprobs`; exact_top_k: vLLM's CUDA rule, None: on CUDA logits).
    Differentiable on the kept set."""
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (greedy decoding has no log-probs to train on), got "
            f"{temperature}"
        )
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    vocab = logits.shape[-1]
    use_top_k = 0 < top_k < vocab
    use_top_p = top_p < 1.0
    x = logits.float()
    if temperature != 1.0:  # like vLLM: true division by a (non-scalar) float32 temperature tensor
        x = x / torch.tensor([temperature], dtype=torch.float32, device=logits.device)
    if not (use_top_k or use_top_p):
        return x
    if logits.is_cuda if exact_top_k is None else exact_top_k:
        with torch.no_grad():
            keep = _cuda_kept_set(x.detach().reshape(-1, vocab), top_k if use_top_k else 0, top_p)
        return x.masked_fill(~keep.reshape(x.shape), -float("inf"))
    with torch.no_grad():
        flat = x.detach().reshape(-1, vocab)
        if not use_top_p:  # vLLM apply_top_k_only: no full sort
            kth = flat.topk(top_k, dim=-1).values[:, -1:]
            keep = flat >= kth
        else:
            logits_sort, logits_idx = flat.sort(dim=-1, descending=False)
            if use_top_k:
                kth = logits_sort[:, vocab - top_k].unsqueeze(-1)
                logits_sort.masked_fill_(logits_sort < kth, -float("inf"))
            probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
            p = torch.tensor(top_p, dtype=torch.float32, device=flat.device)
            removed_sorted = probs_sum <= 1 - p
            removed_sorted[:, -1] = False  # at least one token
            keep = torch.ones_like(removed_sorted).scatter_(-1, logits_idx, ~removed_sorted)
        keep = keep.reshape(x.shape)
    return x.masked_fill(~keep, -float("inf"))


def _cuda_kept_set(flat, top_k, top_p):
    """(N, V) bool: what vLLM 0.32's Triton kernel keeps on CUDA (top_k 0: off). Top-k: exactly k,
    ties at the k-th logit by lowest index (the kernel walks the row in index order). Top-p on that
    set: the smallest top set reaching top_p, ties by lowest index, but a boundary at the k-th logit
    keeps every token equal to it."""
    # a stable descending sort orders ties by index:
    # its first k positions are the kernel's top-k set
    values, order = flat.sort(dim=-1, descending=True, stable=True)
    ranked_keep = torch.ones_like(values, dtype=torch.bool)
    if top_k:
        ranked_keep[:, top_k:] = False
    if top_p < 1.0:
        probs = values.masked_fill(~ranked_keep, -float("inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the tokens ranked above
        ranked_keep &= mass_before < torch.tensor(top_p, dtype=torch.float32, device=flat.device)
        if top_k:  # the boundary token's value: at the k-th logit, every token equal to it survives
            boundary = values.gather(-1, (ranked_keep.sum(-1, keepdim=True) - 1).clamp(min=0))
            ranked_keep |= (boundary == values[:, top_k - 1 : top_k]) & (values == boundary)
    return torch.zeros_like(ranked_keep).scatter_(-1, order, ranked_keep)


# ---------- Log-probs straight from hidden states, a chunk of tokens at a time --------------------

# Logits `chunked_logprobs` makes at once, by device. The head's weight gradient is a GEMM over a
# chunk's tokens that writes the whole (V, H) gradient, so a chunk must hold enough tokens: on a CPU
# 2**25 float32 values (128 MiB; 220 tokens of a 151,936-token vocabulary) cost the same per token
# as 2**24 and 2**26 with V = 32,768 and 0.71x 2**24's with V = 151,936 (110 tokens); on an H200,
# 2**28 (1 GiB; 1,766 tokens) took the step from 0.68 to 0.81 of a plain loop's speed, 0.95 with the
# GEMM in bf16 (notes/gpu-h200.md). This bound, not the batch, sets the head's memory.
LOGIT_CHUNK_ELEMENTS = 2**25
LOGIT_CHUNK_ELEMENTS_BY_DEVICE = {"cpu": LOGIT_CHUNK_ELEMENTS, "cuda": 2**28}
# torch's matmul of bf16/fp16 operands into a float32 result (CUDA kernels only)
_MM_INTO_FLOAT32 = "dtype" in torch.ops.aten.mm.overloads()


def logit_chunk_elements(device):
    """How many logits `chunked_logprobs` makes at once on `device` (a torch.device or its name):
    LOGIT_CHUNK_ELEMENTS_BY_DEVICE's value for its type, the CPU's for a type not listed. Its
    forward and backward hold up to three float32 arrays of that many values (the logits; their
    exponentials or the tanh slope; a copy / temperature) and the matmul's output in the weight's
    dtype: 3.5 GiB on a GPU with a bf16 head. Top-k/top-p add their sort's (values, int64 indices,
    softmax, cumulative sums: up to 5 more), a bf16 weight's gradient a (V, H) float32 product."""
    kind = torch.device(device).type
    return LOGIT_CHUNK_ELEMENTS_BY_DEVICE.get(kind, LOGIT_CHUNK_ELEMENTS)


def chunked_logprobs(
    hidden,
    weight,
    bias,
    tokens,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    hidden_scale=1.0,
    logit_scale=1.0,
    softcap=0.0,
    chunk_elements=None,
):
    """`token_logprobs(head(hidden), tokens, ...)` and the entropy of the same distribution, never
    holding more than ~`chunk_elements` logits (None: `logit_chunk_elements` of hidden's device).
    The family's head (heads.HeadTransform, `_head_logits`), then / temperature and top-k/top-p as
    vLLM does: head(h) = logit_scale * softcap * tanh(((hidden_scale * h) @ weight.T + bias) /
    softcap) (softcap 0: no tanh). hidden (N, H) at the positions to score, weight (V, H), bias (V,)
    or None, tokens (N,) long -> logp (N,) float32 (a gradient to hidden, weight, bias) and the
    detached entropy (N,) of the sampling distribution. Chunks of max(1, chunk_elements // V)
    tokens; the backward recomputes each chunk's logits and applies the gradient in closed form, d
    logp_t / d x = (onehot(t) - p) / temperature (p: the kept-set softmax), through d x / d z =
    logit_scale * (1 - tanh^2(z / softcap)): no chunk's logits outlive it. Gradients come in the
    weight's dtype: in float32, float32 GEMMs throughout; in bf16/fp16 (a mixed-precision model),
    d logp / d z is rounded to that dtype for both GEMMs, as autograd through the model's own bf16
    logits would, and the weight's is accumulated over chunks in float32
    (`_add_weight_gradient`)."""
    if chunk_elements is None:
        chunk_elements = logit_chunk_elements(hidden.device)
    chunk = max(1, chunk_elements // weight.shape[0])
    # (an autograd Function's `apply` takes no keywords: its arguments in `forward`'s order)
    return _ChunkedLogprobs.apply(
        hidden,
        weight,
        bias,
        tokens,
        (temperature, top_k, top_p),
        (hidden_scale, logit_scale, softcap),
        chunk,
    )


def score_tokens(
    model,
    decoder,
    lm_head,
    input_ids,
    attention_mask,
    targets,
    mask,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    untruncated=False,
    packed=False,
    **head,
):
    """(logp, entropy, logp_untruncated or None), each (B, T), 0 off `mask`: `chunked_logprobs` of
    `targets` at the `mask` positions, without logits. `model` (a causal LM: plain, FSDP2 or PEFT)
    runs with logits_to_keep=[] (`final_hidden_states`; packed: its rows without their padding, as
    one); `lm_head` (a DTensor weight is gathered) and the family's transform `head` (hidden_scale,
    logit_scale, softcap) run at the masked positions only (FSDP2's root keeps the head gathered
    until the backward ends). untruncated: also under the temperature alone."""
    hidden = final_hidden_states(model, decoder, input_ids, attention_mask, packed)
    # where completion tokens are predicted: position t of a row predicts its target t
    if packed:
        hidden = hidden[0, packed_index(attention_mask)[:, :-1][mask]]
    else:
        hidden = hidden[:, :-1][mask]
    tokens = targets[mask]
    weight, bias = lm_head.weight, lm_head.bias
    if hasattr(weight, "full_tensor"):
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
    logp, entropy = chunked_logprobs(
        hidden, weight, bias, tokens, temperature, top_k=top_k, top_p=top_p, **head
    )
    full = None
    if untruncated:  # (the KL term's distribution: the temperature alone)
        full = (
            chunked_logprobs(hidden, weight, bias, tokens, temperature, **head)[0]
            if 0 < top_k < weight.shape[0] or top_p < 1
            else logp
        )
    return tuple(
        None if v is None else mask.new_zeros(mask.shape, dtype=v.dtype).masked_scatter(mask, v)
        for v in (logp, entropy, full)
    )


def final_hidden_states(model, decoder, input_ids, attention_mask, packed=False):
    """The decoder's last hidden states, caught by a hook on `decoder` (the model runs with
    logits_to_keep=[] and no cache): (B, L, H) for the (B, L) rows as they are; packed, (1, N, H)
    for their N real tokens in one row (sequence packing: no padding runs), each row's position ids
    restarting at 0 and no attention mask, from which transformers 5 builds a causal mask that keeps
    every row to itself (masking_utils.find_packed_sequence_indices); the rows' bounds go along as
    the attention kwargs flash-attention's varlen kernels read (cu_seq_lens_q, max_length_q: the
    project's row-wise attention, packing.py, reads them too). `packed_index` says where each token
    went."""
    caught = []
    hook = decoder.register_forward_hook(
        lambda _, __, out: caught.append(
            out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        )
    )
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if packed:
        keep = attention_mask.bool()
        lengths = keep.sum(1)
        bounds = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        inputs = dict(
            input_ids=input_ids[keep][None],
            position_ids=(keep.cumsum(1) - 1)[keep][None],
            attention_mask=None,
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=longest,
            max_length_k=longest,
        )
    try:
        model(
            **inputs,
            use_cache=False,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
        )
    finally:
        hook.remove()
    return caught[0]


def packed_index(attention_mask):
    """(B, L) long: where each real token of the rows sits among the packed tokens (rows in order,
    each without its padding; -1 on padding)."""
    keep = attention_mask.bool()
    return torch.where(keep, keep.flatten().cumsum(0).reshape(keep.shape) - 1, -1)


def _head_logits(h, weight, bias, head, slope=False):
    """float32 logits of a chunk through the family's transform `head` = (hidden_scale, logit_scale,
    softcap); with slope, also d logits / d z in float32 (None where it is the constant
    logit_scale). As vLLM 0.32's LogitsProcessor.forward (model_executor/layers/logits_processor.py)
    does it: the soft cap (/ cap, tanh, * cap), then the scale, each in the matmul's output dtype
    (vLLM's head_dtype, by default the serving dtype: bf16 matmul outputs are capped in bf16), then
    float32 (its sampler). In float32 nothing differs; Gemma-2's cap of 30 applied in float32 after
    a bf16 matmul moved sampled tokens' log-probs by 0.04 nats on average, 0.19 at most
    (tests/test_heads.py's bf16 case; a scale of 0.3 alone: 0.012, 0.078)."""
    hidden_scale, logit_scale, softcap = head
    x = torch.nn.functional.linear(h * hidden_scale if hidden_scale != 1 else h, weight, bias)
    dx_dz = None
    if softcap:
        x = x.div_(softcap).tanh_()
        if slope:  # 1 - tanh^2 in one new float32 array (a copy: float32 `x.float()` is x)
            dx_dz = x.to(torch.float32, copy=True).square_().neg_().add_(1).mul_(logit_scale)
        x.mul_(softcap)
    if logit_scale != 1:
        x.mul_(logit_scale)
    return (x.float(), dx_dz) if slope else x.float()


def _add_weight_gradient(grad_weight, grad_z, h, scale):
    """grad_weight (V, H) float32 += scale * grad_z.T @ h, grad_z (n, V) and h (n, H) in the
    weight's dtype. float32: a float32 GEMM. bf16/fp16: on CUDA a GEMM in that dtype into a float32
    result (tensor cores; the float32 GEMM was a fifth of a step on an H200), on a CPU (no such
    kernel) a float32 GEMM of the same operands: the same exact products, summed in float32."""
    if grad_z.dtype == torch.float32:
        grad_weight.addmm_(grad_z.T, h, alpha=scale)
    elif grad_z.is_cuda and _MM_INTO_FLOAT32:
        grad_weight.add_(torch.mm(grad_z.T, h, out_dtype=torch.float32), alpha=scale)
    else:
        grad_weight.addmm_(grad_z.T.float(), h.float(), alpha=scale)


class _ChunkedLogprobs(torch.autograd.Function):
    """Each chunk's logits are made, used in place and dropped within its iteration (autograd
    records nothing inside a Function's forward and backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, sampling, head, chunk):
        logp, entropy, lse = [], [], []
        for h, t in zip(hidden.split(chunk), tokens.split(chunk)):
            x = sampling_logits(_head_logits(h, weight, bias, head), *sampling)
            top = x.max(dim=-1, keepdim=True).values
            shifted = x.sub_(top)  # <= 0, -inf outside the kept set
            e = shifted.exp()
            total = e.sum(dim=-1, keepdim=True)
            log_total = total.log()
            logp.append((shifted.gather(-1, t[:, None]) - log_total).squeeze(-1))
            # entropy = log_total - sum_v p_v shifted_v over the kept set, p = e / total: an
            # elementwise product in place of e (0 * the clamped -inf outside it)
            shifted.clamp_(min=torch.finfo(x.dtype).min)
            mean_shifted = e.mul_(shifted).sum(dim=-1, keepdim=True).div_(total)
            entropy.append((log_total - mean_shifted).squeeze(-1))
            lse.append((top + log_total).squeeze(-1))
        empty = hidden.new_zeros(0, dtype=torch.float32)
        lse = torch.cat(lse) if lse else empty
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.sampling, ctx.head, ctx.chunk = sampling, head, chunk
        entropy = torch.cat(entropy) if entropy else empty
        ctx.mark_non_differentiable(entropy)
        return (torch.cat(logp) if logp else empty), entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = hidden.new_zeros(hidden.shape) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        temperature, (hidden_scale, logit_scale, _) = ctx.sampling[0], ctx.head
        start = 0
        for h, t, norm, g in zip(
            hidden.split(ctx.chunk),
            tokens.split(ctx.chunk),
            lse.split(ctx.chunk),
            grad_logp.split(ctx.chunk),
        ):
            x, dx_dz = _head_logits(h, weight, bias, ctx.head, slope=True)
            x = sampling_logits(x, *ctx.sampling)
            # d logp / d logits = (onehot(t) - p) / temperature, times the incoming gradient g
            g = (g / temperature)[:, None]
            grad_x = x.sub_(norm[:, None]).exp_().mul_(-g)  # p, in place of the recomputed logits
            grad_x.scatter_add_(-1, t[:, None], g)
            # through the transform: d logp / d z, z = (hidden_scale * h) @ weight.T + bias
            if dx_dz is not None or logit_scale != 1:
                grad_x.mul_(dx_dz if dx_dz is not None else logit_scale)
            if need_bias:
                grad_bias += grad_x.sum(0)
            grad_z = grad_x.to(weight.dtype)  # the matmuls' dtype (no copy in float32)
            del x, dx_dz, grad_x
            if need_hidden:
                rows = grad_hidden[start : start + len(h)]
                torch.mm(grad_z, weight, out=rows)
                if hidden_scale != 1:
                    rows.mul_(hidden_scale)
            if need_weight:
                _add_weight_gradient(grad_weight, grad_z, h, hidden_scale)
            start += len(h)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def entropy_from_logits(logits, temperature=1.0):
    """Per-position entropy H = -sum_v p_v log p_v of softmax(logits / T),
    float32, shape logits.shape[:-1]; -inf logits contribute 0 (for logging)."""
    x = logits.float() / temperature
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)
