"""buffer.py — the bounded rollout queue and what crosses it: the generator's only path to the
trainer.

Role
    `RolloutGroup` (one prompt, its G completions, every token tagged with the version that sampled
    it: `tag_versions`), the staleness rule (`--max-lag`), the assembly of padded training batches
    and their split into mini-batches and each rank's micro-batches.
Data contract
    - A `multiprocessing` queue of `--queue-size` groups: a full queue blocks the generator (a first
      bound on staleness and memory). Groups hold plain lists: the sender may exit before the
      receiver unpickles.
    - A completion may hold environment tokens (multi-turn episodes, tasks/episodes.py):
      `model_masks` marks the tokens the model sampled; the others carry version -1 and log-prob 0
      and are never trained.
    - A token's lag = trainer version - its version; --max-lag bounds the lag of every trained
      token. --stale-rule tokens: the tokens beyond it are masked (`stale_mask`) and a group is
      dropped only when none of its model tokens is fresh enough; group: a group with any stale
      sample is dropped. Drops are counted (`dropped_stale`), never silent.
    - `Batch` tensors are (num_samples, seq_len - 1), aligned with targets `input_ids[:, 1:]`;
      `mask` is True on model-sampled completion tokens.
    - With --router-replay or --router-record a sample carries the routes of every position
      (generator/routes.py: numpy, uint8 or uint16, all bits set where missing); a batch's `routes`
      are (num_samples, seq_len, layers, top_k), aligned with `input_ids`: uint8 (255 where missing
      or padding), or int32 for uint16 routes (65535 there).
May touch: the queue it is handed. Nothing of the trainer's model or the engine.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.queues
import queue as queue_lib
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class RolloutGroup:
    group_id: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    token_versions: list[list[int]]
    rewards: list[float]
    answer: str = ""
    gen_stats: dict = field(default_factory=dict)  # generator counters when this group was enqueued
    # per reward function: counters (rewards.call_reward)
    reward_stats: dict = field(default_factory=dict)
    # samples no reward function scored (their reward: the
    unscored: list[int] = field(default_factory=list)
    #   group's mean; their advantage: 0, out of every statistic: `scored_mask`)
    # per completion: "stop" (eos or a stop string) | "length"
    finish_reasons: list[str] = field(default_factory=list)
    # the pass over the training prompts this group's prompt was taken in (tasks/prompts.walk)
    epoch: int = 0
    # per completion token: sampled by the model (None: all were)
    model_masks: list[list[bool]] | None = None
    # multi-turn episodes: turns, env time, faults (tasks/episodes.py)
    episode_stats: dict = field(default_factory=dict)
    # per completion: the routes of prompt + completion (routes.py); None: not recorded
    routes: list | None = None

    def turns(self) -> list[int]:
        return self.episode_stats.get("turns") or [1] * len(self.completion_ids)

    def model_tokens(self) -> list[int]:
        """Per completion, the tokens the model sampled (an episode's environment tokens left
        out)."""
        if self.model_masks is None:
            return [len(c) for c in self.completion_ids]
        return [sum(m) for m in self.model_masks]


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    reward: float
    advantage: float
    model_mask: list[bool] | None = None  # None: every completion token was sampled by the model
    routes: np.ndarray | None = None  # (prompt + completion, layers, top_k) (routes.py)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L-1) = input_ids[:, 1:]
    mask: torch.Tensor  # (B, L-1) bool: target is a completion token
    behaviour_logp: torch.Tensor  # (B, L-1) generator's sampling log-probs (0 off the mask)
    token_versions: torch.Tensor  # (B, L-1) int64, -1 off the mask
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)
    # (B, L-1) the trainer's log-probs before the batch's
    # first update (the proximal policy), once computed
    proximal_logp: torch.Tensor | None = None
    # (B, L, layers, top_k) uint8 or int32, all ones where missing (routes.py)
    routes: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> "Batch":
        return Batch(
            **{
                f.name: None if getattr(self, f.name) is None else fn(f.name, getattr(self, f.name))
                for f in dataclasses.fields(self)
            }
        )

    def select(self, rows) -> "Batch":
        return self._map(lambda name, t: t[rows])

    def trimmed(self) -> "Batch":
        """The same rows without the trailing columns that are padding in every row."""
        length = int(self.attention_mask.sum(1).max()) if len(self) else self.input_ids.shape[1]

        # input_ids and attention_mask are one longer than the target-aligned tensors
        def trim(name, t):
            if t.dim() == 1:
                return t
            return t[
                :, : length if name in ("input_ids", "attention_mask", "routes") else length - 1
            ]

        return self._map(trim)

    def to(self, device) -> "Batch":
        return self._map(lambda name, t: t.to(device))


def tag_versions(weight_versions, num_tokens: int) -> list[int]:
    """Per-token versions from vLLM's spans ([start, end) per version label)."""
    if num_tokens == 0:
        return []
    if not weight_versions:
        raise RuntimeError("vLLM returned no weight-version spans: cannot tag tokens by version")
    tags = [-1] * num_tokens
    for span in weight_versions:
        for i in range(span.start, min(span.end, num_tokens)):
            tags[i] = int(span.version)
    if -1 in tags:
        raise RuntimeError(f"tokens without a version tag: {tags}")
    return tags


class GroupSource(Protocol):
    """Where the trainer takes groups from: this node's RolloutQueue, or remote.TrainerLink (groups
    sent from a generator on another machine)."""

    def get(self, timeout: float | None = None) -> RolloutGroup: ...  # queue.Empty after `timeout`

    def metrics(self) -> dict: ...  # what the source adds to the step's metrics


class RolloutQueue(multiprocessing.queues.Queue):
    """One node's rollout queue: a `multiprocessing` queue of at most `maxsize` groups (spawn
    context). Every source the trainer takes groups from offers `get(timeout=)` and `metrics()`,
    what it adds to the step's metrics (remote.TrainerLink, the other source: its queue bound and
    the weights' send); this one, nothing."""

    def __init__(self, maxsize: int = 0, ctx=None):
        super().__init__(maxsize, ctx=ctx or multiprocessing.get_context("spawn"))

    def metrics(self) -> dict:
        return {}


def put_group(q, group: RolloutGroup, should_stop, timeout_s: float) -> float:
    """Blocking put that honours a stop flag and a timeout; returns the seconds spent waiting for
    space."""
    start = time.monotonic()
    while True:
        try:
            q.put(group, timeout=0.1)
            return time.monotonic() - start
        except queue_lib.Full:
            if should_stop():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(
                    f"rollout queue stayed full for {timeout_s:.0f} s: is the trainer alive?"
                )


def sample_lag(trainer_version: int, token_versions: list[int]) -> int:
    """Versions between the trainer and the oldest model token of a sample (0 for none; environment
    tokens, version -1, have no age)."""
    model = [v for v in token_versions if v >= 0]
    return trainer_version - min(model) if model else 0


def fresh_tokens(trainer_version: int, token_versions: list[int], max_lag: int) -> int:
    """Model tokens of a sample at most `max_lag` versions old."""
    return sum(1 for v in token_versions if v >= 0 and trainer_version - v <= max_lag)


def length_bucket(n: int) -> int:
    """The lower bound of n's power-of-two bucket (0, 1, 2, 4, 8, ...): how staleness is logged by
    length."""
    return 0 if n <= 0 else 1 << (n.bit_length() - 1)


def stale_census(groups, trainer_version: int, max_lag: int, dropped: bool, census: dict) -> None:
    """Add the samples of `groups` to `census` = {"len": {bucket: [samples, dropped, tokens, stale
    tokens, tokens dropped]}, "turns": {turns: [...]}}: what staleness cost, by model-token length
    and by turns per episode (tokens: model tokens; stale: older than `max_lag`; dropped: of the
    samples dropped whole)."""
    for group in groups:
        for versions, turns in zip(group.token_versions, group.turns()):
            model = sum(1 for v in versions if v >= 0)
            stale = model - fresh_tokens(trainer_version, versions, max_lag)
            for kind, key in (("len", length_bucket(model)), ("turns", turns)):
                row = census.setdefault(kind, {}).setdefault(str(key), [0, 0, 0, 0, 0])
                row[0] += 1
                row[1] += int(dropped)
                row[2] += model
                row[3] += stale
                row[4] += model if dropped else 0


@dataclass
class TakeResult:
    groups: list[RolloutGroup]
    samples_kept: int
    samples_dropped: int  # samples of stale groups
    groups_dropped: int  # groups dropped as stale (a group with any stale sample)
    wait_s: float
    # --filter-groups: groups whose rewards were all equal (no learning signal)
    groups_filtered: int = 0
    stale: dict = field(default_factory=dict)  # stale_census of every group taken, kept or dropped


class Stopped(Exception):
    """The run was asked to stop while the trainer waited for rollouts."""


def take_groups(
    q: GroupSource,
    num_groups: int,
    trainer_version: int,
    max_lag: int,
    timeout_s: float,
    should_stop=lambda: False,
    filter_groups: bool = False,
    max_groups_per_step: int = 0,
    on_drop=lambda: None,
    stale_rule: str = "group",
) -> TakeResult:
    """Take groups from the queue until `num_groups` of them are kept.

    stale_rule "group": a group is trained whole or not at all: one with any sample older than
    `max_lag` is dropped (its samples counted as stale), so a group's advantages are always computed
    over exactly the samples trained, and the logged reward is the reward of what was trained. That
    drops long completions more often (their first tokens are the oldest). stale_rule "tokens": a
    group is dropped only when none of its model tokens is within `max_lag`; the trainer masks the
    stale tokens of the others (`stale_mask`). With `filter_groups` (DAPO's dynamic sampling) a
    group whose rewards are all equal is dropped too (its advantages would all be 0). Both are
    replaced by the generator, which must learn of each one at once (`on_drop()`): its staleness
    gate counts the groups the trainer still needs, and waiting for this step's end would deadlock
    both. Raises TimeoutError if no group arrives for `timeout_s` seconds, `Stopped` if
    `should_stop()` turns True meanwhile, and RuntimeError if `max_groups_per_step` groups (default
    20 x `num_groups`) arrive without enough informative ones (every prompt solved, or none ever).
    """
    kept_groups, kept, dropped, groups_dropped, filtered, wait, census = [], 0, 0, 0, 0, 0.0, {}
    max_groups_per_step = max_groups_per_step or 20 * num_groups
    while len(kept_groups) < num_groups:
        start = time.monotonic()
        while True:
            try:
                group = q.get(timeout=0.2)
                break
            except queue_lib.Empty:
                if should_stop():
                    raise Stopped()
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(
                        f"no rollout group arrived for {timeout_s:.0f} s: is the generator alive?"
                    )
        wait += time.monotonic() - start
        if stale_rule == "group":
            stale = any(sample_lag(trainer_version, v) > max_lag for v in group.token_versions)
        else:
            stale = any(t >= 0 for v in group.token_versions for t in v) and not any(
                fresh_tokens(trainer_version, v, max_lag) for v in group.token_versions
            )
        stale_census([group], trainer_version, max_lag, stale, census)
        if stale:
            dropped += len(group.token_versions)
            groups_dropped += 1
            on_drop()
        elif filter_groups and max(group.rewards) == min(group.rewards):
            filtered += 1
            on_drop()
            if filtered + groups_dropped + len(kept_groups) >= max_groups_per_step:
                raise RuntimeError(
                    f"--filter-groups: {filtered} of the last {max_groups_per_step} groups had "
                    f"equal rewards (all solved or all failed), too few to fill a step of "
                    f"{num_groups}: the task is too easy or too hard for this model"
                )
        else:
            kept_groups.append(group)
            kept += len(group.token_versions)
    return TakeResult(
        groups=kept_groups,
        samples_kept=kept,
        samples_dropped=dropped,
        groups_dropped=groups_dropped,
        wait_s=wait,
        groups_filtered=filtered,
        stale=census,
    )


def scored_mask(groups: list[RolloutGroup]) -> torch.Tensor:
    """(num_groups, G) bool: False on the samples no reward function scored
    (advantages.estimate_advantages' `scored`)."""
    return torch.tensor(
        [[j not in g.unscored for j in range(len(g.rewards))] for g in groups], dtype=torch.bool
    )


def to_samples(groups: list[RolloutGroup], advantages: torch.Tensor) -> list[Sample]:
    """Flatten groups into samples; `advantages[g, j]` is sample j's of group g."""
    return [
        Sample(
            prompt_ids=group.prompt_ids,
            completion_ids=group.completion_ids[j],
            behaviour_logprobs=group.behaviour_logprobs[j],
            token_versions=group.token_versions[j],
            reward=group.rewards[j],
            advantage=float(advantages[g, j]),
            model_mask=None if group.model_masks is None else group.model_masks[j],
            routes=None if group.routes is None else group.routes[j],
        )
        for g, group in enumerate(groups)
        for j in range(len(group.completion_ids))
    ]


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad prompt + completion; the mask marks model-sampled completion targets."""
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length - 1), dtype=torch.bool)
    behaviour = torch.zeros((n, length - 1), dtype=torch.float32)
    versions = torch.full((n, length - 1), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        attention[i, : p + c] = 1
        # the completion token at position p + t is predicted at position p + t - 1
        mask[i, p - 1 : p - 1 + c] = (
            True if s.model_mask is None else torch.tensor(s.model_mask, dtype=torch.bool)
        )
        if c:
            behaviour[i, p - 1 : p - 1 + c] = torch.tensor(
                s.behaviour_logprobs, dtype=torch.float32
            )
            versions[i, p - 1 : p - 1 + c] = torch.tensor(s.token_versions, dtype=torch.long)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:].clone(),
        mask=mask,
        behaviour_logp=behaviour,
        token_versions=versions,
        advantages=advantages,
        rewards=rewards,
        routes=collate_routes(samples, length),
    )


def collate_routes(samples: list[Sample], length: int) -> torch.Tensor | None:
    """(B, length, layers, top_k): each sample's routes from position 0 as they came (uint8; uint16
    as int32, which torch handles), the missing mark (all ones of the routes' dtype) where missing
    or padding."""
    shaped = [s.routes for s in samples if s.routes is not None]
    if not shaped:
        return None
    narrow = shaped[0].dtype == np.uint8
    missing = np.iinfo(shaped[0].dtype).max
    routes = torch.full(
        (len(samples), length, *shaped[0].shape[1:]),
        missing,
        dtype=torch.uint8 if narrow else torch.int32,
    )
    for i, s in enumerate(samples):
        if s.routes is not None and len(s.routes):
            rows = s.routes[:length]
            routes[i, : len(rows)] = torch.from_numpy(rows if narrow else rows.astype(np.int32))
    return routes


def route_stats(groups: list[RolloutGroup]) -> dict:
    """What carrying routes costs: bytes per position (prompt + completion) of the groups taken."""
    carried = [(r.nbytes, len(r)) for g in groups if g.routes is not None for r in g.routes]
    positions = sum(n for _, n in carried)
    return {"router/bytes_per_token": sum(b for b, _ in carried) / positions} if positions else {}


def stale_mask(batch: Batch, trainer_version: int, max_lag: int) -> torch.Tensor:
    """(B, L-1) True on trained tokens older than `max_lag` versions (stale_rule "tokens" masks them
    out)."""
    return batch.mask & (trainer_version - batch.token_versions > max_lag)


def staleness_stats(batch: Batch, trainer_version: int) -> dict:
    """Per-token lag of the tokens trained on (trainer version - token version)."""
    lags = (trainer_version - batch.token_versions[batch.mask]).float()
    if lags.numel() == 0:
        return {"lag_mean": 0.0, "lag_max": 0, "fresh_token_frac": 1.0}
    return {
        "lag_mean": float(lags.mean()),
        "lag_max": int(lags.max()),
        "fresh_token_frac": float((lags == 0).float().mean()),
    }


# --------------------------------------------------------------------------------------------------
# The mini-batches, and each rank's micro-batches of an update within --micro-batch-tokens
# --------------------------------------------------------------------------------------------------
def mini_batch_rows(
    num_rows: int, mini_batches: int, seed: int, step: int, epoch: int
) -> list[torch.Tensor]:
    """The rows of each of a step's --mini-batches in one pass: a seeded shuffle (the same on every
    rank), then M nearly equal parts."""
    if mini_batches == 1:
        return [torch.arange(num_rows)]
    order = torch.randperm(
        num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + epoch)
    )
    return list(order.tensor_split(mini_batches))


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
    batch: Batch, rank: int, world_size: int, max_tokens: int, packed=False
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
    batch: Batch, rank: int, world_size: int, max_tokens: int, packed=False
) -> list[Batch]:
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
