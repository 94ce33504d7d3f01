"""bench/learning.py — does async reach the same reward sooner? Reward against wall time and against
steps.

    python bench/learning.py --out DIR       # writes DIR/learning.json and DIR/learning.png
    # the suite's size (tests/test_bench.py): --steps 12
    python bench/learning.py --smoke --out DIR

Two runs of `python train.py` on the default task, same seed, same model, same steps: `--max-lag 0`
(synchronous, strictly on-policy) and `--max-lag 4` (asynchronous). Wall time is the run's own clock
(`wall_s` in metrics.jsonl: from the moment the engine is up; start-up is reported apart). Reported:
the reward curves, the time and the step at which the reward (mean over a 10-step window) first
reaches 0.5, 0.8 and 0.9, the reward over the last 20% of steps and over the last 10 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from run import plots  # noqa: E402  (the project's own, on sys.path through common)

THRESHOLDS = (0.5, 0.8, 0.9)
SMOOTH = 10


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12})
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--async-lag", type=int, default=4, help="--max-lag of the asynchronous run")
    args = common.parse_args(p, argv)
    modes = (("sync", 0), (f"lag{args.async_lag}", args.async_lag))
    runs = {}
    with common.Bench("learning", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for mode, lag in modes:
            run = common.run_train_cli(
                bench.work / mode,
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
            )
            rows = run["rows"]
            reward = [r["reward"] for r in rows]
            sm = plots.smooth(reward, SMOOTH)
            reach = {}
            for th in THRESHOLDS:
                i = next((i for i, v in enumerate(sm) if i >= SMOOTH - 1 and v >= th), None)
                reach[str(th)] = {
                    "step": rows[i]["step"] if i is not None else None,
                    "wall_s": rows[i]["wall_s"] if i is not None else None,
                }
            s = run["summary"]
            runs[mode] = {
                "max_lag": lag,
                "steps": len(rows),
                "wall_s": rows[-1]["wall_s"],
                "process_s": run["process_s"],
                "startup_s": run["process_s"] - rows[-1]["wall_s"],
                "steps_per_s": len(rows) / rows[-1]["wall_s"],
                "reward_first10": s.get("reward_first10"),
                "reward_last20": s.get("reward_last20"),
                "reward_final": sm[-1],
                "max_token_lag": s.get("max_token_lag"),
                "dropped_stale": s.get("dropped_stale"),
                "reach": reach,
                "curve": {
                    "step": [r["step"] for r in rows],
                    "wall_s": [round(r["wall_s"], 3) for r in rows],
                    "reward": [round(x, 4) for x in reward],
                },
            }
            print(
                f"[learning] {mode}: {len(rows)} steps in {rows[-1]['wall_s']:.0f} s "
                f"({run['process_s']:.0f} s with start-up), reward {s.get('reward_first10'):.3f} "
                f"-> {s.get('reward_last20'):.3f}",
                flush=True,
            )
    sync, asyn = runs["sync"], runs[modes[1][0]]
    speed = {}
    for th in THRESHOLDS:
        a, b = sync["reach"][str(th)]["wall_s"], asyn["reach"][str(th)]["wall_s"]
        speed[str(th)] = a / b if a and b else None
    data = {
        "settings": {
            "steps": args.steps,
            "seed": args.seed,
            "smooth": SMOOTH,
            "workload": "default task (copy 3 letters), tiny model, default flags except --max-lag",
        },
        "modes": [m for m, _ in modes],
        "runs": runs,
        "time_to_reward_speedup": speed,
        "wall_speedup": sync["wall_s"] / asyn["wall_s"],
    }
    path = bench.save(data, plot)
    print()
    hdr = [
        "mode",
        "steps",
        "wall s",
        "steps/s",
        "reward first 10%",
        "reward last 20%",
        f"last {SMOOTH} steps",
    ]
    for th in THRESHOLDS:
        hdr += [f"to {th}: s", f"to {th}: step"]
    table_rows = []
    for m, _ in modes:
        r = runs[m]
        row = [
            m,
            r["steps"],
            r["wall_s"],
            r["steps_per_s"],
            r["reward_first10"],
            r["reward_last20"],
            r["reward_final"],
        ]
        for th in THRESHOLDS:
            row += [r["reach"][str(th)]["wall_s"], r["reach"][str(th)]["step"]]
        table_rows.append(row)
    print(common.table(hdr, table_rows))
    print(
        "time-to-reward speedup (sync / async): "
        + ", ".join(
            f"{th}: {speed[str(th)]:.2f}x" if speed[str(th)] else f"{th}: not reached"
            for th in THRESHOLDS
        )
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"sync": "#7f7f7f"}
    for m in data["modes"]:
        c = data["runs"][m]["curve"]
        color = colors.get(m, "#1f77b4")
        label = f"{m} (--max-lag {data['runs'][m]['max_lag']})"
        for ax, x in ((ax1, c["wall_s"]), (ax2, c["step"])):
            ax.plot(x, c["reward"], color=color, alpha=0.2, lw=0.8)
            ax.plot(x, plots.smooth(c["reward"], SMOOTH), color=color, lw=2, label=label)
    for th in (0.9,):
        for ax in (ax1, ax2):
            ax.axhline(th, color="k", ls=":", lw=0.8)
    ax1.set_xlabel("wall time since the engine was up (s)")
    ax2.set_xlabel("optimizer step")
    ax1.set_ylabel(f"reward (faint: per step; bold: mean of {SMOOTH})")
    ax1.set_title("reward vs wall time")
    ax2.set_title("reward vs steps")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_ylim(0, 1.02)
    common.save_figure(fig, path, data, "learning, async vs sync")


if __name__ == "__main__":
    sys.exit(main())
