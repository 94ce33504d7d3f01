"""bench/kv_swap.py — the log-prob mismatch an in-flight weight swap leaves, by `--kv-on-swap` (used
by generator.py).

Role: for bench/generator.py's long workload, weights that differ per version and the scoring of
what was sampled under them. Version v's weights are the start weights plus a deterministic offset
seeded by v (`version_weights`; version 0 is the start model), so the stand-in trainer publishes
them (`PerturbingPublisher`) and the scoring rebuilds any version. `mismatch` scores every sampled
token with the trainer's own scorer (`update.completion_logprobs`, fp32 HF model) under the whole
context and the weights of the token's version tag, against the behaviour log-prob vLLM recorded.
Tokens sampled after a swap inside their request show what the swap did (recompute: re-prefilled,
numerical noise; keep: the old weights' KV cache under the new weights); tokens of requests no swap
reached are the control. Data contract: reads `buffer.RolloutGroup`s; returns plain dicts of floats.
May touch: nothing else.
"""

from __future__ import annotations


def start_weights(model_path: str) -> dict:
    """The model's parameters by name, fp32 (what the stand-in trainer publishes, and version 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def version_weights(weights: dict, version: int, delta: float) -> dict:
    """The start `weights` plus N(0, delta^2) per element, drawn from a generator seeded by
    `version`."""
    import torch

    if version == 0:
        return weights
    g = torch.Generator().manual_seed(1_000_003 * version)
    return {
        name: w + delta * torch.randn(w.shape, generator=g, dtype=w.dtype)
        for name, w in weights.items()
    }


class PerturbingPublisher:
    """Stands in for `sync.SharedWeights` where the stand-in trainer publishes: version v goes out
    as `version_weights(weights, v, delta)`, so each swap changes the weights."""

    def __init__(self, shared, delta: float):
        self.shared, self.delta = shared, delta

    def publish(self, weights: dict, version: int) -> None:
        self.shared.publish(version_weights(weights, version, self.delta), version)


def summary(diffs) -> dict:
    return {
        "tokens": len(diffs),
        "mean": sum(diffs) / len(diffs) if diffs else None,
        "max": max(diffs) if diffs else None,
    }


def mismatch(model_path: str, groups: list, delta: float, cfg, rows_per_batch: int = 256) -> dict:
    """|behaviour - trainer log-prob| per token, split into: after a swap inside its request, before
    it (the same requests' first-version tokens), and requests no swap reached."""
    import torch
    from transformers import AutoModelForCausalLM

    import buffer
    import update

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    start = start_weights(model_path)
    rows = [(g, j) for g in groups for j in range(len(g.completion_ids)) if g.completion_ids[j]]
    diffs = {"after_swap": [], "before_swap": [], "unswapped": []}
    for version in sorted({v for g, j in rows for v in g.token_versions[j]}):
        model.load_state_dict(version_weights(start, version, delta), strict=False)
        mine = [(g, j) for g, j in rows if version in g.token_versions[j]]
        for k in range(0, len(mine), rows_per_batch):
            part = mine[k : k + rows_per_batch]
            batch = buffer.collate(
                [
                    buffer.Sample(
                        g.prompt_ids,
                        g.completion_ids[j],
                        g.behaviour_logprobs[j],
                        g.token_versions[j],
                        0.0,
                        0.0,
                    )
                    for g, j in part
                ],
                pad_id=0,
            )
            with torch.no_grad():
                logp = update.completion_logprobs(
                    model, batch, cfg.temperature, cfg.top_k, cfg.top_p
                ).logp
            diff = (logp - batch.behaviour_logp).abs()
            for i, (g, j) in enumerate(part):
                tags = g.token_versions[j]
                at = batch.mask[i] & (batch.token_versions[i] == version)
                kind = (
                    "unswapped"
                    if len(set(tags)) == 1
                    else "before_swap"
                    if version == tags[0]
                    else "after_swap"
                )
                diffs[kind] += diff[i][at].tolist()
    return {kind: summary(d) for kind, d in diffs.items()}


def merge(parts: list[dict]) -> dict:
    """Rounds' `mismatch` results as one: token-weighted means, the largest max."""
    out = {}
    for kind in parts[0]:
        got = [p[kind] for p in parts if p[kind]["tokens"]]
        tokens = sum(p["tokens"] for p in got)
        out[kind] = {
            "tokens": tokens,
            "mean": sum(p["mean"] * p["tokens"] for p in got) / tokens if tokens else None,
            "max": max((p["max"] for p in got), default=None),
        }
    return out
