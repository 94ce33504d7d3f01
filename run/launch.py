"""run/launch.py — the parent process of `python train.py`: prepare, spawn, supervise.

Role: `run` resolves the flags and prepares the run (prepare.py: the checkpoint to resume, the
devices, the packed weight buffer), spawns one vLLM generator (rollout.generator_main) and the FSDP2
trainer ranks (train.trainer_main, handed in by train.main: this module does not import train.py),
and supervises them until they end (processes.run_children); `write_timeline` then merges every
process's trace events into this start's trace and timeline (trace.json and timeline.png link them;
a resume keeps the earlier starts': `start_trace`).
Data contract: the children get the resolved Config, the prepared run, the shared weight buffer, the
rollout queue and the run's `Control` (the staleness gate's counters set from a resumed run); `run`
returns the run's exit code: 0, 1 (a child failed), or 128 + the signal that stopped it.
May touch: everything under --out (through its children), the file the ranks' process group starts
from; it spawns and kills its own children.
"""

import os
import sys
import tempfile

import torch.multiprocessing as mp

import buffer
from config import Config
from infra import tracing
from infra.processes import make_control, run_children
from rollout import generator_main
from run import metrics, plots, prepare, trace_merge
from run.flag_checks import inactive_flags


def run(cfg: Config, trainer_main) -> int:
    """Start the generator and trainer ranks (each rank runs `trainer_main`: train.trainer_main,
    handed in by train.main), wait for them, and return the run's exit code."""
    metrics.configure_terminal(cfg.log_level)
    inactive = inactive_flags(cfg)
    if inactive:
        print(
            f"warning: {', '.join(inactive)} cannot act in this run: one optimizer step per batch "
            "keeps the ratio to the proximal policy at 1 (the clips act with --mini-batches > 1, "
            "--ppo-epochs > 1 or --is-mode off)",
            file=sys.stderr,
            flush=True,
        )
    cfg = prepare.resolve(cfg)
    prepared = prepare.prepare_run(cfg)
    layout = prepared.layout
    print(
        f"starting the vLLM generator and {cfg.train_ranks} FSDP2 trainer rank(s); "
        f"writing to {cfg.out}/",
        flush=True,
    )
    if not layout.on_gpu:
        print(
            "(on CPU, vLLM's start-up warnings about Triton, torch.compile and LD_PRELOAD "
            "are expected)",
            flush=True,
        )
    # On GPUs this process owns the packed buffer (on the first trainer GPU): it outlives every
    # process that reads it.
    shared, adapter_dir = prepare.run_weights(cfg, prepared, layout.buffer_device)
    ctx = mp.get_context("spawn")
    rollout_queue = buffer.RolloutQueue(cfg.queue_size, ctx)
    errors = ctx.Queue()
    control = make_control(ctx)
    # The generator's staleness gate counts from a resumed run's dropped groups and skipped steps.
    control.groups_dropped.value = prepared.groups_dropped
    control.steps_skipped.value = prepared.start_step - prepared.start_version
    settings = prepare.generator_settings(cfg, prepared, adapter_dir)
    init_file = tempfile.mktemp(prefix="asyncgrpo-dist-")
    # Before the children start (they inherit where to write); a resume keeps earlier traces.
    start_trace(cfg, resumed=prepared.start_step > 0)
    children = {"generator": (generator_main, (settings, shared, rollout_queue, control), True)}
    for rank in range(cfg.train_ranks):
        children[f"trainer{rank}"] = (
            trainer_main,
            (cfg, prepared, rank, cfg.train_ranks, shared, rollout_queue, control, init_file),
            False,
        )
    try:
        return run_children(ctx, children, errors, control, save_grace_s=cfg.save_timeout_s)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
        write_timeline(cfg)


def start_trace(cfg: Config, resumed: bool) -> None:
    """Trace this start under its own name (tracing.configure). A resume keeps what earlier starts
    left in OUT (a crash's trace and timeline are its picture), first merging the processes' files
    of one whose parent was killed before it could."""
    if resumed:
        try:
            trace_merge.merge(cfg.out, remove_parts=True)
        except Exception as e:  # (never stops the run: those files are then lost)
            print(f"warning: an earlier start's trace files were not merged ({e})", file=sys.stderr)
    tracing.configure(cfg.out, cfg.trace_steps, keep_earlier=resumed)


def write_timeline(cfg: Config) -> None:
    """OUT/trace.json from every process's trace events, and OUT/timeline.png from it (even after a
    failure: it shows what happened). Never fails the run: a problem is one warning line."""
    tracing.unconfigure()
    if cfg.trace_steps <= 0:
        return
    try:
        if trace_merge.merge(cfg.out, remove_parts=True):
            plots.plot_timeline(cfg.out)
    except Exception as e:
        print(
            f"warning: no {cfg.out}/trace.json or timeline.png ({type(e).__name__}: {e})",
            file=sys.stderr,
            flush=True,
        )
