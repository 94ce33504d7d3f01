"""plots.py — one picture of a run: `plot_run(out_dir)` reads OUT/metrics.jsonl and writes OUT/plots.png.

Role: called by train.py when a run finishes (a failure only warns), or by hand on any run directory, even
while it runs: `python plots.py runs/latest`. Matplotlib (Agg); needs neither vLLM nor torch.
Data contract: reads the rows metrics.py writes: `step`, `reward`, `reward/<name>/mean`, `eval/...` (plotted
at `eval/step`), `completion_len` (+ `_min`, `_max`), `lag_hist/<k>` (older runs: `lag_max`), `sync_ms`,
`epoch`, `env/...` and `stale_by_turns` (env runs). A missing key leaves its panel empty. Six panels: reward,
held-out evaluation, completion length, staleness, sync latency, epochs (env runs: episodes instead).
May touch: OUT/plots.png only.
"""
from __future__ import annotations

import json
import os
import sys


def read_rows(out_dir: str) -> list[dict]:
    rows = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(out_dir: str) -> str | None:
    """Write OUT/plots.png from OUT/metrics.jsonl; returns its path (None when there is no row yet)."""
    # matplotlib only when a picture is drawn (slow to import; the Agg backend is chosen before pyplot loads)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_rows(out_dir)
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 20)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    (ax_reward, ax_eval, ax_len), (ax_lag, ax_sync, ax_epoch) = axes

    plot_reward(ax_reward, rows, steps, window)
    plot_eval(ax_eval, rows)

    lengths = [r.get("completion_len") for r in rows]
    ax_len.plot(steps, lengths, color="tab:green", lw=1.5, label="mean")
    if all(r.get("completion_len_min") is not None for r in rows):
        ax_len.fill_between(steps, [r["completion_len_min"] for r in rows], [r["completion_len_max"] for r in rows],
                            color="tab:green", alpha=0.2, label="min-max")
    ax_len.set(title="completion length (tokens trained)", xlabel="step")
    ax_len.legend(fontsize=8)

    hist: dict[int, int] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("lag_hist/"):
                hist[int(k.split("/")[1])] = hist.get(int(k.split("/")[1]), 0) + v
    if hist:
        ax_lag.bar(list(hist), list(hist.values()), color="tab:orange")
        ax_lag.set(title="staleness: trained tokens by lag", xlabel="lag (versions)", ylabel="tokens")
    elif any("lag_max" in r for r in rows):
        lag_max = [r["lag_max"] for r in rows if "lag_max" in r]
        ax_lag.hist(lag_max, bins=range(0, max(lag_max) + 2), color="tab:orange", align="left")
        ax_lag.set(title="staleness: max lag per step", xlabel="lag (versions)", ylabel="steps")

    sync = [(r["step"], r["sync_ms"]) for r in rows if r.get("sync_ms") is not None]
    if sync:
        xs, ys = zip(*sync)
        ax_sync.plot(xs, ys, ".", color="tab:purple", ms=3)
        median = sorted(ys)[len(ys) // 2]
        ax_sync.axhline(median, color="tab:purple", lw=1, ls="--", label=f"median {median:.0f} ms")
        ax_sync.legend(fontsize=8)
    ax_sync.set(title="sync latency (publish -> serving)", xlabel="step", ylabel="ms")

    epochs = [(r["step"], r["epoch"]) for r in rows if r.get("epoch") is not None]
    if any("env/turns_mean" in r for r in rows):  # an env run: its episodes in place of the epochs
        plot_episodes(ax_epoch, rows)
    elif epochs:
        xs, ys = zip(*epochs)
        ax_epoch.step(xs, ys, where="post", color="tab:brown")
        ax_epoch.set_ylim(-0.1, max(ys) + 0.5)
        ax_epoch.set(title="epoch (passes over the training prompts)", xlabel="step")

    for ax in (ax_reward, ax_eval, ax_len, ax_lag, ax_sync, ax_epoch):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(os.path.abspath(out_dir), fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "plots.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_episodes(ax, rows: list[dict]) -> None:
    """The episodes panel (env runs): turns per episode, the share of tokens the env wrote, faults and cuts."""
    steps = [r["step"] for r in rows if "env/turns_mean" in r]
    env_rows = [r for r in rows if "env/turns_mean" in r]
    ax.plot(steps, [r["env/turns_mean"] for r in env_rows], color="tab:brown", lw=1.5, label="turns per episode")
    ax.set(title="episodes", xlabel="step", ylabel="turns")
    right = ax.twinx()
    right.plot(steps, [r.get("env/token_frac") or 0 for r in env_rows], color="tab:gray", lw=1, label="env token share")
    episodes = [sum(v[0] for v in (r.get("stale_by_turns") or {}).values()) or 1 for r in env_rows]
    for key, color, label in (("env/truncated_max_turns", "tab:red", "cut by --max-turns"),
                              ("env/truncated_max_episode_tokens", "tab:orange", "cut by --max-episode-tokens"),
                              ("env/errors", "k", "env errors + timeouts")):
        values = [(r.get(key) or 0) + (r.get("env/timeouts") or 0 if key == "env/errors" else 0) for r in env_rows]
        right.plot(steps, [v / n for v, n in zip(values, episodes)], color=color, lw=1, ls="--", label=label)
    right.set_ylim(0, 1.02)
    right.set_ylabel("share of episodes / tokens")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)


def plot_reward(ax_reward, rows: list[dict], steps: list[int], window: int) -> None:
    """The reward panel: the weighted sum, smoothed, and each reward function's mean."""
    rewards = [r["reward"] for r in rows]
    ax_reward.plot(steps, rewards, color="tab:blue", alpha=0.3, lw=1)
    ax_reward.plot(steps, smooth(rewards, window), color="tab:blue", lw=2, label="reward (weighted sum)")
    names = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean")})
    if len(names) > 1 or (names and names[0] != "copy"):
        for name in names:
            pts = [(r["step"], r[f"reward/{name}/mean"]) for r in rows if r.get(f"reward/{name}/mean") is not None]
            if pts:
                xs, ys = zip(*pts)
                ax_reward.plot(xs, smooth(list(ys), window), lw=1.2, ls="--", label=name)
    ax_reward.set(title="reward", xlabel="step")
    ax_reward.legend(fontsize=8)


def plot_eval(ax_eval, rows: list[dict]) -> None:
    """The held-out panel: greedy pass@1, mean sampled reward and the largest pass@k, at the step evaluated."""
    evals = sorted((r for r in rows if r.get("eval/step") is not None), key=lambda r: r["eval/step"])
    pass_keys = sorted((k for k in (evals[-1] if evals else {}) if k.startswith("eval/pass@")),
                       key=lambda k: int(k.split("@")[1]))
    lines = [("eval/greedy_pass@1", "o-", "greedy pass@1"), ("eval/reward", "s--", "mean reward (sampled)")]
    lines += [(pass_keys[-1], "^:", pass_keys[-1][len("eval/"):])] if pass_keys else []
    for key, style, label in lines:
        pts = [(r["eval/step"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax_eval.plot(xs, ys, style, ms=4, lw=1.5, label=label)
    ax_eval.set(title="held-out evaluation", xlabel="step evaluated")
    if evals:
        ax_eval.legend(fontsize=8)
    else:
        ax_eval.text(0.5, 0.5, "no evaluation (--eval-every 0)", ha="center", va="center",
                     transform=ax_eval.transAxes, color="gray")


if __name__ == "__main__":
    for d in sys.argv[1:] or ["runs/latest"]:
        print(plot_run(d))
