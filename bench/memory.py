"""bench/memory.py — does a trainer step's memory stay flat as the batch grows, at a real
vocabulary?

    # writes DIR/memory.json and DIR/memory.png, prints a table
    python bench/memory.py --out DIR
    # the suite's size (tests/test_bench.py): 2 rows of 8 tokens, vocabulary 512, micro-batches of
    # 16 tokens, then the whole batch
    python bench/memory.py --smoke --out DIR

Model: the project's `tasks/builtin.build_tiny_model` with a real vocabulary (151,936 tokens,
Qwen2.5's size; hidden 128, 2 layers, tied embeddings): the LM head and its softmax are a real
model's, the rest is small.
Batches: synthetic GRPO batches of `--sequences` (16, 64, 256) completions of `--lengths` (128, 512,
2,048) nominal tokens (each completion L/2 to L tokens, uniform; prompts of `--prompt-len` tokens).

Each measurement runs in a fresh process (`common.in_child`) holding what a trainer rank holds: the
FSDP2 model (`models.build_trainer_model`, one rank), AdamW, the collated batch; then the trainer's
step (`update.update_on_batch`: gradient clipping, `optimizer.step`). Peak memory: the process's
peak RSS (`ru_maxrss`) on a CPU, `torch.cuda.max_memory_allocated` on a GPU; `ready` is the RSS
before the step.
- micro-batched: `--micro-batch-tokens` (default: the trainer's default), for every size. On 2 cores
  a whole step of the larger sizes takes far longer than this benchmark may (the LM head costs ~3 ms
  per token here), so a step of more than one micro-batch runs two: its shortest row alone (it
  allocates the gradients, at little cost), then its heaviest micro-batch (most rows x length^2:
  attention), which accumulates into them; the others do the same or less work on the same memory.
  The batch is collated whole and the plan is the whole step's; such rows say "2 of n"
  (`--max-micro-batches 0`: the whole step). Checked at 64 x 512 (8 micro-batches): the whole step
  peaked at 1,034 and 1,050 MiB in two runs, its first and heaviest micro-batches at 981 MiB (the
  first alone: 928 MiB: the second adds the accumulation's copy of the gradients); RSS after each
  micro-batch of the whole step rose to ~1,000 MiB by the second and then followed the rows' length,
  it did not keep growing.
- whole batch (`--micro-batch-tokens 0`: every row in one forward and backward, log-probs still
  chunked) where its padded tokens are at most `--whole-max-tokens` (beyond, it would run for
  minutes, or not fit).
- tokens/s: micro-batched against whole-batch, both full steps, `--repeats` times each, alternating
  in the whole batch's process after its first step, on the sizes where it runs and micro-batching
  splits it (medians compared; goal >= 0.9).
Goal: micro-batched peak memory flat in the batch size: at most 1.2x from 16 to 256 sequences.
"""

from __future__ import annotations

import dataclasses
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)

VOCAB = 151_936


def synthetic_batch(sequences: int, length: int, prompt_len: int, vocab: int, seed: int):
    """A collated GRPO batch: random prompt and completion tokens, completions of length/2..length
    tokens."""
    import buffer

    rng = random.Random(seed)
    samples = []
    for i in range(sequences):
        n = rng.randint(max(1, length // 2), length)
        completion = [rng.randrange(3, vocab) for _ in range(n)]
        samples.append(
            buffer.Sample(
                [1] + [rng.randrange(3, 100) for _ in range(prompt_len - 1)],
                completion,
                [-12.0] * n,
                [0] * n,
                float(i % 2),
                rng.uniform(-1.0, 1.0),
            )
        )
    return buffer.collate(samples, 0)


def measure(
    model_path: str,
    sequences: int,
    length: int,
    budgets: list[int],
    max_micro_batches: int,
    prompt_len: int,
    threads: int,
    seed: int,
    checkpointing: bool = False,
) -> dict:
    """One configuration in this (fresh) process: build, then one trainer step per entry of
    `budgets` (its --micro-batch-tokens). Peak memory is the first step's (read right after it); the
    times of the later steps, by budget, give tokens/s (the first step also allocates the
    optimizer's state)."""
    import torch
    import torch.distributed as dist

    import config
    import update
    from trainer import models

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group(
        "gloo" if not cuda else "cpu:gloo,cuda:nccl",
        init_method=f"file://{init_file}",
        rank=0,
        world_size=1,
    )
    try:
        model = models.build_trainer_model(model_path, 1, device)
        if checkpointing:
            models.checkpoint_layers(model)
        # before any forward (FSDP2 pitfall)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        cfg = config.Config(max_new_tokens=length)
        batch = synthetic_batch(sequences, length, prompt_len, model.config.vocab_size, seed)
        planned = len(update.rank_micro_batches(batch, 0, 1, budgets[0]))
        run = planned
        # a one-row micro-batch, then the heaviest (see the docstring)
        if max_micro_batches and planned > 2:
            whole_plan = update.rank_micro_batches

            def shortest_row_then_heaviest(*args):
                mbs = whole_plan(*args)
                heaviest = max(
                    mbs, key=lambda mb: mb.attention_mask.numel() * mb.attention_mask.shape[1]
                )
                shortest = min(mbs, key=lambda mb: mb.attention_mask.shape[1])
                return [shortest.select([0]).trimmed(), heaviest]

            update.rank_micro_batches = shortest_row_then_heaviest
            run = 2
        ready = psutil.Process().memory_info().rss
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, peak, pad_frac = {}, None, None
        for step, budget in enumerate(budgets):
            start = time.perf_counter()
            result = update.update_on_batch(
                model,
                None,
                optimizer,
                batch,
                dataclasses.replace(cfg, micro_batch_tokens=budget),
                0,
                1,
                0,
                step,
                device,
            )
            if cuda:
                torch.cuda.synchronize()
            if step == 0:
                peak = (
                    torch.cuda.max_memory_allocated()
                    if cuda
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                )
                pad_frac = result.metrics["pad_frac"]
            elif run == planned:
                times.setdefault(budget, []).append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)
    tokens = int(batch.mask.sum())
    return {
        "sequences": sequences,
        "length": length,
        "micro_batch_tokens": budgets[0],
        "micro_batches": planned,
        "micro_batches_run": run,
        "full_step": run == planned,
        "grad_checkpointing": checkpointing,
        "completion_tokens": tokens,
        "padded_tokens": int(batch.attention_mask.numel()),
        "pad_frac": pad_frac,
        "peak_mib": peak / 2**20,
        "ready_mib": ready / 2**20,
        "memory": "cuda max_memory_allocated" if cuda else "process peak RSS",
        "step_s": {str(b): t for b, t in times.items()},
        "tokens_per_s": {str(b): tokens / statistics.median(t) for b, t in times.items()},
    }


def main(argv=None) -> int:
    p = common.parser(
        __doc__,
        smoke={
            "sequences": "2",
            "lengths": "8",
            "vocab": 512,
            "prompt_len": 4,
            "micro_batch_tokens": 16,
            "whole_max_tokens": 24,
        },
    )
    p.add_argument("--sequences", default="16,64,256", help="sequences per step, comma-separated")
    p.add_argument("--lengths", default="128,512,2048", help="completion lengths, comma-separated")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="default: the trainer's default"
    )
    p.add_argument(
        "--max-micro-batches",
        type=int,
        default=2,
        choices=(0, 2),
        help="2: a step of more micro-batches runs a one-row micro-batch and its heaviest; 0: all",
    )
    p.add_argument(
        "--whole-max-tokens",
        type=int,
        default=10240,
        help="run the whole-batch step where its padded tokens are at most this",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="full steps of each mode per tokens/s measurement"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="as the trainer's flag, in every measurement",
    )
    args = common.parse_args(p, argv)

    import config

    budget = (
        config.Config().micro_batch_tokens
        if args.micro_batch_tokens is None
        else args.micro_batch_tokens
    )
    threads = args.threads or len(os.sched_getaffinity(0))
    sequences = [int(x) for x in args.sequences.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, speed = [], []
    with common.Bench("memory", args) as bench:
        from tasks.builtin import build_tiny_model

        model = build_tiny_model(
            str(bench.work / "model"), seed=args.seed, alphabet="ascii", vocab_size=args.vocab
        )

        def child(n, length, budgets, max_mb):
            return common.in_child(
                measure,
                model,
                n,
                length,
                budgets,
                max_mb,
                args.prompt_len,
                threads,
                args.seed,
                args.grad_checkpointing,
                timeout_s=1800,
                what=f"step {n}x{length}",
            )

        for length in lengths:
            for n in sequences:
                r = child(n, length, [budget], args.max_micro_batches)
                rows.append(dict(r, mode="micro-batched"))
                print(
                    f"[memory] {n:4d} x {length:5d}: micro-batched peak {r['peak_mib']:7.0f} MiB "
                    f"({r['micro_batches_run']} of {r['micro_batches']} micro-batches)",
                    flush=True,
                )
                if n * (args.prompt_len + length) > args.whole_max_tokens:
                    continue
                # the whole batch: its peak (first step), then micro-batched and whole steps
                # alternating
                split = r["micro_batches"] > 1
                w = child(n, length, [0] + ([budget, 0] * args.repeats if split else []), 0)
                rows.append(dict(w, mode="whole batch"))
                print(
                    f"[memory] {n:4d} x {length:5d}: whole batch peak {w['peak_mib']:7.0f} MiB",
                    flush=True,
                )
                if split:
                    m, whole = w["tokens_per_s"][str(budget)], w["tokens_per_s"]["0"]
                    speed.append(
                        {
                            "sequences": n,
                            "length": length,
                            "micro_batches": r["micro_batches"],
                            "micro_tokens_per_s": m,
                            "whole_tokens_per_s": whole,
                            "ratio": m / whole,
                            "step_s": w["step_s"],
                        }
                    )
                    print(
                        f"[memory] {n:4d} x {length:5d}: {m:.0f} vs {whole:.0f} tokens/s, ratio "
                        f"{m / whole:.2f}",
                        flush=True,
                    )

    micro_rows = [r for r in rows if r["mode"] == "micro-batched"]
    flat = {}
    for length in lengths:
        by_n = {r["sequences"]: r["peak_mib"] for r in micro_rows if r["length"] == length}
        flat[str(length)] = by_n[max(by_n)] / by_n[min(by_n)]
    data = {
        "settings": {
            "vocab": args.vocab,
            "hidden": 128,
            "layers": 2,
            "prompt_len": args.prompt_len,
            "micro_batch_tokens": budget,
            "max_micro_batches": args.max_micro_batches,
            "whole_max_tokens": args.whole_max_tokens,
            "threads": threads,
            "seed": args.seed,
            "grad_checkpointing": args.grad_checkpointing,
            "sequences": sequences,
            "lengths": lengths,
        },
        "rows": rows,
        "speed": speed,
        "flatness": flat,
        "goals": {
            "flatness_max": max(flat.values()),
            "flatness_ok": max(flat.values()) <= 1.2,
            "speed_ratio_min": min((s["ratio"] for s in speed), default=None),
            "speed_ok": all(s["ratio"] >= 0.9 for s in speed) if speed else None,
        },
    }
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "sequences",
                "length",
                "mode",
                "micro-batches",
                "completion tokens",
                "pad_frac",
                "ready MiB",
                "peak MiB",
            ],
            [
                [
                    r["sequences"],
                    r["length"],
                    r["mode"],
                    f"{r['micro_batches_run']} of {r['micro_batches']}"
                    if not r["full_step"]
                    else r["micro_batches"],
                    r["completion_tokens"],
                    r["pad_frac"],
                    r["ready_mib"],
                    r["peak_mib"],
                ]
                for r in rows
            ],
            title=f"peak memory of a trainer step (vocabulary {args.vocab:,}, --micro-batch-tokens "
            f"{budget})",
        )
    )
    print()
    print(
        common.table(
            ["length", "peak 256 / peak 16 sequences (goal <= 1.2)"],
            [[k, v] for k, v in flat.items()],
        )
    )
    if speed:
        print()
        print(
            common.table(
                [
                    "sequences",
                    "length",
                    "micro-batches",
                    "micro-batched tok/s",
                    "whole-batch tok/s",
                    "ratio (goal >= 0.9)",
                ],
                [
                    [
                        s["sequences"],
                        s["length"],
                        s["micro_batches"],
                        s["micro_tokens_per_s"],
                        s["whole_tokens_per_s"],
                        s["ratio"],
                    ]
                    for s in speed
                ],
            )
        )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for mode, style in (("micro-batched", "-o"), ("whole batch", "--s")):
        for length in data["settings"]["lengths"]:
            pts = sorted(
                (r["sequences"], r["peak_mib"])
                for r in data["rows"]
                if r["mode"] == mode and r["length"] == length
            )
            if not pts:
                continue
            line = ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                style,
                color=colors.get(length),
                label=f"{mode}, completions <= {length}",
            )[0]
            colors.setdefault(length, line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks(data["settings"]["sequences"], [str(s) for s in data["settings"]["sequences"]])
    ax.set_xlabel("sequences per step")
    ax.set_ylabel(f"peak MiB ({data['rows'][0]['memory']})")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"trainer step memory, vocabulary {data['settings']['vocab']:,} "
        f"(--micro-batch-tokens {data['settings']['micro_batch_tokens']})",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    common.save_figure(fig, path, data, "memory")


if __name__ == "__main__":
    sys.exit(main())
