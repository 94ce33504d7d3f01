"""schedule.py — what each step's recipe sets: its learning rate and the rewards it trains on.

Role: the loop (train.py) takes each step's learning rate (`learning_rate`: warmup, then constant,
linear or cosine) and the rewards the advantages are computed from (`shaped_rewards`: the task's,
plus DAPO's overlong penalty); `model_token_budget`, the most model tokens one sample can hold, is
DAPO's L_max here and Dr. GRPO's constant normaliser in the loss (update.py's `loss_settings`).
Data contract: a `Config` and a step (or a step's groups) in; a float, or (num_groups, group_size)
tensors out.
May touch: nothing (no process, I/O or state).
"""

import math

import torch

from config import Config


# --------------------------------------------------------------------------------------------------
# The schedule: learning rate, rewards
# --------------------------------------------------------------------------------------------------
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


def shaped_rewards(groups, cfg: Config):
    """(num_groups, group_size) rewards the advantages are computed from: the task's, plus DAPO's
    soft overlong penalty with --overlong-penalty; and which samples were cut at --max-new-tokens
    (an episode: cut by --max-turns or --max-episode-tokens; its penalty counts model tokens
    against --max-turns x --max-new-tokens)."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    lengths = torch.tensor([g.model_tokens() for g in groups], dtype=torch.float32)
    truncated = torch.tensor(
        [
            [reason == "length" for reason in g.finish_reasons or ["stop"] * len(g.rewards)]
            for g in groups
        ]
    )
    if cfg.overlong_penalty:
        rewards = rewards + overlong_penalty(lengths, model_token_budget(cfg), cfg.overlong_penalty)
    return rewards, truncated


def model_token_budget(cfg: Config) -> int:
    """The most model tokens one sample can hold: --max-new-tokens, or for an episode
    (--env, --tools, --task reveal: tasks/builtin.make_task's rule) --max-turns times it: DAPO's
    L_max (`shaped_rewards`) and Dr. GRPO's constant normaliser (--agg seq-mean-token-sum-norm), the
    same for every sample and step."""
    episodes = cfg.task == "reveal" or bool(cfg.env) or bool(cfg.tools)
    return cfg.max_new_tokens * (cfg.max_turns if episodes else 1)


def overlong_penalty(lengths, max_len: int, cache: int):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each completion's reward;
    lengths any shape, L_max = max_len, L_cache = cache: 0 if |y| <= L_max - L_cache; ((L_max -
    L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max (from 0 down to -1); -1 if |y| >
    L_max."""
    if not 0 < cache <= max_len:
        raise ValueError(
            f"the overlong cache must be in (0, max_len], got {cache} (max_len {max_len})"
        )
    lengths = lengths.float()
    soft = ((max_len - cache) - lengths) / cache
    return torch.where(
        lengths <= max_len - cache,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_len, soft, -torch.ones_like(lengths)),
    )
