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

This file holds the options, the four runs, the cost of carrying routes, the tables and the plot;
the paired measurement (its own process and vLLM engine) is bench/moe_paired.py.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from moe_paired import paired  # noqa: E402

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
    p = common.parser(
        __doc__,
        smoke={"steps": 3, "repeats": 2, "groups": 4, "paired_prompts": 2, "paired_tokens": 8},
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument(
        "--repeats", type=int, default=5, help="rounds of each cost measurement (their median)"
    )
    p.add_argument("--groups", type=int, default=32, help="groups per cost round (a step's worth)")
    p.add_argument(
        "--paired-prompts",
        type=int,
        default=32,
        help="prompts (x 8 samples) of the paired measurement",
    )
    p.add_argument(
        "--paired-tokens",
        type=int,
        default=32,
        help="the longer completions of the paired measurement",
    )
    args = common.parse_args(p, argv)
    common.setup_paths()
    runs = {}
    with common.Bench("moe", args) as bench:
        for name, flags in RUNS.items():
            model = [] if name == "dense" else ["--model", "TINY_MOE"]
            run = common.run_train_cli(
                bench.work / name,
                [
                    *model,
                    *flags,
                    "--dtype",
                    "bf16",
                    "--max-lag",
                    "0",
                    "--steps",
                    str(args.steps),
                    "--seed",
                    str(args.seed),
                    "--eval-every",
                    "0",
                ],
            )
            runs[name] = summarize(run["rows"])
            print(
                f"[moe] {name}: {runs[name]['steps']} steps, mismatch_k3 "
                f"{common.fmt(runs[name]['mismatch_k3'])}, "
                f"agreement {common.fmt(runs[name]['agreement'])}",
                flush=True,
            )
        costs = {
            name: carrying_cost(shape, args.repeats, args.groups) for name, shape in SHAPES.items()
        }
        threads = common.default_config().gen_threads
        init = common.build_model(bench.work / "init_moe", seed=args.seed, experts=8)
        weights = (
            {"initial": init}
            if args.smoke
            else {"initial": init, "trained (replay run)": str(bench.work / "replay" / "model")}
        )
        pairs = {
            name: common.in_child(
                paired,
                path,
                args.paired_prompts,
                [5, args.paired_tokens],
                threads,
                args.seed,
                timeout_s=900,
                what=f"paired {name}",
            )
            for name, path in weights.items()
        }

    def ratio(a, b):
        if runs[a]["mismatch_k3"] and runs[b]["mismatch_k3"]:
            return runs[a]["mismatch_k3"] / runs[b]["mismatch_k3"]
        return None

    data = {
        "settings": {
            "steps": args.steps,
            "seed": args.seed,
            "dtype": "bf16",
            "max_lag": 0,
            "task": "copy",
            "model": "TINY_MOE (dense: the default tiny model)",
            "repeats": args.repeats,
            "groups": args.groups,
        },
        "runs": runs,
        "ratio_record_over_replay": ratio("record", "replay"),
        "ratio_plain_over_replay": ratio("plain", "replay"),
        "ratio_replay_over_dense": ratio("replay", "dense"),
        "shapes": SHAPES,
        "costs": costs,
        "paired": pairs,
    }
    path = bench.save(data, plot)
    print()
    print(
        common.table(
            [
                "run",
                "mismatch_k3 mean",
                "median",
                "router/agreement",
                "missing",
                "max |Δ log p|",
                "reward first -> last",
                "train s/step",
                "gen tok/s",
            ],
            [
                [
                    name,
                    r["mismatch_k3"],
                    r["mismatch_k3_median"],
                    r["agreement"],
                    r["missing"],
                    r["max_logprob_diff"],
                    f"{common.fmt(r['reward_first'])} -> {common.fmt(r['reward_last'])}",
                    r["train_s"],
                    r["gen_tokens_per_s"],
                ]
                for name, r in runs.items()
            ],
        )
    )
    print(
        f"mismatch_k3 without replay / with it: {common.fmt(data['ratio_record_over_replay'])} "
        f"(record / replay), "
        f"{common.fmt(data['ratio_plain_over_replay'])} (plain / replay); replay / dense "
        f"{common.fmt(data['ratio_replay_over_dense'])}"
    )
    print(
        common.table(
            [
                "weights",
                "completion tokens",
                "samples",
                "mismatch_k3 live",
                "replayed",
                "ratio",
                "max |Δ log p| live",
                "replayed",
                "router/agreement",
            ],
            [
                [
                    name,
                    int(n),
                    r["samples"],
                    r["k3_live"],
                    r["k3_replayed"],
                    r["ratio"],
                    r["max_diff_live"],
                    r["max_diff_replayed"],
                    r["agreement"],
                ]
                for name, rows in pairs.items()
                for n, r in rows.items()
            ],
        )
    )
    print(
        common.table(
            [
                "shape",
                "bytes/token",
                "queue ms/group: none",
                "routes",
                "ratio",
                "collate ms: none",
                "routes",
                "ratio",
            ],
            [
                [
                    name,
                    c["bytes_per_token"],
                    c["none"]["queue_ms_per_group"],
                    c["routes"]["queue_ms_per_group"],
                    c["queue_ratio"],
                    c["none"]["collate_ms"],
                    c["routes"]["collate_ms"],
                    c["collate_ratio"],
                ]
                for name, c in costs.items()
            ],
        )
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, run), color in zip(
        data["runs"].items(), ("#7f7f7f", "#d62728", "#1f77b4", "#2ca02c")
    ):
        k3 = run["mismatch_k3_per_step"]
        if k3:
            left.plot(
                range(len(k3)),
                k3,
                color=color,
                label=f"{name} (agreement {common.fmt(run['agreement'])})",
            )
    left.set_yscale("log")
    left.set(xlabel="step", ylabel="mismatch_k3 (generator vs trainer)", title="bf16, --max-lag 0")
    left.legend(fontsize=8)
    names = list(data["costs"])
    for i, (what, key) in enumerate(
        (("queue put + get", "queue_ratio"), ("collation", "collate_ratio"))
    ):
        right.bar(
            [x + 0.4 * i for x in range(len(names))],
            [data["costs"][n][key] for n in names],
            width=0.4,
            label=what,
        )
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xticks(
        [x + 0.2 for x in range(len(names))],
        [f"{n}\n{common.fmt(data['costs'][n]['bytes_per_token'])} B/token" for n in names],
    )
    right.set(ylabel="time with routes / without", title="what carrying routes costs")
    right.legend(fontsize=8)
    common.save_figure(fig, path, data, "routing replay on a tiny MoE")


if __name__ == "__main__":
    sys.exit(main())
