"""trainer/heads.py — what each model family does between its final hidden state and the logits vLLM
samples from.

Role: the trainer scores tokens with its own chunked LM head (logprobs.chunked_logprobs), so it
must apply the family's transform exactly as vLLM 0.32 and transformers do: `head_transform(config)`
reads it from a Hugging Face config, `head_problem(config)` says in one line why a model's head is
not known, or why a family (or config) vLLM serves would be scored otherwise than it samples: the
Mixture-of-Experts families measured not to agree (MOE_REFUSED) and the routing or attention
settings vLLM applies otherwise (`routing_problem`, AFMoE's routing, EXAONE-MoE's window):
prepare.py refuses the run before anything starts. The math itself lives in logprobs.py, as
plain numbers.
Data contract: a `transformers.PretrainedConfig` in, a frozen `HeadTransform` out. Touches nothing.

The table below was read from vLLM 0.32 (model_executor/models/*.py: `LogitsProcessor(scale=...,
soft_cap=...)`, applied as soft-cap first, then scale) and from each family's `*ForCausalLM.forward`
in transformers 5; every family in it is checked against transformers' logits by
tests/test_heads.py. A family not in it is refused: its head may hide a transform (MiniCPM divides
the hidden state by hidden_size / dim_model_base, Falcon-H1 multiplies the logits by
lm_head_multiplier, ...) that would make the trainer train on another distribution.
"""

from trainer.logprobs import (  # noqa: F401 (the tables live with the scoring)
    PLAIN,
    PLAIN_HEADS,
    TRANSFORMED_HEADS,
    HeadTransform,
    head_of,
)

# Attributes vLLM reads on families that do not define them (LlamaForCausalLM, and so Mistral and
# Phi-3, takes `logit_scale`; its Transformers backend, used for OLMo-2, takes both), which
# transformers then ignores: a config that sets one is refused, since the two would sample from
# different distributions.
STRAY = {"logit_scale": 1.0, "final_logit_softcapping": None, "logits_scaling": 1.0}
# vLLM's Cohere (commandr.py) and Gemma-2 always use the input embedding as the LM head: an untied
# lm_head is dropped (Cohere, silently) or fails the load (Gemma-2), where transformers uses it.
TIED_ONLY = ("cohere", "cohere2", "cohere2_moe", "gemma2")


# Mixture-of-Experts families vLLM 0.32 serves on CPU whose tokens the trainer does
# not score as vLLM samples them (tiny random-init models of each,
# tests/test_moe.py): refused with the reason measured. The MoE families in the
# head tables (logprobs.py) agree after a weight publish to <= 1e-4 in fp32 (tests/test_moe.py).
MOE_REFUSED = {
    "deepseek_v2": (
        "vLLM 0.32 runs its MLA attention on CPU only at kv_lora_rank 512 + qk_rope_head_dim 64, "
        "and there its log-probs were 2.3e-3 off transformers' in fp32 (tiny model, before any "
        "sync)"
    ),
    "deepseek_v3": (
        "vLLM 0.32 runs its MLA attention on CPU only at kv_lora_rank 512 + qk_rope_head_dim 64, "
        "and there its log-probs were 0.011 off transformers' in fp32 (tiny model, before any "
        "sync); transformers 5's config also lacks the topk_method vLLM reads (without it vLLM "
        "cannot load the weights)"
    ),
    "gpt_oss": (
        "vLLM 0.32's layer-wise reload loads none of its expert weights (GptOssRoutedExperts: "
        '"Failed to load weights"): after a weight sync vLLM would sample from the old experts'
    ),
    "phimoe": (
        "vLLM 0.32 serves the architecture transformers 5 writes (PhimoeForCausalLM) through its "
        "Transformers modeling backend, and its own PhiMoEForCausalLM gave NaN log-probs on a "
        "tiny model: not checked"
    ),
    "minimax_m2": (
        "vLLM 0.32's CPU MoE router has no sigmoid top-k without expert groups, MiniMax-M2's "
        "routing (its engine fails at the first forward); transformers 5's config also lacks "
        "the rotary_dim and scoring_func vLLM reads"
    ),
    "llama4_text": (
        "transformers 5's Llama4ForCausalLM.get_decoder() returns the whole model, not its "
        "decoder: the trainer's chunked LM head cannot read the final hidden states"
    ),
}


def head_problem(config) -> str:
    """Why the trainer cannot score this model's tokens as vLLM samples them ("" when it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type in MOE_REFUSED:
        return f"model type {model_type!r}: {MOE_REFUSED[model_type]}"
    if model_type == "afmoe" and not afmoe_routes_as_transformers(config):
        return (
            "model type 'afmoe': vLLM routes by the config's score_func, route_norm, n_group and "
            "topk_group (the released checkpoints' fields), transformers 5 always by normalized "
            "sigmoid scores, ungrouped, without muP: give a config with score_func 'sigmoid', "
            "route_norm true, n_group and topk_group 1, mup_enabled false "
            f"(this one: {afmoe_routing(config)})"
        )
    routing = routing_problem(config)
    if routing:
        return routing
    if (
        model_type == "exaone_moe"
        and getattr(config, "sliding_window", None)
        and "sliding_attention" not in (getattr(config, "layer_types", None) or [])
    ):
        return (
            "model type 'exaone_moe' with a sliding_window but no sliding-attention layer: "
            "transformers then applies no RoPE in any layer and vLLM applies it in all (measured "
            "0.12 apart in log-prob)"
        )
    if model_type in TRANSFORMED_HEADS:
        transform = TRANSFORMED_HEADS[model_type][1](config)
        if transform.logit_scale <= 0 or transform.softcap < 0:
            return (
                f"model type {model_type!r}: a head transform with a non-positive scale or cap "
                f"({transform})"
            )
        if model_type.startswith("granite") and getattr(config, "logit_scale", 1.0) not in (1, 1.0):
            return (
                f"model type {model_type!r} sets logit_scale, which vLLM applies and "
                "transformers does not"
            )
        if model_type in TIED_ONLY and not getattr(config, "tie_word_embeddings", True):
            return (
                f"model type {model_type!r} with tie_word_embeddings false: vLLM serves its LM "
                "head as the input embedding, transformers as lm_head"
            )
        return ""
    if model_type not in PLAIN_HEADS:
        known = ", ".join(sorted({**PLAIN_HEADS, **TRANSFORMED_HEADS}))
        return (
            f"model type {model_type!r} (architectures {getattr(config, 'architectures', None)}): "
            f"its LM head is not one this trainer knows how to score as vLLM samples (known: "
            f"{known})"
        )
    stray = [
        f"{name}={getattr(config, name)!r}"
        for name, neutral in STRAY.items()
        if getattr(config, name, neutral) not in (neutral, None)
    ]
    if stray:
        return (
            f"model type {model_type!r} sets {', '.join(stray)}: vLLM would apply it to the logits "
            "and transformers would not"
        )
    return ""


def routing_problem(config) -> str:
    """Why vLLM 0.32 would weigh the routed experts otherwise than transformers 5 for this config
    ("" when it would not), measured on tiny models (tests/test_moe.py)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "olmoe" and getattr(config, "norm_topk_prob", False):
        return (
            "model type 'olmoe' with norm_topk_prob true: vLLM 0.32's OLMoE never renormalizes the "
            "top-k routing weights, transformers does (measured 0.013-0.025 apart in log-prob)"
        )
    if (
        model_type == "cohere2_moe"
        and getattr(config, "expert_selection_fn", "softmax") == "softmax"
        and not getattr(config, "norm_topk_prob", True)
    ):
        return (
            "model type 'cohere2_moe' with expert_selection_fn 'softmax' and norm_topk_prob false: "
            "transformers takes the softmax of the top-k logits alone, vLLM 0.32 of all of them "
            "without renormalizing (measured 9.8e-3 apart in log-prob)"
        )
    return ""


def afmoe_routing(config) -> dict:
    return {
        name: getattr(config, name, None)
        for name in ("score_func", "route_norm", "n_group", "topk_group", "mup_enabled")
    }


def afmoe_routes_as_transformers(config) -> bool:
    """An AFMoE config vLLM routes as transformers does (measured to agree; transformers 5's own
    config class lacks the fields vLLM reads, and vLLM then cannot start)."""
    routing = afmoe_routing(config)
    return (
        routing["score_func"] == "sigmoid"
        and routing["route_norm"] is True
        and routing["n_group"] in (None, 1)
        and routing["topk_group"] in (None, 1)
        and not routing["mup_enabled"]
    )


def head_transform(config) -> HeadTransform:
    """The transform of this config's head (logprobs.head_of); ValueError (head_problem's line)
    for a head the trainer would not score as vLLM samples."""
    problem = head_problem(config)
    if problem:
        raise ValueError(problem)
    return head_of(config)
