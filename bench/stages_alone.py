"""bench/stages_alone.py — the project's own stages run alone, for the benchmarks that set them side
by side (overlap.py, trainer.py, generator.py): generation without training (`generate_alone`: the
real generator process feeding `stand_in_trainer`) and training without generation (`train_alone`:
the real trainer fed from a queue already holding every group), each started the way `launch.run`
starts it, with the other side a stand-in that does no work.
Data: in, a resolved config (`common.default_config`) and a model folder (`common.build_model`);
out, plain dicts and lists (groups, per-step times, metrics rows, cores by role). It touches only
the processes it starts (killed when it returns), the scratch folder it is given and the shared
weights buffer it allocates. Project, torch and vLLM imports stay inside functions, as in common.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from machine import CpuByRole, cores_by_role, tree_cpu  # noqa: E402


def stand_in_trainer(
    queue,
    control,
    shared,
    model_path: str,
    steps: int,
    prompts_per_step: int,
    publish: bool = True,
    keep_groups: bool = True,
    timeout_s: float = 300.0,
    armed=None,
    on_step=None,
) -> dict:
    """The trainer's side of the queue with the training taken out: take each step's groups
    (`buffer.take_groups`, as the trainer does) and, if `publish`, republish the same weights under
    the next version (`shared_weights.SharedWeights.publish`), so that the generator swaps weights
    once per step as in a run. Records when each step's last group arrived and how many tokens it
    held; sets `control.stop` at the end."""
    import torch
    from transformers import AutoModelForCausalLM

    import buffer
    from infra import processes

    weights = {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32
        ).named_parameters()
    }
    if armed is not None:
        armed.set()
    t_wait = time.perf_counter()
    processes.wait_for(control.ready, control.stop, timeout_s, "the generator's engine to start")
    ready_s = time.perf_counter() - t_wait
    groups, step_end, tokens, sync_ms, parts = [], [], [], [], []
    start = time.perf_counter()
    version = 0
    try:
        for step in range(steps):
            taken = buffer.take_groups(queue, prompts_per_step, version, 10**6, timeout_s)
            step_end.append(time.perf_counter() - start)
            if on_step is not None:
                on_step(step)
            tokens.append(sum(len(c) for g in taken.groups for c in g.completion_ids))
            for g in taken.groups:
                sync_ms += g.gen_stats.get("sync_ms", [])
                parts += g.gen_stats.get("sync_parts", [])
            if keep_groups:
                groups.extend(taken.groups)
            last_stats = dict(taken.groups[-1].gen_stats, sync_ms=None, sync_parts=None)
            if publish:
                version += 1
                shared.publish(weights, version)
    finally:
        control.stop.set()
    return {
        "groups": groups,
        "step_end_s": step_end,
        "tokens": tokens,
        "ready_wait_s": ready_s,
        "gen_stats": last_stats,
        "sync_ms": sync_ms,
        "sync_parts": parts,
    }


def generate_alone(cfg, model_path: str, steps: int, cpu_from_step: int | None = None) -> dict:
    """Generation with no training: the real generator process (`rollout.generator_main`, started
    like `launch.run` starts it) feeding `stand_in_trainer` (here, in this process). Returns the
    groups (the batches a run would train on), per step when its last group arrived, and from its
    trace (tracing.py) vLLM's engine time per scheduled token from the swap to version
    `cpu_from_step` on (`engine_s_per_token`)."""
    import torch.multiprocessing as mp
    import traces

    import rollout
    from infra import processes
    from run import prepare

    ctx = mp.get_context("spawn")
    shared = prepare.allocate_shared_weights(model_path)
    queue = ctx.Queue(maxsize=cfg.queue_size)
    errors = ctx.Queue()
    control = processes.make_control(ctx)
    settings = common.run_ahead_settings(cfg, model_path)
    proc = ctx.Process(
        target=processes.child_entry,
        name="generator",
        args=(
            "generator",
            rollout.generator_main,
            (settings, shared, queue, control),
            errors,
            True,
        ),
    )
    t_spawn = time.perf_counter()
    with traces.Recording() as recording:  # (the generator and vLLM's processes it starts: traced)
        proc.start()
    snaps = []

    # CPU time of the generator's processes at the start and the end of the window
    def on_step(step):
        if cpu_from_step is not None and step in (cpu_from_step - 1, steps - 1):
            snaps.append((time.monotonic(), tree_cpu(proc.pid)))

    try:
        result = stand_in_trainer(
            queue, control, shared, model_path, steps, cfg.prompts_per_step, on_step=on_step
        )
        proc.join(timeout=60)
    finally:
        control.stop.set()
        processes.kill_tree(proc, True)
    result["process_s"] = time.perf_counter() - t_spawn
    result["cores_by_role"] = (
        cores_by_role(snaps, proc.pid, "generator") if len(snaps) == 2 else None
    )
    result["engine_s_per_token"] = traces.engine_seconds_per_token(
        recording.events(), cpu_from_step or 0
    )
    return result


def train_alone(
    cfg,
    model_path: str,
    groups: list,
    out_dir: Path,
    timeout_s: float = 600.0,
    cpu_from_step: int | None = None,
):
    """Training with no generation: the real trainer (`train.trainer_main`, rank 0 of 1, started
    like `launch.run` starts it) fed from a queue already holding every group it will take. Returns
    its metrics rows (metrics.jsonl), and with `cpu_from_step`, (rows, cores the trainer used from
    that step on)."""
    import torch.multiprocessing as mp

    import buffer
    import train
    from infra import devices, processes
    from run import prepare

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # --max-lag: the oldest sample of each step's groups against the version the trainer is at then,
    # so nothing is dropped or masked, and the per-lag diagnostics cost what a run's do (a lag they
    # need, no more)
    lag = max(
        buffer.sample_lag(i // cfg.prompts_per_step, v)
        for i, g in enumerate(groups)
        for v in g.token_versions
    )
    # no held-out evaluation: no generator would answer, and its last step would wait --timeout-s
    # for one
    cfg = dataclasses.replace(
        cfg,
        out=str(out_dir),
        max_lag=max(cfg.max_lag, lag),
        queue_size=len(groups) + 1,
        eval_every=0,
        steps=len(groups) // cfg.prompts_per_step,
        timeout_s=min(cfg.timeout_s, 60.0),
    )
    ctx = mp.get_context("spawn")
    shared = prepare.allocate_shared_weights(model_path)
    queue = buffer.RolloutQueue(ctx=ctx)
    for g in groups:
        queue.put(g)
    errors = ctx.Queue()
    control = processes.make_control(ctx)
    control.ready.set()  # no engine to wait for
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    proc = ctx.Process(
        target=processes.child_entry,
        name="trainer0",
        args=(
            "trainer0",
            train.trainer_main,
            (
                cfg,
                prepare.Prepared(model_path, model_path, devices.layout_for(cfg)),
                0,
                1,
                shared,
                queue,
                control,
                init_file,
            ),
            errors,
            False,
        ),
    )
    proc.start()
    cpu = (
        CpuByRole(proc.pid, out_dir / "metrics.jsonl", cpu_from_step, cfg.steps)
        if cpu_from_step
        else None
    )
    deadline = time.monotonic() + timeout_s
    try:
        while proc.is_alive() and time.monotonic() < deadline:
            proc.join(timeout=0.5)
        if proc.is_alive():
            raise TimeoutError(f"the trainer took more than {timeout_s:.0f} s")
        if proc.exitcode != 0:
            raise RuntimeError(processes.failure_report("trainer0", proc.exitcode, errors))
    finally:
        if cpu:
            cpu.stop()
        processes.kill_tree(proc, False)
        if os.path.exists(init_file):
            os.unlink(init_file)
    rows = [
        json.loads(line)
        for line in (out_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    if cpu is None:
        return rows
    cores = cpu.result()
    if cores:
        cores = {"trainer": cores.pop("parent", 0.0), **cores}
    return rows, cores
