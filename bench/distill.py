"""bench/distill.py — does a teacher's per-token signal get a random-init student to the teacher's
reward sooner?

    # writes DIR/distill.json and DIR/distill.png (25-35 min on 2 cores)
    python bench/distill.py --out DIR
    # the suite's size (tests/test_bench.py): --steps 12 --seeds 1
    python bench/distill.py --smoke --out DIR

(a) The teacher: a default run, `python train.py` (its OUT/model), or `--teacher OUT/model` to reuse
    one
(its final reward is read from OUT/metrics.jsonl).
(b) Students from a random init: `python train.py --seed S` without --model (the tiny default model
    of seed S),
trained with plain GRPO and with `--teacher TEACHER --distill-coef C` on top of the task's reward,
each for --seeds seeds (the same start for both arms of a seed). Reported per run: the step at which
the reward (mean over a 10-step window) first reaches the target, a --fraction of the teacher's
final reward (its mean over the last 20 steps), and the reverse KL to the teacher at the start and
the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from run import plots  # noqa: E402  (the project's own, on sys.path through common)

SMOOTH = 10
LAST = 20  # the teacher's final reward: the mean over its last LAST steps


def reach_step(rows: list[dict], target: float) -> int | None:
    """The first step whose SMOOTH-step mean reward is >= target (None: never)."""
    sm = plots.smooth([r["reward"] for r in rows], SMOOTH)
    return next(
        (rows[i]["step"] for i, v in enumerate(sm) if i >= SMOOTH - 1 and v >= target), None
    )


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "seeds": "1"})
    p.add_argument(
        "--steps", type=int, default=300, help="steps of the teacher's run and of each student's"
    )
    p.add_argument(
        "--seeds", default="1,2", help="the students' seeds (their random inits), comma-separated"
    )
    p.add_argument(
        "--coef", type=float, default=0.1, help="--distill-coef of the distilled students"
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.9,
        help="target: this share of the teacher's final reward",
    )
    p.add_argument(
        "--teacher", default="", help="a trained model to use as the teacher (default: train one)"
    )
    args = common.parse_args(p, argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with common.Bench("distill", args) as bench:
        teacher = args.teacher
        if not teacher:  # (a) a default run; the final model is the teacher
            run = common.run_train_cli(
                bench.work / "teacher", ["--steps", str(args.steps), "--seed", str(args.seed)]
            )
            teacher, teacher_run = str(bench.work / "teacher" / "model"), run
            teacher_final = sum(r["reward"] for r in run["rows"][-LAST:]) / len(run["rows"][-LAST:])
            print(
                f"[distill] teacher: {len(run['rows'])} steps in {run['process_s']:.0f} s, final "
                f"reward {teacher_final:.3f}",
                flush=True,
            )
        else:  # a teacher trained before: its run's rows lie beside it
            rows = [
                json.loads(line)
                for line in (Path(teacher).parent / "metrics.jsonl").read_text().splitlines()
            ]
            teacher_run = {
                "rows": [r for r in rows if "reward" in r and "step" in r],
                "process_s": None,
            }
            teacher_final = sum(r["reward"] for r in teacher_run["rows"][-LAST:]) / LAST
        runs = {}
        for seed in seeds:
            for arm, extra in (
                ("grpo", []),
                ("distill", ["--teacher", teacher, "--distill-coef", str(args.coef)]),
            ):
                name = f"{arm}_seed{seed}"
                run = common.run_train_cli(
                    bench.work / name, ["--steps", str(args.steps), "--seed", str(seed), *extra]
                )
                rows = run["rows"]
                runs[name] = {
                    "arm": arm,
                    "seed": seed,
                    "steps": len(rows),
                    "wall_s": rows[-1]["wall_s"],
                    "process_s": run["process_s"],
                    "cmd": run["cmd"],
                    "reward_last20": sum(r["reward"] for r in rows[-LAST:]) / len(rows[-LAST:]),
                    "curve": {
                        "step": [r["step"] for r in rows],
                        "reward": [round(r["reward"], 4) for r in rows],
                        "distill_reverse_kl": [
                            round(r["distill_reverse_kl"], 4)
                            for r in rows
                            if "distill_reverse_kl" in r
                        ],
                    },
                }
                print(
                    f"[distill] {name}: {len(rows)} steps in {run['process_s']:.0f} s, reward last "
                    f"{LAST} {runs[name]['reward_last20']:.3f}",
                    flush=True,
                )
    target = args.fraction * teacher_final
    for r in runs.values():
        rows = [{"step": s, "reward": v} for s, v in zip(r["curve"]["step"], r["curve"]["reward"])]
        r["reach_step"] = reach_step(rows, target)
    data = {
        "settings": {
            "steps": args.steps,
            "seeds": seeds,
            "teacher_seed": args.seed,
            "coef": args.coef,
            "fraction": args.fraction,
            "smooth": SMOOTH,
            "teacher": args.teacher or "trained here",
            "workload": "default task (copy 3 letters), tiny model, default flags; students: the "
            "default model of their seed, distilled ones with the task reward too",
        },
        "teacher": {
            "final_reward": teacher_final,
            "process_s": teacher_run["process_s"],
            "curve": {
                "step": [r["step"] for r in teacher_run["rows"]],
                "reward": [round(r["reward"], 4) for r in teacher_run["rows"]],
            },
        },
        "target": target,
        "runs": runs,
    }
    path = bench.save(data, plot)
    print()
    hdr = [
        "run",
        "steps",
        "wall s",
        f"reward last {LAST}",
        f"step to {target:.3f}",
        "reverse KL first",
        "last",
    ]
    table_rows = []
    for name, r in runs.items():
        kl = r["curve"]["distill_reverse_kl"]
        table_rows.append(
            [
                name,
                r["steps"],
                r["wall_s"],
                r["reward_last20"],
                r["reach_step"],
                kl[0] if kl else None,
                kl[-1] if kl else None,
            ]
        )
    print(
        common.table(
            hdr,
            table_rows,
            title=f"teacher final reward {teacher_final:.3f}; target "
            f"{args.fraction} x that = {target:.3f}; --distill-coef {args.coef}",
        )
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"grpo": "#7f7f7f", "distill": "#1f77b4"}
    styles = ["-", "--", ":", "-."]
    seeds = data["settings"]["seeds"]
    for r in data["runs"].values():
        c, ls = r["curve"], styles[seeds.index(r["seed"]) % len(styles)]
        label = f"{r['arm']} seed {r['seed']}" + (
            f" (C {data['settings']['coef']})" if r["arm"] == "distill" else ""
        )
        ax1.plot(
            c["step"],
            plots.smooth(c["reward"], SMOOTH),
            color=colors[r["arm"]],
            ls=ls,
            lw=1.6,
            label=label,
        )
        if c["distill_reverse_kl"]:
            ax2.plot(
                c["step"][: len(c["distill_reverse_kl"])],
                c["distill_reverse_kl"],
                color=colors[r["arm"]],
                ls=ls,
                label=label,
            )
    t = data["teacher"]["curve"]
    ax1.plot(
        t["step"],
        plots.smooth(t["reward"], SMOOTH),
        color="#2ca02c",
        lw=1,
        alpha=0.6,
        label="the teacher's own run (seed 0 unless --seed)",
    )
    ax1.axhline(data["target"], color="k", ls=":", lw=0.8)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel(f"reward (mean of {SMOOTH} steps)")
    ax1.set_title(f"students: plain GRPO vs distilled (dotted: target {data['target']:.3f})")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("distill_reverse_kl (nats per token)")
    ax2.set_title("reverse KL to the teacher, distilled students")
    common.save_figure(fig, path, data, "on-policy distillation")


if __name__ == "__main__":
    sys.exit(main())
