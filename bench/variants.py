"""bench/variants.py — the loss variants on the default task, where they act: PPO mini-batches.

    python bench/variants.py --out DIR       # writes DIR/variants.json; about 15 minutes on 2 cores
    # the suite's size (tests/test_bench.py): --steps 12 --seeds 0
    python bench/variants.py --smoke --out DIR

Runs `python train.py` on the default task for each variant and seed: the default (one update per
batch, `--loss grpo`) and `--loss grpo|dapo|cispo` with `--mini-batches 4` (four optimizer steps per
rollout batch, so the ratio to the proximal policy moves and the clips act). Reported per run:
reward over the first 10% and the last 20% of steps, the run's wall time (from the engine being up),
the clip fractions and the largest ratio seen. Each run is the real command line a user types.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = {
    "default (grpo, 1 update)": [],
    "grpo, 4 mini-batches": ["--loss", "grpo", "--mini-batches", "4"],
    "dapo, 4 mini-batches": ["--loss", "dapo", "--mini-batches", "4"],
    "cispo, 4 mini-batches": ["--loss", "cispo", "--mini-batches", "4"],
}


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "seeds": [0]})
    p.add_argument("--steps", type=int, default=300, help="steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = common.parse_args(p, argv)
    runs = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for name, flags in VARIANTS.items():
            tag = name.split(",")[0].split(" ")[0] + ("_mb4" if flags else "")
            run = common.run_train_cli(
                Path(args.work or out / "work") / f"{tag}_s{seed}",
                ["--steps", str(args.steps), "--seed", str(seed), "--eval-every", "0", *flags],
            )
            s, rows = run["summary"], run["rows"]
            runs.append(
                {
                    "variant": name,
                    "seed": seed,
                    "flags": " ".join(flags) or "(defaults)",
                    "reward_first10": s["reward_first10"],
                    "reward_last20": s["reward_last20"],
                    "wall_s": s["wall_s"],
                    "clip_frac": sum(
                        r.get("clip_frac_low", 0) + r.get("clip_frac_high", 0) for r in rows
                    )
                    / len(rows),
                    "ratio_max": max(r.get("ratio_max", 1.0) for r in rows),
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    machine = common.machine_line(common.machine_info())
    (out / "variants.json").write_text(
        json.dumps({"machine": machine, "steps": args.steps, "runs": runs}, indent=2)
    )
    print(
        "\n| variant | seed | reward first 10% -> last 20% | wall | mean clip fraction | max ratio "
        "|"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(
            f"| {r['variant']} | {r['seed']} | {r['reward_first10']:.3f} -> "
            f"{r['reward_last20']:.3f} | "
            f"{r['wall_s']:.0f} s | {r['clip_frac']:.3f} | {r['ratio_max']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
