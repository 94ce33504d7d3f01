"""bench/learning.py — what the project's choices do to learning, each a `--what` of real
`python train.py` runs side by side (same task, model and seed unless said):

    python bench/learning.py --what NAME --out DIR     # DIR/NAME.json and DIR/NAME.png
    python bench/learning.py --what NAME --smoke --out DIR   # the suite's size (see --help)

- learning: does async reach the same reward sooner? `--max-lag 0` (synchronous) against
  `--max-lag 4`: the reward against wall time (the run's own clock) and steps, the time and step at
  which the 10-step mean reward first reaches 0.5, 0.8 and 0.9.
- stale_bias: does the staleness rule drop long completions more often? `--stale-rule group` against
  `tokens` on completions of 1 to 48 tokens (the random-init model with --max-new-tokens 48 and a
  small --lr, --max-lag 1, 4 prompts x 2, 32 groups in flight): per length bucket of each step's
  `stale_by_len` census, the share of samples dropped and of tokens left out of training.
- variants: the loss variants where they act, PPO mini-batches: the default, and `--loss
  grpo|dapo|cispo --mini-batches 4`, per seed: reward, wall time, clip fraction, largest ratio.
- distill: does a teacher's per-token signal get a random-init student to the teacher's reward
  sooner? A default run's model is the teacher (or `--teacher`); students of each seed trained
  with plain GRPO and with `--teacher T --distill-coef C`: the step at which each reaches
  --fraction of the teacher's final reward, the reverse KL to the teacher.
- real_model: SmolLM2-135M-Instruct (`scripts/fetch_models.py`; the smoke: the tiny model) on "What
  is A + B?" for digits A, B (20 of the 100 held out), each a user message through its chat
  template, the math reward: per step the reward, the on-policy trainer/vLLM log-prob difference,
  the step time and the share of trained positions that are prompt tokens (each prompt computed
  again for each of its samples).
Touches only its scratch folder and --out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from run import plots  # noqa: E402  (the project's own, on sys.path through common)

THRESHOLDS = (0.5, 0.8, 0.9)
SMOOTH = 10  # steps in the mean a reward threshold is read on
LAST = 20  # the teacher's final reward: the mean over its last LAST steps
HELD_OUT = 20  # of real_model's 100 questions


def reach(rows: list[dict], target: float) -> dict:
    """The first step (and its wall_s) whose SMOOTH-step mean reward is >= target (None: never)."""
    sm = plots.smooth([r["reward"] for r in rows], SMOOTH)
    i = next((i for i, v in enumerate(sm) if i >= SMOOTH - 1 and v >= target), None)
    return {k: rows[i][k] if i is not None else None for k in ("step", "wall_s")}


def curve(rows: list[dict], *keys: str) -> dict:
    return {k: [round(r[k], 4) for r in rows if k in r] for k in ("step", "wall_s", *keys)}


def plot_curves(data: dict, path: Path, what: str, x: str = "step") -> None:
    """The generic figure of this file: each run's SMOOTH-step mean reward against `x`."""
    fig, ax = common.plt().subplots(1, 1, figsize=(7, 4))
    for name, run in data["runs"].items():
        c = run["curve"]
        ax.plot(c[x][: len(c["reward"])], plots.smooth(c["reward"], SMOOTH), label=name)
    ax.set(xlabel=x, ylabel=f"reward (mean of {SMOOTH} steps)", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    common.save_figure(fig, path, data, what)


def learning_main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12})
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--async-lag", type=int, default=4, help="--max-lag of the asynchronous run")
    args = common.parse_args(p, argv)
    modes = {"sync": 0, f"lag{args.async_lag}": args.async_lag}
    runs = {}
    with common.Bench("learning", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for mode, lag in modes.items():
            flags = ["--steps", args.steps, "--max-lag", lag, "--model", model, "--seed", args.seed]
            run = common.run_train_cli(bench.work / mode, [str(f) for f in flags])
            rows, s = run["rows"], run["summary"]
            got = {"max_lag": lag, "steps": len(rows), "wall_s": rows[-1]["wall_s"]}
            got.update(process_s=run["process_s"], steps_per_s=len(rows) / rows[-1]["wall_s"])
            got["startup_s"] = run["process_s"] - rows[-1]["wall_s"]
            keys = ("reward_first10", "reward_last20", "max_token_lag", "dropped_stale")
            got.update({k: s.get(k) for k in keys})
            got["reward_final"] = plots.smooth([r["reward"] for r in rows], SMOOTH)[-1]
            got["reach"] = {str(th): reach(rows, th) for th in THRESHOLDS}
            runs[mode] = {**got, "curve": curve(rows, "reward")}
    sync, lagged = runs["sync"], runs[list(modes)[1]]
    speed = {}
    for th in map(str, THRESHOLDS):
        a, b = sync["reach"][th]["wall_s"], lagged["reach"][th]["wall_s"]
        speed[th] = a / b if a and b else None
    data = {"settings": {"steps": args.steps, "seed": args.seed, "smooth": SMOOTH}}
    data.update(modes=list(modes), runs=runs, time_to_reward_speedup=speed)
    data["wall_speedup"] = sync["wall_s"] / lagged["wall_s"]
    path = bench.save(data, lambda d, p: plot_curves(d, p, "learning, async vs sync", "wall_s"))
    for mode, r in runs.items():
        r.update({f"to_{th}_s": r["reach"][str(th)]["wall_s"] for th in THRESHOLDS}, mode=mode)
    keys = "mode steps wall_s steps_per_s reward_first10 reward_last20 reward_final"
    print(common.table_of(list(runs.values()), keys + " to_0.5_s to_0.8_s to_0.9_s"))
    print(f"time-to-reward speedup (sync / async): {speed}")
    print(bench.closing_line(path))
    return 0


def census(rows: list[dict], rule: str) -> dict:
    """Per length bucket, summed over the steps' `stale_by_len` ([samples, dropped, tokens, stale
    tokens, tokens dropped]): the drop rate and the share of tokens left out of training (every
    token of a dropped sample; the stale tokens of a kept one, which the rule "tokens" masks)."""
    total: dict[int, list] = {}
    for row in rows:
        for bucket, counts in (row.get("stale_by_len") or {}).items():
            total[int(bucket)] = [a + b for a, b in zip(total.get(int(bucket), [0] * 5), counts)]
    out = {}
    for b, (samples, dropped, tokens, stale, lost) in sorted(total.items()):
        lost += stale if rule == "tokens" else 0
        out[str(b)] = {"samples": samples, "dropped": dropped, "tokens": tokens}
        out[str(b)].update(stale_tokens=stale, tokens_lost=lost)
        out[str(b)]["drop_rate"] = dropped / samples if samples else None
        out[str(b)]["tokens_lost_share"] = lost / tokens if tokens else None
    return out


def stale_bias_main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "max_new_tokens": 8})
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-lag", type=int, default=1)
    args = common.parse_args(p, argv)
    rules, runs = ("group", "tokens"), {}
    fixed = "--prompts-per-step 4 --group-size 2 --max-inflight-groups 32 --lr 1e-5 --eval-every 0"
    with common.Bench("stale_bias", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        for rule in rules:
            flags = ["--steps", args.steps, "--max-new-tokens", args.max_new_tokens, "--max-lag"]
            flags += [args.max_lag, "--stale-rule", rule, "--model", model, "--seed", args.seed]
            run = common.run_train_cli(bench.work / rule, [*map(str, flags), *fixed.split()])
            rows, s = run["rows"], run["summary"]
            keys = ("max_token_lag", "dropped_stale", "reward_first10", "reward_last20")
            runs[rule] = {
                "steps": len(rows),
                "wall_s": rows[-1]["wall_s"],
                **{k: s[k] for k in keys},
            }
            runs[rule]["masked_tokens"] = sum(r.get("stale_masked_tokens", 0) for r in rows)
            runs[rule]["buckets"] = census(rows, rule)
    settings = {"steps": args.steps, "seed": args.seed, "max_new_tokens": args.max_new_tokens}
    settings.update(max_lag=args.max_lag, update_mode="inflight", workload=fixed)
    path = bench.save({"settings": settings, "rules": list(rules), "runs": runs}, plot_stale)
    rows = []
    for b in sorted({int(b) for rule in rules for b in runs[rule]["buckets"]}):
        row = {"bucket": f"{b}-{2 * b - 1}" if b > 1 else str(b)}
        for rule in rules:
            e = runs[rule]["buckets"].get(str(b), {})
            row.update({f"{rule}:{k}": e.get(k) for k in ("samples", "drop_rate")})
            row[f"{rule}:lost"] = e.get("tokens_lost_share")
        rows.append(row)
    keys = " ".join(f"{r}:samples {r}:drop_rate {r}:lost" for r in rules)
    print(common.table_of(rows, "bucket " + keys))
    print("max token lag: " + ", ".join(f"{r} {runs[r]['max_token_lag']}" for r in rules))
    print(bench.closing_line(path))
    return 0


def plot_stale(data: dict, path: Path) -> None:
    fig, ax = common.plt().subplots(1, 1, figsize=(7, 4))
    for rule in data["rules"]:
        b = data["runs"][rule]["buckets"]
        xs = sorted(int(k) for k in b)
        ax.plot(xs, [b[str(x)]["drop_rate"] for x in xs], marker="o", label=f"--stale-rule {rule}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="completion length bucket (model tokens)", ylabel="share of samples dropped")
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "stale drops by length")


VARIANTS = {
    "default (grpo, 1 update)": [],
    "grpo, 4 mini-batches": ["--loss", "grpo", "--mini-batches", "4"],
    "dapo, 4 mini-batches": ["--loss", "dapo", "--mini-batches", "4"],
    "cispo, 4 mini-batches": ["--loss", "cispo", "--mini-batches", "4"],
}


def variants_main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "seeds": [0]})
    p.add_argument("--steps", type=int, default=300, help="steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = common.parse_args(p, argv)
    runs = []
    with common.Bench("variants", args) as bench:
        for seed in args.seeds:
            for name, flags in VARIANTS.items():
                tag = name.split(",")[0].split(" ")[0] + ("_mb4" if flags else "")
                cli = ["--steps", str(args.steps), "--seed", str(seed), "--eval-every", "0"]
                run = common.run_train_cli(bench.work / f"{tag}_s{seed}", [*cli, *flags])
                s, rows = run["summary"], run["rows"]
                got = {"variant": name, "seed": seed, "flags": " ".join(flags) or "(defaults)"}
                got.update({k: s[k] for k in ("reward_first10", "reward_last20", "wall_s")})
                clips = (r.get("clip_frac_low", 0) + r.get("clip_frac_high", 0) for r in rows)
                got["clip_frac"] = sum(clips) / len(rows)
                got["ratio_max"] = max(r.get("ratio_max", 1.0) for r in rows)
                runs.append(got)
    path = bench.save({"steps": args.steps, "runs": runs}, plot_variants)
    print(
        common.table_of(
            runs, "variant seed reward_first10 reward_last20 wall_s clip_frac ratio_max"
        )
    )
    print(bench.closing_line(path))
    return 0


def plot_variants(data: dict, path: Path) -> None:
    rewards = {}
    for r in data["runs"]:
        rewards.setdefault(r["variant"], []).append(r["reward_last20"])
    common.bars(data, path, "loss variants: reward over the last 20% of steps", rewards, "reward")


def distill_main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"steps": 12, "seeds": "1"})
    p.add_argument("--steps", type=int, default=300, help="steps of the teacher and each student")
    p.add_argument("--seeds", default="1,2", help="the students' seeds (their random inits)")
    p.add_argument("--coef", type=float, default=0.1, help="--distill-coef of distilled students")
    p.add_argument("--fraction", type=float, default=0.9, help="of the teacher's final reward")
    p.add_argument("--teacher", default="", help="a trained model (default: train one)")
    args = common.parse_args(p, argv)
    seeds, runs = [int(s) for s in args.seeds.split(",") if s.strip()], {}
    with common.Bench("distill", args) as bench:
        teacher, teacher_run = args.teacher, None
        if not teacher:  # a default run; its final model is the teacher
            cli = ["--steps", str(args.steps), "--seed", str(args.seed)]
            teacher_run = common.run_train_cli(bench.work / "teacher", cli)
            teacher = str(bench.work / "teacher" / "model")
        rows = teacher_run["rows"] if teacher_run else common.read_run(Path(teacher).parent)["rows"]
        rows = [r for r in rows if "reward" in r and "step" in r]
        final = sum(r["reward"] for r in rows[-LAST:]) / len(rows[-LAST:])
        teacher_row = {"final_reward": final, "curve": curve(rows, "reward")}
        teacher_row["process_s"] = teacher_run["process_s"] if teacher_run else None
        arms = {"grpo": [], "distill": ["--teacher", teacher, "--distill-coef", str(args.coef)]}
        for seed in seeds:
            for arm, extra in arms.items():
                cli = ["--steps", str(args.steps), "--seed", str(seed), *extra]
                run = common.run_train_cli(bench.work / f"{arm}_seed{seed}", cli)
                rows = run["rows"]
                got = {"arm": arm, "seed": seed, "steps": len(rows), "wall_s": rows[-1]["wall_s"]}
                got.update(process_s=run["process_s"], cmd=run["cmd"])
                got["reward_last20"] = sum(r["reward"] for r in rows[-LAST:]) / len(rows[-LAST:])
                got["curve"] = curve(rows, "reward", "distill_reverse_kl")
                got["reach_step"] = reach(rows, args.fraction * final)["step"]
                kl = got["curve"]["distill_reverse_kl"]
                got.update(kl_first=kl[0] if kl else None, kl_last=kl[-1] if kl else None)
                runs[f"{arm}_seed{seed}"] = got
    settings = {"steps": args.steps, "seeds": seeds, "teacher_seed": args.seed, "coef": args.coef}
    settings.update(fraction=args.fraction, smooth=SMOOTH, teacher=args.teacher or "trained here")
    data = {"settings": settings, "teacher": teacher_row, "target": args.fraction * final}
    path = bench.save({**data, "runs": runs}, lambda d, p: plot_curves(d, p, "distillation"))
    print(f"teacher final reward {final:.3f}; target {data['target']:.3f}")
    print(
        common.table_of(
            [{"run": k, **r} for k, r in runs.items()],
            "run steps wall_s reward_last20 reach_step kl_first kl_last",
        )
    )
    print(bench.closing_line(path))
    return 0


def write_task(folder: Path, seed: int, chat: bool) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of "What is A + B?" (prompt, answer), split by a fixed shuffle;
    with `chat`, each prompt a user message (so the model's chat template renders it: a plain
    string prompt stays plain text, as in TRL)."""
    rows = []
    for a in range(10):
        for b in range(10):
            text = f"What is {a} + {b}?"
            rows.append({"prompt": [{"role": "user", "content": text}] if chat else text})
            rows[-1]["answer"] = str(a + b)
    random.Random(seed).shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "test.jsonl"
    for path, part in zip(paths, (rows[HELD_OUT:], rows[:HELD_OUT])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def prompt_tokens(tok, train: Path) -> float:
    """The mean rendered length of the training prompts, in tokens."""
    lengths = []
    for line in train.read_text().splitlines():
        p = json.loads(line)["prompt"]
        ids = (
            tok(p).input_ids
            if isinstance(p, str)
            else tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)
        )
        lengths.append(len(ids))
    return sum(lengths) / len(lengths)


def per_step(rows: list[dict], prompt_len: float, samples: int) -> list[dict]:
    """The figures of each training step (evaluation-only rows are skipped)."""
    out, last_wall, prompts = [], 0.0, prompt_len * samples
    for r in (r for r in rows if r.get("reward") is not None):
        got = {"step": r["step"], "reward": r["reward"], "step_s": r["wall_s"] - last_wall}
        got.update(logprob_diff_on_policy=r.get("logprob_diff_on_policy"))
        got["completion_tokens"] = r["tokens"]
        got["prompt_share"] = prompts / (prompts + r["tokens"]) if r["tokens"] else None
        got.update(eval_reward=r.get("eval/reward"), eval_greedy=r.get("eval/greedy_pass@1"))
        out.append(got)
        last_wall = r["wall_s"]
    return out


def real_model_main(argv=None) -> int:
    smoke = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_model_len": 64}
    p = common.parser(__doc__, smoke={**smoke, "max_new_tokens": 8})
    p.add_argument("--model", default="", help="a model folder (default: the fetched SmolLM2)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps, at most")
    p.add_argument("--minutes", type=float, default=30.0, help="stop the run after this long")
    for flag, default in (("prompts-per-step", 8), ("group-size", 4), ("eval-every", 10)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=256)
    args = common.parse_args(p, argv)
    with common.Bench("real_model", args) as bench:
        from transformers import AutoTokenizer

        model = args.model or model_for(args, bench.work)
        tok = AutoTokenizer.from_pretrained(model)
        train, test = write_task(bench.work / "data", args.seed, tok.chat_template is not None)
        flags = {"model": model, "dataset": train, "eval-dataset": test, "reward": "math"}
        names = ("steps", "prompts_per_step", "group_size", "lr", "eval_every", "max_new_tokens")
        flags.update({n.replace("_", "-"): getattr(args, n) for n in (*names, "max_model_len")})
        flags.update({"eval-prompts": HELD_OUT, "kv-cache-mb": 1024, "seed": args.seed})
        cli = [str(x) for k, v in flags.items() for x in (f"--{k}", v)]
        run = common.run_train_cli(
            bench.work / "run", cli, timeout_s=args.minutes * 60, stop_on_timeout=True
        )
        prompt_len = prompt_tokens(tok, train)
    steps = per_step(run["rows"], prompt_len, args.prompts_per_step * args.group_size)
    evals = [r for r in run["rows"] if r.get("eval/step") is not None]
    keys = ("eval/step", "eval/reward", "eval/greedy_pass@1", "eval/time_s")
    summary = ("reward_first10", "reward_last20", "eval_first", "eval_last", "wall_s")
    data = {"model": model if args.smoke else "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"}
    data.update(cmd=run["cmd"], prompt_tokens_mean=prompt_len, steps=steps)
    data["evals"] = [{k: r.get(k) for k in keys} for r in evals]
    data["summary"] = {k: run["summary"].get(k) for k in summary}
    rewards = {"train": [s["reward"] for s in steps], "held-out": [e["eval/reward"] for e in evals]}
    path = bench.save(data, lambda d, p: common.bars(d, p, "real model: reward", rewards, "reward"))
    keys = "step reward logprob_diff_on_policy step_s completion_tokens prompt_share"
    print(common.table_of(steps, keys, title="real model: per step"))
    print(bench.closing_line(path))
    return 0


def model_for(args, work: Path) -> str:
    """The smoke size's tiny model, or the fetched SmolLM2 (one line if it is not there)."""
    if args.smoke:
        return common.build_model(work / "tiny", seed=args.seed)
    sys.path.insert(0, str(common.REPO / "scripts"))
    import fetch_models

    try:
        return fetch_models.fetch("smollm2")
    except fetch_models.FetchError as err:
        sys.exit(f"error: no SmolLM2: {err}")


WHAT = {"learning": learning_main, "stale_bias": stale_bias_main, "variants": variants_main}
WHAT.update(distill=distill_main, real_model=real_model_main)


def main(argv=None) -> int:
    return common.dispatch(__doc__, WHAT, argv)


if __name__ == "__main__":
    sys.exit(main())
