"""update.py — the GRPO update on one rollout batch, on one FSDP2 rank.

Role: from the loop, one call: `update_on_batch` takes the batch's optimizer updates (--mini-batches
x --ppo-epochs, against the proximal policy: AReaL's decoupled objective), each a backward a
micro-batch at a time (--micro-batch-tokens, each term normalised by the whole update's counts, so
the gradient is the whole batch's; with --packing each runs its rows without padding, packing.py).
`micro_batch_loss`, one call below it, scores the micro-batch's tokens (the policy's log-probs; the
reference's and the teacher's when the run has them) and calls the loss once (losses.grpo_loss:
importance weight, masks, clipped objective, KL, distillation; its settings built from the flags
once per batch, `loss_settings`). What a step logs of it is gathered beside the loss
(step_stats.py), kept as tensors, and reaches the host once per step.
Data contract: takes a collated `buffer.Batch` (every rank holds all of it) and the step's version;
returns `UpdateResult` (loss, gradient norm, log-prob agreement, metrics reduced over micro-batches
and ranks). May touch: the model's gradients and the optimizer it is given; collectives of the
default process group.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import schedule
import torch
import torch.distributed as dist
from step_stats import StepStats, agreement, diagnostics, step_result

import buffer
import losses
from config import Config
from infra import tracing
from trainer import heads, packing, replay
from trainer.logprobs import score_tokens


# --------------------------------------------------------------------------------------------------
# The algorithm: a batch's updates, an update's micro-batches, a micro-batch's loss
# --------------------------------------------------------------------------------------------------
@dataclass
class UpdateResult:
    loss: float  # mean over the step's optimizer updates
    grad_norm: float  # mean over the applied updates (before clipping)
    # trainer vs generator on fully on-policy rows, before any update (None: none)
    logprob_diff: Optional[float]
    metrics: dict  # over every update's tokens (ratio_max: the max; counts: totals), and `updates`
    applied: int  # optimizer updates taken
    skipped: int  # updates skipped for a NaN/inf loss or gradient


def update_on_batch(
    model,
    ref_model,
    optimizer,
    batch,
    cfg,
    rank,
    world_size,
    version,
    step,
    device="cpu",
    teacher=None,
) -> UpdateResult:
    """PPO's update on one rollout batch: --ppo-epochs passes, each of --mini-batches optimizer
    steps on a part of the batch. An update's gradient is this rank's rows of its part, a
    micro-batch at a time (--micro-batch-tokens); each micro-batch's term is normalised by the whole
    part's count (tokens for token-mean, non-empty sequences for the sequence means, over every
    micro-batch and rank), so the gradient is the whole part's however it is split. With more than
    one update, the proximal policy's log-probs are computed first, once; the ratio then moves
    between updates and the clips act. An update with a NaN/inf loss or gradient is skipped. The
    model version advances once per batch (the caller's). optimizer None: one update's gradients are
    left on the parameters, unclipped (tests and benchmarks)."""
    if optimizer is None and cfg.mini_batches * cfg.ppo_epochs > 1:
        raise ValueError(
            "update_on_batch without an optimizer takes one update (--mini-batches 1, --ppo-epochs "
            "1)"
        )
    stats, norms, skipped, updates = StepStats(), [], 0, 0
    settings = loss_settings(cfg)
    packed = packs(cfg, (model, ref_model, teacher))
    proximal = cfg.is_mode != "off" and cfg.mini_batches * cfg.ppo_epochs > 1
    if proximal:
        logp = proximal_logprobs(model, batch, cfg, rank, world_size, device, stats, packed)
        batch = dataclasses.replace(batch, proximal_logp=logp)
        # on the weights the generator sampled with
        agreement(stats, batch.proximal_logp, batch, version)
    for epoch in range(cfg.ppo_epochs):
        for rows in mini_batch_rows(len(batch), cfg, step, epoch):
            part = batch.select(rows)
            # every rank holds the whole batch: the counts need no collective
            tokens = int(part.mask.sum())
            units = tokens if cfg.agg == "token-mean" else int((part.mask.sum(1) > 0).sum())
            micro_batches = rank_micro_batches(
                part, rank, world_size, cfg.micro_batch_tokens, packed
            )
            loss = torch.zeros((), device=device)
            for mb in micro_batches:
                mb = mb.to(device)
                # recorded routes (--router-replay) hold through the backward: a checkpointed layer
                # recomputes them
                measure = not proximal and updates == 0
                with replay.routed_by(model, mb, measure, packed) as routing:
                    t_forward = tracing.clock()
                    mb_loss, terms, entropy = micro_batch_loss(
                        model, ref_model, teacher, mb, cfg, settings, units, tokens, packed
                    )
                    t_backward = tracing.complete("forward", t_forward, rows=len(mb))
                    # FSDP2 averages gradients over ranks: their sum
                    (mb_loss * world_size).backward()
                    tracing.complete("backward", t_backward)
                replay.add_counts(stats, routing)
                diagnostics(
                    stats,
                    mb_loss,
                    terms,
                    entropy,
                    mb,
                    cfg,
                    version,
                    measure_agreement=measure,
                    packed=packed,
                )
                loss += mb_loss.detach()
                # (its graph and tensors: not alive through the next micro-batch)
                del mb_loss, terms, entropy
            # a rank's micro-batches over the step's updates (ranks run as many: FSDP2 needs every
            # rank's forward)
            stats.max("micro_batches", stats.maxima.get("micro_batches", 0) + len(micro_batches))
            updates += 1
            if optimizer is None:
                break
            t_optimizer = tracing.clock()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = float(
                grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            )
            # (the grad norm and this: an update's host syncs)
            loss = loss.double().cpu().reshape(1)
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
    return UpdateResult(
        result.loss / updates,
        sum(norms) / len(norms) if norms else math.nan,
        result.logprob_diff,
        result.metrics,
        len(norms),
        skipped,
    )


def loss_settings(cfg: Config) -> losses.LossSettings:
    """The loss's settings from the run's flags (losses.LossSettings), built once per batch: each
    field is the flag of its name, but `variant` (--loss) and `max_len` (the episode budget)."""
    flags = {f.name for f in dataclasses.fields(losses.LossSettings)} - {"variant", "max_len"}
    return losses.LossSettings(
        variant=cfg.loss,
        max_len=schedule.model_token_budget(cfg),
        **{name: getattr(cfg, name) for name in flags},
    )


def packs(cfg: Config, models) -> bool:
    """Whether an update's micro-batches run packed (packing.py): with --packing on; with auto where
    every model of `models` (None: the run has none) keeps packed rows apart, as train.py's start
    found (packing.decide leaves its verdict on each model; a model never probed is padded)."""
    if cfg.packing != "auto":
        return cfg.packing == "on"
    return all(getattr(m, packing.ATTRIBUTE, None) == "" for m in models if m is not None)


def micro_batch_loss(model, ref_model, teacher, mb, cfg, settings, units, tokens, packed=False):
    """One micro-batch's term of the update's loss, (loss, losses.LossTerms, entropy): the tensors
    the loss needs, scored here (packed: each model runs the rows without their padding), then one
    call to `losses.grpo_loss` (normalised by the update's `units`, its KL term by the update's
    completion `tokens`). The entropy: of the current sampling distribution."""
    scores = completion_logprobs(
        model,
        mb,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        untruncated=cfg.kl_coef > 0 or teacher is not None,
        packed=packed,
    )
    teacher_logp = ref_logp = None
    if teacher is not None:  # on-policy distillation: the teacher scores the sampled tokens
        with torch.no_grad():  # (never an environment's), under the temperature alone
            teacher_logp = completion_logprobs(teacher, mb, cfg.temperature, packed=packed).logp
    if cfg.kl_coef > 0:  # between the untruncated distributions
        ref_logp = reference_logprobs(ref_model, mb, cfg.temperature, packed)
    inputs = losses.LossInputs(
        logp=scores.logp,
        behaviour_logp=mb.behaviour_logp,
        advantages=mb.advantages,
        mask=mb.mask,
        proximal_logp=mb.proximal_logp,
        logp_untruncated=scores.logp_untruncated,
        ref_logp=ref_logp,
        teacher_logp=teacher_logp,
        units=units,
        tokens=tokens,
    )
    loss, terms = losses.grpo_loss(inputs, settings)
    return loss, terms, scores.entropy


# --------------------------------------------------------------------------------------------------
# Scoring: the policy's, the reference's and the proximal policy's log-probs of the sampled tokens
# --------------------------------------------------------------------------------------------------
@dataclass
class TokenScores:
    """What `completion_logprobs` returns: (B, T) float32, 0 off the batch's mask."""

    # log-probs of the targets under the sampling distribution (temperature, top-k, top-p)
    logp: torch.Tensor
    entropy: torch.Tensor  # entropy of that distribution at each position (detached)
    # under the temperature alone (the KL term's), if asked for
    logp_untruncated: Optional[torch.Tensor] = None


def completion_logprobs(
    model, batch, temperature, top_k=-1, top_p=1.0, untruncated=False, packed=False
) -> TokenScores:
    """Score a (micro-)batch's completion tokens with the generator's sampling distribution, without
    logits (`logprobs.score_tokens`: the LM head, with the family's transform of it (heads.py), a
    chunk of tokens at a time; packed: the rows run without their padding, packing.py). Works with
    gradients, or under `torch.no_grad()` for a reference or proximal policy; `model` is a causal
    LM (or what models.py wraps one in), under FSDP2 or plain."""
    head = dataclasses.asdict(heads.head_transform(model.config))
    return TokenScores(
        *score_tokens(
            model,
            model.get_decoder(),
            model.get_output_embeddings(),
            batch.input_ids,
            batch.attention_mask,
            batch.targets,
            batch.mask,
            temperature,
            top_k,
            top_p,
            untruncated,
            packed,
            **head,
        )
    )


def reference_logprobs(ref_model, batch, temperature, packed=False):
    """Log-probs (B, T) of the reference policy (untruncated, at the sampling temperature), no
    gradient. `ref_model`: what models.build_frozen_models made (with LoRA, the policy with its
    adapter off)."""
    if ref_model is None:
        raise ValueError("--kl-coef > 0 needs a reference model (models.build_frozen_models)")
    with torch.no_grad():
        return completion_logprobs(ref_model, batch, temperature, packed=packed).logp


@tracing.timed("proximal log-probs")
def proximal_logprobs(
    model, batch, cfg, rank, world_size, device="cpu", stats=None, packed=False
) -> torch.Tensor:
    """(B, T) log-probs of the batch's tokens under the weights before its first update (the
    proximal policy), without gradients, micro-batched and chunked as training is. Each rank scores
    its own rows; a sum over ranks gives every rank all of them. `stats`: where the routers'
    agreement is counted (recorded routes)."""
    out = torch.zeros(batch.mask.shape)
    plan, count = rank_micro_batch_rows(batch, rank, world_size, cfg.micro_batch_tokens, packed)
    with torch.no_grad():
        # a rank with fewer micro-batches runs fillers: FSDP2 needs every rank's forward
        for i in range(count):
            rows = plan[i] if i < len(plan) else [0]
            mb = batch.select(rows).trimmed().to(device)
            measure = stats is not None and i < len(plan)
            with replay.routed_by(model, mb, measure, packed) as routing:
                logp = completion_logprobs(
                    model, mb, cfg.temperature, cfg.top_k, cfg.top_p, packed=packed
                ).logp
            replay.add_counts(stats, routing)
            if i < len(plan):
                out[rows, : logp.shape[1]] = logp.float().cpu()
    if world_size > 1:
        dist.all_reduce(out)
    return out


# --------------------------------------------------------------------------------------------------
# The mini-batches, and each rank's micro-batches of an update within --micro-batch-tokens
# --------------------------------------------------------------------------------------------------
def mini_batch_rows(num_rows: int, cfg: Config, step: int, epoch: int) -> list[torch.Tensor]:
    """The rows of each of a step's --mini-batches in one pass: a seeded shuffle (the same on every
    rank), then M nearly equal parts."""
    if cfg.mini_batches == 1:
        return [torch.arange(num_rows)]
    order = torch.randperm(
        num_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch)
    )
    return list(order.tensor_split(cfg.mini_batches))


def rows_for_rank(lengths: list[int], rank: int, world_size: int) -> list[int]:
    """One data-parallel rank's rows (indices into `lengths`, each row's prompt + completion
    length, in order), balanced by tokens: longest first, each to the rank with the fewest tokens
    so far (ties: the lowest rank), so the ranks' totals differ by at most the longest row. Every
    rank computes every rank's share from the whole batch, without communicating."""
    loads, mine = [0] * world_size, []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        loads[least] += lengths[i]
        if least == rank:
            mine.append(i)
    return sorted(mine)


def plan_micro_batches(lengths: list[int], max_tokens: int, packed=False) -> list[list[int]]:
    """Rows (indices into `lengths`, each row's prompt + completion length) grouped into
    micro-batches of at most `max_tokens` tokens, shortest rows first, so that rows of similar
    length share a micro-batch: padded, `max_tokens` bounds rows x the longest row (the padding
    stays small); packed, the rows' real tokens (and packing.row_attention pads little). A row
    longer than `max_tokens` gets a micro-batch of its own. `max_tokens` 0: one micro-batch."""
    plan, current, tokens = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        cost = tokens + lengths[i] if packed else (len(current) + 1) * lengths[i]
        if current and max_tokens and cost > max_tokens:
            plan.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return plan + [current] if current else plan


def rank_micro_batch_rows(
    batch: buffer.Batch, rank: int, world_size: int, max_tokens: int, packed=False
) -> tuple[list[list[int]], int]:
    """This rank's micro-batches as rows of `batch`, and how many micro-batches every rank runs (the
    most any rank needs: see `rank_micro_batches`)."""
    lengths = batch.attention_mask.sum(1).tolist()
    plans = []
    for r in range(world_size):
        rows = rows_for_rank(lengths, r, world_size)
        plans.append(
            [
                [rows[i] for i in mb]
                for mb in plan_micro_batches([lengths[i] for i in rows], max_tokens, packed)
            ]
        )
    count = max(len(plan) for plan in plans)
    plan = plans[rank]
    while len(plan) < count and any(len(mb) > 1 for mb in plan):
        k = max(range(len(plan)), key=lambda k: len(plan[k]))
        half = len(plan[k]) // 2
        plan = plan[:k] + [plan[k][:half], plan[k][half:]] + plan[k + 1 :]
    return plan, count


def rank_micro_batches(
    batch: buffer.Batch, rank: int, world_size: int, max_tokens: int, packed=False
) -> list[buffer.Batch]:
    """This rank's rows of `batch` (`rows_for_rank`) in micro-batches (`plan_micro_batches`; packed:
    of real tokens), each trimmed to its longest row.

    Every rank gets as many micro-batches as the rank that needs the most (each forward and backward
    runs FSDP2 collectives): a rank that needs fewer halves its largest ones, and one short of rows
    even then gets fillers, a row of the batch with its mask cleared (it runs through the model,
    adds no loss and no gradient). Every rank holds the whole batch, so each works out every rank's
    plan without communicating.
    """
    plan, count = rank_micro_batch_rows(batch, rank, world_size, max_tokens, packed)
    micro = [batch.select(rows).trimmed() for rows in plan]
    if len(micro) < count:
        filler = batch.select([0]).trimmed()
        micro += [dataclasses.replace(filler, mask=torch.zeros_like(filler.mask))] * (
            count - len(micro)
        )
    return micro
