"""bench/weight_sync.py — how long from the trainer publishing new weights to the generator serving them?

    python bench/weight_sync.py --out DIR     # writes DIR/weight_sync.json and DIR/weight_sync.png

For models of about 1M, 10M, 100M and 300M parameters (Qwen2 built from configs by the project's
`rollout.build_tiny_model`, random weights), each in its own process:
- the trainer side is the project's: an FSDP2 model (`train.build_trainer_model`, one rank) publishing into
  the packed shared buffer with `train.publish` (no gather: each rank writes its own rows);
- the generator side is the project's `rollout.Generator` with its real vLLM engine, running its own loop
  (`Generator.run`); it notices the new version, pauses, loads (`sync.WeightSyncWorker`), resets the prefix
  cache and resumes, and reports each part (`sync_parts`) and the publish-to-serving time (`sync_ms`).
  The engine has been idle for `--gap-s` seconds when a version lands (one one-token request per
  version), so this is the transfer itself: no decode step to wait for, and vLLM's processes no longer
  busy-poll (they do for 1 s after each message, and would compete with the trainer's copy for the cores).
- memcpy: a plain copy of the same bytes (one flat tensor into another), in the same process, same threads.
total = copy into the buffer + publish-to-serving; ratio = total / memcpy (goal: <= 2).
Then, on the idle engine, the load is split further inside the vLLM worker (`reload_weights` straight from
the shared buffer under the seqlock, then the re-tie of the head) to show where the time goes, and the
engine's tensors are checked to share no memory with the buffer (the trainer's later writes cannot reach it).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# name -> (hidden, layers, heads); vocabulary 26, MLP 4x hidden, tied embeddings (head size 32 or 64)
SIZES = {"1M": (128, 4, 4), "10M": (256, 10, 4), "100M": (768, 11, 12), "300M": (1024, 18, 16)}


def _profile_load_in_worker():
    """Returns a function to run inside vLLM's worker (through collective_rpc): the steps of
    `WeightSyncWorker.load_shared_weights` (CPU path), timed one by one, and whether any of the engine's
    tensors shares memory with the shared buffer (it must not: the trainer writes there)."""

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
        for module in model.modules():  # also what the CPU kernels keep as plain attributes (packed weights)
            tensors += [v for v in vars(module).values() if isinstance(v, _torch.Tensor)]
        aliases = sum(start <= t.untyped_storage().data_ptr() < end for t in tensors)
        return {"reload_in_place_ms": (t1 - t0) * 1e3, "retie_head_ms": (t2 - t1) * 1e3,
                "torn": version is None, "engine_tensors_in_buffer": aliases, "engine_tensors": len(tensors),
                "snapshot_allocated": worker._snapshot is not None}

    return profile


def measure_size(name: str, shape: tuple, work: str, syncs: int, seed: int, gap_s: float) -> dict:
    """One model size, in its own process (it owns a vLLM engine)."""
    import asyncio
    import os
    import tempfile

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets the profiling step send a function
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    import train
    from rollout import Generator

    hidden, layers, heads = shape
    t_build = time.perf_counter()
    path = common.build_model(Path(work) / f"model_{name}", seed=seed, hidden=hidden, layers=layers, heads=heads)
    build_s = time.perf_counter() - t_build
    cfg = common.default_config(model=path, max_lag=0, prompts_per_step=1, group_size=2, max_new_tokens=1)
    gen_threads, train_threads = train.split_threads(cfg)
    torch.set_num_threads(train_threads)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    model = train.build_trainer_model(path, 1)
    shared = train.allocate_shared_weights(path)
    params = sum(p.numel() for p in model.parameters())
    nbytes = shared.buffer.numel() * shared.buffer.element_size()

    # memcpy of the same bytes, same process, same threads
    dst = torch.empty_like(shared.buffer)
    dst.copy_(shared.buffer)
    memcpy = []
    for _ in range(7):
        t = time.perf_counter()
        dst.copy_(shared.buffer)
        memcpy.append((time.perf_counter() - t) * 1e3)
    del dst

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    control = train.make_control(ctx)
    gen = Generator(train.generator_settings(cfg, path, gen_threads), shared, queue, control)
    t_engine = time.perf_counter()
    engine = gen.build_engine()
    engine_s = time.perf_counter() - t_engine
    publish_ms, wall_ms = [], []

    async def scenario():
        task = asyncio.create_task(gen.run())
        while not control.ready.is_set():
            await asyncio.sleep(0.01)
        for version in range(1, syncs + 1):
            # an idle engine: the one-token request of the last version is done, and vLLM's processes have
            # stopped busy-polling their message queues (they spin for 1 s after each message)
            await asyncio.sleep(gap_s)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)  # new values every version
            t0 = time.perf_counter()
            train.publish(model, shared, version, 0, 1)
            t1 = time.perf_counter()
            while gen.loaded_version < version and not task.done():
                await asyncio.sleep(0.0005)
            wall_ms.append((time.perf_counter() - t1) * 1e3)
            publish_ms.append((t1 - t0) * 1e3)
        await asyncio.sleep(gap_s)
        profile = [(await engine.collective_rpc(_profile_load_in_worker()))[0] for _ in range(3)]
        control.stop.set()
        await task
        return profile

    try:
        profile = asyncio.run(scenario())
        groups = []
        while True:
            try:
                groups.append(queue.get(timeout=1.0))
            except Exception:
                break
    finally:
        engine.shutdown()
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
    prof = {k: med(p[k] for p in profile) for k in ("reload_in_place_ms", "retie_head_ms")}
    prof.update({k: max(p[k] for p in profile) for k in ("torn", "engine_tensors_in_buffer", "snapshot_allocated")})
    prof["engine_tensors"] = profile[0]["engine_tensors"]
    return {"name": name, "hidden": hidden, "layers": layers, "heads": heads, "params": params, "bytes": nbytes,
            "mb": nbytes / 2**20, "gather_ms": 0.0, "copy_ms": copy_ms, "publish_to_serving_ms": serve_ms,
            **part, "detect_ms": med(ms - sum(p.values()) for ms, p in zip(sync_ms, parts)), "sync_ms": total,
            "memcpy_ms": med(memcpy),
            "ratio": total / med(memcpy), "samples": len(sync_ms), "first_sync": first,
            "load_profile": prof, "build_s": build_s, "engine_start_s": engine_s,
            "all_sync_ms": sync_ms, "all_copy_ms": pub}


def main(argv=None) -> int:
    p = common.parser(__doc__, sizes=SIZES)
    p.add_argument("--syncs", type=int, default=6, help="weight updates per size (the first is left out)")
    p.add_argument("--gap-s", type=float, default=1.2, help="idle time before each update (vLLM's processes "
                                                            "busy-poll for 1 s after each message)")
    args = common.parse_args(p, argv, sizes=SIZES)
    rows = []
    with common.Bench("weight_sync", args) as bench:
        for name in args.sizes:
            t = time.perf_counter()
            row = common.in_child(measure_size, name, SIZES[name], str(bench.work), args.syncs + 1, args.seed,
                                  args.gap_s,
                                  timeout_s=600, what=f"weight sync {name}")
            row["process_s"] = time.perf_counter() - t
            rows.append(row)
            print(f"[weight_sync] {name}: {row['params'] / 1e6:.1f}M params, total {row['sync_ms']:.1f} ms "
                  f"(copy {row['copy_ms']:.1f} + publish->serving {row['publish_to_serving_ms']:.1f}), memcpy "
                  f"{row['memcpy_ms']:.1f} ms, ratio {row['ratio']:.1f} ({row['process_s']:.0f} s)", flush=True)
    data = {"settings": {"sizes": args.sizes, "syncs": args.syncs, "dtype": "float32", "train_ranks": 1,
                         "engine": f"idle for {args.gap_s} s when a version lands", "gap_s": args.gap_s},
            "rows": rows}
    path = bench.save(data, plot)
    print()
    print(common.table(
        ["size", "params", "MB", "copy in", "pause", "load", "reset", "resume", "detect", "total ms", "memcpy ms",
         "ratio"],
        [[r["name"], f"{r['params'] / 1e6:.1f}M", r["mb"], r["copy_ms"], r["pause_ms"], r["load_ms"], r["reset_ms"],
          r["resume_ms"], r["detect_ms"], r["sync_ms"], r["memcpy_ms"], r["ratio"]] for r in rows]))
    print()
    print(common.table(["size", "reload_weights from the buffer ms", "re-tie head ms", "memcpy ms",
                        "engine tensors in the buffer"],
                       [[r["name"], r["load_profile"]["reload_in_place_ms"], r["load_profile"]["retie_head_ms"],
                         r["memcpy_ms"], f"{r['load_profile']['engine_tensors_in_buffer']} of "
                                         f"{r['load_profile']['engine_tensors']}"] for r in rows],
                       title="inside the load (idle engine, timed in the vLLM worker):"))
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    rows = data["rows"]
    names = [f"{r['name']} ({r['mb']:.0f} MB)" for r in rows]
    parts = [("copy_ms", "copy into buffer (trainer)"), ("pause_ms", "pause"),
             ("load_ms", "load in engine (reload_weights)"), ("reset_ms", "prefix-cache reset"),
             ("resume_ms", "resume"), ("detect_ms", "notice the new version")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    left = [0.0] * len(rows)
    for key, label in parts:
        share = [max(0.0, r[key]) / r["sync_ms"] for r in rows]
        ax1.barh(names, share, left=left, label=label)
        left = [a + b for a, b in zip(left, share)]
    ax1.set_xlim(0, 1)
    ax1.invert_yaxis()
    ax1.set_xlabel("share of publish -> serving time")
    ax1.set_title("where the time goes")
    ax1.legend(fontsize=7, loc="lower right")
    x = [r["params"] for r in rows]
    ax2.plot(x, [r["sync_ms"] for r in rows], "o-", label="publish -> serving (measured)")
    ax2.plot(x, [r["memcpy_ms"] for r in rows], "k^-", label="memcpy of the same bytes")
    ax2.plot(x, [2 * r["memcpy_ms"] for r in rows], "r:", label="goal: 2 x memcpy")
    for r in rows:
        ax2.annotate(f"{r['ratio']:.0f}x" if r["ratio"] >= 10 else f"{r['ratio']:.1f}x", (r["params"], r["sync_ms"]),
                     textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("parameters")
    ax2.set_ylabel("ms (log)")
    ax2.set_title("total against memcpy (labels: ratio)")
    ax2.legend(fontsize=7)
    common.save_figure(fig, path, data, "weight sync")


if __name__ == "__main__":
    sys.exit(main())
