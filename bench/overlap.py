"""bench/overlap.py — does asynchrony keep both sides busy? Sync against async, side by side, in one
run.

    # writes DIR/overlap.json and DIR/overlap.png, prints a table
    python bench/overlap.py --out DIR
    # the suite's size (tests/test_bench.py): --steps 6 --warmup 2
    python bench/overlap.py --smoke --out DIR
    # sync (the baseline) and --max-lag 2 only
    python bench/overlap.py --modes lag2 --steps 30 --out DIR

What runs, all with the default workload (the tiny model, 32 prompts x 8 completions, 5 new tokens)
and the same thread budget per process as `python train.py` (half the cores for the generator, the
rest for the trainer):
1. Generation alone: the real generator process (`rollout.generator_main`) feeding a stand-in
   trainer that only takes each step's groups and republishes the weights (one weight swap per step,
   as in a run). -> t_gen, seconds per step's batch.
2. Training alone: the real trainer (`train.trainer_main`) on the very batches of 1, from a queue
   that is never empty. -> t_train, seconds per step.
3. `python train.py --max-lag K` for K = 0 (sync: strictly on-policy, each side waits for the
   other), 1, 2 and 4, same seed and model, `--steps` steps each.
Rates are steady-state: the first `--warmup` steps of every run are left out.

bound = (t_gen + t_train) / max(t_gen, t_train): the best speedup two overlapped stages can give (t:
the mean seconds per step without outliers above 3x the median, `common.typical_mean`; training
alone evaluates nothing). speedup = steps/s of a mode / steps/s of sync; share_of_bound = speedup /
bound. Also reported: the fraction of time the trainer waited for data and the generator for queue
space or weights; the cores each process used (trainer, generator, vLLM's EngineCore and worker)
over the steady window; the CPU bound (both stages' CPU-seconds per step, measured alone, fitted
into the machine's cores: overlap cannot beat it when the stages together need more cores than there
are); and a cross-check of t_gen and t_train read off the sync run itself (the trainer's wait and
train time per step).

Where the missing share goes, per mode, from the run's OUT/trace.json (bench/traces.py) over the
same steady window. A step takes T = trainer wait + trainer work; the bound allows T* = max(t_gen,
t_train), so the share missing is (T - T*) / T, split exactly into (each a share of T):
- the trainer waited while the generator swapped weights (`wait_swap`), had nothing in the engine
  because the staleness gate let no group start (waiting for newer weights: `wait_weights`), had
  nothing in the engine otherwise (`wait_idle`), or had a group blocked on a full queue
  (`wait_full_queue`);
- it waited while the generator generated, beyond the max(0, t_gen - t_train) the bound itself
  leaves (`wait_generating`); of which an estimate of CPU contention on the generator's side
  (`gen_contention`: vLLM's engine time per scheduled token in the run against generation alone,
  times the step's tokens), the rest generation not overlapped with training;
- the trainer evaluated (`evaluation`: asking for and collecting held-out evaluations, the final one
  waited for; training alone evaluates nothing);
- training took longer than alone (`train_contention`: the trainer's other work per step less
  t_train: CPU contention, and what the run adds, such as publishing to a generator that reads).

This file holds the options, the figures over repeats, the tables and the plot; one repeat's runs
are bench/overlap_modes.py, the split of the missing share bench/overlap_breakdown.py.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from overlap_breakdown import missing_share  # noqa: E402
from overlap_modes import MODES, measure  # noqa: E402


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 6, "warmup": 2})
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of every rate")
    p.add_argument(
        "--repeats", type=int, default=1, help="repeat the whole set; medians are reported"
    )
    p.add_argument(
        "--modes",
        default=",".join(m for m, _ in MODES),
        help="comma-separated subset (sync is the baseline: always run)",
    )
    args = common.parse_args(p, argv)
    asked = {m.strip() for m in args.modes.split(",")} | {"sync"}
    if asked - {m for m, _ in MODES}:
        p.error(
            f"unknown --modes {sorted(asked - {m for m, _ in MODES})}; choose from "
            f"{[m for m, _ in MODES]}"
        )
    args.modes = [(m, lag) for m, lag in MODES if m in asked]
    modes = args.modes
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")
    reps = []
    with common.Bench("overlap", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for rep in range(args.repeats):
            reps.append(measure(args, bench, model, rep))
    info = bench.info

    def med(key, field):
        vals = [r[key][field] for r in reps if r[key].get(field) is not None]
        return statistics.median(vals) if vals else None

    t_gen, t_train = med("gen_alone", "step_s_typical"), med("train_alone", "step_s_typical")
    bound = (t_gen + t_train) / max(t_gen, t_train)
    # What the CPU allows: each stage needs (cores it keeps busy alone) x (its time alone)
    # CPU-seconds per step; overlapped, both must fit in the machine's cores.
    gen_cores = statistics.median(
        r["gen_alone"]["cores_by_role"]["total"]
        for r in reps
        if r["gen_alone"].get("cores_by_role")
    )
    train_cores = statistics.median(
        r["train_alone"]["cores_by_role"]["total"]
        for r in reps
        if r["train_alone"].get("cores_by_role")
    )
    cpu_gen, cpu_train = t_gen * gen_cores, t_train * train_cores
    cpu_bound_rate = min(info["cores"] / (cpu_gen + cpu_train), 1 / max(t_gen, t_train))
    cpu_bound = cpu_bound_rate * (t_gen + t_train)
    data = {
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
            "workload": "default task and tiny model; 32 prompts x 8 completions, 5 new tokens",
        },
        "t_gen_s": t_gen,
        "t_train_s": t_train,
        "bound": bound,
        "gen_alone_cores": gen_cores,
        "train_alone_cores": train_cores,
        "cpu_s_per_step": {"gen": cpu_gen, "train": cpu_train},
        "cpu_bound": cpu_bound,
        "cpu_bound_steps_per_s": cpu_bound_rate,
        "sequential_steps_per_s": 1 / (t_gen + t_train),
        "pipelined_steps_per_s": 1 / max(t_gen, t_train),
        "alone": {"gen": reps[-1]["gen_alone"], "train": reps[-1]["train_alone"]},
        "modes": [m for m, _ in modes],
        "repeats": reps,
    }
    sync_rate = med("sync", "steps_per_s")
    # Cross-check from the sync run itself, where the stages take turns: the trainer's wait per step
    # is the generation of its batch (plus the weight swap and the queue hop), its train time the
    # training.
    s_gen = med("sync", "trainer_wait_frac") / sync_rate
    s_train = med("sync", "train_s_mean")
    data["from_sync_run"] = {
        "t_gen_s": s_gen,
        "t_train_s": s_train,
        "bound": (s_gen + s_train) / max(s_gen, s_train),
    }
    for mode, lag in modes:
        rate = med(mode, "steps_per_s")
        speedup = rate / sync_rate
        data[mode] = {
            "max_lag": lag,
            "steps_per_s": rate,
            "speedup": speedup,
            "share_of_bound": speedup / bound,
            "share_of_pipelined": rate * max(t_gen, t_train),
            "share_of_cpu_bound": speedup / cpu_bound,
            "trainer_wait_frac": med(mode, "trainer_wait_frac"),
            "generator_wait_frac": med(mode, "generator_wait_frac"),
            "train_s_per_step": med(mode, "train_s_mean"),
            "gen_busy_s_per_step": med(mode, "gen_busy_s_per_step"),
            "sync_ms_median": med(mode, "sync_ms_median"),
            "lag_mean": med(mode, "lag_mean"),
            "cores_by_role": reps[-1][mode]["cores_by_role"],
            "foreign_cores": med(mode, "foreign_cores"),
            "missing": missing_share(
                [r[mode].get("trace") for r in reps],
                t_gen,
                t_train,
                med("gen_alone", "engine_s_per_token"),
            ),
        }
    path = bench.save(data, plot)

    rows = [
        [
            m,
            data[m]["max_lag"],
            data[m]["steps_per_s"],
            data[m]["speedup"],
            data[m]["share_of_bound"],
            data[m]["share_of_cpu_bound"],
            data[m]["trainer_wait_frac"],
            data[m]["generator_wait_frac"],
            data[m]["train_s_per_step"] * 1e3,
            (data[m]["gen_busy_s_per_step"] or 0) * 1e3,
            data[m]["foreign_cores"],
        ]
        for m, _ in modes
    ]
    print()
    print(
        f"t_gen {t_gen * 1e3:.0f} ms/step alone, t_train {t_train * 1e3:.0f} ms/step alone, bound "
        f"(t_gen + t_train) / max = {bound:.2f}x"
    )
    fs = data["from_sync_run"]
    print(
        f"cross-check inside the sync run: generation (with the swap and the queue hop) "
        f"{fs['t_gen_s'] * 1e3:.0f} "
        f"ms/step, training {fs['t_train_s'] * 1e3:.0f} ms/step, bound {fs['bound']:.2f}x"
    )
    print(
        f"what the CPUs allow: generation alone keeps {gen_cores:.2f} cores busy, training alone "
        f"{train_cores:.2f}; "
        f"{cpu_gen + cpu_train:.3f} CPU-s per step on {info['cores']} cores -> at most "
        f"{cpu_bound:.2f}x"
    )
    print(
        common.table(
            [
                "mode",
                "max lag",
                "steps/s",
                "speedup",
                "share of bound",
                "share of CPU bound",
                "trainer wait",
                "generator wait",
                "train ms/step",
                "gen busy ms/step",
                "other processes (cores)",
            ],
            rows,
        )
    )
    parts = [
        "share_of_pipelined",
        "missing",
        "wait_swap",
        "wait_weights",
        "wait_idle",
        "wait_full_queue",
        "wait_generating",
        "gen_contention",
        "evaluation",
        "train_contention",
        "gen_swap",
        "gen_weights",
        "gen_full_queue",
    ]
    miss_rows = [
        [m] + [data[m]["missing"][k] for k in parts] for m, _ in modes if data[m]["missing"]
    ]
    if miss_rows:
        print()
        print(
            common.table(
                [
                    "mode",
                    "T*/T",
                    "missing",
                    "waits: swap",
                    "waits: for weights",
                    "waits: idle engine",
                    "waits: full queue",
                    "waits: generation",
                    "(of it: CPU contention)",
                    "evaluation",
                    "training slower than alone",
                    "gen: swapping",
                    "gen: waiting for weights",
                    "gen: queue full",
                ],
                miss_rows,
                title="where the missing share of the bound goes (shares of a step, from the "
                "traces; 'waits': the trainer waits while the generator does that):",
            )
        )
    roles = ["trainer", "generator", "engine_core", "vllm_worker", "parent", "helpers", "total"]
    cpu_rows = []
    if data["alone"]["gen"].get("cores_by_role"):
        cpu_rows.append(
            ["generation alone"] + [data["alone"]["gen"]["cores_by_role"].get(r) for r in roles]
        )
    for m, _ in modes:
        if data[m].get("cores_by_role"):
            cpu_rows.append([m] + [data[m]["cores_by_role"].get(r) for r in roles])
    if cpu_rows:
        print()
        print(
            common.table(
                ["run"] + roles,
                cpu_rows,
                title=f"cores used by each process over the steady window (of {info['cores']}):",
            )
        )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    modes = data["modes"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    rates = [data[m]["steps_per_s"] for m in modes]
    ax1.bar(modes, rates, color=["#999999"] + ["#1f77b4"] * (len(modes) - 1))
    ax1.axhline(
        data["sequential_steps_per_s"],
        ls="--",
        color="k",
        lw=1,
        label="1 / (t_gen + t_train) (sequential)",
    )
    ax1.axhline(
        data["pipelined_steps_per_s"],
        ls=":",
        color="r",
        lw=1.5,
        label="1 / max(t_gen, t_train) (perfect overlap)",
    )
    for i, m in enumerate(modes):
        ax1.text(
            i,
            rates[i],
            f"{data[m]['speedup']:.2f}x\n{data[m]['share_of_bound']:.0%} of bound",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_ylabel("steps / s (steady state)")
    ax1.set_ylim(0, max(rates + [data["pipelined_steps_per_s"]]) * 1.5)
    ax1.axhline(
        data["cpu_bound_steps_per_s"],
        ls="-.",
        color="#d62728",
        lw=1,
        label=f"what {data['machine']['cores']} cores allow (CPU work of both stages)",
    )
    ax1.set_title(
        f"throughput; bound {data['bound']:.2f}x, CPU bound {data['cpu_bound']:.2f}x", fontsize=10
    )
    ax1.legend(fontsize=7, loc="upper left")
    x = range(len(modes))
    ax2.bar(
        [i - 0.2 for i in x],
        [data[m]["trainer_wait_frac"] for m in modes],
        0.4,
        label="trainer waits for data",
    )
    ax2.bar(
        [i + 0.2 for i in x],
        [data[m]["generator_wait_frac"] or 0 for m in modes],
        0.4,
        label="generator waits (queue full / weights)",
    )
    ax2.set_xticks(list(x), modes)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("fraction of wall time")
    ax2.set_title("who waits")
    ax2.legend(fontsize=7)
    parts = (
        ("wait_swap", "trainer waits: swap"),
        ("wait_weights", "trainer waits: generator waits for weights"),
        ("wait_idle", "trainer waits: engine idle"),
        ("wait_full_queue", "trainer waits: queue full"),
        ("gen_contention", "trainer waits: generation, CPU contention (estimate)"),
        ("not_overlapped", "trainer waits: generation, not overlapped"),
        ("evaluation", "evaluation"),
        ("train_contention", "training slower than alone"),
    )
    bottom = [0.0] * len(modes)
    for key, label in parts:
        values = [
            (m_["wait_generating"] - m_["gen_contention"] if key == "not_overlapped" else m_[key])
            if m_
            else 0.0
            for m_ in (data[m]["missing"] for m in modes)
        ]
        ax3.bar(list(x), values, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax3.plot(
        list(x),
        [data[m]["missing"]["missing"] if data[m]["missing"] else 0 for m in modes],
        "k_",
        ms=30,
        mew=2,
        label="missing: 1 - max(t_gen, t_train) / step",
    )
    ax3.set_xticks(list(x), modes)
    ax3.set_ylabel("share of a step")
    ax3.set_title("where the missing share goes (from the traces)")
    ax3.set_ylim(min(0.0, *bottom), 1.7 * max(0.05, *bottom))
    ax3.legend(fontsize=6, loc="upper right")
    common.save_figure(fig, path, data, "overlap")


if __name__ == "__main__":
    sys.exit(main())
