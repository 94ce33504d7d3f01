"""bench/generation.py — what does the generator cost on top of bare vLLM? Tokens/s, one
engine.

    python bench/generation.py --out DIR      # writes DIR/generator.json and DIR/generator.png
    # the suite's size (tests/test_bench.py): one round, 4 + 3 steps
    python bench/generation.py --smoke --out DIR

One vLLM engine, built by the project's own `rollout.Generator.build_engine` (same engine arguments,
same threads), serves these phases, interleaved for `--rounds` rounds (the order rotates from round
to round):
- bare: the engine's own `AsyncLLM.generate` on the same prompts (the built-in task, same seed),
  with the same sampling parameters (`Generator.sampling_params`: n = G, temperature, top-k/p,
  log-probs) and the same number of groups in flight (prompts per step); nothing else.
- pipeline: the project's generator loop (`Generator.run`: rewards, per-token versions, the
  staleness gate, groups put on a bounded multiprocessing queue) feeding a stand-in trainer in
  another process that takes each step's groups and republishes the weights, so the generator swaps
  weights once per step as in a run (pause, load, prefix-cache reset, resume).
- pipeline, no sync: the same without weight swaps (the generator's own overhead alone).
- pipeline, keep (long workload): the pipeline with `--kv-on-swap keep`: requests running at a swap
  go on with the old weights' KV cache instead of being re-prefilled (the pipeline phase is
  `recompute`, the default).
Both sides use the generator's sampling parameters, so on the built-in task (scored by token ids)
neither detokenizes (`detokenize=False`).
Two workloads share the engine: the default one (5 new tokens per completion, as `python train.py`)
and a long one (`--long-tokens`, 40 by default), where a step's generation lasts longer, so the
fixed part of a swap weighs less, but each swap preempts longer in-flight completions, which are
re-prefilled under the new weights (`reset_prefix_cache(reset_running_requests=True)`), or with keep
go on with their old cache. There the stand-in trainer publishes weights that differ per version
(bench/kv_swap.py: start weights + N(0, --kv-delta^2) per element, seeded by the version; about one
AdamW step at the default --lr), and the tokens each swapping phase sampled are scored under the
whole context and their version's weights, against their recorded behaviour log-probs: after a swap
inside their request, and in requests no swap reached (control). Rates are tokens/s over the steps
after the warm-up; ratio = pipeline / bare, each pipeline phase against the bare phase of its own
round (goal >= 0.90).

This file holds the options, the plan of workloads and phases, the medians and ratios, the tables
and the plot; the phases themselves, on one engine in a child process, are
bench/generator_phases.py.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kv_swap  # noqa: E402
from generator_phases import measure  # noqa: E402

PHASES = ("bare", "pipeline", "pipeline_nosync")
LABELS = {
    "bare": "bare vLLM",
    "pipeline": "pipeline (weight swap every step)",
    "pipeline_nosync": "pipeline, no weight swaps",
    "pipeline_keep": "pipeline, swaps, --kv-on-swap keep",
}


def summarize(runs: dict) -> dict:
    """Medians per phase; ratios per round (each phase against the bare phase of the same round)."""
    out = {}
    for phase, rates in runs.items():
        out[f"{phase}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rates)
        if phase != "bare":
            # same round
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rates, runs["bare"])]
            key = "ratio" + phase[len("pipeline") :]
            out[key] = statistics.median(ratios)
            out[key.replace("ratio", "ratios")] = ratios
        if rates[0].get("mismatch"):
            out[f"{phase}_mismatch"] = kv_swap.merge([r["mismatch"] for r in rates])
        if rates[0].get("sync_parts_median"):
            out[f"{phase}_sync_parts_median"] = {
                k: statistics.median(r["sync_parts_median"][k] for r in rates)
                for k in rates[0]["sync_parts_median"]
            }
    pipe = runs.get("pipeline", [])
    sync = [r for r in pipe if r.get("sync_ms_median") is not None]
    if sync:
        step_s = statistics.median(r["step_s_mean"] for r in pipe)
        out["pipeline_step_ms"] = step_s * 1e3
        out["bare_step_ms"] = statistics.median(r["step_s_mean"] for r in runs["bare"]) * 1e3
        out["sync_ms_median"] = statistics.median(r["sync_ms_median"] for r in sync)
        out["sync_share_of_step"] = out["sync_ms_median"] / 1e3 / step_s
        out["sync_parts_median"] = out["pipeline_sync_parts_median"]
    return out


def main(argv=None) -> int:
    p = common.parser(
        __doc__, smoke={"steps": 4, "warmup": 2, "long_tokens": 8, "long_steps": 3, "rounds": 1}
    )
    p.add_argument(
        "--steps", type=int, default=25, help="steps' worth of groups per phase (default workload)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="first steps of each phase left out (default workload)",
    )
    p.add_argument(
        "--long-tokens",
        type=int,
        default=40,
        help="new tokens per completion, long workload (0: skip)",
    )
    p.add_argument("--long-steps", type=int, default=10, help="steps per phase, long workload")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all phases")
    p.add_argument(
        "--kv-delta",
        type=float,
        default=3e-4,
        help="per-element std of version v's offset from the "
        "start weights, long workload (about one AdamW step at the default --lr)",
    )
    args = common.parse_args(p, argv)
    cfg = common.default_config()
    plan = [
        {
            "name": "default",
            "max_new_tokens": cfg.max_new_tokens,
            "steps": args.steps,
            "warmup": args.warmup,
            "phases": list(PHASES),
            "score": False,
        }
    ]
    if args.long_tokens:
        plan.append(
            {
                "name": "long",
                "max_new_tokens": args.long_tokens,
                "steps": args.long_steps,
                "warmup": 2,
                "phases": [*PHASES, "pipeline_keep"],
                "score": True,
                "kv_delta": args.kv_delta,
            }
        )
    with common.Bench("generator", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        res = common.in_child(
            measure,
            model,
            plan,
            args.rounds,
            args.seed,
            args.kv_delta,
            timeout_s=900,
            what="generator benchmark",
            in_session=True,
        )
    workloads = {
        w["name"]: {
            **{k: v for k, v in w.items() if k != "name"},
            **summarize(res["runs"][w["name"]]),
        }
        for w in plan
    }
    d = workloads["default"]
    data = {
        "settings": {
            "rounds": args.rounds,
            "seed": args.seed,
            "generator_threads": res["threads"],
            "workload": f"default task and tiny model; {cfg.prompts_per_step} prompts x "
            f"{cfg.group_size} completions in flight",
        },
        "ratio": d["ratio"],
        "ratio_nosync": d["ratio_nosync"],
        "bare_tokens_per_s": d["bare_tokens_per_s"],
        "pipeline_tokens_per_s": d["pipeline_tokens_per_s"],
        "workloads": workloads,
        "engine_start_s": res["engine_start_s"],
        "runs": res["runs"],
    }
    path = bench.save(data, plot)
    print()
    rows = []
    for w in plan:
        s = workloads[w["name"]]
        for phase in w["phases"]:
            key = "ratio" + phase[len("pipeline") :] if phase != "bare" else None
            rows.append(
                [
                    f"{w['name']} ({w['max_new_tokens']} new tokens)",
                    LABELS[phase],
                    s[f"{phase}_tokens_per_s"],
                    s[key] if key else 1.0,
                    " ".join(f"{x:.2f}" for x in s[key.replace("ratio", "ratios")]) if key else "-",
                ]
            )
    print(
        common.table(
            ["workload", "phase", "tokens/s (median)", "ratio to bare", "per-round ratios"], rows
        )
    )
    for w in plan:
        s = workloads[w["name"]]
        if s.get("sync_ms_median"):
            print(
                f"{w['name']}: a weight swap stalls the engine {s['sync_ms_median']:.0f} ms "
                f"(median; parts: "
                + ", ".join(
                    f"{k[:-3]} {v:.1f}"
                    for k, v in s["sync_parts_median"].items()
                    if k.endswith("_ms")
                )
                + f" ms) per {s['pipeline_step_ms']:.0f} ms step ({s['bare_step_ms']:.0f} ms bare)"
            )
    if "long" in workloads:
        print(kv_table(workloads["long"]))
    print(bench.closing_line(path))
    return 0


def kv_table(s: dict) -> str:
    """The long workload's two swapping phases side by side: rate, swap cost, log-prob mismatch."""
    rows = []
    for phase, mode in (("pipeline", "recompute"), ("pipeline_keep", "keep")):
        m, parts = s[f"{phase}_mismatch"], s[f"{phase}_sync_parts_median"]
        rows.append(
            [
                mode,
                s[f"{phase}_tokens_per_s"],
                s["ratio" + phase[len("pipeline") :]],
                parts["reset_ms"],
                parts["requests"],
                *(
                    f"{m[k]['mean']:.2e} / {m[k]['max']:.2e} ({m[k]['tokens']})"
                    for k in ("after_swap", "unswapped")
                ),
            ]
        )
    return common.table(
        [
            "--kv-on-swap",
            "tokens/s",
            "ratio to bare",
            "reset ms",
            "requests in flight per swap",
            "|diff| after a swap: mean / max (tokens)",
            "never swapped (control)",
        ],
        rows,
        title=f"long workload ({s['max_new_tokens']} new tokens), weights offset N(0, "
        f"{s['kv_delta']:g}^2) per version",
    )


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    names = list(data["workloads"])
    fig, axes = plt.subplots(
        1,
        len(names),
        figsize=(9, 4.2),
        squeeze=False,
        gridspec_kw={"width_ratios": [len(data["workloads"][n]["phases"]) for n in names]},
    )
    colors = {
        "bare": "#999999",
        "pipeline": "#1f77b4",
        "pipeline_nosync": "#aec7e8",
        "pipeline_keep": "#ff7f0e",
    }
    short = {
        "bare": "bare vLLM",
        "pipeline": "pipeline\n(swap every\nstep)",
        "pipeline_nosync": "pipeline\n(no swaps)",
        "pipeline_keep": "pipeline\n(swaps, kv\nkeep)",
    }
    for ax, name in zip(axes[0], names):
        w = data["workloads"][name]
        phases = w["phases"]
        for i, ph in enumerate(phases):
            vals = [r["tokens_per_s"] for r in data["runs"][name][ph]]
            ax.bar(i, statistics.median(vals), color=colors[ph])
            ax.plot([i] * len(vals), vals, "k.", ms=5)
            if ph != "bare":
                key = "ratio" + ph[len("pipeline") :]
                ax.text(
                    i,
                    statistics.median(vals),
                    f"{w[key]:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=9,
                )
            # the log-prob mismatch after a swap inside a request (kv_swap.py)
            if w.get(f"{ph}_mismatch"):
                ax.text(
                    i,
                    0,
                    f"|dlogp|\n{w[f'{ph}_mismatch']['after_swap']['mean']:.1e}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="white",
                )
        ax.set_xticks(range(len(phases)), [short[p] for p in phases], fontsize=8)
        ax.set_ylabel("generated tokens / s (dots: rounds)")
        ax.set_title(
            f"{name}: {w['max_new_tokens']} new tokens; pipeline / bare = {w['ratio']:.2f} (goal "
            f"0.90)",
            fontsize=9,
        )
    common.save_figure(fig, path, data, "generator overhead")


if __name__ == "__main__":
    sys.exit(main())
