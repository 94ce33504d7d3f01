"""bench/costs.py — what the run's trace and its held-out evaluation cost a run.

    python bench/costs.py --what trace --out DIR   # DIR/trace_cost.json and .png
    python bench/costs.py --what eval --out DIR    # DIR/eval_cost.json and .png
    python bench/costs.py --what trace --smoke --out DIR   # the suite's size: --steps 12 --rounds 1

Each is the default run (`python train.py`: the copy task, 300 steps) with the feature on against
the same run with it off (`--trace-steps 0`, `--eval-every 0`), same seed and model, alternated over
`--rounds` rounds. Wall time is the run's own clock (`wall_s`, from the moment the
engine is up); the whole process's (start-up, the end's merge and drawing) is reported beside it.
- trace: the medians and their ratios traced / not, each mode's spread (max - min over its runs, as
  a share of its median: the noise the ratio is read against), the trace's size (events and bytes
  per step, the time to draw timeline.png again), and, since a shared machine's spread hides a cost
  this small, the recording's own CPU per event measured in this process (tracing.py's calls as a
  run makes them), times the run's events per step, as a share of a step.
- eval: the medians and their ratio, the generator's share of the wall time spent evaluating while
  training ran, the training reward and the held-out greedy pass@1 at the start and the end.
Touches only its scratch folder and --out.

Reading a run's OUT/trace.json (infra/tracing.py's events; seconds), for bench/overlap.py and the
suite: `steady_breakdown(events, warmup)` sums, per step of the steady window (after `warmup` steps,
as common.steady), trainer rank 0's wait for data, split by what the generator did meanwhile (in
this order: swapping weights; nothing in the engine while the staleness gate let no group start,
i.e. waiting for newer weights; nothing in the engine otherwise; a group blocked on a full queue;
generating), its work (forward and backward, optimizer, publish, evaluation), the generator's swaps,
waits and idle engine, vLLM's engine steps (time, tokens). `engine_seconds_per_token`: the engine's
time per scheduled token after a weight version. `waves_and_holds`: the most sequences an engine
step ran, requests' queueing, the loads held by evaluations. `Recording` traces the processes a
benchmark starts inside it (as launch.run does a run's).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from infra import tracing  # noqa: E402
from run import trace_merge  # noqa: E402


def compare(name: str, argv, modes: dict, measure, rounds: int) -> tuple:
    """The options, the alternated runs and their medians, shared by both questions."""
    p = common.parser(__doc__, smoke={"steps": 12, "rounds": 1})
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=rounds, help="runs of each mode")
    args = common.parse_args(p, argv)
    with common.Bench(name, args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        flags = ["--steps", str(args.steps), "--model", model, "--seed", str(args.seed)]
        runs = common.alternate(bench, args.rounds, modes, flags, measure)
    medians = {m: statistics.median(x["wall_s"] for x in runs[m]) for m in modes}
    settings = {"steps": args.steps, "seed": args.seed, "rounds": args.rounds}
    return args, bench, runs, medians, settings


def trace_main(argv=None) -> int:
    modes = {"trace": [], "no_trace": ["--trace-steps", "0"]}

    def measure(mode, run, out):
        summary = {k: run["summary"][k] for k in ("reward_last20", "trainer_wait_frac")}
        return {**summary, **(trace_size(out, len(run["rows"])) if mode == "trace" else {})}

    args, bench, runs, medians, settings = compare("trace_cost", argv, modes, measure, 3)

    def median(mode, key):
        return statistics.median(x[key] for x in runs[mode])

    def spread(mode, key):
        values = [x[key] for x in runs[mode]]
        return (max(values) - min(values)) / statistics.median(values)

    data = {"settings": {**settings, "workload": "the default run; --trace-steps 300 against 0"}}
    data.update(runs=runs, median_wall_s=medians)
    data["median_process_s"] = {m: median(m, "process_s") for m in modes}
    data["spread_wall"] = {m: spread(m, "wall_s") for m in modes}
    data["spread_process"] = {m: spread(m, "process_s") for m in modes}
    data.update({k: median("trace", k) for k in ("trace_mb", "events_per_step", "kb_per_step")})
    data.update(draw_s=median("trace", "draw_s"), cpu_us_per_event=recording_cost())
    step_s = statistics.median(x["wall_s"] / args.steps for x in runs["trace"])
    data["cpu_share_of_step"] = data["cpu_us_per_event"] * 1e-6 * data["events_per_step"] / step_s
    data["cost_ratio_wall"] = medians["trace"] / medians["no_trace"]
    process = data["median_process_s"]
    data["cost_ratio_process"] = process["trace"] / process["no_trace"]
    path = bench.save(data, plot_trace)
    keys = "mode round wall_s process_s foreign_cores reward_last20 trainer_wait_frac trace_mb"
    print(
        common.table_of([x for m in modes for x in runs[m]], keys + " events_per_step kb_per_step")
    )
    print(
        f"traced / not, medians: run's clock x{data['cost_ratio_wall']:.3f}, whole process "
        f"x{data['cost_ratio_process']:.3f}; spread of the run's clock: "
        f"{data['spread_wall']['trace']:.0%} traced, {data['spread_wall']['no_trace']:.0%} not; "
        f"{data['kb_per_step']:.1f} kB and {data['events_per_step']:.0f} events per step; "
        f"timeline.png drawn in {data['draw_s']:.1f} s; the recording alone "
        f"{data['cpu_us_per_event']:.1f} us of CPU per event = {data['cpu_share_of_step']:.2%} of "
        "a step"
    )
    print(bench.closing_line(path))
    return 0


def recording_cost(n: int = 4000) -> float:
    """CPU microseconds per event of tracing.py as a run uses it, written to its file (median of 3
    tries, each against the same calls untraced)."""
    from infra import tracing

    scheduled = SimpleNamespace(  # (what one engine step of the default run hands vLLM's worker)
        num_scheduled_tokens={f"{k}_group-{g}-0badcafe": 1 for g in range(32) for k in range(8)},
        total_num_scheduled_tokens=256,
        scheduled_new_reqs=[SimpleNamespace(req_id=f"{k}_group-9-0badcafe") for k in range(8)],
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        preempted_req_ids=set(),
    )

    async def outputs():
        yield None

    async def group(i):
        async for _ in tracing.request(outputs(), f"group-{i}", n=8):
            pass

    async def groups():
        await asyncio.gather(
            *(tracing.on_lane(group(i), f"group {i}", group=i) for i in range(n // 4))
        )

    def work(traced: bool):
        t0 = time.process_time()
        for _ in range(n // 2):  # spans with arguments, as engine steps' (read from vLLM's output)
            args = tracing.step_args(scheduled) if traced else {}
            tracing.complete(
                "engine step", tracing.clock(), cat="engine", track="engine steps", **args
            )
        asyncio.run(groups())  # a lane and a request each: two spans
        tracing.flush()
        return time.process_time() - t0

    tries = []
    for _ in range(3):
        off = work(False)
        tracing.configure(tempfile.mkdtemp(prefix="asyncgrpo-trace-cost-"), 10**9)
        tracing.start("bench")
        on = work(True)
        tracing.unconfigure()
        tracing._recorder = None
        tries.append((on - off) / n * 1e6)
    return statistics.median(tries)


def trace_size(out: Path, steps: int) -> dict:
    """trace.json's size and events per step, and the time to draw timeline.png from it again."""
    from run import plots

    trace = out / "trace.json"
    events = len(json.loads(trace.read_text())["traceEvents"])
    t0 = time.perf_counter()
    plots.plot_timeline(str(out))
    draw_s, size = time.perf_counter() - t0, trace.stat().st_size
    got = {"trace_mb": size / 2**20, "kb_per_step": size / 1e3 / steps, "draw_s": draw_s}
    return {**got, "events_per_step": events / steps}


def plot_trace(data: dict, path: Path) -> None:
    walls = {m: [x["wall_s"] for x in runs] for m, runs in data["runs"].items()}
    what = f"trace cost: run's clock x{data['cost_ratio_wall']:.3f}"
    common.bars(data, path, f"{what}, {data['kb_per_step']:.0f} kB/step", walls)


def eval_main(argv=None) -> int:
    modes = {"eval": [], "no_eval": ["--eval-every", "0"]}

    def measure(mode, run, out):
        rows, s = run["rows"], run["summary"]
        evals = sorted((x for x in rows if "eval/step" in x), key=lambda x: x["eval/step"])
        keys = ("reward_first10", "reward_last20", "eval_first", "eval_last", "eval_s")
        got = {k: s.get(k) for k in (*keys, "trainer_wait_frac")}
        # the generator's time evaluating while training ran (the step-0 evaluation is before)
        got["eval_share"] = (
            (s["eval_s"] - evals[0]["eval/time_s"]) / rows[-1]["wall_s"] if evals else None
        )
        got["evals"] = [
            {k.split("/", 1)[1]: x[k] for k in x if k.startswith("eval/")} for x in evals
        ]
        return got

    args, bench, runs, medians, settings = compare("eval_cost", argv, modes, measure, 2)
    workload = "the default run; --eval-every 50 --eval-samples 4 (the defaults) against 0"
    data = {"settings": {**settings, "workload": workload}, "runs": runs, "median_wall_s": medians}
    data["cost_ratio"] = medians["eval"] / medians["no_eval"]
    walls = {m: [x["wall_s"] for x in r] for m, r in runs.items()}
    path = bench.save(data, lambda d, p: common.bars(d, p, "evaluation cost: wall", walls))
    keys = "mode round wall_s process_s foreign_cores reward_first10 reward_last20 eval_first"
    print(common.table_of([x for m in modes for x in runs[m]], keys + " eval_last eval_s"))
    shares = ", ".join(f"{x['eval_share'] or 0:.1%}" for x in runs["eval"])
    print(
        f"median wall time: with evaluation {medians['eval']:.1f} s, without "
        f"{medians['no_eval']:.1f} s: x{data['cost_ratio']:.3f}; the generator spent {shares} of "
        "each run's wall time evaluating while training ran"
    )
    print(bench.closing_line(path))
    return 0


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


def spans_of(events: list[dict], cat: str, pid=None) -> list[tuple[float, float]]:
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


def total(spans) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs, ys) -> list[tuple[float, float]]:
    """The intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        i, j = (i + 1, j) if xs[i][1] < ys[j][1] else (i, j + 1)
    return out


def subtract(xs, ys) -> list[tuple[float, float]]:
    """xs less ys (both sorted, disjoint)."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if c < b and d > a:
                out += [(a, c)] if c > a else []
                a = max(a, d)
        if b > a:
            out.append((a, b))
    return out


def steady_breakdown(events: list[dict], warmup: int) -> dict | None:
    """Per step of the steady window (seconds): what each side did, and what the trainer's wait
    overlapped. None when the trace has too few of rank 0's steps."""
    steps = [e for e in events if e["ph"] == "X" and e.get("cat") == "step"]
    steps = sorted(
        (e for e in steps if e["args"].get("rank") == 0), key=lambda e: e["args"]["step"]
    )
    if len(steps) <= warmup + 1:
        return None
    trainer, first = steps[0]["pid"], steps[warmup - 1] if warmup else None
    lo = (first["ts"] + first["dur"]) / 1e6 if first else steps[0]["ts"] / 1e6
    hi, n = (steps[-1]["ts"] + steps[-1]["dur"]) / 1e6, len(steps) - warmup

    def window(cat, pid=None):
        return [
            (max(a, lo), min(b, hi)) for a, b in spans_of(events, cat, pid) if b > lo and a < hi
        ]

    wait, swap, idle, full = (
        window("wait", trainer),
        window("swap"),
        window("idle"),
        window("queue full"),
    )
    for_weights = intersect(idle, window("staleness gate"))  # nothing to run, no group may start
    parts, rest = {}, wait
    for key, spans in (("swap", swap), ("weights", for_weights), ("idle", idle), ("full", full)):
        parts[key], rest = intersect(rest, spans), subtract(rest, spans)
    engine = [e for e in events if e["ph"] == "X" and e.get("cat") == "engine"]
    engine = [e for e in engine if lo <= e["ts"] / 1e6 < hi]
    out = {
        "steps": n,
        "window_s": hi - lo,
        "step_s": (hi - lo) / n,
        "trainer_wait_s": total(wait) / n,
    }
    named = {"wait_during_swap_s": parts["swap"], "wait_for_weights_s": parts["weights"]}
    named.update(wait_engine_idle_s=parts["idle"], wait_during_full_queue_s=parts["full"])
    named.update(wait_while_generating_s=rest, trainer_busy_s=window("step", trainer))
    named.update(
        engine_s=spans_of(engine, "engine"), gen_swap_s=swap, gen_for_weights_s=for_weights
    )
    named.update(gen_full_queue_s=full, gen_idle_s=idle)
    out.update({key: total(spans) / n for key, spans in named.items()})
    out["engine_tokens"] = sum(e["args"]["tokens"] for e in engine) / n
    for key, cats in (
        ("forward_backward_s", ("forward", "backward")),
        ("optimizer_s", ("optimizer",)),
        ("publish_s", ("publish",)),
        ("evaluation_s", ("evaluation", "checkpoint", "save model")),
    ):
        out[key] = sum(total(window(c, trainer)) for c in cats) / n
    return out


def engine_seconds_per_token(events: list[dict], from_version: int) -> float | None:
    """vLLM's engine time per scheduled token (prefill and decode), over the engine steps after the
    generator's swap to `from_version` (None without one)."""
    timed = [e for e in events if e["ph"] == "X"]
    swaps = [
        e["ts"] for e in timed if e.get("cat") == "swap" and e["args"]["version"] >= from_version
    ]
    if not swaps:
        return None
    engine = [e for e in timed if e.get("cat") == "engine" and e["ts"] >= min(swaps)]
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
    publishes = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "publish")
    swaps = sorted(e["ts"] for e in events if e.get("name") == "pause")
    holds = []
    for e in events:
        if e.get("cat") != "evaluation" or not e["name"].startswith("evaluation (step "):
            continue
        during = [p for p in publishes if e["ts"] <= p < e["ts"] + e["dur"]]
        if e["name"] != "evaluation (step 0)" and during:
            later = [s for s in swaps if s >= during[0]]
            hold = {"evaluation": e["name"], "eval_ms": e["dur"] / 1e3}
            hold.update(publishes_during=len(during))
            hold["publish_to_swap_ms"] = (later[0] - during[0]) / 1e3 if later else None
            holds.append(hold)
    out = {"max_seqs_per_engine_step": most, "engine_steps": len(steps)}
    out["engine_steps_at_max"] = sum(s == most for s in steps)
    for name, q in (("queued_ms_p50", 0.5), ("queued_ms_p90", 0.9)):
        out[name] = queued[min(len(queued) - 1, int(q * len(queued)))] if queued else None
    return {**out, "eval_holds": holds}


def main(argv=None) -> int:
    return common.dispatch(__doc__, {"trace": trace_main, "eval": eval_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
