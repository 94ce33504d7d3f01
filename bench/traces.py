"""bench/traces.py — stage times read from a run's OUT/trace.json (tracing.py), for
bench/overlap.py.

Role: `steady_breakdown(trace, warmup)` sums, over a run's steady window (after the first `warmup`
steps, as common.steady), what each side did per step: trainer rank 0's wait for data, split by what
the generator did meanwhile (in this order: swapping weights; nothing in the engine while the
staleness gate let no group start, i.e. waiting for newer weights; nothing in the engine otherwise;
a group blocked on a full queue; generating), and its work (forward and backward, optimizer,
publish, evaluation); the generator's swaps, its waits for weights with nothing to run, its
full-queue waits, its idle engine; vLLM's engine steps (time, tokens). `engine_seconds_per_token` is
the engine's time per scheduled token after a given weight version (a generation-alone run has no
trainer steps). `waves_and_holds`: the most sequences an engine step ran, requests' queueing and
the weight loads held by evaluations. `Recording` traces the processes a benchmark starts inside it
(as launch.run does a run's). Data contract: reads the events' "cat" and args as tracing.py
writes them; times in seconds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from infra import tracing
from run import trace_merge


class Recording:
    """`with Recording() as r: proc.start()`: the processes started inside record a trace (as a
    run's do); `r.events()` afterwards merges what they wrote (and removes it)."""

    def __enter__(self):
        self.folder = tempfile.mkdtemp(prefix="asyncgrpo-bench-trace-")
        tracing.configure(self.folder, 10**9)
        return self

    def __exit__(self, *exc):
        tracing.unconfigure()

    def events(self) -> list[dict]:
        merged = trace_merge.merge(self.folder)
        events = load(merged) if merged else []
        shutil.rmtree(self.folder, ignore_errors=True)
        return events


def load(path) -> list[dict]:
    return json.loads(Path(path).read_text())["traceEvents"]


def intervals(events: list[dict], cat: str, pid=None) -> list[tuple[float, float]]:
    """The (start, end) seconds of the spans of `cat` (of process `pid`), merged where they
    overlap."""
    spans = sorted(
        (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in events
        if e["ph"] == "X" and e.get("cat") == cat and (pid is None or e["pid"] == pid)
    )
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def clip(spans, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def total(spans) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs, ys) -> list[tuple[float, float]]:
    """The intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys) -> list[tuple[float, float]]:
    """xs less ys (both sorted, disjoint)."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if b > a:
            out.append((a, b))
    return out


def steady_breakdown(events: list[dict], warmup: int) -> dict | None:
    """Per step of the steady window (seconds): what each side did, and what the trainer's wait
    overlapped. None when the trace has too few of rank 0's steps."""
    steps = sorted(
        (
            e
            for e in events
            if e["ph"] == "X" and e.get("cat") == "step" and e["args"].get("rank") == 0
        ),
        key=lambda e: e["args"]["step"],
    )
    if len(steps) <= warmup + 1:
        return None
    trainer = steps[0]["pid"]
    lo = (
        (steps[warmup - 1]["ts"] + steps[warmup - 1]["dur"]) / 1e6
        if warmup
        else steps[0]["ts"] / 1e6
    )
    hi = (steps[-1]["ts"] + steps[-1]["dur"]) / 1e6
    n = len(steps) - warmup

    def per_step(cat, pid=None):
        return clip(intervals(events, cat, pid), lo, hi)

    wait, swap, idle, full = (
        per_step("wait", trainer),
        per_step("swap"),
        per_step("idle"),
        per_step("queue full"),
    )
    # nothing to run, and no group may start
    for_weights = intersect(idle, per_step("staleness gate"))
    parts, rest = {}, wait
    for key, spans in (
        ("swap", swap),
        ("weights", for_weights),
        ("idle", idle),
        ("full_queue", full),
    ):
        parts[key], rest = intersect(rest, spans), subtract(rest, spans)
    engine = [
        e
        for e in events
        if e["ph"] == "X" and e.get("cat") == "engine" and lo <= e["ts"] / 1e6 < hi
    ]
    out = {
        "steps": n,
        "window_s": hi - lo,
        "step_s": (hi - lo) / n,
        "trainer_wait_s": total(wait) / n,
        "wait_during_swap_s": total(parts["swap"]) / n,
        "wait_for_weights_s": total(parts["weights"]) / n,
        "wait_engine_idle_s": total(parts["idle"]) / n,
        "wait_during_full_queue_s": total(parts["full_queue"]) / n,
        "wait_while_generating_s": total(rest) / n,
        "trainer_busy_s": total(per_step("step", trainer)) / n,
        "engine_s": total(intervals(engine, "engine")) / n,
        "engine_tokens": sum(e["args"]["tokens"] for e in engine) / n,
    }
    for key, cat in (
        ("forward_backward_s", ("forward", "backward")),
        ("optimizer_s", ("optimizer",)),
        ("publish_s", ("publish",)),
        ("evaluation_s", ("evaluation", "checkpoint", "save model")),
    ):
        out[key] = sum(total(per_step(c, trainer)) for c in cat) / n
    for key, spans in (
        ("gen_swap_s", swap),
        ("gen_for_weights_s", for_weights),
        ("gen_full_queue_s", full),
        ("gen_idle_s", idle),
    ):
        out[key] = total(spans) / n
    return out


def engine_seconds_per_token(events: list[dict], from_version: int) -> float | None:
    """vLLM's engine time per scheduled token (prefill and decode), over the engine steps after the
    generator's swap to `from_version` (None without one)."""
    swaps = [
        e
        for e in events
        if e["ph"] == "X" and e.get("cat") == "swap" and e["args"]["version"] >= from_version
    ]
    if not swaps:
        return None
    start = min(e["ts"] for e in swaps)
    engine = [e for e in events if e["ph"] == "X" and e.get("cat") == "engine" and e["ts"] >= start]
    tokens = sum(e["args"]["tokens"] for e in engine)
    return sum(e["dur"] for e in engine) / 1e6 / tokens if tokens else None


def waves_and_holds(events: list[dict]) -> dict:
    """What a run's generator waited on (issue 38): the most sequences one vLLM engine step ran and
    how many engine steps ran that many (a cap that bites splits a step's samples into waves); how
    long requests were queued before their first engine step (median, 90th percentile, ms); and,
    for each held-out evaluation after the start's, the trainer's publishes that landed during it
    and the ms from the first of them to the generator's next swap (a held load waits for the
    evaluation's end)."""
    steps = [e["args"].get("requests", 0) for e in events if e.get("name") == "engine step"]
    most = max(steps, default=0)
    queued = sorted(e["dur"] / 1e3 for e in events if e.get("name") == "queued")

    def pick(q):
        return queued[min(len(queued) - 1, int(q * len(queued)))] if queued else None

    publishes = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "publish")
    swaps = sorted(e["ts"] for e in events if e.get("name") == "pause")
    holds = []
    for e in events:
        if e.get("cat") != "evaluation" or not e["name"].startswith("evaluation (step "):
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        during = [p for p in publishes if start <= p < end]
        if e["name"] != "evaluation (step 0)" and during:
            later = [s for s in swaps if s >= during[0]]
            holds.append(
                {
                    "evaluation": e["name"],
                    "eval_ms": e["dur"] / 1e3,
                    "publishes_during": len(during),
                    "publish_to_swap_ms": (later[0] - during[0]) / 1e3 if later else None,
                }
            )
    return {
        "max_seqs_per_engine_step": most,
        "engine_steps": len(steps),
        "engine_steps_at_max": sum(s == most for s in steps),
        "queued_ms_p50": pick(0.5),
        "queued_ms_p90": pick(0.9),
        "eval_holds": holds,
    }
