"""bench/moe.py — routing replay at bf16 on a tiny MoE: mismatch_k3 and router agreement with and
without --router-replay, beside the dense tiny model, and what carrying routes costs.

    # writes DIR/moe.json and DIR/moe.png; ~10 min on 2 quiet cores
    python bench/moe.py --out DIR
    # the suite's size (tests/test_bench.py): 3 steps a run, small cost loops
    python bench/moe.py --smoke --out DIR

Four runs of `python train.py` with the same seed, --dtype bf16 and --max-lag 0 (strictly on policy:
every token was sampled by the weights the trainer scores it with, so mismatch_k3 is the
generator/trainer mismatch alone, no policy change in it), on the built-in copy task:
    plain   the tiny random-init Qwen3-MoE (`--model TINY_MOE`: 8 experts, 2 per token), no routes
            recorded
    record  the same with --router-record: routes recorded and compared (router/agreement), not
            replayed
    replay  the same with --router-replay: the trainer runs the generator's experts
    dense   the default dense tiny model: the floor bf16 kernels alone leave
Per run, over its steps: mismatch_k3 (mean and median), router/agreement, router/missing, the
largest per-token |trainer - generator| log-prob on policy, the reward, the trainer's step time and
the generator's tokens/s. ratio = mismatch_k3 without replay (record) / with it (replay); the same
for plain / replay. Runs that replay and runs that do not train differently (their weights part
after step 0), so their figures also differ by what each trained into; the paired measurement below
compares the two on the very same tokens. Paired, in a child process: vLLM (bf16, the worker's route
recording) samples --paired-prompts copy prompts x 8 completions of exactly N tokens (N = 5, the
copy task's, and --paired-tokens); the trainer's model (`models.build_trainer_model`, bf16 compute)
scores them twice, its routers live, then replaying the recorded routes
(`update.completion_logprobs` inside `replay.routed_by`): mismatch_k3 and max |delta log p| of each,
on the tiny MoE's initial weights and (not at the smoke size) on the weights the replay run ended
with. The cost of carrying routes, measured in this process on groups shaped as the runs' (8 samples
of 5 + 5 tokens, routes of 2 layers x top-2) and as a Qwen3-30B-A3B's would be (48 layers x top-8,
128 experts, 8 samples of 512 + 512 tokens): bytes per token; a group's time through a rollout queue
(pickled by the sender's feeder thread, unpickled by the receiver: put + get), and the collation of
a batch of 32 such groups (`buffer.collate`), each with and without routes (medians of --repeats).

Touches only its scratch folder, --out and, for the paired measurement, a vLLM engine of its own
(shut down before scoring) and a temporary file for the process group.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# the project and torch are imported inside the functions (common.setup_paths)

RUNS = {"plain": [], "record": ["--router-record"], "replay": ["--router-replay"], "dense": []}
SHAPES = {
    "tiny": {"layers": 2, "top_k": 2, "experts": 8, "prompt": 5, "completion": 5},
    "30B-A3B": {"layers": 48, "top_k": 8, "experts": 128, "prompt": 512, "completion": 512},
}


def summarize(rows: list[dict]) -> dict:
    """A run's figures over its steps (None where a run has no such metric: the dense and plain
    runs' routes)."""

    def values(key):
        return [r[key] for r in rows if r.get(key) is not None]

    def mean(key):
        return statistics.mean(values(key)) if values(key) else None

    k3 = values("mismatch_k3")
    steady = rows[1:] or rows  # (the first step carries start-up effects)
    return {
        "steps": len(rows),
        "mismatch_k3": statistics.mean(k3) if k3 else None,
        "mismatch_k3_median": statistics.median(k3) if k3 else None,
        "mismatch_k3_per_step": k3,
        "agreement": mean("router/agreement"),
        "missing": sum(values("router/missing")),
        "bytes_per_token": mean("router/bytes_per_token"),
        "max_logprob_diff": max(values("logprob_diff_on_policy"), default=None),
        "reward_first": rows[0]["reward"],
        "reward_last": statistics.mean(r["reward"] for r in rows[-3:]),
        "train_s": statistics.mean(r["train_s"] for r in steady),
        "gen_tokens_per_s": (steady[-1]["gen_tokens"] - steady[0]["gen_tokens"])
        / max(1e-9, steady[-1]["gen_elapsed_s"] - steady[0]["gen_elapsed_s"])
        if len(steady) > 1
        else None,
    }


def groups_of(shape: dict, count: int, with_routes: bool, seed: int = 0):
    """`count` rollout groups of 8 samples shaped as `shape`, with routes (numpy, as the generator
    makes them)."""
    import numpy as np

    import buffer
    from generator import routes

    rng = np.random.default_rng(seed)
    n = shape["prompt"] + shape["completion"]
    dtype = routes.route_dtype(shape["experts"])
    out = []
    for g in range(count):
        completions = [list(rng.integers(3, 26, shape["completion"])) for _ in range(8)]
        rows = (
            [
                rng.integers(0, shape["experts"], (n, shape["layers"], shape["top_k"])).astype(
                    dtype
                )
                for _ in range(8)
            ]
            if with_routes
            else None
        )
        out.append(
            buffer.RolloutGroup(
                g,
                [1] + [3] * (shape["prompt"] - 1),
                completions,
                [[-1.0] * shape["completion"]] * 8,
                [[0] * shape["completion"]] * 8,
                [0.0] * 8,
                routes=rows,
            )
        )
    return out


def carrying_cost(shape: dict, repeats: int, groups: int) -> dict:
    """Bytes per token, queue put + get per group, and collation of `groups` groups, with and
    without routes."""
    import multiprocessing

    import torch

    import buffer

    made = {kind: groups_of(shape, groups, kind == "routes") for kind in ("none", "routes")}
    q = buffer.RolloutQueue(0, multiprocessing.get_context("spawn"))
    times = {kind: {"queue_ms_per_group": [], "collate_ms": []} for kind in made}
    for round_ in range(repeats + 1):  # alternating, after a warm-up round
        for kind, batch in made.items():
            t = time.perf_counter()
            for g in batch:
                q.put(g)
            for _ in batch:
                q.get(timeout=60)
            queue_ms = (time.perf_counter() - t) * 1e3 / len(batch)
            samples = buffer.to_samples(batch, torch.zeros(len(batch), 8))
            t = time.perf_counter()
            buffer.collate(samples, pad_id=0)
            if round_:
                times[kind]["queue_ms_per_group"].append(queue_ms)
                times[kind]["collate_ms"].append((time.perf_counter() - t) * 1e3)
    q.close()
    out = {
        kind: {what: statistics.median(v) for what, v in figures.items()}
        for kind, figures in times.items()
    }
    out["bytes_per_token"] = buffer.route_stats(made["routes"])["router/bytes_per_token"]
    out["queue_ratio"] = out["routes"]["queue_ms_per_group"] / out["none"]["queue_ms_per_group"]
    out["collate_ratio"] = out["routes"]["collate_ms"] / out["none"]["collate_ms"]
    return out


def main(argv=None) -> int:
    smoke = {"steps": 3, "repeats": 2, "groups": 4, "paired_prompts": 2, "paired_tokens": 8}
    p = common.parser(__doc__, smoke=smoke)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=5, help="rounds of each cost measurement")
    p.add_argument("--groups", type=int, default=32, help="groups per cost round (a step's worth)")
    p.add_argument("--paired-prompts", type=int, default=32, help="prompts (x 8) paired")
    p.add_argument("--paired-tokens", type=int, default=32, help="the paired longer completions")
    args = common.parse_args(p, argv)
    common.setup_paths()
    runs = {}
    with common.Bench("moe", args) as bench:
        fixed = ["--dtype", "bf16", "--max-lag", "0", "--steps", str(args.steps), "--seed"]
        for name, flags in RUNS.items():
            model = [] if name == "dense" else ["--model", "TINY_MOE"]
            cli = [*model, *flags, *fixed, str(args.seed), "--eval-every", "0"]
            runs[name] = summarize(common.run_train_cli(bench.work / name, cli)["rows"])
        costs = {n: carrying_cost(shape, args.repeats, args.groups) for n, shape in SHAPES.items()}
        threads = common.default_config().gen_threads
        weights = {
            "initial": common.build_model(bench.work / "init_moe", seed=args.seed, experts=8)
        }
        if not args.smoke:
            weights["trained (replay run)"] = str(bench.work / "replay" / "model")
        lengths = [5, args.paired_tokens]
        pairs = {
            name: common.in_child(
                paired,
                path,
                args.paired_prompts,
                lengths,
                threads,
                args.seed,
                timeout_s=900,
                what=f"paired {name}",
            )
            for name, path in weights.items()
        }

    def ratio(a, b):
        k3 = runs[a]["mismatch_k3"], runs[b]["mismatch_k3"]
        return k3[0] / k3[1] if all(k3) else None

    settings = {"steps": args.steps, "seed": args.seed, "dtype": "bf16", "max_lag": 0}
    settings.update(task="copy", model="TINY_MOE (dense: the default tiny model)")
    data = {"settings": {**settings, "repeats": args.repeats, "groups": args.groups}, "runs": runs}
    data["ratio_record_over_replay"] = ratio("record", "replay")
    data["ratio_plain_over_replay"] = ratio("plain", "replay")
    data["ratio_replay_over_dense"] = ratio("replay", "dense")
    data.update(shapes=SHAPES, costs=costs, paired=pairs)
    path = bench.save(data, plot)
    keys = "run mismatch_k3 mismatch_k3_median agreement missing max_logprob_diff reward_first"
    print(
        common.table_of([{"run": n, **r} for n, r in runs.items()], keys + " reward_last train_s")
    )
    print(
        "mismatch_k3, record / replay, plain / replay, replay / dense: "
        + ", ".join(
            common.fmt(data[f"ratio_{k}"])
            for k in ("record_over_replay", "plain_over_replay", "replay_over_dense")
        )
    )
    rows = [{"weights": w, "tokens": n, **r} for w, got in pairs.items() for n, r in got.items()]
    keys = "weights tokens samples k3_live k3_replayed ratio max_diff_live max_diff_replayed"
    print(common.table_of(rows, keys + " agreement"))
    rows = [
        {
            "shape": n,
            **c,
            "queue_ms_none": c["none"]["queue_ms_per_group"],
            "queue_ms_routes": c["routes"]["queue_ms_per_group"],
            "collate_ms_none": c["none"]["collate_ms"],
            "collate_ms_routes": c["routes"]["collate_ms"],
        }
        for n, c in costs.items()
    ]
    keys = "shape bytes_per_token queue_ms_none queue_ms_routes queue_ratio collate_ms_none"
    print(common.table_of(rows, keys + " collate_ms_routes collate_ratio"))
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    """Each run's mismatch_k3 per step (log scale)."""
    fig, ax = common.plt().subplots(1, 1, figsize=(7, 4))
    for name, run in data["runs"].items():
        if run["mismatch_k3_per_step"]:
            label = f"{name} (agreement {common.fmt(run['agreement'])})"
            ax.plot(run["mismatch_k3_per_step"], label=label)
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="mismatch_k3 (generator vs trainer)", title="bf16, --max-lag 0")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "MoE routing replay")


def paired(model_path: str, prompts: int, lengths: list[int], threads: int, seed: int) -> dict:
    """{N: figures} of one model's samples scored with live and with replayed routes, in a child
    process: vLLM (bf16, the worker's route recording) samples `prompts` copy prompts x 8
    completions of exactly N tokens; the trainer's model (bf16 compute, one gloo rank) scores them
    with its routers live, then replaying the recorded routes."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    import losses
    import update
    from trainer import models, replay

    batches = sampled(model_path, prompts, lengths, threads, seed)
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(model_path, 1, compute_dtype=torch.bfloat16)
        base = model
        state = replay.install(model, base.model.layers, base.config, True)
        out = {}
        for n, batch in batches.items():
            row = {"samples": len(batch), "tokens": int(batch.mask.sum())}
            for name, on in (("live", False), ("replayed", True)):
                state.replay = on
                with torch.no_grad(), replay.routed_by(model, batch) as counts:
                    logp = update.completion_logprobs(model, batch, 1.0).logp
                k3 = losses.mismatch_k3(logp, batch.behaviour_logp, batch.mask)
                row[f"k3_{name}"] = float(k3[batch.mask].mean())
                row[f"max_diff_{name}"] = float(
                    (logp - batch.behaviour_logp).abs()[batch.mask].max()
                )
                if not on:
                    row["agreement"] = int(counts["agree"]) / max(1, int(counts["decisions"]))
            row["ratio"] = row["k3_live"] / row["k3_replayed"]
            out[str(n)] = row
        return out
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)


def sampled(model_path: str, prompts: int, lengths: list[int], threads: int, seed: int) -> dict:
    """{N: the collated batch of `prompts` copy prompts x 8 completions of exactly N tokens},
    sampled by vLLM in this process (bf16, the worker recording the routes), its engine shut down
    after."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    os.environ["OMP_NUM_THREADS"] = str(threads)

    import torch
    from vllm import LLM, SamplingParams

    import buffer
    from generator import routes
    from tasks import builtin, chat

    torch.set_num_threads(threads)
    llm = LLM(
        model=model_path,
        dtype=torch.bfloat16,
        seed=seed,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
        enable_prefix_caching=True,
    )
    layers, top_k, experts = llm.collective_rpc("start_routes", args=("",))[0]
    dtype = routes.route_dtype(experts)
    task = builtin.CopyTask(chat.load_tokenizer(model_path))
    batches = {}
    for n in lengths:
        outs = llm.generate(
            [{"prompt_token_ids": p.prompt_ids} for p in task.prompts[:prompts]],
            SamplingParams(n=8, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, seed=seed),
            use_tqdm=False,
        )
        groups = []
        for o in outs:
            taken = dict(llm.collective_rpc("take_routes", args=(o.request_id,))[0])
            cs = sorted(o.outputs, key=lambda c: c.index)
            logprobs = [[c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)] for c in cs]
            rows = [
                routes.fitted(
                    np_rows(taken[c.index], dtype, layers, top_k),
                    len(o.prompt_token_ids) + n,
                    layers,
                    top_k,
                    dtype,
                )
                for c in cs
            ]
            groups.append(
                buffer.RolloutGroup(
                    0,
                    list(o.prompt_token_ids),
                    [list(c.token_ids) for c in cs],
                    logprobs,
                    [[0] * n for _ in cs],
                    [0.0] * 8,
                    routes=rows,
                )
            )
        batches[n] = buffer.collate(
            buffer.to_samples(groups, torch.zeros(len(groups), 8)), pad_id=0
        )
    llm.llm_engine.engine_core.shutdown()
    return batches


def np_rows(data: bytes, dtype, layers: int, top_k: int):
    import numpy as np

    return np.frombuffer(data, dtype=dtype).reshape(-1, layers, top_k)


if __name__ == "__main__":
    sys.exit(main())
