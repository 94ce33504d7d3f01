"""The trainer scores tokens with the model family's own distribution (heads.py,
update.completion_logprobs).

- For a tiny random model of every family in heads.py's table, `completion_logprobs` (log-probs,
  untruncated log-probs, entropy) equals `log_softmax(model(...).logits.float() / T)` at the
  targets, with and without top-k/top-p; the transforms are sharp (Granite logits_scaling 0.25, soft
  cap 2.0, Cohere logit_scale 4.0, a head whose raw logits spread over ~+-10), and without them the
  same comparison fails.
- Gradients through the chunked head equal autograd's through the model's logits, once per
  transform.
- On bf16 hidden states and weight, the head's cap and scale are vLLM's LogitsProcessor's to the bit
  (bf16, then float32). The chunked head's own forward and backward, transform by transform, in
  float32 and bf16: tests/test_token_logprobs.py.
- A head the code does not know (or a stray transform attribute) is refused in one line before
  anything starts.
- Every transformed family vLLM's CPU engine serves, on a real engine (one child process, an engine
  each): after a weight sync through the trainer's publish and the worker's load, the trainer's
  log-probs of what vLLM sampled equal vLLM's, and differ from the weights before the sync.
"""

import os
import time

import pytest
import torch
import transformers
from spawned import end_in_process_engine, result_of_child, served_llm

import buffer
import update
from trainer import heads, logprobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 300
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> config values; the transformed ones
# sharp enough that leaving the transform out shows
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "olmo2": {},
    "gemma": {},
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32, **MOE),
    "qwen3_moe": dict(num_experts=4, **MOE),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "granite": dict(logits_scaling=0.25),
    "granitemoe": dict(logits_scaling=0.25, num_local_experts=4, num_experts_per_tok=2),
    # vLLM: tied only (heads.TIED_ONLY)
    "gemma2": dict(final_logit_softcapping=2.0, tie_word_embeddings=True),
    "gemma3_text": dict(final_logit_softcapping=2.0),
    "cohere": dict(logit_scale=4.0, tie_word_embeddings=True),
    "cohere2": dict(logit_scale=4.0, tie_word_embeddings=True),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, first_k_dense_replace=0, **MOE),
    "exaone_moe": dict(
        num_experts=4,
        layer_types=["sliding_attention"],
        sliding_window=4,
        mlp_layer_types=["sparse"],
        **MOE,
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0
    ),
    "afmoe": dict(
        num_experts=4,
        num_dense_layers=0,
        layer_types=["full_attention"],
        score_func="sigmoid",
        route_norm=True,
        n_group=1,
        topk_group=1,
        **MOE,
    ),
    "granitemoeshared": dict(
        logits_scaling=0.25, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32
    ),
    "cohere2_moe": dict(
        logit_scale=4.0,
        tie_word_embeddings=True,
        num_experts=4,
        layer_types=["full_attention"],
        mlp_layer_types=["sparse"],
        num_experts_per_tok=2,
    ),
}
HEAD_GAIN = 40.0  # the random head's logits (std ~0.16) times this: a softcap at 2.0 bites
SAMPLINGS = {"plain": (1.0, -1, 1.0), "T, top-k, top-p": (0.7, 40, 0.9)}


def tiny_model(model_type, vocab=VOCAB, seed=0, gain=HEAD_GAIN):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, **{**SHAPE, **FAMILIES[model_type]}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(gain)
    return model


def tiny_batch(model, vocab=VOCAB, seed=0):
    """Prompts and completions of different lengths, right-padded: greedy completions (inside every
    top-k/top-p set), a random one (mostly outside: -inf) and an empty one."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_len, completion_len, greedy in [
        (3, 6, True),
        (5, 3, False),
        (2, 0, True),
        (4, 5, True),
    ]:
        ids = torch.randint(3, vocab, (prompt_len + completion_len,), generator=g)
        for i in range(prompt_len, prompt_len + completion_len) if greedy else ():
            with torch.no_grad():
                ids[i] = model(input_ids=ids[None, :i]).logits[0, -1].argmax()
        ids = ids.tolist()
        samples.append(
            buffer.Sample(
                ids[:prompt_len],
                ids[prompt_len:],
                [0.0] * completion_len,
                [0] * completion_len,
                0.0,
                1.0,
            )
        )
    return buffer.collate(samples, pad_id=0)


def expected_scores(model, batch, temperature, top_k, top_p):
    """From the model's own logits (B, L-1, V): what the trainer must give, by the generator's
    rules."""
    logits = (
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    )
    sampled = logprobs.sampling_logits(logits, temperature, top_k, top_p)
    logp = torch.log_softmax(sampled, -1).gather(-1, batch.targets[..., None]).squeeze(-1)
    untruncated = (
        torch.log_softmax(logits / temperature, -1).gather(-1, batch.targets[..., None]).squeeze(-1)
    )
    entropy = logprobs.entropy_from_logits(sampled.detach())
    zero = torch.zeros_like(logp)
    return [torch.where(batch.mask, t, zero) for t in (logp, untruncated, entropy)]


def largest_difference(model, batch, sampling):
    with torch.no_grad():
        got = update.completion_logprobs(model, batch, *sampling, untruncated=True)
        want = expected_scores(model, batch, *sampling)
    m = batch.mask
    assert torch.isfinite(got.logp[m]).sum() >= 10  # the greedy rows' tokens, at least
    # equal where both are -inf (a token outside the top-k/top-p set)
    return max(
        float(torch.where(a[m] == b[m], 0.0, a[m] - b[m]).abs().max())
        for a, b in zip((got.logp, got.logp_untruncated, got.entropy), want)
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_scores_equal_the_models_own_distribution(model_type, monkeypatch):
    model = tiny_model(model_type)
    batch = tiny_batch(model)
    transform = heads.head_transform(model.config)
    assert (transform != heads.PLAIN) == (model_type in heads.TRANSFORMED_HEADS)
    for name, sampling in SAMPLINGS.items():
        assert largest_difference(model, batch, sampling) < 1e-4, name
    if transform != heads.PLAIN:  # the transform is what makes them equal
        monkeypatch.setattr(update, "head_of", lambda config: heads.PLAIN)  # what the update reads
        assert largest_difference(model, batch, SAMPLINGS["plain"]) > 0.1


@pytest.mark.parametrize(
    "model_type,sampling",
    [
        ("llama", "T, top-k, top-p"),
        ("granite", "plain"),
        ("gemma2", "T, top-k, top-p"),
        ("cohere", "plain"),
    ],
)
def test_gradients_through_the_head_equal_autograd_through_the_logits(model_type, sampling):
    model = tiny_model(model_type)
    batch = tiny_batch(model)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logp = update.completion_logprobs(model, batch, *SAMPLINGS[sampling]).logp
    got = gradients((torch.where(batch.mask & torch.isfinite(logp), logp, 0.0) * weights).sum())
    reference, _, _ = expected_scores(model, batch, *SAMPLINGS[sampling])
    want = gradients((torch.where(torch.isfinite(reference), reference, 0.0) * weights).sum())
    head = next(n for n, p in model.named_parameters() if p is model.get_output_embeddings().weight)
    # lm_head.weight, or the embedding it is tied to
    assert got.keys() == want.keys() and head in got
    # float32 rounding, relative to the largest entry (the sharp head's gradients are large)
    for name in want:
        scale = float(want[name].abs().max())
        assert float((got[name] - want[name]).abs().max()) <= 2e-5 * scale + 1e-7, name


def vllm_head(logits, softcap, logit_scale):
    """vLLM 0.32's own LogitsProcessor.forward on the head's matmul outputs (logits_as_input: its
    soft cap, then its scale, in the dtype it is handed), then float32 as its sampler takes them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    with set_current_vllm_config(VllmConfig()):
        processor = LogitsProcessor(
            logits.shape[-1], scale=logit_scale, logits_as_input=True, soft_cap=softcap or None
        )
    return processor(None, logits.clone()).float()


@pytest.mark.parametrize(
    "head", [dict(softcap=30.0), dict(softcap=2.0, logit_scale=4.0), dict(logit_scale=0.3)]
)
def test_a_bf16_head_is_capped_and_scaled_as_vllm_does(head):
    """On the same bf16 hidden states and weight (Gemma-2's final soft cap 30; a cap with a scale; a
    scale), the trainer's logits are vLLM's to the bit and its log-probs of sampled tokens equal
    vLLM's (capping in float32 after the bf16 matmul was off by 0.043 nats on average, 0.19 at most,
    with the cap of 30). In float32 the arithmetic is vLLM's too."""
    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 64, generator=g).bfloat16()
    # matmul outputs of std 16: a cap of 30 bites
    weight = (2.0 * torch.randn(1000, 64, generator=g)).bfloat16()
    # (the order of heads.HeadTransform)
    full = {**dict(hidden_scale=1.0, logit_scale=1.0, softcap=0.0), **head}
    z = torch.nn.functional.linear(hidden, weight)
    want_logits = vllm_head(z, full["softcap"], full["logit_scale"])
    got_logits = logprobs._head_logits(hidden, weight, None, tuple(full.values()))
    assert torch.equal(got_logits, want_logits)
    tokens = torch.multinomial(torch.softmax(want_logits / 0.8, -1), 1, generator=g).squeeze(-1)
    want = torch.log_softmax(want_logits / 0.8, -1).gather(-1, tokens[:, None]).squeeze(-1)
    got, _ = logprobs.chunked_logprobs(
        hidden, weight, None, tokens, 0.8, **full, chunk_elements=20_000
    )
    assert float((got - want).abs().max()) < 1e-5
    h32, w32 = hidden.float(), weight.float()  # float32: the same float32 operations as vLLM
    assert torch.equal(
        logprobs._head_logits(h32, w32, None, tuple(full.values())),
        vllm_head(torch.nn.functional.linear(h32, w32), full["softcap"], full["logit_scale"]),
    )


def test_a_head_the_code_does_not_know_is_refused_in_one_line(tmp_path):
    import train
    from tasks import builtin

    assert "not one this trainer knows" in heads.head_problem(
        transformers.AutoConfig.for_model("stablelm")
    )
    # vLLM's Llama scales, HF's does not
    llama = transformers.AutoConfig.for_model("llama", logit_scale=2.0)
    assert "logit_scale=2.0" in heads.head_problem(llama)
    # vLLM would drop its lm_head
    untied = transformers.AutoConfig.for_model("cohere", tie_word_embeddings=False)
    assert "tie_word_embeddings false" in heads.head_problem(untied)
    with pytest.raises(ValueError, match="not one this trainer knows"):
        heads.head_transform(transformers.AutoConfig.for_model("falcon_h1"))
    # its tokenizer, then an unknown family's config
    model = builtin.build_tiny_model(str(tmp_path / "stablelm"))
    transformers.AutoConfig.for_model(
        "stablelm", vocab_size=26, **{k: v for k, v in SHAPE.items() if k != "head_dim"}
    ).save_pretrained(model)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main(["--model", model, "--out", str(out), "--steps", "1"])
    message = str(err.value)
    assert message.startswith("error: ") and "'stablelm'" in message and "\n" not in message
    assert not out.exists() or not (out / "config.json").exists()


# --------------------------------------------------------------------------------------------------
# vLLM samples, the trainer scores, after a weight sync
# --------------------------------------------------------------------------------------------------
# One child process serves every transformed family in turn, each on its own vLLM engine inside that
# process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no EngineCore or worker process to start, ~3 s an
# engine after the first import instead of ~40 s a `train.py` run): the project's engine options and
# worker extension, new weights through the trainer's publish (`sync.publish_model`) and the
# worker's load, the trainer's scorer on what vLLM sampled. Granite also runs through train.py in
# test_distill.py's run (its student).
ENGINE_FAMILIES = ("granite", "gemma2", "gemma3_text", "cohere")
# sharp, yet sampling stays random (entropy > 0.3 at a
# 26-token vocabulary): log-probs of ~0 agree trivially
RUN_HEAD_GAIN = {"granite": 4.0, "gemma2": 10.0, "gemma3_text": 10.0, "cohere": 1.0}
ENGINE_TIMEOUT_S = 600


def serve_sync_and_score(models: dict) -> dict:
    """In a child: for each family, a vLLM engine on its model; the trainer's HF model moved off the
    served weights, published into the shared buffer and loaded by the worker; 8 prompts x 4 samples
    of 5 tokens; per family the largest |vLLM - trainer| log-prob under the new weights, the
    smallest under the old ones (the sync took), and the sampled tokens' mean entropy."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: a quick start
    from vllm import SamplingParams

    import sync
    from run import prepare

    out = {}
    for family, path in models.items():
        start = time.perf_counter()
        llm = served_llm(path, enable_prefix_caching=True)
        shared = prepare.allocate_shared_weights(path)
        llm.collective_rpc("attach_shared_weights", args=(shared.to_bytes(),))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        old = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # about a few AdamW steps' worth of change, on every weight
            for p in model.parameters():
                p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
        sync.publish_model(model, shared, 1, 0, 1)
        loaded = llm.collective_rpc("load_shared_weights", args=(1,))[0]
        llm.reset_prefix_cache()
        prompts = [torch.randint(3, 26, (4,), generator=g).tolist() for _ in range(8)]
        params = SamplingParams(n=4, max_tokens=5, temperature=1.0, logprobs=0, seed=0)
        samples = []
        for prompt, request in zip(
            prompts,
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
        ):
            for c in request.outputs:
                lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                samples.append(
                    buffer.Sample(prompt, list(c.token_ids), lps, [1] * len(lps), 0.0, 1.0)
                )
        batch = buffer.collate(samples, pad_id=0)
        with torch.no_grad():
            new = update.completion_logprobs(model, batch, 1.0)
            for p, w in zip(model.parameters(), old):
                p.copy_(w)
            before = update.completion_logprobs(model, batch, 1.0)
        m = batch.mask
        out[family] = {
            "loaded": loaded,
            "tokens": int(m.sum()),
            "diff": float((new.logp[m] - batch.behaviour_logp[m]).abs().max()),
            "diff_old_median": float((before.logp[m] - batch.behaviour_logp[m]).abs().median()),
            "entropy": float(new.entropy[m].mean()),
            "seconds": time.perf_counter() - start,
        }
        del llm
        end_in_process_engine()
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """serve_sync_and_score over ENGINE_FAMILIES, in one spawned child: {family: figures}."""
    from tasks import builtin

    models = {}
    for family in ENGINE_FAMILIES:
        # the copy task's tokenizer
        path = builtin.build_tiny_model(str(tmp_path_factory.mktemp(family) / "model"))
        tiny_model(family, vocab=26, gain=RUN_HEAD_GAIN[family]).save_pretrained(path)
        models[family] = path
    return result_of_child(serve_sync_and_score, (models,), ENGINE_TIMEOUT_S)


@pytest.mark.parametrize("model_type", ENGINE_FAMILIES)
def test_trainer_and_vllm_agree_after_a_sync(model_type, served):
    got = served[model_type]
    assert got["loaded"] == 1 and got["tokens"] >= 60, got
    assert got["entropy"] > 0.3, got  # sampling is random: log-probs of ~0 would agree trivially
    # vLLM serves the new weights, not the ones it started with
    assert got["diff_old_median"] > 1e-3, got
    print(
        f"{model_type}: on-policy |trainer - vLLM| log-prob after a sync {got['diff']:.2e} (before "
        f"it: median {got['diff_old_median']:.2e}; {got['seconds']:.1f} s)"
    )
    assert got["diff"] < 1e-3, got
