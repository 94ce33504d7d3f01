"""bench/weight_sync_measure.py — one size of bench/weight_sync.py, measured in its own process (it
owns a vLLM engine; in a smoke session, bench/machine.py's): the trainer side an FSDP2 model (one
rank) publishing into the packed shared buffer with `sync.publish_model`, the generator side the
project's `rollout.Generator` running its own loop on the real engine, and the plain memcpy of the
same bytes beside them; with a LoRA rank, only the adapter crosses, and the tmpfs-file route
(`tmpfs_route`) is measured on the same engine. Inside the vLLM worker, the load is profiled step by
step (`_profile_load_in_worker`). What is measured and why: bench/weight_sync.py's docstring.
Data: in, a size's name and (hidden, layers, heads), a scratch folder, the number of syncs, the
seed, the idle gap and the LoRA rank; out, one row of weight_sync.json (a dict of floats and lists).
It touches only its scratch folder, a temporary file for the process group, a /dev/shm folder it
deletes, and the engine it is given.
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
import machine  # noqa: E402
from weight_sync_cross import memcpy_ms  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)


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

    from trainer import lora
    from trainer.lora import SERVED_ID

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

    import sync
    from infra import devices, processes
    from rollout import Generator
    from run import prepare
    from trainer import (
        lora,  # also without LoRA: lora.synced_parameters names what a full sync publishes
        models,
    )

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
        from generator.shared_weights import SharedWeights

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
    engine, loop = machine.engine_for(gen), machine.event_loop()
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
        machine.release(engine, loop)
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
