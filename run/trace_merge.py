"""run/trace_merge.py — join a run's trace files (tracing.py writes them, one per process) into
OUT/trace.json.

Role: `merge(out)` reads OUT/trace/'s segment files, keeps the trainer's last --trace-steps steps
(`last_steps`), adds each request's phases (`request_phases`) and writes the start's own
OUT/trace-START.json, OUT/trace.json its link (tracing.configure names it: a resume keeps the
earlier starts' traces); train.py's parent calls it at the end of a run, `python -m run.plots OUT`
on a run in progress.
Data contract: tracing.py's files (one JSON event a line; metadata events "M" kept once each, the
newest) and OUT/trace/run.json ({"steps", "t0_ns", "file": the start's trace, "link": the name
that points at the newest start's}); the output is Chrome's trace-event format (see
tracing.py). Request phases: from the engine steps' request ids (vLLM's worker records which
requests each step scheduled new, preempted or resumed), grouped by the id the generator sent.
May touch: OUT/trace-START.json (written whole, then renamed), the link OUT/trace.json and, when
asked, OUT/trace/. Standard library only.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import shutil


def merge(out: str, remove_parts: bool = False) -> str | None:
    """Join OUT/trace/'s files into the start's own trace, OUT/trace-START.json (written whole, then
    renamed: a reader never sees half of it), and point OUT/trace.json at it; with `remove_parts`,
    delete them after. Returns its path, or None when there is nothing to merge. Lines cut short by
    a killed process, and files removed while we read them, are skipped."""
    folder = os.path.join(out, "trace")
    try:
        with open(os.path.join(folder, "run.json")) as f:
            run = json.load(f)
    except (OSError, ValueError):
        return None
    meta, events = {}, []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("ph") == "M":
                meta[(event["pid"], event.get("tid"), event["name"])] = event
            elif "ph" in event:
                events.append(event)
    events = last_steps(events, run["steps"])
    events += request_phases(events)
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    # the start's own file and its link (tracing.configure; an older version's run.json: neither)
    name, link = run.get("file", "trace.json"), run.get("link")
    path = os.path.join(out, name)
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(
            {
                "traceEvents": list(meta.values()) + events,
                "displayTimeUnit": "ms",
                "otherData": {"t0_ns": run["t0_ns"], "trace_steps": run["steps"]},
            },
            f,
            separators=(",", ":"),
        )
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    if link:
        point(out, link, name)
    if remove_parts:
        shutil.rmtree(folder, ignore_errors=True)
    return path


def point(out: str, link: str, target: str) -> None:
    """OUT/link (trace.json, timeline.png) -> OUT/target, the newest start's: a relative symbolic
    link, replaced at once (a reader never finds none); a copy where the file system has none."""
    tmp = os.path.join(out, f".{link}.{os.getpid()}.tmp")
    try:
        os.symlink(target, tmp)
    except OSError:
        shutil.copyfile(os.path.join(out, target), tmp)
    os.replace(tmp, os.path.join(out, link))


def last_steps(events: list[dict], steps: int) -> list[dict]:
    """The events of the trainer's last `steps` steps (rank 0's "step" spans; all events if it has
    fewer)."""
    ends = sorted(
        e["ts"] + e["dur"]
        for e in events
        if e.get("cat") == "step" and e.get("args", {}).get("rank") == 0
    )
    if len(ends) <= steps:
        return events
    cut = ends[-steps - 1]
    return [e for e in events if e["ts"] + e.get("dur", 0) > cut]


def request_phases(events: list[dict]) -> list[dict]:
    """Each request's phases, nested in its span: queued (sent, not yet scheduled by the engine),
    paused (a weight swap), preempted (until the engine resumed it) and re-prefill (the engine step
    that resumed it: its KV cache recomputed). From the engine steps' request ids, grouped by the id
    the generator sent: for a group of n samples, the first scheduled and every preemption or resume
    of any of them."""
    first, preempted, resumed, swaps = {}, {}, {}, []
    for e in events:
        if e.get("cat") == "engine" and e["ph"] == "X":
            args = e.get("args", {})
            for rid in args.get("new", ()):
                first[rid] = min(first.get(rid, e["ts"]), e["ts"])
            for rid in args.get("preempted", ()):
                preempted.setdefault(rid, []).append(e["ts"])
            for rid in args.get("resumed", ()):
                resumed.setdefault(rid, []).append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "swap" and e["ph"] == "X":
            swaps.append((e["ts"], e["ts"] + e["dur"]))
    phases, swaps = [], sorted(swaps)
    swap_starts = [a for a, _ in swaps]
    for e in events:
        if e.get("cat") != "request" or e["ph"] != "X":
            continue
        rid, start, end = e["args"]["id"], e["ts"], e["ts"] + e["dur"]
        if rid not in first:  # (no engine step of it in the trace: its phases are unknown)
            continue
        running = min(max(first[rid], start), end)
        near = swaps[
            max(0, bisect.bisect_left(swap_starts, running) - 1) : bisect.bisect_left(
                swap_starts, end
            )
        ]
        spans = [(a, b, "paused (weight swap)") for a, b in near if a < end and b > running]
        resumes = sorted(r for r in resumed.get(rid, ()) if start <= r[0] <= end)
        for p in preempted.get(rid, ()):
            later = [r for r in resumes if r[0] >= p]
            # (a swap preempts and resumes in one step: its pause is the gap)
            if later and later[0][0] > p:
                spans.append((p, later[0][0], "preempted"))
        spans += [(a, b, "re-prefill") for a, b in resumes]
        cursor = running
        for a, b, name in sorted(spans):
            a, b = max(a, cursor), min(b, end)
            if b > a:
                phases.append(
                    dict(
                        e,
                        name=name,
                        cat="request phase",
                        ts=a,
                        dur=round(b - a, 1),
                        args={"id": rid},
                    )
                )
                cursor = b
        if running > start:
            phases.append(
                dict(
                    e,
                    name="queued",
                    cat="request phase",
                    dur=round(running - start, 1),
                    args={"id": rid},
                )
            )
    return phases
