"""bench/weight_sync_cross.py — bench/weight_sync.py's cross-machine rows (`--cross-sizes`,
`--cross-only`).

The trainer side of remote.py (`--role trainer`): the publish gathered into rank
0's own buffer (`remote.RemoteWeights`) and sent in 64 MiB buckets over the 2-member gloo group
(`link.send_weights`) to a second process standing in for the generator node, which receives
straight into its packed buffer (`link.receive_weights`), here over loopback. Timed from the
publish's start to the receiver's `end_write` (one clock: one machine), against the one-node path
(the publish into the shared buffer) and a memcpy of the same bytes. The generator's load that
follows (pause, reload, reset) is the same on both paths (bench/weight_sync.py's rows).
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

    import link
    from shared_weights import SharedWeights

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

    import link
    import models
    import prepare
    import remote
    import sync

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
