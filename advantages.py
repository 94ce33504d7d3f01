"""advantages.py — a batch's advantages from its rewards: the baselines of --adv-estimator (torch
only).

Role: train.py turns each step's shaped rewards into advantages with `estimate_advantages` (grpo's
`group_advantages`, rloo, reinforce_pp, reinforce_baseline); losses.py takes them from there (per
token with a teacher: losses.distill_advantages). Functions on tensors: no optimizer, process, I/O
or state. Data contract: rewards (num_groups, G) float; scored (num_groups, G) bool, False on a
sample no reward function scored (buffer.scored_mask); advantages (num_groups, G) float32, 0 on
every unscored sample. May touch: nothing beyond the tensors it is given.
"""

import torch

SCALES = ("group", "batch", "none")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_baseline")


def _scored_stats(x, scored, groupwise):
    """Mean and unbiased std of x (num_groups, G) over its `scored` entries, per group (groupwise)
    or over the batch, shaped to broadcast; where none is scored the mean is 0, where fewer than two
    are the std is 0."""
    dims = -1 if groupwise else (0, 1)
    n = scored.sum(dims, keepdim=True)
    mean = torch.where(scored, x, 0.0).sum(dims, keepdim=True) / n.clamp(min=1)
    var = torch.where(scored, (x - mean).square(), 0.0).sum(dims, keepdim=True) / (n - 1).clamp(
        min=1
    )
    return mean, torch.where(n > 1, var.sqrt(), 0.0)


def group_advantages(rewards, scale="group", eps=1e-6, scored=None):
    """Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath): A_ij = (R_ij - mean_j
    R_ij) / (std + eps) with std the unbiased std of the group (scale="group"), of the whole batch
    ("batch"), or no division ("none": Dr. GRPO, Liu et al. 2025: the std biases towards too-easy /
    too-hard questions). rewards (num_groups, group_size) -> the same shape; a group of size 1 has
    advantage 0 (std 0, never NaN). scored: see `estimate_advantages`."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {SCALES}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be (num_groups, group_size), got shape {tuple(rewards.shape)}"
        )
    rewards = rewards.float()
    scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored.bool()
    mean, std = _scored_stats(rewards, scored, groupwise=True)
    centered = torch.where(scored, rewards - mean, 0.0)
    if scale == "none":
        return centered
    if scale == "batch":
        std = _scored_stats(rewards, scored, groupwise=False)[1]
    return centered / (std + eps)


def estimate_advantages(rewards, estimator="grpo", scale="group", eps=1e-6, scored=None):
    """Advantages (num_groups, G) of rewards (num_groups, G) by the baseline `estimator`
    (ADV_ESTIMATORS):
      grpo          `group_advantages(rewards, scale)`
      rloo          leave-one-out mean (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):
                    A_ij = R_ij - (1/(G-1)) sum_{k != j} R_ik = G/(G-1) (R_ij - mean_j R_ij);
                    G = 1: 0
      reinforce_pp  REINFORCE++ (Hu 2025, arXiv 2501.03262) as OpenRLHF's "reinforce" estimator
                    computes it: batch whitening only, no per-prompt baseline, A = (R - mean(R)) /
                    (std(R) + eps) over the batch
      reinforce_baseline  REINFORCE++-baseline (the same paper; OpenRLHF's "reinforce_baseline", in
                    openrlhf/trainer/ppo_utils/experience_maker.py,
                    `compute_advantages_and_returns`): the group mean first, R'_ij = R_ij - mean_j
                    R_ij, then R' whitened over the batch as reinforce_pp does
    Batch whitening here takes the unbiased std over samples (OpenRLHF whitens over tokens, a sample
    once per token, with the biased variance); one sample: 0. `scale` is grpo's only:
    flag_checks refuses another. scored: (num_groups, G) bool, False on a sample no reward
    function scored (default: all scored): its advantage is 0 under every estimator, and it is left
    out of every statistic (group means and stds, leave-one-out means, batch whitening), as if it
    had not been sampled."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; expected one of {ADV_ESTIMATORS}"
        )
    if estimator == "grpo":
        return group_advantages(rewards, scale, eps, scored)
    rewards = rewards.float()
    scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored.bool()
    if estimator == "rloo":
        n = scored.sum(-1, keepdim=True)
        others_mean = (torch.where(scored, rewards, 0.0).sum(-1, keepdim=True) - rewards) / (
            n - 1
        ).clamp(min=1)
        return torch.where(scored & (n > 1), rewards - others_mean, 0.0)
    if estimator == "reinforce_baseline":
        rewards = torch.where(
            scored, rewards - _scored_stats(rewards, scored, groupwise=True)[0], 0.0
        )
    mean, std = _scored_stats(rewards, scored, groupwise=False)
    return torch.where(scored, (rewards - mean) / (std + eps), 0.0)


# --------------------------------------------------------------------------------------------------
# The rewards the advantages are computed from: the task's, and DAPO's overlong penalty
# --------------------------------------------------------------------------------------------------
def shaped_rewards(groups, max_len: int, overlong_cache: int = 0):
    """(num_groups, group_size) rewards the advantages are computed from: the task's, plus DAPO's
    soft overlong penalty with --overlong-penalty (`overlong_cache`; 0: off), L_max = `max_len`
    (config.Config.model_token_budget); and which samples were cut at --max-new-tokens
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
    if overlong_cache:
        rewards = rewards + overlong_penalty(lengths, max_len, overlong_cache)
    return rewards, truncated


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
