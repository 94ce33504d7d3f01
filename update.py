"""update.py — the GRPO update on one rollout batch, on one FSDP2 rank.

Role: score the batch's completion tokens (log-probs and entropy through a chunked LM head: never
B x T x V), the loss of each micro-batch (`--micro-batch-tokens`, normalised by the whole step's counts so
the gradient is the whole batch's), and the optimizer steps of a batch (`--mini-batches` x `--ppo-epochs`,
against the proximal policy's log-probs: AReaL's decoupled objective).
Data contract: takes a collated `buffer.Batch` (every rank holds all of it) and the step's version; returns
`UpdateResult` (loss, gradient norm, log-prob agreement, metrics reduced over micro-batches and ranks).
May touch: the model's gradients and the optimizer it is given; collectives of the default process group.
"""
import math
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import buffer
import heads
import lora
from config import Config
from losses import (behaviour_weights, chunked_logprobs, distill_advantages, dsv32_sequence_mask, geometric_mean_mask, icepop_mask,
                    kl_penalty, mismatch_k3, overlong_penalty, policy_loss)


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
    lengths = torch.tensor([[len(c) for c in g.completion_ids] if g.model_masks is None else list(map(sum, g.model_masks))
                            for g in groups], dtype=torch.float32)
    episodes = any(g.model_masks is not None for g in groups)
    truncated = torch.tensor([[reason == "length" for reason in g.finish_reasons or ["stop"] * len(g.rewards)]
                              for g in groups])
    if cfg.overlong_penalty:
        budget = cfg.max_new_tokens * (cfg.max_turns if episodes else 1)
        rewards = rewards + overlong_penalty(lengths, budget, cfg.overlong_penalty)
    return rewards, truncated




@dataclass
class TokenScores:
    """What `completion_logprobs` returns: (B, T) float32, 0 off the batch's mask."""
    logp: torch.Tensor  # log-probs of the targets under the sampling distribution (temperature, top-k, top-p)
    entropy: torch.Tensor  # entropy of that distribution at each position (detached)
    logp_untruncated: Optional[torch.Tensor] = None  # under the temperature alone (the KL term's), if asked for


def completion_logprobs(model, batch, temperature, top_k=-1, top_p=1.0, untruncated=False) -> TokenScores:
    """Score a (micro-)batch's completion tokens with the generator's sampling distribution.

    The model runs without its LM head; the head, with the family's transform of it (heads.py), is applied
    to the final hidden states at completion positions only, a chunk of tokens at a time
    (`losses.chunked_logprobs`), so no (B, T, V) logits exist in the forward or the backward. Works with
    gradients, or under `torch.no_grad()` for a reference or proximal policy; `model` is a causal LM or a PEFT wrapper of one, under FSDP2 or plain."""
    # The whole model runs (under FSDP2 only its call gathers the weights), with logits_to_keep=[]: no logits;
    # the decoder's output is caught on the way. FSDP2's root keeps the LM head's weight gathered from its
    # forward to the end of the backward, so the head can be applied after the call.
    base = lora.base_model_of(model)
    caught = []
    hook = base.get_decoder().register_forward_hook(lambda _, __, out: caught.append(out.last_hidden_state))
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=batch.input_ids.device))
    finally:
        hook.remove()
    hidden = caught[0][:, :-1][batch.mask]  # final hidden states where completion tokens are predicted
    targets = batch.targets[batch.mask]
    head = base.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # a model whose root reshards after its forward (the KL reference): gather
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()

    # the family's transform after the head (Granite's scaling, Gemma-2's soft cap, ...), as vLLM applies it
    head = dataclasses.asdict(heads.head_transform(base.config))

    def scored(values):  # (N,) -> (B, T), 0 off the mask
        return values.new_zeros(batch.mask.shape).masked_scatter(batch.mask, values)

    logp, entropy = chunked_logprobs(hidden, weight, bias, targets, temperature, top_k, top_p, **head)
    scores = TokenScores(scored(logp), scored(entropy))
    if untruncated:
        truncated = 0 < top_k < weight.shape[0] or top_p < 1
        scores.logp_untruncated = scores.logp if not truncated else scored(
            chunked_logprobs(hidden, weight, bias, targets, temperature, **head)[0])
    return scores


def reference_logprobs(model, ref_model, batch, temperature):
    """Log-probs (B, T) of the reference policy (untruncated, at the sampling temperature), no gradient:
    `ref_model`, or with LoRA (`ref_model` None) the same model with its adapter switched off."""
    with torch.no_grad():
        if ref_model is not None:
            return completion_logprobs(ref_model, batch, temperature).logp
        with model.disable_adapter():
            return completion_logprobs(model, batch, temperature).logp


class StepStats:
    """One step's metrics, added up over its micro-batches and then over ranks: means (a total over a
    count), sums and maxima. Every rank adds the same names, in any order."""

    def __init__(self):
        self.means, self.sums, self.maxima = {}, {}, {}

    def mean(self, name, total, count):
        s, n = self.means.get(name, (0.0, 0))
        self.means[name] = (s + total, n + count)

    def add(self, name, value):
        self.sums[name] = self.sums.get(name, 0.0) + value

    def max(self, name, value):
        self.maxima[name] = max(self.maxima.get(name, -math.inf), value)

    def reduced(self, world_size) -> dict:
        """The step's values (the same on every rank: a collective, every rank calls it)."""
        means, sums, maxima = sorted(self.means), sorted(self.sums), sorted(self.maxima)
        totals = torch.tensor([self.means[n][0] for n in means] + [self.means[n][1] for n in means]
                              + [self.sums[n] for n in sums], dtype=torch.float64)
        highest = torch.tensor([self.maxima[n] for n in maxima], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(totals)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        k = len(means)
        out = {n: float(totals[i] / totals[k + i]) if totals[k + i] > 0 else 0.0 for i, n in enumerate(means)}
        out.update(zip(sums, totals[2 * k:].tolist()))
        out.update(zip(maxima, highest.tolist()))
        return out


def off_policy_mask(cfg, trained, trainer_old, logp, mb, weights, version, stats: StepStats):
    """The trained tokens less those the off-policy masks drop (losses.py: --geo-mask-*, --dsv32-mask-kl,
    --icepop-*), and the step's mismatch metrics, kept as tensors until the step's reduction: the
    behaviour-to-trainer k3 (trainer: the current log-probs) overall and by lag, the share each rule
    dropped or truncated (of trained tokens; of trained sequences for the sequence masks), and the
    normalised effective sample size (sum w)^2 / (n sum w^2) of the per-token weights the loss applies
    (importance weight x masks; at --is-level sequence each token carries its sequence's weight)."""
    n, rows = trained.sum(), trained.any(1)
    k3 = mismatch_k3(logp, mb.behaviour_logp, trained)
    stats.mean("mismatch_k3", k3.sum(), n)
    lag = version - mb.token_versions
    for age in range(cfg.max_lag + 1):  # every trained token's lag is within --max-lag (buffer.stale_mask)
        at = trained & (lag == age)
        stats.mean(f"mismatch_k3/lag{age}", (k3 * at).sum(), at.sum())
        stats.add(f"mismatch_tokens/lag{age}", at.sum())
    if weights is not None and cfg.is_mode == "truncate":
        stats.mean("is_truncated_frac", (trained & (weights >= cfg.is_high)).sum(), n)
    elif weights is not None:
        stats.mean("is_masked_frac", (trained & (weights == 0)).sum(), n)
    keep = trained
    if cfg.geo_mask_high is not None:
        kept = geometric_mean_mask(trainer_old, mb.behaviour_logp, trained, cfg.geo_mask_low, cfg.geo_mask_high)
        stats.mean("geo_masked_seq_frac", (rows & ~kept.any(1)).sum(), rows.sum())
        keep = keep & kept
    if cfg.dsv32_mask_kl is not None:
        kept = dsv32_sequence_mask(logp, mb.behaviour_logp, mb.advantages, trained, cfg.dsv32_mask_kl)
        stats.mean("dsv32_masked_seq_frac", (rows & ~kept.any(1)).sum(), rows.sum())
        keep = keep & kept
    if cfg.icepop_high is not None:
        kept = icepop_mask(trainer_old, mb.behaviour_logp, trained, cfg.icepop_low, cfg.icepop_high)
        stats.mean("icepop_masked_frac", (trained & ~kept).sum(), n)
        keep = keep & kept
    applied = torch.where(keep, weights if weights is not None else 1.0, 0.0)
    stats.add("ess_w", applied.sum())
    stats.add("ess_w2", applied.square().sum())
    stats.add("ess_n", n)
    return keep


def micro_batch_loss(model, ref_model, mb, cfg, units, tokens, version, stats: StepStats, teacher=None):
    """One micro-batch's term of the step's loss: its share of the whole batch's loss (normalised by the
    step's `units`, and its KL term by the step's completion `tokens`). Its metrics go into `stats`."""
    scores = completion_logprobs(model, mb, cfg.temperature, cfg.top_k, cfg.top_p, untruncated=cfg.kl_coef > 0)
    proximal = mb.proximal_logp if cfg.is_mode != "off" else None
    # A stale token can lie outside the current (or proximal) policy's top-k/top-p set (log-prob -inf): leave it out.
    outside = mb.mask & ~torch.isfinite(scores.logp)
    if proximal is not None:
        outside |= mb.mask & ~torch.isfinite(proximal)
    mask = mb.mask & ~outside
    logp = torch.where(mask, scores.logp, torch.zeros_like(scores.logp))
    # The decoupled objective (AReaL): the ratio against the proximal policy, the weights before the batch's
    # first update; the importance weight proximal / behaviour. With one update per batch the proximal
    # policy is the current one, and its log-probs need no pass of their own.
    trainer_old = torch.where(mask, proximal, 0.0) if proximal is not None else logp.detach()
    if cfg.is_mode == "off":
        old_logp, weights = mb.behaviour_logp, None  # ratio against the generator (PipelineRL style)
    else:
        old_logp = trainer_old
        weights = behaviour_weights(old_logp, mb.behaviour_logp, mask, level=cfg.is_level,
                                    mode=cfg.is_mode, low=cfg.is_low, high=cfg.is_high)
    trained, mask = mask, off_policy_mask(cfg, mask, trainer_old, logp, mb, weights, version, stats)
    advantages = mb.advantages
    if cfg.distill_coef > 0:  # the teacher scores the sampled (mask True) tokens, never an environment's, untruncated
        with torch.no_grad():  # against the current student's sampling log-probs (Tinker: the sampler's)
            teacher_logp = completion_logprobs(teacher, mb, cfg.temperature).logp
        advantages, reverse_kl = distill_advantages(advantages, logp, teacher_logp, mask, cfg.distill_coef)
        stats.mean("distill_reverse_kl", float(reverse_kl.sum()), int(mask.sum()))
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, variant=cfg.loss,
                                eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                                agg=cfg.agg, max_len=cfg.max_new_tokens, weights=weights, units=units)
    n = int(mask.sum())
    if cfg.kl_coef > 0:  # between the untruncated distributions
        ref_logp = reference_logprobs(model, ref_model, mb, cfg.temperature)
        kl = torch.where(mask, kl_penalty(scores.logp_untruncated, ref_logp, cfg.kl_kind), 0.0).sum()
        loss = loss + cfg.kl_coef * kl / max(tokens, 1)
        stats.mean("kl_ref", float(kl), n)
    if weights is not None:
        stats.mean("is_weight_mean", float(weights[mask].sum()), n)
    for name, value in metrics.items():  # policy_loss's are means over the masked tokens, but ratio_max
        stats.max(name, value) if name == "ratio_max" else stats.mean(name, value * n, n)
    stats.mean("entropy", float(scores.entropy[mb.mask].sum()), int(mb.mask.sum()))
    stats.add("outside_support_tokens", int(outside.sum()))
    stats.add("loss", float(loss.detach()))
    stats.add("positions", mb.attention_mask.numel())
    stats.add("padding", int((mb.attention_mask == 0).sum()))
    # Agreement with the generator, on completions sampled entirely by the weights we hold now.
    on_policy_rows = ((mb.token_versions == version) | ~trained).all(dim=1) & trained.any(dim=1)
    diff = (logp.detach() - mb.behaviour_logp).abs()[trained & on_policy_rows[:, None]]
    stats.max("logprob_diff_on_policy", float(diff.max()) if diff.numel() else -1.0)
    # bf16 makes the max a tail; the mean says how far the two sides typically disagree
    stats.mean("logprob_diff_mean", float(diff.sum()), diff.numel())
    stats.add("on_policy_rows", int(on_policy_rows.sum()))
    return loss


@dataclass
class StepResult:
    loss: float  # the whole batch's loss (every micro-batch, every rank)
    logprob_diff: Optional[float]  # max |trainer - generator| log-prob on fully on-policy rows (None: none)
    metrics: dict  # the per-step row's loss diagnostics, entropy, pad_frac, micro_batches


def train_on_batch(model, ref_model, batch, cfg, rank, world_size, version, device="cpu", teacher=None) -> StepResult:
    """Forward and backward over this rank's rows of the step's `batch`, one micro-batch at a time
    (`--micro-batch-tokens`): gradients accumulate, and the caller clips and steps once. Every term is
    normalised by the whole step's count (tokens for token-mean, non-empty sequences for the sequence
    means, over every micro-batch and rank), so the gradient is the whole batch's however it is split.
    Returns the step's loss and metrics, reduced over ranks (the same on every rank)."""
    micro_batches = buffer.rank_micro_batches(batch, rank, world_size, cfg.micro_batch_tokens)
    tokens = int(batch.mask.sum())  # every rank holds the whole batch: the step's counts need no collective
    units = tokens if cfg.agg == "token-mean" else int((batch.mask.sum(1) > 0).sum())
    stats = StepStats()
    for mb in micro_batches:
        loss = micro_batch_loss(model, ref_model, mb.to(device), cfg, units, tokens, version, stats, teacher)
        (loss * world_size).backward()  # FSDP2 averages gradients over ranks: the factor makes it their sum
    step = stats.reduced(world_size)
    on_policy = step.pop("on_policy_rows") > 0
    diff = step.pop("logprob_diff_on_policy")
    if not on_policy:
        step.pop("logprob_diff_mean")
    positions, padding = step.pop("positions"), step.pop("padding")
    for age in range(cfg.max_lag + 1):  # a lag no trained token has: no figure (not a 0)
        if not step.pop(f"mismatch_tokens/lag{age}"):
            step.pop(f"mismatch_k3/lag{age}")
    w, w2, n = step.pop("ess_w"), step.pop("ess_w2"), step.pop("ess_n")
    if n:
        step["is_ess"] = w * w / (n * w2) if w2 > 0 else 0.0
    step.update(outside_support_tokens=int(step["outside_support_tokens"]), pad_frac=padding / positions,
                micro_batches=len(micro_batches))
    return StepResult(step.pop("loss"), diff if on_policy else None, step)


def proximal_logprobs(model, batch, cfg, rank, world_size, device="cpu") -> torch.Tensor:
    """(B, T) log-probs of the batch's tokens under the weights before its first update (the proximal policy),
    without gradients, micro-batched and chunked as training is. Each rank scores its own rows; a sum over
    ranks gives every rank all of them."""
    out = torch.zeros(batch.mask.shape)
    plan, count = buffer.rank_micro_batch_rows(batch, rank, world_size, cfg.micro_batch_tokens)
    with torch.no_grad():
        for i in range(count):  # a rank with fewer micro-batches runs fillers: FSDP2 needs every rank's forward
            rows = plan[i] if i < len(plan) else [0]
            mb = batch.select(rows).trimmed()
            logp = completion_logprobs(model, mb.to(device), cfg.temperature, cfg.top_k, cfg.top_p).logp
            if i < len(plan):
                out[rows, :logp.shape[1]] = logp.float().cpu()
    if world_size > 1:
        dist.all_reduce(out)
    return out


def mini_batch_rows(num_rows: int, cfg: Config, step: int, epoch: int) -> list[torch.Tensor]:
    """The rows of each of a step's --mini-batches in one pass: a seeded shuffle (the same on every rank), then
    M nearly equal parts."""
    if cfg.mini_batches == 1:
        return [torch.arange(num_rows)]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch))
    return list(order.tensor_split(cfg.mini_batches))


@dataclass
class UpdateResult:
    loss: float  # mean over the step's optimizer updates
    grad_norm: float  # mean over the applied updates (before clipping)
    logprob_diff: Optional[float]  # trainer vs generator on fully on-policy rows, before any update (None: none)
    metrics: dict  # means over the updates (ratio_max: the max; counts: totals), and `updates`
    applied: int  # optimizer updates taken
    skipped: int  # updates skipped for a NaN/inf loss or gradient


def update_on_batch(model, ref_model, optimizer, batch, cfg, rank, world_size, version, step,
                    device="cpu", teacher=None) -> UpdateResult:
    """PPO's update on one rollout batch: --ppo-epochs passes, each of --mini-batches optimizer steps on a part
    of the batch (each normalised over its own part). With more than one update, the proximal policy's
    log-probs are computed first, once; the ratio then moves between updates and the clips act. An update
    with a NaN/inf loss or gradient is skipped. The model version advances once per batch (the caller's)."""
    proximal = cfg.is_mode != "off" and cfg.mini_batches * cfg.ppo_epochs > 1
    logprob_diff, diff_mean = None, None
    if proximal:
        batch = dataclasses.replace(batch, proximal_logp=proximal_logprobs(model, batch, cfg, rank, world_size, device))
        # agreement with the generator, measured on the weights it sampled with (before any update)
        on_policy = ((batch.token_versions == version) | ~batch.mask).all(1) & batch.mask.any(1)
        both = batch.mask & on_policy[:, None] & torch.isfinite(batch.proximal_logp)
        diff = (batch.proximal_logp - batch.behaviour_logp).abs()[both]
        if diff.numel():
            logprob_diff, diff_mean = float(diff.max()), float(diff.mean())
    results, norms, skipped = [], [], 0
    for epoch in range(cfg.ppo_epochs):
        for rows in mini_batch_rows(len(batch), cfg, step, epoch):
            result = train_on_batch(model, ref_model, batch.select(rows), cfg, rank, world_size, version, device,
                                    teacher)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if math.isfinite(grad_norm) and math.isfinite(result.loss):
                optimizer.step()
                norms.append(grad_norm)
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            results.append(result)
    metrics = {}
    for name in dict.fromkeys(name for r in results for name in r.metrics):  # (a lag may be in some only)
        values = [r.metrics[name] for r in results if name in r.metrics]
        combine = max if name == "ratio_max" else sum if name in ("outside_support_tokens", "micro_batches") else \
            (lambda v: sum(v) / len(v))
        metrics[name] = combine(values)
    if not proximal:  # one update: its own measure of the agreement (the model had not changed yet)
        logprob_diff = results[0].logprob_diff
    elif diff_mean is not None:
        metrics["logprob_diff_mean"] = diff_mean
    else:
        metrics.pop("logprob_diff_mean", None)
    metrics["updates"] = len(norms)
    return UpdateResult(sum(r.loss for r in results) / len(results), sum(norms) / len(norms) if norms else math.nan,
                        logprob_diff, metrics, len(norms), skipped)
