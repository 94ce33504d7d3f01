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
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


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


def main(argv=None) -> int:
    return common.dispatch(__doc__, {"trace": trace_main, "eval": eval_main}, argv)


if __name__ == "__main__":
    sys.exit(main())
