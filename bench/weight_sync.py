"""bench/weight_sync.py — how long from the trainer publishing new weights to the generator serving
them?

    python bench/weight_sync.py --out DIR     # writes DIR/weight_sync.json and DIR/weight_sync.png
    python bench/weight_sync.py --smoke --out DIR   # the suite's size (tests/test_bench.py): the
    default tiny model
                                                    # (full and LoRA rows), 1M
                                                    cross-machine, --syncs 2 --gap-s 0.2

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

Cross-machine rows (`--cross-sizes`, default 10M,100M; `--cross-only`: these rows alone, no vLLM,
written to DIR/weight_sync_cross.json): remote.py's publish over gloo, measured by
bench/weight_sync_cross.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import engines  # noqa: E402
from weight_sync_cross import (  # noqa: E402
    cross_table,
    measure_cross_machine,
    memcpy_ms,
    plot_cross,
)

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)

# name -> (hidden, layers, heads); vocabulary 26, MLP 4x hidden, tied embeddings (head size 32 or
# 64)
SIZES = {"1M": (128, 4, 4), "10M": (256, 10, 4), "100M": (768, 11, 12), "300M": (1024, 18, 16)}
# tiny: the default model (the smoke's: its engine is the other smokes')
ALL_SIZES = {**SIZES, "tiny": None}


def _profile_load_in_worker():
    """Returns a function to run inside vLLM's worker (through collective_rpc): the steps of
    `WeightSyncWorker.load_shared_weights` (CPU path), timed one by one, and whether any of the
    engine's tensors shares memory with the shared buffer (it must not: the trainer writes
    there)."""

    def profile(worker):
        import time as _t

        import torch as _torch

        shared = worker._shared
        t0 = _t.perf_counter()
        version = shared.read_in_place(worker._reload_from)
        t1 = _t.perf_counter()
        worker._refresh_tied_lm_head()
        t2 = _t.perf_counter()
        start = shared.buffer.untyped_storage().data_ptr()
        end = start + shared.buffer.untyped_storage().nbytes()
        model = worker.model_runner.get_model()
        tensors = list(model.parameters()) + list(model.buffers())
        # also what the CPU kernels keep as plain attributes (packed weights)
        for module in model.modules():
            tensors += [v for v in vars(module).values() if isinstance(v, _torch.Tensor)]
        aliases = sum(start <= t.untyped_storage().data_ptr() < end for t in tensors)
        return {
            "reload_in_place_ms": (t1 - t0) * 1e3,
            "retie_head_ms": (t2 - t1) * 1e3,
            "torn": version is None,
            "engine_tensors_in_buffer": aliases,
            "engine_tensors": len(tensors),
            "snapshot_allocated": worker._snapshot is not None,
        }

    return profile


async def tmpfs_route(gen, model, config, base_model: str, versions, gap_s: float) -> list[dict]:
    """LoRA's alternative to the shared buffer, measured on the same engine: the trainer writes the
    adapter as a PEFT folder on tmpfs (/dev/shm), renamed into place per version (that is the
    consistency), and the generator pauses, has vLLM reload its adapter from the folder (`add_lora`
    with `load_inplace=True`), resets the prefix cache, sets the version and resumes: the
    shared-memory path's steps, with a file."""
    import torch
    from vllm.lora.request import LoRARequest

    import lora
    from lora import SERVED_ID

    engine, timings = gen.engine, []
    root = tempfile.mkdtemp(
        prefix="asyncgrpo-bench-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        for version in versions:
            await asyncio.sleep(gap_s)
            with torch.no_grad():
                for _, p in lora.synced_parameters(model):
                    p.add_(1e-4)
            t0 = time.perf_counter()
            state = {name: p.full_tensor() for name, p in lora.synced_parameters(model)}
            folder, tmp = os.path.join(root, f"v{version}"), os.path.join(root, f".tmp-v{version}")
            lora.save_adapter(state, config, base_model, tmp)
            os.rename(tmp, folder)
            t1 = time.perf_counter()
            await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            t2 = time.perf_counter()
            if not await engine.add_lora(
                LoRARequest("policy", SERVED_ID, folder, load_inplace=True)
            ):
                raise RuntimeError("vLLM did not reload the adapter from the file")
            t3 = time.perf_counter()
            await engine.reset_prefix_cache(reset_running_requests=True)
            await engine.update_weight_version(str(version))
            await engine.resume_generation()
            t4 = time.perf_counter()
            timings.append(
                {
                    "write_ms": (t1 - t0) * 1e3,
                    "pause_ms": (t2 - t1) * 1e3,
                    "load_ms": (t3 - t2) * 1e3,
                    "reset_resume_ms": (t4 - t3) * 1e3,
                    "sync_ms": (t4 - t0) * 1e3,
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return timings


def measure_size(
    name: str, shape: tuple, work: str, syncs: int, seed: int, gap_s: float, lora_rank: int = 0
) -> dict:
    """One model size, in its own process (it owns a vLLM engine). With `lora_rank`, the same model
    served with a LoRA adapter on every linear layer (alpha = 2 x rank): only the adapter is
    synced."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets the profiling step send a function
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    import devices
    import lora  # also without LoRA: lora.synced_parameters names what a full sync publishes
    import models
    import prepare
    import processes
    import sync
    from rollout import Generator

    t_build = time.perf_counter()
    sizes = {} if shape is None else dict(zip(("hidden", "layers", "heads"), shape))
    path = common.build_model(Path(work) / f"model_{name}", seed=seed, **sizes)
    build_s = time.perf_counter() - t_build
    if shape is None:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        shape = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads)
    hidden, layers, heads = shape
    cfg = common.default_config(
        model=path,
        max_lag=0,
        prompts_per_step=1,
        group_size=2,
        max_new_tokens=1,
        lora_rank=lora_rank,
    )
    torch.set_num_threads(cfg.train_threads)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    lora_config, lora_dir = None, ""
    if lora_rank:
        from shared_weights import SharedWeights

        lora_config = lora.peft_config(lora_rank, 2 * lora_rank, 0.0, "all-linear")
    model = models.build_trainer_model(path, 1, lora_config=lora_config, seed=seed)
    # as launch.run and trainer_main do: a buffer for the adapter, published once at the start
    if lora_rank:
        shapes, resolved = lora.adapter_shapes(path, lora_config)
        lora_dir = lora.write_config(
            resolved, path, str(Path(work) / f"adapter_config_{name}_r{lora_rank}")
        )
        shared = SharedWeights.allocate(shapes, starts_empty=True)
        sync.publish_model(model, shared, 0, 0, 1)
    else:
        shared = prepare.allocate_shared_weights(path)
    synced = [p for _, p in lora.synced_parameters(model)]
    base_params = sum(p.numel() for p in model.parameters()) - (
        sum(p.numel() for p in synced) if lora_rank else 0
    )
    params = sum(p.numel() for p in synced)
    nbytes = shared.buffer.numel() * shared.buffer.element_size()

    memcpy = memcpy_ms(shared.buffer)  # the same bytes, same process, same threads

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    control = processes.make_control(ctx)
    prepared = prepare.Prepared(path, path, devices.layout_for(cfg))
    gen = Generator(prepare.generator_settings(cfg, prepared, lora_dir), shared, queue, control)
    t_engine = time.perf_counter()
    engine, loop = engines.engine_for(gen), engines.event_loop()
    engine_s = time.perf_counter() - t_engine
    publish_ms, wall_ms = [], []

    async def scenario():
        task = asyncio.create_task(gen.run())
        while not control.ready.is_set():
            await asyncio.sleep(0.01)
        for version in range(1, syncs + 1):
            # an idle engine: the one-token request of the last version is done, and vLLM's
            # processes have stopped busy-polling their message queues (they spin for 1 s after each
            # message)
            await asyncio.sleep(gap_s)
            with torch.no_grad():
                for p in synced:
                    p.add_(1e-4)  # new values every version
            t0 = time.perf_counter()
            sync.publish_model(model, shared, version, 0, 1)
            t1 = time.perf_counter()
            while gen.loaded_version < version and not task.done():
                await asyncio.sleep(0.0005)
            wall_ms.append((time.perf_counter() - t1) * 1e3)
            publish_ms.append((t1 - t0) * 1e3)
        if lora_rank:
            files = await tmpfs_route(
                gen, model, resolved, path, range(syncs + 1, 2 * syncs + 1), gap_s
            )
            profile = []
        else:
            await asyncio.sleep(gap_s)
            files, profile = (
                [],
                [(await engine.collective_rpc(_profile_load_in_worker()))[0] for _ in range(3)],
            )
        control.stop.set()
        await task
        return profile, files

    try:
        profile, files = loop.run_until_complete(scenario())
        groups = []
        while True:
            try:
                groups.append(queue.get(timeout=1.0))
            except Exception:
                break
    finally:
        engines.release(engine, loop)
        gen.engine = engine = None  # no second shutdown from __del__ at exit
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)
    sync_ms = [ms for g in groups for ms in g.gen_stats.get("sync_ms", [])]
    parts = [p for g in groups for p in g.gen_stats.get("sync_parts", [])]
    if len(sync_ms) < syncs:
        raise RuntimeError(f"{len(sync_ms)} syncs reported by the generator, expected {syncs}")
    sync_ms, parts = sync_ms[:syncs], parts[:syncs]
    # the first load also warms up paths in the engine: report it, leave it out of the medians
    first = {"sync_ms": sync_ms[0], **parts[0]}
    sync_ms, parts, pub = sync_ms[1:], parts[1:], publish_ms[1:]
    med = statistics.median
    part = {k: med(p[k] for p in parts) for k in parts[0]}
    copy_ms, serve_ms = med(pub), med(sync_ms)
    total = copy_ms + serve_ms
    row = {}
    if profile:
        prof = {k: med(p[k] for p in profile) for k in ("reload_in_place_ms", "retie_head_ms")}
        prof.update(
            {
                k: max(p[k] for p in profile)
                for k in ("torn", "engine_tensors_in_buffer", "snapshot_allocated")
            }
        )
        prof["engine_tensors"] = profile[0]["engine_tensors"]
        row["load_profile"] = prof
    if lora_rank:
        name = f"{name} LoRA r{lora_rank}"
        files = files[1:]  # the first file load warms up too
        row["tmpfs_file"] = {
            **{k: med(f[k] for f in files) for k in files[0]},
            "samples": len(files),
        }
        # like for like: the shared-memory path without the time to notice a new version
        row["shm_sync_ms_without_detect"] = copy_ms + sum(part.values())
    return {
        **row,
        "name": name,
        "lora_rank": lora_rank,
        "base_params": base_params,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "params": params,
        "bytes": nbytes,
        "mb": nbytes / 2**20,
        "gather_ms": 0.0,
        "copy_ms": copy_ms,
        "publish_to_serving_ms": serve_ms,
        **part,
        "detect_ms": med(ms - sum(p.values()) for ms, p in zip(sync_ms, parts)),
        "sync_ms": total,
        "memcpy_ms": med(memcpy),
        "ratio": total / med(memcpy),
        "samples": len(sync_ms),
        "first_sync": first,
        "build_s": build_s,
        "engine_start_s": engine_s,
        "all_sync_ms": sync_ms,
        "all_copy_ms": pub,
    }


def main(argv=None) -> int:
    p = common.parser(
        __doc__,
        sizes=SIZES,
        smoke={
            "sizes": "tiny",
            "lora_sizes": "tiny",
            "cross_sizes": "1M",
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
        "--cross-only",
        action="store_true",
        help="only the cross-machine rows: DIR/weight_sync_cross.json",
    )
    args = common.parse_args(p, argv, sizes=ALL_SIZES)
    cross_sizes = [s.strip() for s in args.cross_sizes.split(",") if s.strip()]
    if any(s not in SIZES for s in cross_sizes):
        p.error(f"--cross-sizes: choose from {', '.join(SIZES)}")
    if args.cross_only:
        with common.Bench("weight_sync_cross", args) as bench:
            cross = [
                common.in_child(
                    measure_cross_machine,
                    n,
                    SIZES[n],
                    str(bench.work),
                    args.seed,
                    args.syncs + 1,
                    timeout_s=600,
                    what=f"cross-machine sync {n}",
                )
                for n in cross_sizes
            ]
        path = bench.save(
            {
                "settings": {
                    "sizes": cross_sizes,
                    "syncs": args.syncs,
                    "dtype": "float32",
                    "bucket_bytes": 64 * 2**20,
                },
                "cross_machine": cross,
            },
            plot_cross,
        )
        print(cross_table(cross))
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
                f"{row['sync_ms']:.1f} "
                f"ms (copy {row['copy_ms']:.1f} + publish->serving "
                f"{row['publish_to_serving_ms']:.1f}), memcpy "
                f"{row['memcpy_ms']:.2f} ms, ratio {row['ratio']:.1f} ({row['process_s']:.0f} s)",
                flush=True,
            )
        cross = [
            common.in_child(
                measure_cross_machine,
                n,
                SIZES[n],
                str(bench.work),
                args.seed,
                args.syncs + 1,
                timeout_s=600,
                what=f"cross-machine sync {n}",
            )
            for n in cross_sizes
        ]
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
        },
        "rows": rows,
        "cross_machine": cross,
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
    print(bench.closing_line(path))
    return 0


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
