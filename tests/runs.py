"""The run harness of the end-to-end tests (not a test module): `python train.py` as a subprocess,
every process it starts recorded while it runs.

`Run` starts one `train.py` (`launcher`: arguments before train.py, e.g. torchrun's), records every
descendant it ever has (vLLM's processes rename themselves after they start: the names are
refreshed), waits for its exit or for metrics rows with a timeout that fails the test and kills the
run, and lists what outlived it. `finish_ok` waits for a run that must succeed and asserts what
every successful run holds: the exit code, nothing left behind, an EngineCore seen, one metrics row
and one version per step, and a summary that adds up. `SMALL` is a small run's flags. The
`start_run` fixture (tests/conftest.py) makes runs and kills whatever is left of them after the
test. Used by tests/test_pipeline.py and tests/test_multinode.py. May touch: the processes of the
runs it started, only.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-new-tokens",
    "5",
    "--eval-prompts",
    "16",
    "--eval-samples",
    "2",
]  # a small evaluation
RUN_TIMEOUT_S = 240  # a whole small run; a healthy one takes ~30 s on 2 busy cores


def is_engine_core(name: str) -> bool:
    # the kernel's process name (comm) is cut at 15 characters
    return name.startswith("VLLM::EngineCor")


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Run:
    """One `train.py` subprocess (`launcher`: arguments before train.py, e.g. torchrun's); records
    every descendant it ever had (they are reparented if orphaned)."""

    def __init__(self, out: Path, *args: str, launcher: tuple = (), env: dict | None = None):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = Path(f"{out}.stdout"), Path(f"{out}.stderr")
        self.start = time.monotonic()
        with open(self.stdout_path, "w") as so, open(self.stderr_path, "w") as se:
            self.proc = subprocess.Popen(
                [sys.executable, *launcher, "train.py", "--out", str(out), *args],
                cwd=REPO,
                stdout=so,
                stderr=se,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            )
        self.root = psutil.Process(self.proc.pid)
        self.seen: dict[int, psutil.Process] = {}
        self.names: dict[int, str] = {}  # names as seen while alive

    def record(self) -> None:
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                # refreshed: vLLM's processes rename themselves after they start
                name = child.name()
            except psutil.Error:
                continue
            self.names[child.pid] = name
            self.seen.setdefault(child.pid, child)

    def poll(self):
        self.record()
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        """Wait for the exit (recording descendants meanwhile); fail the test on timeout."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill_all()
                pytest.fail(f"train.py did not exit within {timeout:.0f} s\n{self.tail()}")
            time.sleep(0.25)
        return self.proc.returncode

    def wait_rows(self, n: int, timeout: float) -> None:
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
            if self.poll() is not None:
                pytest.fail(
                    f"train.py exited ({self.proc.returncode}) before {n} metrics "
                    f"rows\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.kill_all()
                pytest.fail(f"fewer than {n} metrics rows after {timeout:.0f} s\n{self.tail()}")
            time.sleep(0.25)
        self.record()

    def leftovers(self, grace_s: float) -> list[str]:
        """Recorded descendants (and processes naming this run's --out) still alive after
        `grace_s`."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [p for p in self.seen.values() if not gone(p)]
            for p in psutil.process_iter(["pid", "cmdline"]):
                if (
                    p.pid != self.proc.pid
                    and str(self.out) in " ".join(p.info["cmdline"] or [])
                    and not gone(p)
                ):
                    alive.append(p)
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        out = []
        for p in alive:
            try:
                out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        return out

    def kill_all(self) -> None:
        """Kill this run's processes only (the train.py process and what it started)."""
        self.record()
        for p in [self.root, *self.seen.values()]:
            try:
                if not gone(p):
                    p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return f"--- stderr tail ---\n{self.stderr()[-n:]}"

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def finish_ok(run: Run, steps: int) -> tuple[list[dict], dict]:
    code = run.wait(RUN_TIMEOUT_S)
    assert code == 0, f"train.py exited {code}\n{run.tail()}"
    assert run.leftovers(grace_s=10) == [], "processes of the run outlived it"
    assert any(map(is_engine_core, run.names.values())), (
        f"the run's EngineCore was never seen: {run.names}"
    )
    rows, summary = run.rows(), run.summary()
    assert [r["step"] for r in rows] == list(range(steps))
    # no skipped step, one version per step
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert summary["steps"] == steps
    assert summary["tokens_trained"] == sum(r["tokens"] for r in rows) > 0
    assert summary["max_token_lag"] == max(r["lag_max"] for r in rows)
    assert (
        summary["dropped_stale"]
        == sum(r["dropped_stale"] for r in rows)
        == rows[-1]["dropped_stale_total"]
    )
    return rows, summary
