"""generator/counters.py — the generator's counters, handed to the trainer with every group.

Role: `GeneratorStats` counts what the generator did (groups and tokens scored, time idle, waiting
on a full queue and scoring, weight loads and the requests in flight at them, evaluation tokens);
`EngineIdle` times the stretches when the engine generates nothing.
Data contract: `hand_off` is the dict a `buffer.RolloutGroup` carries as `gen_stats` (run/metrics.py
reads its keys: tokens, idle_s, elapsed_s, loaded_version, swap_requests, reward_s, sync_ms,
train_prompts, prompts_dropped_long, max_num_seqs); the publish-to-serving times of the loads since
the last group go with the next one only.
May touch: its own fields, the "engine idle" trace events (tracing.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

from infra import tracing


@dataclass
class GeneratorStats:
    """Written by the generator (rollout.py), its weight swaps (weight_swaps.py) and its
    evaluations (tasks/evaluation.run_eval)."""

    tokens: int = 0  # tokens the model sampled in the groups scored
    groups: int = 0  # groups scored and queued (a run stopping mid-score drops the group)
    idle_s: float = 0.0  # time the engine generated nothing (EngineIdle)
    queue_wait_s: float = 0.0  # time scored groups waited for room on a full queue
    elapsed_s: float = 0.0  # since the loop started
    loads: int = 0  # weight loads
    swap_requests: int = 0  # in flight at the loads: re-prefilled or kept on their cache
    max_num_seqs: int | None = None  # sequences vLLM runs at once (set with the engine)
    # the task's prompts, set as the loop starts: training, held out, cut for being too long
    train_prompts: int | None = None
    held_out_prompts: int | None = None
    prompts_dropped_long: int | None = None
    reward_s: float = 0.0  # time the reward functions took
    unscored: int = 0  # samples no reward function scored
    eval_tokens: int = 0  # tokens the held-out evaluations sampled
    # per load since the last group handed off: publish -> serving (ms), and its parts
    sync_ms: list[float] = field(default_factory=list)
    sync_parts: list[dict] = field(default_factory=list)

    def count_group(self, group) -> None:
        """Count a scored group (a `buffer.RolloutGroup`): its tokens, scoring time, unscored
        samples."""
        self.reward_s += sum(s["time_s"] for s in group.reward_stats.values())
        self.unscored += len(group.unscored)
        self.groups += 1
        self.tokens += (
            sum(map(sum, group.model_masks))
            if group.model_masks is not None
            else sum(map(len, group.completion_ids))
        )

    def count_swap(self, in_flight: int, sync_ms: float, parts: dict) -> None:
        """Count a weight load: the requests in flight at it, its publish-to-serving time and its
        parts."""
        self.loads += 1
        self.swap_requests += in_flight
        self.sync_ms.append(sync_ms)
        self.sync_parts.append(parts)

    def counters(self) -> dict:
        """The counters by name (the loads' times left out)."""
        pending = ("sync_ms", "sync_parts")
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in pending
        }

    def hand_off(self, loaded_version: int) -> dict:
        """The counters for the group queued now, with the loads' times since the last one (which
        start over) and the version loaded."""
        stats = dict(
            self.counters(),
            sync_ms=self.sync_ms,
            sync_parts=self.sync_parts,
            loaded_version=loaded_version,
        )
        self.sync_ms, self.sync_parts = [], []
        return stats


class EngineIdle:
    """The engine is idle while no request generates: each idle stretch is traced ("engine idle")
    and summed into `stats.idle_s`."""

    def __init__(self, stats: GeneratorStats):
        self.stats = stats
        self.generating = 0  # requests inside engine.generate (a group's G samples: one)
        self.since: float | None = time.perf_counter()  # None while a request generates

    @contextlib.contextmanager
    def generating_request(self):
        """Counts one request as generating while inside."""
        now = time.perf_counter()
        if self.generating == 0 and self.since is not None:
            tracing.complete("engine idle", self.since, now, track="engine idle", cat="idle")
            self.stats.idle_s += now - self.since
            self.since = None
        self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1
            if self.generating == 0:
                self.since = time.perf_counter()
