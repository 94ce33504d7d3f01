"""step_stats.py — what a step logs of its update: gathered beside the loss, reduced once.

Role: update.py hands each micro-batch's loss terms (losses.LossTerms) to `diagnostics`: the loss
family's metrics, entropy, KL terms, the behaviour-to-trainer mismatch overall and by lag, what each
off-policy rule dropped, the importance weights' effective sample size, the agreement with the
generator. They are added up as tensors where they were made (`StepStats`: no host sync per
micro-batch) and reach the host once per step (`StepStats.reduced`, then `step_result`).
Data contract: a micro-batch's tensors ((B, T), 0-d) in; a `StepResult` of plain numbers out, the
same on every rank.
May touch: collectives of the default process group (`StepStats.reduced`: every rank calls it).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from losses import LossTerms, mismatch_k3


def diagnostics(
    stats, loss, t: LossTerms, entropy, mb, cfg, version, measure_agreement=True, packed=False
) -> None:
    """What the step's row says of one micro-batch (its `loss`, `t` of losses.grpo_loss, the
    `entropy` of the current sampling distribution): policy_loss's diagnostics, entropy, KL terms,
    the behaviour-to-trainer mismatch (k3, overall and by lag), the share each off-policy rule
    dropped or truncated (of trained tokens; of trained sequences for the sequence masks), the
    importance weights' normalised effective sample size (sum w)^2 / (n sum w^2) (importance weight
    x masks; at --is-level sequence each token carries its sequence's weight), the agreement with
    the generator, and the padding the forward ran (packed: none)."""
    n, rows, m = t.trained.sum(), t.trained.any(1), t.mask.sum()
    k3 = mismatch_k3(t.logp, mb.behaviour_logp, t.trained)
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
