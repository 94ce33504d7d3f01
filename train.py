"""train.py — the trainer: FSDP2 ranks that turn rollout batches into new weights; `python
train.py`.

Role: `python train.py` prepares the run (run/prepare.py), spawns one vLLM generator (rollout.py)
and the FSDP2 trainer ranks, and supervises them (run/launch.py, infra/processes.py). Each rank
loops (`train`, the algorithm in one screen): take a batch of rollout groups (buffer.py) -> shaped
rewards and group advantages (advantages.py) -> mask the tokens older than --max-lag -> the GRPO
update (update.py, losses.py) -> publish the weights (sync.py) -> evaluate, log (run/metrics.py) and
save (trainer/checkpoint.py).
Data contract: trainer version = rollout batches trained on; a sample is trained on only if its
oldest token is at most --max-lag versions old. The run's first on-policy batch is where trainer and
generator must agree: fp32 stops the run above metrics.FIRST_BATCH_BOUND_FP32, bf16 warns.
OUT/ gets metrics.jsonl, summary.json, model/ (Hugging Face format; with --lora-rank adapter/),
checkpoints/, and from every process's trace events (infra/tracing.py) trace.json and timeline.png.
May touch: everything under --out; it spawns and kills its own children.
"""

import functools
import math
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

import buffer
from advantages import estimate_advantages, shaped_rewards
from config import Config
from infra import devices, tracing
from infra.processes import Control, exit_now, saving, wait_for
from run import launch, metrics, prepare
from sync import WeightsSink, publish_model, trainable_parameters
from tasks import evaluation
from trainer import checkpoint, packing
from trainer.models import build_frozen_models, build_policy, check_layout, checkpoint_layers
from update import update_on_batch


# --------------------------------------------------------------------------------------------------
# The trainer (one process per rank): set-up, the loop, tear-down
# --------------------------------------------------------------------------------------------------
@dataclass
class Rank:
    """What one trainer rank holds while it trains."""

    cfg: Config
    prepared: prepare.Prepared
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    pad_id: int
    shared: WeightsSink  # shared_weights.SharedWeights, or remote.RemoteWeights
    rollout_queue: buffer.GroupSource  # buffer.RolloutQueue, or remote.TrainerLink
    # the run's flags and counters (processes.make_control, or remote.thread_control)
    control: Control
    # the gloo group of every collective around a save (timeout --save-timeout-s)
    save_group: object = None
    log: metrics.RunLog | None = None  # rank 0 only
    version: int = 0
    teacher: torch.nn.Module | None = None  # --teacher (frozen, sharded like the reference)
    # what the generator holds or will load next: what an evaluation asked for now sees
    published: int = 0
    bad_steps: int = 0
    # the run's first on-policy agreement has been judged (check_first_agreement)
    agreement_checked: bool = False


def train(trainer: Rank) -> int:
    """The algorithm, one rollout batch per step; returns the step it stopped at (cfg.steps when
    done)."""
    cfg = trainer.cfg
    for step in range(trainer.prepared.start_step, cfg.steps):
        tracing.step(step)
        t_wait = time.perf_counter()
        taken = take_batch(trainer)
        # asked to stop (a signal, or another process failed): every rank leaves together
        if taken is None:
            return step
        wait_s, t_step = time.perf_counter() - t_wait, time.perf_counter()
        tracing.complete("wait for data", t_wait, t_step, cat="wait", step=step)
        # ---- the algorithm: rewards -> advantages -> fresh-enough tokens -> the GRPO update
        rewards, truncated = shaped_rewards(
            taken.groups, cfg.model_token_budget, cfg.overlong_penalty
        )
        # an unscored sample (a reward or env fault) gets
        # advantage 0 and stays out of every statistic
        scored = buffer.scored_mask(taken.groups)
        advantages = estimate_advantages(rewards, cfg.adv_estimator, cfg.adv_scale, scored=scored)
        batch = buffer.collate(buffer.to_samples(taken.groups, advantages), trainer.pad_id)
        # (none left with --stale-rule group)
        stale = buffer.stale_mask(batch, trainer.version, cfg.max_lag)
        batch.mask &= ~stale  # --max-lag bounds every trained token's age
        if cfg.overlong_filter:  # cut completions add no loss (and no tokens to the normalisation)
            batch.mask &= ~truncated.flatten()[:, None]
        lr = learning_rate(step, cfg)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        result = update_on_batch(
            trainer.model,
            trainer.ref_model,
            trainer.optimizer,
            batch,
            cfg,
            rank=trainer.rank,
            world_size=trainer.world_size,
            version=trainer.version,
            step=step,
            device=trainer.device,
            teacher=trainer.teacher,
        )
        # every update had a NaN/inf loss or gradient: nothing changed
        skipped = result.applied == 0
        if not skipped:
            trainer.version += 1  # one version per rollout batch, however many updates it took
        # ---- plumbing: count bad steps, publish the weights, evaluate, log, save ----
        count_bad_steps(trainer, result.skipped)
        if skipped and trainer.rank == 0:
            count_skipped_step(trainer.control)
        last = step + 1 == cfg.steps
        publish_ms = publish_when_due(trainer, last, skipped)
        train_s = time.perf_counter() - t_step
        evals = evaluate(trainer, step, last)
        if trainer.log is not None:
            task_rewards = torch.tensor([g.rewards for g in taken.groups])
            result.metrics.update(
                lr=lr,
                truncated_frac=float(truncated.float().mean()),
                stale_masked_tokens=int(stale.sum()),
                groups_filtered=taken.groups_filtered,
                overlong_penalty=float((rewards - task_rewards).mean()),
                # (remote.TrainerLink: the queue bound, the send)
                **trainer.rollout_queue.metrics(),
            )
            times = dict(wait_s=wait_s, train_s=train_s, publish_ms=publish_ms)
            log_step(trainer, step, taken, batch, result, skipped=skipped, evals=evals, times=times)
        check_first_agreement(trainer, step, result.logprob_diff)
        checkpoint.save_when_due(trainer, step, last)
        tracing.complete(f"step {step}", t_step, cat="step", **step_args(trainer, step, batch))
    return cfg.steps


def publish_when_due(trainer: Rank, last: bool, skipped: bool) -> float:
    """Publish the weights every --sync-every versions (and at the last step when the run
    evaluates: the final evaluation must see the final weights); the milliseconds it took (0.0 when
    not due, or when the step changed nothing)."""
    cfg, t_publish = trainer.cfg, time.perf_counter()
    if (trainer.version % cfg.sync_every == 0 or (last and cfg.eval_every > 0)) and not skipped:
        publish_model(
            trainer.model, trainer.shared, trainer.version, trainer.rank, trainer.world_size
        )
        trainer.published = trainer.version
        tracing.complete("publish", t_publish, version=trainer.version)
    return (time.perf_counter() - t_publish) * 1e3


def log_step(trainer: Rank, step, taken, batch, result, skipped: bool, evals, times: dict) -> None:
    """Rank 0's row of the step (metrics.RunLog.step); `times`: wait_s, train_s, publish_ms."""
    trainer.log.step(
        step,
        trainer.version,
        taken,
        batch,
        result.metrics,
        loss=result.loss,
        grad_norm=result.grad_norm,
        logprob_diff=result.logprob_diff,
        skipped=skipped,
        evals=evals,
        **times,
    )


def learning_rate(step: int, cfg: Config) -> float:
    """The learning rate of step `step` (0-based): linear warmup to --lr over --lr-warmup-steps,
    then constant, or decayed to --min-lr at the last step (--lr-schedule linear | cosine)."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, cfg.steps - 1 - cfg.lr_warmup_steps))
    decay = (
        1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    )
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * decay


def check_first_agreement(trainer: Rank, step: int, logprob_diff: float | None) -> None:
    """Judge the run's first on-policy agreement, once (metrics.first_batch_check): every rank
    stops the run in one line where trainer and generator disagree beyond what a model served as
    the trainer scores it reaches; rank 0 warns in bf16. On-policy rows are those sampled entirely
    by the weights the trainer held for the step, however stale the rest: at a run's first step,
    every row (the generator serves the version the run starts from, and the trainer holds it until
    its first update); later, only rows sampled after a load of what the trainer holds (None when a
    step has none, and the first step that has some is judged)."""
    if trainer.agreement_checked or logprob_diff is None:
        return
    trainer.agreement_checked = True
    config = AutoConfig.from_pretrained(trainer.prepared.model_path)
    family = ", ".join([f"model type {config.model_type!r}", *(config.architectures or [])])
    verdict, line = metrics.first_batch_check(logprob_diff, trainer.cfg.dtype, family, step)
    if verdict == "stop":
        raise SystemExit(line)
    if verdict == "warn" and trainer.rank == 0:
        print(line, file=sys.stderr, flush=True)


def step_args(trainer: Rank, step: int, batch) -> dict:
    """What the trace's step span says: the step, rank and version after it, and (rank 0) its
    trained tokens by the version that sampled them."""
    args = {"step": step, "rank": trainer.rank, "version": trainer.version}
    if trainer.rank == 0 and tracing.enabled():
        versions, counts = batch.token_versions[batch.mask].unique(return_counts=True)
        args["tokens_by_version"] = dict(zip(map(str, versions.tolist()), counts.tolist()))
    return args


def take_batch(trainer: Rank):
    """Rank 0 takes the step's groups off the rollout queue (the staleness rule, whole groups) and
    every rank gets them; None on every rank when the run is asked to stop."""
    taken = None
    if trainer.rank == 0 and not trainer.control.stop.is_set():
        try:
            cfg = trainer.cfg
            taken = buffer.take_groups(
                trainer.rollout_queue,
                cfg.prompts_per_step,
                trainer.version,
                cfg.max_lag,
                cfg.timeout_s,
                should_stop=trainer.control.stop.is_set,
                filter_groups=cfg.filter_groups,
                stale_rule=cfg.stale_rule,
                on_drop=functools.partial(count_dropped_group, trainer.control),
            )
        except buffer.Stopped:
            taken = None
        tracing.counter("rollout queue", groups=tracing.qsize(trainer.rollout_queue))
    return broadcast(taken, trainer.world_size)


def count_bad_steps(trainer: Rank, skipped_updates: int) -> None:
    """A bad step: one with any update skipped for a NaN/inf loss or gradient (however many of its
    updates)."""
    trainer.bad_steps += skipped_updates > 0
    if trainer.bad_steps > trainer.cfg.max_bad_steps:
        raise RuntimeError(
            f"{trainer.bad_steps} steps with NaN/inf loss or gradients (--max-bad-steps "
            f"{trainer.cfg.max_bad_steps}): lower --lr or check the rewards"
        )


def count_dropped_group(control) -> None:
    """The generator replaces a group the trainer rejected whole (its staleness gate counts the
    groups still needed)."""
    with control.groups_dropped.get_lock():
        control.groups_dropped.value += 1


def count_skipped_step(control) -> None:
    """A step that kept the version: the generator's staleness gate reads versions from steps less
    these."""
    with control.steps_skipped.get_lock():
        control.steps_skipped.value += 1


def broadcast(value, world_size: int):
    """Rank 0's `value` on every rank."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def evaluate(trainer: Rank, step: int, last: bool) -> list:
    """Ask the generator for an evaluation every --eval-every steps; pick up answers between steps
    (only the final one is waited for). Rank 0 only (the generator evaluated step 0 before it was
    ready)."""
    if trainer.rank != 0 or trainer.cfg.eval_every <= 0:
        return []
    t0 = time.perf_counter()
    if (step + 1) % trainer.cfg.eval_every == 0 or last:
        evaluation.request(trainer.control, step + 1, trainer.published)
    answers = evaluation.collect(
        trainer.control,
        trainer.cfg.steps if last else None,
        trainer.cfg.timeout_s,
        trainer.control.stop.is_set,
    )
    if answers or last:
        tracing.complete("evaluation", t0, answers=len(answers))
    return answers


def start_rank(
    cfg: Config,
    prepared: prepare.Prepared,
    rank: int,
    world_size: int,
    shared: WeightsSink,
    rollout_queue: buffer.GroupSource,
    control: Control,
    init_file: str,
) -> Rank | None:
    """Device and process group, the model (restored on a resume), the reference, the tokenizer;
    then wait for the generator's engine. None when the run was stopped before its first step."""
    torch.set_num_threads(cfg.train_threads)
    torch.manual_seed(cfg.seed + rank)
    joined = join_process_group(cfg, prepared.layout, rank, world_size, control, init_file)
    if joined is None:
        return None
    device, save_group = joined
    model, optimizer = build_trained_model(cfg, prepared, world_size, device, save_group)
    check_layout(model, shared.layout)
    version = prepared.start_version
    if shared.starts_empty:  # the generator serves nothing until it has loaded these weights
        publish_model(model, shared, version, rank, world_size)
    ref_model, teacher = build_frozen_models(cfg, prepared, model, world_size, device)
    # whether micro-batches are packed: a probe on every model, now (--packing on: an error here)
    packing.decide(cfg, (model, ref_model, teacher), rank, world_size)
    tokenizer = AutoTokenizer.from_pretrained(prepared.base_model)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    # the run's clock starts when the engine is up, not while vLLM starts
    ready = (
        wait_for(control.ready, control.stop, cfg.timeout_s, "the generator's engine to start")
        if rank == 0
        else True
    )
    # stopped by a signal before the first step: nothing to save
    if not broadcast(ready, world_size):
        dist.destroy_process_group()
        return None
    log = metrics.RunLog(cfg, world_size, prepared.start_step) if rank == 0 else None
    if log is not None:
        log.sync_mb = shared.nbytes / 2**20  # in the serving dtype
    return Rank(
        cfg=cfg,
        prepared=prepared,
        rank=rank,
        world_size=world_size,
        device=device,
        model=model,
        ref_model=ref_model,
        optimizer=optimizer,
        pad_id=pad_id,
        shared=shared,
        rollout_queue=rollout_queue,
        control=control,
        save_group=save_group,
        log=log,
        version=version,
        teacher=teacher,
        published=version,
    )


def join_process_group(cfg: Config, layout, rank: int, world_size: int, control, init_file: str):
    """(this rank's device, the gloo group of its saves), once the rank has joined the trainer's
    process group; None when the run stopped while it waited for the engine."""
    device = devices.rank_device(layout, rank, torchrun=cfg.role == "trainer")
    # vLLM measures a GPU's free memory while it starts:
    # on a shared GPU, keep off it until vLLM is up.
    if layout.shared_gpus and not wait_for(
        control.engine_started, control.stop, cfg.timeout_s, "the generator's engine to start"
    ):
        return None
    devices.enter_rank_device(layout, rank, device)
    # (--role trainer: torchrun's env:// group, made by remote.run_trainer)
    if not dist.is_initialized():
        dist.init_process_group(
            layout.backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=cfg.timeout_s + 60),
        )
    # Saves wait on their own group: a rank that finished
    # writing its shards waits for the slowest one.
    save_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.save_timeout_s))
    return device, save_group


def build_trained_model(cfg: Config, prepared, world_size: int, device, save_group):
    """(the policy, sharded, and its optimizer), restored from --resume's checkpoint if any."""
    model = build_policy(cfg, prepared.base_model, world_size, device)
    if cfg.grad_checkpointing:
        checkpoint_layers(model)
    # Build the optimizer before any forward pass (FSDP2
    # pitfall: see shared notes). Only what trains has state.
    optimizer = torch.optim.AdamW(
        trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    # the trained weights (with LoRA the adapter) and the optimizer, resharded to these ranks
    if prepared.resume_dir:
        checkpoint.load_trainer_state(model, optimizer, prepared.resume_dir, save_group)
    return model, optimizer


def finish_rank(trainer: Rank, step: int) -> None:
    """The final model when the run is done; otherwise (a signal, or another process failed) a
    checkpoint."""
    # rank 0's control decides (under torchrun each rank has a control of its own)
    finished = broadcast(
        step >= trainer.cfg.steps and not trainer.control.interrupted.is_set(), trainer.world_size
    )
    if trainer.rank == 0:
        trainer.control.stop.set()  # the generator can stop now
    with saving(trainer.control):  # the parent waits for a save in progress
        if finished:
            checkpoint.save_hf_model(trainer)
        else:
            where = checkpoint.save_checkpoint(trainer, step)
    if not finished and trainer.rank == 0:
        print(
            f"stopped at step {step} (version {trainer.version}); checkpoint in {where}; "
            f"continue with --resume latest --out {trainer.cfg.out}",
            flush=True,
        )
    if trainer.log is not None:
        trainer.log.finish(trainer.version)
    dist.barrier()
    dist.destroy_process_group()


def trainer_main(
    cfg: Config,
    prepared: prepare.Prepared,
    rank: int,
    world_size: int,
    shared: WeightsSink,
    rollout_queue: buffer.GroupSource,
    control: Control,
    init_file: str,
) -> None:
    """One FSDP2 rank, from start to end."""
    tracing.start(f"trainer {rank}", sort=rank)
    trainer = start_rank(
        cfg,
        prepared,
        rank=rank,
        world_size=world_size,
        shared=shared,
        rollout_queue=rollout_queue,
        control=control,
        init_file=init_file,
    )
    if trainer is not None:
        finish_rank(trainer, train(trainer))


def main(argv=None) -> int:
    cfg = prepare.parse_args(argv)
    # (the remote roles are imported only when asked for: they start ZMQ)
    if cfg.role == "trainer":
        from run import remote

        return remote.run_trainer(cfg, trainer_main)
    if cfg.role == "generator":
        from run import remote_generator

        return remote_generator.run_generator(cfg)
    return launch.run(cfg, trainer_main)


if __name__ == "__main__":
    exit_now(main())
