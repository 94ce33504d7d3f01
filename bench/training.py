"""bench/training.py — what does the trainer cost on top of a bare FSDP2 loop? Tokens/s.

    python bench/training.py --out DIR        # writes DIR/trainer.json and DIR/trainer.png
    # the suite's size (tests/test_bench.py): tiny, --steps 6 --warmup 2
    python bench/training.py --smoke --out DIR

1. Batches: the real generator (`rollout.generator_main`) produces `--steps` steps of rollouts on
   the default task (32 prompts x 8 completions), recorded once.
2. For each model size (the default tiny model, and a larger one built with the project's
   `tasks/builtin.build_tiny_model`), in this order, on those same batches, with the trainer's
   thread budget:
   - bare: a plain FSDP2 loop (`models.build_trainer_model`, AdamW): forward, log-softmax of the
     targets, a policy-gradient loss, backward, step. Batches are collated beforehand and not timed.
   - project: the real trainer (`train.trainer_main`, rank 0 of 1) fed from a queue that is never
     empty: taking groups off the queue, advantages, collation, sampling-consistent log-probs,
     behaviour-policy correction, GRPO loss, gradient clipping, agreement statistics, AdamW step,
     publishing the weights into the shared buffer, metrics.
   - bare again (the bare rate is the mean of the two, so drift on a shared machine cancels to first
     order).
Rates are completion tokens/s over the steps after `--warmup`; ratio = project / bare (goal >=
0.90).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import stages_alone  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)

# name -> build_tiny_model sizes (None: the default tiny model)
SIZES = {"tiny": None, "4M": {"hidden": 256, "layers": 4, "heads": 4}}


def bare_loop(
    model_path: str, groups: list, prompts_per_step: int, lr: float, threads: int, seed: int
) -> dict:
    """A plain FSDP2 training loop on the given groups (in a child process)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import buffer
    from advantages import group_advantages
    from trainer import models

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(model_path, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
        batches = []
        for k in range(len(groups) // prompts_per_step):
            gs = groups[k * prompts_per_step : (k + 1) * prompts_per_step]
            adv = group_advantages(torch.tensor([g.rewards for g in gs], dtype=torch.float32))
            batches.append(buffer.collate(buffer.to_samples(gs, adv), pad_id))
        times, tokens = [], []
        for b in batches:
            t = time.perf_counter()
            logits = (
                model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
            )
            logp = torch.log_softmax(logits, -1).gather(-1, b.targets[..., None])[..., 0]
            loss = -(logp * b.advantages[:, None] * b.mask).sum() / b.mask.sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
            tokens.append(int(b.mask.sum()))
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return {"step_s": times, "tokens": tokens}


def rate(step_s: list[float], tokens: list[int], warmup: int) -> dict:
    s, t = step_s[warmup:], tokens[warmup:]
    return {
        "tokens_per_s": sum(t) / sum(s),
        "step_ms_mean": statistics.fmean(s) * 1e3,
        "step_ms_median": statistics.median(s) * 1e3,
        "tokens_per_step": statistics.fmean(t),
    }


def main(argv=None) -> int:
    p = common.parser(__doc__, sizes=SIZES, smoke={"sizes": "tiny", "steps": 6, "warmup": 2})
    p.add_argument(
        "--steps", type=int, default=25, help="batches (optimizer steps) per measurement"
    )
    p.add_argument("--warmup", type=int, default=5, help="first steps of each measurement left out")
    args = common.parse_args(p, argv, sizes=SIZES)
    rows = []
    with common.Bench("trainer", args) as bench:
        work = bench.work
        base = common.build_model(work / "model_tiny", seed=args.seed)
        cfg = common.default_config(model=base, seed=args.seed, steps=args.steps)
        threads = cfg.train_threads
        gen = stages_alone.generate_alone(cfg, base, steps=args.steps)
        groups = gen["groups"]
        print(f"[trainer] recorded {len(groups)} groups from the generator", flush=True)
        for name in args.sizes:
            model = (
                base
                if SIZES[name] is None
                else common.build_model(work / f"model_{name}", seed=args.seed, **SIZES[name])
            )
            run_cfg = common.default_config(model=model, seed=args.seed, steps=args.steps)
            bare = []
            b = common.in_child(
                bare_loop,
                model,
                groups,
                cfg.prompts_per_step,
                cfg.lr,
                threads,
                args.seed,
                timeout_s=600,
                what="bare FSDP2 loop",
                in_session=True,
            )
            bare.append(rate(b["step_s"], b["tokens"], args.warmup))
            metrics = stages_alone.train_alone(run_cfg, model, groups, work / f"project_{name}")
            walls = [r["wall_s"] for r in metrics]
            step_s = common.intervals(walls, 1)  # per-step wall time, from the end of step 0 on
            proj = rate([walls[0]] + step_s, [r["tokens"] for r in metrics], args.warmup)
            window = metrics[args.warmup :]
            proj["take_ms_mean"] = statistics.fmean(r["trainer_wait_s"] for r in window) * 1e3
            proj["train_ms_mean"] = statistics.fmean(r["train_s"] for r in window) * 1e3
            proj["publish_ms_mean"] = statistics.fmean(r["publish_ms"] for r in window)
            b = common.in_child(
                bare_loop,
                model,
                groups,
                cfg.prompts_per_step,
                cfg.lr,
                threads,
                args.seed,
                timeout_s=600,
                what="bare FSDP2 loop",
                in_session=True,
            )
            bare.append(rate(b["step_s"], b["tokens"], args.warmup))
            bare_rate = statistics.fmean(x["tokens_per_s"] for x in bare)
            row = {
                "name": name,
                "params": common.count_params(model),
                "threads": threads,
                "bare_tokens_per_s": bare_rate,
                "project_tokens_per_s": proj["tokens_per_s"],
                "ratio": proj["tokens_per_s"] / bare_rate,
                "bare": bare,
                "project": proj,
            }
            rows.append(row)
            print(
                f"[trainer] {name}: bare {bare_rate:.0f} tok/s ({bare[0]['tokens_per_s']:.0f}, "
                f"{bare[1]['tokens_per_s']:.0f}), project {proj['tokens_per_s']:.0f} tok/s, "
                f"ratio {row['ratio']:.2f}",
                flush=True,
            )
    data = {
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "sizes": args.sizes,
            "seed": args.seed,
            "threads": threads,
            "train_ranks": 1,
            "workload": "default task; 32 prompts x 8 completions per batch, recorded from the "
            "generator",
        },
        "ratio": rows[0]["ratio"],
        "rows": rows,
    }
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "model",
                "params",
                "bare tok/s",
                "project tok/s",
                "ratio",
                "bare ms/step",
                "project ms/step",
                "of which: take from queue",
                "publish",
            ],
            [
                [
                    r["name"],
                    f"{r['params'] / 1e6:.2f}M",
                    r["bare_tokens_per_s"],
                    r["project_tokens_per_s"],
                    r["ratio"],
                    statistics.fmean(x["step_ms_mean"] for x in r["bare"]),
                    r["project"]["step_ms_mean"],
                    r["project"]["take_ms_mean"],
                    r["project"]["publish_ms_mean"],
                ]
                for r in rows
            ],
        )
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar(
        [i - 0.2 for i in x],
        [r["bare_tokens_per_s"] for r in rows],
        0.4,
        color="#999999",
        label="bare FSDP2 loop",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [r["project_tokens_per_s"] for r in rows],
        0.4,
        color="#1f77b4",
        label="project trainer",
    )
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["project_tokens_per_s"], f"{r['ratio']:.2f}", ha="center", va="bottom")
    ax.set_xticks(list(x), [f"{r['name']} ({r['params'] / 1e6:.2f}M params)" for r in rows])
    ax.set_ylabel("trained completion tokens / s")
    ax.set_title("trainer overhead (goal: ratio >= 0.90)")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "trainer")


if __name__ == "__main__":
    sys.exit(main())
