"""bench/load_memory.py — host memory of a trainer start on N ranks: every rank loading the model,
or one.

    python bench/load_memory.py --out DIR [--before-repo /work/main] [--ranks 2] [--hidden
        1024 --layers 16]
    # the suite's size (tests/test_bench.py): this checkout alone (--before-repo ''), hidden 64, 2
    # layers, vocabulary 512
    python bench/load_memory.py --smoke --out DIR

Builds a random Qwen2-style model (~300M parameters with the defaults) once, then, for each checkout
(`--before-repo`, e.g. main's code, none if ''; and this one), spawns `--ranks` gloo ranks that each
call that checkout's `models.build_trainer_model(model, 2)` and sample the peak RSS of the ranks,
summed (every 0.1 s, from the parent). Both checkouts run side by side in one invocation, one after
the other, on the same model file. Writes DIR/load_memory_{N}ranks.json. On CPU the shards are host
memory too (one copy in all); on GPUs they are on the devices.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import psutil

RANKS = r"""
import os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, model, init, world):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from trainer import models
    model = models.build_trainer_model(model, world)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    world = int(sys.argv[3])
    scratch = tempfile.mktemp(prefix="load-memory-")
    mp.spawn(rank_main, args=(sys.argv[2], scratch, world), nprocs=world)
"""


def peak_of_ranks(repo: str, model: str, ranks: int) -> dict:
    """Run the `ranks`-rank start of `repo`; the peak of the ranks' RSS summed, and each rank's own
    peak."""
    script = Path(tempfile.mkdtemp()) / "ranks.py"
    script.write_text(RANKS)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script), repo, model, str(ranks)])
    root = psutil.Process(proc.pid)
    peak_sum, peak_each = 0, {}
    while proc.poll() is None:
        rss = {}
        try:
            for child in root.children(recursive=True):
                if "spawn_main" in " ".join(child.cmdline()):
                    rss[child.pid] = child.memory_info().rss
        except psutil.Error:
            pass
        peak_sum = max(peak_sum, sum(rss.values()))
        for pid, value in rss.items():
            peak_each[pid] = max(peak_each.get(pid, 0), value)
        time.sleep(0.1)
    gib = 2**30
    return {
        "repo": repo,
        "exit_code": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_rss_sum_gib": round(peak_sum / gib, 3),
        "peak_rss_per_rank_gib": [round(v / gib, 3) for _, v in sorted(peak_each.items())],
    }


def save_in_bf16(model: str, dst: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (dst / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(dst)
        AutoTokenizer.from_pretrained(model).save_pretrained(dst)
    return str(dst)


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"before_repo": "", "hidden": 64, "layers": 2, "vocab": 512})
    p.add_argument(
        "--before-repo", default="/work/main", help="the checkout to compare with (main's code)"
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--disk-dtype",
        default="bf16",
        choices=["bf16", "fp32"],
        help="the weights' dtype on disk (fp32 files load without a copy: memory-mapped)",
    )
    args = common.parse_args(p, argv)
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix="load-memory-"))
    model = common.build_model(
        work / f"model-h{args.hidden}-l{args.layers}",
        hidden=args.hidden,
        layers=args.layers,
        heads=16,
        vocab_size=args.vocab,
    )
    # as real checkpoints ship: the trainer's fp32 master weights are then a copy
    if args.disk_dtype == "bf16":
        model = save_in_bf16(model, work / f"model-h{args.hidden}-l{args.layers}-bf16")
    params = common.count_params(model)
    info = common.machine_info()
    with common.LoadMonitor() as load:
        runs = (
            {"before": peak_of_ranks(args.before_repo, model, args.ranks)}
            if args.before_repo
            else {}
        )
        runs["after"] = peak_of_ranks(str(common.REPO), model, args.ranks)
    fp32_gib = params * 4 / 2**30
    result = {
        "machine": info,
        "load": load.summary(),
        "params": params,
        "fp32_model_gib": round(fp32_gib, 3),
        **runs,
    }
    print(
        common.table(
            [
                "checkout",
                f"peak RSS, {args.ranks} ranks summed (GiB)",
                "per rank (GiB)",
                "model copies",
                "exit",
            ],
            [
                [
                    name,
                    r["peak_rss_sum_gib"],
                    r["peak_rss_per_rank_gib"],
                    round(r["peak_rss_sum_gib"] / fp32_gib, 2),
                    r["exit_code"],
                ]
                for name, r in runs.items()
            ],
            title=f"{args.ranks}-rank start, {params / 1e6:.0f}M parameters ({fp32_gib:.2f} GiB in "
            f"fp32)",
        )
    )
    result.update(ranks=args.ranks, disk_dtype=args.disk_dtype)
    common.write_json(out, f"load_memory_{args.ranks}ranks", result)
    return max(r["exit_code"] for r in runs.values())


if __name__ == "__main__":
    sys.exit(main())
