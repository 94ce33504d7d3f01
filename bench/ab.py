"""bench/ab.py — did a change of the code leave the run alone? Two revisions side by side on one
machine.

    # DIR/ab.json, DIR/ab.png
    python bench/ab.py --base REV [--head REV] [--runs 3] [--args "..."] --out DIR
    # the suite's size (tests/test_bench.py): HEAD against itself, one run each
    python bench/ab.py --smoke --out DIR

Both revisions are checked out into scratch worktrees (`git worktree add --detach`) and run with
this interpreter. Two parts:
- exact: `update.update_on_batch` of each revision, run on the same model and the same fixed batch
  for three steps with AdamW, one case per loss setting (CASES). Each process runs one thread, so
  each case is a deterministic computation. The parameters and losses are compared: equal to the
  bit, or their largest difference.
- runs: `python train.py --out OUT ARGS` from each revision, alternating base and head (a drifting
  machine load hits both alike), --runs times each. Per run: wall time (start-up included), reward
  (first 10% -> last 20% of steps), held-out greedy pass@1 at the end, the log-prob agreement after
  sync, tokens/s. The async schedule makes a run unrepeatable, so each side's spread is the noise a
  difference is judged by.
May touch: the repository's worktree list (two scratch worktrees, removed at the end) and its
scratch folder.

The whole set, and its page:

    python bench/ab.py --what all --out bench/results     # every benchmark, then the summary
    python bench/ab.py --what all --smoke --only memory --out DIR
    python bench/ab.py --what report --out DIR            # DIR/summary.md from DIR/*.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

# (name, train.py flags): the update's variants both revisions have (the default, a second loss, the
# KL term, mini-batches with the proximal policy, micro-batches, LoRA with its KL reference)
CASES = (
    ("default", []),
    ("dr_grpo", ["--loss", "dr_grpo"]),
    ("kl", ["--kl-coef", "0.05"]),
    ("mini_batches", ["--mini-batches", "2", "--ppo-epochs", "2"]),
    ("micro_batches", ["--micro-batch-tokens", "64"]),
    ("lora_kl", ["--lora-rank", "4", "--kl-coef", "0.05"]),
)
STEPS = 3
FIGURES = (
    "process_s",
    "wall_s",
    "reward_first10",
    "reward_last20",
    "eval_last",
    "logprob_diff_after_sync",
    "gen_tokens_per_s",
    "train_tokens_per_s",
)

# Runs inside a revision's checkout (argv: checkout, model, cases as JSON, out file): what it
# computes is that revision's code alone. Trainer models moved from train.py to models.py; the LoRA
# reference became lora.AdapterOff (before: None, the adapter switched off inside update.py).
PROBE = r"""
import json, sys, tempfile
checkout, model_path, cases, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
sys.path.insert(0, checkout)
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import buffer, config, update
try:  # the revisions after the restructure keep the parts in folders (trainer/, run/)
    from trainer import lora
except ImportError:
    import lora
try:
    from run import flag_checks
except ImportError:
    try:
        import flag_checks
    except ImportError:
        flag_checks = None
try:
    from trainer.models import build_reference_model, build_trainer_model
except ImportError:
    try:
        from models import build_reference_model, build_trainer_model
    except ImportError:
        from train import build_reference_model, build_trainer_model
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

def fixed_batch(vocab, seed=0, rows=16):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        n = int(torch.randint(2, 6, (1,), generator=g))
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        behaviour = (-torch.rand(n, generator=g) * 3).tolist()
        samples.append(
            buffer.Sample([1, 5, 6, 7], ids, behaviour, [0] * n, float(i % 2), float(i % 3) - 1.0)
        )
    return buffer.collate(samples, 0)

result = {}
for name, argv in cases:
    # (the flags-alone checks: flag_checks.parse_args; config.parse_args in revisions before it)
    parse_args = getattr(flag_checks, "parse_args", None) or config.parse_args
    cfg = parse_args(argv)
    torch.manual_seed(0)
    lora_config = None
    if cfg.lora_rank:
        lora_config = lora.peft_config(
            cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets
        )
    model = build_trainer_model(model_path, 1, lora_config=lora_config, seed=0)
    ref = None
    if cfg.kl_coef > 0:
        ref = (lora.AdapterOff(model) if hasattr(lora, "AdapterOff") else None) if cfg.lora_rank \
            else build_reference_model(model_path, 1)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    batch = fixed_batch(model.config.vocab_size)
    losses = []
    for step in range(int(sys.argv[5])):
        r = update.update_on_batch(model, ref, optimizer, batch, cfg, 0, 1, step, step)
        losses.append([r.loss, r.grad_norm])
    params = {
        n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    result[name] = {"losses": losses, "params": params}
torch.save(result, out)
dist.destroy_process_group()
"""


def checkout(rev: str, where: Path) -> tuple[Path, str]:
    """A detached worktree of `rev` at `where`; (path, full commit)."""
    sha = subprocess.check_output(
        ["git", "-C", str(common.REPO), "rev-parse", rev], text=True
    ).strip()
    subprocess.run(
        ["git", "-C", str(common.REPO), "worktree", "add", "-f", "--detach", str(where), sha],
        check=True,
        capture_output=True,
    )
    return where, sha


def remove(where: Path) -> None:
    subprocess.run(
        ["git", "-C", str(common.REPO), "worktree", "remove", "--force", str(where)],
        capture_output=True,
    )


def exact_part(trees: dict, model: str, work: Path) -> dict:
    """Each revision's probe on the same model and batch; per case, whether losses and parameters
    agree."""
    out = {}
    for side, tree in trees.items():
        dst = work / f"probe_{side}.pt"
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                PROBE,
                str(tree),
                model,
                json.dumps(CASES),
                str(dst),
                str(STEPS),
            ],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if probe.returncode != 0:
            raise RuntimeError(
                f"the {side} revision's update probe failed:\n{probe.stderr[-3000:]}"
            )
        out[side] = torch.load(dst)
    cases = {}
    for name, _ in CASES:
        a, b = out["base"][name], out["head"][name]
        if set(a["params"]) != set(b["params"]):
            raise RuntimeError(f"{name}: the revisions train different parameters")
        diff = max(
            float((a["params"][k].double() - b["params"][k].double()).abs().max())
            for k in a["params"]
        )
        loss_diff = max(
            abs(x - y) for la, lb in zip(a["losses"], b["losses"]) for x, y in zip(la, lb)
        )
        cases[name] = {
            "identical": diff == 0.0 and loss_diff == 0.0,
            "max_param_diff": diff,
            "max_loss_or_grad_norm_diff": loss_diff,
            "losses_base": a["losses"],
            "losses_head": b["losses"],
        }
    return cases


def run_part(trees: dict, runs: int, args: list[str], work: Path) -> dict:
    """`python train.py` from each revision, alternating sides; each run's figures and reward
    curve."""
    results = {side: [] for side in trees}
    for i in range(runs):
        for side, tree in trees.items():
            run = common.run_train_cli(work / f"{side}_{i}", args, repo=tree)
            s = run["summary"]
            figures = {k: s.get(k) for k in FIGURES if k != "process_s"}
            figures["process_s"] = run["process_s"]
            figures["reward_curve"] = [round(r["reward"], 4) for r in run["rows"]]
            results[side].append(figures)
            print(
                f"[ab] {side} run {i + 1}: {run['process_s']:.0f} s, reward "
                f"{s['reward_first10']:.3f} -> "
                f"{s['reward_last20']:.3f}, held-out {s.get('eval_last')}",
                flush=True,
            )
    return results


def spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "sd": None, "min": None, "max": None}
    return {
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def compare(argv=None) -> int:
    """`--what ab` (the default): the two revisions, the exact part and the runs."""
    p = common.parser(__doc__, smoke={"base": "HEAD", "runs": 1})
    p.add_argument("--base", default="", help="the revision before the change (required)")
    p.add_argument("--head", default="HEAD", help="the revision after it")
    p.add_argument("--runs", type=int, default=3, help="train.py runs per revision (0: exact only)")
    p.add_argument("--args", default="", help="train.py flags of every run (default: none)")
    p.add_argument("--skip-exact", action="store_true", help="leave out the exact part")
    args = common.parse_args(p, argv)
    if not args.base:
        p.error("--base is required (or --smoke)")
    with common.Bench("ab", args) as bench:
        trees, commits = {}, {}
        try:
            for side, rev in (("base", args.base), ("head", args.head)):
                trees[side], commits[side] = checkout(rev, bench.work / f"tree_{side}")
            model = common.build_model(bench.work / "model", seed=args.seed)
            exact = {} if args.skip_exact else exact_part(trees, model, bench.work)
            runs = run_part(trees, args.runs, shlex.split(args.args), bench.work)
        finally:
            for tree in trees.values():
                remove(tree)
    summary = {side: {k: spread([r[k] for r in rs]) for k in FIGURES} for side, rs in runs.items()}
    ratios = {
        k: summary["head"][k]["mean"] / summary["base"][k]["mean"]
        for k in FIGURES
        if summary["base"][k]["mean"] and summary["head"][k]["mean"] is not None
    }
    # run i of base against run i of head, step by step (0 at every step: the same run)
    step_diffs = [
        max(abs(a - b) for a, b in zip(rb["reward_curve"], rh["reward_curve"]))
        for rb, rh in zip(runs["base"], runs["head"])
    ]
    settings = {"base": commits["base"], "head": commits["head"], "runs": args.runs}
    settings.update(args=args.args, exact_steps=STEPS, cases=dict(CASES))
    data = {"settings": settings, "exact": exact, "runs": runs, "summary": summary}
    data.update(head_over_base=ratios, max_step_reward_diff=step_diffs)
    path = bench.save(data, plot)
    show(data)
    print(bench.closing_line(path))
    return 0


def show(data: dict) -> None:
    """The exact part's cases, each figure's mean ± sd on both sides, the step differences."""
    rows = [{"case": n, **c} for n, c in data["exact"].items()]
    print(common.table_of(rows, "case identical max_param_diff max_loss_or_grad_norm_diff"))
    rows = []
    for k in FIGURES if data["settings"]["runs"] else ():
        row = {"figure": k, "head/base": data["head_over_base"].get(k)}
        for side in ("base", "head"):
            got = data["summary"][side][k]
            row[side] = "-" if got["mean"] is None else f"{got['mean']:.4g} ± {got['sd']:.2g}"
        rows.append(row)
    print(common.table_of(rows, "figure base head head/base", "base and head: mean ± sd"))
    print("largest per-step reward difference, run i:", data["max_step_reward_diff"])


ALL = ("overlap", "weight_sync", "generation", "training", "learning")
# what the summary page shows of each result: (JSON name, heading, its top-level figures)
SUMMARY = (
    ("overlap", "**Overlap**", "t_gen_s t_train_s bound cpu_bound"),
    ("weight_sync", "**Weight sync**", ""),
    ("generator", "**Generator**", "ratio ratio_nosync bare_tokens_per_s pipeline_tokens_per_s"),
    ("trainer", "**Trainer**", "ratio"),
    ("learning", "**Learning**", "wall_speedup"),
    ("memory", "**Memory**", ""),
)


def run_all(argv=None) -> int:
    """`--what all [--smoke] [--only a,b] --out DIR`: each benchmark as its own `python
    bench/NAME.py --out DIR` (a failure is reported, the others go on), then `--what report`."""
    p = argparse.ArgumentParser(description="every benchmark, then the summary page")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--only", default=",".join(ALL), help="comma-separated subset")
    p.add_argument("--smoke", action="store_true", help="each at its smoke size")
    args = p.parse_args(argv)
    failed = []
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        script = [sys.executable, str(common.REPO / "bench" / f"{name}.py"), "--out", args.out]
        print(f"===== {name}", flush=True)
        if subprocess.call(script + ["--smoke"] * args.smoke) != 0:
            failed.append(name)
    report(["--out", args.out])
    print(f"failed: {', '.join(failed)}" if failed else "all done", file=sys.stderr)
    return 1 if failed else 0


def report(argv=None) -> int:
    """`--what report --out DIR`: DIR/summary.md, from the JSON files the benchmarks wrote there:
    per result, its machine and date, its headline figures and its rows."""
    p = argparse.ArgumentParser(description="the summary page of DIR's results")
    p.add_argument("--out", default="bench_out")
    out, lines = Path(p.parse_args(argv).out), []
    for name, heading, keys in SUMMARY:
        if not (out / f"{name}.json").exists():
            continue
        data = json.loads((out / f"{name}.json").read_text())
        lines += [f"{heading} ({common.machine_line(data['machine'])})", ""]
        if keys:
            lines += [common.table_of([data], keys), ""]
        rows = [r for r in data.get("rows", []) if isinstance(r, dict)]
        if rows:
            keys = " ".join(k for k, v in rows[0].items() if isinstance(v, (int, float, str)))
            lines += [common.table_of(rows, keys), ""]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    return common.dispatch(__doc__, {"ab": compare, "all": run_all, "report": report}, argv)


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"base": "#7f7f7f", "head": "#1f77b4"}
    for side, runs in data["runs"].items():
        for i, run in enumerate(runs):
            ax.plot(
                run["reward_curve"],
                color=colors[side],
                lw=1,
                alpha=0.8,
                label=f"{side} {data['settings'][side][:7]}" if i == 0 else None,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if any(data["runs"].values()):
        ax.legend()
    common.save_figure(fig, path, data, "A/B of two revisions: reward per step, every run")


if __name__ == "__main__":
    sys.exit(main())
