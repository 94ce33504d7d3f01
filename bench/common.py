"""bench/common.py — what the benchmarks share: the options and outputs of a benchmark (`Bench`:
machine facts and the load of other processes from bench/machine.py, a scratch folder, its JSON,
plot and closing line), tables and figures, `--what` entries, child processes, `python train.py`
runs and their steady-state rates, and the project's config and models as a run builds them.
Project, torch and vLLM imports stay inside functions: spawned children re-import the benchmark
script, and vLLM must load only in the process that runs the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue as queue_lib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import machine
from machine import (  # noqa: F401  (re-exported to the scripts)
    CpuByRole,
    LoadMonitor,
    cores_by_role,
    machine_info,
    machine_line,
    tree_cpu,
)

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def setup_paths() -> None:
    """The repo on sys.path here and in every process we (or vLLM) spawn: vLLM's worker imports
    `vllm_worker.WeightSyncWorker` by name."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *parts])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


setup_paths()


# --------------------------------------------------------------------------------------------------
# Output: JSON, tables, plots
# --------------------------------------------------------------------------------------------------
def write_json(out: str | Path, name: str, data: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
        f.write("\n")
    return path


def alternate(bench, rounds: int, modes: dict, flags: list[str], measure) -> dict[str, list]:
    """`python train.py FLAGS MODE_FLAGS` for each mode of `modes` {name: flags}, `rounds` times,
    the order swapped every round (so no mode always runs first): {mode: [its runs' figures]}, each
    the run's clock (`wall_s`), the process's, other processes' cores and `measure(mode, run,
    out)`."""
    runs = {m: [] for m in modes}
    for r in range(rounds):
        for mode in list(modes)[:: 1 if r % 2 == 0 else -1]:
            t0, out = time.monotonic(), bench.work / f"{mode}_{r}"
            run = run_train_cli(out, [*flags, *modes[mode]])
            x = {"wall_s": run["rows"][-1]["wall_s"], "process_s": run["process_s"]}
            x.update(foreign_cores=bench.foreign_cores(t0, time.monotonic()), round=r, mode=mode)
            runs[mode].append({**x, **measure(mode, run, out)})
            shown = {k: fmt(v) for k, v in runs[mode][-1].items() if isinstance(v, float)}
            print(f"[{bench.name}] {mode} round {r}: {shown}", flush=True)
    return runs


def bars(data: dict, path: Path, what: str, values: dict, ylabel: str = "s", log=False) -> None:
    """The generic figure: per label, the median of its values (a bar) and each value (a dot);
    `log`: a log scale."""
    fig, ax = plt().subplots(1, 1, figsize=(1.6 * len(values) + 3, 4))
    for j, (label, vs) in enumerate(values.items()):
        vs = [v for v in vs if v is not None]
        ax.bar(j, statistics.median(vs) if vs else 0, alpha=0.6)
        ax.scatter([j] * len(vs), vs, color="k", zorder=3, s=12)
    ax.set_xticks(range(len(values)), list(values), fontsize=7)
    ax.set(
        title=f"{what} (bars: medians; dots: each)",
        ylabel=ylabel,
        yscale="log" if log else "linear",
    )
    save_figure(fig, path, data, what)


def _json_default(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x)
    if x != x:
        return "nan"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A markdown table (prints well in a terminal and pastes into the README)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    for r in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def table_of(rows: list[dict], keys: str, title: str | None = None) -> str:
    """`table` of dicts: one column per key of the space-separated `keys` (a key missing: "-")."""
    return table(keys.split(), [[r.get(k) for k in keys.split()] for r in rows], title)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def parser(doc: str, sizes: dict | None = None, smoke: dict | None = None):
    """The options every benchmark takes (--out, --work, --seed; --sizes when it has model
    `sizes`; --smoke when it has a `smoke` size: {dest: value} of its own options); the benchmark
    adds its own. Its description is the first paragraph of the benchmark's docstring."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="folder for NAME.json and NAME.png")
    p.add_argument(
        "--work",
        default="",
        help="scratch folder for runs (default: a temporary folder, deleted at the end)",
    )
    p.add_argument("--seed", type=int, default=0)
    if sizes:
        p.add_argument(
            "--sizes", default=",".join(sizes), help=f"comma-separated, from {', '.join(sizes)}"
        )
    if smoke:
        p.smoke = smoke
        p.add_argument(
            "--smoke",
            action="store_true",
            help="the tiny size tests/test_bench.py runs (figures are "
            "meaningless; flags given beside it win): "
            + " ".join(f"{k}={v!r}" for k, v in smoke.items()),
        )
    return p


def parse_args(p, argv, sizes: dict | None = None):
    """`p.parse_args(argv)`, with the smoke size's values as defaults under --smoke; with `sizes`,
    `args.sizes` becomes the list of sizes asked for (checked)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if getattr(p, "smoke", None) and "--smoke" in argv:
        p.set_defaults(**p.smoke)
    args = p.parse_args(argv)
    if sizes:
        args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        for s in args.sizes:
            if s not in sizes:
                p.error(f"unknown size {s}; choose from {', '.join(sizes)}")
    return args


def dispatch(doc: str, entries: dict, argv=None) -> int:
    """`python bench/FILE.py --what NAME [options]`: the file's entry NAME (default: its first),
    given the other options (each entry parses its own; `--what NAME --help` lists them)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], add_help=False)
    p.add_argument("--what", choices=list(entries), default=next(iter(entries)))
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # (what follows "--" is the entry's)
    args, rest = p.parse_known_args(argv[:split])
    return entries[args.what](rest + argv[split:])


class Bench:
    """What every benchmark does around its measurements: while it runs, the machine's facts, the
    load monitor and a scratch folder; afterwards its JSON (name, machine, load and wall time
    first), its plot and its closing line.

        # bench.work: the scratch folder, bench.info
        with common.Bench("overlap", args) as bench:
            ...measure...
        path = bench.save(data, plot)                    # DIR/overlap.json, DIR/overlap.png
        print(bench.closing_line(path))
    """

    def __init__(self, name: str, args):
        self.name, self.out = name, Path(args.out)
        self.info = machine_info()
        self.load, self.wall_s = None, None
        self._start = time.perf_counter()
        self._monitor = LoadMonitor()
        self._keep = bool(args.work)  # a scratch folder given is kept; a temporary one is deleted
        self.work = (
            Path(args.work)
            if args.work
            else Path(tempfile.mkdtemp(prefix=f"asyncgrpo-bench-{name.replace('_', '-')}-"))
        )
        self.work.mkdir(parents=True, exist_ok=True)

    def __enter__(self):
        self._monitor.__enter__()
        return self

    def foreign_cores(self, t0: float, t1: float) -> float | None:
        return self._monitor.foreign_cores(t0, t1)

    def __exit__(self, *exc):
        if not self._keep:
            shutil.rmtree(self.work, ignore_errors=True)
        self._monitor.__exit__(*exc)
        self.load = self._monitor.summary()
        self.wall_s = time.perf_counter() - self._start

    def save(self, data: dict, plot) -> Path:
        data = {
            "benchmark": self.name,
            "machine": self.info,
            "load": self.load,
            "wall_s": self.wall_s,
            **data,
        }
        path = write_json(self.out, self.name, data)
        plot(data, self.out / f"{self.name}.png")
        return path

    def closing_line(self, path: Path) -> str:
        return (
            f"machine: {machine_line(self.info)}; other processes used "
            f"{self.load['foreign_cores_mean']} cores on average. Wrote {path}"
        )


def save_figure(fig, path: Path, data: dict, what: str) -> None:
    """Title the figure with what it shows and the machine it was measured on, write it, close
    it."""
    fig.suptitle(f"{what}: {machine_line(data['machine'])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt().close(fig)


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------
def _child_main(fn, args, results):
    # we can kill this child and what it starts (vLLM's EngineCore and workers) as a group
    os.setpgrp()
    try:
        results.put(("ok", fn(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))
    results.close()
    results.join_thread()


def in_child(fn, *args, timeout_s: float = 600.0, what: str = "child", in_session: bool = False):
    """Run `fn(*args)` in a spawned child in its own process group; return its result (picklable).
    The whole group is killed afterwards, so no engine process outlives the call. `in_session`: in a
    smoke session (bench/machine.py) `fn` runs in this process instead (on the session's engines, if
    it needs one)."""
    if in_session and machine.SESSION is not None:
        return fn(*args)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(fn, args, results), name=what)
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, value = results.get(timeout=0.5)
                break
            except queue_lib.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"{what} died (exit code {proc.exitcode}) without a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} took more than {timeout_s:.0f} s")
        proc.join(timeout=60)
    finally:
        _kill_group(proc)
    if status != "ok":
        raise RuntimeError(f"{what} failed:\n{value}")
    return value


def _kill_group(proc):
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(timeout=5)


def run_train_cli(
    out_dir: Path,
    args: list[str],
    timeout_s: float = 900.0,
    cpu_window=None,
    repo=REPO,
    stop_on_timeout: bool = False,
) -> dict:
    """`python train.py --out OUT ARGS` exactly as a user runs it (from `repo`: another checkout may
    be given); returns its summary and per-step rows. With `cpu_window=(from_step, to_step)`, also
    the cores each process used over those steps. Past `timeout_s` the run is stopped as Ctrl-C
    stops it: an error, or with `stop_on_timeout` the steps it finished."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [PY, str(Path(repo) / "train.py"), "--out", str(out_dir), *args]
    start = time.perf_counter()
    cpu = None
    with open(out_dir / "stdout.txt", "w") as so, open(out_dir / "stderr.txt", "w") as se:
        proc = subprocess.Popen(
            cmd,
            cwd=repo,
            stdout=so,
            stderr=se,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        if cpu_window:
            cpu = CpuByRole(proc.pid, out_dir / "metrics.jsonl", *cpu_window)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:  # (a stopped run saves its checkpoint first)
                proc.wait(timeout=180 if stop_on_timeout else 40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
        finally:
            if cpu:
                cpu.stop()
    total_s = time.perf_counter() - start
    stopped = rc == "timeout" or rc == 128 + signal.SIGINT
    if stop_on_timeout and stopped and (out_dir / "summary.json").exists():
        rc = 0
    if rc != 0:
        tail = (out_dir / "stderr.txt").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} ended with {rc}:\n{tail}")
    return {
        **read_run(out_dir),
        "process_s": total_s,
        "cmd": " ".join(cmd[1:]),
        "cores_by_role": cpu.result() if cpu else None,
    }


def read_run(out_dir: Path) -> dict:
    """A finished run's summary (OUT/summary.json) and per-step rows (OUT/metrics.jsonl)."""
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return {"summary": summary, "rows": [json.loads(line) for line in lines if line.strip()]}


# --------------------------------------------------------------------------------------------------
# Steady-state rates from a run's per-step rows
# --------------------------------------------------------------------------------------------------
def steady(rows: list[dict], warmup: int) -> dict:
    """Rates over the steps after `warmup` (the first steps carry start-up effects).

    wall_s of row i is when step i ended; the window is (end of step warmup-1, end of the last
    step]."""
    if len(rows) <= warmup + 1:
        raise ValueError(f"need more than {warmup + 1} steps, got {len(rows)}")
    a, b = rows[warmup - 1] if warmup > 0 else None, rows[-1]
    t0 = a["wall_s"] if a else 0.0
    window = rows[warmup:]
    span = b["wall_s"] - t0
    out = {
        "steps": len(window),
        "window_s": span,
        "steps_per_s": len(window) / span,
        "step_s_median": statistics.median(
            r["wall_s"] - p["wall_s"] for p, r in zip(rows[warmup - 1 :], window)
        )
        if warmup > 0
        else None,
        "trainer_wait_frac": sum(r["trainer_wait_s"] for r in window) / span,
        "train_s_mean": statistics.fmean(r["train_s"] for r in window),
        "tokens_per_step": statistics.fmean(r["tokens"] for r in window),
    }
    if a and a.get("gen_elapsed_s") is not None and b.get("gen_elapsed_s") is not None:
        d_el = b["gen_elapsed_s"] - a["gen_elapsed_s"]
        d_idle = b["gen_idle_s"] - a["gen_idle_s"]
        out["generator_wait_frac"] = d_idle / d_el if d_el > 0 else None
        out["gen_busy_s_per_step"] = (d_el - d_idle) / len(window)
    syncs = [r["sync_ms"] for r in window if r.get("sync_ms") is not None]
    out["sync_ms_median"] = statistics.median(syncs) if syncs else None
    out["lag_mean"] = statistics.fmean(r.get("lag_mean", 0.0) for r in window)
    return out


def typical_mean(values, outlier: float = 3.0) -> float:
    """The mean of `values` without those above `outlier` x their median (one stalled step, a
    page-in, another job's burst): what a stage costs per step in steady state."""
    median = statistics.median(values)
    return statistics.fmean(v for v in values if v <= outlier * median)


def intervals(ends: list[float], warmup: int) -> list[float]:
    """Per-step durations from cumulative end times, skipping `warmup` steps."""
    return (
        [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])]
        if warmup > 0
        else [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    )


# --------------------------------------------------------------------------------------------------
# The project's config and models, as the benchmarks build them
# --------------------------------------------------------------------------------------------------
def default_config(**changes):
    """The run's config with `changes`, validated and resolved as `launch.run` resolves it
    (prepare.resolve)."""
    import config
    from run import flag_checks, prepare

    cfg = config.Config(**changes)
    flag_checks.validate(cfg, prepare.check(cfg))
    return prepare.resolve(cfg)


def run_ahead_settings(cfg, model_path: str):
    """The generator's settings as `launch.run` builds them (`prepare.generator_settings`), except
    that the staleness gate never closes: a stand-in trainer never lags, so the generator runs as
    far ahead as the queue allows."""
    from infra import devices
    from run import prepare

    # (and no held-out evaluation: costs.py --what eval measures that apart)
    return prepare.generator_settings(
        dataclasses.replace(cfg, max_lag=10**6, eval_every=0),
        prepare.Prepared(model_path, model_path, devices.layout_for(cfg)),
    )


def build_model(path: Path, seed: int = 0, **sizes) -> str:
    """The project's tiny-model builder (builtin.build_tiny_model), optionally with other sizes."""
    from tasks.builtin import build_tiny_model

    path = Path(path)
    # one folder per model for the session's benchmarks (one engine each)
    if machine.SESSION is not None:
        models = machine.SESSION.models
        path = models.setdefault(
            (seed, tuple(sorted(sizes.items()))), Path(machine.SESSION.work) / f"m{len(models)}"
        )
    if not (path / "config.json").exists():
        build_tiny_model(str(path), seed=seed, **sizes)
    return str(path)


def count_params(model_path: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in m.parameters())
