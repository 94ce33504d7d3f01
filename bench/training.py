"""bench/training.py — the trainer's cost: against a bare FSDP2 loop, and in bf16 against fp32.

    python bench/training.py [--what trainer] --out DIR   # DIR/trainer.json and trainer.png
    python bench/training.py --what dtype --out DIR       # DIR/dtype.json and dtype.png; ~5 min
    # the suite's sizes (tests/test_bench.py): tiny; trainer: --steps 6 --warmup 2; dtype: 2 x 16
    # tokens, 1 step, 4 prompts x 8 tokens, --repeats 1, runs of 12 steps
    python bench/training.py [--what NAME] --smoke --out DIR

`trainer`: what does the trainer cost on top of a bare FSDP2 loop? The real generator
(`rollout.generator_main`) records `--steps` steps of rollouts on the default task (32 prompts x 8
completions) once; for each model size (the default tiny model, and a larger `build_tiny_model`), on
those batches, with the trainer's thread budget: bare (a plain FSDP2 loop: forward, log-softmax of
the targets, a policy-gradient loss, backward, AdamW step; batches collated beforehand, not timed),
then project (the real `train.trainer_main`, rank 0 of 1, fed from a queue never empty: advantages,
collation, log-probs, corrections, GRPO loss, clipping, statistics, AdamW, the publish, metrics),
then bare again (the bare rate is the mean of the two: drift cancels to first order). Completion
tokens/s after `--warmup` steps; ratio = project / bare (goal >= 0.90).

`dtype`: is bf16 faster than fp32 here? (`--dtype auto`'s CPU choice, devices.CPU_DEFAULT_DTYPE, is
decided from it.) For each size (alphabet "ascii", so sequences can be long), fp32 and bf16
alternating `--repeats` rounds, each in a fresh child with the default run's thread counts:
- trainer: `models.build_trainer_model(compute_dtype=...)` (with bf16 the mixed-precision policy:
  bf16 compute, fp32 master weights and reduction), the bare step above on `--train-batch` x
  `--train-len` random tokens; tokens/s after `--warmup` steps.
- generator: vLLM (`LLM`, in-process, eager) completing `--gen-prompts` prompts of 16 tokens to
  `--gen-tokens` (ignore_eos); tokens/s of the second of two identical calls.
ratio = bf16 / fp32 tokens/s. Then the default run on policy (every step measures the agreement),
`python train.py --steps N --max-lag 0 --dtype fp32|bf16` (N = --run-steps, alternating): steps/s
after its first 10 steps, the reward, the trainer-generator log-prob difference, one sync's bytes.
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
import overlap  # noqa: E402  (the stages alone: generation without training, and the reverse)

# torch, vLLM and the project are imported in the functions that run in child processes
TRAINER_SIZES = {"tiny": None, "4M": {"hidden": 256, "layers": 4, "heads": 4}}
DTYPE_SIZES = {"tiny": {}, "4M": {"hidden": 256, "layers": 4, "heads": 4}}
DTYPES = ("fp32", "bf16")


def plain_steps(model_path: str, batches, threads: int, seed: int, dtype=None) -> list[float]:
    """A plain FSDP2 loop over `batches` (in a child): each step's seconds. A batch is the
    collated one of the project, or a tensor of token ids with advantages (`(ids, advantages)`)."""
    import torch
    import torch.distributed as dist

    from infra import devices
    from trainer import models

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    build = {"compute_dtype": devices.torch_dtype(dtype)} if dtype else {}
    init = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(model_path, 1, **build)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        times = []
        for b in batches:
            t = time.perf_counter()
            if isinstance(b, tuple):  # random ids: every position a target
                ids, adv = b
                mask, mask_sum, targets, attention = 1.0, ids[:, 1:].numel(), ids[:, 1:], None
            else:
                ids, adv, mask, targets = b.input_ids, b.advantages, b.mask, b.targets
                mask_sum, attention = b.mask.sum(), b.attention_mask
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
            (-(logp * adv[:, None] * mask).sum() / mask_sum).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
    finally:
        dist.destroy_process_group()
        if os.path.exists(init):
            os.unlink(init)
    return times


def collated(model_path: str, groups: list, prompts_per_step: int) -> list:
    """The recorded groups as the trainer's batches, `prompts_per_step` groups each."""
    import torch
    from transformers import AutoTokenizer

    import buffer
    from advantages import group_advantages

    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
    batches = []
    for k in range(len(groups) // prompts_per_step):
        gs = groups[k * prompts_per_step : (k + 1) * prompts_per_step]
        adv = group_advantages(torch.tensor([g.rewards for g in gs], dtype=torch.float32))
        batches.append(buffer.collate(buffer.to_samples(gs, adv), pad_id))
    return batches


def rate(step_s: list[float], tokens: list[int], warmup: int) -> dict:
    s, t = step_s[warmup:], tokens[warmup:]
    return {
        **{"tokens_per_s": sum(t) / sum(s), "step_ms_mean": statistics.fmean(s) * 1e3},
        **{"step_ms_median": statistics.median(s) * 1e3, "tokens_per_step": statistics.fmean(t)},
    }


def trainer(argv=None) -> int:
    """`--what trainer`: the project's trainer against the bare loop, on recorded batches."""
    p = common.parser(
        __doc__, sizes=TRAINER_SIZES, smoke={"sizes": "tiny", "steps": 6, "warmup": 2}
    )
    p.add_argument("--steps", type=int, default=25, help="batches (optimizer steps) each")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each left out")
    args = common.parse_args(p, argv, sizes=TRAINER_SIZES)
    rows = []
    with common.Bench("trainer", args) as bench:
        base = common.build_model(bench.work / "model_tiny", seed=args.seed)
        cfg = common.default_config(model=base, seed=args.seed, steps=args.steps)
        groups = overlap.generate_alone(cfg, base, steps=args.steps)["groups"]
        print(f"[trainer] recorded {len(groups)} groups from the generator", flush=True)
        for name in args.sizes:
            sizes = TRAINER_SIZES[name]
            model = base if sizes is None else common.build_model(bench.work / name, **sizes)
            rows.append(trainer_row(name, model, groups, args, bench.work))
    settings = {"steps": args.steps, "warmup": args.warmup, "sizes": args.sizes, "seed": args.seed}
    settings.update(threads=cfg.train_threads, train_ranks=1)
    settings["workload"] = "default task; 32 prompts x 8 completions per batch, recorded"
    data = {"settings": settings, "ratio": rows[0]["ratio"], "rows": rows}
    path = bench.save(data, lambda d, p: bars_of(d, p, "bare_tokens_per_s project_tokens_per_s"))
    for r in rows:
        r.update({f"project_{k}": v for k, v in r["project"].items()})
    keys = "name params bare_tokens_per_s project_tokens_per_s ratio project_step_ms_mean"
    print(common.table_of(rows, f"{keys} project_take_ms_mean project_publish_ms_mean"))
    print(bench.closing_line(path))
    return 0


def trainer_row(name: str, model: str, groups: list, args, work: Path) -> dict:
    """Bare, project, bare again, for one model."""
    cfg = common.default_config(model=model, seed=args.seed, steps=args.steps)
    batches = collated(model, groups, cfg.prompts_per_step)
    tokens = [int(b.mask.sum()) for b in batches]

    def bare_rate():
        steps = (model, batches, cfg.train_threads, args.seed)
        return rate(common.in_child(plain_steps, *steps, in_session=True), tokens, args.warmup)

    bare = [bare_rate()]
    metrics = overlap.train_alone(cfg, model, groups, work / f"project_{name}")
    bare.append(bare_rate())
    walls = [r["wall_s"] for r in metrics]
    step_s = [walls[0]] + common.intervals(walls, 1)  # per-step wall time, from the end of step 0
    proj = rate(step_s, [r["tokens"] for r in metrics], args.warmup)
    window = metrics[args.warmup :]
    proj["take_ms_mean"] = statistics.fmean(r["trainer_wait_s"] for r in window) * 1e3
    proj["train_ms_mean"] = statistics.fmean(r["train_s"] for r in window) * 1e3
    proj["publish_ms_mean"] = statistics.fmean(r["publish_ms"] for r in window)
    bare_rate = statistics.fmean(x["tokens_per_s"] for x in bare)
    row = {"name": name, "params": common.count_params(model), "threads": cfg.train_threads}
    row.update(bare_tokens_per_s=bare_rate, project_tokens_per_s=proj["tokens_per_s"])
    row.update(ratio=proj["tokens_per_s"] / bare_rate, bare=bare, project=proj)
    print(f"[trainer] {name}: bare {bare_rate:.0f}, project {proj['tokens_per_s']:.0f} tok/s")
    return row


def generate_rate(model_path: str, dtype: str, threads: int, prompts: int, tokens: int) -> float:
    """Tokens/s of vLLM generation (in a child process: vLLM binds its threads for good)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: a quick start
    os.environ["OMP_NUM_THREADS"] = str(threads)
    from vllm import LLM, SamplingParams

    from infra import devices

    llm = LLM(
        model=model_path,
        dtype=devices.torch_dtype(dtype),
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    batch = [
        {"prompt_token_ids": [rng.randrange(3, 100) for _ in range(16)]} for _ in range(prompts)
    ]
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate(batch, params, use_tqdm=False)  # warm-up: the same work once
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    llm.llm_engine.engine_core.shutdown()
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed


def dtype_rates(model: str, args, resolved) -> dict:
    """{(side, dtype): [tokens/s of each round]} for the trainer step and vLLM generation."""
    import torch

    runs = {(side, d): [] for side in ("train", "generate") for d in DTYPES}
    ids = torch.randint(3, 100, (args.train_batch, args.train_len))
    batches = [(ids, torch.randn(args.train_batch))] * (args.warmup + args.steps)
    for _ in range(args.repeats):
        for d in DTYPES:
            steps = (model, batches, resolved.train_threads, args.seed, d)
            s = common.in_child(plain_steps, *steps, what=f"trainer {d}", in_session=True)
            s = s[args.warmup :]
            runs["train", d].append(args.train_batch * (args.train_len - 1) * len(s) / sum(s))
    for d in DTYPES:  # one engine per dtype: a start costs ~10 s; two calls are timed inside
        size = (resolved.gen_threads, args.gen_prompts, args.gen_tokens)
        runs["generate", d].append(
            common.in_child(generate_rate, model, d, *size, timeout_s=600, what=f"vLLM {d}")
        )
    return runs


def dtype(argv=None) -> int:
    """`--what dtype`: bf16 against fp32, the trainer's step, vLLM and whole default runs."""
    smoke = {"sizes": "tiny", "train_batch": 2, "train_len": 16, "steps": 1, "warmup": 1}
    smoke.update(gen_prompts=4, gen_tokens=8, repeats=1, run_steps=12)
    p = common.parser(__doc__, sizes=DTYPE_SIZES, smoke=smoke)
    p.add_argument("--train-batch", type=int, default=16, help="sequences per trainer step")
    p.add_argument("--train-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=6, help="trainer steps measured, after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gen-prompts", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--run-steps", type=int, default=60, help="steps of each default run (0: none)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of fp32 then bf16")
    args = common.parse_args(p, argv, sizes=DTYPE_SIZES)
    rows = []
    with common.Bench("dtype", args) as bench:
        resolved = common.default_config()
        for name in args.sizes:
            sizes = DTYPE_SIZES[name]
            model = common.build_model(bench.work / name, seed=args.seed, alphabet="ascii", **sizes)
            runs = dtype_rates(model, args, resolved)
            row = {"name": name, "params": common.count_params(model)}
            for side in ("train", "generate"):
                for d in DTYPES:
                    row[f"{side}_{d}"] = statistics.fmean(runs[side, d])
                    row[f"{side}_{d}_runs"] = runs[side, d]
                row[f"{side}_ratio"] = row[f"{side}_bf16"] / row[f"{side}_fp32"]
            rows.append(row)
        runs = whole_runs(bench.work, args.run_steps, args.repeats) if args.run_steps else []
    keys = "sizes run_steps train_batch train_len steps warmup gen_prompts gen_tokens seed"
    settings = {k: getattr(args, k) for k in keys.split()}
    settings.update(gen_threads=resolved.gen_threads, train_threads=resolved.train_threads)
    data = {"settings": settings, "rows": rows, "runs": runs}
    path = bench.save(data, lambda d, p: bars_of(d, p, "train_ratio generate_ratio"))
    keys = "name params train_fp32 train_bf16 train_ratio generate_fp32 generate_bf16"
    print(common.table_of(rows, f"{keys} generate_ratio", "tokens/s; ratio: bf16 / fp32"))
    keys = "dtype steps_per_s reward_last20 logprob_diff_max logprob_diff_mean sync_mb"
    print(common.table_of(runs, keys, "the default run, on policy"))
    print(bench.closing_line(path))
    return 0


def whole_runs(work: Path, steps: int, repeats: int) -> list[dict]:
    """The default run in each dtype, `repeats` times, alternating; a row per dtype (means)."""
    measured = {d: [] for d in DTYPES}
    for i in range(repeats):
        for d in DTYPES:
            flags = ["--steps", str(steps), "--dtype", d, "--max-lag", "0"]
            got = common.run_train_cli(work / f"run_{d}_{i}", [*flags, "--log-every", str(steps)])
            rows = got["rows"]
            diffs = [r["logprob_diff_on_policy"] for r in rows]
            means = [r.get("logprob_diff_mean") for r in rows]
            measured[d].append(
                {
                    "steps_per_s": common.steady(rows, 10)["steps_per_s"],
                    "reward_last20": got["summary"]["reward_last20"],
                    "logprob_diff_max": max(x for x in diffs if x is not None),
                    "logprob_diff_mean": statistics.fmean(x for x in means if x is not None),
                    "sync_mb": got["summary"]["sync_mb"],
                }
            )
    return [
        {
            "dtype": d,
            **{k: statistics.fmean(m[k] for m in measured[d]) for k in measured[d][0]},
            "runs": measured[d],
        }
        for d in DTYPES
    ]


def bars_of(data: dict, path: Path, keys: str) -> None:
    """One bar per (row, key) of the figures `keys`."""
    values = {f"{r['name']} {k}": [r[k]] for r in data["rows"] for k in keys.split()}
    common.bars(data, path, data["benchmark"], values, ylabel="")


def main(argv=None) -> int:
    return common.dispatch(__doc__, {"trainer": trainer, "dtype": dtype}, argv)


if __name__ == "__main__":
    sys.exit(main())
