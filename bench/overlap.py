"""bench/overlap.py — does asynchrony keep both sides busy? Sync against async, side by side.

    python bench/overlap.py --out DIR                       # DIR/overlap.json and overlap.png
    python bench/overlap.py --modes lag2 --steps 30 --out DIR   # sync (the baseline) and lag 2
    python bench/overlap.py --smoke --out DIR               # the suite's size: --steps 6 --warmup 2

All with the default workload (the tiny model, 32 prompts x 8 completions, 5 new tokens) and the
thread budget of `python train.py`:
1. Generation alone (`generate_alone`): the real generator process (`rollout.generator_main`)
   feeding a stand-in trainer (`stand_in_trainer`) that only takes each step's groups and
   republishes the weights (one swap per step, as in a run). -> t_gen, seconds per step.
2. Training alone (`train_alone`): the real trainer (`train.trainer_main`) on the very batches of
   1, from a queue never empty. -> t_train, seconds per step. (bench/training.py and
   bench/generation.py use these stages too.)
3. `python train.py --max-lag K` for K = 0 (sync: each side waits for the other), 1, 2 and 4.
Rates are steady-state: the first `--warmup` steps of every run are left out.

bound = (t_gen + t_train) / max(t_gen, t_train): the best speedup two overlapped stages give (t: the
mean seconds per step without outliers above 3x the median). speedup = steps/s of a mode / steps/s
of sync; share_of_bound = speedup / bound. Also: the trainer's and generator's waits, the cores each
process used over the steady window, the CPU bound (both stages' CPU-seconds per step alone fitted
into the machine's cores), and t_gen and t_train read off the sync run itself.

Where the missing share goes, per mode, from the run's trace (bench/costs.py `steady_breakdown`). A
step takes T = trainer wait + work; the bound allows T* = max(t_gen, t_train), so the share missing
(T - T*) / T splits exactly into (shares of T): the trainer waited while the generator swapped
weights (`wait_swap`), had nothing in the engine because the staleness gate let no group start
(`wait_weights`) or otherwise (`wait_idle`), had a group blocked on a full queue
(`wait_full_queue`), generated beyond the max(0, t_gen - t_train) the bound leaves
(`wait_generating`; of it `gen_contention`: vLLM's engine time per token in the run against alone,
times the step's tokens); the trainer evaluated (`evaluation`); training took longer than alone
(`train_contention`: CPU contention, and what the run adds, such as the publish).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import costs  # noqa: E402  (reading traces)

MODES = (("sync", 0), ("lag1", 1), ("lag2", 2), ("lag4", 4))


@dataclasses.dataclass
class StandIn:
    """A stand-in trainer's job: the generator's queue, control and weights (`shared`: what it
    publishes to), the model, how many steps of how many groups; whether it republishes and keeps
    the groups; `armed` (set once it is ready), `on_step` (called with each step taken)."""

    queue: object
    control: object
    shared: object
    model_path: str
    steps: int
    prompts_per_step: int
    publish: bool = True
    keep_groups: bool = True
    timeout_s: float = 300.0
    armed: object = None
    on_step: object = None


def stand_in_trainer(job: StandIn) -> dict:
    """The trainer's side of the queue with the training taken out: take each step's groups
    (`buffer.take_groups`) and, if `publish`, republish the same weights under the next version, so
    the generator swaps once per step. Records when each step's last group arrived and its tokens;
    sets `control.stop` at the end."""
    import torch
    from transformers import AutoModelForCausalLM

    import buffer
    from infra import processes

    queue, control, timeout_s = job.queue, job.control, job.timeout_s
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32)
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    if job.armed is not None:
        job.armed.set()
    t_wait = time.perf_counter()
    processes.wait_for(control.ready, control.stop, timeout_s, "the generator's engine to start")
    out = {"groups": [], "step_end_s": [], "tokens": [], "sync_ms": [], "sync_parts": []}
    out["ready_wait_s"], start, version = time.perf_counter() - t_wait, time.perf_counter(), 0
    try:
        for step in range(job.steps):
            taken = buffer.take_groups(
                queue, job.prompts_per_step, version, 10**6, timeout_s
            ).groups
            out["step_end_s"].append(time.perf_counter() - start)
            if job.on_step is not None:
                job.on_step(step)
            out["tokens"].append(sum(len(c) for g in taken for c in g.completion_ids))
            for g in taken:
                out["sync_ms"] += g.gen_stats.get("sync_ms", [])
                out["sync_parts"] += g.gen_stats.get("sync_parts", [])
            out["groups"] += taken if job.keep_groups else []
            out["gen_stats"] = dict(taken[-1].gen_stats, sync_ms=None, sync_parts=None)
            if job.publish:
                version += 1
                job.shared.publish(weights, version)
    finally:
        control.stop.set()
    return out


def generate_alone(cfg, model_path: str, steps: int, cpu_from_step: int | None = None) -> dict:
    """Generation with no training: the real generator process (started as `launch.run` starts it)
    feeding `stand_in_trainer` here. The groups (the batches a run would train on), when each step's
    last group arrived, the generator's cores from step `cpu_from_step` on, and from its trace
    vLLM's engine time per scheduled token from the swap to that version on."""
    import torch.multiprocessing as mp

    import rollout
    from infra import processes
    from run import prepare

    ctx = mp.get_context("spawn")
    shared = prepare.allocate_shared_weights(model_path)
    queue, errors, control = (
        ctx.Queue(maxsize=cfg.queue_size),
        ctx.Queue(),
        processes.make_control(ctx),
    )
    job = (common.run_ahead_settings(cfg, model_path), shared, queue, control)
    args = ("generator", rollout.generator_main, job, errors, True)
    proc = ctx.Process(target=processes.child_entry, name="generator", args=args)
    t_spawn, snaps = time.perf_counter(), []
    with costs.Recording() as recording:  # (the generator and vLLM's processes: traced)
        proc.start()

    def on_step(step):  # the generator's CPU time at the start and the end of the window
        if cpu_from_step is not None and step in (cpu_from_step - 1, steps - 1):
            snaps.append((time.monotonic(), common.tree_cpu(proc.pid)))

    try:
        job = StandIn(queue, control, shared, model_path, steps, cfg.prompts_per_step)
        result = stand_in_trainer(dataclasses.replace(job, on_step=on_step))
        proc.join(timeout=60)
    finally:
        control.stop.set()
        processes.kill_tree(proc, True)
    result["process_s"] = time.perf_counter() - t_spawn
    cores = common.cores_by_role(snaps, proc.pid, "generator") if len(snaps) == 2 else None
    result["cores_by_role"] = cores
    events = recording.events()
    result["engine_s_per_token"] = costs.engine_seconds_per_token(events, cpu_from_step or 0)
    return result


def train_alone(cfg, model_path: str, groups: list, out_dir: Path, cpu_from_step=None):
    """Training with no generation: the real trainer (rank 0 of 1, started as `launch.run` starts
    it) fed from a queue already holding every group. Its metrics rows, and with `cpu_from_step`,
    (rows, the cores it used from that step on)."""
    import torch.multiprocessing as mp

    import buffer
    import train
    from infra import devices, processes
    from run import prepare

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # --max-lag: the oldest sample of each step against the trainer's version then, so nothing is
    # dropped or masked and the per-lag diagnostics cost what a run's do
    pps = cfg.prompts_per_step
    lag = max(
        buffer.sample_lag(i // pps, v) for i, g in enumerate(groups) for v in g.token_versions
    )
    # no held-out evaluation: no generator would answer, and the last step would wait for one
    cfg = dataclasses.replace(
        cfg, out=str(out_dir), max_lag=max(cfg.max_lag, lag), queue_size=len(groups) + 1
    )
    cfg = dataclasses.replace(
        cfg, eval_every=0, steps=len(groups) // pps, timeout_s=min(cfg.timeout_s, 60.0)
    )
    ctx = mp.get_context("spawn")
    shared, queue = prepare.allocate_shared_weights(model_path), buffer.RolloutQueue(ctx=ctx)
    for g in groups:
        queue.put(g)
    errors, control = ctx.Queue(), processes.make_control(ctx)
    control.ready.set()  # no engine to wait for
    init = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    prepared = prepare.Prepared(model_path, model_path, devices.layout_for(cfg))
    job = (cfg, prepared, 0, 1, shared, queue, control, init)
    args = ("trainer0", train.trainer_main, job, errors, False)
    proc = ctx.Process(target=processes.child_entry, name="trainer0", args=args)
    proc.start()
    metrics = out_dir / "metrics.jsonl"
    cpu = common.CpuByRole(proc.pid, metrics, cpu_from_step, cfg.steps) if cpu_from_step else None
    deadline = time.monotonic() + 600.0
    try:
        while proc.is_alive() and time.monotonic() < deadline:
            proc.join(timeout=0.5)
        if proc.is_alive():
            raise TimeoutError("the trainer took more than 600 s")
        if proc.exitcode != 0:
            raise RuntimeError(processes.failure_report("trainer0", proc.exitcode, errors))
    finally:
        if cpu:
            cpu.stop()
        processes.kill_tree(proc, False)
        if os.path.exists(init):
            os.unlink(init)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if cpu is None:
        return rows
    cores = cpu.result()
    return rows, {"trainer": cores.pop("parent", 0.0), **cores} if cores else cores


def step_times(steps: list[float], t0: float, bench) -> dict:
    """A stage's seconds per step: mean, median, typical (outliers out), and the machine's load."""
    return {
        **{"step_s_mean": statistics.fmean(steps), "step_s_median": statistics.median(steps)},
        "step_s_typical": common.typical_mean(steps),
        "foreign_cores": bench.foreign_cores(t0, time.monotonic()),
    }


def measure(args, bench, model: str, rep: int) -> dict:
    """One set of runs: the stages alone, then each mode, with its steady rates, cores and trace."""
    cfg = common.default_config(steps=args.steps, model=model, seed=args.seed)
    t, t0 = time.perf_counter(), time.monotonic()
    gen = generate_alone(cfg, model, steps=args.steps, cpu_from_step=args.warmup)
    out = {"gen_alone": step_times(common.intervals(gen["step_end_s"], args.warmup), t0, bench)}
    out["gen_alone"].update(
        tokens_per_step=statistics.fmean(gen["tokens"][args.warmup :]),
        sync_ms_median=statistics.median(gen["sync_ms"]) if gen["sync_ms"] else None,
        engine_s_per_token=gen.get("engine_s_per_token"),
        engine_ready_wait_s=gen["ready_wait_s"],
        process_s=time.perf_counter() - t,
        cores_by_role=gen["cores_by_role"],
    )
    t, t0 = time.perf_counter(), time.monotonic()
    where = bench.work / f"train_alone{rep}"
    rows, cores = train_alone(cfg, model, gen["groups"], where, cpu_from_step=args.warmup)
    walls, window = [r["wall_s"] for r in rows], rows[args.warmup :]
    out["train_alone"] = step_times(common.intervals(walls, args.warmup), t0, bench)
    out["train_alone"].update(
        train_s_mean=statistics.fmean(r["train_s"] for r in window),
        tokens_per_step=statistics.fmean(r["tokens"] for r in window),
        process_s=time.perf_counter() - t,
        cores_by_role=cores,
    )
    alone = (out["gen_alone"]["step_s_mean"], out["train_alone"]["step_s_mean"])
    print("[overlap] alone: %.3f s a step generating, %.3f s training" % alone, flush=True)
    for mode, lag in args.modes:
        t0, where = time.monotonic(), bench.work / f"{mode}{rep}"
        flags = ["--steps", str(args.steps), "--max-lag", str(lag), "--model", model]
        run = common.run_train_cli(
            where, [*flags, "--seed", str(args.seed)], cpu_window=(args.warmup, args.steps)
        )
        st = common.steady(run["rows"], args.warmup)
        st.update(cores_by_role=run["cores_by_role"], process_s=run["process_s"])
        st.update({k: run["summary"].get(k) for k in ("max_token_lag", "dropped_stale")})
        st["foreign_cores"] = bench.foreign_cores(t0, time.monotonic())
        trace = where / "trace.json"
        st["trace"] = (
            costs.steady_breakdown(costs.load(trace), args.warmup) if trace.exists() else None
        )
        out[mode] = st
        print(f"[overlap] {mode} (--max-lag {lag}): {st['steps_per_s']:.2f} steps/s", flush=True)
    return out


def missing_share(
    breakdowns: list, t_gen: float, t_train: float, engine_s_per_token
) -> dict | None:
    """The missing share of the bound and its parts, as shares of a step (medians over repeats; see
    the docstring). None without a trace."""
    rows = [b for b in breakdowns if b]
    if not rows:
        return None

    def med(key):
        return statistics.median(b[key] for b in rows)

    step, bound = med("step_s"), max(t_gen, t_train)
    generating = med("wait_while_generating_s") - max(0.0, t_gen - t_train)
    contention = (
        0.0  # the engine's time per step in the run less the same tokens at its speed alone
    )
    if engine_s_per_token:
        alone = engine_s_per_token * med("engine_tokens")
        contention = max(0.0, min(generating, med("engine_s") - alone))
    out = {"share_of_pipelined": bound / step, "missing": 1 - bound / step}
    for key, name in (
        ("wait_swap", "wait_during_swap_s"),
        ("wait_weights", "wait_for_weights_s"),
        ("wait_idle", "wait_engine_idle_s"),
        ("wait_full_queue", "wait_during_full_queue_s"),
        ("evaluation", "evaluation_s"),
        ("gen_swap", "gen_swap_s"),
        ("gen_weights", "gen_for_weights_s"),
        ("gen_full_queue", "gen_full_queue_s"),
    ):
        out[key] = med(name) / step
    out.update(gen_contention=contention / step, wait_generating=generating / step)
    out["train_contention"] = (med("trainer_busy_s") - med("evaluation_s") - t_train) / step
    return {**out, "step_s": step, "trace": rows[-1]}


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 6, "warmup": 2})
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of every rate")
    p.add_argument("--repeats", type=int, default=1, help="repeats of the whole set (medians)")
    p.add_argument("--modes", default=",".join(m for m, _ in MODES), help="a subset (sync: always)")
    args = common.parse_args(p, argv)
    asked = {m.strip() for m in args.modes.split(",")} | {"sync"}
    if asked - {m for m, _ in MODES} or args.steps <= args.warmup + 2:
        p.error(f"--modes from {[m for m, _ in MODES]}; --steps must exceed --warmup by 3")
    args.modes = [(m, lag) for m, lag in MODES if m in asked]
    with common.Bench("overlap", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        reps = [measure(args, bench, model, rep) for rep in range(args.repeats)]
    data = figures(reps, args, bench.info["cores"])
    path = bench.save(data, plot)
    times = (data["t_gen_s"], data["t_train_s"], data["bound"], data["cpu_bound"])
    print("t_gen %.3f s, t_train %.3f s: bound %.2fx, CPU bound %.2fx" % times)
    rows = [{"mode": m, **data[m], **(data[m]["missing"] or {})} for m in data["modes"]]
    keys = "mode max_lag steps_per_s speedup share_of_bound share_of_cpu_bound trainer_wait_frac"
    print(common.table_of(rows, f"{keys} generator_wait_frac foreign_cores"))
    keys = "mode missing wait_swap wait_weights wait_idle wait_full_queue wait_generating"
    print(
        common.table_of(
            rows, f"{keys} gen_contention evaluation train_contention", "the missing share"
        )
    )
    print(bench.closing_line(path))
    return 0


def figures(reps: list[dict], args, cores: int) -> dict:
    """The medians over repeats, the bounds, and per mode its rates, shares and missing share."""

    def med(key, field):
        vals = [r[key][field] for r in reps if r[key].get(field) is not None]
        return statistics.median(vals) if vals else None

    t_gen, t_train = med("gen_alone", "step_s_typical"), med("train_alone", "step_s_typical")
    bound = (t_gen + t_train) / max(t_gen, t_train)
    # what the CPU allows: each stage needs (cores it keeps busy alone) x (its time alone)
    # CPU-seconds per step; overlapped, both must fit in the machine's cores
    alone_cores = {}
    for stage in ("gen_alone", "train_alone"):
        got = [r[stage]["cores_by_role"]["total"] for r in reps if r[stage].get("cores_by_role")]
        alone_cores[stage] = statistics.median(got)
    cpu_gen, cpu_train = t_gen * alone_cores["gen_alone"], t_train * alone_cores["train_alone"]
    cpu_rate = min(cores / (cpu_gen + cpu_train), 1 / max(t_gen, t_train))
    settings = {
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    settings["workload"] = "default task and tiny model; 32 prompts x 8 completions, 5 new tokens"
    data = {"settings": settings, "t_gen_s": t_gen, "t_train_s": t_train, "bound": bound}
    data.update(
        gen_alone_cores=alone_cores["gen_alone"], train_alone_cores=alone_cores["train_alone"]
    )
    data.update(
        cpu_s_per_step={"gen": cpu_gen, "train": cpu_train}, cpu_bound=cpu_rate * (t_gen + t_train)
    )
    data.update(cpu_bound_steps_per_s=cpu_rate, sequential_steps_per_s=1 / (t_gen + t_train))
    data.update(pipelined_steps_per_s=1 / max(t_gen, t_train))
    data["alone"] = {"gen": reps[-1]["gen_alone"], "train": reps[-1]["train_alone"]}
    data.update(modes=[m for m, _ in args.modes], repeats=reps)
    # the sync run, where the stages take turns: the trainer's wait per step is its batch's
    # generation (with the swap and the queue hop), its train time the training
    sync_rate = med("sync", "steps_per_s")
    s_gen, s_train = med("sync", "trainer_wait_frac") / sync_rate, med("sync", "train_s_mean")
    data["from_sync_run"] = {"t_gen_s": s_gen, "t_train_s": s_train}
    data["from_sync_run"]["bound"] = (s_gen + s_train) / max(s_gen, s_train)
    engine_s_per_token = med("gen_alone", "engine_s_per_token")
    for mode, lag in args.modes:
        rate = med(mode, "steps_per_s")
        speedup = rate / sync_rate
        row = {"max_lag": lag, "steps_per_s": rate, "speedup": speedup}
        row.update(share_of_bound=speedup / bound, share_of_pipelined=rate * max(t_gen, t_train))
        row["share_of_cpu_bound"] = speedup / data["cpu_bound"]
        for key in (
            "trainer_wait_frac",
            "generator_wait_frac",
            "sync_ms_median",
            "lag_mean",
            "foreign_cores",
        ):
            row[key] = med(mode, key)
        row.update(
            train_s_per_step=med(mode, "train_s_mean"),
            gen_busy_s_per_step=med(mode, "gen_busy_s_per_step"),
        )
        row["cores_by_role"] = reps[-1][mode]["cores_by_role"]
        traces = [r[mode].get("trace") for r in reps]
        row["missing"] = missing_share(traces, t_gen, t_train, engine_s_per_token)
        data[mode] = row
    return data


def plot(data: dict, path: Path) -> None:
    """Steps/s of each mode, against the sequential and perfectly overlapped rates."""
    values = {m: [data[m]["steps_per_s"]] for m in data["modes"]}
    values["sequential"] = [data["sequential_steps_per_s"]]
    values["perfect overlap"] = [data["pipelined_steps_per_s"]]
    values["CPU bound"] = [data["cpu_bound_steps_per_s"]]
    common.bars(data, path, "overlap", values, ylabel="steps / s (steady state)")


if __name__ == "__main__":
    sys.exit(main())
