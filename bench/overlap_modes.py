"""bench/overlap_modes.py — one set of bench/overlap.py's runs: generation alone and training alone
(bench/stages_alone.py, on the same batches), then `python train.py --max-lag K` for each mode asked
for (`MODES`: sync is K = 0, the baseline), with the steady-state rates of each (`common.steady`),
the cores each process used over the steady window and, from each run's trace, its breakdown
(`traces.steady_breakdown`). What the runs are and why: bench/overlap.py's docstring.
Data: in, overlap.py's parsed options (`args.modes`: [(mode, max lag)], --steps, --warmup, --seed),
its `common.Bench` and the model folder; out, {"gen_alone", "train_alone", mode: figures} for the
repeat. It touches only the bench's scratch folder (one folder per run) and the processes it starts.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import stages_alone  # noqa: E402
import traces  # noqa: E402

MODES = (("sync", 0), ("lag1", 1), ("lag2", 2), ("lag4", 4))


def measure(args, bench, model: str, rep: int) -> dict:
    """One set of runs. Each records `foreign_cores`: the cores other processes used while it
    ran."""
    cfg = common.default_config(steps=args.steps, model=model, seed=args.seed)
    work = bench.work
    out = {}
    t, t0 = time.perf_counter(), time.monotonic()
    gen = stages_alone.generate_alone(cfg, model, steps=args.steps, cpu_from_step=args.warmup)
    gen_steps = common.intervals(gen["step_end_s"], args.warmup)
    out["gen_alone"] = {
        "step_s_mean": statistics.fmean(gen_steps),
        "step_s_median": statistics.median(gen_steps),
        "step_s_typical": common.typical_mean(gen_steps),
        "tokens_per_step": statistics.fmean(gen["tokens"][args.warmup :]),
        "sync_ms_median": statistics.median(gen["sync_ms"]) if gen["sync_ms"] else None,
        "engine_s_per_token": gen.get("engine_s_per_token"),
        "engine_ready_wait_s": gen["ready_wait_s"],
        "process_s": time.perf_counter() - t,
        "cores_by_role": gen["cores_by_role"],
        "foreign_cores": bench.foreign_cores(t0, time.monotonic()),
    }
    print(
        f"[overlap] generation alone: {out['gen_alone']['step_s_mean'] * 1e3:.0f} ms/step (other "
        f"processes: {out['gen_alone']['foreign_cores']} cores)",
        flush=True,
    )
    t, t0 = time.perf_counter(), time.monotonic()
    rows, train_cores = stages_alone.train_alone(
        cfg, model, gen["groups"], work / f"train_alone{rep}", cpu_from_step=args.warmup
    )
    train_steps = common.intervals([r["wall_s"] for r in rows], args.warmup)
    out["train_alone"] = {
        "step_s_mean": statistics.fmean(train_steps),
        "step_s_median": statistics.median(train_steps),
        "step_s_typical": common.typical_mean(train_steps),
        "train_s_mean": statistics.fmean(r["train_s"] for r in rows[args.warmup :]),
        "tokens_per_step": statistics.fmean(r["tokens"] for r in rows[args.warmup :]),
        "process_s": time.perf_counter() - t,
        "cores_by_role": train_cores,
        "foreign_cores": bench.foreign_cores(t0, time.monotonic()),
    }
    print(
        f"[overlap] training alone:   {out['train_alone']['step_s_mean'] * 1e3:.0f} ms/step (other "
        f"processes: {out['train_alone']['foreign_cores']} cores)",
        flush=True,
    )
    for mode, lag in args.modes:
        t0 = time.monotonic()
        run = common.run_train_cli(
            work / f"{mode}{rep}",
            [
                "--steps",
                str(args.steps),
                "--max-lag",
                str(lag),
                "--model",
                model,
                "--seed",
                str(args.seed),
            ],
            cpu_window=(args.warmup, args.steps),
        )
        st = common.steady(run["rows"], args.warmup)
        st["cores_by_role"] = run["cores_by_role"]
        st["process_s"] = run["process_s"]
        st["max_token_lag"] = run["summary"].get("max_token_lag")
        st["dropped_stale"] = run["summary"].get("dropped_stale")
        st["foreign_cores"] = bench.foreign_cores(t0, time.monotonic())
        trace = work / f"{mode}{rep}" / "trace.json"
        st["trace"] = (
            traces.steady_breakdown(traces.load(trace), args.warmup) if trace.exists() else None
        )
        out[mode] = st
        print(
            f"[overlap] {mode:5s} (--max-lag {lag}): {st['steps_per_s']:.2f} steps/s, trainer "
            f"waits {st['trainer_wait_frac']:.0%}, generator waits "
            f"{st.get('generator_wait_frac') or 0:.0%} "
            f"({run['process_s']:.0f} s with start-up; other processes: {st['foreign_cores']} "
            f"cores)",
            flush=True,
        )
    return out
