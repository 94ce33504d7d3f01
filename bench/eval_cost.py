"""bench/eval_cost.py — what held-out evaluation costs a run, and what it shows.

    python bench/eval_cost.py --out DIR       # writes DIR/eval_cost.json and DIR/eval_cost.png
    # the suite's size (tests/test_bench.py): --steps 12 --rounds 1
    python bench/eval_cost.py --smoke --out DIR

The default run (`python train.py`: the copy task, 300 steps, `--eval-every 50`) against the same
run with `--eval-every 0`, same seed and model, alternated over `--rounds` rounds (the order swaps
every round, so neither always runs first). Wall time is the run's own clock (`wall_s`: from the
moment the engine is up; start-up is reported apart). Reported: the medians and their ratio (the
cost of evaluating), the generator's time spent evaluating, the training reward of both, and the
held-out greedy pass@1 curve.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODES = (("eval", []), ("no_eval", ["--eval-every", "0"]))


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "rounds": 1})
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode")
    args = common.parse_args(p, argv)
    runs = {m: [] for m, _ in MODES}
    with common.Bench("eval_cost", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for r in range(args.rounds):
            for mode, extra in MODES if r % 2 == 0 else MODES[::-1]:
                t0 = time.monotonic()
                run = common.run_train_cli(
                    bench.work / f"{mode}_{r}",
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
                evals = sorted((x for x in rows if "eval/step" in x), key=lambda x: x["eval/step"])
                runs[mode].append(
                    {
                        "wall_s": rows[-1]["wall_s"],
                        "process_s": run["process_s"],
                        "foreign_cores": bench.foreign_cores(t0, time.monotonic()),
                        "reward_first10": s["reward_first10"],
                        "reward_last20": s["reward_last20"],
                        "eval_first": s.get("eval_first"),
                        "eval_last": s.get("eval_last"),
                        "eval_s": s.get("eval_s"),
                        "trainer_wait_frac": s["trainer_wait_frac"],
                        # the generator's time evaluating while training ran (the step-0 one is done
                        # before), / wall
                        "eval_share": (s["eval_s"] - evals[0]["eval/time_s"]) / rows[-1]["wall_s"]
                        if evals
                        else None,
                        "evals": [
                            {k.split("/", 1)[1]: x[k] for k in x if k.startswith("eval/")}
                            for x in evals
                        ],
                    }
                )
                last = runs[mode][-1]
                print(
                    f"[eval_cost] {mode} round {r}: {last['wall_s']:.1f} s, reward "
                    f"{s['reward_first10']:.3f} -> {s['reward_last20']:.3f}"
                    + (
                        f", held-out greedy pass@1 {s['eval_first']:.3f} -> {s['eval_last']:.3f}"
                        if s.get("eval_last") is not None
                        else ""
                    ),
                    flush=True,
                )
    medians = {m: statistics.median(x["wall_s"] for x in runs[m]) for m, _ in MODES}
    data = {
        "settings": {
            "steps": args.steps,
            "seed": args.seed,
            "rounds": args.rounds,
            "workload": "default task (copy 3 letters, 93 held-out triples), tiny model, default "
            "flags; eval: --eval-every 50 --eval-samples 4 (the defaults)",
        },
        "runs": runs,
        "median_wall_s": medians,
        "cost_ratio": medians["eval"] / medians["no_eval"],
    }
    path = bench.save(data, plot)
    print()
    table_rows = [
        [
            m,
            i,
            x["wall_s"],
            x["process_s"],
            x["foreign_cores"],
            x["reward_first10"],
            x["reward_last20"],
            x["eval_first"],
            x["eval_last"],
            x["eval_s"],
        ]
        for m, _ in MODES
        for i, x in enumerate(runs[m])
    ]
    print(
        common.table(
            [
                "mode",
                "round",
                "wall s",
                "process s",
                "others' cores",
                "reward first 10%",
                "reward last 20%",
                "held-out pass@1 first",
                "last",
                "eval s (generator)",
            ],
            table_rows,
        )
    )
    print(
        f"median wall time: with evaluation {medians['eval']:.1f} s, without "
        f"{medians['no_eval']:.1f} s: "
        f"x{data['cost_ratio']:.3f} ({(data['cost_ratio'] - 1) * 100:+.1f}%); the generator spent "
        + ", ".join(f"{x['eval_share'] * 100:.1f}%" for x in runs["eval"])
        + " of each run's wall time "
        "evaluating while training ran (weight loads wait for it: the trainer goes on for "
        "--max-lag steps)"
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(data["runs"]["eval"]):
        e = run["evals"]
        label = "" if i else "greedy pass@1"
        ax1.plot(
            [x["step"] for x in e],
            [x["greedy_pass@1"] for x in e],
            "o-",
            color="tab:blue",
            label=label,
            alpha=0.8,
        )
        ax1.plot(
            [x["step"] for x in e],
            [x["reward"] for x in e],
            "s--",
            color="tab:green",
            label="" if i else "mean reward of 4 samples",
            alpha=0.8,
        )
        ax1.plot(
            [x["step"] for x in e],
            [x["pass@4"] for x in e],
            "^:",
            color="tab:purple",
            label="" if i else "pass@4",
            alpha=0.8,
        )
    ax1.set(title="held-out triples (never trained on)", xlabel="step evaluated", ylim=(0, 1.02))
    ax1.legend(fontsize=8, loc="lower right")
    modes = list(data["runs"])
    for j, m in enumerate(modes):
        walls = [x["wall_s"] for x in data["runs"][m]]
        ax2.scatter([j] * len(walls), walls, color="k", zorder=3, s=12)
        ax2.bar(j, data["median_wall_s"][m], color=("tab:blue", "tab:gray")[j], alpha=0.6)
    ax2.set_xticks(
        range(len(modes)), ["--eval-every 50" if m == "eval" else "--eval-every 0" for m in modes]
    )
    ax2.set(title=f"wall time (median; dots: runs): x{data['cost_ratio']:.3f}", ylabel="s")
    common.save_figure(fig, path, data, "evaluation cost")


if __name__ == "__main__":
    sys.exit(main())
