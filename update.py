"""update.py — the GRPO update on one rollout batch, on one FSDP2 rank.

Role: from the loop, one call: `update_on_batch` takes the batch's optimizer updates (--mini-batches
x --ppo-epochs, against the proximal policy: AReaL's decoupled objective), each a backward a
micro-batch at a time (--micro-batch-tokens, each term normalised by the whole update's counts, so
the gradient is the whole batch's; with --packing each runs its rows without padding, packing.py).
`micro_batch_loss`, one call below it, scores the micro-batch's tokens (the policy's log-probs; the
reference's and the teacher's when the run has them) and calls the loss once (losses.grpo_loss:
importance weight, masks, clipped objective, KL, distillation; its settings built from the flags
once per batch, losses.settings_from). What a step logs of it is gathered beside the loss
(`diagnostics`, `StepStats`), kept as tensors, and reaches the host once per step.
Data contract: takes a collated `buffer.Batch` (every rank holds all of it) and the step's version;
returns `UpdateResult` (loss, gradient norm, log-prob agreement, metrics reduced over micro-batches
and ranks). May touch: the model's gradients and the optimizer it is given; collectives of the
default process group.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import buffer
import losses
from config import Config
from infra import tracing
from trainer import packing, replay
from trainer.logprobs import head_of, score_tokens


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
            "update_on_batch without an optimizer takes one update: 1 x 1 mini-batches"
        )
    run = UpdatePass(
        model=model,
        ref_model=ref_model,
        teacher=teacher,
        cfg=cfg,
        settings=losses.settings_from(cfg, cfg.model_token_budget),
        packed=packs(cfg, (model, ref_model, teacher)),
        rank=rank,
        world_size=world_size,
        version=version,
        device=device,
    )
    proximal = cfg.is_mode != "off" and cfg.mini_batches * cfg.ppo_epochs > 1
    if proximal:
        batch = with_proximal_logprobs(run, batch)
    norms, skipped, updates = [], 0, 0
    for epoch in range(cfg.ppo_epochs):
        for rows in buffer.mini_batch_rows(len(batch), cfg.mini_batches, cfg.seed, step, epoch):
            part = batch.select(rows)
            # every rank holds the whole batch: the counts need no collective
            tokens = int(part.mask.sum())
            units = tokens if cfg.agg == "token-mean" else int((part.mask.sum(1) > 0).sum())
            micro_batches = buffer.rank_micro_batches(
                part, rank, world_size, cfg.micro_batch_tokens, run.packed
            )
            # without a proximal pass, the first update's forward is where the agreement with the
            # generator (and the routers') is measured: its weights are the ones that sampled
            measure = not proximal and updates == 0
            loss = torch.zeros((), device=device)
            for mb in micro_batches:
                mb = mb.to(device)
                # recorded routes (--router-replay) hold through the
                # backward: a checkpointed layer recomputes them
                with replay.routed_by(model, mb, measure, run.packed) as routing:
                    t_forward = tracing.clock()
                    mb_loss, terms, entropy = micro_batch_loss(run, mb, units, tokens)
                    t_backward = tracing.complete("forward", t_forward, rows=len(mb))
                    (mb_loss * world_size).backward()  # FSDP2 averages gradients over ranks
                    tracing.complete("backward", t_backward)
                replay.add_counts(run.stats, routing)
                diagnostics(run, mb_loss, terms, entropy, mb, measure_agreement=measure)
                loss += mb_loss.detach()
                del mb_loss, terms, entropy  # not alive through the next micro-batch's forward
            # the micro-batches of the step's updates (every rank runs as many: FSDP2's forwards)
            run.stats.max(
                "micro_batches", run.stats.maxima.get("micro_batches", 0) + len(micro_batches)
            )
            updates += 1
            if optimizer is None:
                break
            grad_norm = optimizer_step(model, optimizer, loss, cfg.grad_clip, world_size)
            skipped += grad_norm is None
            norms += [] if grad_norm is None else [grad_norm]
    return update_result(run.stats, norms, skipped, updates, world_size)


@dataclass
class UpdatePass:
    """What every micro-batch of one batch's updates shares, built once by `update_on_batch`."""

    model: torch.nn.Module
    ref_model: Optional[torch.nn.Module]
    teacher: Optional[torch.nn.Module]
    cfg: Config
    settings: losses.LossSettings
    packed: bool = False  # micro-batches run without padding (packing.py)
    rank: int = 0
    world_size: int = 1
    version: int = 0  # the trainer's version: the batch's lags are counted from it
    device: object = "cpu"
    stats: "StepStats" = dataclasses.field(default_factory=lambda: StepStats())


def with_proximal_logprobs(run: UpdatePass, batch):
    """The batch with the proximal policy's log-probs (the weights before its first update), and
    their agreement with the generator counted: they are the weights that sampled."""
    logp = proximal_logprobs(
        run.model,
        batch,
        run.cfg,
        run.rank,
        run.world_size,
        device=run.device,
        stats=run.stats,
        packed=run.packed,
    )
    batch = dataclasses.replace(batch, proximal_logp=logp)
    agreement(run.stats, batch.proximal_logp, batch, run.version)
    return batch


def update_result(stats, norms: list, skipped: int, updates: int, world_size: int) -> UpdateResult:
    """The batch's `UpdateResult`: its statistics reduced over the ranks (a collective)."""
    result = step_result(stats, world_size)
    result.metrics["updates"] = len(norms)
    return UpdateResult(
        loss=result.loss / updates,
        grad_norm=sum(norms) / len(norms) if norms else math.nan,
        logprob_diff=result.logprob_diff,
        metrics=result.metrics,
        applied=len(norms),
        skipped=skipped,
    )


def optimizer_step(model, optimizer, loss, grad_clip: float, world_size: int) -> Optional[float]:
    """Clip and apply the gradients on the parameters; the gradient norm before clipping, or None
    when the update was skipped (a NaN/inf loss or gradient). The gradients are cleared either
    way."""
    t_optimizer = tracing.clock()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    # (the grad norm and this: an update's host syncs)
    loss = loss.double().cpu().reshape(1)
    if world_size > 1:
        dist.all_reduce(loss)
    applied = math.isfinite(grad_norm) and math.isfinite(float(loss))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracing.complete("optimizer step", t_optimizer, cat="optimizer")
    return grad_norm if applied else None


def packs(cfg: Config, models) -> bool:
    """Whether an update's micro-batches run packed (packing.py): with --packing on; with auto where
    every model of `models` (None: the run has none) keeps packed rows apart, as train.py's start
    found (packing.decide leaves its verdict on each model; a model never probed is padded)."""
    if cfg.packing != "auto":
        return cfg.packing == "on"
    return all(getattr(m, packing.ATTRIBUTE, None) == "" for m in models if m is not None)


def micro_batch_loss(run: UpdatePass, mb, units: int, tokens: int):
    """One micro-batch's term of the update's loss, (loss, losses.LossTerms, entropy): the tensors
    the loss needs, scored here (packed: each model runs the rows without their padding), then one
    call to `losses.grpo_loss` (normalised by the update's `units`, its KL term by the update's
    completion `tokens`). The entropy: of the current sampling distribution."""
    model, ref_model, teacher, cfg, packed = (
        run.model,
        run.ref_model,
        run.teacher,
        run.cfg,
        run.packed,
    )
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
    loss, terms = losses.grpo_loss(inputs, run.settings)
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
    logits (`logprobs.score_tokens`: the LM head, with the family's transform of it
    (logprobs.head_of), a chunk of tokens at a time; packed: the rows run without their padding,
    packing.py). Works with gradients, or under `torch.no_grad()` for a reference or proximal
    policy; `model` is a causal LM (or what models.py wraps one in), under FSDP2 or plain."""
    head = dataclasses.asdict(head_of(model.config))
    return TokenScores(
        *score_tokens(
            model,
            model.get_decoder(),
            model.get_output_embeddings(),
            batch.input_ids,
            batch.attention_mask,
            targets=batch.targets,
            mask=batch.mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            untruncated=untruncated,
            packed=packed,
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
    plan, count = buffer.rank_micro_batch_rows(
        batch, rank, world_size, cfg.micro_batch_tokens, packed
    )
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
# What a step logs of its update: kept as tensors beside the loss, reduced once per step
# --------------------------------------------------------------------------------------------------
def diagnostics(run: UpdatePass, loss, t: losses.LossTerms, entropy, mb, measure_agreement=True):
    """What the step's row says of one micro-batch of `run` (its `loss`, `t` of losses.grpo_loss,
    the `entropy` of the current sampling distribution): policy_loss's diagnostics, entropy, KL
    terms, the behaviour-to-trainer mismatch (k3, overall and by lag), the share each off-policy
    rule dropped or truncated (of trained tokens; of trained sequences for the sequence masks), the
    importance weights' normalised effective sample size (sum w)^2 / (n sum w^2) (importance weight
    x masks; at --is-level sequence each token carries its sequence's weight), the agreement with
    the generator, and the padding the forward ran (packed: none)."""
    stats, cfg, version, packed = run.stats, run.cfg, run.version, run.packed
    n, rows, m = t.trained.sum(), t.trained.any(1), t.mask.sum()
    k3 = t.mismatch
    stats.mean("mismatch_k3", k3.sum(), n)
    lag = version - mb.token_versions
    # every trained token's lag is within --max-lag (buffer.stale_mask) and within the version
    # (token versions are >= 0): the loop stops at both, since each lag costs a few tensor ops and
    # two names per micro-batch, and a run that never drops (--max-lag 1000000) looped a million
    # times per micro-batch (minutes and GBs a step)
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
    # policy_loss's are means over the masked tokens, but ratio_max
    for name, value in t.policy.items():
        stats.max(name, value) if name == "ratio_max" else stats.mean(name, value * m, m)
    stats.mean("entropy", entropy[mb.mask].sum(), mb.mask.sum())
    stats.add("outside_support_tokens", t.outside.sum())
    stats.add("loss", loss.detach())
    # a packed micro-batch runs its real tokens alone
    real = mb.attention_mask.sum()
    stats.add("positions", real if packed else mb.attention_mask.numel())
    stats.add("padding", 0 if packed else mb.attention_mask.numel() - real)
    if measure_agreement:
        agreement(stats, t.logp, mb, version, t.trained)


def agreement(stats, logp, batch, version, scored=None) -> None:
    """|trainer - generator| log-prob on completions sampled entirely by the weights `logp` comes
    from (the tokens `scored`: by default the batch's where `logp` is finite); bf16 makes the max a
    tail, the mean says how far the two sides typically disagree."""
    scored = batch.mask & torch.isfinite(logp) if scored is None else scored
    on_policy_rows = ((batch.token_versions == version) | ~scored).all(dim=1) & scored.any(dim=1)
    both = scored & on_policy_rows[:, None]
    diff = torch.where(both, (logp - batch.behaviour_logp).abs(), 0.0)
    stats.max("logprob_diff_on_policy", torch.where(both, diff, -1.0).max())
    stats.mean("logprob_diff_mean", diff.sum(), both.sum())
    stats.add("on_policy_rows", on_policy_rows.sum())


class StepStats:
    """One step's metrics, added up over its micro-batches and updates as tensors where they were
    made (no host sync), then reduced over ranks once: means (a total over a count), sums and
    maxima. Every rank adds the same names, in any order."""

    def __init__(self):
        self.means, self.sums, self.maxima = {}, {}, {}

    def mean(self, name, total, count):
        s, n = self.means.get(name, (0.0, 0))
        self.means[name] = (s + total, n + count)

    def add(self, name, value):
        self.sums[name] = self.sums.get(name, 0.0) + value

    def max(self, name, value):
        self.maxima[name] = (
            value
            if name not in self.maxima
            else torch.maximum(torch.as_tensor(self.maxima[name]), torch.as_tensor(value))
        )

    def reduced(self, world_size) -> dict:
        """The step's values (the same on every rank: a collective, every rank calls it)."""
        means, sums, maxima = sorted(self.means), sorted(self.sums), sorted(self.maxima)
        values = to_host(
            [self.means[n][0] for n in means]
            + [self.means[n][1] for n in means]
            + [self.sums[n] for n in sums]
            + [self.maxima[n] for n in maxima]
        )
        k, totals, highest = (
            len(means),
            values[: 2 * len(means) + len(sums)],
            values[2 * len(means) + len(sums) :],
        )
        if world_size > 1:
            dist.all_reduce(totals)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        out = {
            n: float(totals[i] / totals[k + i]) if totals[k + i] > 0 else 0.0
            for i, n in enumerate(means)
        }
        out.update(zip(sums, totals[2 * k :].tolist()))
        out.update(zip(maxima, highest.tolist()))
        return out


def to_host(values) -> torch.Tensor:
    """float64 CPU copies of numbers and 0-d tensors: those on an accelerator in one device-to-host
    copy."""
    out = torch.tensor(
        [float(v) if not torch.is_tensor(v) or v.device.type == "cpu" else 0.0 for v in values],
        dtype=torch.float64,
    )
    on_device = [i for i, v in enumerate(values) if torch.is_tensor(v) and v.device.type != "cpu"]
    if on_device:
        out[on_device] = torch.stack([values[i].double().reshape(()) for i in on_device]).cpu()
    return out


@dataclass
class StepResult:
    loss: float  # the loss summed over micro-batches, ranks and updates
    # max |trainer - generator| log-prob on fully on-policy rows (None: none)
    logprob_diff: Optional[float]
    metrics: dict  # the per-step row's loss diagnostics, entropy, pad_frac, micro_batches


def step_result(stats: StepStats, world_size: int) -> StepResult:
    """The step's reduced metrics, with the derived figures (ESS, padding share) and without the
    counts they came from; a lag no trained token has, or agreement with no on-policy row, gets no
    figure (not a 0)."""
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
    row.update(
        outside_support_tokens=int(row["outside_support_tokens"]),
        pad_frac=padding / positions,
        micro_batches=int(row["micro_batches"]),
    )
    return StepResult(row.pop("loss"), diff if on_policy else None, row)
