"""config.py — the run's settings: one `Config` dataclass and its command line; the generator's
start (`GeneratorSettings`: the Config and what the parent derived for the generator process).

Role: every `Config` field is a `--flag` (underscores become dashes); the comment after a field is
its `--help` text (wrapped onto `#   ` lines, see Config) and a comment line on its own starts a
group of flags, so this class is the one source of both (CleanRL's arguments dataclass).
`build_parser` turns it into the command line. The checks are elsewhere, so that this file stays a
leaf: run/flag_checks.py's read the flags alone (`flag_checks.parse_args`: the flags as a checked
Config), run/prepare.py's load what the flags name (datasets, reward functions, --env, --tools, chat
templates, devices), and prepare.parse_args runs both (train.py's command line): one clear line
per bad value, before anything starts. A checked Config is never changed: what a run derives from
it (devices, threads, the resolved dtype) lives in `prepare.Prepared`.
May touch: nothing. Imports nothing of the project (a leaf: every module may import it).
"""

import argparse
import dataclasses
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Config:
    """Every field is a `--flag` (underscores become dashes). The comment after a field is its
    `--help` text and a comment line on its own starts a group of flags: this class is the one
    source of both. A long help text wraps onto comment lines that start `#   ` (a hash and three
    spaces) directly below its field: each continues the field's help, joined with one space; a
    group's comment starts `# ` (one space)."""

    # run
    steps: int = 300  # steps to train for: rollout batches, one
    #   model version each (a resume counts on)
    seed: int = 0  # seeds the tiny model, the prompts drawn and the sampling
    model: str = ""  # Hugging Face model directory or hub id; "" builds the tiny default
    #   model into OUT/init_model (TINY_MOE: a tiny Qwen3-MoE, 8 experts,
    #   2 routed per token, the copy tokenizer, into OUT/init_moe_model)
    out: str = "runs/latest"  # output folder: metrics.jsonl, summary.json, plots.png,
    #   trace.json, timeline.png, model/, checkpoints/
    # asynchrony
    max_lag: int = 2  # train only on samples whose oldest token is
    #   <= this many versions old (0: on-policy)
    queue_size: int = 64  # rollout groups waiting in the queue, at most
    sync_every: int = 1  # publish weights every N steps
    update_mode: str = "inflight"  # inflight: swap weights with requests
    #   kept running; drain: let them finish
    kv_on_swap: str = "recompute"  # inflight swaps: recompute (running requests re-prefilled under
    #   the new weights) | keep (they go on with the old weights' KV cache, PipelineRL style)
    max_inflight_groups: int = 0  # groups generating at once; 0 = --prompts-per-step
    stale_rule: str = "tokens"  # tokens: mask trained tokens older than --max-lag (drop a
    #   group only if none is fresh) | group: drop any group with one
    # sizes
    train_ranks: int = 1  # FSDP2 trainer ranks (processes; on GPUs one per --train-devices GPU)
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 32  # prompts (groups) per step
    max_new_tokens: int = 5  # longest completion, in tokens
    micro_batch_tokens: int = 4096  # each rank's forward/backward takes at most this many tokens at
    #   once, padding included (none with --packing; 0: all its rows)
    packing: str = "auto"  # sequence packing: a micro-batch's rows run as one row, without padding
    #   | auto: where every model keeps packed rows apart (a probe at start), else
    #   right-padded rows | on: an error where a model cannot | off: right-padded rows
    # data and reward (tasks/prompts.py; the defaults are the built-in copy task)
    task: str = "auto"  # auto (dataset with --dataset, else copy) | copy | dataset | gsm8k
    #   (a preset) | rg:NAME (reasoning-gym's dataset NAME, generated)
    dataset: str = ""  # a .jsonl/.json/.parquet file, or a Hugging Face dataset NAME[:CONFIG]
    split: str = "train"  # the split of a Hugging Face dataset
    data_dir: str = ""  # your copy of a built-in task's files: with --task gsm8k, GSM8K's (MIT,
    #   openai/grade-school-math: grade_school_math/data): trains on DIR/train.jsonl,
    #   holds out DIR/test.jsonl ("": the shipped 32-row sample, no held-out set)
    prompt_column: str = "prompt"  # text, or a list of chat messages
    #   (rendered with the chat template)
    answer_column: str = "answer"  # also passed to reward functions as `answer`
    reward: str = ""  # comma-separated module:function |
    #   path/file.py:function | math (TRL's convention)
    reward_weights: str = ""  # comma-separated, one per --reward function; "": all 1
    system_prompt: str = ""  # added as a system message (chat template) or a prefix (plain text)
    chat_template: str = ""  # a Jinja file (or a tokenizer_config.json) rendering prompts,
    #   episodes and evaluation in place of the model's own chat template
    chat_template_kwargs: str = ""  # a JSON object handed to every rendering,
    #   e.g. '{"enable_thinking": false}'
    reward_workers: int = 0  # 0: rewards run in a thread of the generator; N: a pool of N processes
    max_prompt_tokens: int = 0  # drop longer prompts before training starts
    #   (counted); 0: only the context limits them
    # multi-turn environments (tasks/envs.py): reset, then model turn / step until done or a limit
    env: str = ""  # FILE.py:NAME or module:NAME: a class (or zero-argument
    #   factory) with reset(**row) and step(action)
    max_turns: int = 4  # model turns per episode, at most (an episode cut here is truncated)
    max_episode_tokens: int = 0  # prompt + every turn and observation of an
    #   episode, at most; 0: the model's context
    env_timeout_s: float = 30.0  # a reset/step/get_reward/close slower
    #   than this ends its episode (counted)
    env_workers: int = 32  # worker threads for environments whose methods are not async
    tools: str = ""  # FILE.py:fn1,fn2 | module:fn1,fn2: functions the model
    #   may call (TRL's tools=; a tool-capable chat template)
    tool_parser: str = ""  # vLLM's tool-call parser for the model's calls (its server's
    #   --tool-call-parser names: hermes, llama3_json, qwen3_coder,
    #   mistral, ...); "": the one the chat template's format names
    reasoning_parser: str = ""  # vLLM's reasoning parser, run on each model turn of a tool episode
    #   before its tool calls are read (its server's --reasoning-parser names: qwen3, deepseek_r1,
    #   ...); "": the one the chat template's format names (Qwen3's <think> -> qwen3) | none
    # sampling (the trainer scores tokens with the same temperature/top-k/top-p)
    temperature: float = 1.0  # sampling temperature (> 0)
    top_k: int = -1  # keep the k most likely tokens; -1: off
    top_p: float = 1.0  # nucleus sampling: keep the smallest set
    #   of tokens with this much mass; 1: off
    stop: tuple = ()  # stop strings, one or more (\n, \t, \\ are
    #   unescaped): the reward sees the text before the stop
    # evaluation on held-out prompts (evaluation.py), on the generator's engine beside training
    eval_every: int = 50  # evaluate every N steps, and at step 0 and the end (0: never)
    eval_dataset: str = ""  # held-out prompts: a file or Hugging Face
    #   dataset ("": --dataset's test split, if any)
    eval_split: str = ""  # the split of the held-out set ("": test)
    eval_prompts: int = 256  # held-out prompts per evaluation, at
    #   most (the same fixed subset each time)
    eval_samples: int = 4  # sampled completions per held-out prompt (mean
    #   reward, pass@k for k <= this); 0: greedy only
    eval_pass_reward: float = 1.0  # a completion passes (pass@k, greedy
    #   pass@1) when its reward is >= this
    eval_weights: str = "inflight"  # inflight: loads go on during an evaluation | fixed: loads wait
    #   for it (one version per evaluation; eval/last_version names the versions it ran on)
    # optimisation and loss (see losses.py)
    lr: float = 3e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # clip the gradient's global norm to this
    loss: str = "grpo"  # the policy loss: grpo | dapo | dr_grpo | gspo | cispo (dr_grpo: also
    #   --adv-scale none --agg seq-mean-token-sum-norm where no flag sets them)
    adv_scale: str = "group"  # divide advantages by the reward std of
    #   the group | batch | none (Dr. GRPO)
    agg: str = "token-mean"  # how token losses are averaged over the batch (see losses.AGGS)
    eps_low: float = 0.2  # lower clip of the ratio: 1 - eps_low
    eps_high: Optional[float] = None  # upper clip of the ratio: 1 +
    #   eps_high; none: eps_low (dapo: 0.28)
    dual_clip: Optional[float] = None  # dual-clip constant c > 1 for negative advantages; none: off
    kl_coef: float = 0.0  # weight of the KL penalty to the original
    #   model (> 0 keeps a frozen reference)
    kl_kind: str = "k3"  # KL estimator: k1 | k2 | k3 (Schulman's)
    teacher: str = ""  # on-policy distillation: a Hugging Face model directory or hub
    #   id with the student's tokenizer; it scores every sampled token
    distill_coef: float = 0.0  # C > 0 (needs --teacher): each sampled token's advantage gets -C x
    #   (student - teacher log-prob), the per-token reverse KL; a dataset
    #   task may then omit --reward (rewards 0: distillation alone)
    is_level: str = "token"  # behaviour-policy importance weights per token or per sequence
    is_mode: str = "truncate"  # truncate (TIS) | mask (MIS) | off (the
    #   ratio is taken against the generator)
    is_low: Optional[float] = None  # with --is-mode mask: weights below
    #   this are masked; none: no lower bound
    is_high: float = 2.0  # importance weights above this are truncated (or masked)
    mini_batches: int = 1  # optimizer steps per rollout batch, each on 1/M of it (PPO mini-batches)
    ppo_epochs: int = 1  # passes over each rollout batch (each
    #   pass: --mini-batches optimizer steps)
    lr_schedule: str = "constant"  # after warmup: constant | linear | cosine
    #   (decay to --min-lr at the last step)
    lr_warmup_steps: int = 0  # steps of linear warmup from lr / N to --lr
    min_lr: float = 0.0  # the learning rate at the last step, with --lr-schedule linear or cosine
    # off-policy masks and baselines (losses.py; the README's table of them)
    adv_estimator: str = "grpo"  # advantages: grpo (group mean, --adv-scale) | rloo (leave-one-out
    #   mean) | reinforce_pp (REINFORCE++ as OpenRLHF's "reinforce":
    #   batch-whitened, no group baseline) | reinforce_baseline
    #   (REINFORCE++-baseline: the group mean subtracted, then batch-whitened)
    geo_mask_high: Optional[float] = None  # verl's geometric rejection: drop a sequence whose
    #   per-token geometric-mean ratio trainer/generator is above this (verl: 1.001); none: off
    geo_mask_low: Optional[float] = None  # with --geo-mask-high: ... or below
    #   this; none: 1 / --geo-mask-high
    dsv32_mask_kl: Optional[float] = None  # DeepSeek-V3.2: drop a negative-advantage sequence whose
    #   mean log(generator/trainer) is above this (delta); none: off
    icepop_high: Optional[float] = None  # IcePop: drop tokens whose ratio trainer/generator
    #   is above this (paper: 5); none: off
    icepop_low: float = 0.5  # with --icepop-high: ... or below this (paper: 0.5)
    # GRPO recipes (DAPO)
    filter_groups: bool = False  # dynamic sampling: skip groups whose rewards
    #   are all equal; the step waits for others
    overlong_filter: bool = False  # leave completions cut at --max-new-tokens out of the loss
    overlong_penalty: int = 0  # L > 0: DAPO's soft overlong penalty over
    #   the last L tokens before --max-new-tokens
    # Mixture-of-Experts routing (routes.py records the generator's, replay.py replays them in the
    # trainer)
    router_replay: bool = False  # the trainer sends each token to the experts the generator's
    #   router chose for it (recorded by vLLM), with gate weights
    #   from its own router (which keeps its gradient)
    router_record: bool = False  # record the generator's routes and log router/agreement
    #   without replaying them (--router-replay records them too)
    # machinery
    gen_threads: int = 0  # CPU threads of the generator; 0: half the cores
    train_threads: int = 0  # CPU threads per trainer rank; 0: the
    #   rest of the cores, split between ranks
    kv_cache_mb: int = 256  # vLLM's KV cache on CPU, in MiB (sized up at the start where
    #   a step needs more and memory allows; one line says so)
    dtype: str = "auto"  # bf16 | fp32 | auto (bf16 on GPUs, fp32 on CPU): trainer
    #   compute (fp32 master weights), vLLM, weight syncs
    max_model_len: int = 0  # vLLM's context, prompt + completion (longer prompts
    #   are skipped and counted); 0: the model's own
    gpu_memory_utilization: float = 0.0  # vLLM's share of each generator GPU; 0: 0.9
    #   alone, 0.3 on a GPU shared with a trainer rank
    grad_checkpointing: bool = False  # recompute each decoder layer's activations in the
    #   backward pass: less memory, ~1/3 more compute
    timeout_s: float = 300.0  # longest wait for any other process before the run fails
    gen_devices: str = ""  # generator GPUs, e.g. "0" ("" or "cpu": the CPU path); see devices.py
    train_devices: str = ""  # trainer GPUs, one FSDP2 rank each, e.g.
    #   "1,2,3"; "0" with --gen-devices 0 shares it
    # LoRA (lora.py): train an adapter on the frozen base model and sync only the adapter
    lora_rank: int = 0  # > 0: LoRA of this rank (0: full fine-tuning)
    lora_alpha: int = 16  # the adapter's scale is alpha / rank
    lora_dropout: float = 0.0  # dropout on the adapter's input: 0 (RL scores
    #   each token twice; masks would differ)
    lora_targets: str = "all-linear"  # the modules the adapter wraps: all-linear,
    #   or names such as q_proj,v_proj
    merge_at_end: bool = False  # with --lora-rank: also write OUT/model,
    #   the base model with the adapter merged in
    # checkpoints and faults
    save_every: int = 0  # write a checkpoint every N steps (0: only when
    #   interrupted); each rank writes its own shards
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    save_hf_every: int = 0  # also write OUT/model (with --lora-rank
    #   OUT/adapter) every N steps (0: at the end only)
    save_timeout_s: float = 1800.0  # longest a save may take: ranks wait this long for
    #   each other around one, and a stopping run for it
    resume: str = ""  # a checkpoint folder, or "latest" (the newest under OUT/checkpoints)
    max_bad_steps: int = 10  # steps skipped for NaN/inf loss or gradients before the run stops
    # logging
    log_every: int = 10  # print a progress line every N steps
    log_level: str = "warning"  # warning: progress lines, warnings,
    #   errors; info / debug: also vLLM's own log
    trace_steps: int = 300  # OUT/trace.json (Perfetto, chrome://tracing) and OUT/timeline.png hold
    #   the last N steps of every process's timeline (0: no trace); links to this start's
    #   own trace-START.json and timeline-START.png (a resume keeps the earlier starts')
    wandb: str = "off"  # log to Weights & Biases: online | offline | off
    wandb_project: str = "asyncgrpo"  # the wandb project
    # beyond one node (remote.py): the generator on its own machine, the trainer ranks under
    # torchrun
    role: str = "all"  # all: this machine runs both | generator: serve
    #   a remote trainer | trainer: a torchrun rank
    generator_addr: str = ""  # HOST:PORT the generator listens on and the
    #   trainer connects to (PORT + 1: weights)

    @property
    def model_token_budget(self) -> int:
        """The most model tokens one sample can hold: --max-new-tokens, or for an episode (--env,
        --tools, --task reveal: tasks/builtin.make_task's rule) --max-turns times it: DAPO's L_max
        (advantages.shaped_rewards) and Dr. GRPO's constant normaliser (--agg
        seq-mean-token-sum-norm), the same for every sample and step."""
        episodes = self.task == "reveal" or bool(self.env) or bool(self.tools)
        return self.max_new_tokens * (self.max_turns if episodes else 1)


# The values losses.py and advantages.py take (each holds its own tuple: those files copy out
# alone, importing nothing of the project; tests/test_copyable.py checks the two agree).
LOSS_CHOICES = {
    "loss": ("grpo", "dapo", "dr_grpo", "gspo", "cispo"),
    "agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "kl_kind": ("k1", "k2", "k3"),
    "is_level": ("token", "sequence"),
    "is_mode": ("truncate", "mask", "off"),
    "adv_scale": ("group", "batch", "none"),
    "adv_estimator": ("grpo", "rloo", "reinforce_pp", "reinforce_baseline"),
}
CHOICES = {
    **LOSS_CHOICES,
    "update_mode": ("inflight", "drain"),
    "kv_on_swap": ("recompute", "keep"),
    "eval_weights": ("inflight", "fixed"),
    "stale_rule": ("tokens", "group"),
    "packing": ("auto", "on", "off"),
    "dtype": ("auto", "bf16", "fp32"),
    "lr_schedule": ("constant", "linear", "cosine"),
    "log_level": ("debug", "info", "warning"),
    "wandb": ("online", "offline", "off"),
    "role": ("all", "generator", "trainer"),
}


def field_help(cls) -> dict[str, tuple[str, str]]:
    """{field: (group, help)} read from the class's source: a field's trailing comment is its help,
    continued by comment lines starting `#   ` right below it; any other comment line on its own
    names the group of the fields below it (CleanRL's arguments dataclass, without a second list to
    keep in step)."""
    # line number -> its tokens (the docstring spans lines: tokenize it whole)
    lines: dict[int, list] = {}
    for token in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if token.type not in (
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NEWLINE,
            tokenize.NL,
            tokenize.ENDMARKER,
        ):
            lines.setdefault(token.start[0], []).append(token)
    # field: the one a continuation line below `previous` extends
    group, found, field, previous = "", {}, None, None
    for number, tokens in lines.items():
        if len(tokens) == 1 and tokens[0].type == tokenize.COMMENT:
            text = tokens[0].string
            if field and number == previous + 1 and text.startswith("#   "):
                found[field] = (group, f"{found[field][1]} {text[1:].strip()}".strip())
                previous = number
                continue
            group, field = text.lstrip("# ").strip(), None
        elif len(tokens) > 2 and tokens[0].type == tokenize.NAME and tokens[1].string == ":":
            comment = (
                tokens[-1].string.lstrip("# ").strip()
                if tokens[-1].type == tokenize.COMMENT
                else ""
            )
            found[tokens[0].string] = (group, comment)
            field, previous = tokens[0].string, number
        else:
            field = None
    return found


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        # say what an empty default is, not "(default: )"
        if action.default in ("", None, ()) and action.help:
            return action.help + (' (default: "")' if action.default == "" else " (default: none)")
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--flag VALUE ...]",
        formatter_class=HelpFormatter,
        description="Asynchronous GRPO: a vLLM generator and FSDP2 trainer ranks joined by a "
        "bounded rollout queue, with weights pushed to the running generator. No flags: the "
        "built-in task on a tiny model.",
    )
    metavars = {int: "N", float: "X", str: "S"}
    docs, groups = field_help(Config), {}
    for f in dataclasses.fields(Config):
        group_name, help_text = docs[f.name]
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        group = groups[group_name]
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif f.type is tuple:  # one or more strings
            group.add_argument(flag, nargs="+", default=f.default, help=help_text, metavar="S")
        elif typing.get_origin(f.type) is typing.Union:  # Optional[float]: "none" means None
            group.add_argument(
                flag,
                type=lambda s: None if s.lower() == "none" else float(s),
                default=f.default,
                help=help_text,
                metavar="X",
            )
        else:
            group.add_argument(
                flag,
                type=f.type,
                default=f.default,
                choices=CHOICES.get(f.name),
                help=help_text,
                metavar=None if f.name in CHOICES else metavars[f.type],
            )
    return parser


def split_addr(addr: str) -> tuple[str, int]:
    """--generator-addr HOST:PORT -> (host, port)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--generator-addr {addr!r}: give HOST:PORT")
    return host, int(port)


@dataclass
class GeneratorSettings:
    """The generator's start (rollout.generator_main): the run's resolved Config (the one source of
    every setting) and what the parent derived for that process (prepare.generator_settings)."""

    cfg: Config
    model: str  # the directory vLLM serves (a resumed run: the checkpoint's model)
    initial_version: int = 0  # the version of the weights in `model`
    # a resumed run continues the sequence of group ids (and so the walk of prompts)
    first_group_id: int = 0
    # evaluate the initial weights (step 0) as the engine starts, beside the first steps
    eval_at_start: bool = False
    # with --lora-rank: holds the adapter's adapter_config.json (rank, alpha, targets)
    lora_dir: str = ""
    stop: tuple = ()  # --stop, unescaped (vLLM's SamplingParams.stop)
    # GPU placement (devices.DeviceLayout.generator_settings; the defaults are the CPU path)
    device: str = "cpu"  # "cpu" or "cuda"
    # this process's GPUs: the generator's first, then the weight buffer's
    cuda_visible_devices: str = ""
    # vLLM's share of each of its GPUs (bounded on a shared GPU)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # = number of generator GPUs
