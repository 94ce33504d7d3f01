"""bench/weight_sync_cross.py — bench/weight_sync.py's rows without an engine: the cross-machine
rows (`--cross-sizes`) and the publish rows (`--publish-sizes`; `--cross-only`: these alone).

The trainer side of remote.py (`--role trainer`): the publish gathered into rank
0's own buffer (`remote.RemoteWeights`) and sent in 64 MiB buckets over the 2-member gloo group
(`link.send_weights`) to a second process standing in for the generator node, which receives
straight into its packed buffer (`link.receive_weights`), here over loopback. Timed from the
publish's start to the receiver's `end_write` (one clock: one machine), against the one-node path
(the publish into the shared buffer) and a memcpy of the same bytes. The generator's load that
follows (pause, reload, reset) is the same on both paths (bench/weight_sync.py's rows).

The publish rows: `sync.publish_model` at several FSDP2 ranks over gloo (spawned processes), into
a single writer's buffer (what a GPU buffer and remote.py get: the gather) and into the CPU shared
buffer (each rank writes its own rows), each alternated with `publish_per_parameter`, the code it
replaced (issue 37), in the same ranks; rank 0's times, medians after the first round, and whether
the bytes are the same.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# torch and the project are imported in the functions that run in child processes (common.py)


def memcpy_ms(buffer, repeats: int = 7) -> list[float]:
    """Milliseconds of copying `buffer` into a fresh tensor of its size, `repeats` times (after one
    warm copy)."""
    import torch

    dst = torch.empty_like(buffer)
    dst.copy_(buffer)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(buffer)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _cross_receiver(port: int, shapes, dtype, versions: int, results) -> None:
    """The generator node's side of the cross-machine row: receive `versions` publishes into its own
    buffer."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from generator.shared_weights import SharedWeights
    from run import link

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=120))
    group = link.weight_group(store, 1, torch.device("cpu"), 120)
    shared = SharedWeights.allocate(shapes, dtype=dtype)
    for version in range(1, versions + 1):
        link.receive_weights(group, shared, version)
        results.put((version, shared.publish_time_ns()))


def measure_cross_machine(name: str, shape: tuple, work: str, seed: int, syncs: int) -> dict:
    """One size's cross-machine row (no engine): memcpy, the one-node publish into shared memory,
    and the remote publish (gather into rank 0's buffer, then buckets over gloo into another
    process's buffer)."""
    import os
    import socket
    import tempfile
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    import sync
    from run import link, prepare, remote
    from trainer import models

    hidden, layers, heads = shape
    path = common.build_model(
        Path(work) / f"model_{name}", seed=seed, hidden=hidden, layers=layers, heads=heads
    )
    cfg = common.default_config(model=path)
    torch.set_num_threads(cfg.train_threads)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    model = models.build_trainer_model(path, 1)
    shared = prepare.allocate_shared_weights(path)  # the one-node path
    nbytes = shared.nbytes
    med = statistics.median

    memcpy = memcpy_ms(shared.buffer)
    shm = []
    for version in range(1, syncs + 1):
        t = time.perf_counter()
        sync.publish_model(model, shared, version, 0, 1)
        shm.append((time.perf_counter() - t) * 1e3)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    receiver = ctx.Process(
        target=_cross_receiver,
        args=(port, [(sl.name, sl.shape) for sl in shared.layout], shared.dtype, syncs, results),
    )
    receiver.start()
    try:
        store = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=120))
        group = link.weight_group(store, 0, torch.device("cpu"), 120)
        sends = []

        class Sender:  # what remote.TrainerLink.send_weights does, without the message link
            def send_weights(self, version, flat):
                t = time.perf_counter()
                link.send_weights(group, flat)
                sends.append((time.perf_counter() - t) * 1e3)

        weights = remote.RemoteWeights(shared.layout, shared.dtype, Sender())
        starts, cross = [], []
        for version in range(1, syncs + 1):
            starts.append(time.time_ns())
            sync.publish_model(model, weights, version, 0, 1)
            got, end_ns = results.get(timeout=120)
            assert got == version
            cross.append((end_ns - starts[-1]) / 1e6)
        # the same packed bytes (the last version)
        equal = torch.equal(weights.buffer, shared.buffer)
        receiver.join(timeout=60)
    finally:
        receiver.kill()
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)
    cross, sends, shm = cross[1:], sends[1:], shm[1:]  # the first of each warms up
    return {
        "name": name,
        "params": sum(sl.numel for sl in shared.layout),
        "bytes": nbytes,
        "mb": nbytes / 2**20,
        "memcpy_ms": med(memcpy),
        "shm_publish_ms": med(shm),
        "cross_ms": med(cross),
        "cross_send_ms": med(sends),
        "cross_copy_ms": med(cross) - med(sends),
        "cross_over_memcpy": med(cross) / med(memcpy),
        "cross_over_shm": med(cross) / med(shm),
        "shm_over_memcpy": med(shm) / med(memcpy),
        "same_bytes": equal,
        "samples": len(cross),
        "all_cross_ms": cross,
    }


def cross_table(rows: list[dict]) -> str:
    return common.table(
        [
            "size",
            "MB",
            "memcpy ms",
            "shared memory ms",
            "gloo loopback ms",
            "(send part)",
            "shm / memcpy",
            "gloo / memcpy",
            "gloo / shm",
        ],
        [
            [
                r["name"],
                r["mb"],
                r["memcpy_ms"],
                r["shm_publish_ms"],
                r["cross_ms"],
                r["cross_send_ms"],
                r["shm_over_memcpy"],
                r["cross_over_memcpy"],
                r["cross_over_shm"],
            ]
            for r in rows
        ],
        title="cross-machine path (remote.py, gloo over loopback on this machine) against the "
        "one-node publish into shared memory and a memcpy of the same bytes:",
    )


def plot_cross(data: dict, path: Path) -> None:
    plt = common.plt()
    rows = data["cross_machine"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (key, label) in enumerate(
        [
            ("memcpy_ms", "memcpy"),
            ("shm_publish_ms", "publish into shared memory"),
            ("cross_ms", "publish over gloo (loopback)"),
        ]
    ):
        ax.bar(
            [j + (i - 1) * width for j in range(len(rows))],
            [r[key] for r in rows],
            width,
            label=label,
        )
    ax.set_xticks(range(len(rows)), [f"{r['name']} ({r['mb']:.0f} MB)" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "cross-machine weight sync")


# --------------------------------------------------------------------------------------------------
# The publish rows (`--publish-sizes`): sync.publish_model at several ranks against its predecessor
# --------------------------------------------------------------------------------------------------
def publish_per_parameter(model, shared, version, rank, world_size):
    """sync.publish_model as it was before issue 37 (d5365e1), the publish rows' baseline: one
    parameter at a time, gathered (single writer) or written from each rank's rows (many)."""
    import torch
    import torch.distributed as dist

    import sync

    params = sync.trainable_parameters(model)
    if shared.single_writer:
        with torch.no_grad():
            if rank == 0:
                shared.begin_write()
            for slot, param in zip(shared.layout, params):
                full = param.detach().to(shared.dtype)
                full = full.full_tensor() if hasattr(full, "full_tensor") else full
                if rank == 0:
                    shared.write_param(slot, full)
                del full
            if rank == 0:
                shared.end_write(version)
        return
    if rank == 0:
        shared.begin_write()
    if world_size > 1:
        dist.barrier()
    with torch.no_grad():
        for slot, param in zip(shared.layout, params):
            local = param.to_local() if hasattr(param, "to_local") else param
            start = sync.fsdp_row_start(slot.shape[0], rank, world_size) if slot.shape else 0
            shared.write_param(slot, local, start)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shared.end_write(version)


PUBLISH_WAYS = ("single_old", "single_new", "multi_old", "multi_new")


def _publish_rank(rank, world, init_file, path, shared, syncs, results) -> None:
    """One trainer rank of a publish row: each way in turn, `syncs` rounds; rank 0 reports its
    times and whether each way's buffer equals its predecessor's to the bit."""
    import torch
    import torch.distributed as dist

    import sync
    from generator.shared_weights import SharedWeights
    from trainer import models

    class SingleWriter(SharedWeights):
        single_writer = True  # what a GPU buffer is (only rank 0 maps it), in CPU memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = models.build_trainer_model(path, world)
        single = SingleWriter(
            torch.zeros_like(shared.buffer) if rank == 0 else None,
            torch.zeros(3, dtype=torch.int64),
            shared.layout,
            dtype=shared.dtype,
        )
        ways = {
            "single_old": (publish_per_parameter, single),
            "single_new": (sync.publish_model, single),
            "multi_old": (publish_per_parameter, shared),
            "multi_new": (sync.publish_model, shared),
        }
        times, same, before = {way: [] for way in ways}, {}, None
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


def measure_publish(name: str, shape: tuple, work: str, seed: int, syncs: int, ranks: int):
    """One size's publish row: sync.publish_model at `ranks` gloo ranks on CPU, single writer (what
    a GPU buffer and remote.py use: the gather) and many writers (the CPU shared buffer: each rank
    its rows), each against `publish_per_parameter`, alternated; medians after the first round."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    from run import prepare

    hidden, layers, heads = shape
    path = common.build_model(
        Path(work) / f"model_{name}", seed=seed, hidden=hidden, layers=layers, heads=heads
    )
    shared = prepare.allocate_shared_weights(path)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    results = mp.get_context("spawn").Queue()
    try:
        mp.start_processes(
            _publish_rank,
            args=(ranks, init_file, path, shared, syncs, results),
            nprocs=ranks,
            start_method="spawn",
        )
        got = results.get(timeout=60)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    med = {way: statistics.median(got["times"][way][1:]) for way in PUBLISH_WAYS}
    return {
        "name": name,
        "ranks": ranks,
        "params": sum(sl.numel for sl in shared.layout),
        "tensors": len(shared.layout),
        "mb": shared.nbytes / 2**20,
        "memcpy_ms": statistics.median(memcpy_ms(shared.buffer)),
        **{f"{way}_ms": ms for way, ms in med.items()},
        "single_new_over_old": med["single_new"] / med["single_old"],
        "multi_new_over_old": med["multi_new"] / med["multi_old"],
        "same_bytes": got["same_bytes"],
        "samples": syncs - 1,
        "all_ms": got["times"],
    }


def publish_table(rows: list[dict]) -> str:
    return common.table(
        [
            "size",
            "ranks",
            "tensors",
            "MB",
            "memcpy ms",
            "single writer: per parameter ms",
            "batched ms",
            "batched / per parameter",
            "many writers: per parameter ms",
            "batched ms",
            "batched / per parameter",
            "same bytes",
        ],
        [
            [
                r["name"],
                r["ranks"],
                r["tensors"],
                r["mb"],
                r["memcpy_ms"],
                r["single_old_ms"],
                r["single_new_ms"],
                r["single_new_over_old"],
                r["multi_old_ms"],
                r["multi_new_ms"],
                r["multi_new_over_old"],
                all(r["same_bytes"].values()),
            ]
            for r in rows
        ],
        title="the trainer's publish on CPU (gloo), sync.publish_model against the per-parameter "
        "publish it replaced (issue 37), alternated in the same ranks (medians):",
    )
