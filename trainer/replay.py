"""trainer/replay.py — routing replay in the trainer (--router-replay): every MoE layer sends a
token to the experts the generator sent it to, with gate weights from the trainer's own router, so
the router keeps its gradient.

Role
    `install(model, layers, config, replay)` patches the router of each Hugging Face MoE block
    (transformers 5's routers, e.g. `mlp.gate`, returning router logits, top-k weights and top-k
    experts) in place: parameter names, sharding and checkpoints are untouched. `routed_by(model,
    batch)` is the context one micro-batch's forward and backward run in: it hands the patched
    routers the batch's recorded routes. Where a token has a route, its experts are the recorded
    ones and their weights what the family's router computes for the experts it chose (`Rule`:
    softmax or sigmoid scores, over all experts or the chosen ones, renormalised and scaled where
    the family does), from the router's own logits; a token without one (padding, the last token of
    a row, a missing route) keeps the live router's choice. With replay off the patched router
    returns exactly what the original does and only counts (--router-record): the share of token x
    layer decisions where the trainer's own top-k equals the generator's (`router/agreement`), and
    the decisions that had no route to replay (`router/missing`). The frozen models (the KL
    reference, also LoRA's adapter-off policy, and a teacher) route themselves (`own_routing`:
    lora.AdapterOff runs in it). Activation checkpointing (--grad-checkpointing) recomputes a layer
    in the backward pass: the context spans the backward too (update.py), so the recompute routes
    as the forward did; a layer counts once per context.
Data contract: a batch's `routes` is (B, T, decoder layers, top_k) aligned with `input_ids`
(buffer.collate): uint8 with 255 where missing, or a wider integer type with -1 or 65535 (uint16's
all ones) there; a layer without a MoE block ignores its rows. A packed micro-batch (--packing) runs
its rows' real tokens as one row: its routes are taken at those tokens, in that order. torch only.
May touch: the routers' `forward` (an instance attribute) of the model it is given, nothing else.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

ATTRIBUTE = "router_replay"  # where install() leaves the state on the model


@dataclass(frozen=True)
class Rule:
    """How a family's router (transformers 5) weighs the experts it chose; a str names a config
    field."""

    router: str = "mlp.gate"  # the router's path in a decoder layer
    score: str = "softmax"  # softmax | sigmoid (or a config field holding one)
    # the scores of the chosen experts' logits alone (not over every expert)
    chosen_only: bool = False
    normalize: bool | str = True  # the chosen weights divided by their sum
    scale: float | str = 1.0  # then multiplied by this
    # it returns (experts, weights, logits), not (logits, weights, experts)
    experts_first: bool = False


ROUTERS = {
    "qwen3_moe": Rule(normalize="norm_topk_prob"),
    "qwen2_moe": Rule(normalize="norm_topk_prob"),
    "olmoe": Rule(normalize="norm_topk_prob"),
    "mixtral": Rule(),
    "ernie4_5_moe": Rule(),
    "glm4_moe": Rule(score="sigmoid", normalize="norm_topk_prob", scale="routed_scaling_factor"),
    "exaone_moe": Rule(score="sigmoid", normalize="norm_topk_prob", scale="routed_scaling_factor"),
    "afmoe": Rule(router="mlp.router", score="sigmoid", scale="route_scale"),
    "cohere2_moe": Rule(score="expert_selection_fn", chosen_only=True, normalize="norm_topk_prob"),
    "granitemoe": Rule(
        router="block_sparse_moe.router", chosen_only=True, normalize=False, experts_first=True
    ),
    "granitemoeshared": Rule(
        router="block_sparse_moe.router", chosen_only=True, normalize=False, experts_first=True
    ),
}


def problem(config) -> str | None:
    """Why routes cannot be replayed (or recorded and compared) in this model, in one line; None if
    they can."""
    kind = getattr(config, "model_type", "?")
    if kind in ROUTERS:
        return None
    if not any(
        hasattr(config, name)
        for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    ):
        return (
            "--router-replay/--router-record need a Mixture-of-Experts model "
            f"({kind} has no experts)"
        )
    return (
        "--router-replay/--router-record: the trainer replays routes of "
        f"{', '.join(ROUTERS)}; not of {kind}"
    )


def top_k_of(config) -> int:
    return getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_k")


class RouterReplay:
    """What the patched routers read (the micro-batch's routes, whether to replay them) and what
    they count."""

    def __init__(self, replay: bool, layers: int, top_k: int):
        self.replay, self.layers, self.top_k = replay, layers, top_k
        # (N, layers, top_k) long; (N,) bool: N = B x T as the blocks flatten a padded batch, or
        # the real tokens of a packed one (logprobs.final_hidden_states)
        self.routes = self.needed = None
        self.measure, self.counted, self.counts = False, set(), {}

    def begin(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        measure: bool,
        packed: bool = False,
    ) -> None:
        """A micro-batch's routes; `rows` (B,) bool: the rows it trains on (a filler or a fully
        masked row's routes are replayed too, never counted). packed: the model runs the rows'
        real tokens as one row, and the routes follow them."""
        b, t = attention_mask.shape
        if tuple(routes.shape) != (b, t, self.layers, self.top_k):
            raise RuntimeError(
                f"routes of shape {tuple(routes.shape)} for a batch of {b} x {t} tokens "
                f"in a model of {self.layers} layers and top-{self.top_k} routing: "
                "they do not belong to this batch"
            )
        # A position's routes matter when its output is scored: a real token with a real target.
        needed = torch.zeros_like(attention_mask, dtype=torch.bool)
        needed[:, :-1] = (
            attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool() & rows[:, None]
        )
        wide = routes.long()
        absent = (wide < 0) | (wide == (255 if routes.dtype == torch.uint8 else 65535))
        wide = torch.where(absent, -1, wide)
        if packed:
            keep = attention_mask.bool()
            self.routes, self.needed = wide[keep], needed[keep]
        else:
            self.routes = wide.reshape(b * t, self.layers, self.top_k)
            self.needed = needed.reshape(-1)
        self.measure, self.counted = measure, set()
        zero = torch.zeros((), dtype=torch.long, device=routes.device)
        self.counts = {"agree": zero, "decisions": zero, "missing": zero}

    def end(self) -> dict:
        counts, self.routes, self.needed = self.counts, None, None
        return counts

    def count(
        self, layer: int, own: torch.Tensor, recorded: torch.Tensor, present: torch.Tensor
    ) -> None:
        # A layer is counted once per measured forward: a recompute, or the same modules scored
        # again, is not counted twice.
        if not self.measure or layer in self.counted:
            return
        self.counted.add(layer)
        with torch.no_grad():
            needed = self.needed.to(present.device)
            same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)
            self.counts["agree"] = self.counts["agree"] + (same & present & needed).sum()
            self.counts["decisions"] = self.counts["decisions"] + (present & needed).sum()
            self.counts["missing"] = self.counts["missing"] + (~present & needed).sum()


def weigh(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    score: str,
    chosen_only: bool,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    """(tokens, top_k) float32 weights of the `chosen` experts, as the family's router weighs its
    own choice."""
    logits = logits.float()
    if chosen_only:
        logits = logits.gather(-1, chosen)
    weights = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    if not chosen_only:
        weights = weights.gather(-1, chosen)
    # A softmax over the chosen experts alone already sums to 1.
    if normalize and not (chosen_only and score == "softmax"):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale


def route(forward, state: RouterReplay, layer: int, rule: dict, hidden_states, *args):
    """A patched router: the original's outputs, with the recorded experts where the micro-batch has
    them (replay on) and their weights from the router's own logits (`weigh`), so the gradient
    reaches it."""
    out = forward(hidden_states, *args)
    experts_first = rule["experts_first"]
    experts, weights, logits = out if experts_first else out[::-1]
    if state.routes is None:
        return out
    recorded = state.routes[:, layer].to(experts.device)
    present = (recorded >= 0).all(-1)
    state.count(layer, experts, recorded, present)
    if not state.replay:
        return out
    chosen = torch.where(present[:, None], recorded, experts)
    replayed = weigh(
        logits, chosen, rule["score"], rule["chosen_only"], rule["normalize"], rule["scale"]
    )
    weights = torch.where(present[:, None], replayed.to(weights.dtype), weights)
    return (chosen, weights, logits) if experts_first else (logits, weights, chosen)


def install(model, layers, config, replay: bool) -> RouterReplay:
    """Patch the router of every MoE block of `layers` (the decoder layers of the Hugging Face model
    inside `model`); the state is left on `model` for `routed_by`."""
    spec = ROUTERS[config.model_type]
    rule = {
        field: getattr(config, value)
        if isinstance(value, str) and field in ("normalize", "scale")
        else value
        for field, value in vars(spec).items()
    }
    rule["score"] = (
        spec.score if spec.score in ("softmax", "sigmoid") else getattr(config, spec.score)
    )
    layers = list(layers)
    state = RouterReplay(replay, len(layers), top_k_of(config))
    patched = 0
    for index, layer in enumerate(layers):
        router = layer
        for name in spec.router.split("."):
            router = getattr(router, name, None)
        if router is None or not hasattr(router, "top_k"):  # a dense layer of a mixed model
            continue
        router.forward = functools.partial(route, router.forward, state, index, rule)
        patched += 1
    if not patched:
        raise RuntimeError(
            f"no MoE router found in the {config.model_type} model: nothing to replay"
        )
    setattr(model, ATTRIBUTE, state)
    return state


@contextlib.contextmanager
def routed_by(model, batch, measure: bool = True, packed: bool = False):
    """Run a forward (and its backward) of `batch` with its recorded routes; yields the counts
    (tensors: agree, decisions, missing; filled once the forward ran), or None where nothing is
    replayed or counted. packed: the forward runs the batch packed (update.py, packing.py)."""
    state = getattr(model, ATTRIBUTE, None)
    if state is None or getattr(batch, "routes", None) is None:
        yield None
        return
    state.begin(batch.routes, batch.attention_mask, batch.mask.any(1), measure, packed)
    counts = {}
    try:
        yield counts
    finally:
        counts.update(state.end())


@contextlib.contextmanager
def own_routing(model):
    """Run a forward in which `model`'s patched routers route themselves: the micro-batch's routes
    are set aside (nothing replayed, nothing counted) and back afterwards, for the backward's
    recompute. The --kl-coef reference of a LoRA run (lora.AdapterOff: the policy with its adapter
    off, the same patched routers) scores inside it, so that it routes itself as the separate
    reference of full fine-tuning (no patched routers) and a teacher do: one rule for both paths.
    Why themselves: the recorded routes are the generator's, chosen by the current weights;
    replayed in the reference they would make it follow the policy's routing, and the KL term
    would miss the part of the drift that is routing."""
    state = getattr(model, ATTRIBUTE, None)
    if state is None or state.routes is None:
        yield
        return
    kept = state.routes, state.needed
    state.routes = state.needed = None
    try:
        yield
    finally:
        state.routes, state.needed = kept


def add_counts(stats, counts) -> None:
    """A micro-batch's counts into the step's metrics (step_stats.StepStats), if it keeps any."""
    if counts and stats is not None:
        stats.mean("router/agreement", counts["agree"], counts["decisions"])
        stats.add("router/missing", counts["missing"])
