"""losses.py — the GRPO loss family: functions on tensors (no optimizer, process, I/O or state; torch only).

Role: update.py takes log-probs from `score_tokens` (no logits), distillation's per-token advantages from
`distill_advantages` (the batch's: advantages.py), off-policy corrections from `behaviour_weights` and the masks
beside it, the loss from `policy_loss` (+ `kl_penalty`).
Data contract (B sequences, T padded completion length, V vocabulary): log-probs, weights
(B, T) float; advantages (B,) or (B, T); mask (B, T), True on completion tokens; logits (..., V). Masked-out
positions never reach a result, and results there are 0. A loss: a scalar with its graph, a dict of 0-d tensors.
Variants of `policy_loss`: grpo, dapo, dr_grpo, gspo, cispo (all minimise; formulas in its docstring)."""

import torch

VARIANTS = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
IS_LEVELS, IS_MODES = ("token", "sequence"), ("truncate", "mask", "off")  # of `behaviour_weights`


# ---------- Per-token advantages (a batch's, from its rewards: advantages.py) ----------------------


def distill_advantages(advantages, logp, teacher_logp, mask, coef: float):
    """On-policy distillation (Thinking Machines 2025, "On-Policy Distillation"; tinker-cookbook's
    distillation/train_on_policy.py `incorporate_kl_penalty`, undiscounted). On tokens the student sampled,
    k_t = logp_t - teacher_logp_t estimates the reverse KL(student || teacher); A_t = A - coef * k_t, detached (an
    advantage, not a loss term). advantages: (B,) or (B, T). Returns (A_t, k), both (B, T), 0 off the mask."""
    m_bool, zeros = mask.bool(), torch.zeros_like(logp)
    k = torch.where(m_bool, logp.detach() - teacher_logp.detach(), zeros)
    task = (advantages[:, None].expand_as(k) if advantages.dim() == 1 else advantages).to(k.dtype)
    return torch.where(m_bool, task - coef * k, zeros), k


# ---------- Policy losses -------------------------------------------------------------------------


def _masked_mean(x, m_bool):
    """0-d tensor: the mean of x over True positions of m_bool (0 if none); never read back to the host here."""
    return torch.where(m_bool, x, torch.zeros_like(x)).sum() / m_bool.sum().clamp(min=1)


def aggregate(loss_tok, mask, agg="token-mean", max_len=None, units=None, seq_lens=None):
    """Reduce a per-token loss (B, T) to a scalar. token-mean: sum over masked tokens / their number (DAPO's
    token-level loss); seq-mean-token-mean: mean over sequences of each one's token sum / |o_i| (original GRPO);
    seq-mean-token-sum: of each one's token sum; seq-mean-token-sum-norm: seq-mean-token-sum / max_len, default
    T = mask.shape[-1] (Dr. GRPO: a constant normaliser instead of |y_i|). Fully masked sequences are left out
    of sequence means; an all-masked batch gives 0 with the graph attached (no NaN). units: the count to divide
    by (masked tokens for token-mean, else non-empty sequences), default this mask's; a micro-batch passes its
    whole step's (every micro-batch, every rank), so that the micro-batches' losses add up to the whole batch's.
    seq_lens (B,): each sequence's |o_i|, default its tokens in `mask`; update.py passes the tokens it trains
    before the off-policy masks, as `units` counts them (DeepSeek-V3.2's eq. 9: 1/|o_i| outside its mask M_it)."""
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")
    m_bool = mask.bool()
    loss_tok = torch.where(m_bool, loss_tok, torch.zeros_like(loss_tok))
    if agg == "token-mean":
        return loss_tok.sum() / (m_bool.sum().clamp(min=1) if units is None else max(units, 1))
    seq_len = m_bool.sum(dim=-1) if seq_lens is None else seq_lens
    valid = seq_len > 0
    seq_sum = loss_tok.sum(dim=-1)
    if agg == "seq-mean-token-mean":
        per_seq = seq_sum / seq_len.clamp(min=1)
    else:
        per_seq = seq_sum
    loss = (per_seq * valid).sum() / (valid.sum().clamp(min=1) if units is None else max(units, 1))
    if agg == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if max_len is None else max_len)
    return loss


def policy_loss(logp, old_logp, advantages, mask, variant="grpo", eps_low=0.2, eps_high=None, dual_clip=None,
                agg="token-mean", max_len=None, weights=None, units=None, seq_lens=None):
    """Policy-gradient loss of the GRPO family: (loss, metrics of `_clip_metrics`). r_t = exp(logp_t -
    old_logp_t); per-token losses (to minimise):
    grpo (Shao et al. 2024; PPO's clipped surrogate, Schulman et al. 2017):
        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
      dual_clip=c > 1 (Ye et al. 2020, dual-clip PPO): for A < 0, l_t = min(l_t, -c A): bounded by c|A|.
    dapo (Yu et al. 2025, DAPO): grpo with clip-higher, eps_high defaults to 0.28 (eps_low stays 0.2); meant
      with agg="token-mean".
    dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training"): the grpo surrogate; meant with
      group_advantages(scale="none") and agg="seq-mean-token-sum-norm".
    gspo (Zheng et al. 2025, Group Sequence Policy Optimization): s_i = exp( (1/|y_i|) sum_t (logp_t - old_logp_t) ),
        l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
      in the paper's token form (below); per-token advantages are reduced by their masked mean. The paper uses
      far smaller clip ranges (e.g. 3e-4 / 4e-4): pass them.
    cispo (MiniMax-M1, MiniMax 2025): l_t = -sg[min(r_t, 1 + eps_high)] A_t logp_t: the IS weight is clipped
      and detached, so every token keeps its gradient -min(r_t, 1 + eps_high) A_t (none is dropped as in PPO
      clipping); eps_low is unused (the paper sets no lower bound).
    advantages (B,) or (B, T); weights: optional (B, T) detached per-token weights (e.g. behaviour_weights)
    multiplied into l_t; agg/max_len/units/seq_lens: see `aggregate`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown policy-loss variant {variant!r}; expected one of {VARIANTS}")
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if eps_high is None:
        eps_high = 0.28 if variant == "dapo" else eps_low

    m_bool = mask.bool()
    zeros = torch.zeros_like(logp)
    old_logp = old_logp.detach()
    # log-ratio, zeroed off the mask so padding garbage can never overflow exp
    log_ratio = torch.where(m_bool, logp - old_logp, zeros)
    advantages = advantages.detach().to(logp.dtype)

    if variant == "gspo":
        seq_len = m_bool.sum(dim=-1).clamp(min=1)
        if advantages.dim() == 2:
            advantages = torch.where(m_bool, advantages, zeros).sum(dim=-1) / seq_len
        adv = advantages[:, None].expand_as(logp)
        seq_log_ratio = log_ratio.detach().sum(dim=-1) / seq_len  # sg[log s_i]
        # s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]: each token's loss equals its sequence's, and
        # d l_it / d logp_t = -s_i A_i (0 if clipped): with agg="seq-mean-token-mean", the paper's gradient
        logp_minus_sg = torch.where(m_bool, logp - logp.detach(), zeros)
        ratio = torch.exp(seq_log_ratio[:, None] + logp_minus_sg)
    else:
        adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
        ratio = torch.exp(log_ratio)

    if variant == "cispo":
        is_weight = torch.clamp(ratio, max=1.0 + eps_high).detach()
        loss_tok = -is_weight * adv * torch.where(m_bool, logp, zeros)
    else:
        surr1 = ratio * adv
        surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
        loss_tok = -torch.min(surr1, surr2)
        if dual_clip is not None:
            loss_tok = torch.where(adv < 0, torch.min(loss_tok, -dual_clip * adv), loss_tok)

    if weights is not None:
        loss_tok = loss_tok * weights.detach()
    loss = aggregate(loss_tok, m_bool, agg=agg, max_len=max_len, units=units, seq_lens=seq_lens)

    return loss, _clip_metrics(ratio, log_ratio, adv, m_bool, variant, eps_low, eps_high, dual_clip)


@torch.no_grad()
def _clip_metrics(ratio, log_ratio, adv, m_bool, variant, eps_low, eps_high, dual_clip) -> dict:
    """policy_loss's metrics (0-d tensors, over masked tokens: a caller reads them back once per step):
      clip_frac_high  share where the upper clip acts: r > 1 + eps_high and A > 0 (cispo: any A, its cap
                      acts on both signs);  clip_frac_low  r < 1 - eps_low and A < 0 (cispo: 0)
      ratio_mean, ratio_max  of the ratio the variant clips (gspo: s_i, once per token of its sequence)
      approx_kl       k3 estimate of KL(pi_old || pi_theta) from tokens sampled under pi_old: exp(d) - 1 - d,
                      d = logp - old_logp;  dual_clip_frac  (only with dual_clip) A < 0 and r > c"""
    r = ratio.detach()
    if variant == "cispo":
        high = r > 1.0 + eps_high
        low = torch.zeros_like(m_bool)
    else:
        high = (r > 1.0 + eps_high) & (adv > 0)
        low = (r < 1.0 - eps_low) & (adv < 0)
    d = log_ratio.detach()
    k3 = torch.expm1(d) - d
    metrics = {
        "clip_frac_high": _masked_mean(high.float(), m_bool),
        "clip_frac_low": _masked_mean(low.float(), m_bool),
        "ratio_mean": _masked_mean(r, m_bool),
        "ratio_max": torch.where(m_bool, r, torch.zeros_like(r)).max(),  # (ratios are > 0: 0 when none)
        "approx_kl": _masked_mean(k3, m_bool),
    }
    if dual_clip is not None:
        metrics["dual_clip_frac"] = _masked_mean(((adv < 0) & (r > dual_clip)).float(), m_bool)
    return metrics


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token KL(pi_theta || pi_ref) estimators (Schulman 2020, "Approximating KL Divergence") for tokens
    sampled from pi_theta, d = ref_logp - logp: k1 = logp - ref_logp (unbiased, high variance, can be < 0);
    k2 = 0.5 * (logp - ref_logp)^2; k3 = exp(d) - d - 1 (unbiased, >= 0; GRPO's KL term). The inputs' shape;
    the gradient flows through logp only."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    ref_logp = ref_logp.detach()
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


# ---------- Off-policy correction -----------------------------------------------------------------


def behaviour_weights(old_logp, behaviour_logp, mask, level="token", mode="truncate", low=None, high=2.0):
    """Importance weights for the generator's sampling policy: the tokens were sampled by the behaviour
    policy mu (the generator's recorded log-probs: stale weights and/or another numerical engine), the loss
    is built around pi_old. Per token rho_t = exp(old_logp - behaviour_logp).
      level="token": rho = rho_t;  level="sequence": rho = prod over the sequence's masked tokens of rho_t
                        (exp of the masked sum of log-ratios), for all of its tokens
      mode="truncate":  w = min(rho, high)   (truncated IS, TIS; Yao et al. 2025, "Your efficient RL
                        framework secretly brings you off-policy RL training")
      mode="mask":      w = 1 if low <= rho <= high else 0 (masked IS, MIS; low=None means 1/high); at
                        sequence level it drops whole sequences;  mode="off": w = 1 everywhere
    Returns detached weights (B, T), zero on unmasked positions (except "off")."""
    for name, value, allowed in (("mode", mode, IS_MODES), ("level", level, IS_LEVELS)):
        if value not in allowed:
            raise ValueError(f"unknown behaviour-weight {name} {value!r}; expected one of {allowed}")
    if mode == "off":
        return torch.ones(mask.shape, dtype=old_logp.dtype, device=old_logp.device)
    if high is None or not high > 0:
        raise ValueError(f"high must be > 0, got {high}")
    low = 1.0 / high if low is None else low
    with torch.no_grad():
        m_bool = mask.bool()
        zeros = torch.zeros_like(old_logp)
        log_rho = torch.where(m_bool, old_logp - behaviour_logp, zeros)
        if level == "sequence":
            log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(old_logp)
        rho = torch.exp(log_rho)
        if mode == "truncate":
            w = torch.clamp(rho, max=high)
        else:
            w = ((rho >= low) & (rho <= high)).to(old_logp.dtype)
        return torch.where(m_bool, w, zeros)


def _log_ratio(logp, behaviour_logp, m_bool):  # log(pi / mu) per token, 0 off the mask, detached
    return torch.where(m_bool, logp.detach() - behaviour_logp, torch.zeros_like(logp))


def _sequence_mean(x, m_bool):  # (B,) mean over each row's masked tokens (0 for an empty row)
    return torch.where(m_bool, x, torch.zeros_like(x)).sum(-1) / m_bool.sum(-1).clamp(min=1)


# The masks below return (B, T) bool, True on the tokens kept (False off `mask`). A masked token leaves the
# loss like one off `mask` (no gradient) but stays in the normalisers (`aggregate`'s units and each sequence's
# |o_i|, counted before these masks), as DeepSeek-V3.2's eq. 9 has it: its M_it multiplies the token's term
# inside (1/G) sum_i (1/|o_i|) sum_t, |o_i| the whole response. verl does otherwise: its rejection
# (verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_and_add_to_batch) replaces the batch's
# response_mask with the kept tokens, so agg_loss divides by those ("rejected samples not in denominator", as
# its ray_trainer.py said until verl PR #3984).
def geometric_mean_mask(old_logp, behaviour_logp, mask, low=None, high=1.001):
    """verl's geometric rejection sampling (rollout correction, rollout_rs="geometric"; Liu, Li et al. 2025,
    "When Speed Kills Stability"; verl/trainer/ppo/rollout_corr_helper.py, preset decoupled_geo_rs: high
    1.001, low None = 1/high). Per sequence, rho_t = pi_old_t / mu_t over its masked tokens:
        rho_geo_i = exp( (1/|y_i|) sum_t log rho_t );   keep sequence i iff low <= rho_geo_i <= high"""
    m_bool, low = mask.bool(), 1.0 / high if low is None else low
    geo = torch.exp(_sequence_mean(_log_ratio(old_logp, behaviour_logp, m_bool), m_bool))
    return m_bool & ((geo >= low) & (geo <= high))[:, None]


def dsv32_sequence_mask(logp, behaviour_logp, advantages, mask, max_kl):
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, arXiv 2512.02556, eq. 9): with mu the
    sampling (inference) policy and pi_theta the current one,
        M_it = 0 if A_it < 0 and (1/|o_i|) sum_t log(mu_t / pi_theta_t) > max_kl (their delta), else 1
    advantages (B,) or (B, T)."""
    m_bool = mask.bool()  # kl: the mean of log(mu / pi) = -log(pi / mu)
    kl = _sequence_mean(-_log_ratio(logp, behaviour_logp, m_bool), m_bool)
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    return m_bool & ~((adv < 0) & (kl > max_kl)[:, None])


def icepop_mask(old_logp, behaviour_logp, mask, low=0.5, high=5.0):
    """IcePop's token mask (Ling Team 2025, Ring-1T, "Every Step Evolves", arXiv 2510.18855; the blog "Small
    Leak Can Sink a Great Ship"): k_t = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old), keep token t iff
    low <= k_t <= high (paper: 0.5, 5). Its M(k) also weights a kept token by k: --is-mode truncate with
    --is-high >= high gives that weight."""
    k = torch.exp(_log_ratio(old_logp, behaviour_logp, mask.bool()))
    return mask.bool() & (k >= low) & (k <= high)


def mismatch_k3(logp, behaviour_logp, mask):
    """(B, T) k3 estimate of KL(mu || pi) per token sampled from mu (Schulman 2020): r = pi / mu, k3 = r - 1 - log r."""
    d = _log_ratio(logp, behaviour_logp, mask.bool())
    return torch.expm1(d) - d


# ---------- Log-probs consistent with the generator's sampler -------------------------------------


def token_logprobs(logits, tokens, temperature=1.0, top_k=-1, top_p=1.0, exact_top_k=None):
    """log p(tokens) under the distribution vLLM samples from: logits (..., V), tokens (...) long -> (...) float32.
    Mirrors vLLM 0.32's sampler (v1/sample/sampler.py: float32 logits / temperature; then, on CPU,
    ops/topk_topp_sampler.py apply_top_k_top_p_pytorch), then log_softmax over the kept set ("processed_logprobs").
      top_k on iff 0 < top_k < V: every logit >= the k-th largest is kept (ties at the k-th all kept).
      top_p on iff top_p < 1, on the top-k set: sort ascending, softmax, cumsum; a token is removed iff its
        cumsum <= 1 - top_p (float32, as vLLM), the largest always kept: the smallest top set reaching top_p;
        boundary ties follow the sort order (lower vocabulary indices dropped first).
    A sampled token just outside the kept set here (the two sides' logits differ in the last bits) gets -inf:
    callers mask or weight it. Recorded log-probs match this only with logprobs_mode="processed_logprobs".
    On CUDA (exact_top_k None and CUDA logits, or True) the kept set is vLLM's Triton kernel's
    (topk_topp_triton.py; FlashInfer is never used with processed log-probs): exactly k tokens, ties by lowest
    index (`_cuda_kept_set`); where the kernel is inexact (top-p ties within 1e-9, pivot searches of 18 steps)
    it may differ. Checked on CPU tensors against a reading of the kernel, never yet on a GPU."""
    x = sampling_logits(logits, temperature, top_k, top_p, exact_top_k)
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def sampling_logits(logits, temperature=1.0, top_k=-1, top_p=1.0, exact_top_k=None):
    """The float32 logits (..., V) vLLM samples from: / temperature, -inf outside the top-k/top-p set (rules in
    `token_logprobs`; exact_top_k: vLLM's CUDA rule, None: on CUDA logits). Differentiable on the kept set."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no log-probs to train on), got {temperature}")
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
    """(N, V) bool: what vLLM 0.32's Triton kernel keeps on CUDA (top_k 0: off). Top-k: exactly k, ties at the
    k-th logit by lowest index (the kernel walks the row in index order). Top-p on that set: the smallest top
    set reaching top_p, ties by lowest index, but a boundary at the k-th logit keeps every token equal to it."""
    vocab = flat.shape[-1]
    # a stable descending sort orders ties by index: its first k positions are the kernel's top-k set
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
            ranked_keep |= (boundary == values[:, top_k - 1:top_k]) & (values == boundary)
    return torch.zeros_like(ranked_keep).scatter_(-1, order, ranked_keep)


# ---------- Log-probs straight from hidden states, a chunk of tokens at a time --------------------

# Logits held at once by `chunked_logprobs`: 2**24 float32 values, 64 MiB (110 tokens of a 151,936-token
# vocabulary); its forward and backward hold two or three such arrays. This bound, not the batch, sets the
# LM head's memory. Chunks of 2**23 to 2**25 logits cost the same per token on a CPU; smaller ones cost more.
LOGIT_CHUNK_ELEMENTS = 2**24


def chunked_logprobs(hidden, weight, bias, tokens, temperature=1.0, top_k=-1, top_p=1.0, hidden_scale=1.0,
                     logit_scale=1.0, softcap=0.0, chunk_elements=LOGIT_CHUNK_ELEMENTS):
    """`token_logprobs(head(hidden), tokens, ...)` and the entropy of the same distribution, never holding more
    than ~`chunk_elements` logits. The family's head (heads.HeadTransform, `_head_logits`), then / temperature and
    top-k/top-p as vLLM does: head(h) = logit_scale * softcap * tanh(((hidden_scale * h) @ weight.T + bias) / softcap)
    (softcap 0: no tanh). hidden (N, H) at the positions to score, weight (V, H), bias (V,) or None, tokens (N,)
    long -> logp (N,) float32 (a gradient to hidden, weight, bias) and the detached entropy (N,) of the sampling
    distribution. Chunks of max(1, chunk_elements // V) tokens; the backward recomputes each chunk's logits and
    applies the gradient in closed form, d logp_t / d x = (onehot(t) - p) / temperature (p: the kept-set
    softmax), through d x / d z = logit_scale * (1 - tanh^2(z / softcap)): no chunk's logits outlive it."""
    chunk = max(1, chunk_elements // weight.shape[0])
    return _ChunkedLogprobs.apply(hidden, weight, bias, tokens, (temperature, top_k, top_p),
                                  (hidden_scale, logit_scale, softcap), chunk)


def score_tokens(model, decoder, lm_head, input_ids, attention_mask, targets, mask, temperature=1.0, top_k=-1,
                 top_p=1.0, untruncated=False, **head):
    """(logp, entropy, logp_untruncated or None), each (B, T), 0 off `mask`: `chunked_logprobs` of `targets` at the
    `mask` positions, without logits. `model` (a causal LM: plain, FSDP2 or PEFT) runs with logits_to_keep=[]; a
    hook on its `decoder` catches the final hidden states; `lm_head` (a DTensor weight is gathered) and the
    family's transform `head` (hidden_scale, logit_scale, softcap) run at the masked positions only (FSDP2's root
    keeps the head gathered until the backward ends). untruncated: also under the temperature alone."""
    caught = []
    hook = decoder.register_forward_hook(
        lambda _, __, out: caught.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    finally:
        hook.remove()
    hidden, tokens = caught[0][:, :-1][mask], targets[mask]  # where completion tokens are predicted
    weight, bias = lm_head.weight, lm_head.bias
    if hasattr(weight, "full_tensor"):
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
    logp, entropy = chunked_logprobs(hidden, weight, bias, tokens, temperature, top_k, top_p, **head)
    full = None
    if untruncated:  # (the KL term's distribution: the temperature alone)
        full = chunked_logprobs(hidden, weight, bias, tokens, temperature, **head)[0] if 0 < top_k < weight.shape[0] \
            or top_p < 1 else logp
    return tuple(None if v is None else mask.new_zeros(mask.shape, dtype=v.dtype).masked_scatter(mask, v)
                 for v in (logp, entropy, full))


def _head_logits(h, weight, bias, head, slope=False):
    """float32 logits of a chunk through the family's transform `head` = (hidden_scale, logit_scale,
    softcap); with slope, also d logits / d z in float32 (None where it is the constant logit_scale).
    As vLLM 0.32's LogitsProcessor.forward (model_executor/layers/logits_processor.py) does it: the soft cap
    (/ cap, tanh, * cap), then the scale, each in the matmul's output dtype (vLLM's head_dtype, by default the
    serving dtype: bf16 matmul outputs are capped in bf16), then float32 (its sampler). In float32 nothing
    differs; Gemma-2's cap of 30 applied in float32 after a bf16 matmul moved sampled tokens' log-probs by 0.04
    nats on average, 0.19 at most (tests/test_heads.py's bf16 case; a scale of 0.3 alone: 0.012, 0.078)."""
    hidden_scale, logit_scale, softcap = head
    x = torch.nn.functional.linear(h * hidden_scale if hidden_scale != 1 else h, weight, bias)
    dx_dz = None
    if softcap:
        x = x.div_(softcap).tanh_()
        dx_dz = (1 - x.float().square()).mul_(logit_scale) if slope else None
        x.mul_(softcap)
    if logit_scale != 1:
        x.mul_(logit_scale)
    return (x.float(), dx_dz) if slope else x.float()


class _ChunkedLogprobs(torch.autograd.Function):
    """Each chunk's logits are made, used in place and dropped within its iteration (autograd records
    nothing inside a Function's forward and backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, sampling, head, chunk):
        logp, entropy, lse = [], [], []
        for h, t in zip(hidden.split(chunk), tokens.split(chunk)):
            x = sampling_logits(_head_logits(h, weight, bias, head), *sampling)
            top = x.max(dim=-1, keepdim=True).values
            e = (x - top).exp_()
            total = e.sum(dim=-1, keepdim=True)
            norm = top + total.log()  # logsumexp
            logp.append((x.gather(-1, t[:, None]) - norm).squeeze(-1))
            # H = norm - sum_v p_v x_v over the kept set (p = e / total; -inf outside it, where p = 0)
            x.clamp_(min=torch.finfo(x.dtype).min)
            entropy.append((norm - torch.bmm(e[:, None, :], x[:, :, None]).squeeze(-1) / total).squeeze(-1))
            lse.append(norm.squeeze(-1))
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
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        temperature, (hidden_scale, logit_scale, _) = ctx.sampling[0], ctx.head
        start = 0
        for h, t, norm, g in zip(hidden.split(ctx.chunk), tokens.split(ctx.chunk), lse.split(ctx.chunk),
                                 grad_logp.split(ctx.chunk)):
            x, dx_dz = _head_logits(h, weight, bias, ctx.head, slope=True)
            x = sampling_logits(x, *ctx.sampling)
            # d logp / d logits = (onehot(t) - p) / temperature, times the incoming gradient g
            g = (g / temperature)[:, None]
            grad_x = x.sub_(norm[:, None]).exp_().mul_(-g)  # p, in place of the recomputed logits
            grad_x.scatter_add_(-1, t[:, None], g)
            # through the transform: d logp / d z, z = (hidden_scale * h) @ weight.T + bias
            if dx_dz is not None or logit_scale != 1:
                grad_x.mul_(dx_dz if dx_dz is not None else logit_scale)
            if need_hidden:
                grad_hidden[start:start + len(h)] = (grad_x.to(weight.dtype) @ weight) * hidden_scale
            if need_weight:
                grad_weight.addmm_(grad_x.T, h.float(), alpha=hidden_scale)
            if need_bias:
                grad_bias += grad_x.sum(0)
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
