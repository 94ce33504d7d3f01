"""infra/tracing.py — the run's timeline: trace events from every process, merged into
OUT/trace.json.

Role: each process of a run records what it does and when, on one clock: the trainer ranks (waits
for data, forward and backward per micro-batch, optimizer steps, publishes, evaluations,
checkpoints), the generator (weight swaps and their phases, the idle engine, the staleness gate,
each group's and episode's requests on swim lanes, env calls, full-queue waits, the queue's depth)
and vLLM's worker (each engine step: requests, tokens, requests new, preempted or resumed; weight
loads). `configure(out, steps)` in the parent, before any child starts, puts the settings in the
environment every child inherits; `start(name)` in a child opens its recorder (without `configure`
every call here is a no-op); trace_merge.py joins the processes' files into OUT/trace.json (the
parent at the end; `python -m run.plots OUT` on a run in progress). Data contract: Chrome's
trace-event format (Perfetto, chrome://tracing): a JSON object whose "traceEvents" are complete
events ("X": ts, dur), counters ("C"), instants ("i") and metadata ("M": process and track names);
pid = the OS process, tid = a track in it; ts and dur in microseconds since the run's start
(time.time_ns() in the parent: each process maps its perf_counter onto that clock once, when it
starts); "cat" names what an event is (bench/overlap.py and plots.py read them). Request lanes: a
group's (or an episode's) life on one lane track, its requests nested inside (the merge adds each
request's phases). Bounded: a process writes segment files of --trace-steps steps (as it counts
them: the trainer its step, the generator and the worker the weight version they load) and keeps the
two newest. An event is a tuple appended to a list, written every FLUSH_S seconds or FLUSH_EVENTS
events (a process killed loses at most that). Each start of a run has its own name (`start_name`:
trace-START.json, timeline-START.png); OUT/trace.json and OUT/timeline.png link the newest's, and a
resume keeps the earlier starts' files (`configure`). May touch: OUT/trace/ (each process its own
files), the starts' traces and timelines in OUT and their links; nothing else. Standard library
only.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import heapq
import json
import os
import re
import shutil
import sys
import threading
import time

DIR_ENV, STEPS_ENV, T0_ENV = "ASYNCGRPO_TRACE_DIR", "ASYNCGRPO_TRACE_STEPS", "ASYNCGRPO_TRACE_T0_NS"
# In OUT: the newest start's trace and timeline (links to its files, named by `start_name`)
TRACE, TIMELINE = "trace.json", "timeline.png"
STARTS = re.compile(r"(trace-\d{8}-\d{6}(-\d+)?\.json|timeline-\d{8}-\d{6}(-\d+)?\.png)")
FLUSH_S, FLUSH_EVENTS = 2.0, 4096
LANE = "<lane>"  # as a track: the lane of the group or episode the calling asyncio task runs for
_recorder = None  # this process's Recorder (None: no trace)
_lane = contextvars.ContextVar("trace_lane", default=None)


# --------------------------------------------------------------------------------------------------
# The run's side: configure before the children start (trace_merge.merge joins their files)
# --------------------------------------------------------------------------------------------------
def configure(out: str, steps: int, keep_earlier: bool = False) -> None:
    """Trace the processes started from now on into OUT/trace/, each keeping about `steps` steps (0:
    no trace), merged at the end under this start's name (`start_name`). keep_earlier (a resume, as
    metrics.jsonl keeps its rows): what earlier starts left in OUT stays, each under its own name
    (a plain trace.json of an older version is renamed by its time); otherwise it is removed (their
    traces, timelines and the links to them). The processes' files of an earlier start are removed
    either way (launch.py merges a killed run's first)."""
    folder = os.path.join(out, "trace")
    shutil.rmtree(folder, ignore_errors=True)
    plain = [os.path.join(out, n) for n in (TRACE, TIMELINE)]
    plain = [p for p in plain if os.path.isfile(p) and not os.path.islink(p)]
    if keep_earlier and plain:  # an older version's files, renamed by the time of its trace
        stem = start_name(out, os.path.getmtime(plain[0]) * 1e9)
        for path in plain:
            os.replace(path, os.path.join(out, file_name(stem, os.path.basename(path))))
    elif not keep_earlier:
        for name in earlier_files(out) + [TRACE, TIMELINE]:
            if os.path.lexists(os.path.join(out, name)):
                os.unlink(os.path.join(out, name))
    if steps <= 0:
        unconfigure()
        return
    os.makedirs(folder)
    t0 = time.time_ns()
    with open(os.path.join(folder, "run.json"), "w") as f:
        stem = start_name(out, t0)
        json.dump({"steps": steps, "t0_ns": t0, "file": file_name(stem, TRACE), "link": TRACE}, f)
    os.environ.update({DIR_ENV: folder, STEPS_ENV: str(steps), T0_ENV: str(t0)})


def start_name(out: str, t0_ns: float) -> str:
    """A start's file stem in OUT: trace-YYYYmmdd-HHMMSS (local time of its start), with -2, -3, ...
    where OUT already holds that name (two starts in one second). Its timeline: the same with
    "timeline" for "trace"."""
    stem = "trace-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(t0_ns / 1e9))
    taken, name, n = set(os.listdir(out)) if os.path.isdir(out) else set(), stem, 1
    while {file_name(name, TRACE), file_name(name, TIMELINE)} & taken:
        n += 1
        name = f"{stem}-{n}"
    return name


def file_name(stem: str, link: str) -> str:
    """A start's file for `link`: (trace-X, trace.json) -> trace-X.json, (trace-X, timeline.png) ->
    timeline-X.png."""
    kind, ext = os.path.splitext(link)
    return kind + stem[len("trace") :] + ext


def earlier_files(out: str) -> list[str]:
    """The traces and timelines that starts left in OUT under their own names, oldest first."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted(n for n in names if STARTS.fullmatch(n))


def unconfigure() -> None:
    """Processes started from now on record nothing (the run is over)."""
    for name in (DIR_ENV, STEPS_ENV, T0_ENV):
        os.environ.pop(name, None)


# --------------------------------------------------------------------------------------------------
# A process's side: its recorder, and what the hooks call (each a no-op without a recorder)
# --------------------------------------------------------------------------------------------------
class Recorder:
    """One process's events: appended in memory, written to OUT/trace/NAME-PID.SEGMENT.jsonl."""

    def __init__(self, folder: str, name: str, steps: int, t0_ns: int, sort: int):
        self.folder, self.steps, self.pid = folder, steps, os.getpid()
        self.base = f"{''.join(c if c.isalnum() else '_' for c in name)}-{self.pid}"
        # perf_counter -> the run's clock
        self.shift_us = (time.time_ns() - time.perf_counter_ns() - t0_ns) / 1e3
        self.events, self.lock, self.tracks, self.lanes, self.states = (
            [],
            threading.Lock(),
            {},
            [],
            {},
        )
        self.meta = [
            {"ph": "M", "name": "process_name", "pid": self.pid, "args": {"name": name}},
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": self.pid,
                "args": {"sort_index": sort},
            },
        ]
        self.segment, self.segments, self.lane_count = 0, [0], 0
        self.new_segment, self.last_flush, self.broken = True, time.perf_counter(), False

    def track(self, name: str) -> int:
        tid = self.tracks.get(name)
        if tid is None:
            tid = self.tracks[name] = len(self.tracks) + 1
            self.meta += [
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"name": name},
                },
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                },
            ]
            self.new_segment = True  # (the metadata goes to the file with the next flush)
        return tid

    def add(
        self, ph: str, name: str, cat: str, track, t0: float, t1: float | None = None, args=None
    ) -> None:
        tid = self.track(_lane.get() or "main" if track == LANE else track)
        event = (
            ph,
            name,
            cat,
            tid,
            t0 * 1e6 + self.shift_us,
            None if t1 is None else (t1 - t0) * 1e6,
            args,
        )
        with self.lock:
            self.events.append(event)
        if len(self.events) >= FLUSH_EVENTS or (t1 or t0) - self.last_flush > FLUSH_S:
            self.flush()

    def take_lane(self) -> str:
        """The lowest free lane (a track "lane K"): a group's or a request's swim lane while it
        lives."""
        if not self.lanes:
            self.lane_count += 1
            return f"lane {self.lane_count - 1:03d}"
        return f"lane {heapq.heappop(self.lanes):03d}"

    def free_lane(self, lane: str) -> None:
        heapq.heappush(self.lanes, int(lane[5:]))

    def flush(self) -> None:
        with self.lock:
            events, self.events = self.events, []
        self.last_flush = time.perf_counter()
        if os.getpid() != self.pid or self.broken:  # a forked copy of this process writes nothing
            return
        lines = [
            json.dumps(e, separators=(",", ":")) for e in (self.meta if self.new_segment else [])
        ]
        for ph, name, cat, tid, ts, dur, args in events:
            event = {
                "ph": ph,
                "name": name,
                "cat": cat,
                "pid": self.pid,
                "tid": tid,
                "ts": round(ts, 1),
            }
            if dur is not None:
                event["dur"] = round(dur, 1)
            if ph == "i":
                event["s"] = "t"
            if args:
                event["args"] = args
            lines.append(json.dumps(event, separators=(",", ":"), default=str))
        try:
            with open(os.path.join(self.folder, f"{self.base}.{self.segment}.jsonl"), "a") as f:
                f.write("\n".join(lines) + "\n")
            self.new_segment = False
        except OSError as e:  # (OUT gone, disk full): the run goes on without its trace
            self.broken = True
            print(
                f"warning: no more trace events from {self.base} ({e})", file=sys.stderr, flush=True
            )

    def step(self, n: int) -> None:
        """The process is at step (or version) n: a new segment file every `steps` steps, the two
        newest kept."""
        segment = max(0, n) // self.steps
        if segment <= self.segment:
            return
        self.flush()
        self.segment, self.new_segment = segment, True
        self.segments.append(segment)
        for old in self.segments[:-2]:
            try:
                os.unlink(os.path.join(self.folder, f"{self.base}.{old}.jsonl"))
            except OSError:
                pass
        self.segments = self.segments[-2:]


def start(name: str, sort: int = 0) -> Recorder | None:
    """This process's recorder, named `name` in the trace (None when the run records no trace). A
    process forked from one that records starts its own."""
    global _recorder
    if _recorder is not None and _recorder.pid == os.getpid():
        return _recorder
    _recorder = None
    folder = os.environ.get(DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    _recorder = Recorder(folder, name, int(os.environ[STEPS_ENV]), int(os.environ[T0_ENV]), sort)
    atexit.register(flush)
    return _recorder


clock = time.perf_counter  # the clock every span's times are read on


def enabled() -> bool:
    return _recorder is not None


def flush() -> None:
    if _recorder is not None:
        _recorder.flush()


def step(n: int) -> None:
    if _recorder is not None:
        _recorder.step(n)


def complete(
    name: str, t0: float, t1: float | None = None, track="main", cat: str | None = None, **args
) -> float:
    """A span from perf_counter time t0 to t1 (default: now) on `track` (LANE: the caller's lane);
    returns t1."""
    t1 = time.perf_counter() if t1 is None else t1
    if _recorder is not None:
        _recorder.add(ph="X", name=name, cat=cat or name, track=track, t0=t0, t1=t1, args=args)
    return t1


def counter(name: str, **values) -> None:
    """A counter's values now (a "C" event: Perfetto draws one track per counter); None values are
    left out."""
    values = {k: v for k, v in values.items() if v is not None}
    if _recorder is not None and values:
        _recorder.add(
            ph="C", name=name, cat=name, track="main", t0=time.perf_counter(), args=values
        )


def state(track: str, name: str, on: bool, **args) -> bool:
    """Call as often as you like: one span of `name` on `track` for each stretch of calls with `on`
    true (closed by the first call with `on` false). Returns `on`."""
    rec = _recorder
    if rec is not None:
        since = rec.states.get(track)
        if on and since is None:
            rec.states[track] = time.perf_counter()
        elif not on and since is not None:
            del rec.states[track]
            t1 = time.perf_counter()
            rec.add(ph="X", name=name, cat=track, track=track, t0=since, t1=t1, args=args)
    return on


def timed(name: str, track: str = "main", step_from_result: bool = False):
    """Decorator: each call is a span (with `step_from_result`, the call's result is the process's
    new step)."""

    def wrap(fn):
        @functools.wraps(fn)
        def timed_call(*a, **k):
            if _recorder is None:
                return fn(*a, **k)
            t0 = time.perf_counter()
            result = fn(*a, **k)
            complete(name, t0, track=track)
            if step_from_result:
                step(result)
            return result

        return timed_call

    return wrap


def qsize(q) -> int | None:
    """A queue's depth, where the platform can tell (not on macOS)."""
    try:
        return q.qsize()
    except (NotImplementedError, AttributeError, OSError):
        return None


# --------------------------------------------------------------------------------------------------
# The generator's hooks: lanes, requests, weight swaps; vLLM's worker: engine steps
# --------------------------------------------------------------------------------------------------
def on_lane(coro, name: str, **args):
    """`coro` with a lane of its own: a span `name` over its whole life, and every LANE event and
    request it makes inside on that lane (asyncio tasks it starts inherit the lane)."""
    return coro if _recorder is None else _on_lane(coro, name, args)


async def _on_lane(coro, name, args):
    rec, t0 = _recorder, time.perf_counter()
    lane = rec.take_lane()
    token = _lane.set(lane)
    try:
        return await coro
    finally:
        t1, cat = time.perf_counter(), name.split()[0]
        rec.add(ph="X", name=name, cat=cat, track=lane, t0=t0, t1=t1, args=args)
        _lane.reset(token)
        rec.free_lane(lane)


def request(outputs, request_id: str, **args):
    """An engine request's outputs (an async iterator), recorded as a span "request" on the caller's
    lane (or a lane of its own) from the moment it is sent to its last output; the merge adds its
    phases."""
    return outputs if _recorder is None else _request(outputs, request_id, args)


async def _request(outputs, request_id, args):
    rec, t0 = _recorder, time.perf_counter()
    lane = _lane.get()
    own = lane is None
    lane = rec.take_lane() if own else lane
    try:
        async for out in outputs:
            yield out
    finally:
        t1, request_args = time.perf_counter(), dict(args, id=request_id)
        rec.add(ph="X", name="request", cat="request", track=lane, t0=t0, t1=t1, args=request_args)
        if own:
            rec.free_lane(lane)


def swap(t0: float, t1: float, t2: float, t3: float, version: int, requests: int) -> None:
    """The generator's weight swap: pause from t0, load from t1, cache reset and version from t2,
    resume from t3 to now; `requests` in flight through it. Version `version` is the generator's new
    step."""
    if _recorder is None:
        return
    t4 = time.perf_counter()
    _recorder.add(
        ph="X",
        name=f"weight swap -> v{version}",
        cat="swap",
        track="weight swaps",
        t0=t0,
        t1=t4,
        args={"version": version, "requests": requests},
    )
    for name, a, b in (
        ("pause", t0, t1),
        ("load", t1, t2),
        ("reset + version", t2, t3),
        ("resume", t3, t4),
    ):
        _recorder.add("X", name, "swap phase", "weight swaps", a, b)
    _recorder.step(version)


def watch_engine(worker) -> None:
    """In vLLM's worker (its extension's first call): each engine step a span on "engine steps" with
    what the scheduler sent it (requests, tokens; the ids of requests new, resumed or preempted, by
    the id the generator sent)."""
    rank = getattr(worker, "rank", 0)
    rec = start(f"vLLM worker {rank}", sort=200 + rank)
    if rec is None or rank != 0:
        return
    execute, sample, pending = worker.execute_model, getattr(worker, "sample_tokens", None), []

    def record(t0, args):
        t1 = time.perf_counter()
        rec.add(
            ph="X", name="engine step", cat="engine", track="engine steps", t0=t0, t1=t1, args=args
        )

    def execute_model(scheduler_output, *a, **k):
        t0 = time.perf_counter()
        out = execute(scheduler_output, *a, **k)
        if scheduler_output.total_num_scheduled_tokens > 0:
            if out is None and sample is not None:  # the step ends in sample_tokens
                pending[:] = [t0, step_args(scheduler_output)]
            else:
                record(t0, step_args(scheduler_output))
        return out

    def sample_tokens(*a, **k):
        out = sample(*a, **k)
        if pending:
            record(*pending)
            pending.clear()
        return out

    worker.execute_model = execute_model
    if sample is not None:
        worker.sample_tokens = sample_tokens


def step_args(scheduler_output) -> dict:
    """What one engine step ran: requests and tokens, and the requests new, resumed or preempted
    (vLLM 0.32's SchedulerOutput), each counted under the id the generator sent."""
    args = {
        "requests": len(scheduler_output.num_scheduled_tokens),
        "tokens": scheduler_output.total_num_scheduled_tokens,
    }
    for key, ids in (
        ("new", [r.req_id for r in scheduler_output.scheduled_new_reqs]),
        ("resumed", getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None)),
        ("preempted", getattr(scheduler_output, "preempted_req_ids", None)),
    ):
        if ids:
            args[key] = sent_ids(ids)
    return args


def sent_ids(ids) -> dict:
    """{id the generator sent: how many of `ids` are its}. vLLM names a request "ID-<8 random
    characters>" and the k-th of its n samples "k_ID-<...>"."""
    out = {}
    for rid in ids:
        rid = rid.rpartition("-")[0] or rid
        head, sep, tail = rid.partition("_")
        rid = tail if sep and head.isdigit() else rid
        out[rid] = out.get(rid, 0) + 1
    return out
