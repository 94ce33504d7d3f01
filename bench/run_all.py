"""bench/run_all.py — every benchmark, one after the other, then the summary page.

    python bench/run_all.py --out bench/results     # about 16 minutes on 2 cores
    # the suite's size (tests/test_bench.py): --smoke passed to each benchmark
    python bench/run_all.py --smoke --only memory --out DIR

Each benchmark runs as its own `python bench/NAME.py --out DIR`; a failure is reported and the
others go on.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("overlap", "weight_sync", "generation", "training", "learning")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--only", default=",".join(NAMES), help="comma-separated subset")
    p.add_argument(
        "--smoke", action="store_true", help="each benchmark at its smoke size (its own --smoke)"
    )
    args = p.parse_args(argv)
    failed = []
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        start = time.perf_counter()
        print(f"===== {name}", flush=True)
        rc = subprocess.call(
            [sys.executable, str(HERE / f"{name}.py"), "--out", args.out, *["--smoke"] * args.smoke]
        )
        print(f"===== {name}: exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    subprocess.call([sys.executable, str(HERE / "report.py"), "--out", args.out])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
