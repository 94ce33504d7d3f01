"""bench/weight_sync.py — how long from the trainer publishing new weights to the generator serving
them?

    python bench/weight_sync.py --out DIR     # writes DIR/weight_sync.json and DIR/weight_sync.png
    # the suite's size (tests/test_bench.py): the default tiny model (full and LoRA rows), 1M
    # cross-machine, --syncs 2 --gap-s 0.2
    python bench/weight_sync.py --smoke --out DIR

For models of about 1M, 10M, 100M and 300M parameters (Qwen2 built from configs by the project's
`tasks/builtin.build_tiny_model`, random weights; also `tiny`, the default model, not in the default
list), each in its own process (the engine is bench/engines.py's: the smokes of tests/test_bench.py
share it):
- the trainer side is the project's: an FSDP2 model (`models.build_trainer_model`, one rank)
  publishing into the packed shared buffer with `sync.publish_model` (no gather: each rank writes
  its own rows);
- the generator side is the project's `rollout.Generator` with its real vLLM engine, running its own
  loop (`Generator.run`); it notices the new version, pauses, loads
  (`vllm_worker.WeightSyncWorker`), resets the prefix cache and resumes, and reports each part
  (`sync_parts`) and the publish-to-serving time (`sync_ms`). The engine has been idle for `--gap-s`
  seconds when a version lands (one one-token request per version), so this is the transfer itself:
  no decode step to wait for, and vLLM's processes no longer busy-poll (they do for 1 s after each
  message, and would compete with the trainer's copy for the cores).
- memcpy: a plain copy of the same bytes (one flat tensor into another), in the same process, same
  threads.
total = copy into the buffer + publish-to-serving; ratio = total / memcpy (goal: <= 2).
Then, on the idle engine, the load is split further inside the vLLM worker (`reload_weights`
straight from the shared buffer under the seqlock, then the re-tie of the head) to show where the
time goes, and the engine's tensors are checked to share no memory with the buffer (the trainer's
later writes cannot reach it).

LoRA rows (`--lora-sizes`, default 100M; rank `--lora-rank` 8 on every linear layer): the same model
served by vLLM with an adapter, the trainer a PEFT adapter under FSDP2; only the adapter crosses,
through the same buffer and seqlock (`vllm_worker.WeightSyncWorker.load_shared_adapter`). Reported
beside the full sync of that size (`ratio_to_full`), and against the alternative of a tmpfs file:
the adapter written as a PEFT folder under /dev/shm and reloaded by vLLM's own
`add_lora(load_inplace=True)` on the same engine (`tmpfs_file`).

Cross-machine rows (`--cross-sizes`, default 10M,100M): remote.py's publish over gloo, measured by
bench/weight_sync_cross.py. Publish rows (`--publish-sizes`, default 10M,100M): the trainer's
`sync.publish_model` at `--publish-ranks` (2) FSDP2 ranks over gloo, single writer (the gather a GPU
buffer and remote.py take) and many writers (the CPU shared buffer), each against the
per-parameter publish it replaced (issue 37), alternated in the same ranks, bytes compared.
`--cross-only`: these rows alone, no vLLM, written to DIR/weight_sync_cross.json.

This file holds the options, the order of the measurements, the tables and the plot; one size's
measurement (its own process and vLLM engine) is bench/weight_sync_measure.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from weight_sync_cross import (  # noqa: E402
    cross_table,
    measure_cross_machine,
    measure_publish,
    plot_cross,
    publish_table,
)
from weight_sync_measure import measure_size  # noqa: E402

# name -> (hidden, layers, heads); vocabulary 26, MLP 4x hidden, tied embeddings (head size 32 or
# 64)
SIZES = {"1M": (128, 4, 4), "10M": (256, 10, 4), "100M": (768, 11, 12), "300M": (1024, 18, 16)}
# tiny: the default model (the smoke's: its engine is the other smokes')
ALL_SIZES = {**SIZES, "tiny": None}


def main(argv=None) -> int:
    p = common.parser(
        __doc__,
        sizes=SIZES,
        smoke={
            "sizes": "tiny",
            "lora_sizes": "tiny",
            "cross_sizes": "1M",
            "publish_sizes": "1M",
            "syncs": 2,
            "gap_s": 0.2,
        },
    )
    p.add_argument(
        "--syncs", type=int, default=6, help="weight updates per size (the first is left out)"
    )
    p.add_argument(
        "--gap-s",
        type=float,
        default=1.2,
        help="idle time before each update (vLLM's processes busy-poll for 1 s after each message)",
    )
    p.add_argument(
        "--lora-sizes",
        default="100M",
        help="sizes that also get a LoRA row (adapter-only sync); '' for none",
    )
    p.add_argument(
        "--lora-rank", type=int, default=8, help="the LoRA rows' adapter rank (alpha = 2 x rank)"
    )
    p.add_argument(
        "--cross-sizes",
        default="10M,100M",
        help="sizes that also get a cross-machine row (gloo over loopback, no engine); '' for none",
    )
    p.add_argument(
        "--publish-sizes",
        default="10M,100M",
        help="sizes that also get a publish row (the trainer's publish at --publish-ranks gloo "
        "ranks against the per-parameter one it replaced, no engine); '' for none",
    )
    p.add_argument("--publish-ranks", type=int, default=2, help="the publish rows' trainer ranks")
    p.add_argument(
        "--cross-only",
        action="store_true",
        help="only the rows without an engine (cross-machine, publish): DIR/weight_sync_cross.json",
    )
    args = common.parse_args(p, argv, sizes=ALL_SIZES)
    cross_sizes = [s.strip() for s in args.cross_sizes.split(",") if s.strip()]
    publish_sizes = [s.strip() for s in args.publish_sizes.split(",") if s.strip()]
    if any(s not in SIZES for s in cross_sizes + publish_sizes):
        p.error(f"--cross-sizes, --publish-sizes: choose from {', '.join(SIZES)}")
    if args.cross_only:
        with common.Bench("weight_sync_cross", args) as bench:
            cross, publish = rows_without_engine(args, bench.work, cross_sizes, publish_sizes)
        path = bench.save(
            {
                "settings": {
                    "sizes": cross_sizes,
                    "syncs": args.syncs,
                    "dtype": "float32",
                    "bucket_bytes": 64 * 2**20,
                    "publish_sizes": publish_sizes,
                    "publish_ranks": args.publish_ranks,
                },
                "cross_machine": cross,
                "publish": publish,
            },
            plot_cross,
        )
        print(cross_table(cross))
        print()
        print(publish_table(publish))
        print(bench.closing_line(path))
        return 0
    lora_sizes = [s.strip() for s in args.lora_sizes.split(",") if s.strip()]
    if any(s not in ALL_SIZES for s in lora_sizes):
        p.error(f"--lora-sizes: choose from {', '.join(ALL_SIZES)}")
    rows = []
    with common.Bench("weight_sync", args) as bench:
        for name, rank in [(n, 0) for n in args.sizes] + [(n, args.lora_rank) for n in lora_sizes]:
            t = time.perf_counter()
            row = common.in_child(
                measure_size,
                name,
                ALL_SIZES[name],
                str(bench.work),
                args.syncs + 1,
                args.seed,
                args.gap_s,
                rank,
                timeout_s=600,
                what=f"weight sync {name}",
                in_session=True,
            )
            row["process_s"] = time.perf_counter() - t
            full = next((r for r in rows if r["name"] == name and not r["lora_rank"]), None)
            if rank and full is not None:
                row.update(
                    full_sync_ms=full["sync_ms"],
                    ratio_to_full=row["sync_ms"] / full["sync_ms"],
                    bytes_ratio_to_full=row["bytes"] / full["bytes"],
                )
            rows.append(row)
            print(
                f"[weight_sync] {row['name']}: {row['params'] / 1e6:.2f}M params synced, total "
                f"{row['sync_ms']:.1f} ms (copy {row['copy_ms']:.1f} + publish->serving "
                f"{row['publish_to_serving_ms']:.1f}), memcpy "
                f"{row['memcpy_ms']:.2f} ms, ratio {row['ratio']:.1f} ({row['process_s']:.0f} s)",
                flush=True,
            )
        cross, publish = rows_without_engine(args, bench.work, cross_sizes, publish_sizes)
    data = {
        "settings": {
            "sizes": args.sizes,
            "syncs": args.syncs,
            "dtype": "float32",
            "train_ranks": 1,
            "engine": f"idle for {args.gap_s} s when a version lands",
            "gap_s": args.gap_s,
            "lora_sizes": lora_sizes,
            "lora_rank": args.lora_rank,
            "lora_targets": "all-linear",
            "cross_sizes": cross_sizes,
            "publish_sizes": publish_sizes,
            "publish_ranks": args.publish_ranks,
        },
        "rows": rows,
        "cross_machine": cross,
        "publish": publish,
    }
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "size",
                "params",
                "MB",
                "copy in",
                "pause",
                "load",
                "reset",
                "resume",
                "detect",
                "total ms",
                "memcpy ms",
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
                    r["detect_ms"],
                    r["sync_ms"],
                    r["memcpy_ms"],
                    r["ratio"],
                ]
                for r in rows
            ],
        )
    )
    print()
    full_rows, lora_rows = (
        [r for r in rows if not r["lora_rank"]],
        [r for r in rows if r["lora_rank"]],
    )
    print(
        common.table(
            [
                "size",
                "reload_weights from the buffer ms",
                "re-tie head ms",
                "memcpy ms",
                "engine tensors in the buffer",
            ],
            [
                [
                    r["name"],
                    r["load_profile"]["reload_in_place_ms"],
                    r["load_profile"]["retie_head_ms"],
                    r["memcpy_ms"],
                    f"{r['load_profile']['engine_tensors_in_buffer']} of "
                    f"{r['load_profile']['engine_tensors']}",
                ]
                for r in full_rows
            ],
            title="inside the load (idle engine, timed in the vLLM worker):",
        )
    )
    if lora_rows:
        print()
        print(
            common.table(
                [
                    "LoRA row",
                    "adapter MB",
                    "full MB",
                    "sync ms",
                    "full sync ms",
                    "LoRA / full",
                    "shm (no detect) ms",
                    "tmpfs file ms",
                    "file: write",
                    "file: pause",
                    "file: vLLM load",
                    "file: reset+resume",
                ],
                [
                    [
                        r["name"],
                        r["mb"],
                        r["mb"] / r.get("bytes_ratio_to_full", float("nan")),
                        r["sync_ms"],
                        r.get("full_sync_ms", float("nan")),
                        r.get("ratio_to_full", float("nan")),
                        r["shm_sync_ms_without_detect"],
                        r["tmpfs_file"]["sync_ms"],
                        r["tmpfs_file"]["write_ms"],
                        r["tmpfs_file"]["pause_ms"],
                        r["tmpfs_file"]["load_ms"],
                        r["tmpfs_file"]["reset_resume_ms"],
                    ]
                    for r in lora_rows
                ],
                title="LoRA: only the adapter crosses; shared memory (the project's path) against "
                "a tmpfs file:",
            )
        )
    if cross:
        print()
        print(cross_table(cross))
    if publish:
        print()
        print(publish_table(publish))
    print(bench.closing_line(path))
    return 0


def rows_without_engine(args, work, cross_sizes, publish_sizes) -> tuple[list, list]:
    """The cross-machine rows and the publish rows, each size in a child process of its own."""
    cross = [
        common.in_child(
            measure_cross_machine,
            n,
            SIZES[n],
            str(work),
            args.seed,
            args.syncs + 1,
            timeout_s=600,
            what=f"cross-machine sync {n}",
        )
        for n in cross_sizes
    ]
    publish = [
        common.in_child(
            measure_publish,
            n,
            SIZES[n],
            str(work),
            args.seed,
            args.syncs + 1,
            args.publish_ranks,
            timeout_s=600,
            what=f"publish {n} at {args.publish_ranks} ranks",
        )
        for n in publish_sizes
    ]
    return cross, publish


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    rows = data["rows"]
    names = [f"{r['name']} ({r['mb']:.0f} MB)" for r in rows]
    parts = [
        ("copy_ms", "copy into buffer (trainer)"),
        ("pause_ms", "pause"),
        ("load_ms", "load in engine (reload_weights)"),
        ("reset_ms", "prefix-cache reset"),
        ("resume_ms", "resume"),
        ("detect_ms", "notice the new version"),
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    left = [0.0] * len(rows)
    for key, label in parts:
        share = [max(0.0, r[key]) / r["sync_ms"] for r in rows]
        ax1.barh(names, share, left=left, label=label)
        left = [a + b for a, b in zip(left, share)]
    ax1.set_xlim(0, 1)
    ax1.invert_yaxis()
    ax1.set_xlabel("share of publish -> serving time")
    ax1.set_title("where the time goes")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    full = [r for r in rows if not r.get("lora_rank")]
    x = [r["params"] for r in full]
    ax2.plot(x, [r["sync_ms"] for r in full], "o-", label="publish -> serving (measured)")
    ax2.plot(x, [r["memcpy_ms"] for r in full], "k^-", label="memcpy of the same bytes")
    ax2.plot(x, [2 * r["memcpy_ms"] for r in full], "r:", label="goal: 2 x memcpy")
    for r in rows:
        if r.get("lora_rank"):
            ax2.plot(
                [r["params"]],
                [r["sync_ms"]],
                "g*",
                markersize=10,
                label=f"{r['name']} (adapter only)",
            )
        ax2.annotate(
            f"{r['ratio']:.0f}x" if r["ratio"] >= 10 else f"{r['ratio']:.1f}x",
            (r["params"], r["sync_ms"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("parameters")
    ax2.set_ylabel("ms (log)")
    ax2.set_title("total against memcpy (labels: ratio)")
    ax2.legend(fontsize=7)
    common.save_figure(fig, path, data, "weight sync")


if __name__ == "__main__":
    sys.exit(main())
