"""bench/dtype.py — is bf16 faster than fp32 on this machine? Trainer step and vLLM generation, side
by side.

    # writes DIR/dtype.json and DIR/dtype.png; ~5 min on 2 cores
    python bench/dtype.py --out DIR
    # the suite's size (tests/test_bench.py): tiny, 2 x 16 tokens, 1 step, 4 prompts x 8 tokens,
    # --repeats 1, runs of 12 steps
    python bench/dtype.py --smoke --out DIR

What `--dtype auto` picks on the CPU path (devices.CPU_DEFAULT_DTYPE) is decided from this
benchmark. For each model size (random-init Qwen2/Llama from `tasks/builtin.build_tiny_model`,
alphabet "ascii" so sequences can be long), in alternating order fp32, bf16, fp32, bf16 (`--repeats`
rounds; drift on a shared machine cancels
to first order):
- trainer: `models.build_trainer_model(compute_dtype=...)` (FSDP2, world size 1, with bf16 the
  mixed-precision policy: bf16 compute, fp32 master weights and gradient reduction), AdamW; a step =
  forward, log-softmax of the targets, a policy-gradient loss, backward, optimizer step, on a batch
  of random token ids; `--train-batch` sequences x `--train-len` tokens; tokens/s after `--warmup`
  steps.
- generator: vLLM 0.32 (`LLM`, engine in-process, eager, the dtype asked for), `--gen-prompts`
  prompts of 16 tokens, each completed to `--gen-tokens` tokens (ignore_eos); tokens/s of the second
  of two identical calls.
Each measurement runs in a fresh child process with the thread count the default run gives each
side. ratio = bf16 tokens/s / fp32 tokens/s (> 1: bf16 faster).
Then the default run made strictly on-policy, so that every step measures the agreement,
`python train.py --steps N --max-lag 0 --dtype fp32|bf16` (N = --run-steps; fp32, bf16, fp32, bf16):
steps/s after its first 10 steps, the reward reached, the log-prob difference between the trainer
and the generator on on-policy tokens, and the bytes of one sync.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)

# name -> build_tiny_model sizes (alphabet "ascii": 100 tokens, 1024 positions)
SIZES = {"tiny": {}, "4M": {"hidden": 256, "layers": 4, "heads": 4}}
DTYPES = ("fp32", "bf16")


def train_rate(
    model_path: str,
    dtype: str,
    threads: int,
    batch: int,
    length: int,
    steps: int,
    warmup: int,
    seed: int,
) -> dict:
    """Tokens/s of full trainer steps (in a child process)."""
    import torch
    import torch.distributed as dist

    from infra import devices
    from trainer import models

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(model_path, 1, compute_dtype=devices.torch_dtype(dtype))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        vocab = model.config.vocab_size
        ids = torch.randint(3, vocab, (batch, length))
        advantages = torch.randn(batch)
        times = []
        for _ in range(warmup + steps):
            t = time.perf_counter()
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logp * advantages[:, None]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)
    measured = times[warmup:]
    return {
        "tokens_per_s": batch * (length - 1) * len(measured) / sum(measured),
        "step_ms_median": statistics.median(measured) * 1e3,
    }


def generate_rate(
    model_path: str, dtype: str, threads: int, prompts: int, tokens: int, seed: int
) -> dict:
    """Tokens/s of vLLM generation (in a child process: vLLM binds its threads for good)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: a quick start
    os.environ["OMP_NUM_THREADS"] = str(threads)

    from vllm import LLM, SamplingParams

    from infra import devices

    llm = LLM(
        model=model_path,
        dtype=devices.torch_dtype(dtype),
        seed=seed,
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=False,
    )
    rng = random.Random(seed)
    batch = [
        {"prompt_token_ids": [rng.randrange(3, 100) for _ in range(16)]} for _ in range(prompts)
    ]
    params = SamplingParams(
        max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0, seed=seed
    )
    llm.generate(batch, params, use_tqdm=False)  # warm-up: the same work once
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()
    return {"tokens_per_s": produced / elapsed, "tokens": produced}


def main(argv=None) -> int:
    p = common.parser(
        __doc__,
        sizes=SIZES,
        smoke={
            "sizes": "tiny",
            "train_batch": 2,
            "train_len": 16,
            "steps": 1,
            "warmup": 1,
            "gen_prompts": 4,
            "gen_tokens": 8,
            "repeats": 1,
            "run_steps": 12,
        },
    )
    p.add_argument("--train-batch", type=int, default=16, help="sequences per trainer step")
    p.add_argument(
        "--train-len", type=int, default=128, help="tokens per sequence in a trainer step"
    )
    p.add_argument("--steps", type=int, default=6, help="trainer steps measured, after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gen-prompts", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument(
        "--run-steps", type=int, default=60, help="steps of each whole default run (0: none)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="rounds of fp32 then bf16: trainer steps, whole runs"
    )
    args = common.parse_args(p, argv, sizes=SIZES)
    rows = []
    with common.Bench("dtype", args) as bench:
        resolved = common.default_config()
        gen_threads, train_threads = resolved.gen_threads, resolved.train_threads
        for name in args.sizes:
            model = common.build_model(
                bench.work / f"model_{name}", seed=args.seed, alphabet="ascii", **SIZES[name]
            )
            runs = {(side, d): [] for side in ("train", "generate") for d in DTYPES}
            for _ in range(args.repeats):
                for d in DTYPES:
                    runs["train", d].append(
                        common.in_child(
                            train_rate,
                            model,
                            d,
                            train_threads,
                            args.train_batch,
                            args.train_len,
                            args.steps,
                            args.warmup,
                            args.seed,
                            timeout_s=600,
                            what=f"trainer {d}",
                            in_session=True,
                        )["tokens_per_s"]
                    )
            # one engine per dtype: a start costs ~10 s, and two calls are timed inside
            for d in DTYPES:
                runs["generate", d].append(
                    common.in_child(
                        generate_rate,
                        model,
                        d,
                        gen_threads,
                        args.gen_prompts,
                        args.gen_tokens,
                        args.seed,
                        timeout_s=600,
                        what=f"vLLM {d}",
                    )["tokens_per_s"]
                )
            row = {"name": name, "params": common.count_params(model)}
            for side in ("train", "generate"):
                for d in DTYPES:
                    row[f"{side}_{d}"] = statistics.fmean(runs[side, d])
                    row[f"{side}_{d}_runs"] = runs[side, d]
                row[f"{side}_ratio"] = row[f"{side}_bf16"] / row[f"{side}_fp32"]
            rows.append(row)
            print(
                f"[dtype] {name}: trainer fp32 {row['train_fp32']:.0f} / bf16 "
                f"{row['train_bf16']:.0f} tok/s "
                f"(x{row['train_ratio']:.2f}); vLLM fp32 {row['generate_fp32']:.0f} / bf16 "
                f"{row['generate_bf16']:.0f} tok/s (x{row['generate_ratio']:.2f})",
                flush=True,
            )
        runs = whole_runs(bench.work, args.run_steps, args.repeats) if args.run_steps else []
    data = {
        "settings": {
            "sizes": args.sizes,
            "run_steps": args.run_steps,
            "train_batch": args.train_batch,
            "train_len": args.train_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "gen_prompts": args.gen_prompts,
            "gen_tokens": args.gen_tokens,
            "gen_threads": gen_threads,
            "train_threads": train_threads,
            "seed": args.seed,
        },
        "rows": rows,
        "runs": runs,
    }
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "model",
                "params",
                "trainer fp32 tok/s",
                "trainer bf16 tok/s",
                "bf16/fp32",
                "vLLM fp32 tok/s",
                "vLLM bf16 tok/s",
                "bf16/fp32",
            ],
            [
                [
                    r["name"],
                    f"{r['params'] / 1e6:.2f}M",
                    r["train_fp32"],
                    r["train_bf16"],
                    r["train_ratio"],
                    r["generate_fp32"],
                    r["generate_bf16"],
                    r["generate_ratio"],
                ]
                for r in rows
            ],
        )
    )
    if runs:
        print()
        print(
            common.table(
                [
                    "default run",
                    "steps/s",
                    "bf16/fp32",
                    "reward last 20%",
                    "logprob diff max",
                    "logprob diff mean",
                    "MB per sync",
                ],
                [
                    [
                        r["dtype"],
                        r["steps_per_s"],
                        r["steps_per_s"] / runs[0]["steps_per_s"],
                        r["reward_last20"],
                        r["logprob_diff_max"],
                        r["logprob_diff_mean"],
                        r["sync_mb"],
                    ]
                    for r in runs
                ],
            )
        )
    print(bench.closing_line(path))
    return 0


def whole_runs(work: Path, steps: int, repeats: int) -> list[dict]:
    """The default run in each dtype, `repeats` times, alternating; one row per dtype (rates
    averaged)."""
    measured = {d: [] for d in DTYPES}
    for i in range(repeats):
        for d in DTYPES:
            got = common.run_train_cli(
                work / f"run_{d}_{i}",
                ["--steps", str(steps), "--dtype", d, "--max-lag", "0", "--log-every", str(steps)],
            )
            rows = got["rows"]
            diffs = [
                r["logprob_diff_on_policy"] for r in rows if r["logprob_diff_on_policy"] is not None
            ]
            means = [r["logprob_diff_mean"] for r in rows if r.get("logprob_diff_mean") is not None]
            measured[d].append(
                {
                    "steps_per_s": common.steady(rows, 10)["steps_per_s"],
                    "reward_last20": got["summary"]["reward_last20"],
                    "logprob_diff_max": max(diffs),
                    "logprob_diff_mean": statistics.fmean(means),
                    "sync_mb": got["summary"]["sync_mb"],
                }
            )
            print(f"[dtype] default run {d}: {measured[d][-1]}", flush=True)
    return [
        {
            "dtype": d,
            **{k: statistics.fmean(m[k] for m in measured[d]) for k in measured[d][0]},
            "runs": measured[d],
        }
        for d in DTYPES
    ]


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["train_ratio"] for r in rows], 0.4, label="trainer step")
    ax.bar([i + 0.2 for i in x], [r["generate_ratio"] for r in rows], 0.4, label="vLLM generation")
    ax.axhline(1.0, color="#999999", lw=1)
    ax.set_xticks(list(x), [f"{r['name']} ({r['params'] / 1e6:.2f}M params)" for r in rows])
    ax.set_ylabel("bf16 tokens/s / fp32 tokens/s")
    ax.set_title("bf16 against fp32 (> 1: bf16 faster)")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "dtype")


if __name__ == "__main__":
    sys.exit(main())
