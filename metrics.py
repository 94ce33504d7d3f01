"""metrics.py — what a run reports: one JSON row per step, a progress line, wandb, the summary.

Role
    `RunLog` lives in the trainer's rank 0. Each step it receives what the step saw (the groups taken from
    the queue with their generator counters, the batch, the loss metrics) and writes one row to
    `OUT/metrics.jsonl`; every `--log-every` steps it prints a progress line; with `--wandb online|offline`
    it logs the same rows. At the end it writes `OUT/summary.json` and `OUT/plots.png`.

Data contract
    - A row: step, version, reward, loss and the loss family's diagnostics (clip fractions, ratio, approx
      KL, IS weight, entropy of the sampling distribution; means over the step's completion tokens, every
      micro-batch and rank), micro-batches per rank and the share of their positions that is padding
      (pad_frac), grad norm, zero-variance groups, completion lengths, per-token lag (mean, max,
      histogram), dropped stale samples, trainer wait / train / publish times, generator counters, sync
      latency, and per-reward-function statistics.
    - The summary: steps, wall_s, reward_first10 (mean reward over the first 10% of steps), reward_last20,
      tokens_trained, max_token_lag, dropped_stale, trainer_wait_frac, generator_wait_frac, sync_ms_median,
      gen_tokens_per_s, train_tokens_per_s, logprob_diff_after_sync, bad_steps, sync_mb, config.
    - On a resume, the rows of the steps already done are kept and the totals continue from them.

May touch: files under `--out` only.
"""
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

import buffer
import data


class RunLog:
    """Rank 0's metrics: one JSON row per step, a progress line, wandb, and the summary at the end."""

    def __init__(self, cfg, world_size, start_step=0):
        self.cfg, self.rows, self.start = cfg, [], time.perf_counter()
        self.tokens_trained = self.dropped = self.wait_s = self.train_s = 0.0
        self.max_token_lag, self.logprob_diff, self.sync_ms, self.gen = 0, None, [], {}
        self.sync_mb = None  # set by the trainer: the size of the packed shared buffer
        self.bad_steps = 0
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
        self.file = open(path, "w")
        for r in self.rows:
            self.file.write(json.dumps(r) + "\n")
        self.wandb = None
        if cfg.wandb != "off":
            os.environ["WANDB_MODE"] = cfg.wandb
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg), dir=cfg.out)

    def step(self, step, version, taken, batch, metrics, *, loss, grad_norm, logprob_diff, wait_s, train_s,
             publish_ms, skipped):
        rewards = [r for g in taken.groups for r in g.rewards]
        zero_var = sum(1 for g in taken.groups if max(g.rewards) == min(g.rewards)) / len(taken.groups)
        lag = buffer.staleness_stats(batch, version - (0 if skipped else 1))
        gen = taken.groups[-1].gen_stats
        for g in taken.groups:
            self.sync_ms += g.gen_stats.get("sync_ms", [])
        tokens = int(batch.mask.sum())
        self.tokens_trained += tokens
        self.dropped += taken.samples_dropped
        self.wait_s += wait_s
        self.train_s += train_s
        self.max_token_lag = max(self.max_token_lag, lag["lag_max"])
        self.bad_steps += int(skipped)
        if logprob_diff is not None:
            self.logprob_diff = max(self.logprob_diff or 0.0, logprob_diff)
        self.gen = gen
        row = {"step": step, "version": version, "reward": sum(rewards) / len(rewards), "loss": loss,
               "grad_norm": grad_norm, "zero_var_groups": zero_var, "empty_completions": int((batch.mask.sum(1) == 0).sum()), "tokens": tokens,
               "completion_len": float(batch.mask.sum(1).float().mean()), "dropped_stale": taken.samples_dropped,
               "dropped_stale_total": int(self.dropped), **lag, "trainer_wait_s": wait_s, "train_s": train_s,
               "publish_ms": publish_ms, "logprob_diff_on_policy": logprob_diff, "skipped": skipped,
               "gen_tokens": gen.get("tokens"), "gen_idle_s": gen.get("idle_s"),
               "gen_elapsed_s": gen.get("elapsed_s"), "gen_loaded_version": gen.get("loaded_version"),
               "sync_ms": (self.sync_ms[-1] if self.sync_ms else None), "wall_s": time.perf_counter() - self.start,
               **metrics}
        # per reward function: mean/std/none_frac/errors/time_s; lengths; tokens per lag
        lengths = batch.mask.sum(1)
        lags = torch.bincount((version - (0 if skipped else 1) - batch.token_versions[batch.mask]).clamp(min=0))
        row.update(data.summarize([g.reward_stats for g in taken.groups]), completion_len_min=int(lengths.min()),
                   completion_len_max=int(lengths.max()), unscored=sum(g.unscored for g in taken.groups),
                   gen_reward_s=gen.get("reward_s"), **{f"lag_hist/{k}": int(n) for k, n in enumerate(lags)})
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if step % self.cfg.log_every == 0 or step == self.cfg.steps - 1:
            recent = self.rows[-self.cfg.log_every:]
            print(f"step {step:5d}  v{version:<5d} reward {sum(r['reward'] for r in recent) / len(recent):.3f}  "
                  f"lag {row['lag_mean']:.2f} (max {row['lag_max']})  dropped {int(self.dropped)}  "
                  f"wait {wait_s * 1e3:6.0f} ms  train {train_s * 1e3:5.0f} ms  "
                  f"{self.tokens_trained / (time.perf_counter() - self.start):7.0f} tok/s", flush=True)

    def finish(self, version):
        n = len(self.rows)
        rewards = [r["reward"] for r in self.rows]
        first = rewards[: max(1, n // 10)]
        last = rewards[-max(1, n // 5):]
        wall = time.perf_counter() - self.start
        gen = self.gen
        summary = {
            "steps": n, "version": version, "wall_s": wall,
            "reward_first10": sum(first) / len(first) if first else None,
            "reward_last20": sum(last) / len(last) if last else None,
            "tokens_trained": int(self.tokens_trained), "max_token_lag": self.max_token_lag,
            "dropped_stale": int(self.dropped), "bad_steps": self.bad_steps,
            "trainer_wait_frac": self.wait_s / wall if wall else None,
            "generator_wait_frac": gen.get("idle_s", 0) / gen["elapsed_s"] if gen.get("elapsed_s") else None,
            "sync_ms_median": statistics.median(self.sync_ms) if self.sync_ms else None,
            "gen_tokens_per_s": gen.get("tokens", 0) / gen["elapsed_s"] if gen.get("elapsed_s") else None,
            "train_tokens_per_s": self.tokens_trained / self.train_s if self.train_s else None,
            "logprob_diff_after_sync": self.logprob_diff,
            "sync_mb": self.sync_mb,  # what each weight sync moves (with --lora-rank: the adapter only)
            "config": dataclasses.asdict(self.cfg),
        }
        with open(os.path.join(self.cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.file.close()
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if k != "config"})
            self.wandb.finish()
        if n:
            print(f"done: {n} steps in {wall:.0f} s, reward {summary['reward_first10']:.3f} -> "
                  f"{summary['reward_last20']:.3f}; summary in {self.cfg.out}/summary.json", flush=True)
        try:
            import plots
            plots.plot_run(self.cfg.out)
        except Exception as e:  # a plot is never worth failing a finished run
            print(f"warning: no {self.cfg.out}/plots.png ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
