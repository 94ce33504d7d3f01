"""run/flag_checks.py — the checks of the run's flags that read the flags alone: one line per bad
value.

Role: `parse_args(argv)` reads the command line into a `config.Config` (`config_of`: with the
settings `--loss dr_grpo` stands for where no flag sets them) and refuses it, in one `error:` line
per problem, before anything starts (`validate`); `problems_of` says what is wrong, one flag family
after another (sizes, saving, evaluation, staleness, advantages, sampling, the update, LoRA, the
models, episodes, the remote roles); `inactive_flags` names the flags that cannot act in this run
(train.py warns). The checks that load what the flags name are prepare.check's;
prepare.parse_args runs both (train.py's command line).
Data contract: a problem is one line that names the flag, the value and the way out.
May touch: nothing (reads the paths --model and --teacher name, to check they exist).
"""

import argparse
import dataclasses
import os

from config import Config, build_parser, split_addr

# What makes --loss dr_grpo Dr. GRPO (Liu et al. 2025): its surrogate is grpo's; the advantages are
# not divided by the group's std (--adv-estimator grpo's scale) and token losses are summed over a
# constant. Given where the command line leaves them (`config_of`), refused where it sets others.
DR_GRPO = {"adv_scale": "none", "agg": "seq-mean-token-sum-norm"}


def parse_args(argv=None) -> Config:
    """The flags as a Config, checked by `validate` (train.py's command line: prepare.parse_args,
    which adds the checks that load what the flags name)."""
    cfg = config_of(argv)
    validate(cfg)
    return cfg


def config_of(argv=None) -> Config:
    """The command line as a Config, not yet checked: the flags it gives, the defaults for the
    rest, except the settings --loss dr_grpo stands for (DR_GRPO), which replace defaults only."""
    cfg = Config(**vars(build_parser().parse_args(argv)))
    if cfg.loss != "dr_grpo":
        return cfg
    given = given_flags(argv)
    settings = dr_grpo_settings(cfg)
    return dataclasses.replace(cfg, **{k: v for k, v in settings.items() if k not in given})


def given_flags(argv=None) -> set[str]:
    """The Config fields the command line sets itself (however spelt: --agg=X, an abbreviation)."""
    parser = build_parser()
    # No default reaches the namespace, so it holds only what the command line gives (the parser's
    # set_defaults would put them there all the same).
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def dr_grpo_settings(cfg: Config) -> dict:
    """DR_GRPO as it applies to this run: another --adv-estimator than grpo has its own scale."""
    return {k: v for k, v in DR_GRPO.items() if k != "adv_scale" or cfg.adv_estimator == "grpo"}


def validate(cfg: Config, more: list[str] = ()) -> None:
    """Exits with one clear line per bad value (the run has not started anything yet):
    `problems_of`'s, then `more` (prepare.check's)."""
    problems = problems_of(cfg) + list(more)
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))


def problems_of(cfg: Config) -> list[str]:
    """One line per bad value, read from the flags alone: flag family by flag family."""
    return [
        *size_problems(cfg),
        *saving_problems(cfg),
        *evaluation_problems(cfg),
        *staleness_problems(cfg),
        *advantage_problems(cfg),
        *sampling_problems(cfg),
        *update_problems(cfg),
        *lora_problems(cfg),
        *model_problems(cfg),
        *episode_problems(cfg),
        *remote_problems(cfg),
    ]


def size_problems(cfg: Config) -> list[str]:
    """The sizes of a run, a step and a sequence: one line each."""
    out = []
    for name in (
        "steps",
        "group_size",
        "prompts_per_step",
        "max_new_tokens",
        "queue_size",
        "sync_every",
        "train_ranks",
        "kv_cache_mb",
    ):
        if getattr(cfg, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.micro_batch_tokens < 0:
        out.append(
            "--micro-batch-tokens must be >= 0 "
            f"(0: each rank's whole share at once; got {cfg.micro_batch_tokens})"
        )
    if cfg.max_model_len < 0:
        out.append(f"--max-model-len must be >= 0 (got {cfg.max_model_len})")
    elif cfg.max_model_len and cfg.max_model_len <= cfg.max_new_tokens:
        out.append(
            f"--max-model-len {cfg.max_model_len} leaves no room for a prompt before "
            f"--max-new-tokens {cfg.max_new_tokens}: give more than {cfg.max_new_tokens}"
        )
    return out


def saving_problems(cfg: Config) -> list[str]:
    """Checkpoints, saved models and the steps a run may skip: one line each."""
    out = []
    if (
        cfg.save_every < 0
        or cfg.keep_checkpoints < 0
        or cfg.max_bad_steps < 0
        or cfg.save_hf_every < 0
    ):
        out.append(
            "--save-every, --keep-checkpoints, --save-hf-every and --max-bad-steps must be >= 0"
        )
    if cfg.save_timeout_s <= 0:
        out.append(f"--save-timeout-s must be > 0 (got {cfg.save_timeout_s})")
    return out


def evaluation_problems(cfg: Config) -> list[str]:
    """The held-out evaluation and the trace: one line each."""
    out = []
    if cfg.eval_every < 0 or cfg.eval_samples < 0 or cfg.max_prompt_tokens < 0:
        out.append("--eval-every, --eval-samples and --max-prompt-tokens must be >= 0")
    if cfg.trace_steps < 0:
        out.append(f"--trace-steps must be >= 0 (0: no trace; got {cfg.trace_steps})")
    if cfg.eval_prompts < 1:
        out.append(f"--eval-prompts must be >= 1 (got {cfg.eval_prompts})")
    return out


def staleness_problems(cfg: Config) -> list[str]:
    """The staleness bound against the syncs, and what a weight swap keeps: one line each."""
    out = []
    if cfg.max_lag < 0:
        out.append(f"--max-lag must be >= 0 (got {cfg.max_lag})")
    elif cfg.max_lag < cfg.sync_every - 1:
        out.append(
            f"--max-lag {cfg.max_lag} < --sync-every {cfg.sync_every} - 1: the trainer would "
            "reject every sample between syncs; raise --max-lag or lower --sync-every"
        )
    if cfg.kv_on_swap == "keep" and cfg.update_mode == "drain":
        out.append(
            "--kv-on-swap keep needs --update-mode inflight (drain lets running requests finish "
            "before a swap: no KV cache is kept across one)"
        )
    return out


def advantage_problems(cfg: Config) -> list[str]:
    """The advantages, the off-policy corrections and --loss dr_grpo: one line each."""
    out = []
    if cfg.group_size == 1 and cfg.adv_estimator == "grpo" and cfg.adv_scale != "none":
        out.append(
            "--group-size 1 gives every sample a zero group-relative advantage; use a group of "
            ">= 2 (or --adv-scale none with a baseline-free reward)"
        )
    out += off_policy_problems(cfg)
    if cfg.loss == "dr_grpo":
        out += dr_grpo_problems(cfg)
    return out


def sampling_problems(cfg: Config) -> list[str]:
    """How the generator samples: one line each."""
    out = []
    if any(s == "" for s in cfg.stop):
        out.append("--stop: an empty stop string would end every completion at once")
    if cfg.top_k < -1:
        out.append(f"--top-k must be -1 or 0 (off) or >= 1 (got {cfg.top_k})")
    if cfg.temperature <= 0:
        out.append(f"--temperature must be > 0 (got {cfg.temperature})")
    if not 0 < cfg.top_p <= 1:
        out.append(f"--top-p must be in (0, 1] (got {cfg.top_p})")
    return out


def update_problems(cfg: Config) -> list[str]:
    """The optimizer, the batch's split into updates and the overlong penalty: one line each."""
    out = []
    if cfg.lr <= 0:
        out.append(f"--lr must be > 0 (got {cfg.lr})")
    if cfg.mini_batches < 1 or cfg.ppo_epochs < 1:
        out.append(
            "--mini-batches and --ppo-epochs must be >= 1 "
            f"(got {cfg.mini_batches}, {cfg.ppo_epochs})"
        )
    elif cfg.mini_batches > cfg.prompts_per_step * cfg.group_size:
        out.append(
            f"--mini-batches {cfg.mini_batches} is more than the "
            f"{cfg.prompts_per_step * cfg.group_size} samples of a step "
            "(--prompts-per-step x --group-size)"
        )
    if cfg.lr_warmup_steps < 0 or not 0 <= cfg.min_lr <= cfg.lr:
        out.append(
            "--lr-warmup-steps must be >= 0 and --min-lr in [0, --lr] "
            f"(got {cfg.lr_warmup_steps}, {cfg.min_lr})"
        )
    if not 0 <= cfg.overlong_penalty < cfg.max_new_tokens:
        out.append(
            f"--overlong-penalty must be in [0, --max-new-tokens) (got {cfg.overlong_penalty})"
        )
    return out


def model_problems(cfg: Config) -> list[str]:
    """--model, and distillation from --teacher: one line each. (The teacher's tokenizer is checked
    where it is loaded: prepare.check_teacher.)"""
    out = model_path_problems("--model", cfg.model)
    if cfg.distill_coef < 0 or (cfg.distill_coef > 0) != bool(cfg.teacher):
        out.append(
            f"--distill-coef {cfg.distill_coef} and --teacher {cfg.teacher!r}: distillation needs "
            "both, a teacher and a coefficient > 0 (neither: off)"
        )
    return out + model_path_problems("--teacher", cfg.teacher)


def episode_problems(cfg: Config) -> list[str]:
    """Multi-turn episodes and the parsers of tool calls: one line each. (Whether the parsers
    named exist is prepare's to check: it imports vLLM.)"""
    out = []
    if (
        cfg.max_turns < 1
        or cfg.max_episode_tokens < 0
        or cfg.env_workers < 1
        or not cfg.env_timeout_s > 0
    ):
        out.append(
            "--max-turns and --env-workers must be >= 1, --max-episode-tokens >= 0 and "
            f"--env-timeout-s > 0 (got {cfg.max_turns}, {cfg.env_workers}, "
            f"{cfg.max_episode_tokens}, {cfg.env_timeout_s})"
        )
    if cfg.tool_parser and not (cfg.tools or cfg.env):
        out.append(
            f"--tool-parser {cfg.tool_parser} reads tool calls: "
            "it needs --tools or an --env with tools"
        )
    if cfg.reasoning_parser and not (cfg.tools or cfg.env):
        out.append(
            f"--reasoning-parser {cfg.reasoning_parser} separates reasoning before tool calls are "
            "read: it needs --tools or an --env with tools"
        )
    return out


def dr_grpo_problems(cfg: Config) -> list[str]:
    """--loss dr_grpo with other settings than DR_GRPO's, set on the command line: that run would be
    grpo (or a mix) under Dr. GRPO's name."""
    settings = dr_grpo_settings(cfg)
    flag = {k: f"--{k.replace('_', '-')}" for k in settings}
    other = [f"{flag[k]} {getattr(cfg, k)}" for k, v in settings.items() if getattr(cfg, k) != v]
    if not other:
        return []
    wanted = " ".join(f"{flag[k]} {v}" for k, v in settings.items())
    return [
        f"--loss dr_grpo with {' '.join(other)} is not Dr. GRPO (its loss is grpo's; {wanted} "
        f"make it Dr. GRPO, and --loss dr_grpo sets them where no flag does): drop "
        f"{' and '.join(other)}, or use --loss grpo with them"
    ]


def lora_problems(cfg: Config) -> list[str]:
    """--lora-*, --merge-at-end: one line each."""
    out = []
    if not 0 <= cfg.lora_rank <= 512:
        out.append(f"--lora-rank must be in 0..512 (got {cfg.lora_rank})")
    if cfg.lora_rank and cfg.lora_alpha <= 0:
        out.append(f"--lora-alpha must be > 0 (got {cfg.lora_alpha})")
    if cfg.lora_dropout != 0:
        out.append(
            f"--lora-dropout {cfg.lora_dropout}: RL fine-tuning runs without dropout (each scoring "
            "pass draws its own masks, so ratios, importance weights and clips measure the masks, "
            "not the policy); use 0"
        )
    if cfg.lora_rank and "lm_head" in cfg.lora_targets.replace(" ", "").split(","):
        out.append(
            "--lora-targets lm_head: the LM head cannot take an adapter here (the trainer applies "
            "its weight directly, a chunk of tokens at a time); adapt the other layers"
        )
    if cfg.lora_rank and not cfg.lora_targets.strip(" ,"):
        out.append("--lora-targets is empty: give all-linear or module names such as q_proj,v_proj")
    if cfg.merge_at_end and not cfg.lora_rank:
        out.append("--merge-at-end merges a LoRA adapter: it needs --lora-rank")
    return out


def off_policy_problems(cfg: Config) -> list[str]:
    """--adv-estimator and the off-policy masks: one line each."""
    out = []
    if cfg.adv_estimator != "grpo" and cfg.adv_scale != "group":
        out.append(
            f"--adv-scale {cfg.adv_scale} applies to --adv-estimator grpo only "
            f"({cfg.adv_estimator} has its own baseline and scale)"
        )
    baselines = {"rloo": "leave-one-out baseline", "reinforce_baseline": "group-mean baseline"}
    if cfg.adv_estimator in baselines and cfg.group_size < 2:
        out.append(
            f"--adv-estimator {cfg.adv_estimator}'s {baselines[cfg.adv_estimator]} "
            "needs --group-size >= 2"
        )
    if cfg.geo_mask_low is not None and cfg.geo_mask_high is None:
        out.append("--geo-mask-low needs --geo-mask-high (the geometric mask is off without it)")
    for name, low, high in (
        ("geo-mask", cfg.geo_mask_low, cfg.geo_mask_high),
        ("icepop", cfg.icepop_low, cfg.icepop_high),
    ):
        if high is not None and not (high >= 1 and 0 < (1 / high if low is None else low) <= 1):
            out.append(
                f"--{name}-low and --{name}-high must bound the ratio 1: 0 < low <= 1 <= high "
                f"(got {low}, {high})"
            )
    if cfg.dsv32_mask_kl is not None and not cfg.dsv32_mask_kl >= 0:
        out.append(f"--dsv32-mask-kl must be >= 0, a KL threshold (got {cfg.dsv32_mask_kl})")
    return out


def model_path_problems(flag: str, path: str) -> list[str]:
    """A --model/--teacher that names a file, or a local path that does not exist (else: a hub
    id)."""
    if path and not os.path.isdir(path) and os.path.exists(path):
        return [f"{flag} {path} is a file; give a Hugging Face model directory"]
    if path and not os.path.exists(path) and path.startswith((".", "/", "~")):
        return [f"{flag} {path}: no such directory"]
    return []


def remote_problems(cfg: Config) -> list[str]:
    """What a remote role (remote.py) cannot do, one line each."""
    if cfg.role == "all":
        return []
    out = []
    try:
        split_addr(cfg.generator_addr)
    except ValueError as err:
        out.append(f"--role {cfg.role} needs {err}")
    if cfg.lora_rank:
        out.append(
            "--lora-rank with a remote role is not supported yet (the adapter config lives on the "
            "trainer's disk)"
        )
    if cfg.queue_size < 2:
        out.append(
            f"--queue-size {cfg.queue_size} with a remote role: give >= 2 (1 group waits on the "
            "generator node, the rest are the trainer's credits)"
        )
    return out


def inactive_flags(cfg: Config) -> list[str]:
    """Flags that cannot change this run's gradient: one optimizer step per rollout batch
    (--mini-batches 1 --ppo-epochs 1) makes the ratio to the proximal policy exactly 1, so with an
    importance correction the ratio clips never act."""
    # With --is-mode off the ratio is taken against the generator, and with more than one update
    # per batch it moves: either way the clips act.
    if cfg.is_mode == "off" or cfg.mini_batches * cfg.ppo_epochs > 1:
        return []
    set_by_user = [
        f"--{name.replace('_', '-')}"
        for name in ("eps_low", "eps_high", "dual_clip")
        if getattr(cfg, name) != getattr(Config, name)
    ]
    if cfg.loss in ("dapo", "gspo", "cispo"):
        set_by_user.insert(0, f"--loss {cfg.loss}")
    return set_by_user
