"""train.py — entry point: config, processes, the trainer loop, the run summary.

Role
    `python train.py` (no flags) builds a tiny random-init model and its tokenizer locally, starts one vLLM
    generator process (rollout.py) and `--train-ranks` FSDP2 trainer processes (gloo on CPU), joins them
    with a bounded rollout queue (buffer.py) and a packed shared weight buffer (sync.py), and trains with
    a GRPO-family loss (losses.py) until `--steps` optimizer steps are done; metrics.py writes what a run
    reports, checkpoint.py its checkpoints (`--save-every`, `--resume`), lora.py the adapter of
    `--lora-rank`. The parent process only supervises (processes.py): a child that raises, exits or is
    killed ends the whole run with a non-zero exit and the child's traceback, and no process of the run is
    left behind. With `--role generator` / `--role trainer` (under torchrun) the two sides run on different
    machines instead (remote.py).

Data contract
    - Every `Config` field is a `--flag` (underscores become dashes).
    - `--dtype bf16|fp32|auto` is one precision for the run: the trainer's compute (FSDP2 mixed precision;
      master weights, gradient reduction and optimizer state stay fp32), vLLM, the packed weight buffer
      (cast on publish) and the `--kl-coef` reference. Checkpoints and the final model are fp32.
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
import inspect
import io
import json
import math
import os
import sys
import tempfile
import time
import tokenize
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
    """Every field is a `--flag` (underscores become dashes). The comment after a field is its `--help` text
    and a comment line on its own starts a group of flags: this class is the one source of both."""
    # run
    steps: int = 300  # steps to train for: rollout batches, one model version each (a resume counts on)
    seed: int = 0  # seeds the tiny model, the prompts drawn and the sampling
    model: str = ""  # Hugging Face model directory or hub id; "" builds the tiny default model into OUT/init_model
    out: str = "runs/latest"  # output folder: metrics.jsonl, summary.json, plots.png, model/, checkpoints/
    # asynchrony
    max_lag: int = 2  # train only on samples whose oldest token is <= this many versions old (0: on-policy)
    queue_size: int = 64  # rollout groups waiting in the queue, at most
    sync_every: int = 1  # publish weights every N steps
    update_mode: str = "inflight"  # inflight: swap weights with requests kept running; drain: let them finish
    max_inflight_groups: int = 0  # groups generating at once; 0 = --prompts-per-step
    # sizes
    train_ranks: int = 1  # FSDP2 trainer ranks (processes; on GPUs one per --train-devices GPU)
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 32  # prompts (groups) per step
    max_new_tokens: int = 5  # longest completion, in tokens
    micro_batch_tokens: int = 4096  # each rank's forward/backward takes at most this many padded tokens at once (0: all its rows)
    # data and reward (data.py; the defaults are the built-in copy task)
    task: str = "auto"  # auto (dataset with --dataset, else copy) | copy | dataset | gsm8k (a preset)
    dataset: str = ""  # a .jsonl/.json/.parquet file, or a Hugging Face dataset NAME[:CONFIG]
    split: str = "train"  # the split of a Hugging Face dataset
    prompt_column: str = "prompt"  # text, or a list of chat messages (rendered with the chat template)
    answer_column: str = "answer"  # also passed to reward functions as `answer`
    reward: str = ""  # comma-separated module:function | path/file.py:function | math (TRL's convention)
    reward_weights: str = ""  # comma-separated, one per --reward function; "": all 1
    system_prompt: str = ""  # added as a system message (chat template) or a prefix (plain text)
    reward_workers: int = 0  # 0: rewards run in a thread of the generator; N: a pool of N processes
    max_prompt_tokens: int = 0  # drop longer prompts before training starts (counted); 0: only the context limits them
    # sampling (the trainer scores tokens with the same temperature/top-k/top-p)
    temperature: float = 1.0  # sampling temperature (> 0)
    top_k: int = -1  # keep the k most likely tokens; -1: off
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this much mass; 1: off
    stop: tuple = ()  # stop strings, one or more (\n, \t, \\ are unescaped): the reward sees the text before the stop
    # evaluation on held-out prompts (evaluation.py), on the generator's engine beside training
    eval_every: int = 50  # evaluate every N steps, and at step 0 and the end (0: never)
    eval_dataset: str = ""  # held-out prompts: a file or Hugging Face dataset ("": --dataset's test split, if any)
    eval_split: str = ""  # the split of the held-out set ("": test)
    eval_prompts: int = 256  # held-out prompts per evaluation, at most (the same fixed subset each time)
    eval_samples: int = 4  # sampled completions per held-out prompt (mean reward, pass@k for k <= this); 0: greedy only
    eval_pass_reward: float = 1.0  # a completion passes (pass@k, greedy pass@1) when its reward is >= this
    # optimisation and loss (see losses.py)
    lr: float = 3e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # clip the gradient's global norm to this
    loss: str = "grpo"  # the policy loss: grpo | dapo | dr_grpo | gspo | cispo
    adv_scale: str = "group"  # divide advantages by the reward std of the group | batch | none (Dr. GRPO)
    agg: str = "token-mean"  # how token losses are averaged over the batch (see losses.AGGS)
    eps_low: float = 0.2  # lower clip of the ratio: 1 - eps_low
    eps_high: Optional[float] = None  # upper clip of the ratio: 1 + eps_high; none: eps_low (dapo: 0.28)
    dual_clip: Optional[float] = None  # dual-clip constant c > 1 for negative advantages; none: off
    kl_coef: float = 0.0  # weight of the KL penalty to the original model (> 0 keeps a frozen reference)
    kl_kind: str = "k3"  # KL estimator: k1 | k2 | k3 (Schulman's)
    is_level: str = "token"  # behaviour-policy importance weights per token or per sequence
    is_mode: str = "truncate"  # truncate (TIS) | mask (MIS) | off (the ratio is taken against the generator)
    is_low: Optional[float] = None  # with --is-mode mask: weights below this are masked; none: no lower bound
    is_high: float = 2.0  # importance weights above this are truncated (or masked)
    mini_batches: int = 1  # optimizer steps per rollout batch, each on 1/M of it (PPO mini-batches)
    ppo_epochs: int = 1  # passes over each rollout batch (each pass: --mini-batches optimizer steps)
    lr_schedule: str = "constant"  # after warmup: constant | linear | cosine (decay to --min-lr at the last step)
    lr_warmup_steps: int = 0  # steps of linear warmup from lr / N to --lr
    min_lr: float = 0.0  # the learning rate at the last step, with --lr-schedule linear or cosine
    # GRPO recipes (DAPO)
    filter_groups: bool = False  # dynamic sampling: skip groups whose rewards are all equal; the step waits for others
    overlong_filter: bool = False  # leave completions cut at --max-new-tokens out of the loss
    overlong_penalty: int = 0  # L > 0: DAPO's soft overlong penalty over the last L tokens before --max-new-tokens
    # machinery
    gen_threads: int = 0  # CPU threads of the generator; 0: half the cores
    train_threads: int = 0  # CPU threads per trainer rank; 0: the rest of the cores, split between ranks
    kv_cache_mb: int = 256  # vLLM's KV cache on CPU, in MiB
    dtype: str = "auto"  # bf16 | fp32 | auto (bf16 on GPUs, fp32 on CPU): trainer compute (fp32 master weights), vLLM, weight syncs
    max_model_len: int = 0  # vLLM's context, prompt + completion (longer prompts are skipped and counted); 0: the model's own
    gpu_memory_utilization: float = 0.0  # vLLM's share of each generator GPU; 0: 0.9 alone, 0.3 on a GPU shared with a trainer rank
    grad_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass: less memory, ~1/3 more compute
    timeout_s: float = 300.0  # longest wait for any other process before the run fails
    gen_devices: str = ""  # generator GPUs, e.g. "0" ("" or "cpu": the CPU path); see devices.py
    train_devices: str = ""  # trainer GPUs, one FSDP2 rank each, e.g. "1,2,3"; "0" with --gen-devices 0 shares it
    # LoRA (lora.py): train an adapter on the frozen base model and sync only the adapter
    lora_rank: int = 0  # > 0: LoRA of this rank (0: full fine-tuning)
    lora_alpha: int = 16  # the adapter's scale is alpha / rank
    lora_dropout: float = 0.0  # dropout on the adapter's input
    lora_targets: str = "all-linear"  # the modules the adapter wraps: all-linear, or names such as q_proj,v_proj
    merge_at_end: bool = False  # with --lora-rank: also write OUT/model, the base model with the adapter merged in
    # checkpoints and faults
    save_every: int = 0  # write a checkpoint every N steps (0: only when interrupted)
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    resume: str = ""  # a checkpoint folder, or "latest" (the newest under OUT/checkpoints)
    max_bad_steps: int = 10  # steps skipped for NaN/inf loss or gradients before the run stops
    # logging
    log_every: int = 10  # print a progress line every N steps
    log_level: str = "warning"  # warning: progress lines, warnings, errors; info / debug: also vLLM's own log
    wandb: str = "off"  # log to Weights & Biases: online | offline | off
    wandb_project: str = "asyncgrpo"  # the wandb project
    # beyond one node (remote.py): the generator on its own machine, the trainer ranks under torchrun
    role: str = "all"  # all: this machine runs both | generator: serve a remote trainer | trainer: a torchrun rank
    generator_addr: str = ""  # HOST:PORT the generator listens on and the trainer connects to (PORT + 1: weights)


CHOICES = {"update_mode": ("inflight", "drain"), "loss": ("grpo", "dapo", "dr_grpo", "gspo", "cispo"),
           "adv_scale": ("group", "batch", "none"), "wandb": ("online", "offline", "off"),
           "agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
           "kl_kind": ("k1", "k2", "k3"), "is_level": ("token", "sequence"),
           "is_mode": ("truncate", "mask", "off"), "log_level": ("debug", "info", "warning"),
           "lr_schedule": ("constant", "linear", "cosine"), "dtype": ("auto", "bf16", "fp32"),
           "role": ("all", "generator", "trainer")}


def field_help(cls) -> dict[str, tuple[str, str]]:
    """{field: (group, help)} read from the class's source: a field's trailing comment is its help, and a
    comment line on its own names the group of the fields below it (CleanRL's arguments dataclass, without a
    second list to keep in step)."""
    lines: dict[int, list] = {}  # line number -> its tokens (the docstring spans lines: tokenize it whole)
    for token in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if token.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER):
            lines.setdefault(token.start[0], []).append(token)
    group, found = "", {}
    for tokens in lines.values():
        if len(tokens) == 1 and tokens[0].type == tokenize.COMMENT:
            group = tokens[0].string.lstrip("# ").strip()
        elif len(tokens) > 2 and tokens[0].type == tokenize.NAME and tokens[1].string == ":":
            comment = tokens[-1].string.lstrip("# ").strip() if tokens[-1].type == tokenize.COMMENT else ""
            found[tokens[0].string] = (group, comment)
    return found


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default in ("", None, ()) and action.help:  # say what an empty default is, not "(default: )"
            return action.help + (' (default: "")' if action.default == "" else " (default: none)")
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--flag VALUE ...]", formatter_class=HelpFormatter,
        description="Asynchronous GRPO: a vLLM generator and FSDP2 trainer ranks joined by a bounded rollout queue, "
                    "with weights pushed to the running generator. No flags: the built-in task on a tiny model.")
    metavars = {int: "N", float: "X", str: "S"}
    docs, groups = field_help(Config), {}
    for f in dataclasses.fields(Config):
        group_name, help_text = docs[f.name]
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        group = groups[group_name]
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.type is tuple:  # one or more strings
            group.add_argument(flag, nargs="+", default=f.default, help=help_text, metavar="S")
        elif typing.get_origin(f.type) is typing.Union:  # Optional[float]: "none" means None
            group.add_argument(flag, type=lambda s: None if s.lower() == "none" else float(s), default=f.default,
                               help=help_text, metavar="X")
        else:
            group.add_argument(flag, type=f.type, default=f.default, choices=CHOICES.get(f.name), help=help_text,
                               metavar=None if f.name in CHOICES else metavars[f.type])
    return parser


def parse_args(argv=None) -> Config:
    cfg = Config(**vars(build_parser().parse_args(argv)))
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """One clear line per bad value (the run has not started anything yet)."""
    problems = []
    for name in ("steps", "group_size", "prompts_per_step", "max_new_tokens", "queue_size", "sync_every",
                 "train_ranks", "kv_cache_mb"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.micro_batch_tokens < 0:
        problems.append(f"--micro-batch-tokens must be >= 0 (0: each rank's whole share at once; got {cfg.micro_batch_tokens})")
    if cfg.save_every < 0 or cfg.keep_checkpoints < 0 or cfg.max_bad_steps < 0:
        problems.append("--save-every, --keep-checkpoints and --max-bad-steps must be >= 0")
    if cfg.max_model_len < 0:
        problems.append(f"--max-model-len must be >= 0 (got {cfg.max_model_len})")
    elif cfg.max_model_len and cfg.max_model_len <= cfg.max_new_tokens:
        problems.append(f"--max-model-len {cfg.max_model_len} leaves no room for a prompt before "
                        f"--max-new-tokens {cfg.max_new_tokens}: give more than {cfg.max_new_tokens}")
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
    if cfg.mini_batches < 1 or cfg.ppo_epochs < 1:
        problems.append(f"--mini-batches and --ppo-epochs must be >= 1 (got {cfg.mini_batches}, {cfg.ppo_epochs})")
    elif cfg.mini_batches > cfg.prompts_per_step * cfg.group_size:
        problems.append(f"--mini-batches {cfg.mini_batches} is more than the {cfg.prompts_per_step * cfg.group_size} "
                        "samples of a step (--prompts-per-step x --group-size)")
    if cfg.lr_warmup_steps < 0 or not 0 <= cfg.min_lr <= cfg.lr:
        problems.append(f"--lr-warmup-steps must be >= 0 and --min-lr in [0, --lr] (got {cfg.lr_warmup_steps}, "
                        f"{cfg.min_lr})")
    if not 0 <= cfg.overlong_penalty < cfg.max_new_tokens:
        problems.append(f"--overlong-penalty must be in [0, --max-new-tokens) (got {cfg.overlong_penalty})")
    if not 0 <= cfg.lora_rank <= 512:
        problems.append(f"--lora-rank must be in 0..512 (got {cfg.lora_rank})")
    if cfg.lora_rank and cfg.lora_alpha <= 0:
        problems.append(f"--lora-alpha must be > 0 (got {cfg.lora_alpha})")
    if not 0 <= cfg.lora_dropout < 1:
        problems.append(f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    if cfg.lora_rank and "lm_head" in cfg.lora_targets.replace(" ", "").split(","):
        problems.append("--lora-targets lm_head: the LM head cannot take an adapter here (the trainer applies "
                        "its weight directly, a chunk of tokens at a time); adapt the other layers")
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
    import remote
    problems += remote.problems(cfg)  # --role, --generator-addr
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))


def inactive_flags(cfg: Config) -> list[str]:
    """Flags that cannot change this run's gradient: one optimizer step per rollout batch (--mini-batches 1
    --ppo-epochs 1) makes the ratio to the proximal policy exactly 1, so with an importance correction the
    ratio clips never act."""
    if cfg.is_mode == "off" or cfg.mini_batches * cfg.ppo_epochs > 1:  # the ratio moves: the clips act
        return []
    set_by_user = [f"--{name.replace('_', '-')}" for name in ("eps_low", "eps_high", "dual_clip")
                   if getattr(cfg, name) != getattr(Config, name)]
    if cfg.loss in ("dapo", "gspo", "cispo"):
        set_by_user.insert(0, f"--loss {cfg.loss}")
    return set_by_user


# ----------------------------------------------------------------------------------------------------
# The trainer (one process per rank)
# ----------------------------------------------------------------------------------------------------
def build_trainer_model(model_path, world_size, device="cpu", lora_config=None, adapter_dir="", seed=0,
                        compute_dtype=torch.float32):
    """The model under FSDP2; with a LoRA config, wrapped in a trainable adapter first (from `adapter_dir`
    on a resume) and the base weights frozen. The parameters (master weights), their gradients and the
    optimizer state stay fp32; with `compute_dtype` bf16, FSDP2's mixed precision gathers the parameters
    in bf16 for forward and backward and reduces gradients in fp32 (verl's recipe)."""
    import lora
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    if lora_config is not None:
        model = lora.wrap(model, lora_config, seed, adapter_dir)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return shard_layers_and_root(model, lora.base_model_of(model).model.layers, world_size, device, mp_policy=policy)


def shard_layers_and_root(model, layers, world_size, device, **options):
    """fully_shard each decoder layer, then the root (FSDP2's usual wrapping)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # An explicit mesh: with a CUDA build of torch, fully_shard's default mesh is on the GPU even on the CPU path.
    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def learning_rate(step: int, cfg: Config) -> float:
    """The learning rate of step `step` (0-based): linear warmup to --lr over --lr-warmup-steps, then constant,
    or decayed to --min-lr at the last step (--lr-schedule linear | cosine)."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, cfg.steps - 1 - cfg.lr_warmup_steps))
    decay = 1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * decay


def shaped_rewards(groups, cfg: Config):
    """(num_groups, group_size) rewards the advantages are computed from: the task's, plus DAPO's soft overlong
    penalty with --overlong-penalty; and which samples were cut at --max-new-tokens."""
    from losses import overlong_penalty

    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    lengths = torch.tensor([[len(c) for c in g.completion_ids] for g in groups], dtype=torch.float32)
    truncated = torch.tensor([[reason == "length" for reason in g.finish_reasons or ["stop"] * len(g.rewards)]
                              for g in groups])
    if cfg.overlong_penalty:
        rewards = rewards + overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_penalty)
    return rewards, truncated


def build_reference_model(model_path, world_size, device="cpu", dtype=torch.float32):
    """The frozen reference of `--kl-coef` (full fine-tuning): the original weights, in the serving dtype,
    sharded under FSDP2 like the policy, so each rank holds 1/world_size of it. The root reshards after
    each forward too (FSDP2 keeps a root's parameters gathered for the backward that a no-grad reference
    never runs: the embedding and output head, the largest tensors, would stay whole on every rank)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return shard_layers_and_root(model, model.model.layers, world_size, device, reshard_after_forward=True)


def checkpoint_layers(model) -> None:
    """Activation checkpointing (`--grad-checkpointing`): each decoder layer keeps only its input for the
    backward pass and recomputes the rest there, trading about one more forward for the activations of
    every layer. Applied inside FSDP2's hooks (they run around the layer's call; the recompute runs after
    the layer's pre-backward hook has gathered its weights), so it composes with sharding and with LoRA."""
    import functools

    import lora
    from torch.utils.checkpoint import checkpoint

    for layer in lora.base_model_of(model).model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


@dataclass
class TokenScores:
    """What `completion_logprobs` returns: (B, T) float32, 0 off the batch's mask."""
    logp: torch.Tensor  # log-probs of the targets under the sampling distribution (temperature, top-k, top-p)
    entropy: torch.Tensor  # entropy of that distribution at each position (detached)
    logp_untruncated: Optional[torch.Tensor] = None  # under the temperature alone (the KL term's), if asked for


def completion_logprobs(model, batch, temperature, top_k=-1, top_p=1.0, untruncated=False) -> TokenScores:
    """Score a (micro-)batch's completion tokens with the generator's sampling distribution.

    The model runs without its LM head; the head is applied to the final hidden states at completion
    positions only, a chunk of tokens at a time (`losses.chunked_logprobs`), so no (B, T, V) logits exist
    in the forward or the backward. Works with gradients, or under `torch.no_grad()` for a reference or
    proximal policy; `model` is a causal LM or a PEFT wrapper of one, under FSDP2 or plain."""
    import lora
    from losses import chunked_logprobs

    # The whole model runs (under FSDP2 only its call gathers the weights), with logits_to_keep=[]: no logits;
    # the decoder's output is caught on the way. FSDP2's root keeps the LM head's weight gathered from its
    # forward to the end of the backward, so the head can be applied after the call.
    base = lora.base_model_of(model)
    caught = []
    hook = base.get_decoder().register_forward_hook(lambda _, __, out: caught.append(out.last_hidden_state))
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=batch.input_ids.device))
    finally:
        hook.remove()
    hidden = caught[0][:, :-1][batch.mask]  # final hidden states where completion tokens are predicted
    targets = batch.targets[batch.mask]
    head = base.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # a model whose root reshards after its forward (the KL reference): gather
        weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()

    def scored(values):  # (N,) -> (B, T), 0 off the mask
        return values.new_zeros(batch.mask.shape).masked_scatter(batch.mask, values)

    logp, entropy = chunked_logprobs(hidden, weight, bias, targets, temperature, top_k, top_p)
    scores = TokenScores(scored(logp), scored(entropy))
    if untruncated:
        truncated = 0 < top_k < weight.shape[0] or top_p < 1
        scores.logp_untruncated = scores.logp if not truncated else scored(
            chunked_logprobs(hidden, weight, bias, targets, temperature)[0])
    return scores


def reference_logprobs(model, ref_model, batch, temperature):
    """Log-probs (B, T) of the reference policy (untruncated, at the sampling temperature), no gradient:
    `ref_model`, or with LoRA (`ref_model` None) the same model with its adapter switched off."""
    with torch.no_grad():
        if ref_model is not None:
            return completion_logprobs(ref_model, batch, temperature).logp
        with model.disable_adapter():
            return completion_logprobs(model, batch, temperature).logp


class StepStats:
    """One step's metrics, added up over its micro-batches and then over ranks: means (a total over a
    count), sums and maxima. Every rank adds the same names, in any order."""

    def __init__(self):
        self.means, self.sums, self.maxima = {}, {}, {}

    def mean(self, name, total, count):
        s, n = self.means.get(name, (0.0, 0))
        self.means[name] = (s + total, n + count)

    def add(self, name, value):
        self.sums[name] = self.sums.get(name, 0.0) + value

    def max(self, name, value):
        self.maxima[name] = max(self.maxima.get(name, -math.inf), value)

    def reduced(self, world_size) -> dict:
        """The step's values (the same on every rank: a collective, every rank calls it)."""
        import torch.distributed as dist

        means, sums, maxima = sorted(self.means), sorted(self.sums), sorted(self.maxima)
        totals = torch.tensor([self.means[n][0] for n in means] + [self.means[n][1] for n in means]
                              + [self.sums[n] for n in sums], dtype=torch.float64)
        highest = torch.tensor([self.maxima[n] for n in maxima], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(totals)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        k = len(means)
        out = {n: float(totals[i] / totals[k + i]) if totals[k + i] > 0 else 0.0 for i, n in enumerate(means)}
        out.update(zip(sums, totals[2 * k:].tolist()))
        out.update(zip(maxima, highest.tolist()))
        return out


def micro_batch_loss(model, ref_model, mb, cfg, units, tokens, version, stats: StepStats):
    """One micro-batch's term of the step's loss: its share of the whole batch's loss (normalised by the
    step's `units`, and its KL term by the step's completion `tokens`). Its metrics go into `stats`."""
    from losses import behaviour_weights, kl_penalty, policy_loss

    scores = completion_logprobs(model, mb, cfg.temperature, cfg.top_k, cfg.top_p, untruncated=cfg.kl_coef > 0)
    proximal = mb.proximal_logp if cfg.is_mode != "off" else None
    # A stale token can lie outside the current (or proximal) policy's top-k/top-p set (log-prob -inf): leave it out.
    outside = mb.mask & ~torch.isfinite(scores.logp)
    if proximal is not None:
        outside |= mb.mask & ~torch.isfinite(proximal)
    mask = mb.mask & ~outside
    logp = torch.where(mask, scores.logp, torch.zeros_like(scores.logp))
    if cfg.is_mode == "off":
        old_logp, weights = mb.behaviour_logp, None  # ratio against the generator (PipelineRL style)
    else:
        # The decoupled objective (AReaL): the ratio against the proximal policy, the weights before the batch's
        # first update; the importance weight proximal / behaviour. With one update per batch the proximal
        # policy is the current one, and its log-probs need no pass of their own.
        old_logp = torch.where(mask, proximal, 0.0) if proximal is not None else logp.detach()
        weights = behaviour_weights(old_logp, mb.behaviour_logp, mask, level=cfg.is_level,
                                    mode=cfg.is_mode, low=cfg.is_low, high=cfg.is_high)
    loss, metrics = policy_loss(logp, old_logp, mb.advantages, mask, variant=cfg.loss,
                                eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                                agg=cfg.agg, max_len=cfg.max_new_tokens, weights=weights, units=units)
    n = int(mask.sum())
    if cfg.kl_coef > 0:  # between the untruncated distributions
        ref_logp = reference_logprobs(model, ref_model, mb, cfg.temperature)
        kl = torch.where(mask, kl_penalty(scores.logp_untruncated, ref_logp, cfg.kl_kind), 0.0).sum()
        loss = loss + cfg.kl_coef * kl / max(tokens, 1)
        stats.mean("kl_ref", float(kl), n)
    if weights is not None:
        stats.mean("is_weight_mean", float(weights[mask].sum()), n)
    for name, value in metrics.items():  # policy_loss's are means over the masked tokens, but ratio_max
        stats.max(name, value) if name == "ratio_max" else stats.mean(name, value * n, n)
    stats.mean("entropy", float(scores.entropy[mb.mask].sum()), int(mb.mask.sum()))
    stats.add("outside_support_tokens", int(outside.sum()))
    stats.add("loss", float(loss.detach()))
    stats.add("positions", mb.attention_mask.numel())
    stats.add("padding", int((mb.attention_mask == 0).sum()))
    # Agreement with the generator, on completions sampled entirely by the weights we hold now.
    on_policy_rows = ((mb.token_versions == version) | ~mask).all(dim=1) & mask.any(dim=1)
    diff = (logp.detach() - mb.behaviour_logp).abs()[mask & on_policy_rows[:, None]]
    stats.max("logprob_diff_on_policy", float(diff.max()) if diff.numel() else -1.0)
    # bf16 makes the max a tail; the mean says how far the two sides typically disagree
    stats.mean("logprob_diff_mean", float(diff.sum()), diff.numel())
    stats.add("on_policy_rows", int(on_policy_rows.sum()))
    return loss


@dataclass
class StepResult:
    loss: float  # the whole batch's loss (every micro-batch, every rank)
    logprob_diff: Optional[float]  # max |trainer - generator| log-prob on fully on-policy rows (None: none)
    metrics: dict  # the per-step row's loss diagnostics, entropy, pad_frac, micro_batches


def train_on_batch(model, ref_model, batch, cfg, rank, world_size, version, device="cpu") -> StepResult:
    """Forward and backward over this rank's rows of the step's `batch`, one micro-batch at a time
    (`--micro-batch-tokens`): gradients accumulate, and the caller clips and steps once. Every term is
    normalised by the whole step's count (tokens for token-mean, non-empty sequences for the sequence
    means, over every micro-batch and rank), so the gradient is the whole batch's however it is split.
    Returns the step's loss and metrics, reduced over ranks (the same on every rank)."""
    import buffer

    micro_batches = buffer.rank_micro_batches(batch, rank, world_size, cfg.micro_batch_tokens)
    tokens = int(batch.mask.sum())  # every rank holds the whole batch: the step's counts need no collective
    units = tokens if cfg.agg == "token-mean" else int((batch.mask.sum(1) > 0).sum())
    stats = StepStats()
    for mb in micro_batches:
        loss = micro_batch_loss(model, ref_model, mb.to(device), cfg, units, tokens, version, stats)
        (loss * world_size).backward()  # FSDP2 averages gradients over ranks: the factor makes it their sum
    step = stats.reduced(world_size)
    on_policy = step.pop("on_policy_rows") > 0
    diff = step.pop("logprob_diff_on_policy")
    if not on_policy:
        step.pop("logprob_diff_mean")
    positions, padding = step.pop("positions"), step.pop("padding")
    step.update(outside_support_tokens=int(step["outside_support_tokens"]), pad_frac=padding / positions,
                micro_batches=len(micro_batches))
    return StepResult(step.pop("loss"), diff if on_policy else None, step)


def proximal_logprobs(model, batch, cfg, rank, world_size, device="cpu") -> torch.Tensor:
    """(B, T) log-probs of the batch's tokens under the weights before its first update (the proximal policy),
    without gradients, micro-batched and chunked as training is. Each rank scores its own rows; a sum over
    ranks gives every rank all of them."""
    import torch.distributed as dist

    import buffer

    out = torch.zeros(batch.mask.shape)
    plan, count = buffer.rank_micro_batch_rows(batch, rank, world_size, cfg.micro_batch_tokens)
    with torch.no_grad():
        for i in range(count):  # a rank with fewer micro-batches runs fillers: FSDP2 needs every rank's forward
            rows = plan[i] if i < len(plan) else [0]
            mb = batch.select(rows).trimmed()
            logp = completion_logprobs(model, mb.to(device), cfg.temperature, cfg.top_k, cfg.top_p).logp
            if i < len(plan):
                out[rows, :logp.shape[1]] = logp.float().cpu()
    if world_size > 1:
        dist.all_reduce(out)
    return out


def mini_batch_rows(num_rows: int, cfg: Config, step: int, epoch: int) -> list[torch.Tensor]:
    """The rows of each of a step's --mini-batches in one pass: a seeded shuffle (the same on every rank), then
    M nearly equal parts."""
    if cfg.mini_batches == 1:
        return [torch.arange(num_rows)]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch))
    return list(order.tensor_split(cfg.mini_batches))


@dataclass
class UpdateResult:
    loss: float  # mean over the step's optimizer updates
    grad_norm: float  # mean over the applied updates (before clipping)
    logprob_diff: Optional[float]  # trainer vs generator on fully on-policy rows, before any update (None: none)
    metrics: dict  # means over the updates (ratio_max: the max; counts: totals), and `updates`
    applied: int  # optimizer updates taken
    skipped: int  # updates skipped for a NaN/inf loss or gradient


def update_on_batch(model, ref_model, optimizer, batch, cfg, rank, world_size, version, step,
                    device="cpu") -> UpdateResult:
    """PPO's update on one rollout batch: --ppo-epochs passes, each of --mini-batches optimizer steps on a part
    of the batch (each normalised over its own part). With more than one update, the proximal policy's
    log-probs are computed first, once; the ratio then moves between updates and the clips act. An update
    with a NaN/inf loss or gradient is skipped. The model version advances once per batch (the caller's)."""
    proximal = cfg.is_mode != "off" and cfg.mini_batches * cfg.ppo_epochs > 1
    logprob_diff, diff_mean = None, None
    if proximal:
        batch = dataclasses.replace(batch, proximal_logp=proximal_logprobs(model, batch, cfg, rank, world_size, device))
        # agreement with the generator, measured on the weights it sampled with (before any update)
        on_policy = ((batch.token_versions == version) | ~batch.mask).all(1) & batch.mask.any(1)
        both = batch.mask & on_policy[:, None] & torch.isfinite(batch.proximal_logp)
        diff = (batch.proximal_logp - batch.behaviour_logp).abs()[both]
        if diff.numel():
            logprob_diff, diff_mean = float(diff.max()), float(diff.mean())
    results, norms, skipped = [], [], 0
    for epoch in range(cfg.ppo_epochs):
        for rows in mini_batch_rows(len(batch), cfg, step, epoch):
            result = train_on_batch(model, ref_model, batch.select(rows), cfg, rank, world_size, version, device)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if math.isfinite(grad_norm) and math.isfinite(result.loss):
                optimizer.step()
                norms.append(grad_norm)
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            results.append(result)
    metrics = {}
    for name in results[0].metrics:
        values = [r.metrics[name] for r in results if name in r.metrics]
        combine = max if name == "ratio_max" else sum if name in ("outside_support_tokens", "micro_batches") else \
            (lambda v: sum(v) / len(v))
        metrics[name] = combine(values)
    if not proximal:  # one update: its own measure of the agreement (the model had not changed yet)
        logprob_diff = results[0].logprob_diff
    elif diff_mean is not None:
        metrics["logprob_diff_mean"] = diff_mean
    else:
        metrics.pop("logprob_diff_mean", None)
    metrics["updates"] = len(norms)
    return UpdateResult(sum(r.loss for r in results) / len(results), sum(norms) / len(norms) if norms else math.nan,
                        logprob_diff, metrics, len(norms), skipped)


def trainer_main(cfg, rank, world_size, model_path, shared, rollout_queue, control, init_file, resume_dir="",
                 base_model=""):
    """One FSDP2 rank. `model_path`: the weights to start from (the original model, or a checkpoint's model on a
    resume); `base_model`: the model the run first started from (default `model_path`), the one source of the
    tokenizer, the saved model's skeleton, the KL reference and the LoRA base: checkpoints rotate away, it stays."""
    import torch.distributed as dist
    from datetime import timedelta

    import buffer
    import checkpoint
    import evaluation
    import metrics
    from losses import group_advantages

    import devices

    base_model = base_model or model_path
    torch.set_num_threads(cfg.train_threads)
    torch.manual_seed(cfg.seed + rank)
    layout = devices.layout_for(cfg)  # CPU: gloo, as before; GPU: this rank's GPU, NCCL for CUDA tensors
    device = torch.device(layout.train_device(rank))
    if cfg.role == "trainer" and torch.cuda.is_available():  # under torchrun: this node's GPU LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    serving_dtype = devices.torch_dtype(devices.resolve_dtype(cfg.dtype, layout))  # run() resolved "auto" already
    if layout.on_gpu:
        # vLLM measures a GPU's free memory while it starts: on a shared GPU, keep off it until vLLM is up.
        if layout.shared_gpus and not wait_for(control.ready, control.stop, cfg.timeout_s,
                                               "the generator's engine to start"):
            return
        torch.cuda.set_device(device)
        if layout.shares_gpu(rank):
            torch.cuda.set_per_process_memory_fraction(layout.train_memory_fraction, device)
    if not dist.is_initialized():  # (--role trainer: torchrun's env:// group, made by remote.run_trainer)
        dist.init_process_group(layout.backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg.timeout_s + 60))
    lora_config = None
    if cfg.lora_rank:
        import lora
        lora_config = lora.peft_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    model = build_trainer_model(model_path, world_size, device, lora_config,
                                os.path.join(resume_dir, "adapter") if resume_dir and cfg.lora_rank else "", cfg.seed,
                                compute_dtype=serving_dtype)
    if cfg.grad_checkpointing:
        checkpoint_layers(model)
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
    # the generator serves no adapter until this first publish (a new adapter is the base model); a remote
    # generator serves nothing until it has these start weights
    if cfg.lora_rank or shared.device_type == "remote":
        publish_model(model, shared, version, rank, world_size)
    ref_model = None
    if cfg.kl_coef > 0 and not cfg.lora_rank:
        ref_model = build_reference_model(base_model, world_size, device, serving_dtype)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(base_model)
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
        log.sync_mb = shared.nbytes / 2**20  # in the serving dtype
    published = version  # what the generator holds or will load next: what an evaluation asked for now sees
    evaluating = rank == 0 and cfg.eval_every > 0  # (the generator evaluated step 0 before it was ready)
    bad_steps = 0

    def count_dropped_group():  # the generator replaces it (its staleness gate counts the groups still needed)
        with control.groups_dropped.get_lock():
            control.groups_dropped.value += 1

    step = start_step
    for step in range(start_step, cfg.steps):
        t_wait = time.perf_counter()
        taken = None
        if rank == 0 and not control.stop.is_set():
            try:
                taken = buffer.take_groups(rollout_queue, cfg.prompts_per_step, version, cfg.max_lag,
                                           cfg.timeout_s, should_stop=control.stop.is_set,
                                           filter_groups=cfg.filter_groups, on_drop=count_dropped_group)
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

        rewards, truncated = shaped_rewards(taken.groups, cfg)
        advantages = group_advantages(rewards, scale=cfg.adv_scale)
        batch = buffer.collate(buffer.to_samples(taken.groups, advantages), pad_id)
        if cfg.overlong_filter:  # cut completions add no loss (and no tokens to the normalisation)
            batch.mask &= ~truncated.flatten()[:, None]
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        result = update_on_batch(model, ref_model, optimizer, batch, cfg, rank, world_size, version, step, device)
        grad_norm = result.grad_norm
        skipped = result.applied == 0  # every update had a NaN/inf loss or gradient: nothing changed
        bad_steps += result.skipped
        if bad_steps > cfg.max_bad_steps:
            raise RuntimeError(f"{bad_steps} steps with NaN/inf loss or gradients (--max-bad-steps "
                               f"{cfg.max_bad_steps}): lower --lr or check the rewards")
        if not skipped:
            version += 1  # one version per rollout batch, however many updates it took
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
            result.metrics.update(lr=lr, truncated_frac=float(truncated.float().mean()),
                                  groups_filtered=taken.groups_filtered,
                                  overlong_penalty=float((rewards - torch.tensor([g.rewards for g in taken.groups])).mean()))
            if hasattr(rollout_queue, "metrics"):  # remote.TrainerLink: the queue bound, the weights' send
                result.metrics.update(rollout_queue.metrics())
            log.step(step, version, taken, batch, result.metrics, loss=result.loss, grad_norm=grad_norm,
                     logprob_diff=result.logprob_diff, wait_s=wait_s,
                     train_s=train_s, publish_ms=publish_ms, skipped=skipped, evals=evals)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint.save_trainer_state(model, optimizer, base_model, cfg, step + 1, version, rank,
                                          groups_dropped=control.groups_dropped.value)
    else:
        step = cfg.steps  # the loop ran to the end
    finished = step >= cfg.steps and not control.interrupted.is_set()
    if world_size > 1:  # rank 0's control decides (under torchrun each rank has a control of its own)
        box = [finished]
        dist.broadcast_object_list(box, src=0)
        finished = box[0]
    if rank == 0:
        control.stop.set()  # the generator can stop now
    if finished:
        checkpoint.save_final_model(model, base_model, cfg, rank)
    else:  # a signal, or another process failed: keep what was learned
        where = checkpoint.save_trainer_state(model, optimizer, base_model, cfg, step, version, rank,
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


def check_engine(model_path, cfg, layout) -> None:
    """A model or context vLLM cannot serve here (e.g. a head size its CPU backend lacks): one line, now."""
    from rollout import engine_problems

    problems = engine_problems(model_path, layout.on_gpu, cfg.max_model_len, cfg.max_new_tokens, cfg.kv_cache_mb,
                               cfg.dtype)
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))


def allocate_shared_weights(model_path, device="cpu", dtype=torch.float32):
    """The packed buffer for the full weights, in the serving dtype (the trainer casts into it on publish)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from sync import SharedWeights, named_shapes_of

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return SharedWeights.allocate(named_shapes_of(skeleton), dtype=dtype, device=device)


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
    import devices
    from rollout import GeneratorSettings

    dtype = devices.resolve_dtype(cfg.dtype, layout if layout is not None else devices.plan("", ""))
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
        log_level=cfg.log_level, lora_dir=lora_dir, dtype=dtype, max_model_len=cfg.max_model_len,
        **(layout.generator_settings() if layout is not None else {}))


@dataclass
class Prepared:
    """What `prepare_run` found: the weights to start from and where a resume continues."""
    model_path: str  # the weights to start from (a resume: the checkpoint's model; with LoRA the base)
    base_model: str  # the model the run first started from (tokenizer, LoRA base, KL reference)
    layout: object  # devices.DeviceLayout
    gen_threads: int
    resume_dir: str = ""
    start_step: int = 0
    start_version: int = 0
    groups_dropped: int = 0


def prepare_run(cfg: Config, engine_here: bool = True) -> Prepared:
    """Before any process starts (`run`, and trainer rank 0 of `--role trainer`): resolve --dtype and the
    resume, build or find the model, check its tokenizer (and, with `engine_here`, that vLLM can serve it:
    a generator on another machine checks that itself), split the threads, write OUT/config.json."""
    import checkpoint
    import metrics

    metrics.configure_terminal(cfg.log_level)
    inactive = inactive_flags(cfg)
    if inactive:
        print(f"warning: {', '.join(inactive)} cannot act in this run: one optimizer step per batch keeps the ratio "
              "to the proximal policy at 1 (the clips act with --mini-batches > 1, --ppo-epochs > 1 or --is-mode off)",
              file=sys.stderr, flush=True)
    import devices

    cfg.dtype = devices.resolve_dtype(cfg.dtype, devices.layout_for(cfg))  # "auto" -> bf16 | fp32, before any save
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
        # The model the run first started from, carried through every resume: checkpoints rotate away.
        base_model = saved.get("base_model", "")
        if not os.path.isdir(base_model):
            raise SystemExit(f"error: the model {resume_dir} was trained from ({base_model or 'not recorded'}) is "
                             "gone: it holds the tokenizer (and the LoRA base / KL reference)")
        # The weights to start from: the checkpoint's (LoRA checkpoints hold the adapter only: the base's)
        model_path = base_model if cfg.lora_rank else os.path.join(resume_dir, "model")
    else:
        model_path = base_model = prepare_model(cfg)
    check_tokenizer(model_path)
    layout = devices.layout_for(cfg)
    if engine_here:
        check_engine(model_path, cfg, layout)
    if layout.notice:
        print(layout.notice, file=sys.stderr, flush=True)
    cfg.train_ranks = layout.world_size  # on GPUs: one rank per --train-devices GPU
    gen_threads, cfg.train_threads = split_threads(cfg)
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return Prepared(model_path, base_model, layout, gen_threads, resume_dir, start_step, start_version,
                    groups_dropped)


def run(cfg: Config) -> int:
    """Start the generator and trainer ranks, wait for them, and return the run's exit code."""
    import devices

    prepared = prepare_run(cfg)
    model_path, base_model, layout, gen_threads = (prepared.model_path, prepared.base_model, prepared.layout,
                                                   prepared.gen_threads)
    resume_dir, start_step, start_version, groups_dropped = (prepared.resume_dir, prepared.start_step,
                                                             prepared.start_version, prepared.groups_dropped)
    print(f"starting the vLLM generator and {cfg.train_ranks} FSDP2 trainer rank(s); writing to {cfg.out}/"
          + ("" if layout.on_gpu else "\n(on CPU, vLLM's start-up warnings about Triton, torch.compile and "
                                       "LD_PRELOAD are expected)"), flush=True)
    # On GPUs this process owns the packed buffer (on the first trainer GPU) and outlives every reader.
    lora_dir = ""
    if cfg.lora_rank:  # the buffer holds the adapter only; vLLM reads its rank and alpha from lora_dir
        import lora
        from sync import SharedWeights

        shapes, resolved = lora.adapter_shapes(model_path, lora.peft_config(
            cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets))
        lora_dir = lora.write_config(resolved, model_path, os.path.join(cfg.out, "adapter_config"))
        shared = SharedWeights.allocate(shapes, dtype=devices.torch_dtype(cfg.dtype), device=layout.buffer_device)
    else:
        shared = allocate_shared_weights(model_path, layout.buffer_device, devices.torch_dtype(cfg.dtype))
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
                                                     control, init_file, resume_dir, base_model), False)
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
    if cfg.role != "all":
        import remote

        return remote.run_trainer(cfg) if cfg.role == "trainer" else remote.run_generator(cfg)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
