"""bench/trace_cost.py — what the run's trace (OUT/trace.json, OUT/timeline.png) costs, and how big
it gets.

    # writes DIR/trace_cost.json and DIR/trace_cost.png
    python bench/trace_cost.py --out DIR
    # the suite's size (tests/test_bench.py): --steps 12 --rounds 1
    python bench/trace_cost.py --smoke --out DIR

The default run (`python train.py`: the copy task, 300 steps, the trace on) against the same run
with `--trace-steps 0`, same seed and model, alternated over `--rounds` rounds (the order swaps
every round, so neither always runs first). Reported: the medians of the run's own clock (`wall_s`,
from the moment the engine is up) and of the whole process (start-up, the end's merge and drawing
included), their ratios traced / not, each mode's spread (max - min over its runs, as a share of its
median: the noise the ratio must be read against), and the trace's size: events and bytes per step,
trace.json's size, the time to draw timeline.png. On a shared machine the runs' spread hides a cost
this small, so the recording's own CPU time is measured too, in this process: tracing.py's calls as
the run makes them (spans with arguments, lanes and requests on an asyncio loop, vLLM scheduler
outputs of 256 requests read, every event written to its file), per event, times the run's events
per step: the CPU seconds per step the trace costs, against the run's seconds per step.
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

MODES = (("trace", []), ("no_trace", ["--trace-steps", "0"]))


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "rounds": 1})
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    args = common.parse_args(p, argv)
    runs = {m: [] for m, _ in MODES}
    with common.Bench("trace_cost", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for r in range(args.rounds):
            for mode, extra in MODES if r % 2 == 0 else MODES[::-1]:
                t0 = time.monotonic()
                out = bench.work / f"{mode}_{r}"
                run = common.run_train_cli(
                    out,
                    [
                        "--steps",
                        str(args.steps),
                        "--model",
                        model,
                        "--seed",
                        str(args.seed),
                        *extra,
                    ],
                )
                rows, s = run["rows"], run["summary"]
                x = {
                    "wall_s": rows[-1]["wall_s"],
                    "process_s": run["process_s"],
                    "foreign_cores": bench.foreign_cores(t0, time.monotonic()),
                    "reward_last20": s["reward_last20"],
                    "trainer_wait_frac": s["trainer_wait_frac"],
                }
                if mode == "trace":
                    x.update(trace_size(out, len(rows)))
                runs[mode].append(x)
                print(
                    f"[trace_cost] {mode} round {r}: run {x['wall_s']:.1f} s, process "
                    f"{x['process_s']:.1f} s"
                    + (
                        f", trace.json {x['trace_mb']:.2f} MB ({x['events_per_step']:.0f} events, "
                        f"{x['kb_per_step']:.1f} kB per step)"
                        if mode == "trace"
                        else ""
                    ),
                    flush=True,
                )

    def median(mode, key):
        return statistics.median(x[key] for x in runs[mode])

    def spread(mode, key):
        values = [x[key] for x in runs[mode]]
        return (max(values) - min(values)) / statistics.median(values)

    data = {
        "settings": {
            "steps": args.steps,
            "seed": args.seed,
            "rounds": args.rounds,
            "workload": "default task and flags (tiny model, 32 prompts x 8, 5 new tokens, "
            "--eval-every 50); trace: --trace-steps 300 (the default) against 0",
        },
        "runs": runs,
        "median_wall_s": {m: median(m, "wall_s") for m, _ in MODES},
        "median_process_s": {m: median(m, "process_s") for m, _ in MODES},
        "spread_wall": {m: spread(m, "wall_s") for m, _ in MODES},
        "spread_process": {m: spread(m, "process_s") for m, _ in MODES},
        "trace_mb": median("trace", "trace_mb"),
        "events_per_step": median("trace", "events_per_step"),
        "kb_per_step": median("trace", "kb_per_step"),
        "draw_s": median("trace", "draw_s"),
    }
    data["cpu_us_per_event"] = recording_cost()
    data["cpu_share_of_step"] = (
        data["cpu_us_per_event"]
        * 1e-6
        * data["events_per_step"]
        / statistics.median(x["wall_s"] / args.steps for x in runs["trace"])
    )
    data["cost_ratio_wall"] = data["median_wall_s"]["trace"] / data["median_wall_s"]["no_trace"]
    data["cost_ratio_process"] = (
        data["median_process_s"]["trace"] / data["median_process_s"]["no_trace"]
    )
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "mode",
                "round",
                "run s",
                "process s",
                "others' cores",
                "reward last 20%",
                "trainer waits",
                "trace MB",
                "events / step",
                "kB / step",
            ],
            [
                [
                    m,
                    i,
                    x["wall_s"],
                    x["process_s"],
                    x["foreign_cores"],
                    x["reward_last20"],
                    x["trainer_wait_frac"],
                    x.get("trace_mb"),
                    x.get("events_per_step"),
                    x.get("kb_per_step"),
                ]
                for m, _ in MODES
                for i, x in enumerate(runs[m])
            ],
        )
    )
    print(
        f"traced / not, medians: run's clock x{data['cost_ratio_wall']:.3f}, whole process "
        f"x{data['cost_ratio_process']:.3f}; spread of the run's clock over each mode's runs: "
        f"{data['spread_wall']['trace']:.0%} traced, {data['spread_wall']['no_trace']:.0%} not; "
        f"trace.json {data['trace_mb']:.2f} MB, {data['kb_per_step']:.1f} kB and "
        f"{data['events_per_step']:.0f} events per "
        f"step; timeline.png drawn in {data['draw_s']:.1f} s"
    )
    print(
        f"recording, measured alone: {data['cpu_us_per_event']:.1f} us of CPU per event, "
        f"{data['cpu_us_per_event'] * data['events_per_step'] / 1e3:.2f} ms per step = "
        f"{data['cpu_share_of_step']:.2%} of a step"
    )
    print(bench.closing_line(path))
    return 0


def recording_cost(n: int = 4000) -> float:
    """CPU microseconds per event of tracing.py as a run uses it, written to its file (median of 3
    tries)."""
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
        # spans with arguments, as engine steps' (read from vLLM's scheduler output)
        for i in range(n // 2):
            t = tracing.clock()
            tracing.complete(
                "engine step",
                t,
                cat="engine",
                track="engine steps",
                **(tracing.step_args(scheduled) if traced else {}),
            )
        asyncio.run(groups())  # a lane and a request each: two spans
        tracing.flush()
        return time.process_time() - t0

    tries = []
    for _ in range(3):
        off = work(False)  # the same calls with no trace (the loop and its tasks)
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
    return {
        "trace_mb": trace.stat().st_size / 2**20,
        "kb_per_step": trace.stat().st_size / 1e3 / steps,
        "events_per_step": events / steps,
        "draw_s": time.perf_counter() - t0,
    }


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(1, 1, figsize=(6, 4))
    modes = list(data["runs"])
    for j, m in enumerate(modes):
        walls = [x["wall_s"] for x in data["runs"][m]]
        ax.scatter([j] * len(walls), walls, color="k", zorder=3, s=12)
        ax.bar(j, data["median_wall_s"][m], color=("tab:blue", "tab:gray")[j], alpha=0.6)
    ax.set_xticks(
        range(len(modes)),
        ["trace on (default)" if m == "trace" else "--trace-steps 0" for m in modes],
    )
    ax.set(
        title=f"run's clock (median; dots: runs): x{data['cost_ratio_wall']:.3f}; trace "
        f"{data['kb_per_step']:.0f} kB/step",
        ylabel="s",
    )
    common.save_figure(fig, path, data, "trace cost")


if __name__ == "__main__":
    sys.exit(main())
