"""The run's trace (tracing.py) and timeline (plots.plot_timeline).

- A real run's OUT/trace.json is valid trace-event JSON (what Perfetto and chrome://tracing load:
  each event's required fields, every process and track named by a metadata event, times monotone on
  each track) and has both sides, whose spans agree with metrics.jsonl; OUT/timeline.png is written.
  The run is the one tests/conftest.py makes for tests/test_bench.py too (bench/memory.py --what
  peak_rss --smoke: 12 steps, on-policy).
- Recorders in separate processes share one clock; each keeps at most two segment files; the merge
  keeps the trainer's last --trace-steps steps and survives a line cut short; a request's phases
  come from the engine steps; `python -m run.plots OUT` merges and draws a run in progress.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import tracing
from run import flag_checks, plots, trace_merge

REPO = Path(__file__).resolve().parent.parent
REQUIRED = {
    "X": ("name", "cat", "ts", "dur", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "i": ("name", "ts", "pid", "tid", "s"),
    "M": ("name", "pid", "args"),
}


def check_trace_format(doc: dict) -> list[dict]:
    """The checks Perfetto's JSON importer relies on; returns the events."""
    events = doc["traceEvents"]
    assert doc.get("displayTimeUnit") in ("ms", "ns") and events
    for e in events:
        assert all(k in e for k in REQUIRED[e["ph"]]), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["pid"] for e in events} <= named
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xi"} <= tracks
    last = {}
    for e in events:
        if e["ph"] in "XiC":
            track = (e["pid"], e.get("tid"), e["name"] if e["ph"] == "C" else None)
            assert e["ts"] >= last.get(track, 0), f"time goes back on {track}: {e}"
            last[track] = e["ts"]
    return events


def test_a_run_writes_a_valid_trace_with_both_sides_and_a_timeline(recorded_run):
    run_dir, _ = recorded_run
    events = check_trace_format(json.loads((run_dir / "trace.json").read_text()))
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    cats = {}
    for e in events:
        cats.setdefault(names[e["pid"]], set()).add(e.get("cat"))
    assert {"wait", "step", "forward", "backward", "optimizer", "publish", "evaluation"} <= cats[
        "trainer 0"
    ]
    assert {
        "swap",
        "swap phase",
        "group",
        "request",
        "request phase",
        "evaluation",
        "idle",
    } <= cats["generator"]
    # vLLM's engine steps (in the worker's process, or the core's)
    assert "engine" in set().union(*cats.values())
    # each step's spans agree with its metrics row: the wait, the tokens trained, their versions
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((e for e in events if e.get("cat") == "step"), key=lambda e: e["args"]["step"])
    waits = sorted((e for e in events if e.get("cat") == "wait"), key=lambda e: e["args"]["step"])
    assert [e["args"]["step"] for e in steps] == [r["step"] for r in rows] == list(range(12))
    for row, step, wait in zip(rows, steps, waits):
        assert (
            abs(wait["dur"] / 1e6 - row["trainer_wait_s"]) < 2e-3
            and wait["ts"] + wait["dur"] <= step["ts"] + 1
        )
        versions = {int(v): n for v, n in step["args"]["tokens_by_version"].items()}
        assert sum(versions.values()) == row["tokens"] and step["args"]["version"] == row["version"]
        assert step["args"]["version"] - 1 - min(versions) == row["lag_max"] == 0  # (on-policy)
    swaps = [e for e in events if e.get("cat") == "swap"]
    # a swap per step, on-policy
    assert len(swaps) >= 11 and all(e["args"]["version"] >= 1 for e in swaps)
    assert not (run_dir / "trace").exists()  # the processes' files, merged and removed
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


RECORD = """
import json, os, sys, time
from infra import tracing
name, steps, cat = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rec, t0 = tracing.start(name), tracing.clock()
for step in range(steps):
    tracing.step(step)
    time.sleep(0.002)
    # (from the end of the last step)
    t0 = tracing.complete("step %d" % step, t0, cat=cat, step=step, rank=0)
    tracing.counter("depth", groups=step)
wall_ns = time.time_ns()
tracing.complete("mark", tracing.clock())
tracing.flush()
print(json.dumps({"wall_ns": wall_ns, "pid": rec.pid, "files": sorted(os.listdir(rec.folder))}))
"""


def record_in_child(name: str, steps: int, cat: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", RECORD, name, str(steps), cat],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_processes_share_one_clock_keep_two_segments_and_the_merge_keeps_the_last_steps(
    tmp_path, monkeypatch
):
    for name in (tracing.DIR_ENV, tracing.STEPS_ENV, tracing.T0_ENV):
        monkeypatch.delenv(name, raising=False)
    tracing.configure(str(tmp_path), steps=3)
    try:
        first, second = (
            record_in_child("trainer 0", 10, "step"),
            record_in_child("generator", 2, "swap"),
        )
    finally:
        tracing.unconfigure()
    assert tracing.DIR_ENV not in os.environ
    # steps 0-9 in segments of 3: segments 2 (steps 6-8) and 3 (step 9) are left on disk
    assert [f for f in first["files"] if f.startswith("trainer")] == [
        f"trainer_0-{first['pid']}.{k}.jsonl" for k in (2, 3)
    ]
    with open(tmp_path / "trace" / f"trainer_0-{first['pid']}.3.jsonl", "a") as f:
        f.write('{"ph": "X", "name": "cut sh')  # a process killed in the middle of a write
    events = check_trace_format(json.loads(Path(trace_merge.merge(str(tmp_path))).read_text()))
    steps = [
        e["args"]["step"] for e in events if e.get("cat") == "step" and e["pid"] == first["pid"]
    ]
    assert steps == [7, 8, 9]  # the last 3 steps
    # one time base: each "mark" lies where its process
    # read the wall clock (µs since configure's t0)
    t0 = json.loads((tmp_path / "trace" / "run.json").read_text())["t0_ns"]
    marks = {e["pid"]: e["ts"] for e in events if e["name"] == "mark"}
    for child in (first, second):
        assert abs(marks[child["pid"]] - (child["wall_ns"] - t0) / 1e3) < 2000  # within 2 ms
    assert marks[second["pid"]] > marks[first["pid"]]
    # `python -m run.plots OUT` on a run in progress:
    # merges the processes' files and draws the timeline
    done = subprocess.run(
        [sys.executable, "-m", "run.plots", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "timeline.png").exists(), done.stderr
    # --trace-steps 0: nothing recorded, nothing left from before
    tracing.configure(str(tmp_path), steps=0)
    assert not (tmp_path / "trace").exists() and not (tmp_path / "trace.json").exists()
    assert tracing.DIR_ENV not in os.environ and tracing.start("trainer 0") is None


def test_request_phases_from_the_engine_steps():
    def span(cat, ts, dur, **args):
        return {
            "ph": "X",
            "name": cat,
            "cat": cat,
            "pid": 1,
            "tid": 2,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    events = [
        span("request", 0, 100, id="group-3"),
        span("engine", 10, 5, new={"group-3": 8}, requests=8, tokens=40),
        # paused; then the swap's reset preempts and resumes it in one step
        span("swap", 30, 10, version=2),
        span(
            "engine", 41, 4, preempted={"group-3": 8}, resumed={"group-3": 8}, requests=8, tokens=40
        ),
        # no room: preempted
        span("engine", 60, 2, preempted={"group-3": 1}, requests=7, tokens=7),
        span("engine", 70, 3, resumed={"group-3": 1}, requests=8, tokens=12),
        # never scheduled in the trace: no phases
        span("request", 200, 10, id="eval-0-1-greedy"),
    ]
    phases = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in trace_merge.request_phases(events)]
    assert sorted(phases, key=lambda p: p[1]) == [
        ("queued", 0, 10),
        ("paused (weight swap)", 30, 40),
        ("re-prefill", 41, 45),
        ("preempted", 60, 70),
        ("re-prefill", 70, 73),
    ]


def test_engine_request_ids_are_counted_under_the_id_the_generator_sent():
    assert tracing.sent_ids(
        [
            "0_group-12-1a2b3c4d",
            "7_group-12-ffffffff",
            "eval-3-1-greedy-0badcafe",
            "group-4-2-t1-12345678",
        ]
    ) == {"group-12": 2, "eval-3-1-greedy": 1, "group-4-2-t1": 1}


def test_trace_steps_must_not_be_negative():
    with pytest.raises(SystemExit, match="--trace-steps"):
        flag_checks.parse_args(["--trace-steps", "-1"])
    assert flag_checks.parse_args([]).trace_steps > 0  # on by default


def test_timeline_of_a_trace_without_steps_is_drawn(tmp_path):
    """A run stopped before its first step still gets a picture (the generator's side only)."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "generator"}},
        {
            "ph": "X",
            "name": "engine step",
            "cat": "engine",
            "pid": 1,
            "tid": 1,
            "ts": 5.0,
            "dur": 3.0,
            "args": {"requests": 1, "tokens": 4},
        },
    ]
    (tmp_path / "trace.json").write_text(
        json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    )
    t0 = time.perf_counter()
    assert plots.plot_timeline(str(tmp_path)) == str(tmp_path / "timeline.png")
    assert time.perf_counter() - t0 < 60


def record_by_hand(out: Path, name: str, step: int) -> None:
    """What a process of the configured start writes: one trainer step in its segment file."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "main"}},
        {
            "ph": "X",
            "name": f"step {step}",
            "cat": "step",
            "pid": 7,
            "tid": 1,
            "ts": 10.0,
            "dur": 5.0,
            "args": {"step": step, "rank": 0, "version": step + 1, "tokens_by_version": {}},
        },
    ]
    (out / "trace" / "trainer_0-7.0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events)
    )


def test_a_resume_keeps_the_earlier_starts_trace_and_timeline_under_their_own_names(
    tmp_path, monkeypatch
):
    """Each start's trace and timeline have their own names, trace.json and timeline.png link the
    newest's: a resume into the same OUT keeps the earlier start's (a crash's picture), even one
    whose parent was killed before it merged; a fresh start, like metrics.jsonl, begins anew."""
    from run import launch  # (vLLM: imported already where the suite ran test_engine.py)

    for name in (tracing.DIR_ENV, tracing.STEPS_ENV, tracing.T0_ENV):
        monkeypatch.delenv(name, raising=False)
    out, starts = str(tmp_path), []
    cfg = flag_checks.parse_args(["--out", out, "--trace-steps", "3"])
    for resumed in (False, True):
        launch.start_trace(cfg, resumed)
        record_by_hand(tmp_path, "trainer 0", len(starts))
        launch.write_timeline(cfg)  # merges, draws, unconfigures
        trace = os.path.realpath(tmp_path / "trace.json")
        timeline = os.path.realpath(tmp_path / "timeline.png")
        assert os.path.dirname(trace) == os.path.dirname(timeline) == os.path.realpath(tmp_path)
        starts.append((os.path.basename(trace), os.path.basename(timeline)))
    (first_trace, first_png), (second_trace, second_png) = starts
    assert first_trace != second_trace and first_png != second_png
    assert first_png == first_trace.replace("trace", "timeline").replace(".json", ".png")
    for (trace, png), step in zip(starts, (0, 1)):
        steps = [
            e["args"]["step"]
            for e in json.loads((tmp_path / trace).read_text())["traceEvents"]
            if e.get("cat") == "step"
        ]
        assert steps == [step] and (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # a start whose parent was killed: its processes' files, merged under its name by the resume
    launch.start_trace(cfg, resumed=True)
    record_by_hand(tmp_path, "trainer 0", 2)
    tracing.unconfigure()
    launch.start_trace(cfg, resumed=True)
    tracing.unconfigure()
    killed = os.path.basename(os.path.realpath(tmp_path / "trace.json"))
    assert killed not in (first_trace, second_trace) and (tmp_path / killed).exists()
    assert len(tracing.earlier_files(out)) == 5  # three traces, two timelines
    # an older version's plain trace.json: renamed by its time on a resume
    os.unlink(tmp_path / "trace.json")
    (tmp_path / "trace.json").write_text("{}")
    tracing.configure(out, 3, keep_earlier=True)
    tracing.unconfigure()
    assert not (tmp_path / "trace.json").exists() and len(tracing.earlier_files(out)) == 6
    # a fresh start: nothing of the earlier ones
    tracing.configure(out, 3)
    tracing.unconfigure()
    assert tracing.earlier_files(out) == []
    assert not os.path.lexists(tmp_path / "trace.json")
    assert not os.path.lexists(tmp_path / "timeline.png")
