"""run/metrics.py — what a run reports: one JSON row per step, a progress line, wandb, the summary.

Role: `RunLog` lives in trainer rank 0: each step it writes a row to OUT/metrics.jsonl (and wandb
with --wandb), every --log-every steps a progress line; at the end OUT/summary.json and
OUT/plots.png. Data contract
    - A row: step, version, reward, loss and the loss family's diagnostics, grad norm, lengths,
      per-token lag (mean, max, histogram), dropped samples, wait/train/publish times, generator
      counters, sync latency, logprob_diff_on_policy, reward/<name>/... per reward function, epoch,
      what staleness cost by length and turns (`stale_by_len`, `stale_by_turns`), env/... for env
      tasks (`episode_metrics`), and the eval/... keys of any evaluation answered during the step
      (the final one lands in the last row).
    - The summary: steps, wall_s, reward_first10 / reward_last20, token, wait, sync and eval
      figures, config.
    - On a resume, the rows of the steps already done are kept and the totals continue from them.
    - `first_batch_check`: the verdict on a run's first on-policy agreement, a line to stop the run
      with or to warn (train.check_first_agreement acts on it).
May touch: files under `--out` only.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch

import buffer
from run import plots
from tasks import evaluation
from tasks.rewards import summarize as summarize_rewards


def configure_terminal(log_level: str) -> None:
    """What the run's terminal shows. "warning" (the default): the progress lines, warnings and
    errors; vLLM's own INFO log (six lines per weight sync) and the libraries' progress bars are
    left out. "info" / "debug": vLLM logs at that level, bars included. Called in the parent before
    any child starts: children, vLLM's EngineCore and workers inherit the environment. The per-sync
    reload warnings that are expected are dropped at their source, in the vLLM worker
    (vllm_worker.ExpectedReloadWarnings)."""
    os.environ["VLLM_LOGGING_LEVEL"] = log_level.upper()
    if log_level != "warning":
        return
    # transformers' and the hub's bars, in every process
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # after the variable above: the hub reads it when first imported
    import transformers.utils.logging

    # this process may have imported transformers already
    transformers.utils.logging.disable_progress_bar()
    # vLLM's start-up scan of every module touches a deprecated torch alias (not
    # our code, not actionable); the shared-memory queues of vLLM's worker,
    # force-killed at shutdown (generator/engine.quiet_requested_shutdown), are
    # reclaimed by the resource tracker, which says so.
    expected = (
        "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
        "ignore:resource_tracker:UserWarning",
    )
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), *expected) if w
    )


def evaluation_line(keys: dict) -> str:
    """The terminal's line for one held-out evaluation (its eval/... keys)."""

    def show(value):
        return "-" if value is None else f"{value:.3f}"

    passes = "  ".join(f"{k[5:]} {show(v)}" for k, v in keys.items() if k.startswith("eval/pass@"))
    first, last = keys["eval/version"], keys.get("eval/last_version", keys["eval/version"])
    versions = f"v{first}" if last == first else f"v{first}-v{last}"
    return (
        f"eval at step {keys['eval/step']} ({versions}, {keys['eval/prompts']} held-out prompts): "
        f"greedy pass@1 {show(keys['eval/greedy_pass@1'])}  reward {show(keys['eval/reward'])}  "
        f"{passes}"
    )


def episode_metrics(groups) -> dict:
    """The env/... keys of one step (empty for a run without envs)."""
    stats = [g.episode_stats for g in groups if g.episode_stats]
    if not stats:
        return {}
    turns = [t for s in stats for t in s["turns"]]
    env_ms = sorted(1e3 * t for s in stats for t in s["env_s"])
    tokens = sum(s["episode_tokens"] for s in stats)
    out = {
        "env/turns_mean": sum(turns) / len(turns),
        "env/turns_max": max(turns),
        "env/time_ms_median": statistics.median(env_ms) if env_ms else None,
        "env/time_ms_p95": env_ms[min(len(env_ms) - 1, int(0.95 * len(env_ms)))]
        if env_ms
        else None,
        "env/errors": sum(s["errors"] for s in stats),
        "env/timeouts": sum(s["timeouts"] for s in stats),
        "env/token_frac": sum(s["env_tokens"] for s in stats) / tokens if tokens else None,
    }
    # --tools, TRL environment classes
    for name in ("tool_calls", "tool_call_parse_failures", "tool_errors"):
        if any(name in s for s in stats):
            out[f"env/{name}"] = sum(s.get(name, 0) for s in stats)
    for reason in ("max_turns", "max_episode_tokens"):
        out[f"env/truncated_{reason}"] = sum(s["truncated"].get(reason, 0) for s in stats)
    lines = [line for s in stats for line in s["error_lines"]]
    if lines:
        out["env/error"] = lines[0]
    return out


def all_faults_warning(row: dict, episodes: int) -> str | None:
    """The warning for a step whose every episode ended in an environment fault: it trains on zero
    advantages only, and would otherwise look like a quiet step."""
    faults = (row.get("env/errors") or 0) + (row.get("env/timeouts") or 0)
    if not episodes or faults < episodes:
        return None
    return (
        f"warning: every episode of step {row['step']} ended in an environment fault "
        f"({row.get('env/error')}): "
        "the run learns nothing from such steps (counted in env/errors, env/timeouts)"
    )


# The most the trainer's and the generator's log-probs may differ on a run's first on-policy batch
# in fp32 (max over its tokens) before the run stops. Every family the suite serves agrees within
# 1e-4 there (the tiny models 2e-7 to 3e-6, SmolLM2-135M 6.3e-5), and every model measured to be
# served otherwise than transformers scores it differed by 2.3e-3 or more (DeepSeek-V2's MLA on
# CPU 2.3e-3, Cohere2-MoE's softmax routing without norm_topk_prob 9.8e-3, OLMoE with
# norm_topk_prob 0.013-0.025, an LM head vLLM never loaded 0.8-3.4 or NaN). 1e-3 leaves ten times
# the largest agreement and is under half the smallest disagreement.
FIRST_BATCH_BOUND_FP32 = 1e-3
# what bf16 rounding alone gave on the default model (bench/README.md: max 0.022 over 60 steps)
BF16_ROUNDING_MEASURED = 0.022


def first_batch_check(logprob_diff: float, dtype: str, family: str, step: int) -> tuple[str, str]:
    """The verdict on a run's first on-policy batch, whose max |trainer - generator| log-prob is
    `logprob_diff`: ("stop", the line) in fp32 above FIRST_BATCH_BOUND_FP32, or not a number in
    any dtype; ("warn", the line) in bf16 above it, where rounding alone reaches it; ("", "")
    otherwise. `family` names the model (its model type and architectures)."""
    over = not logprob_diff <= FIRST_BATCH_BOUND_FP32  # (NaN included)
    figure = (
        f"trainer and generator log-probs differ by up to {logprob_diff:.3g} on the run's first "
        f"on-policy batch (step {step}; {family}"
    )
    if over and (dtype != "bf16" or math.isnan(logprob_diff)):
        return "stop", (
            f"error: {figure}; {dtype}, where every family served as transformers scores it agrees "
            f"within 1e-4 and a run stops above {FIRST_BATCH_BOUND_FP32:g}): vLLM serves this "
            "model otherwise than the trainer scores it, and the run would train on samples from "
            "another distribution than the one it updates"
        )
    if over:
        return "warn", (
            f"warning: {figure}; bf16, whose rounding alone gave up to {BF16_ROUNDING_MEASURED} on "
            f"the default model): a few steps with --dtype fp32 tell rounding from a model served "
            f"otherwise (fp32 stops above {FIRST_BATCH_BOUND_FP32:g})"
        )
    return "", ""


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What the trainer measured of one step, as `RunLog.step` is handed it."""

    step: int
    version: int  # the weights' version after the step
    loss: float
    grad_norm: float
    logprob_diff: float | None  # max |trainer - generator| log-prob on the on-policy rows
    wait_s: float
    train_s: float
    publish_ms: float | None
    skipped: bool  # no new version (every update NaN/inf)

    @property
    def trained_from(self) -> int:
        """The version the batch was trained against."""
        return self.version - (0 if self.skipped else 1)


class RunLog:
    """Rank 0's metrics: one JSON row per step, a progress line, wandb, and the summary at the
    end."""

    def __init__(self, cfg, world_size, start_step=0):
        self.cfg, self.rows, self.start = cfg, [], time.perf_counter()
        self.warned_all_faults = False
        self.tokens_trained = self.dropped = self.wait_s = self.train_s = 0.0
        self.max_token_lag, self.logprob_diff, self.sync_ms, self.gen = 0, None, [], {}
        self.sync_mb = None  # set by the trainer: the size of the packed shared buffer
        self.bad_steps = 0
        # when this process's first step ended (the ETA counts from there)
        self.first_step_end = None
        self.evals: list[dict] = []  # the eval/... keys of every evaluation, in order
        path = os.path.join(cfg.out, "metrics.jsonl")
        if start_step and os.path.exists(path):  # a resume: keep the rows of the steps already done
            with open(path) as f:
                earlier = [json.loads(line) for line in f if line.strip()]
            self.rows = [r for r in earlier if r["step"] < start_step]
            self.start -= self.rows[-1]["wall_s"] if self.rows else 0.0
            for r in self.rows:
                self.tokens_trained += r["tokens"]
                self.dropped += r["dropped_stale"]
                self.wait_s += r["trainer_wait_s"]
                self.train_s += r["train_s"]
                self.max_token_lag = max(self.max_token_lag, r["lag_max"])
                self.bad_steps += int(r["skipped"])
                if r.get("logprob_diff_on_policy") is not None:
                    self.logprob_diff = max(self.logprob_diff or 0.0, r["logprob_diff_on_policy"])
                if r.get("sync_ms") is not None:
                    self.sync_ms.append(r["sync_ms"])
                if "eval/step" in r:
                    self.evals.append({k: v for k, v in r.items() if k.startswith("eval/")})
        self.resumed_rows = len(self.rows)
        self.file = open(path, "w")
        for r in self.rows:
            self.file.write(json.dumps(r) + "\n")
        self.wandb = None
        if cfg.wandb != "off":
            os.environ["WANDB_MODE"] = cfg.wandb
            import wandb  # optional: only runs that log to wandb import it

            self.wandb = wandb.init(
                project=cfg.wandb_project, config=dataclasses.asdict(cfg), dir=cfg.out
            )
            # plotted against the step evaluated
            self.wandb.define_metric("eval/*", step_metric="eval/step")

    def step(
        self,
        step,
        version,
        taken,
        batch,
        metrics,
        *,
        loss,
        grad_norm,
        logprob_diff,
        wait_s,
        train_s,
        publish_ms,
        skipped,
        evals=(),
    ):
        """Record one step: the run's totals, the step's row (with the evaluations answered during
        it) in metrics.jsonl and wandb, and every --log-every steps the progress line."""
        figures = StepFigures(
            step=step,
            version=version,
            loss=loss,
            grad_norm=grad_norm,
            logprob_diff=logprob_diff,
            wait_s=wait_s,
            train_s=train_s,
            publish_ms=publish_ms,
            skipped=skipped,
        )
        lag = buffer.staleness_stats(batch, figures.trained_from)
        self.add_to_totals(taken, batch, lag, figures)
        row = self.row_of(taken, batch, metrics, lag, figures)
        warning = all_faults_warning(row, sum(len(g.rewards) for g in taken.groups))
        if warning and not self.warned_all_faults:  # once a run
            self.warned_all_faults = True
            print(warning, file=sys.stderr, flush=True)
        # what staleness cost, by model-token length bucket and by turns (buffer.stale_census)
        row.update(
            stale_by_len=taken.stale.get("len", {}), stale_by_turns=taken.stale.get("turns", {})
        )
        for result in evals:  # usually none; two answers in one step: the row keeps the newer
            self.evals.append(evaluation.summarize(result, self.cfg.eval_pass_reward))
            row.update(self.evals[-1])
            print(evaluation_line(self.evals[-1]), flush=True)
        self.write(row, figures)

    def add_to_totals(self, taken, batch, lag: dict, figures: StepFigures) -> None:
        """The run's totals (the summary's), and the generator's latest counters, with one step."""
        for g in taken.groups:
            self.sync_ms += g.gen_stats.get("sync_ms", [])
        self.tokens_trained += int(batch.mask.sum())
        self.dropped += taken.samples_dropped
        self.wait_s += figures.wait_s
        self.train_s += figures.train_s
        self.max_token_lag = max(self.max_token_lag, lag["lag_max"])
        self.bad_steps += int(figures.skipped)
        if figures.logprob_diff is not None:
            self.logprob_diff = max(self.logprob_diff or 0.0, figures.logprob_diff)
        self.gen = taken.groups[-1].gen_stats

    def row_of(self, taken, batch, metrics: dict, lag: dict, figures: StepFigures) -> dict:
        """The step's row, once the totals count it: what it trained on and how, the generator's
        counters, the trainer's `metrics`, then each reward function's figures, the lengths, the
        tokens by lag, the episodes and the recorded routes."""
        rewards = [r for g in taken.groups for r in g.rewards]
        zero_var = sum(1 for g in taken.groups if max(g.rewards) == min(g.rewards))
        # the model's sampled tokens per completion, before stale and overlong masking
        # (`trained_len`: after)
        lengths = torch.tensor([n for g in taken.groups for n in g.model_tokens()])
        gen = self.gen
        row = {
            "step": figures.step,
            "version": figures.version,
            "reward": sum(rewards) / len(rewards),
            "loss": figures.loss,
            "grad_norm": figures.grad_norm,
            "zero_var_groups": zero_var / len(taken.groups),
            "empty_completions": int((lengths == 0).sum()),
            "tokens": int(batch.mask.sum()),
            "completion_len": float(lengths.float().mean()),
            "trained_len": float(batch.mask.sum(1).float().mean()),
            "dropped_stale": taken.samples_dropped,
            "dropped_stale_total": int(self.dropped),
            **lag,
            "trainer_wait_s": figures.wait_s,
            "train_s": figures.train_s,
            "publish_ms": figures.publish_ms,
            "logprob_diff_on_policy": figures.logprob_diff,
            "skipped": figures.skipped,
            "gen_tokens": gen.get("tokens"),
            "gen_idle_s": gen.get("idle_s"),
            "gen_elapsed_s": gen.get("elapsed_s"),
            "gen_loaded_version": gen.get("loaded_version"),
            # in flight at swaps, re-prefilled or kept (--kv-on-swap)
            "gen_swap_requests": gen.get("swap_requests"),
            "sync_ms": (self.sync_ms[-1] if self.sync_ms else None),
            "wall_s": time.perf_counter() - self.start,
            **metrics,
        }
        # per reward function: mean/std/none_frac/errors/time_s
        row.update(summarize_rewards([g.reward_stats for g in taken.groups]))
        sampled_by = batch.token_versions[batch.mask]  # the version that sampled each token trained
        lags = torch.bincount((figures.trained_from - sampled_by).clamp(min=0))
        row.update(
            completion_len_min=int(lengths.min()),
            completion_len_max=int(lengths.max()),
            unscored=sum(len(g.unscored) for g in taken.groups),
            gen_reward_s=gen.get("reward_s"),
            **{f"lag_hist/{k}": int(n) for k, n in enumerate(lags)},  # trained tokens per lag
            epoch=max(g.epoch for g in taken.groups),
            **episode_metrics(taken.groups),
            **buffer.route_stats(taken.groups),  # with recorded routes: router/bytes_per_token
        )
        return row

    def write(self, row: dict, figures: StepFigures) -> None:
        """Keep the row, append it to metrics.jsonl (and wandb); the progress line every
        --log-every steps and at the last."""
        self.rows.append(row)
        if self.first_step_end is None:
            self.first_step_end = time.perf_counter()
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=figures.step)
        step = figures.step
        if step % self.cfg.log_every == 0 or step == self.cfg.steps - 1:
            line = self.progress_line(step, figures.version, figures.wait_s, figures.train_s)
            print(line, flush=True)

    def progress_line(self, step, version, wait_s, train_s) -> str:
        """One line a person can follow: where the run is, how it learns, how stale, how fast, how
        long."""
        recent = self.rows[-self.cfg.log_every :]
        now = time.perf_counter()
        done_here = len(self.rows) - self.resumed_rows
        if done_here <= 1:  # the first step waited for the engine: time the rest from its end
            eta = "-"
        else:
            left = int((now - self.first_step_end) / (done_here - 1) * (self.cfg.steps - step - 1))
            eta = f"{left // 60}m{left % 60:02d}s"
        row = self.rows[-1]
        width = len(str(self.cfg.steps))
        return (
            f"step {step + 1:>{width}}/{self.cfg.steps}  v{version:<5d} "
            f"reward {sum(r['reward'] for r in recent) / len(recent):.3f}  "
            f"lag {row['lag_mean']:.2f} (max {row['lag_max']})  dropped {int(self.dropped)}  "
            f"wait {wait_s * 1e3:4.0f} ms  train {train_s * 1e3:4.0f} ms  "
            f"{self.tokens_trained / (now - self.start):6.0f} tok/s  ETA {eta}"
        )

    def finish(self, version):
        n = len(self.rows)
        rewards = [r["reward"] for r in self.rows]
        first = rewards[: max(1, n // 10)]
        last = rewards[-max(1, n // 5) :]
        wall = time.perf_counter() - self.start
        gen = self.gen
        summary = {
            "steps": n,
            "version": version,
            "wall_s": wall,
            "reward_first10": sum(first) / len(first) if first else None,
            "reward_last20": sum(last) / len(last) if last else None,
            "tokens_trained": int(self.tokens_trained),
            "max_token_lag": self.max_token_lag,
            "dropped_stale": int(self.dropped),
            "bad_steps": self.bad_steps,
            "trainer_wait_frac": self.wait_s / wall if wall else None,
            "generator_wait_frac": gen.get("idle_s", 0) / gen["elapsed_s"]
            if gen.get("elapsed_s")
            else None,
            "sync_ms_median": statistics.median(self.sync_ms) if self.sync_ms else None,
            "gen_tokens_per_s": gen.get("tokens", 0) / gen["elapsed_s"]
            if gen.get("elapsed_s")
            else None,
            "train_tokens_per_s": self.tokens_trained / self.train_s if self.train_s else None,
            "logprob_diff_after_sync": self.logprob_diff,
            # what each weight sync moves (with --lora-rank: the adapter only)
            "sync_mb": self.sync_mb,
            "eval_first": self.evals[0]["eval/greedy_pass@1"] if self.evals else None,
            "eval_last": self.evals[-1]["eval/greedy_pass@1"] if self.evals else None,
            "eval_last_step": self.evals[-1]["eval/step"] if self.evals else None,
            "eval_s": sum(e["eval/time_s"] for e in self.evals) if self.evals else None,
            "train_prompts": gen.get("train_prompts"),
            "prompts_dropped_long": gen.get("prompts_dropped_long"),
            # sequences vLLM runs at once (infra/devices.engine_concurrency)
            "max_num_seqs": gen.get("max_num_seqs"),
            "config": dataclasses.asdict(self.cfg),
        }
        with open(os.path.join(self.cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.file.close()
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if k != "config"})
            self.wandb.finish()
        if n:
            print(
                f"done: {n} steps in {wall:.0f} s, reward {summary['reward_first10']:.3f} -> "
                f"{summary['reward_last20']:.3f}; summary in {self.cfg.out}/summary.json",
                flush=True,
            )
        try:
            plots.plot_run(self.cfg.out)
        except Exception as e:  # a plot is never worth failing a finished run
            print(
                f"warning: no {self.cfg.out}/plots.png ({type(e).__name__}: {e})",
                file=sys.stderr,
                flush=True,
            )
