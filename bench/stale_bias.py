"""bench/stale_bias.py — does the staleness rule drop long completions more often? Drop rate by
length.

    python bench/stale_bias.py --out DIR       # writes DIR/stale_bias.json and DIR/stale_bias.png
    # the suite's size (tests/test_bench.py): 12 steps, 8 new tokens
    python bench/stale_bias.py --smoke --out DIR

Two runs of `python train.py` on the default copy task with a long tail of completion lengths: the
random-init tiny model with --max-new-tokens 48 (it stops only when it samples <eos>, so lengths
spread from 1 to 48; a small --lr 1e-5 keeps that spread, and the two runs' length distributions
alike, over the run), in-flight swaps, --max-lag 1, groups of 2, 4 prompts per step and up to 32
groups in flight (so groups often land a step later than planned, the way long groups do), the same
seed: `--stale-rule group` (a group is dropped when any of its samples has a token older
than --max-lag: the rule before issue 22) and `--stale-rule tokens` (only the stale tokens are
masked; a group is dropped only when none of its tokens is fresh enough). From each step's
`stale_by_len` census: per length bucket (model tokens, powers of two), the share of samples dropped
whole and the share of their tokens left out of training (those of dropped samples, and the masked
stale ones). Both rules keep every trained token within --max-lag (`max_token_lag` in the summary).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RULES = ("group", "tokens")


def census(rows: list[dict]) -> dict:
    """{bucket: [samples, samples dropped, tokens, stale tokens, tokens dropped]} summed over the
    steps."""
    total: dict[int, list] = {}
    for row in rows:
        for bucket, counts in (row.get("stale_by_len") or {}).items():
            acc = total.setdefault(int(bucket), [0, 0, 0, 0, 0])
            for k, v in enumerate(counts):
                acc[k] += v
    return dict(sorted(total.items()))


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "max_new_tokens": 8})
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-lag", type=int, default=1)
    args = common.parse_args(p, argv)
    runs = {}
    with common.Bench("stale_bias", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for rule in RULES:
            run = common.run_train_cli(
                bench.work / rule,
                [
                    "--steps",
                    str(args.steps),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--max-lag",
                    str(args.max_lag),
                    "--stale-rule",
                    rule,
                    "--model",
                    model,
                    "--seed",
                    str(args.seed),
                    "--prompts-per-step",
                    "4",
                    "--group-size",
                    "2",
                    "--max-inflight-groups",
                    "32",
                    "--lr",
                    "1e-5",
                    "--eval-every",
                    "0",
                ],
            )
            buckets = census(run["rows"])
            s = run["summary"]
            runs[rule] = {
                "steps": len(run["rows"]),
                "wall_s": run["rows"][-1]["wall_s"],
                "max_token_lag": s["max_token_lag"],
                "dropped_stale": s["dropped_stale"],
                "reward_first10": s["reward_first10"],
                "reward_last20": s["reward_last20"],
                "masked_tokens": sum(r.get("stale_masked_tokens", 0) for r in run["rows"]),
                "buckets": {
                    str(b): {
                        "samples": c[0],
                        "dropped": c[1],
                        "tokens": c[2],
                        "stale_tokens": c[3],
                        "drop_rate": c[1] / c[0] if c[0] else None,
                        # left out of training: every token of a dropped sample, the stale
                        # tokens of a kept one (the rule "tokens" masks them)
                        "tokens_lost": c[4] + (c[3] if rule == "tokens" else 0),
                        "tokens_lost_share": (c[4] + (c[3] if rule == "tokens" else 0)) / c[2]
                        if c[2]
                        else None,
                    }
                    for b, c in buckets.items()
                },
            }
            print(
                f"[stale_bias] {rule}: {len(run['rows'])} steps, {s['dropped_stale']} samples "
                f"dropped, max token lag {s['max_token_lag']}",
                flush=True,
            )
    data = {
        "settings": {
            "steps": args.steps,
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "max_lag": args.max_lag,
            "update_mode": "inflight",
            "workload": "copy task, random-init tiny model, --max-new-tokens 48, --lr 1e-5, "
            "4 prompts x 2 per step, 32 groups in flight",
        },
        "rules": list(RULES),
        "runs": runs,
    }
    path = bench.save(data, plot)
    print()
    buckets = sorted({int(b) for rule in RULES for b in runs[rule]["buckets"]})
    hdr = ["length bucket (tokens)"] + [
        f"{rule}: {what}" for rule in RULES for what in ("samples", "drop rate", "tokens lost")
    ]
    table_rows = []
    for b in buckets:
        row = [f"{b}-{2 * b - 1}" if b > 1 else str(b)]
        for rule in RULES:
            e = runs[rule]["buckets"].get(str(b))
            row += [e["samples"], e["drop_rate"], e["tokens_lost_share"]] if e else [0, None, None]
        table_rows.append(row)
    print(common.table(hdr, table_rows))
    print("max token lag: " + ", ".join(f"{rule} {runs[rule]['max_token_lag']}" for rule in RULES))
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(1, 1, figsize=(7, 4))
    for rule, color in zip(data["rules"], ("#d62728", "#1f77b4")):
        b = data["runs"][rule]["buckets"]
        xs = sorted(int(k) for k in b)
        ax.plot(
            xs,
            [b[str(x)]["drop_rate"] for x in xs],
            marker="o",
            color=color,
            label=f"--stale-rule {rule}",
        )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="completion length bucket (model tokens)",
        ylabel="share of samples dropped as stale",
        title=f"stale drops by length (--max-lag {data['settings']['max_lag']}, in-flight swaps)",
    )
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "stale-drop length bias")


if __name__ == "__main__":
    sys.exit(main())
