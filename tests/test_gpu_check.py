"""scripts/gpu_check.py on a machine without a GPU: it fails at once with a clear message, and its
whole flow (FSDP2 steps, the packed sync between two processes, the seqlock under back-to-back
writes, log-prob agreement, one JSON line) runs as a CPU dry run with the same code."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(*args, timeout=120):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout + proc.stderr  # exactly one JSON line
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_gpu_check_without_a_gpu_fails_at_once_with_a_clear_message():
    start = time.monotonic()
    code, result, stderr = _check("bash", "scripts/gpu_check.sh", "--sizes", "tiny")
    assert code == 2 and result["ok"] is False and "no CUDA GPU visible" in result["error"]
    assert "no CUDA GPU visible" in stderr and time.monotonic() - start < 30


def test_gpu_check_flow_as_a_cpu_dry_run():
    code, result, stderr = _check(
        sys.executable,
        "scripts/gpu_check.py",
        "--device",
        "cpu",
        "--sizes",
        "tiny",
        "--steps",
        "2",
        "--torn-seconds",
        "0.3",
        "--reps",
        "3",
    )
    assert code == 0 and result["ok"] is True, stderr
    tiny = result["sizes"]["tiny"]
    assert tiny["versions_ok"] and tiny["logprob_max_diff"] < 1e-4 and tiny["fsdp_steps"] == 2
    assert tiny["torn_check"]["torn"] == 0 and tiny["torn_check"]["snapshots"] > 0
    for key in (
        "publish_ms",
        "snapshot_ms",
        "d2d_copy_ms",
        "sync_ms",
        "train_step_ms",
        "ipc_open_ms",
    ):
        assert tiny[key] is not None and tiny[key] >= 0, key
