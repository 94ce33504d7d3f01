"""losses.py — the GRPO loss of one micro-batch, assembled in one place (torch only).

Role: update.py scores a micro-batch's tokens (the policy's; the reference's and the teacher's when
the run has them) and calls `grpo_loss(LossInputs, LossSettings)` once per micro-batch. Inside, in
this order: the tokens the trainer can score, the ratio's denominator (the proximal policy: AReaL's
decoupled objective) and the behaviour importance weights (`behaviour_weights`), the
distillation advantage (`distill_advantages`), the off-policy masks (`off_policy_masks`), the
clipped objective of the variant and its aggregation (`policy_loss`, `aggregate`), the KL term
(`kl_penalty`). Each piece is a function of its own, usable (and tested) alone.
Data contract (B sequences, T padded completion length): log-probs, weights (B, T) float; advantages
(B,) or (B, T); masks (B, T) bool, True on completion tokens. Masked-out positions never reach a
result, and results there are 0. The loss: a scalar with its graph; `LossTerms`: what it used,
detached, and `policy_loss`'s metrics as 0-d tensors (nothing is read back to the host here).
Variants of `policy_loss`: grpo, dapo, dr_grpo, gspo, cispo (all minimise; formulas: its docstring).
May touch: nothing but its arguments (no optimizer, process, I/O or state); copies out alone.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

VARIANTS = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
IS_LEVELS, IS_MODES = ("token", "sequence"), ("truncate", "mask", "off")  # of `behaviour_weights`
# the fields of LossSettings that grpo_loss hands to `policy_loss`, by its parameters' names
POLICY_SETTINGS = ("variant", "eps_low", "eps_high", "dual_clip", "agg", "max_len")


# ---------- The loss of one micro-batch: one typed input, one settings object -----------------


@dataclass
class LossInputs:
    """A micro-batch's tensors, (B, T) unless noted, on one device. units, tokens: the whole
    update's counts (every micro-batch and rank), the loss's and the KL term's normalisers; None:
    this micro-batch's own."""

    logp: torch.Tensor  # the current policy's, with its graph; -inf outside the sampling's kept set
    behaviour_logp: torch.Tensor  # the generator's (mu), recorded while sampling
    advantages: torch.Tensor  # (B,) or (B, T)
    mask: torch.Tensor  # completion tokens (bool)
    proximal_logp: Optional[torch.Tensor] = None  # pi_old; None: the current policy's, detached
    logp_untruncated: Optional[torch.Tensor] = None  # the current policy's, temperature alone
    ref_logp: Optional[torch.Tensor] = None  # the reference's, untruncated (kl_coef > 0)
    teacher_logp: Optional[torch.Tensor] = None  # the teacher's, untruncated (None: no distilling)
    units: Optional[int] = None  # `aggregate`'s: tokens for token-mean, else non-empty sequences
    tokens: Optional[int] = None  # completion tokens: the KL term's normaliser


@dataclass(frozen=True)
class LossSettings:
    """What the loss does (`settings_from` builds it from the run's flags, once per batch).
    variant .. max_len: `policy_loss`'s; is_*: `behaviour_weights`' (is_mode "off": no weights, the
    ratio against the generator); geo_mask_*, dsv32_mask_kl, icepop_*: the off-policy masks (None:
    off); kl_coef, kl_kind: the KL term to the reference (0: off); distill_coef: the C of
    `distill_advantages`."""

    variant: str = "grpo"
    eps_low: float = 0.2
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    agg: str = "token-mean"
    max_len: Optional[int] = None
    is_level: str = "token"
    is_mode: str = "truncate"
    is_low: Optional[float] = None
    is_high: float = 2.0
    geo_mask_low: Optional[float] = None
    geo_mask_high: Optional[float] = None
    dsv32_mask_kl: Optional[float] = None
    icepop_low: float = 0.5
    icepop_high: Optional[float] = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    distill_coef: float = 0.0


def settings_from(flags, max_len: Optional[int]) -> LossSettings:
    """The loss's settings from an object holding the run's flags (config.Config): each field is
    the flag of its name, but `variant` (--loss) and `max_len` (the episode budget, given)."""
    names = {f.name for f in dataclasses.fields(LossSettings)} - {"variant", "max_len"}
    return LossSettings(
        variant=flags.loss, max_len=max_len, **{name: getattr(flags, name) for name in names}
    )


@dataclass
class LossTerms:
    """What `grpo_loss` used, detached, (B, T): for a caller's diagnostics."""

    logp: torch.Tensor  # the current policy's log-probs (0 off `trained`)
    outside: torch.Tensor  # sampled tokens outside the current (or proximal) top-k/top-p set
    trained: torch.Tensor  # the sampled tokens the trainer can score: the mask less `outside`
    mask: torch.Tensor  # what the loss trains on: `trained` less what the off-policy masks drop
    kept: dict  # each off-policy mask's kept tokens, by the name of the share it logs
    weights: Optional[torch.Tensor]  # behaviour importance weights (None: is_mode "off")
    policy: dict  # policy_loss's metrics (0-d tensors)
    kl: Optional[torch.Tensor] = None  # per-token KL to the reference (kl_coef > 0)
    reverse_kl: Optional[torch.Tensor] = None  # per-token reverse KL to the teacher
    # k3 of KL(behaviour || current) per trained token (`mismatch_k3`): the generator-trainer gap
    mismatch: Optional[torch.Tensor] = None


def grpo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, LossTerms]:
    """One micro-batch's term of the update's loss, (loss, terms): its share of the whole update's
    (normalised by `inputs.units`, its KL term by `inputs.tokens`), so that the micro-batches'
    losses add up to the whole update's.
    - The ratio's denominator (decoupled objective, AReaL): the proximal policy; with is_mode "off"
      the generator's log-probs (PipelineRL style). The importance weight: proximal / behaviour.
    - With a teacher, each token's advantage A_t = A - C (logp_t - teacher_logp_t), untruncated.
    - The off-policy masks drop tokens from the loss, not from its normalisers (see above them)."""
    x, s = inputs, settings
    proximal = x.proximal_logp if s.is_mode != "off" else None
    # A stale token can lie outside the current (or proximal)
    # policy's top-k/top-p set (log-prob -inf): leave it out.
    outside = x.mask & ~torch.isfinite(x.logp)
    if proximal is not None:
        outside |= x.mask & ~torch.isfinite(proximal)
    trained = x.mask & ~outside
    logp = torch.where(trained, x.logp, 0.0)
    # With one update per batch the proximal policy is the current one: its log-probs, detached.
    trainer_old = torch.where(trained, proximal, 0.0) if proximal is not None else logp.detach()
    if s.is_mode == "off":
        old_logp, weights = x.behaviour_logp, None  # the ratio against the generator
    else:
        old_logp = trainer_old
        weights = behaviour_weights(
            old_logp, x.behaviour_logp, trained, s.is_level, s.is_mode, low=s.is_low, high=s.is_high
        )
    advantages, reverse_kl = x.advantages, None
    if x.teacher_logp is not None:
        # like with like, as the KL term: both under the temperature alone (the student's
        # top-k/top-p log-prob against an untruncated teacher would add -log(kept mass) of reverse
        # KL on every token)
        if x.logp_untruncated is None:
            raise ValueError("distillation needs the student's untruncated log-probs")
        student = torch.where(trained, x.logp_untruncated, 0.0)
        advantages, reverse_kl = distill_advantages(
            advantages, student, x.teacher_logp, trained, s.distill_coef
        )
    kept = off_policy_masks(s, trained, trainer_old, logp.detach(), x.behaviour_logp, advantages)
    mask = trained
    for rule in kept.values():
        mask = mask & rule
    if reverse_kl is not None:
        reverse_kl = torch.where(mask, reverse_kl, 0.0)  # (its metric: over the tokens trained on)
    objective = {name: getattr(s, name) for name in POLICY_SETTINGS}
    seq_lens = x.mask.sum(-1)  # each |o_i|: its tokens before the off-policy masks
    loss, policy = policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        weights=weights,
        units=x.units,
        seq_lens=seq_lens,
        **objective,
    )
    kl = None
    if s.kl_coef > 0:  # between the untruncated distributions
        if x.ref_logp is None or x.logp_untruncated is None:
            raise ValueError("kl_coef > 0 needs the reference's and the untruncated log-probs")
        kl = torch.where(mask, kl_penalty(x.logp_untruncated, x.ref_logp, s.kl_kind), 0.0)
        tokens = x.mask.sum().clamp(min=1) if x.tokens is None else max(x.tokens, 1)
        loss = loss + s.kl_coef * kl.sum() / tokens
        kl = kl.detach()
    terms = LossTerms(
        logp=logp.detach(),
        outside=outside,
        trained=trained,
        mask=mask,
        kept=kept,
        weights=weights,
        policy=policy,
        kl=kl,
        reverse_kl=reverse_kl,
        mismatch=mismatch_k3(logp.detach(), x.behaviour_logp, trained),
    )
    return loss, terms


def off_policy_masks(settings, trained, trainer_old, logp, behaviour_logp, advantages) -> dict:
    """The kept tokens of each off-policy mask `settings` turns on (geo_mask_high, dsv32_mask_kl,
    icepop_high), by the name of the share it logs; the geometric and IcePop masks use the
    trainer's (proximal, or current) log-probs, DeepSeek-V3.2's the current ones and the advantages
    the loss uses (with a teacher, each token's A_t)."""
    s, kept = settings, {}
    if s.geo_mask_high is not None:
        kept["geo_masked_seq_frac"] = geometric_mean_mask(
            trainer_old, behaviour_logp, trained, s.geo_mask_low, s.geo_mask_high
        )
    if s.dsv32_mask_kl is not None:
        kept["dsv32_masked_seq_frac"] = dsv32_sequence_mask(
            logp, behaviour_logp, advantages, trained, s.dsv32_mask_kl
        )
    if s.icepop_high is not None:
        kept["icepop_masked_frac"] = icepop_mask(
            trainer_old, behaviour_logp, trained, s.icepop_low, s.icepop_high
        )
    return kept


# ---------- Per-token advantages (a batch's, from its rewards: advantages.py) ---------------------


def distill_advantages(advantages, logp, teacher_logp, mask, coef: float):
    """On-policy distillation (Thinking Machines 2025, "On-Policy Distillation"; tinker-cookbook's
    distillation/train_on_policy.py `incorporate_kl_penalty`, undiscounted). On tokens the student
    sampled, k_t = logp_t - teacher_logp_t estimates the reverse KL(student || teacher); A_t = A -
    coef * k_t, detached (an advantage, not a loss term). advantages: (B,) or (B, T). Returns (A_t,
    k), both (B, T), 0 off the mask."""
    m_bool, zeros = mask.bool(), torch.zeros_like(logp)
    k = torch.where(m_bool, logp.detach() - teacher_logp.detach(), zeros)
    task = (advantages[:, None].expand_as(k) if advantages.dim() == 1 else advantages).to(k.dtype)
    return torch.where(m_bool, task - coef * k, zeros), k


# ---------- Policy losses -------------------------------------------------------------------------


def _masked_mean(x, m_bool):
    """0-d tensor: the mean of x over True positions of m_bool (0 if none); never read back to the
    host here."""
    return torch.where(m_bool, x, torch.zeros_like(x)).sum() / m_bool.sum().clamp(min=1)


def aggregate(loss_tok, mask, agg="token-mean", max_len=None, units=None, seq_lens=None):
    """Reduce a per-token loss (B, T) to a scalar. token-mean: sum over masked tokens / their number
    (DAPO's token-level loss); seq-mean-token-mean: mean over sequences of each one's token
    sum / |o_i| (original GRPO); seq-mean-token-sum: of each one's token sum;
    seq-mean-token-sum-norm: seq-mean-token-sum / max_len, default T = mask.shape[-1] (Dr. GRPO: a
    constant normaliser instead of |y_i|). Fully masked sequences are left out of sequence means; an
    all-masked batch gives 0 with the graph attached (no NaN). units: the count to divide by (masked
    tokens for token-mean, else non-empty sequences), default this mask's; a micro-batch passes its
    whole step's (every micro-batch, every rank), so that the micro-batches' losses add up to the
    whole batch's. seq_lens (B,): each sequence's |o_i|, default its tokens in `mask`; grpo_loss
    passes the tokens before the off-policy masks, as `units` counts them (DeepSeek-V3.2's eq. 9:
    1/|o_i| outside its mask M_it)."""
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


def policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    variant="grpo",
    eps_low=0.2,
    eps_high=None,
    dual_clip=None,
    agg="token-mean",
    max_len=None,
    weights=None,
    units=None,
    seq_lens=None,
):
    """Policy-gradient loss of the GRPO family: (loss, metrics of `_clip_metrics`). r_t =
    exp(logp_t - old_logp_t); per-token losses (to minimise):
    grpo (Shao et al. 2024; PPO's clipped surrogate, Schulman et al. 2017):
        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
      dual_clip=c > 1 (Ye et al. 2020, dual-clip PPO): for A < 0, l_t = min(l_t, -c A): bounded by
      c|A|.
    dapo (Yu et al. 2025, DAPO): grpo with clip-higher, eps_high defaults to 0.28 (eps_low stays
      0.2); meant with agg="token-mean".
    dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training"): the grpo surrogate; meant with
      group_advantages(scale="none") and agg="seq-mean-token-sum-norm".
    gspo (Zheng et al. 2025, Group Sequence Policy Optimization): s_i = exp( (1/|y_i|) sum_t
        (logp_t - old_logp_t) ), l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
      in the paper's token form (below); per-token advantages are reduced by their masked mean. The
      paper uses far smaller clip ranges (e.g. 3e-4 / 4e-4): pass them.
    cispo (MiniMax-M1, MiniMax 2025): l_t = -sg[min(r_t, 1 + eps_high)] A_t logp_t: the IS weight is
      clipped and detached, so every token keeps its gradient -min(r_t, 1 + eps_high) A_t (none is
      dropped as in PPO clipping); eps_low is unused (the paper sets no lower bound).
    advantages (B,) or (B, T); weights: optional (B, T) detached per-token weights (e.g.
    behaviour_weights) multiplied into l_t; agg/max_len/units/seq_lens: see `aggregate`."""
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
        # s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]: each token's loss
        # equals its sequence's, and d l_it / d logp_t = -s_i A_i (0 if
        # clipped): with agg="seq-mean-token-mean", the paper's gradient
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
    clip = dict(variant=variant, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return loss, _clip_metrics(ratio, log_ratio, adv, m_bool, **clip)


@torch.no_grad()
def _clip_metrics(ratio, log_ratio, adv, m_bool, variant, eps_low, eps_high, dual_clip) -> dict:
    """policy_loss's metrics (0-d tensors, over masked tokens: a caller reads them back once per
    step):
      clip_frac_high  share where the upper clip acts: r > 1 + eps_high and A > 0 (cispo: any A, its
                      cap acts on both signs);  clip_frac_low  r < 1 - eps_low and A < 0 (cispo: 0)
      ratio_mean, ratio_max  of the ratio the variant clips (gspo: s_i, once per token of its
                             sequence)
      approx_kl       k3 estimate of KL(pi_old || pi_theta) from tokens sampled under pi_old:
                      exp(d) - 1 - d, d = logp - old_logp;  dual_clip_frac  (only with dual_clip)
                          A < 0 and r > c"""
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
        # (ratios are > 0: 0 when none)
        "ratio_max": torch.where(m_bool, r, torch.zeros_like(r)).max(),
        "approx_kl": _masked_mean(k3, m_bool),
    }
    if dual_clip is not None:
        metrics["dual_clip_frac"] = _masked_mean(((adv < 0) & (r > dual_clip)).float(), m_bool)
    return metrics


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token KL(pi_theta || pi_ref) estimators (Schulman 2020, "Approximating KL Divergence")
    for tokens sampled from pi_theta, d = ref_logp - logp: k1 = logp - ref_logp (unbiased, high
    variance, can be < 0); k2 = 0.5 * (logp - ref_logp)^2; k3 = exp(d) - d - 1 (unbiased, >= 0;
    GRPO's KL term). The inputs' shape; the gradient flows through logp only."""
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


def behaviour_weights(
    old_logp, behaviour_logp, mask, level="token", mode="truncate", low=None, high=2.0
):
    """Importance weights for the generator's sampling policy: the tokens were sampled by the
    behaviour policy mu (the generator's recorded log-probs: stale weights and/or another numerical
    engine), the loss is built around pi_old. Per token rho_t = exp(old_logp - behaviour_logp).
      level="token": rho = rho_t;  level="sequence": rho = prod over the sequence's masked tokens of
          rho_t
                        (exp of the masked sum of log-ratios), for all of its tokens
      mode="truncate":  w = min(rho, high)   (truncated IS, TIS; Yao et al. 2025, "Your efficient RL
                        framework secretly brings you off-policy RL training")
      mode="mask":      w = 1 if low <= rho <= high else 0 (masked IS, MIS; low=None means 1/high);
                        at sequence level it drops whole sequences;  mode="off": w = 1 everywhere
    Returns detached weights (B, T), zero on unmasked positions (except "off")."""
    for name, value, allowed in (("mode", mode, IS_MODES), ("level", level, IS_LEVELS)):
        if value not in allowed:
            raise ValueError(
                f"unknown behaviour-weight {name} {value!r}; expected one of {allowed}"
            )
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


# The masks below return (B, T) bool, True on the tokens kept (False off `mask`). A masked token
# leaves the loss like one off `mask` (no gradient) but stays in the normalisers (`aggregate`'s
# units and each sequence's |o_i|, counted before these masks), as DeepSeek-V3.2's eq. 9 has it: its
# M_it multiplies the token's term inside (1/G) sum_i (1/|o_i|) sum_t, |o_i| the whole response.
# verl does otherwise: its rejection (verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_correction_and_add_to_batch) replaces the batch's response_mask with the kept
# tokens, so agg_loss divides by those ("rejected samples not in denominator", as its ray_trainer.py
# said until verl PR #3984).
def geometric_mean_mask(old_logp, behaviour_logp, mask, low=None, high=1.001):
    """verl's geometric rejection sampling (rollout correction, rollout_rs="geometric"; Liu, Li et
    al. 2025, "When Speed Kills Stability"; verl/trainer/ppo/rollout_corr_helper.py, preset
    decoupled_geo_rs: high 1.001, low None = 1/high). Per sequence, rho_t = pi_old_t / mu_t over its
        masked tokens: rho_geo_i = exp( (1/|y_i|) sum_t log rho_t );
        keep sequence i iff low <= rho_geo_i <= high"""
    m_bool, low = mask.bool(), 1.0 / high if low is None else low
    geo = torch.exp(_sequence_mean(_log_ratio(old_logp, behaviour_logp, m_bool), m_bool))
    return m_bool & ((geo >= low) & (geo <= high))[:, None]


def dsv32_sequence_mask(logp, behaviour_logp, advantages, mask, max_kl):
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, arXiv 2512.02556, eq. 9): with
    mu the sampling (inference) policy and pi_theta the current one,
        M_it = 0 if A_it < 0 and (1/|o_i|) sum_t log(mu_t / pi_theta_t) > max_kl (their delta),
               else 1
    advantages (B,) or (B, T)."""
    m_bool = mask.bool()  # kl: the mean of log(mu / pi) = -log(pi / mu)
    kl = _sequence_mean(-_log_ratio(logp, behaviour_logp, m_bool), m_bool)
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    return m_bool & ~((adv < 0) & (kl > max_kl)[:, None])


def icepop_mask(old_logp, behaviour_logp, mask, low=0.5, high=5.0):
    """IcePop's token mask (Ling Team 2025, Ring-1T, "Every Step Evolves", arXiv 2510.18855; the
    blog "Small Leak Can Sink a Great Ship"): k_t = pi_train(y_t; theta_old) / pi_infer(y_t;
    theta_old), keep token t iff low <= k_t <= high (paper: 0.5, 5). Its M(k) also weights a kept
    token by k: --is-mode truncate with --is-high >= high gives that weight."""
    k = torch.exp(_log_ratio(old_logp, behaviour_logp, mask.bool()))
    return mask.bool() & (k >= low) & (k <= high)


def mismatch_k3(logp, behaviour_logp, mask):
    """(B, T) k3 estimate of KL(mu || pi) per token sampled from mu (Schulman 2020): r = pi / mu,
    k3 = r - 1 - log r."""
    d = _log_ratio(logp, behaviour_logp, mask.bool())
    return torch.expm1(d) - d
