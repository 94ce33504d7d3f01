"""update.py — the GRPO update on one rollout batch, on one FSDP2 rank.

Role: from the loop, one call: `update_on_batch` takes the batch's optimizer updates (--mini-batches x
--ppo-epochs, against the proximal policy: AReaL's decoupled objective), each a backward a micro-batch at a
time (--micro-batch-tokens, each term normalised by the whole update's counts, so the gradient is the whole
batch's); `micro_batch_loss`, one call below it, is the math (log-probs, importance weight, masks,
clipped objective, KL, distillation; losses.py). What a step logs of it is gathered beside the loss
(`diagnostics`), kept as tensors, and reaches the host once per step (`StepStats.reduced`).
Data contract: takes a collated `buffer.Batch` (every rank holds all of it) and the step's version; returns
`UpdateResult` (loss, gradient norm, log-prob agreement, metrics reduced over micro-batches and ranks).
May touch: the model's gradients and the optimizer it is given; collectives of the default process group.
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import buffer
import heads
import replay
import tracing
from config import Config
from losses import (behaviour_weights, distill_advantages, dsv32_sequence_mask, geometric_mean_mask, icepop_mask,
                    kl_penalty, mismatch_k3, policy_loss, score_tokens)


# ----------------------------------------------------------------------------------------------------
# The algorithm: a batch's updates, an update's micro-batches, a micro-batch's loss
# ----------------------------------------------------------------------------------------------------
@dataclass
class UpdateResult:
    loss: float  # mean over the step's optimizer updates
    grad_norm: float  # mean over the applied updates (before clipping)
    logprob_diff: Optional[float]  # trainer vs generator on fully on-policy rows, before any update (None: none)
    metrics: dict  # over every update's tokens (ratio_max: the max; counts: totals), and `updates`
    applied: int  # optimizer updates taken
    skipped: int  # updates skipped for a NaN/inf loss or gradient


def update_on_batch(model, ref_model, optimizer, batch, cfg, rank, world_size, version, step,
                    device="cpu", teacher=None) -> UpdateResult:
    """PPO's update on one rollout batch: --ppo-epochs passes, each of --mini-batches optimizer steps on a part
    of the batch. An update's gradient is this rank's rows of its part, a micro-batch at a time
    (--micro-batch-tokens); each micro-batch's term is normalised by the whole part's count (tokens for
    token-mean, non-empty sequences for the sequence means, over every micro-batch and rank), so the
    gradient is the whole part's however it is split. With more than one update, the proximal policy's
    log-probs are computed first, once; the ratio then moves between updates and the clips act. An update
    with a NaN/inf loss or gradient is skipped. The model version advances once per batch (the caller's).
    optimizer None: one update's gradients are left on the parameters, unclipped (tests and benchmarks)."""
    if optimizer is None and cfg.mini_batches * cfg.ppo_epochs > 1:
        raise ValueError("update_on_batch without an optimizer takes one update (--mini-batches 1, --ppo-epochs 1)")
    stats, norms, skipped, updates = StepStats(), [], 0, 0
    proximal = cfg.is_mode != "off" and cfg.mini_batches * cfg.ppo_epochs > 1
    if proximal:
        batch = dataclasses.replace(batch, proximal_logp=proximal_logprobs(model, batch, cfg, rank, world_size, device,
                                                                           stats))
        agreement(stats, batch.proximal_logp, batch, version)  # on the weights the generator sampled with
    for epoch in range(cfg.ppo_epochs):
        for rows in mini_batch_rows(len(batch), cfg, step, epoch):
            part = batch.select(rows)
            tokens = int(part.mask.sum())  # every rank holds the whole batch: the counts need no collective
            units = tokens if cfg.agg == "token-mean" else int((part.mask.sum(1) > 0).sum())
            micro_batches = rank_micro_batches(part, rank, world_size, cfg.micro_batch_tokens)
            loss = torch.zeros((), device=device)
            for mb in micro_batches:
                mb = mb.to(device)
                # recorded routes (--router-replay) hold through the backward: a checkpointed layer recomputes them
                with replay.routed_by(model, mb, measure=not proximal and updates == 0) as routing:
                    t_forward = tracing.clock()
                    terms = micro_batch_loss(model, ref_model, teacher, mb, cfg, units, tokens)
                    t_backward = tracing.complete("forward", t_forward, rows=len(mb))
                    (terms.loss * world_size).backward()  # FSDP2 averages gradients over ranks: their sum
                    tracing.complete("backward", t_backward)
                replay.add_counts(stats, routing)
                diagnostics(stats, terms, mb, cfg, version, measure_agreement=not proximal and updates == 0)
                loss += terms.loss.detach()
                del terms  # (its graph and tensors: not alive through the next micro-batch)
            # a rank's micro-batches over the step's updates (ranks run as many: FSDP2 needs every rank's forward)
            stats.max("micro_batches", stats.maxima.get("micro_batches", 0) + len(micro_batches))
            updates += 1
            if optimizer is None:
                break
            t_optimizer = tracing.clock()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            loss = loss.double().cpu().reshape(1)  # (the grad norm and this: an update's host syncs)
            if world_size > 1:
                dist.all_reduce(loss)
            if math.isfinite(grad_norm) and math.isfinite(float(loss)):
                optimizer.step()
                norms.append(grad_norm)
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            tracing.complete("optimizer step", t_optimizer, cat="optimizer")
    result = step_result(stats, world_size)
    result.metrics["updates"] = len(norms)
    return UpdateResult(result.loss / updates, sum(norms) / len(norms) if norms else math.nan, result.logprob_diff,
                        result.metrics, len(norms), skipped)


@dataclass
class LossTerms:
    """A micro-batch's loss (with its graph) and what its diagnostics read, detached, (B, T)."""
    loss: torch.Tensor
    logp: torch.Tensor  # the current policy's log-probs of the sampled tokens (0 off `trained`)
    entropy: torch.Tensor  # of the current sampling distribution
    outside: torch.Tensor  # sampled tokens outside the current (or proximal) top-k/top-p set
    trained: torch.Tensor  # the sampled tokens the trainer can score: the batch's mask less `outside`
    mask: torch.Tensor  # what the loss trains on: `trained` less what the off-policy masks drop
    kept: dict  # each off-policy mask's kept tokens (losses.py), by its metric's name
    weights: Optional[torch.Tensor]  # behaviour importance weights (None: --is-mode off)
    policy: dict  # policy_loss's diagnostics (tensors)
    kl: Optional[torch.Tensor] = None  # per-token KL to the reference (--kl-coef)
    reverse_kl: Optional[torch.Tensor] = None  # per-token reverse KL to the teacher (--teacher)


def micro_batch_loss(model, ref_model, teacher, mb, cfg, units, tokens) -> LossTerms:
    """One micro-batch's term of the update's loss: its share of the whole batch's (normalised by the
    update's `units`, and its KL term by the update's completion `tokens`)."""
    scores = completion_logprobs(model, mb, cfg.temperature, cfg.top_k, cfg.top_p,
                                 untruncated=cfg.kl_coef > 0 or teacher is not None)
    proximal = mb.proximal_logp if cfg.is_mode != "off" else None
    # A stale token can lie outside the current (or proximal) policy's top-k/top-p set (log-prob -inf): leave it out.
    outside = mb.mask & ~torch.isfinite(scores.logp)
    if proximal is not None:
        outside |= mb.mask & ~torch.isfinite(proximal)
    trained = mb.mask & ~outside
    logp = torch.where(trained, scores.logp, 0.0)
    # The decoupled objective (AReaL): the ratio against the proximal policy, the weights before the batch's
    # first update; the importance weight proximal / behaviour. With one update per batch the proximal
    # policy is the current one, and its log-probs need no pass of their own.
    trainer_old = torch.where(trained, proximal, 0.0) if proximal is not None else logp.detach()
    if cfg.is_mode == "off":
        old_logp, weights = mb.behaviour_logp, None  # ratio against the generator (PipelineRL style)
    else:
        old_logp = trainer_old
        weights = behaviour_weights(old_logp, mb.behaviour_logp, trained, level=cfg.is_level, mode=cfg.is_mode,
                                    low=cfg.is_low, high=cfg.is_high)
    advantages, reverse_kl = mb.advantages, None
    if teacher is not None:  # on-policy distillation: the teacher scores the sampled tokens (never an environment's)
        with torch.no_grad():
            teacher_logp = completion_logprobs(teacher, mb, cfg.temperature).logp
        # like with like, as the KL term: both under the temperature alone (the student's top-k/top-p log-prob
        # against an untruncated teacher would add -log(kept mass) of reverse KL on every token)
        advantages, reverse_kl = distill_advantages(advantages, torch.where(trained, scores.logp_untruncated, 0.0),
                                                    teacher_logp, trained, cfg.distill_coef)
    kept = off_policy_masks(cfg, trained, trainer_old, logp.detach(), mb, advantages)
    mask = trained
    for rule in kept.values():
        mask = mask & rule
    if reverse_kl is not None:
        reverse_kl = torch.where(mask, reverse_kl, 0.0)  # (its metric: over the tokens the loss trains on)
    loss, policy = policy_loss(logp, old_logp, advantages, mask, variant=cfg.loss, eps_low=cfg.eps_low,
                               eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, agg=cfg.agg,
                               max_len=model_token_budget(cfg), weights=weights, units=units,
                               seq_lens=mb.mask.sum(-1))
    kl = None
    if cfg.kl_coef > 0:  # between the untruncated distributions
        ref_logp = reference_logprobs(ref_model, mb, cfg.temperature)
        kl = torch.where(mask, kl_penalty(scores.logp_untruncated, ref_logp, cfg.kl_kind), 0.0)
        loss = loss + cfg.kl_coef * kl.sum() / max(tokens, 1)
    return LossTerms(loss, logp.detach(), scores.entropy, outside, trained, mask, kept, weights, policy,
                     None if kl is None else kl.detach(), reverse_kl)


def off_policy_masks(cfg, trained, trainer_old, logp, mb, advantages) -> dict:
    """The kept tokens of each off-policy mask the run has on (losses.py: --geo-mask-*, --dsv32-mask-kl,
    --icepop-*), by the name of the share it logs; the geometric and IcePop masks use the trainer's
    (proximal, or current) log-probs, DeepSeek-V3.2's the current ones and the advantages the loss uses
    (`advantages`: with a teacher, each token's A_t)."""
    kept = {}
    if cfg.geo_mask_high is not None:
        kept["geo_masked_seq_frac"] = geometric_mean_mask(trainer_old, mb.behaviour_logp, trained, cfg.geo_mask_low,
                                                          cfg.geo_mask_high)
    if cfg.dsv32_mask_kl is not None:
        kept["dsv32_masked_seq_frac"] = dsv32_sequence_mask(logp, mb.behaviour_logp, advantages, trained,
                                                            cfg.dsv32_mask_kl)
    if cfg.icepop_high is not None:
        kept["icepop_masked_frac"] = icepop_mask(trainer_old, mb.behaviour_logp, trained, cfg.icepop_low,
                                                 cfg.icepop_high)
    return kept


# ----------------------------------------------------------------------------------------------------
# Diagnostics: gathered beside the loss as tensors, reduced once per step
# ----------------------------------------------------------------------------------------------------
def diagnostics(stats, t: LossTerms, mb, cfg, version, measure_agreement=True) -> None:
    """What the step's row says of one micro-batch: policy_loss's diagnostics, entropy, KL terms, the
    behaviour-to-trainer mismatch (k3, overall and by lag), the share each off-policy rule dropped or
    truncated (of trained tokens; of trained sequences for the sequence masks), the importance weights'
    normalised effective sample size (sum w)^2 / (n sum w^2) (importance weight x masks; at --is-level
    sequence each token carries its sequence's weight), and the agreement with the generator."""
    n, rows, m = t.trained.sum(), t.trained.any(1), t.mask.sum()
    k3 = mismatch_k3(t.logp, mb.behaviour_logp, t.trained)
    stats.mean("mismatch_k3", k3.sum(), n)
    lag = version - mb.token_versions
    # every trained token's lag is within --max-lag (buffer.stale_mask) and within the version (token versions are
    # >= 0): the loop stops at both, since each lag costs a few tensor ops and two names per micro-batch, and a run
    # that never drops (--max-lag 1000000) looped a million times per micro-batch (minutes and GBs a step)
    for age in range(min(cfg.max_lag, version) + 1):
        at = t.trained & (lag == age)
        stats.mean(f"mismatch_k3/lag{age}", (k3 * at).sum(), at.sum())
        stats.add(f"mismatch_tokens/lag{age}", at.sum())
    if t.weights is not None:
        dropped = t.weights >= cfg.is_high if cfg.is_mode == "truncate" else t.weights == 0
        dropped_frac = "is_truncated_frac" if cfg.is_mode == "truncate" else "is_masked_frac"
        stats.mean(dropped_frac, (t.trained & dropped).sum(), n)
        stats.mean("is_weight_mean", torch.where(t.mask, t.weights, 0.0).sum(), m)
    for name, kept in t.kept.items():
        if name.endswith("_seq_frac"):
            stats.mean(name, (rows & ~kept.any(1)).sum(), rows.sum())
        else:
            stats.mean(name, (t.trained & ~kept).sum(), n)
    applied = torch.where(t.mask, t.weights if t.weights is not None else 1.0, 0.0)
    stats.add("ess_w", applied.sum())
    stats.add("ess_w2", applied.square().sum())
    stats.add("ess_n", n)
    if t.kl is not None:
        stats.mean("kl_ref", t.kl.sum(), m)
    if t.reverse_kl is not None:
        stats.mean("distill_reverse_kl", t.reverse_kl.sum(), m)
    for name, value in t.policy.items():  # policy_loss's are means over the masked tokens, but ratio_max
        stats.max(name, value) if name == "ratio_max" else stats.mean(name, value * m, m)
    stats.mean("entropy", t.entropy[mb.mask].sum(), mb.mask.sum())
    stats.add("outside_support_tokens", t.outside.sum())
    stats.add("loss", t.loss.detach())
    stats.add("positions", mb.attention_mask.numel())
    stats.add("padding", (mb.attention_mask == 0).sum())
    if measure_agreement:
        agreement(stats, t.logp, mb, version, t.trained)


def agreement(stats, logp, batch, version, scored=None) -> None:
    """|trainer - generator| log-prob on completions sampled entirely by the weights `logp` comes from
    (the tokens `scored`: by default the batch's where `logp` is finite); bf16 makes the max a tail, the
    mean says how far the two sides typically disagree."""
    scored = batch.mask & torch.isfinite(logp) if scored is None else scored
    on_policy_rows = ((batch.token_versions == version) | ~scored).all(dim=1) & scored.any(dim=1)
    both = scored & on_policy_rows[:, None]
    diff = torch.where(both, (logp - batch.behaviour_logp).abs(), 0.0)
    stats.max("logprob_diff_on_policy", torch.where(both, diff, -1.0).max())
    stats.mean("logprob_diff_mean", diff.sum(), both.sum())
    stats.add("on_policy_rows", on_policy_rows.sum())


class StepStats:
    """One step's metrics, added up over its micro-batches and updates as tensors where they were made (no
    host sync), then reduced over ranks once: means (a total over a count), sums and maxima. Every rank adds
    the same names, in any order."""

    def __init__(self):
        self.means, self.sums, self.maxima = {}, {}, {}

    def mean(self, name, total, count):
        s, n = self.means.get(name, (0.0, 0))
        self.means[name] = (s + total, n + count)

    def add(self, name, value):
        self.sums[name] = self.sums.get(name, 0.0) + value

    def max(self, name, value):
        self.maxima[name] = value if name not in self.maxima else torch.maximum(
            torch.as_tensor(self.maxima[name]), torch.as_tensor(value))

    def reduced(self, world_size) -> dict:
        """The step's values (the same on every rank: a collective, every rank calls it)."""
        means, sums, maxima = sorted(self.means), sorted(self.sums), sorted(self.maxima)
        values = to_host([self.means[n][0] for n in means] + [self.means[n][1] for n in means]
                         + [self.sums[n] for n in sums] + [self.maxima[n] for n in maxima])
        k, totals, highest = len(means), values[:2 * len(means) + len(sums)], values[2 * len(means) + len(sums):]
        if world_size > 1:
            dist.all_reduce(totals)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        out = {n: float(totals[i] / totals[k + i]) if totals[k + i] > 0 else 0.0 for i, n in enumerate(means)}
        out.update(zip(sums, totals[2 * k:].tolist()))
        out.update(zip(maxima, highest.tolist()))
        return out


def to_host(values) -> torch.Tensor:
    """float64 CPU copies of numbers and 0-d tensors: those on an accelerator in one device-to-host copy."""
    out = torch.tensor([float(v) if not torch.is_tensor(v) or v.device.type == "cpu" else 0.0 for v in values],
                       dtype=torch.float64)
    on_device = [i for i, v in enumerate(values) if torch.is_tensor(v) and v.device.type != "cpu"]
    if on_device:
        out[on_device] = torch.stack([values[i].double().reshape(()) for i in on_device]).cpu()
    return out


@dataclass
class StepResult:
    loss: float  # the loss summed over micro-batches, ranks and updates
    logprob_diff: Optional[float]  # max |trainer - generator| log-prob on fully on-policy rows (None: none)
    metrics: dict  # the per-step row's loss diagnostics, entropy, pad_frac, micro_batches


def step_result(stats: StepStats, world_size: int) -> StepResult:
    """The step's reduced metrics, with the derived figures (ESS, padding share) and without the counts
    they came from; a lag no trained token has, or agreement with no on-policy row, gets no figure (not a 0)."""
    row = stats.reduced(world_size)
    on_policy = row.pop("on_policy_rows", 0) > 0
    diff = row.pop("logprob_diff_on_policy", -1.0)
    if not on_policy:
        row.pop("logprob_diff_mean", None)
    for name in [n for n in row if n.startswith("mismatch_tokens/")]:
        if not row.pop(name):
            row.pop(name.replace("mismatch_tokens/", "mismatch_k3/"))
    w, w2, n = row.pop("ess_w"), row.pop("ess_w2"), row.pop("ess_n")
    if n:
        row["is_ess"] = w * w / (n * w2) if w2 > 0 else 0.0
    positions, padding = row.pop("positions"), row.pop("padding")
    row.update(outside_support_tokens=int(row["outside_support_tokens"]), pad_frac=padding / positions,
                micro_batches=int(row["micro_batches"]))
    return StepResult(row.pop("loss"), diff if on_policy else None, row)


# ----------------------------------------------------------------------------------------------------
# Scoring: the policy's, the reference's and the proximal policy's log-probs of the sampled tokens
# ----------------------------------------------------------------------------------------------------
@dataclass
class TokenScores:
    """What `completion_logprobs` returns: (B, T) float32, 0 off the batch's mask."""
    logp: torch.Tensor  # log-probs of the targets under the sampling distribution (temperature, top-k, top-p)
    entropy: torch.Tensor  # entropy of that distribution at each position (detached)
    logp_untruncated: Optional[torch.Tensor] = None  # under the temperature alone (the KL term's), if asked for


def completion_logprobs(model, batch, temperature, top_k=-1, top_p=1.0, untruncated=False) -> TokenScores:
    """Score a (micro-)batch's completion tokens with the generator's sampling distribution, without logits
    (`losses.score_tokens`: the LM head, with the family's transform of it (heads.py), a chunk of tokens at
    a time). Works with gradients, or under `torch.no_grad()` for a reference or proximal policy; `model` is
    a causal LM (or what models.py wraps one in), under FSDP2 or plain."""
    head = dataclasses.asdict(heads.head_transform(model.config))
    return TokenScores(*score_tokens(model, model.get_decoder(), model.get_output_embeddings(), batch.input_ids,
                                     batch.attention_mask, batch.targets, batch.mask, temperature, top_k, top_p,
                                     untruncated, **head))


def reference_logprobs(ref_model, batch, temperature):
    """Log-probs (B, T) of the reference policy (untruncated, at the sampling temperature), no gradient.
    `ref_model`: what models.build_frozen_models made (with LoRA, the policy with its adapter off)."""
    if ref_model is None:
        raise ValueError("--kl-coef > 0 needs a reference model (models.build_frozen_models)")
    with torch.no_grad():
        return completion_logprobs(ref_model, batch, temperature).logp


@tracing.timed("proximal log-probs")
def proximal_logprobs(model, batch, cfg, rank, world_size, device="cpu", stats=None) -> torch.Tensor:
    """(B, T) log-probs of the batch's tokens under the weights before its first update (the proximal policy),
    without gradients, micro-batched and chunked as training is. Each rank scores its own rows; a sum over
    ranks gives every rank all of them. `stats`: where the routers' agreement is counted (recorded routes)."""
    out = torch.zeros(batch.mask.shape)
    plan, count = rank_micro_batch_rows(batch, rank, world_size, cfg.micro_batch_tokens)
    with torch.no_grad():
        for i in range(count):  # a rank with fewer micro-batches runs fillers: FSDP2 needs every rank's forward
            rows = plan[i] if i < len(plan) else [0]
            mb = batch.select(rows).trimmed().to(device)
            with replay.routed_by(model, mb, measure=stats is not None and i < len(plan)) as routing:
                logp = completion_logprobs(model, mb, cfg.temperature, cfg.top_k, cfg.top_p).logp
            replay.add_counts(stats, routing)
            if i < len(plan):
                out[rows, :logp.shape[1]] = logp.float().cpu()
    if world_size > 1:
        dist.all_reduce(out)
    return out


# ----------------------------------------------------------------------------------------------------
# The schedule: learning rate, rewards, mini-batches
# ----------------------------------------------------------------------------------------------------
def learning_rate(step: int, cfg: Config) -> float:
    """The learning rate of step `step` (0-based): linear warmup to --lr over --lr-warmup-steps, then constant,
    or decayed to --min-lr at the last step (--lr-schedule linear | cosine)."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, cfg.steps - 1 - cfg.lr_warmup_steps))
    decay = 1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * decay


def shaped_rewards(groups, cfg: Config):
    """(num_groups, group_size) rewards the advantages are computed from: the task's, plus DAPO's soft overlong
    penalty with --overlong-penalty; and which samples were cut at --max-new-tokens (an episode: cut by
    --max-turns or --max-episode-tokens; its penalty counts model tokens against --max-turns x --max-new-tokens)."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    lengths = torch.tensor([g.model_tokens() for g in groups], dtype=torch.float32)
    truncated = torch.tensor([[reason == "length" for reason in g.finish_reasons or ["stop"] * len(g.rewards)]
                              for g in groups])
    if cfg.overlong_penalty:
        rewards = rewards + overlong_penalty(lengths, model_token_budget(cfg), cfg.overlong_penalty)
    return rewards, truncated


def model_token_budget(cfg: Config) -> int:
    """The most model tokens one sample can hold: --max-new-tokens, or for an episode (--env, --tools, --task
    reveal: tasks.make_task's rule) --max-turns times it: DAPO's L_max (`shaped_rewards`) and Dr. GRPO's constant
    normaliser (--agg seq-mean-token-sum-norm), the same for every sample and step."""
    episodes = cfg.task == "reveal" or bool(cfg.env) or bool(cfg.tools)
    return cfg.max_new_tokens * (cfg.max_turns if episodes else 1)


def overlong_penalty(lengths, max_len: int, cache: int):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each completion's reward; lengths
    any shape, L_max = max_len, L_cache = cache: 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) /
    L_cache if L_max - L_cache < |y| <= L_max (from 0 down to -1); -1 if |y| > L_max."""
    if not 0 < cache <= max_len:
        raise ValueError(f"the overlong cache must be in (0, max_len], got {cache} (max_len {max_len})")
    lengths = lengths.float()
    soft = ((max_len - cache) - lengths) / cache
    return torch.where(lengths <= max_len - cache, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, soft, -torch.ones_like(lengths)))


def mini_batch_rows(num_rows: int, cfg: Config, step: int, epoch: int) -> list[torch.Tensor]:
    """The rows of each of a step's --mini-batches in one pass: a seeded shuffle (the same on every rank), then
    M nearly equal parts."""
    if cfg.mini_batches == 1:
        return [torch.arange(num_rows)]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch))
    return list(order.tensor_split(cfg.mini_batches))


# ----------------------------------------------------------------------------------------------------
# The micro-batches: each rank's rows of an update, within --micro-batch-tokens
# ----------------------------------------------------------------------------------------------------
def rows_for_rank(num_rows: int, rank: int, world_size: int) -> slice:
    """Contiguous share of a batch's rows for one data-parallel rank."""
    per = math.ceil(num_rows / world_size)
    return slice(min(rank * per, num_rows), min((rank + 1) * per, num_rows))


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows (indices into `lengths`, each row's prompt + completion length) grouped into micro-batches of
    at most `max_tokens` padded tokens (rows x the longest row), shortest rows first, so that rows of
    similar length share a micro-batch and padding stays small. A row longer than `max_tokens` gets a
    micro-batch of its own. `max_tokens` 0: one micro-batch."""
    plan, current = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and max_tokens and (len(current) + 1) * lengths[i] > max_tokens:
            plan.append(current)
            current = []
        current.append(i)
    return plan + [current] if current else plan


def rank_micro_batch_rows(batch: buffer.Batch, rank: int, world_size: int,
                          max_tokens: int) -> tuple[list[list[int]], int]:
    """This rank's micro-batches as rows of `batch`, and how many micro-batches every rank runs (the most any
    rank needs: see `rank_micro_batches`)."""
    lengths = batch.attention_mask.sum(1).tolist()
    plans = []
    for r in range(world_size):
        rows = rows_for_rank(len(batch), r, world_size)
        plans.append([[rows.start + i for i in mb] for mb in plan_micro_batches(lengths[rows], max_tokens)])
    count = max(len(plan) for plan in plans)
    plan = plans[rank]
    while len(plan) < count and any(len(mb) > 1 for mb in plan):
        k = max(range(len(plan)), key=lambda k: len(plan[k]))
        half = len(plan[k]) // 2
        plan = plan[:k] + [plan[k][:half], plan[k][half:]] + plan[k + 1:]
    return plan, count


def rank_micro_batches(batch: buffer.Batch, rank: int, world_size: int, max_tokens: int) -> list[buffer.Batch]:
    """This rank's rows of `batch` (`rows_for_rank`) in micro-batches (`plan_micro_batches`), each trimmed
    to its longest row.

    Every rank gets as many micro-batches as the rank that needs the most (each forward and backward runs
    FSDP2 collectives): a rank that needs fewer halves its largest ones, and one short of rows even then
    gets fillers, a row of the batch with its mask cleared (it runs through the model, adds no loss and no
    gradient). Every rank holds the whole batch, so each works out every rank's plan without communicating.
    """
    plan, count = rank_micro_batch_rows(batch, rank, world_size, max_tokens)
    micro = [batch.select(rows).trimmed() for rows in plan]
    if len(micro) < count:
        filler = batch.select([0]).trimmed()
        micro += [dataclasses.replace(filler, mask=torch.zeros_like(filler.mask))] * (count - len(micro))
    return micro
