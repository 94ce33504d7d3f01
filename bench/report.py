"""bench/report.py — one markdown page from the benchmarks' JSON files: the goals, met or not, and
the tables.

    python bench/report.py --out DIR         # reads DIR/*.json, writes DIR/summary.md and prints it

It has no size of its own (no --smoke): tests/test_bench.py runs it on what the other scripts'
smokes wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from generation import LABELS  # noqa: E402


def load(out: Path, name: str):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def yes(ok: bool) -> str:
    return "met" if ok else "**not met**"


def build(out: Path) -> str:
    ov, ws, gen, tr, ln = (
        load(out, n) for n in ("overlap", "weight_sync", "generator", "trainer", "learning")
    )
    lines = []
    machines = {
        common.machine_line(d["machine"]).rsplit(";", 1)[0] for d in (ov, ws, gen, tr, ln) if d
    }
    lines.append("Machine: " + "; ".join(sorted(machines)) + ".")
    noise = [
        f"{d['benchmark']} {d['load']['foreign_cores_mean']}" for d in (ov, ws, gen, tr, ln) if d
    ]
    lines.append(
        "Cores used by other people's processes during each benchmark (mean): "
        + ", ".join(noise)
        + "."
    )
    lines.append("")
    goals = []
    if ov:
        best = max(ov["modes"][1:], key=lambda m: ov[m]["share_of_bound"])
        goals.append(
            [
                "overlap: async speedup / bound (t_gen + t_train) / max",
                ">= 0.95",
                f"{ov[best]['share_of_bound']:.2f} ({best}: {ov[best]['speedup']:.2f}x of "
                f"{ov['bound']:.2f}x; {ov[best]['share_of_cpu_bound']:.2f} of what the CPUs allow, "
                f"{ov['cpu_bound']:.2f}x)",
                yes(ov[best]["share_of_bound"] >= 0.95),
            ]
        )
    if ws:
        full = [r for r in ws["rows"] if not r.get("lora_rank")]
        worst = max(full, key=lambda r: r["ratio"])
        best = min(full, key=lambda r: r["ratio"])
        goals.append(
            [
                "weight sync: publish -> serving / memcpy",
                "<= 2",
                f"{best['ratio']:.1f} ({best['name']}) to {worst['ratio']:.0f} ({worst['name']})",
                yes(worst["ratio"] <= 2),
            ]
        )
        for r in ws["rows"]:
            if r.get("lora_rank") and "ratio_to_full" in r:
                goals.append(
                    [
                        f"weight sync, {r['name']}: adapter only",
                        "(report)",
                        f"{r['mb']:.1f} MB, {r['sync_ms']:.1f} ms = {r['ratio_to_full']:.2f} of "
                        f"the full sync; tmpfs file {r['tmpfs_file']['sync_ms']:.1f} ms",
                        "-",
                    ]
                )
    if gen:
        w = gen["workloads"]
        txt = f"{gen['ratio']:.2f} (swap every step); {gen['ratio_nosync']:.2f} without swaps"
        if "long" in w:
            txt += (
                f"; {w['long']['ratio']:.2f} with {w['long']['max_new_tokens']}-token completions"
            )
        goals.append(
            ["generator: pipeline tokens/s / bare vLLM", ">= 0.90", txt, yes(gen["ratio"] >= 0.90)]
        )
    if tr:
        txt = ", ".join(
            f"{r['ratio']:.2f} ({r['name']}, {r['params'] / 1e6:.2f}M)" for r in tr["rows"]
        )
        goals.append(
            [
                "trainer: project tokens/s / bare FSDP2 loop",
                ">= 0.90",
                txt,
                yes(min(r["ratio"] for r in tr["rows"]) >= 0.90),
            ]
        )
    if ln:
        async_mode = ln["modes"][1]
        sp = ln["time_to_reward_speedup"].get("0.9")
        r = ln["runs"]
        txt = (
            f"to reward 0.9: sync {r['sync']['reach']['0.9']['wall_s'] or float('nan'):.0f} s, "
            f"{async_mode} {r[async_mode]['reach']['0.9']['wall_s'] or float('nan'):.0f} s"
            + (f" ({sp:.2f}x sooner)" if sp else "")
            + f"; reward over the last 10 steps {r['sync']['reward_final']:.3f} "
            f"vs {r[async_mode]['reward_final']:.3f}"
        )
        goals.append(
            [
                "learning: async reaches the same reward sooner",
                "yes",
                txt,
                yes(
                    bool(
                        sp
                        and sp > 1
                        and r[async_mode]["reward_final"] >= r["sync"]["reward_final"] - 0.02
                    )
                ),
            ]
        )
    lines.append(common.table(["benchmark", "goal", "measured", ""], goals))
    lines.append("")
    if ov:
        lines.append(
            f"**Overlap** (`overlap.json`): t_gen {ov['t_gen_s'] * 1e3:.0f} ms and t_train "
            f"{ov['t_train_s'] * 1e3:.0f} ms per step, each alone; bound {ov['bound']:.2f}x. "
            f"Alone, generation keeps {ov['gen_alone_cores']:.2f} cores busy and training "
            f"{ov['train_alone_cores']:.2f}, so {ov['machine']['cores']} cores allow at most "
            f"{ov['cpu_bound']:.2f}x."
        )
        lines.append("")
        lines.append(
            common.table(
                [
                    "mode",
                    "steps/s",
                    "speedup",
                    "share of bound",
                    "share of CPU bound",
                    "trainer waits",
                    "generator waits",
                ],
                [
                    [
                        f"{m} (--max-lag {ov[m]['max_lag']})",
                        ov[m]["steps_per_s"],
                        ov[m]["speedup"],
                        ov[m]["share_of_bound"],
                        ov[m]["share_of_cpu_bound"],
                        ov[m]["trainer_wait_frac"],
                        ov[m]["generator_wait_frac"],
                    ]
                    for m in ov["modes"]
                ],
            )
        )
        lines.append("")
    if ws:
        lines.append(
            "**Weight sync** (`weight_sync.json`, ms, engine idle when the version lands; the "
            "trainer copies its rows straight into the shared buffer, so there is no gather):"
        )
        lines.append("")
        lines.append(
            common.table(
                [
                    "row",
                    "params",
                    "MB",
                    "copy into buffer",
                    "pause",
                    "load in engine",
                    "prefix-cache reset",
                    "resume",
                    "total",
                    "memcpy",
                    "ratio",
                ],
                [
                    [
                        r["name"],
                        f"{r['params'] / 1e6:.1f}M",
                        r["mb"],
                        r["copy_ms"],
                        r["pause_ms"],
                        r["load_ms"],
                        r["reset_ms"],
                        r["resume_ms"],
                        r["sync_ms"],
                        r["memcpy_ms"],
                        r["ratio"],
                    ]
                    for r in ws["rows"]
                ],
            )
        )
        lines.append("")
    if gen:
        lines.append("**Generator** (`generator.json`, tokens/s, medians of rounds):")
        lines.append("")
        rows = []
        for name, w in gen["workloads"].items():
            for ph in w["phases"]:
                key = None if ph == "bare" else "ratio" + ph[len("pipeline") :]
                rows.append(
                    [
                        f"{name} ({w['max_new_tokens']} new tokens)",
                        LABELS.get(ph, ph),
                        w[f"{ph}_tokens_per_s"],
                        w[key] if key else 1.0,
                    ]
                )
        lines.append(common.table(["workload", "phase", "tokens/s", "ratio to bare"], rows))
        lines.append("")
    if tr:
        lines.append("**Trainer** (`trainer.json`, completion tokens/s):")
        lines.append("")
        lines.append(
            common.table(
                ["model", "bare FSDP2 loop", "project trainer", "ratio"],
                [
                    [
                        f"{r['name']} ({r['params'] / 1e6:.2f}M)",
                        r["bare_tokens_per_s"],
                        r["project_tokens_per_s"],
                        r["ratio"],
                    ]
                    for r in tr["rows"]
                ],
            )
        )
        lines.append("")
    if ln:
        lines.append("**Learning** (`learning.json`, same seed, same steps):")
        lines.append("")
        hdr = [
            "mode",
            "steps",
            "wall s",
            "reward first 10%",
            "last 20%",
            "last 10 steps",
            "reward 0.5 at",
            "0.8 at",
            "0.9 at",
        ]
        rows = []
        for m in ln["modes"]:
            r = ln["runs"][m]
            at = [
                f"{r['reach'][t]['wall_s']:.0f} s / step {r['reach'][t]['step']}"
                if r["reach"][t]["step"] is not None
                else "not reached"
                for t in ("0.5", "0.8", "0.9")
            ]
            rows.append(
                [
                    f"{m} (--max-lag {r['max_lag']})",
                    r["steps"],
                    r["wall_s"],
                    r["reward_first10"],
                    r["reward_last20"],
                    r["reward_final"],
                    *at,
                ]
            )
        lines.append(common.table(hdr, rows))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    text = build(Path(args.out))
    (Path(args.out) / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
