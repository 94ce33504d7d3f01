"""run/plots.py — the pictures of a run: OUT/plots.png (its curves over steps) and OUT/timeline.png
(both sides over wall time).

Role: `plot_run(out_dir)` reads OUT/metrics.jsonl and writes OUT/plots.png; `plot_timeline(out_dir)`
reads OUT/trace.json (tracing.py) and writes OUT/timeline.png. Called by train.py when a run
finishes (a failure only warns), or by hand on any run directory, even while it runs: `python
plots.py runs/latest` (which first merges the trace of a run in progress). Matplotlib (Agg); needs
neither vLLM nor torch. Data contract: reads the rows metrics.py writes: `step`, `reward`,
`reward/<name>/mean`, `eval/...` (plotted at `eval/step`), `completion_len` (+ `_min`, `_max`),
`lag_hist/<k>` (older runs: `lag_max`), `sync_ms`, `epoch`, `env/...` and `stale_by_turns` (env
runs). A missing key leaves its panel empty. Six panels: reward, held-out evaluation, completion
length, staleness, sync latency, epochs (env runs: episodes instead). The timeline reads the trace's
events by their "cat" (tracing.py): each trainer rank's waits and work, the generator's engine
steps, evaluations, idle engine, staleness gate, weight swaps and full-queue waits, the queue's
depth, the requests in the engine (from the request spans), and each step's trained tokens by
version (rank 0's step spans). A run's start has its own timeline-START.png beside its
trace-START.json, timeline.png and trace.json linking the newest (tracing.start_name). May touch:
OUT/plots.png, OUT/timeline.png and OUT/timeline-START.png (and the trace, through
trace_merge.merge, from the command line).
"""

from __future__ import annotations

import json
import os
import sys

from infra import tracing
from run import trace_merge


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
    """Write OUT/plots.png from OUT/metrics.jsonl; returns its path (None when there is no row
    yet)."""
    # matplotlib only when a picture is drawn (slow to
    # import; the Agg backend is chosen before pyplot loads)
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
        ax_len.fill_between(
            steps,
            [r["completion_len_min"] for r in rows],
            [r["completion_len_max"] for r in rows],
            color="tab:green",
            alpha=0.2,
            label="min-max",
        )
    ax_len.set(title="completion length (tokens trained)", xlabel="step")
    ax_len.legend(fontsize=8)

    hist: dict[int, int] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("lag_hist/"):
                hist[int(k.split("/")[1])] = hist.get(int(k.split("/")[1]), 0) + v
    if hist:
        ax_lag.bar(list(hist), list(hist.values()), color="tab:orange")
        ax_lag.set(
            title="staleness: trained tokens by lag", xlabel="lag (versions)", ylabel="tokens"
        )
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
    """The episodes panel (env runs): turns per episode, the share of tokens the env wrote, faults
    and cuts."""
    steps = [r["step"] for r in rows if "env/turns_mean" in r]
    env_rows = [r for r in rows if "env/turns_mean" in r]
    ax.plot(
        steps,
        [r["env/turns_mean"] for r in env_rows],
        color="tab:brown",
        lw=1.5,
        label="turns per episode",
    )
    ax.set(title="episodes", xlabel="step", ylabel="turns")
    right = ax.twinx()
    right.plot(
        steps,
        [r.get("env/token_frac") or 0 for r in env_rows],
        color="tab:gray",
        lw=1,
        label="env token share",
    )
    episodes = [sum(v[0] for v in (r.get("stale_by_turns") or {}).values()) or 1 for r in env_rows]
    for key, color, label in (
        ("env/truncated_max_turns", "tab:red", "cut by --max-turns"),
        ("env/truncated_max_episode_tokens", "tab:orange", "cut by --max-episode-tokens"),
        ("env/errors", "k", "env errors + timeouts"),
    ):
        values = [
            (r.get(key) or 0) + (r.get("env/timeouts") or 0 if key == "env/errors" else 0)
            for r in env_rows
        ]
        right.plot(
            steps,
            [v / n for v, n in zip(values, episodes)],
            color=color,
            lw=1,
            ls="--",
            label=label,
        )
    right.set_ylim(0, 1.02)
    right.set_ylabel("share of episodes / tokens")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)


def plot_reward(ax_reward, rows: list[dict], steps: list[int], window: int) -> None:
    """The reward panel: the weighted sum, smoothed, and each reward function's mean."""
    rewards = [r["reward"] for r in rows]
    ax_reward.plot(steps, rewards, color="tab:blue", alpha=0.3, lw=1)
    ax_reward.plot(
        steps, smooth(rewards, window), color="tab:blue", lw=2, label="reward (weighted sum)"
    )
    names = sorted(
        {
            k.split("/")[1]
            for r in rows
            for k in r
            if k.startswith("reward/") and k.endswith("/mean")
        }
    )
    if len(names) > 1 or (names and names[0] != "copy"):
        for name in names:
            pts = [
                (r["step"], r[f"reward/{name}/mean"])
                for r in rows
                if r.get(f"reward/{name}/mean") is not None
            ]
            if pts:
                xs, ys = zip(*pts)
                ax_reward.plot(xs, smooth(list(ys), window), lw=1.2, ls="--", label=name)
    ax_reward.set(title="reward", xlabel="step")
    ax_reward.legend(fontsize=8)


def plot_eval(ax_eval, rows: list[dict]) -> None:
    """The held-out panel: greedy pass@1, mean sampled reward and the largest pass@k, at the step
    evaluated."""
    evals = sorted(
        (r for r in rows if r.get("eval/step") is not None), key=lambda r: r["eval/step"]
    )
    pass_keys = sorted(
        (k for k in (evals[-1] if evals else {}) if k.startswith("eval/pass@")),
        key=lambda k: int(k.split("@")[1]),
    )
    lines = [
        ("eval/greedy_pass@1", "o-", "greedy pass@1"),
        ("eval/reward", "s--", "mean reward (sampled)"),
    ]
    lines += [(pass_keys[-1], "^:", pass_keys[-1][len("eval/") :])] if pass_keys else []
    for key, style, label in lines:
        pts = [(r["eval/step"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax_eval.plot(xs, ys, style, ms=4, lw=1.5, label=label)
    ax_eval.set(title="held-out evaluation", xlabel="step evaluated")
    if evals:
        ax_eval.legend(fontsize=8)
    else:
        ax_eval.text(
            0.5,
            0.5,
            "no evaluation (--eval-every 0)",
            ha="center",
            va="center",
            transform=ax_eval.transAxes,
            color="gray",
        )


# The timeline: rows of spans, by the events' "cat"; (cat, colour, legend label)
TRAINER_SPANS = (
    ("wait", "#f4a6a6", "trainer waits for data"),
    ("forward", "#1f77b4", "forward"),
    ("backward", "#6baed6", "backward"),
    ("optimizer", "#08306b", "optimizer step"),
    ("proximal log-probs", "#9ecae1", "proximal log-probs"),
    ("publish", "#9467bd", "publish"),
    ("evaluation", "#7f7f7f", "evaluation"),
    ("checkpoint", "#000000", "checkpoint / save"),
    ("save model", "#000000", None),
)
ENGINE_SPANS = (("engine", "#2ca02c", "engine step (vLLM)"),)
GENERATOR_SPANS = (
    ("evaluation", "#7f7f7f", None),
    ("idle", "#c7c7c7", "engine idle"),
    ("staleness gate", "#ff7f0e", "no group may start (--max-lag)"),
    ("queue full", "#8c564b", "a group blocked: queue full"),
    ("swap", "#d62728", "weight swap"),
)


def plot_timeline(out_dir: str) -> str | None:
    """Write OUT/timeline.png from OUT/trace.json; returns its path (None when the trace has no
    span). Where trace.json links a start's own trace (tracing.start_name), the picture is that
    start's too, timeline-START.png, and timeline.png links it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out_dir, tracing.TRACE)) as f:
        events = json.load(f)["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    spans = [e for e in events if e["ph"] == "X"]
    if not spans:
        return None
    trainers = sorted(
        (p for p, n in names.items() if n.startswith("trainer")), key=lambda p: names[p]
    )
    rows = [(names[p], [e for e in spans if e["pid"] == p], TRAINER_SPANS) for p in trainers]
    rows += [("vLLM engine", spans, ENGINE_SPANS), ("generator", spans, GENERATOR_SPANS)]
    steps = sorted(
        (e for e in spans if e["cat"] == "step" and e["args"].get("rank") == 0),
        key=lambda e: e["ts"],
    )
    fig, (ax_all, ax_zoom, ax_queue, ax_version) = plt.subplots(
        4, 1, figsize=(15, 11), gridspec_kw={"height_ratios": [3, 3, 1.6, 2.2]}
    )
    draw_rows(ax_all, rows)
    ax_all.set_title(
        "both sides over the run (wall time since the start; a thin orange bar over grey: the "
        "generator waits for newer weights)",
        fontsize=10,
    )
    window = zoom_window(steps)
    draw_rows(ax_zoom, rows, window)
    ax_zoom.set_title(f"zoom: steps {window[2]}-{window[3]}", fontsize=10)
    ax_all.axvspan(window[0], window[1], color="k", alpha=0.08)
    plot_counters(ax_queue, events)
    plot_versions(ax_version, steps)
    ax_version.set_xlim(ax_all.get_xlim())
    ax_queue.set_xlim(ax_all.get_xlim())
    fig.legend(
        handles=[
            matplotlib.patches.Patch(color=c, label=label)
            for _, c, label in TRAINER_SPANS + ENGINE_SPANS + GENERATOR_SPANS
            if label
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.975),
        ncol=7,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(f"{out_dir}: {busy_line(rows, steps)}", fontsize=9, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    source = os.path.basename(os.path.realpath(os.path.join(out_dir, tracing.TRACE)))
    own = tracing.STARTS.fullmatch(source) is not None
    name = tracing.file_name(source[: -len(".json")], tracing.TIMELINE) if own else "timeline.png"
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    if own:
        trace_merge.point(out_dir, tracing.TIMELINE, name)
    return path


def draw_rows(ax, rows, window=None) -> None:
    """One horizontal row per process role; its spans as bars, by category (later categories drawn
    over)."""
    lo, hi = (window[0], window[1]) if window else (-float("inf"), float("inf"))
    for y, (_, events, kinds) in enumerate(rows):
        for cat, color, _ in kinds:
            bars = [
                (e["ts"] / 1e6, e["dur"] / 1e6)
                for e in events
                if e["cat"] == cat and e["ts"] / 1e6 < hi and (e["ts"] + e["dur"]) / 1e6 > lo
            ]
            thin = cat in (
                "forward",
                "backward",
                "optimizer",
                "proximal log-probs",
                "staleness gate",
            )
            height = 0.35 if thin else 0.7
            ax.broken_barh(bars, (-y - height / 2, height), color=color, lw=0)
    ax.set_yticks([-y for y in range(len(rows))], [label for label, _, _ in rows], fontsize=8)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    if window:
        ax.set_xlim(lo, hi)
    ax.set_xlabel("s", fontsize=8)


def zoom_window(steps: list[dict]) -> tuple[float, float, int, int]:
    """Five steps in the middle of the run (the whole trace if it has fewer): (from s, to s, first,
    last step)."""
    if not steps:
        return 0.0, 1.0, 0, 0
    mid = len(steps) // 2
    chosen = steps[max(0, mid - 2) : mid + 3]
    first, last = chosen[0], chosen[-1]
    return (
        first["ts"] / 1e6 - 0.2 * first["dur"] / 1e6,
        (last["ts"] + last["dur"]) / 1e6,
        first["args"]["step"],
        last["args"]["step"],
    )


def plot_counters(ax, events) -> None:
    """The rollout queue's depth (groups) and the generator's requests in the engine (from its
    request spans)."""
    pts = sorted(
        (e["ts"] / 1e6, e["args"]["groups"])
        for e in events
        if e["ph"] == "C" and e["name"] == "rollout queue"
    )
    if pts:
        ax.step(*zip(*pts), where="post", color="tab:brown", lw=0.8)
    changes = sorted(
        [(e["ts"], 1) for e in events if e["ph"] == "X" and e["cat"] == "request"]
        + [(e["ts"] + e["dur"], -1) for e in events if e["ph"] == "X" and e["cat"] == "request"]
    )
    right, level, xs, ys = ax.twinx(), 0, [], []
    for ts, delta in changes:
        level += delta
        xs.append(ts / 1e6)
        ys.append(level)
    if xs:
        right.step(xs, ys, where="post", color="tab:green", lw=0.8)
    ax.set_ylabel("rollout queue (groups)", color="tab:brown", fontsize=8)
    right.set_ylabel("requests in the engine", color="tab:green", fontsize=8)
    ax.set_title(
        "rollout queue depth (groups waiting) and the generator's requests in the engine",
        fontsize=10,
    )


def plot_versions(ax, steps: list[dict]) -> None:
    """Each trained step (a bar over its wait and work): the shares of its tokens by their lag, the
    versions between the weights it trained from and those that sampled them."""
    shares: dict[int, dict[int, float]] = {}  # lag -> {step: share}
    lefts, width = [], []  # (each bar from the end of the step before: steps tile the time)
    steps = [e for e in steps if "version" in e["args"]]
    for i, e in enumerate(steps):
        counts = {
            int(v): n for v, n in e["args"].get("tokens_by_version", {}).items() if int(v) >= 0
        }
        total = sum(counts.values()) or 1
        for v, n in counts.items():
            lag = e["args"]["version"] - 1 - v
            shares.setdefault(lag, {})[i] = shares.get(lag, {}).get(i, 0.0) + n / total
        width.append(
            (e["ts"] + e["dur"]) / 1e6 - (lefts[-1] + width[-1] if lefts else e["ts"] / 1e6)
        )
        lefts.append((e["ts"] + e["dur"]) / 1e6 - width[-1])
    bottom = [0.0] * len(steps)
    for lag in sorted(shares):
        values = [shares[lag].get(i, 0.0) for i in range(len(steps))]
        ax.bar(
            lefts,
            values,
            width=width,
            bottom=bottom,
            align="edge",
            color=f"C{lag % 10}",
            lw=0,
            label=f"{lag} version{'s' * (lag != 1)} old",
        )
        bottom = [b + v for b, v in zip(bottom, values)]
    if steps:
        first, last = steps[0]["args"], steps[-1]["args"]
        ax.text(
            0.995,
            1.02,
            f"trained versions {first['version'] - 1} to {last['version'] - 1}",
            ha="right",
            va="bottom",
            transform=ax.transAxes,
            fontsize=8,
        )
    ax.set(ylabel="share of tokens", ylim=(0, 1))
    ax.set_title(
        "each trained batch's tokens by the weight version that sampled them (lag: versions behind "
        "the weights trained)",
        fontsize=10,
    )
    if shares:
        ax.legend(fontsize=8, loc="lower left", title="lag", title_fontsize=8, ncol=6)


def busy_line(rows, steps) -> str:
    """The shares of wall time over the trace: the trainer waiting, the engine stepping, swaps."""
    if not steps:
        return ""
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]

    def share(events, cat):
        return sum(
            min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
            for e in events
            if e["cat"] == cat and e["ts"] < hi and e["ts"] + e["dur"] > lo
        ) / (hi - lo)

    trainer, everything = rows[0][1], rows[-1][1]
    return (
        f"{len(steps)} steps; trainer 0 waits for data {share(trainer, 'wait'):.0%} of the time; "
        f"vLLM's engine runs steps {share(everything, 'engine'):.0%} of it, has nothing to run "
        f"{share(everything, 'idle'):.0%}; "
        f"the generator may start no group (--max-lag) {share(everything, 'staleness gate'):.0%}, "
        f"swaps weights {share(everything, 'swap'):.0%}"
    )


if __name__ == "__main__":
    for d in sys.argv[1:] or ["runs/latest"]:
        if os.path.exists(os.path.join(d, "metrics.jsonl")):
            print(plot_run(d))
        # a run in progress (or killed): its processes' files
        if os.path.isdir(os.path.join(d, "trace")):
            trace_merge.merge(d)
        if os.path.exists(os.path.join(d, "trace.json")):
            print(plot_timeline(d))
