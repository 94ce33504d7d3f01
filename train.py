"""train.py — entry point: config, processes, the trainer loop, the run summary.

Role
    `python train.py` (no flags) builds a tiny random-init model and its tokenizer locally, starts one vLLM
    generator process (rollout.py) and `--train-ranks` FSDP2 trainer processes (gloo on CPU), joins them
    with a bounded rollout queue (buffer.py) and a packed shared weight buffer (sync.py), and trains with
    a GRPO-family loss (losses.py) until `--steps` optimizer steps are done; metrics.py writes what a run
    reports, checkpoint.py its checkpoints (`--save-every`, `--resume`), lora.py the adapter of
    `--lora-rank`. The parent process only supervises (processes.py): a child that raises, exits or is
    killed ends the whole run with a non-zero exit and the child's traceback, and no process of the run is
    left behind.

Data contract
    - Every `Config` field is a `--flag` (underscores become dashes).
    - Trainer version = optimizer steps taken. Weights are published every `--sync-every` steps; the
      generator tags each sampled token with the version that produced it. A sample is trained on only
      if trainer version - its oldest token's version <= `--max-lag` (`--max-lag 0`: strictly on-policy).
    - `--out DIR` receives `metrics.jsonl` (one row per step), `summary.json` and the final model in
      `DIR/model` (Hugging Face format: loadable by `transformers` and vLLM). With `--lora-rank R` only a
      LoRA adapter trains (lora.py): it alone is synced and checkpointed, and the run ends with
      `DIR/adapter` (PEFT format) and, with `--merge-at-end`, the merged model in `DIR/model`.

May touch: everything under `--out`; spawns and kills its own children. Data flows one way:
rollout -> buffer -> train (losses) -> sync -> rollout.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from typing import Optional

import torch
import torch.multiprocessing as mp

from processes import make_control, run_children, wait_for
from sync import publish_model, synced_parameters

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Config:
    steps: int = 300  # optimizer steps
    seed: int = 0
    model: str = ""  # Hugging Face model directory; "" builds the tiny default model into OUT/init_model
    out: str = "runs/latest"
    # asynchrony
    max_lag: int = 2  # train only on samples whose oldest token is <= this many versions old (0: on-policy)
    queue_size: int = 64  # rollout groups waiting in the queue, at most
    sync_every: int = 1  # publish weights every N optimizer steps
    update_mode: str = "inflight"  # "inflight": swap with requests kept running; "drain": let them finish
    max_inflight_groups: int = 0  # groups generating at once; 0 = prompts_per_step
    # sizes
    train_ranks: int = 1
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 32
    max_new_tokens: int = 5
    # data and reward (data.py; the defaults are the built-in copy task)
    task: str = "auto"  # auto ("dataset" with --dataset, else "copy") | copy | dataset | gsm8k (a preset)
    dataset: str = ""  # a .jsonl/.json/.parquet file, or a Hugging Face dataset NAME[:CONFIG]
    split: str = "train"  # the split of a Hugging Face dataset
    prompt_column: str = "prompt"  # text, or a list of chat messages (rendered with the chat template)
    answer_column: str = "answer"  # also passed to reward functions as `answer`
    reward: str = ""  # comma-separated module:function | path/file.py:function | math (TRL's convention)
    reward_weights: str = ""  # comma-separated, one per --reward function (default: all 1)
    system_prompt: str = ""  # added as a system message (chat template) or a prefix (plain text)
    reward_workers: int = 0  # 0: rewards run in a thread of the generator; N: a pool of N processes
    max_prompt_tokens: int = 0  # drop longer prompts before training starts (counted); 0: only the context limits them
    # sampling (the trainer scores tokens with the same temperature/top-k/top-p)
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    stop: tuple = ()  # stop strings, one or more (\n, \t, \\ are unescaped): the reward sees the text before the stop
    # evaluation on held-out prompts (evaluation.py), on the generator's engine beside training
    eval_every: int = 50  # evaluate every N steps, and at step 0 and the end (0: never)
    eval_dataset: str = ""  # held-out prompts: a file or Hugging Face dataset ("": --dataset's test split, if any)
    eval_split: str = ""  # the split of the held-out set ("": test)
    eval_prompts: int = 256  # held-out prompts per evaluation, at most (the same fixed subset each time)
    eval_samples: int = 4  # sampled completions per held-out prompt (mean reward, pass@k for k <= this); 0: greedy only
    eval_pass_reward: float = 1.0  # a completion passes (pass@k, greedy pass@1) when its reward is >= this
    # optimisation and loss (see losses.py)
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: str = "grpo"  # grpo | dapo | dr_grpo | gspo | cispo
    adv_scale: str = "group"  # group | batch | none
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    eps_low: float = 0.2
    eps_high: Optional[float] = None  # None: eps_low (dapo: 0.28)
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_kind: str = "k3"
    is_level: str = "token"  # behaviour-policy correction: token | sequence
    is_mode: str = "truncate"  # truncate (TIS) | mask (MIS) | off (ratio taken against the generator)
    is_low: Optional[float] = None
    is_high: float = 2.0
    # machinery
    gen_threads: int = 0  # 0: half the cores
    train_threads: int = 0  # per rank; 0: the rest of the cores, split between ranks
    kv_cache_mb: int = 256
    # LoRA (lora.py): train an adapter on the frozen base model and sync only the adapter
    lora_rank: int = 0  # > 0: LoRA of this rank (0: full fine-tuning)
    lora_alpha: int = 16  # the adapter's scale is alpha / rank
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"  # or comma-separated module names, e.g. "q_proj,v_proj"
    merge_at_end: bool = False  # with --lora-rank: also write OUT/model, the base model with the adapter merged in
    timeout_s: float = 300.0  # longest wait for any other process before the run fails
    gen_devices: str = ""  # generator GPUs, e.g. "0" ("" or "cpu": the CPU path); see devices.py
    train_devices: str = ""  # trainer GPUs, one FSDP2 rank each, e.g. "1,2,3"; "0" with --gen-devices 0 shares it
    # checkpoints and faults
    save_every: int = 0  # write a checkpoint every N steps (0: only when interrupted)
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    resume: str = ""  # a checkpoint folder, or "latest" (the newest under OUT/checkpoints)
    max_bad_steps: int = 10  # steps skipped for NaN/inf loss or gradients before the run stops
    log_every: int = 10
    wandb: str = "off"  # online | offline | off
    wandb_project: str = "asyncgrpo"


CHOICES = {"update_mode": ("inflight", "drain"), "loss": ("grpo", "dapo", "dr_grpo", "gspo", "cispo"),
           "adv_scale": ("group", "batch", "none"), "wandb": ("online", "offline", "off"),
           "agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
           "kl_kind": ("k1", "k2", "k3"), "is_level": ("token", "sequence"),
           "is_mode": ("truncate", "mask", "off")}


def parse_args(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type is tuple:  # one or more strings
            parser.add_argument(flag, nargs="+", default=f.default)
        elif typing.get_origin(f.type) is typing.Union:  # Optional[float]: "none" means None
            parser.add_argument(flag, type=lambda s: None if s.lower() == "none" else float(s), default=f.default)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=CHOICES.get(f.name))
    cfg = Config(**vars(parser.parse_args(argv)))
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """One clear line per bad value (the run has not started anything yet)."""
    problems = []
    for name in ("steps", "group_size", "prompts_per_step", "max_new_tokens", "queue_size", "sync_every",
                 "train_ranks", "kv_cache_mb"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.save_every < 0 or cfg.keep_checkpoints < 0 or cfg.max_bad_steps < 0:
        problems.append("--save-every, --keep-checkpoints and --max-bad-steps must be >= 0")
    if cfg.eval_every < 0 or cfg.eval_samples < 0 or cfg.max_prompt_tokens < 0:
        problems.append("--eval-every, --eval-samples and --max-prompt-tokens must be >= 0")
    if cfg.eval_prompts < 1:
        problems.append(f"--eval-prompts must be >= 1 (got {cfg.eval_prompts})")
    if any(s == "" for s in cfg.stop):
        problems.append("--stop: an empty stop string would end every completion at once")
    if cfg.max_lag < 0:
        problems.append(f"--max-lag must be >= 0 (got {cfg.max_lag})")
    elif cfg.max_lag < cfg.sync_every - 1:
        problems.append(f"--max-lag {cfg.max_lag} < --sync-every {cfg.sync_every} - 1: the trainer would "
                        "reject every sample between syncs; raise --max-lag or lower --sync-every")
    if cfg.group_size == 1 and cfg.adv_scale != "none":
        problems.append("--group-size 1 gives every sample a zero group-relative advantage; use a group of "
                        ">= 2 (or --adv-scale none with a baseline-free reward)")
    if cfg.top_k < -1:
        problems.append(f"--top-k must be -1 or 0 (off) or >= 1 (got {cfg.top_k})")
    if cfg.temperature <= 0:
        problems.append(f"--temperature must be > 0 (got {cfg.temperature})")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1] (got {cfg.top_p})")
    if cfg.lr <= 0:
        problems.append(f"--lr must be > 0 (got {cfg.lr})")
    if not 0 <= cfg.lora_rank <= 512:
        problems.append(f"--lora-rank must be in 0..512 (got {cfg.lora_rank})")
    if cfg.lora_rank and cfg.lora_alpha <= 0:
        problems.append(f"--lora-alpha must be > 0 (got {cfg.lora_alpha})")
    if not 0 <= cfg.lora_dropout < 1:
        problems.append(f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    if cfg.lora_rank and not cfg.lora_targets.strip(" ,"):
        problems.append("--lora-targets is empty: give all-linear or module names such as q_proj,v_proj")
    if cfg.merge_at_end and not cfg.lora_rank:
        problems.append("--merge-at-end merges a LoRA adapter: it needs --lora-rank")
    if cfg.model and not os.path.isdir(cfg.model) and os.path.exists(cfg.model):
        problems.append(f"--model {cfg.model} is a file; give a Hugging Face model directory")
    elif cfg.model and not os.path.exists(cfg.model) and (cfg.model.startswith((".", "/", "~"))):
        problems.append(f"--model {cfg.model}: no such directory")
    import data
    problems += data.check_flags(cfg)  # data/reward flags: files exist, rows complete, reward functions import
    import devices
    problems += devices.problems(cfg)  # --gen-devices/--train-devices: parse, GPUs exist, one rank per GPU
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))


# ----------------------------------------------------------------------------------------------------
# The trainer (one process per rank)
# ----------------------------------------------------------------------------------------------------
def build_trainer_model(model_path, world_size, device="cpu", lora_config=None, adapter_dir="", seed=0):
    """The model under FSDP2; with a LoRA config, wrapped in a trainable adapter first (from `adapter_dir`
    on a resume) and the base weights frozen."""
    import lora
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    if lora_config is not None:
        model = lora.wrap(model, lora_config, seed, adapter_dir)
    # An explicit mesh: with a CUDA build of torch, fully_shard's default mesh is on the GPU even on the CPU path.
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in lora.base_model_of(model).model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def target_logprobs(logits, batch, temperature, top_k=-1, top_p=1.0):
    """Log-probs of the batch's targets (0 off the mask) under the given sampling distribution."""
    from losses import token_logprobs

    logp = token_logprobs(logits, batch.targets, temperature, top_k, top_p)
    return torch.where(batch.mask, logp, torch.zeros_like(logp))


def next_token_logits(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()


def loss_on_batch(model, ref_model, local, cfg, world_size):
    """The loss of this rank's rows, scaled so that summing over ranks gives the whole batch's loss."""
    import torch.distributed as dist
    from losses import behaviour_weights, kl_penalty, policy_loss

    logits = next_token_logits(model, local)
    # Score with the generator's distribution: temperature, and the same top-k/top-p truncation.
    logp = target_logprobs(logits, local, cfg.temperature, cfg.top_k, cfg.top_p)
    # A stale token can lie outside the current policy's top-k/top-p set (log-prob -inf): leave it out.
    outside = local.mask & ~torch.isfinite(logp)
    if outside.any():
        local = dataclasses.replace(local, mask=local.mask & ~outside)
        logp = torch.where(local.mask, logp, torch.zeros_like(logp))
    if cfg.is_mode == "off":
        old_logp, weights = local.behaviour_logp, None  # ratio against the generator (PipelineRL style)
    else:
        old_logp = logp.detach()  # one step per batch: the proximal policy is the current one (AReaL)
        weights = behaviour_weights(old_logp, local.behaviour_logp, local.mask, level=cfg.is_level,
                                    mode=cfg.is_mode, low=cfg.is_low, high=cfg.is_high)
    loss, metrics = policy_loss(logp, old_logp, local.advantages, local.mask, variant=cfg.loss,
                                eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                                agg=cfg.agg, max_len=cfg.max_new_tokens, weights=weights)
    if cfg.kl_coef > 0:  # between the untruncated distributions
        with torch.no_grad():
            if ref_model is not None:
                ref_logits = next_token_logits(ref_model, local)
            else:  # LoRA: the reference is the base model, the same weights with the adapter switched off
                with model.disable_adapter():
                    ref_logits = next_token_logits(model, local)
            ref_logp = target_logprobs(ref_logits, local, cfg.temperature)
        full_logp = target_logprobs(logits, local, cfg.temperature)
        kl = (kl_penalty(full_logp, ref_logp, cfg.kl_kind) * local.mask).sum() / local.mask.sum().clamp(min=1)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = float(kl)
    metrics["outside_support_tokens"] = int(outside.sum())
    if weights is not None:
        metrics["is_weight_mean"] = float(weights[local.mask].mean()) if local.mask.any() else 1.0
    # Aggregations are means over tokens (token-mean) or over non-empty sequences: weight each rank's
    # mean by its share of those units; FSDP averages gradients over ranks, hence the world_size factor.
    units = local.mask.sum() if cfg.agg == "token-mean" else (local.mask.sum(1) > 0).sum()
    units = units.float()
    total_units = units.clone()
    if world_size > 1:
        dist.all_reduce(total_units)
    share = units / total_units.clamp(min=1)
    return loss * share * world_size, loss * share, logp.detach(), metrics, local


def trainer_main(cfg, rank, world_size, model_path, shared, rollout_queue, control, init_file, resume_dir=""):
    import torch.distributed as dist
    from datetime import timedelta

    import buffer
    import checkpoint
    import evaluation
    import metrics
    from losses import group_advantages

    import devices

    torch.set_num_threads(cfg.train_threads)
    torch.manual_seed(cfg.seed + rank)
    layout = devices.layout_for(cfg)  # CPU: gloo, as before; GPU: this rank's GPU, NCCL for CUDA tensors
    device = torch.device(layout.train_device(rank))
    if layout.on_gpu:
        # vLLM measures a GPU's free memory while it starts: on a shared GPU, keep off it until vLLM is up.
        if layout.shared_gpus and not wait_for(control.ready, control.stop, cfg.timeout_s,
                                               "the generator's engine to start"):
            return
        torch.cuda.set_device(device)
        if layout.shares_gpu(rank):
            torch.cuda.set_per_process_memory_fraction(layout.train_memory_fraction, device)
    dist.init_process_group(layout.backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=cfg.timeout_s + 60))
    lora_config = None
    if cfg.lora_rank:
        import lora
        lora_config = lora.peft_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    model = build_trainer_model(model_path, world_size, device, lora_config,
                                os.path.join(resume_dir, "adapter") if resume_dir and cfg.lora_rank else "", cfg.seed)
    if cfg.lora_dropout > 0:
        model.train()  # dropout on the adapter's input (the base models we load have no other dropout active)
    # Build the optimizer before any forward pass (FSDP2 pitfall: see shared notes). Only what trains has state.
    optimizer = torch.optim.AdamW([p for _, p in synced_parameters(model)], lr=cfg.lr, weight_decay=cfg.weight_decay)
    start_step = version = 0
    if resume_dir:  # model_path points at the checkpoint's model (with LoRA: the base; the adapter is loaded)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved = checkpoint.load_state(resume_dir)
        start_step, version = saved["step"], saved["version"]
        full = torch.load(os.path.join(resume_dir, "optimizer.pt"), weights_only=False) if rank == 0 else {}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=world_size > 1))
        if rank == 0:
            checkpoint.restore_rng(resume_dir)
    names = [name for name, _ in synced_parameters(model)]
    if names != [slot.name for slot in shared.layout]:
        raise RuntimeError("trainer parameters do not match the shared buffer's layout")
    if cfg.lora_rank:  # the generator serves no adapter until this first publish (a new adapter is the base model)
        publish_model(model, shared, version, rank, world_size)
    ref_model = None
    if cfg.kl_coef > 0 and not cfg.lora_rank:
        from transformers import AutoModelForCausalLM
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    ready = True
    if rank == 0:  # the run's clock starts when the engine is up, not while vLLM starts
        ready = wait_for(control.ready, control.stop, cfg.timeout_s, "the generator's engine to start")
    if world_size > 1:
        box = [ready]
        dist.broadcast_object_list(box, src=0)
        ready = box[0]
    if not ready:  # stopped by a signal before the first step: nothing to save
        dist.destroy_process_group()
        return
    log = metrics.RunLog(cfg, world_size, start_step) if rank == 0 else None
    if log is not None:
        log.sync_mb = sum(slot.numel for slot in shared.layout) * 4 / 2**20  # float32
    published = version  # what the generator holds or will load next: what an evaluation asked for now sees
    evaluating = rank == 0 and cfg.eval_every > 0  # (the generator evaluated step 0 before it was ready)
    bad_steps = 0
    step = start_step
    for step in range(start_step, cfg.steps):
        t_wait = time.perf_counter()
        taken = None
        if rank == 0 and not control.stop.is_set():
            try:
                taken = buffer.take_groups(rollout_queue, cfg.prompts_per_step, version, cfg.max_lag,
                                           cfg.timeout_s, should_stop=control.stop.is_set)
                control.groups_dropped.value += taken.groups_dropped
            except buffer.Stopped:
                taken = None
        if world_size > 1:
            box = [taken]
            dist.broadcast_object_list(box, src=0)
            taken = box[0]
        if taken is None:  # asked to stop (a signal): leave the loop on every rank together
            break
        wait_s = time.perf_counter() - t_wait
        t_step = time.perf_counter()

        rewards = torch.tensor([g.rewards for g in taken.groups], dtype=torch.float32)
        advantages = group_advantages(rewards, scale=cfg.adv_scale)
        batch = buffer.collate(buffer.to_samples(taken.groups, advantages), pad_id)
        local = batch.select(buffer.rows_for_rank(len(batch), rank, world_size))
        if device.type == "cuda":
            local = dataclasses.replace(local, **{f.name: getattr(local, f.name).to(device)
                                                  for f in dataclasses.fields(local)})

        scaled_loss, loss_share, logp, metrics, local = loss_on_batch(model, ref_model, local, cfg, world_size)
        scaled_loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # Agreement with the generator, on completions sampled entirely by the weights we hold now.
        on_policy_rows = ((local.token_versions == version) | ~local.mask).all(dim=1) & local.mask.any(dim=1)
        diff = (logp - local.behaviour_logp).abs()[local.mask & on_policy_rows[:, None]]
        stats = torch.tensor([float(loss_share.detach()), diff.max().item() if diff.numel() else -1.0,
                              float(on_policy_rows.sum())])
        if world_size > 1:
            dist.all_reduce(stats[:1])
            dist.all_reduce(stats[1:2], op=dist.ReduceOp.MAX)
            dist.all_reduce(stats[2:])
        skipped = not math.isfinite(grad_norm) or not math.isfinite(float(stats[0]))
        if skipped:  # NaN/inf loss or gradients: skip the step, count it, stop after too many
            optimizer.zero_grad(set_to_none=True)
            bad_steps += 1
            if bad_steps > cfg.max_bad_steps:
                raise RuntimeError(f"{bad_steps} steps with NaN/inf loss or gradients (--max-bad-steps "
                                   f"{cfg.max_bad_steps}): lower --lr or check the rewards")
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            version += 1
        t_publish = time.perf_counter()
        last = step + 1 == cfg.steps  # the final evaluation must see the final weights: publish them
        if (version % cfg.sync_every == 0 or (last and cfg.eval_every > 0)) and not skipped:
            publish_model(model, shared, version, rank, world_size)
            published = version
        publish_ms = (time.perf_counter() - t_publish) * 1e3
        train_s = time.perf_counter() - t_step
        evals = []
        if evaluating:  # answers are picked up between steps; only the final one is waited for
            if (step + 1) % cfg.eval_every == 0 or last:
                evaluation.request(control, step + 1, published)
            evals = evaluation.collect(control, cfg.steps if last else None, cfg.timeout_s, control.stop.is_set)
        if rank == 0:
            log.step(step, version, taken, batch, metrics, loss=float(stats[0]), grad_norm=grad_norm,
                     logprob_diff=float(stats[1]) if stats[2] > 0 else None, wait_s=wait_s,
                     train_s=train_s, publish_ms=publish_ms, skipped=skipped, evals=evals)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint.save_trainer_state(model, optimizer, model_path, cfg, step + 1, version, rank,
                                          groups_dropped=control.groups_dropped.value)
    else:
        step = cfg.steps  # the loop ran to the end
    finished = step >= cfg.steps and not control.interrupted.is_set()
    if rank == 0:
        control.stop.set()  # the generator can stop now
    if finished:
        checkpoint.save_final_model(model, model_path, cfg, rank)
    else:  # a signal, or another process failed: keep what was learned
        where = checkpoint.save_trainer_state(model, optimizer, model_path, cfg, step, version, rank,
                                              groups_dropped=control.groups_dropped.value)
        if rank == 0:
            print(f"stopped at step {step} (version {version}); checkpoint in {where}; continue with "
                  f"--resume latest --out {cfg.out}", flush=True)
    if rank == 0:
        log.finish(version)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# The parent: build, spawn, supervise
# ----------------------------------------------------------------------------------------------------
def prepare_model(cfg) -> str:
    if cfg.model:
        import data

        try:
            path = data.resolve_model(cfg.model)  # a local directory, or a hub id downloaded once
        except data.DataError as err:
            raise SystemExit(f"error: {err}") from None
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit(f"error: --model {cfg.model} has no config.json: not a Hugging Face model directory")
        return path
    from rollout import build_tiny_model

    path = os.path.abspath(os.path.join(cfg.out, "init_model"))
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, seed=cfg.seed)
    return path


def check_tokenizer(model_path) -> None:
    """The run needs an end-of-sequence token (completions must be able to stop)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as err:
        raise SystemExit(f"error: cannot load the tokenizer of {model_path}: {err}") from None
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
    eos = tokenizer.eos_token_id
    if eos is None or (vocab is not None and eos >= vocab):
        raise SystemExit(f"error: the tokenizer in {model_path} has no eos token the model knows (eos "
                         f"{tokenizer.eos_token!r}, id {eos}, model vocabulary {vocab}): completions could "
                         "never stop; set eos_token in its tokenizer_config.json")


def allocate_shared_weights(model_path, device="cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM
    from sync import SharedWeights, named_shapes_of

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return SharedWeights.allocate(named_shapes_of(skeleton), dtype=torch.float32, device=device)


def split_threads(cfg):
    cores = len(os.sched_getaffinity(0))
    gen = cfg.gen_threads or max(1, cores // 2)
    train = cfg.train_threads or max(1, (cores - gen) // cfg.train_ranks)
    return gen, train


def generator_settings(cfg: Config, model_path: str, gen_threads: int, start_step: int = 0,
                       start_version: int = 0, layout=None, lora_dir: str = "", groups_dropped: int = 0):
    """The generator's settings (`rollout.GeneratorSettings`) for this config: what `run` starts the generator
    with, and what the benchmarks start it with. A resumed run passes its checkpoint's step, version and
    groups dropped so far (the walk of prompts continues after the last group id consumed); `layout`
    (devices.layout_for) adds the GPU placement, None is the CPU path; `lora_dir` holds the adapter's config
    with --lora-rank."""
    import data
    from rollout import GeneratorSettings

    return GeneratorSettings(
        model=model_path, seed=cfg.seed, group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step,
        max_new_tokens=cfg.max_new_tokens, max_lag=cfg.max_lag, update_mode=cfg.update_mode,
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        max_inflight_groups=cfg.max_inflight_groups, kv_cache_mb=cfg.kv_cache_mb, threads=gen_threads,
        queue_timeout_s=cfg.timeout_s, initial_version=start_version,
        first_group_id=start_step * cfg.prompts_per_step + groups_dropped,
        task=cfg.task, dataset=cfg.dataset, split=cfg.split, prompt_column=cfg.prompt_column,
        answer_column=cfg.answer_column, reward=cfg.reward, reward_weights=cfg.reward_weights,
        system_prompt=cfg.system_prompt, reward_workers=cfg.reward_workers, max_prompt_tokens=cfg.max_prompt_tokens,
        stop=data.stop_strings(cfg.stop), eval_dataset=cfg.eval_dataset, eval_split=cfg.eval_split,
        eval_prompts=cfg.eval_prompts, eval_samples=cfg.eval_samples,
        eval_at_start=cfg.eval_every > 0 and start_step == 0, lora_rank=cfg.lora_rank,
        lora_dir=lora_dir, **(layout.generator_settings() if layout is not None else {}))


def run(cfg: Config) -> int:
    """Start the generator and trainer ranks, wait for them, and return the run's exit code."""
    import checkpoint

    import data

    os.makedirs(cfg.out, exist_ok=True)
    if cfg.eval_every and not data.has_eval_set(cfg):
        print("note: no held-out prompts (a dataset file has no test split): no evaluation; give --eval-dataset "
              "FILE or a Hugging Face dataset with a test split (or --eval-split)", file=sys.stderr, flush=True)
        cfg.eval_every = 0
    resume_dir, start_step, start_version, groups_dropped = "", 0, 0, 0
    if cfg.resume:
        resume_dir = checkpoint.resolve(cfg.resume, cfg.out)
        saved = checkpoint.load_state(resume_dir)
        start_step, start_version = saved["step"], saved["version"]
        groups_dropped = saved.get("groups_dropped", 0)
        for line in checkpoint.config_differences(saved["config"], dataclasses.asdict(cfg)):
            print(f"warning: config differs from the checkpoint's: {line}", file=sys.stderr)
        print(f"resuming from {resume_dir}: step {start_step}, version {start_version}", flush=True)
        # LoRA checkpoints hold the adapter only: the base model is the one the run started from
        model_path = saved.get("base_model", "") if cfg.lora_rank else os.path.join(resume_dir, "model")
        if cfg.lora_rank and not os.path.isdir(model_path):
            raise SystemExit(f"error: the base model of {resume_dir} ({model_path or 'not recorded'}) is gone")
    else:
        model_path = prepare_model(cfg)
    check_tokenizer(model_path)
    import devices

    layout = devices.layout_for(cfg)
    if layout.notice:
        print(layout.notice, file=sys.stderr, flush=True)
    cfg.train_ranks = layout.world_size  # on GPUs: one rank per --train-devices GPU
    gen_threads, cfg.train_threads = split_threads(cfg)
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    # On GPUs this process owns the packed buffer (on the first trainer GPU) and outlives every reader.
    lora_dir = ""
    if cfg.lora_rank:  # the buffer holds the adapter only; vLLM reads its rank and alpha from lora_dir
        import lora
        from sync import SharedWeights

        shapes, resolved = lora.adapter_shapes(model_path, lora.peft_config(
            cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets))
        lora_dir = lora.write_config(resolved, model_path, os.path.join(cfg.out, "adapter_config"))
        shared = SharedWeights.allocate(shapes, dtype=torch.float32, device=layout.buffer_device)
    else:
        shared = allocate_shared_weights(model_path, device=layout.buffer_device)
    ctx = mp.get_context("spawn")
    rollout_queue = ctx.Queue(maxsize=cfg.queue_size)
    errors = ctx.Queue()
    control = make_control(ctx)
    control.groups_dropped.value = groups_dropped  # so the generator's landing step, (group id - dropped) //
    # prompts_per_step, starts at start_step with first_group_id = start_step * prompts_per_step + dropped
    settings = generator_settings(cfg, model_path, gen_threads, start_step, start_version, layout, lora_dir,
                                  groups_dropped)
    init_file = tempfile.mktemp(prefix="asyncgrpo-dist-")
    children = {"generator": (_generator_entry, (settings, shared, rollout_queue, control), True)}
    for rank in range(cfg.train_ranks):
        children[f"trainer{rank}"] = (trainer_main, (cfg, rank, cfg.train_ranks, model_path, shared, rollout_queue,
                                                     control, init_file, resume_dir), False)
    try:
        return run_children(ctx, children, errors, control)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def _generator_entry(settings, shared, rollout_queue, control):
    from rollout import generator_main

    rollout_queue.cancel_join_thread()  # exiting must not wait for a full queue to drain
    control.eval_results.cancel_join_thread()  # nor for evaluation answers nobody will read
    generator_main(settings, shared, rollout_queue, control)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
