"""bench/peak_rss.py — the peak memory of a whole `train.py` run: every process it starts, added up.

    python bench/peak_rss.py [--out FILE.json] -- TRAIN.PY ARGS...
    # the suite's size (tests/test_bench.py): a 12-step run of 4 prompts x 4 (SMOKE_ARGS; ARGS added
    # after)
    python bench/peak_rss.py --smoke [--out FILE.json] [-- ARGS...]

Runs `python train.py ARGS` and, every `--interval` seconds, reads the memory of the run's whole
process tree (the parent, the generator, vLLM's EngineCore and workers, the trainer ranks, helpers):
the sum of their RSS (pages shared between processes, such as the libraries and the shared weight
buffer, count once per process: an upper bound) and the sum of their PSS (shared pages split between
the processes that map them: what the run really holds). Prints the peaks, the peak per role, and
the run's exit code; exits with the run's code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
# a tiny run that still has every kind of row (on policy, so every step measures the agreement;
# evaluations)
SMOKE_ARGS = [
    "--steps",
    "12",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-new-tokens",
    "5",
    "--max-lag",
    "0",
    "--eval-every",
    "6",
    "--eval-prompts",
    "8",
]


def role(proc, root_pid: int) -> str:
    name = proc.name()
    if proc.pid == root_pid:
        return "parent"
    if name.startswith("VLLM::EngineCor"):
        return "vllm_engine_core"
    if name.startswith("VLLM::Worker"):
        return "vllm_worker"
    try:
        parent = proc.parent()
    except Exception:
        parent = None
    if parent is not None and parent.pid == root_pid:
        return "child"  # the generator or a trainer rank (spawned by train.py)
    return "helper"


def sample(root) -> dict:
    """{pid: (role, rss, pss)} for the process tree under `root`."""
    out = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            full = p.memory_full_info()
            out[p.pid] = (role(p, root.pid), full.rss, getattr(full, "pss", full.rss), p.name())
        except psutil.Error:
            pass
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="train.py's arguments start with " + " ".join(SMOKE_ARGS),
    )
    args = p.parse_args(argv[:split])

    train_args = (SMOKE_ARGS if args.smoke else []) + argv[split + 1 :]
    cmd = [sys.executable, str(REPO / "train.py"), *train_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    at_peak, by_role = {}, {}
    while proc.poll() is None:
        snap = sample(root)
        rss, pss = sum(v[1] for v in snap.values()), sum(v[2] for v in snap.values())
        peak_rss = max(peak_rss, rss)
        if pss > peak_pss:
            peak_pss, at_peak = pss, snap
        roles = {}
        for r, _, q, _ in snap.values():
            roles[r] = roles.get(r, 0) + q
        for r, q in roles.items():
            by_role[r] = max(by_role.get(r, 0), q)
        time.sleep(args.interval)
    gib = 2**30
    result = {
        "cmd": " ".join(["python", "train.py", *train_args]),
        "exit_code": proc.returncode,
        "wall_s": time.perf_counter() - start,
        "peak_rss_sum_gib": peak_rss / gib,
        "peak_pss_sum_gib": peak_pss / gib,
        "peak_pss_by_role_gib": {k: v / gib for k, v in by_role.items()},
        "processes_at_pss_peak": [
            {"pid": pid, "role": r, "name": n, "rss_gib": a / gib, "pss_gib": b / gib}
            for pid, (r, a, b, n) in sorted(at_peak.items())
        ],
    }
    print(
        f"peak memory of the run: {result['peak_pss_sum_gib']:.2f} GiB PSS, "
        f"{result['peak_rss_sum_gib']:.2f} GiB "
        f"RSS summed over its processes; exit code {proc.returncode}, {result['wall_s']:.0f} s",
        flush=True,
    )
    for r, v in sorted(result["peak_pss_by_role_gib"].items()):
        print(f"  {r:18s} peak PSS {v:.2f} GiB", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
