"""bench/weight_sync.py — how long from the trainer publishing new weights to the generator serving
them?

    python bench/weight_sync.py --out DIR      # DIR/weight_sync.json and .png
    python bench/weight_sync.py --cross-only --out DIR   # no engine: DIR/weight_sync_cross.json
    python bench/weight_sync.py --smoke --out DIR        # the suite's size (tests/test_bench.py)

Each size (random-weight Qwen2) in its own process: an FSDP2 trainer publishes into the shared
buffer (`sync.publish_model`) while `rollout.Generator` runs on a real vLLM engine, idle
`--gap-s` when a version lands. A row: copy in + publish-to-serving (`sync_ms`, in parts) against a
memcpy of the bytes (`ratio`; goal <= 2), the load timed in the worker (`load_profile`). LoRA rows:
the adapter alone, against the full row and a tmpfs folder reloaded by vLLM's `add_lora`
(`tmpfs_file`). No engine: cross-machine rows (remote.py's buckets over gloo) and publish rows
(`sync.publish_model` at N ranks against the per-parameter publish it replaced, issue 37).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from statistics import median as med
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import machine  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import sync  # noqa: E402  (the project's, on sys.path through common; vLLM loads with an engine)
from generator.shared_weights import SharedWeights  # noqa: E402
from infra import devices, processes  # noqa: E402
from rollout import Generator  # noqa: E402
from run import link, prepare, remote  # noqa: E402
from trainer import lora, models  # noqa: E402

# name -> (hidden, layers, heads); vocabulary 26, MLP 4x hidden, tied embeddings
SIZES = {"1M": (128, 4, 4), "10M": (256, 10, 4), "100M": (768, 11, 12), "300M": (1024, 18, 16)}
ALL_SIZES = {**SIZES, "tiny": None}  # tiny: the default model (the smoke's, the other smokes')
SMOKE = {"sizes": "tiny", "lora_sizes": "tiny", "cross_sizes": "1M", "publish_sizes": "1M"}


@dataclass
class Job:
    """One row's measurement, as a child process receives it."""

    name: str
    shape: tuple | None  # (hidden, layers, heads); None: the default model's
    work: str  # the scratch folder
    seed: int
    syncs: int  # versions published (the first is left out of the medians)
    gap_s: float = 0.0  # the engine's idle time before each version
    lora_rank: int = 0  # > 0: only an adapter of this rank crosses
    ranks: int = 1  # the publish rows' trainer ranks

    def model(self) -> str:
        sizes = {} if self.shape is None else dict(zip(("hidden", "layers", "heads"), self.shape))
        return common.build_model(Path(self.work) / f"model_{self.name}", self.seed, **sizes)


def options(argv):
    p = common.parser(__doc__, sizes=SIZES, smoke={**SMOKE, "syncs": 2, "gap_s": 0.2})
    add = p.add_argument
    add("--syncs", type=int, default=6, help="weight updates per size (the first is left out)")
    add("--gap-s", type=float, default=1.2, help="idle s before each (vLLM polls for 1 s)")
    add("--lora-sizes", default="100M", help="sizes that also get a LoRA row; '' for none")
    add("--lora-rank", type=int, default=8, help="the LoRA rows' rank (alpha = 2 x rank)")
    add("--cross-sizes", default="10M,100M", help="sizes with a cross-machine row; '' for none")
    add("--publish-sizes", default="10M,100M", help="sizes with a publish row; '' for none")
    add("--publish-ranks", type=int, default=2, help="the publish rows' trainer ranks")
    add("--cross-only", action="store_true", help="only the rows without an engine")
    args = common.parse_args(p, argv, sizes=ALL_SIZES)
    for key in ("cross_sizes", "publish_sizes", "lora_sizes"):
        allowed = ALL_SIZES if key == "lora_sizes" else SIZES
        setattr(args, key, [s.strip() for s in getattr(args, key).split(",") if s.strip()])
        if any(s not in allowed for s in getattr(args, key)):
            p.error(f"--{key.replace('_', '-')}: choose from {', '.join(allowed)}")
    return args


def main(argv=None) -> int:
    args = options(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "work", "smoke")}
    settings.update(dtype="float32", train_ranks=1, lora_targets="all-linear", bucket_bytes=2**26)
    settings["sizes"] = args.cross_sizes if args.cross_only else args.sizes
    with common.Bench("weight_sync_cross" if args.cross_only else "weight_sync", args) as bench:
        data = {"settings": settings, **({} if args.cross_only else engine_rows(args, bench.work))}
        work, syncs, ranks = str(bench.work), args.syncs + 1, args.publish_ranks
        job = {n: Job(n, SIZES[n], work, args.seed, syncs, ranks=ranks) for n in SIZES}
        for key, measure in (
            ("cross_machine", measure_cross_machine),
            ("publish", measure_publish),
        ):
            sizes = args.cross_sizes if key == "cross_machine" else args.publish_sizes
            data[key] = [common.in_child(measure, job[n], what=f"{key} {n}") for n in sizes]
    path = bench.save(data, plot)
    print_tables(data.get("rows", []), data["cross_machine"], data["publish"])
    print(bench.closing_line(path))
    return 0


def engine_rows(args, work) -> dict:
    """{"rows": each size's full row, then the LoRA rows (beside the full), a process each."""
    rows = []
    for name, rank in [(n, 0) for n in args.sizes] + [(n, args.lora_rank) for n in args.lora_sizes]:
        t = time.perf_counter()
        job = Job(name, ALL_SIZES[name], str(work), args.seed, args.syncs + 1, args.gap_s, rank)
        row = common.in_child(measure_size, job, what=f"weight sync {name}", in_session=True)
        row["process_s"] = time.perf_counter() - t
        full = next((r for r in rows if r["name"] == name and not r["lora_rank"]), None)
        if rank and full is not None:
            row.update(full_sync_ms=full["sync_ms"], ratio_to_full=row["sync_ms"] / full["sync_ms"])
            row["bytes_ratio_to_full"] = row["bytes"] / full["bytes"]
        rows.append(row)
        shown = " ".join(f"{k} {common.fmt(row[k])}" for k in ("copy_ms", "sync_ms", "ratio"))
        print(f"[weight_sync] {row['name']}: {shown} ({row['process_s']:.0f} s)", flush=True)
    return {"rows": rows}


TABLES = {  # the tables printed: {rows: "columns | title"}
    "rows": "name params mb copy_ms pause_ms load_ms reset_ms resume_ms detect_ms sync_ms"
    " memcpy_ms ratio | publish -> serving in parts (ms), against a memcpy of the same bytes:",
    "full": "name reload_in_place_ms retie_head_ms memcpy_ms engine_tensors_in_buffer"
    " engine_tensors | inside the load (idle engine, timed in the vLLM worker):",
    "lora": "name mb sync_ms full_sync_ms ratio_to_full shm_sync_ms_without_detect file_sync_ms"
    " file_write_ms file_pause_ms file_load_ms file_reset_resume_ms | LoRA: only the adapter"
    " crosses; shared memory (the project's path) against a tmpfs file:",
    "cross": "name mb memcpy_ms shm_publish_ms cross_ms cross_send_ms shm_over_memcpy"
    " cross_over_memcpy cross_over_shm | across machines (remote.py, gloo over loopback):",
    "publish": "name ranks tensors mb memcpy_ms single_old_ms single_new_ms single_new_over_old"
    " multi_old_ms multi_new_ms multi_new_over_old same | the trainer's publish on CPU (gloo),"
    " sync.publish_model (new) against the per-parameter one (old), alternated in the same ranks:",
}


def print_tables(rows: list[dict], cross: list[dict], publish: list[dict]) -> None:
    full = [{**r, **r["load_profile"]} for r in rows if not r["lora_rank"]]
    lora = [
        {**r, **{f"file_{k}": v for k, v in r["tmpfs_file"].items()}} for r in rows[len(full) :]
    ]
    same = [{**r, "same": all(r["same_bytes"].values())} for r in publish]
    groups = {"rows": rows, "full": full, "lora": lora, "cross": cross, "publish": same}
    for group, spec in TABLES.items():
        if groups[group]:
            print(common.table_of(groups[group], *spec.split(" | ")), end="\n\n")


def plot(data: dict, path: Path) -> None:
    """One figure: each row's syncs (ms, the first left out) beside the memcpy of its bytes."""
    values = {}
    for r in data.get("rows", []):
        values[r["name"]] = [c + s for c, s in zip(r["all_copy_ms"], r["all_sync_ms"])]
        values[f"{r['name']} memcpy"] = [r["memcpy_ms"]]
    for r in data["cross_machine"]:
        values[f"{r['name']} gloo"] = r["all_cross_ms"]
        values[f"{r['name']} shm"] = [r["shm_publish_ms"]]
    common.bars(data, path, "weight sync", values, ylabel="ms (log)", log=True)


def measure_size(job: Job) -> dict:
    """One size's row, in a process of its own (it owns an engine; in a session, machine.py's)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets the profiling step send a function
    with machine.one_rank():
        side = trainer_side(job)
        groups, profile, files, publish_ms = engine_syncs(side, job.syncs, job.gap_s)
    return size_row(side, groups, profile, files, publish_ms, job.syncs)


def trainer_side(job: Job) -> SimpleNamespace:
    """The model, its FSDP2 trainer, the shared buffer (an adapter's published once, as a run)."""
    t_build = time.perf_counter()
    path, rank, shape = job.model(), job.lora_rank, job.shape
    s = SimpleNamespace(name=job.name, build_s=time.perf_counter() - t_build, lora_dir="")
    if shape is None:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        shape = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads)
    s.path, s.shape, s.lora_rank = path, shape, rank
    small = dict(max_lag=0, prompts_per_step=1, group_size=2, max_new_tokens=1)
    s.cfg = common.default_config(model=path, lora_rank=rank, **small)
    torch.set_num_threads(s.cfg.train_threads)
    lora_config = lora.peft_config(rank, 2 * rank, 0.0, "all-linear") if rank else None
    s.model = models.build_trainer_model(path, 1, lora_config=lora_config, seed=job.seed)
    if rank:
        shapes, s.resolved = lora.adapter_shapes(path, lora_config)
        folder = str(Path(job.work) / f"adapter_config_{job.name}_r{rank}")
        s.lora_dir = lora.write_config(s.resolved, path, folder)
        s.shared = SharedWeights.allocate(shapes, starts_empty=True)
        sync.publish_model(s.model, s.shared, 0, 0, 1)
    else:
        s.shared = prepare.allocate_shared_weights(path)
    s.synced = [p for _, p in lora.synced_parameters(s.model)]  # what a full sync publishes too
    s.params = sum(p.numel() for p in s.synced)
    s.base_params = sum(p.numel() for p in s.model.parameters()) - (s.params if rank else 0)
    s.memcpy = machine.memcpy_ms(s.shared.buffer)  # the same bytes, same process, same threads
    return s


def engine_syncs(s, syncs: int, gap_s: float):
    """`syncs` versions published to the generator, then the tmpfs route (LoRA) or the load
    profiled: the groups it queued (counters: the syncs' times), the profile, the files, copies."""
    ctx = mp.get_context("spawn")
    queue, control = ctx.Queue(), processes.make_control(ctx)
    prepared = prepare.Prepared(s.path, s.path, devices.layout_for(s.cfg))
    settings = prepare.generator_settings(s.cfg, prepared, s.lora_dir)
    gen = Generator(settings, s.shared, queue, control)
    t_engine = time.perf_counter()
    engine, loop = machine.engine_for(gen), machine.event_loop()
    s.engine_s, publish_ms = time.perf_counter() - t_engine, []

    async def scenario():
        task = asyncio.create_task(gen.run())
        while not control.ready.is_set():
            await asyncio.sleep(0.01)
        for version in range(1, syncs + 1):
            await asyncio.sleep(gap_s)  # an idle engine, its processes no longer busy-polling
            nudge(s.synced)
            t0 = time.perf_counter()
            sync.publish_model(s.model, s.shared, version, 0, 1)
            publish_ms.append((time.perf_counter() - t0) * 1e3)
            while gen.loaded_version < version and not task.done():
                await asyncio.sleep(0.0005)
        profile, files = [], []
        if s.lora_rank:
            files = await tmpfs_route(gen, s, range(syncs + 1, 2 * syncs + 1), gap_s)
        else:
            await asyncio.sleep(gap_s)
            profile = [(await engine.collective_rpc(profile_load()))[0] for _ in range(3)]
        control.stop.set()
        await task
        return profile, files

    try:
        profile, files = loop.run_until_complete(scenario())
        groups = []
        with contextlib.suppress(Exception):  # (until the queue stays empty for a second)
            while True:
                groups.append(queue.get(timeout=1.0))
    finally:
        machine.release(engine, loop)
        gen.engine = engine = None  # no second shutdown from __del__ at exit
    return groups, profile, files, publish_ms


@torch.no_grad()
def nudge(params) -> None:
    for p in params:
        p.add_(1e-4)  # new values every version


def size_row(s, groups, profile, files, publish_ms, syncs) -> dict:
    """Medians of the syncs after the first (it warms up paths in the engine: reported apart)."""
    sync_ms = [ms for g in groups for ms in g.gen_stats.get("sync_ms", [])]
    parts = [p for g in groups for p in g.gen_stats.get("sync_parts", [])]
    if len(sync_ms) < syncs:
        raise RuntimeError(f"{len(sync_ms)} syncs reported by the generator, expected {syncs}")
    first = {"sync_ms": sync_ms[0], **parts[0]}
    sync_ms, parts, pub = sync_ms[1:syncs], parts[1:syncs], publish_ms[1:]
    part = {k: med(p[k] for p in parts) for k in parts[0]}
    copy_ms, serve_ms, memcpy = med(pub), med(sync_ms), med(s.memcpy)
    row, name = {}, s.name
    if profile:
        prof = {k: med(p[k] for p in profile) for k in ("reload_in_place_ms", "retie_head_ms")}
        for k in ("torn", "engine_tensors_in_buffer", "snapshot_allocated"):
            prof[k] = max(p[k] for p in profile)
        row["load_profile"] = {**prof, "engine_tensors": profile[0]["engine_tensors"]}
    if s.lora_rank:
        name, files = f"{name} LoRA r{s.lora_rank}", files[1:]  # the first file load warms up too
        row["tmpfs_file"] = {k: med(f[k] for f in files) for k in files[0]}
        row["tmpfs_file"]["samples"] = len(files)
        # like for like: the shared-memory path without the time to notice a new version
        row["shm_sync_ms_without_detect"] = copy_ms + sum(part.values())
    nbytes = s.shared.buffer.numel() * s.shared.buffer.element_size()
    return {
        **row,
        **dict(name=name, lora_rank=s.lora_rank, base_params=s.base_params),
        **dict(zip(("hidden", "layers", "heads"), s.shape), params=s.params),
        **dict(bytes=nbytes, mb=nbytes / 2**20),
        **dict(gather_ms=0.0, copy_ms=copy_ms, publish_to_serving_ms=serve_ms, **part),
        "detect_ms": med(ms - sum(p.values()) for ms, p in zip(sync_ms, parts)),
        **dict(sync_ms=copy_ms + serve_ms, memcpy_ms=memcpy, ratio=(copy_ms + serve_ms) / memcpy),
        **dict(samples=len(sync_ms), first_sync=first, build_s=s.build_s),
        **dict(engine_start_s=s.engine_s, all_sync_ms=sync_ms, all_copy_ms=pub),
    }


def profile_load():
    """For vLLM's worker (collective_rpc; a closure: sent by value): `load_shared_weights`'s steps
    timed, and whether an engine tensor shares the buffer's memory (it must not)."""

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
        for module in model.modules():  # also what the CPU kernels keep as attributes
            tensors += [v for v in vars(module).values() if isinstance(v, _torch.Tensor)]
        aliases = sum(start <= t.untyped_storage().data_ptr() < end for t in tensors)
        out = dict(reload_in_place_ms=(t1 - t0) * 1e3, retie_head_ms=(t2 - t1) * 1e3)
        out.update(torn=version is None, snapshot_allocated=worker._snapshot is not None)
        return dict(out, engine_tensors_in_buffer=aliases, engine_tensors=len(tensors))

    return profile


async def tmpfs_route(gen, s, versions, gap_s: float) -> list[dict]:
    """LoRA's alternative: the adapter as a PEFT folder on /dev/shm (renamed into place), then the
    shared-memory path's steps with vLLM's `add_lora(load_inplace=True)` as the load."""
    from vllm.lora.request import LoRARequest

    engine, timings = gen.engine, []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="asyncgrpo-bench-lora-", dir=shm)
    try:
        for version in versions:
            await asyncio.sleep(gap_s)
            nudge(s.synced)
            t0 = time.perf_counter()
            state = {name: p.full_tensor() for name, p in lora.synced_parameters(s.model)}
            folder, tmp = os.path.join(root, f"v{version}"), os.path.join(root, f".tmp-v{version}")
            lora.save_adapter(state, s.resolved, s.path, tmp)
            os.rename(tmp, folder)
            t1 = time.perf_counter()
            await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            t2 = time.perf_counter()
            request = LoRARequest("policy", lora.SERVED_ID, folder, load_inplace=True)
            if not await engine.add_lora(request):
                raise RuntimeError("vLLM did not reload the adapter from the file")
            t3 = time.perf_counter()
            await engine.reset_prefix_cache(reset_running_requests=True)
            await engine.update_weight_version(str(version))
            await engine.resume_generation()
            t4 = time.perf_counter()
            ms = [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4))]
            keys = ("write_ms", "pause_ms", "load_ms", "reset_resume_ms", "sync_ms")
            timings.append(dict(zip(keys, ms)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return timings


def measure_cross_machine(job: Job) -> dict:
    """One size's cross-machine row: memcpy, the one-node publish, and remote.py's (gathered into
    `RemoteWeights`, bucketed over gloo to a stand-in generator node, timed to its `end_write`)."""
    path = job.model()
    torch.set_num_threads(common.default_config(model=path).train_threads)
    with machine.one_rank():
        model = models.build_trainer_model(path, 1)
        shared = prepare.allocate_shared_weights(path)  # the one-node path
        memcpy, shm = machine.memcpy_ms(shared.buffer), []
        for version in range(1, job.syncs + 1):
            t = time.perf_counter()
            sync.publish_model(model, shared, version, 0, 1)
            shm.append((time.perf_counter() - t) * 1e3)
        cross, sends, equal = publish_across(model, shared, job.syncs)
    cross, sends, shm = cross[1:], sends[1:], shm[1:]  # the first of each warms up
    c, m, s = med(cross), med(memcpy), med(shm)
    return {
        **dict(name=job.name, params=sum(sl.numel for sl in shared.layout)),
        **dict(bytes=shared.nbytes, mb=shared.nbytes / 2**20, memcpy_ms=m, shm_publish_ms=s),
        **dict(cross_ms=c, cross_send_ms=med(sends), cross_copy_ms=c - med(sends)),
        **dict(cross_over_memcpy=c / m, cross_over_shm=c / s, shm_over_memcpy=s / m),
        **dict(same_bytes=equal, samples=len(cross), all_cross_ms=cross),
    }


def publish_across(model, shared, syncs: int):
    """`syncs` publishes over loopback: the times, their send part, and the same bytes or not."""
    ctx, port = mp.get_context("spawn"), machine.free_port()
    results, layout = ctx.Queue(), [(sl.name, sl.shape) for sl in shared.layout]
    receiver = ctx.Process(target=cross_receiver, args=(port, layout, shared.dtype, syncs, results))
    receiver.start()
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=120))
        group = link.weight_group(store, 0, torch.device("cpu"), 120)
        sends, cross = [], []

        def send(version, flat):  # remote.TrainerLink.send_weights, without the message link
            t = time.perf_counter()
            link.send_weights(group, flat)
            sends.append((time.perf_counter() - t) * 1e3)

        sink = remote.RemoteWeights(shared.layout, shared.dtype, SimpleNamespace(send_weights=send))
        for version in range(1, syncs + 1):
            start = time.time_ns()
            sync.publish_model(model, sink, version, 0, 1)
            got, end_ns = results.get(timeout=120)
            assert got == version
            cross.append((end_ns - start) / 1e6)
        equal = torch.equal(sink.buffer, shared.buffer)
        receiver.join(timeout=60)
    finally:
        receiver.kill()
    return cross, sends, equal


def cross_receiver(port: int, shapes, dtype, versions: int, results) -> None:
    """The generator node's side: receive `versions` publishes into its own packed buffer."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=120))
    group = link.weight_group(store, 1, torch.device("cpu"), 120)
    shared = SharedWeights.allocate(shapes, dtype=dtype)
    for version in range(1, versions + 1):
        link.receive_weights(group, shared, version)
        results.put((version, shared.publish_time_ns()))


def publish_per_parameter(model, shared, version, rank, world_size):
    """sync.publish_model as it was before issue 37 (d5365e1), the publish rows' baseline: one
    parameter at a time, gathered (single writer) or written from each rank's rows (many)."""
    many = not shared.single_writer and world_size > 1
    if rank == 0:
        shared.begin_write()
    if many:
        dist.barrier()
    with torch.no_grad():
        for slot, param in zip(shared.layout, sync.trainable_parameters(model)):
            if shared.single_writer:
                full = param.detach().to(shared.dtype)
                full = full.full_tensor() if hasattr(full, "full_tensor") else full
                if rank == 0:
                    shared.write_param(slot, full)
                del full
            else:
                local = param.to_local() if hasattr(param, "to_local") else param
                start = sync.fsdp_row_start(slot.shape[0], rank, world_size) if slot.shape else 0
                shared.write_param(slot, local, start)
    if many:
        dist.barrier()
    if rank == 0:
        shared.end_write(version)


PUBLISH_WAYS = ("single_old", "single_new", "multi_old", "multi_new")


def publish_rank(rank, world, init_file, path, shared, syncs, results) -> None:
    """One rank of a publish row: each way, `syncs` rounds; rank 0's times, bytes equal or not."""

    class SingleWriter(SharedWeights):
        single_writer = True  # what a GPU buffer is (only rank 0 maps it), in CPU memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = models.build_trainer_model(path, world)
        buffer = torch.zeros_like(shared.buffer) if rank == 0 else None
        seq = torch.zeros(3, dtype=torch.int64)
        single = SingleWriter(buffer, seq, shared.layout, dtype=shared.dtype)
        old, new = publish_per_parameter, sync.publish_model
        ways = dict(zip(PUBLISH_WAYS, [(old, single), (new, single), (old, shared), (new, shared)]))
        times, same, before = {way: [] for way in PUBLISH_WAYS}, {}, None
        for version in range(syncs):
            for way, (publish, sink) in ways.items():
                dist.barrier()
                t = time.perf_counter()
                publish(model, sink, version, rank, world)
                times[way].append((time.perf_counter() - t) * 1e3)
                if rank == 0 and way.endswith("old"):
                    before = sink.buffer.clone()
                elif rank == 0:
                    same[way] = same.get(way, True) and torch.equal(sink.buffer, before)
        if rank == 0:
            results.put({"times": times, "same_bytes": same})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_publish(job: Job) -> dict:
    """One size's publish row at `job.ranks` gloo ranks on CPU; medians after the first round."""
    path = job.model()
    shared = prepare.allocate_shared_weights(path)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    results = mp.get_context("spawn").Queue()
    try:
        rank_args = (job.ranks, init_file, path, shared, job.syncs, results)
        mp.start_processes(publish_rank, rank_args, nprocs=job.ranks, start_method="spawn")
        got = results.get(timeout=60)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    ms = {way: med(got["times"][way][1:]) for way in PUBLISH_WAYS}
    memcpy = med(machine.memcpy_ms(shared.buffer))
    return {
        **dict(name=job.name, ranks=job.ranks, params=sum(sl.numel for sl in shared.layout)),
        **dict(tensors=len(shared.layout), mb=shared.nbytes / 2**20, memcpy_ms=memcpy),
        **{f"{way}_ms": v for way, v in ms.items()},
        **{f"{w}_new_over_old": ms[f"{w}_new"] / ms[f"{w}_old"] for w in ("single", "multi")},
        **dict(same_bytes=got["same_bytes"], samples=job.syncs - 1, all_ms=got["times"]),
    }


if __name__ == "__main__":
    sys.exit(main())
