"""bench/memory.py — memory: a trainer step's as the batch grows, a whole run's, a trainer start's.

    python bench/memory.py [--what step] --out DIR      # a trainer step: DIR/memory.json, .png
    python bench/memory.py --what peak_rss [--out FILE.json] -- TRAIN.PY ARGS...
    python bench/memory.py --what load_memory --out DIR [--before-repo /work/main] [--ranks 2]
    # the suite's sizes (tests/test_bench.py; tests/conftest.py records its shared run with
    # `--what peak_rss --smoke`)
    python bench/memory.py [--what NAME] --smoke --out DIR

`step`: does a trainer step's memory stay flat as the batch grows, at a real vocabulary? Model: the
project's `tasks/builtin.build_tiny_model` with Qwen2.5's vocabulary (151,936; hidden 128, 2 layers,
tied embeddings): the LM head and its softmax are a real model's, the rest is small. Batches:
synthetic GRPO batches of `--sequences` (16, 64, 256) completions of `--lengths` (128, 512, 2,048)
nominal tokens (each L/2 to L, uniform). Each measurement runs in a fresh process, holding what a
trainer rank holds (the FSDP2 model, AdamW, the collated batch), then the trainer's step
(`update.update_on_batch`). Peak: the process's peak RSS (`ru_maxrss`) on a CPU,
`torch.cuda.max_memory_allocated` on a GPU; `ready` is the RSS before the step.
- micro-batched (`--micro-batch-tokens`, default the trainer's): a step of more than two
  micro-batches runs two (`--max-micro-batches 2`): its shortest row alone (allocates the
  gradients), then its heaviest micro-batch (rows x length^2), which accumulates into them; rows
  say "2 of n".
  Checked at 64 x 512: the whole step peaked at 1,034-1,050 MiB, the two micro-batches at 981 MiB.
- whole batch (`--micro-batch-tokens 0`) where its padded tokens are at most `--whole-max-tokens`;
  tokens/s of both modes, full steps alternating in the whole batch's process (goal >= 0.9).
Goal: micro-batched peak memory at most 1.2x from 16 to 256 sequences.

`peak_rss`: runs `python train.py ARGS` and every `--interval` s reads its whole process tree's
memory: the sum of RSS (shared pages once per process: an upper bound) and of PSS (shared pages
split: what the run holds); the peaks, the peak per role, the run's exit code (its own exit code).

`load_memory`: a random Qwen2-style model (~300M parameters by default), then for each checkout
(`--before-repo`, none if ''; and this one) `--ranks` gloo ranks each calling that checkout's
`models.build_trainer_model`; the peak RSS of the ranks, summed, sampled every 0.1 s. Writes
DIR/load_memory_{N}ranks.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes
VOCAB, GIB = 151_936, 2**30
# a tiny run with every kind of row (on policy, so every step measures the agreement; evaluations)
SMOKE_RUN = "--steps 12 --prompts-per-step 4 --group-size 4 --max-new-tokens 5 --max-lag 0"
SMOKE_RUN = [*SMOKE_RUN.split(), "--eval-every", "6", "--eval-prompts", "8"]


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One measured trainer step: a batch of `sequences` x `length`, one step per budget."""

    model_path: str
    sequences: int
    length: int
    budgets: list
    max_micro_batches: int
    prompt_len: int
    threads: int
    seed: int
    checkpointing: bool = False


def synthetic_batch(sequences: int, length: int, prompt_len: int, vocab: int, seed: int):
    """A collated GRPO batch: random tokens, completions of length/2..length tokens."""
    import buffer

    rng, samples = random.Random(seed), []
    for i in range(sequences):
        n = rng.randint(max(1, length // 2), length)
        prompt = [1] + [rng.randrange(3, 100) for _ in range(prompt_len - 1)]
        completion = [rng.randrange(3, vocab) for _ in range(n)]
        reward = float(i % 2)
        samples.append(
            buffer.Sample(prompt, completion, [-12.0] * n, [0] * n, reward, rng.uniform(-1, 1))
        )
    return buffer.collate(samples, 0)


def two_micro_batches(planner):
    """The plan cut to its shortest row alone, then its heaviest micro-batch (see the docstring)."""
    whole_plan = planner.rank_micro_batches

    def shortest_row_then_heaviest(*args):
        mbs = whole_plan(*args)
        heaviest = max(mbs, key=lambda mb: mb.attention_mask.numel() * mb.attention_mask.shape[1])
        shortest = min(mbs, key=lambda mb: mb.attention_mask.shape[1])
        return [shortest.select([0]).trimmed(), heaviest]

    planner.rank_micro_batches = shortest_row_then_heaviest


def measure(case: StepCase) -> dict:
    """One configuration in this (fresh) process: one trainer step per budget. The peak is the
    first step's; the later steps' times give tokens/s (the first also allocates the optimizer's
    state)."""
    import torch
    import torch.distributed as dist

    import buffer
    import config
    import update
    from trainer import models

    torch.set_num_threads(case.threads)
    torch.manual_seed(case.seed)
    cuda = torch.cuda.is_available()
    device, init = ("cuda" if cuda else "cpu"), tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(case.model_path, 1, device)
        if case.checkpointing:
            models.checkpoint_layers(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # before any forward (FSDP2)
        cfg = config.Config(max_new_tokens=case.length)
        vocab = model.config.vocab_size
        batch = synthetic_batch(case.sequences, case.length, case.prompt_len, vocab, case.seed)
        # (the micro-batch plan lives in update.py, or in buffer.py after the restructure)
        planner = update if hasattr(update, "rank_micro_batches") else buffer
        planned = run = len(planner.rank_micro_batches(batch, 0, 1, case.budgets[0]))
        if case.max_micro_batches and planned > 2:
            two_micro_batches(planner)
            run = 2
        ready = psutil.Process().memory_info().rss
        times, peak, pad_frac = {}, None, None
        for step, budget in enumerate(case.budgets):
            start, budgeted = (
                time.perf_counter(),
                dataclasses.replace(cfg, micro_batch_tokens=budget),
            )
            result = update.update_on_batch(
                model, None, optimizer, batch, budgeted, 0, 1, 0, step, device=device
            )
            if cuda:
                torch.cuda.synchronize()
            if step == 0:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                peak = torch.cuda.max_memory_allocated() if cuda else rss
                pad_frac = result.metrics["pad_frac"]
            elif run == planned:
                times.setdefault(budget, []).append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
        if os.path.exists(init):
            os.unlink(init)
    tokens = int(batch.mask.sum())
    return {
        **{"sequences": case.sequences, "length": case.length},
        **{"micro_batch_tokens": case.budgets[0], "micro_batches": planned},
        **{"micro_batches_run": run, "full_step": run == planned},
        **{"grad_checkpointing": case.checkpointing, "completion_tokens": tokens},
        **{"padded_tokens": int(batch.attention_mask.numel()), "pad_frac": pad_frac},
        **{"peak_mib": peak / 2**20, "ready_mib": ready / 2**20},
        "memory": "cuda max_memory_allocated" if cuda else "process peak RSS",
        "step_s": {str(b): t for b, t in times.items()},
        "tokens_per_s": {str(b): tokens / statistics.median(t) for b, t in times.items()},
    }


def step_parser():
    smoke = {"sequences": "2", "lengths": "8", "vocab": 512, "prompt_len": 4}
    p = common.parser(__doc__, smoke={**smoke, "micro_batch_tokens": 16, "whole_max_tokens": 24})
    p.add_argument("--sequences", default="16,64,256", help="sequences per step, comma-separated")
    p.add_argument("--lengths", default="128,512,2048", help="completion lengths, comma-separated")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the trainer's")
    p.add_argument("--max-micro-batches", type=int, default=2, choices=(0, 2), help="0: all")
    p.add_argument("--whole-max-tokens", type=int, default=10240, help="padded tokens, at most")
    p.add_argument("--repeats", type=int, default=1, help="full steps of each mode for tokens/s")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--grad-checkpointing", action="store_true", help="as the trainer's flag")
    return p


def step_memory(argv=None) -> int:
    """`--what step`: the table of peaks by batch size, micro-batched and whole."""
    import config

    args = common.parse_args(step_parser(), argv)
    budget = args.micro_batch_tokens
    budget = config.Config().micro_batch_tokens if budget is None else budget
    threads = args.threads or len(os.sched_getaffinity(0))
    sequences, lengths = ([int(x) for x in s.split(",")] for s in (args.sequences, args.lengths))
    rows, speed = [], []
    with common.Bench("memory", args) as bench:
        from tasks.builtin import build_tiny_model

        model = str(bench.work / "model")
        build_tiny_model(model, seed=args.seed, alphabet="ascii", vocab_size=args.vocab)
        case = StepCase(model, 0, 0, [], 0, args.prompt_len, threads, args.seed)
        case = dataclasses.replace(case, checkpointing=args.grad_checkpointing)
        for length in lengths:
            for n in sequences:
                at = dataclasses.replace(case, sequences=n, length=length)
                rows += one_size(at, budget, args, speed)
    micro = [r for r in rows if r["mode"] == "micro-batched"]
    flat = {}
    for length in lengths:
        by_n = {r["sequences"]: r["peak_mib"] for r in micro if r["length"] == length}
        flat[str(length)] = by_n[max(by_n)] / by_n[min(by_n)]
    settings = {k: getattr(args, k) for k in ("vocab", "prompt_len", "max_micro_batches")}
    settings.update(hidden=128, layers=2, micro_batch_tokens=budget, threads=threads)
    for k in ("whole_max_tokens", "seed", "grad_checkpointing"):
        settings[k] = getattr(args, k)
    ratios = [s["ratio"] for s in speed]
    goals = {"flatness_max": max(flat.values()), "flatness_ok": max(flat.values()) <= 1.2}
    goals.update(
        speed_ratio_min=min(ratios, default=None), speed_ok=min(ratios) >= 0.9 if ratios else None
    )
    data = {"settings": {**settings, "sequences": sequences, "lengths": lengths}, "rows": rows}
    path = bench.save({**data, "speed": speed, "flatness": flat, "goals": goals}, plot)
    for r in rows:
        r["micro-batches"] = r["micro_batches"] if r["full_step"] else f"2 of {r['micro_batches']}"
    keys = "sequences length mode micro-batches completion_tokens pad_frac ready_mib peak_mib"
    print(common.table_of(rows, keys, f"peak memory of a trainer step (vocabulary {args.vocab:,})"))
    print(
        common.table_of(
            [{"length": k, "peak_256/peak_16": v} for k, v in flat.items()],
            "length peak_256/peak_16",
        )
    )
    keys = "sequences length micro_batches micro_tokens_per_s whole_tokens_per_s ratio"
    print(common.table_of(speed, keys, "micro-batched vs whole batch (goal >= 0.9)"))
    print(bench.closing_line(path))
    return 0


def one_size(case: StepCase, budget: int, args, speed: list) -> list[dict]:
    """The micro-batched step of one size, and the whole batch's where it fits (then both speeds,
    appended to `speed`)."""
    what = f"step {case.sequences}x{case.length}"
    r = common.in_child(
        measure,
        dataclasses.replace(case, budgets=[budget], max_micro_batches=args.max_micro_batches),
        timeout_s=1800,
        what=what,
    )
    print(f"[memory] {what}: micro-batched peak {r['peak_mib']:.0f} MiB", flush=True)
    if case.sequences * (args.prompt_len + case.length) > args.whole_max_tokens:
        return [dict(r, mode="micro-batched")]
    # the whole batch: its peak (first step), then micro-batched and whole steps alternating
    split = r["micro_batches"] > 1
    budgets = [0] + ([budget, 0] * args.repeats if split else [])
    w = common.in_child(
        measure, dataclasses.replace(case, budgets=budgets), timeout_s=1800, what=what
    )
    print(f"[memory] {what}: whole batch peak {w['peak_mib']:.0f} MiB", flush=True)
    if split:
        m, whole = w["tokens_per_s"][str(budget)], w["tokens_per_s"]["0"]
        speed.append(
            {
                **{"sequences": case.sequences, "length": case.length},
                **{"micro_batches": r["micro_batches"], "micro_tokens_per_s": m},
                **{"whole_tokens_per_s": whole, "ratio": m / whole, "step_s": w["step_s"]},
            }
        )
    return [dict(r, mode="micro-batched"), dict(w, mode="whole batch")]


def plot(data: dict, path: Path) -> None:
    fig, ax = common.plt().subplots(figsize=(7, 4.2))
    for mode, style in (("micro-batched", "-o"), ("whole batch", "--s")):
        for length in data["settings"]["lengths"]:
            rows = [r for r in data["rows"] if r["mode"] == mode and r["length"] == length]
            pts = sorted((r["sequences"], r["peak_mib"]) for r in rows)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{mode}, completions <= {length}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequences per step", ylabel=f"peak MiB ({data['rows'][0]['memory']})")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    common.save_figure(fig, path, data, "trainer step memory")


def tree_memory(root) -> dict:
    """{pid: (role, rss, pss, name)} for the process tree under `root`."""
    out = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            full, name = p.memory_full_info(), p.name()
            role = "parent" if p.pid == root.pid else "helper"
            if name.startswith(("VLLM::EngineCor", "VLLM::Worker")):
                role = "vllm_engine_core" if "EngineCor" in name else "vllm_worker"
            elif role == "helper" and p.ppid() == root.pid:
                role = "child"  # the generator or a trainer rank (spawned by train.py)
            out[p.pid] = (role, full.rss, getattr(full, "pss", full.rss), name)
        except psutil.Error:
            pass
    return out


def peak_rss(argv=None) -> int:
    """`--what peak_rss [--smoke] [--out FILE.json] -- TRAIN.PY ARGS`: the run's peak memory."""
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description="the peak memory of a whole train.py run")
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--smoke", action="store_true", help="train.py's arguments start with SMOKE_RUN")
    args = p.parse_args(argv[:split])
    train_args = (SMOKE_RUN if args.smoke else []) + argv[split + 1 :]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "train.py", *train_args], cwd=common.REPO)
    root, peak_rss, peak_pss, at_peak, by_role = psutil.Process(proc.pid), 0, 0, {}, {}
    while proc.poll() is None:
        snap = tree_memory(root)
        rss, pss = sum(v[1] for v in snap.values()), sum(v[2] for v in snap.values())
        peak_rss = max(peak_rss, rss)
        if pss > peak_pss:
            peak_pss, at_peak = pss, snap
        roles = {}
        for r, _, q, _ in snap.values():
            roles[r] = roles.get(r, 0) + q
        by_role = {r: max(by_role.get(r, 0), roles.get(r, 0)) for r in {*by_role, *roles}}
        time.sleep(args.interval)
    result = {
        "cmd": " ".join(["python", "train.py", *train_args]),
        **{"exit_code": proc.returncode, "wall_s": time.perf_counter() - start},
        **{"peak_rss_sum_gib": peak_rss / GIB, "peak_pss_sum_gib": peak_pss / GIB},
        "peak_pss_by_role_gib": {k: v / GIB for k, v in by_role.items()},
        "processes_at_pss_peak": [
            {"pid": pid, "role": r, "name": n, "rss_gib": a / GIB, "pss_gib": b / GIB}
            for pid, (r, a, b, n) in sorted(at_peak.items())
        ],
    }
    print(f"peak memory of the run: {peak_pss / GIB:.2f} GiB PSS, {peak_rss / GIB:.2f} GiB RSS")
    print(
        common.table_of(
            [{"role": r, "peak PSS GiB": v} for r, v in sorted(by_role.items())], "role"
        )
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return proc.returncode


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
    init = tempfile.mktemp(prefix="load-memory-")
    mp.spawn(rank_main, args=(sys.argv[2], init, world), nprocs=world)
"""


def peak_of_ranks(repo: str, model: str, ranks: int) -> dict:
    """`ranks` ranks of `repo` building the trainer's model: their RSS summed at its peak, and each
    rank's own peak."""
    script = Path(tempfile.mkdtemp()) / "ranks.py"
    script.write_text(RANKS)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script), repo, model, str(ranks)])
    root, peak_sum, peak_each = psutil.Process(proc.pid), 0, {}
    while proc.poll() is None:
        rss = {}
        try:
            for child in root.children(recursive=True):
                if "spawn_main" in " ".join(child.cmdline()):
                    rss[child.pid] = child.memory_info().rss
        except psutil.Error:
            pass
        peak_sum = max(peak_sum, sum(rss.values()))
        peak_each = {pid: max(peak_each.get(pid, 0), v) for pid, v in {**peak_each, **rss}.items()}
        time.sleep(0.1)
    return {
        **{"repo": repo, "exit_code": proc.returncode},
        **{"wall_s": round(time.perf_counter() - t0, 1)},
        **{"peak_rss_sum_gib": round(peak_sum / GIB, 3)},
        "peak_rss_per_rank_gib": [round(v / GIB, 3) for _, v in sorted(peak_each.items())],
    }


def load_memory(argv=None) -> int:
    """`--what load_memory`: a trainer start's host memory on N ranks, checkout by checkout."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = common.parser(__doc__, smoke={"before_repo": "", "hidden": 64, "layers": 2, "vocab": 512})
    p.add_argument("--before-repo", default="/work/main", help="the checkout to compare with")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--disk-dtype", default="bf16", choices=["bf16", "fp32"], help="fp32: mmapped")
    args = common.parse_args(p, argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="load-memory-"))
    name = f"model-h{args.hidden}-l{args.layers}"
    sizes = {"hidden": args.hidden, "layers": args.layers, "heads": 16, "vocab_size": args.vocab}
    model = common.build_model(work / name, **sizes)
    if args.disk_dtype == "bf16":  # as real checkpoints ship: the fp32 master weights are a copy
        dst = work / f"{name}-bf16"
        if not (dst / "config.json").exists():
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
            loaded.save_pretrained(dst)
            AutoTokenizer.from_pretrained(model).save_pretrained(dst)
        model = str(dst)
    params = common.count_params(model)
    info = common.machine_info()
    with common.LoadMonitor() as load:
        runs = (
            {"before": peak_of_ranks(args.before_repo, model, args.ranks)}
            if args.before_repo
            else {}
        )
        runs["after"] = peak_of_ranks(str(common.REPO), model, args.ranks)
    fp32_gib = params * 4 / GIB
    rows = [
        {"checkout": k, **r, "model_copies": r["peak_rss_sum_gib"] / fp32_gib}
        for k, r in runs.items()
    ]
    keys = "checkout peak_rss_sum_gib peak_rss_per_rank_gib model_copies exit_code"
    print(common.table_of(rows, keys, f"{args.ranks}-rank start, {params / 1e6:.0f}M parameters"))
    result = {"machine": info, "load": load.summary(), "params": params}
    result.update(
        fp32_model_gib=round(fp32_gib, 3), **runs, ranks=args.ranks, disk_dtype=args.disk_dtype
    )
    common.write_json(args.out, f"load_memory_{args.ranks}ranks", result)
    return max(r["exit_code"] for r in runs.values())


def main(argv=None) -> int:
    entries = {"step": step_memory, "peak_rss": peak_rss, "load_memory": load_memory}
    return common.dispatch(__doc__, entries, argv)


if __name__ == "__main__":
    sys.exit(main())
