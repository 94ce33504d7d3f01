"""Mixture-of-Experts models end to end: vLLM samples from the weights the trainer publishes, the
trainer scores what it sampled exactly, and a family it cannot score is refused before anything
starts.

- The worker hands vLLM each trainer parameter as the checkpoint tensors it stands for
  (vllm_worker's reverse weight conversion): a fused expert tensor becomes per-expert views with the
  checkpoint's names; a dense model's names pass unchanged (no engine).
- Every MoE family in heads.py's tables, on a real engine (one child process, an engine each, in
  turn): the trainer's fp32 log-probs of what vLLM sampled equal vLLM's (<= 1e-4) at start and after
  a publish of new weights through `sync.publish_model` and the worker's load, and the publish took
  (the old weights' log-probs are off). Without vllm_worker.drop_moe_kernels a Qwen3-MoE is 0.019
  off after the publish (vLLM's CPU kernel reads unpacked experts as packed); without the conversion
  Mixtral's load fails.
- A family vLLM serves but the trainer does not score exactly (heads.MOE_REFUSED) is refused in one
  line.
- `--model TINY_MOE` through train.py on two FSDP2 ranks (the experts sharded with the rest):
  held-out evaluation, a DCP checkpoint, trainer and vLLM agreeing after every sync (<= 1e-4 fp32).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import transformers
from spawned import end_in_process_engine, result_of_child, served_llm

import buffer
import update
from tasks import builtin
from trainer import heads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the copy task's tokenizer (builtin.build_tiny_model
# writes it; the family's config replaces the model)
VOCAB = 26
SHAPE = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=VOCAB,
)
TOP2 = dict(num_experts_per_tok=2)
# a window that bites
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
# model_type -> a tiny config: 4 experts, 2 routed per token; shared experts and dense first layers
# where the family has them
MOE_FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, **TOP2),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **TOP2
    ),
    "mixtral": dict(num_local_experts=4, **TOP2),
    "olmoe": dict(num_experts=4, **TOP2),
    "granitemoe": dict(num_local_experts=4, logits_scaling=0.5, **TOP2),
    "granitemoeshared": dict(
        num_local_experts=4, shared_intermediate_size=32, logits_scaling=0.5, **TOP2
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_shared_experts=1,
        **TOP2,
    ),
    "exaone_moe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        num_shared_experts=1,
        mlp_layer_types=["dense", "sparse"],
        **SLIDING,
        **TOP2,
    ),
    "cohere2_moe": dict(
        num_experts=4,
        mlp_layer_types=["sparse"] * 2,
        logit_scale=1.0,
        tie_word_embeddings=True,
        # no wider than the context: see below
        **{**SLIDING, "sliding_window": 64},
        **TOP2,
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    "afmoe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        num_dense_layers=1,
        num_shared_experts=1,
        **SLIDING,
        # what vLLM reads
        score_func="sigmoid",
        route_norm=True,
        n_group=1,
        topk_group=1,
        **TOP2,
    ),
}
# random-init routers score experts almost alike: sharpen them so routes are decided
ROUTER_GAIN = 10.0
ENGINE_TIMEOUT_S = 900


def tiny_moe(model_type, seed=0):
    config = transformers.AutoConfig.for_model(model_type, **{**SHAPE, **MOE_FAMILIES[model_type]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith(
                ("gate.weight", "router.weight", "router.layer.weight")
            ):
                p.mul_(ROUTER_GAIN)
    return model


def test_the_worker_hands_vllm_checkpoint_named_expert_tensors():
    from generator import vllm_worker

    model = tiny_moe("mixtral")
    skeleton = vllm_worker.checkpoint_skeleton(model.config)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    fused = dict(model.named_parameters())[name].detach()  # experts x (gate; up) x hidden
    got = dict(vllm_worker.checkpoint_tensors(skeleton, name, fused))
    half = fused.shape[1] // 2
    assert len(got) == 2 * 4
    for e in range(4):  # Mixtral's checkpoint: block_sparse_moe.experts.E.w1 (gate) and .w3 (up)
        prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert torch.equal(got[f"{prefix}.w1.weight"], fused[e, :half])
        assert torch.equal(got[f"{prefix}.w3.weight"], fused[e, half:])
    down = "model.layers.1.mlp.experts.down_proj"
    got = dict(
        vllm_worker.checkpoint_tensors(
            skeleton, down, dict(model.named_parameters())[down].detach()
        )
    )
    assert sorted(got) == [
        f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)
    ]
    router = "model.layers.0.mlp.gate.weight"
    assert [n for n, _ in vllm_worker.checkpoint_tensors(skeleton, router, fused[0])] == [
        "model.layers.0.block_sparse_moe.gate.weight"
    ]
    dense = transformers.AutoConfig.for_model(
        "qwen2", **{k: v for k, v in SHAPE.items() if k != "head_dim"}
    )
    name = "model.layers.0.mlp.gate_proj.weight"
    weight = fused[0]
    [(out, tensor)] = vllm_worker.checkpoint_tensors(
        vllm_worker.checkpoint_skeleton(dense), name, weight
    )
    assert out == name and tensor is weight  # a dense model's weights pass as they are, no copy


# --------------------------------------------------------------------------------------------------
# vLLM samples, the trainer scores, at start and after a publish: every MoE family, one engine each
# --------------------------------------------------------------------------------------------------
def serve_publish_and_score(models: dict) -> dict:
    """In a child: for each family, a vLLM engine on its model (VLLM_ENABLE_V1_MULTIPROCESSING=0: in
    this process, ~3 s an engine after the first) with the project's worker extension; 8 prompts x 4
    samples of 5 tokens scored by the trainer's `completion_logprobs`, at start and after new
    weights (every parameter moved by 5% of its spread) went through `sync.publish_model` and the
    worker's load. Per family: the largest |vLLM - trainer| log-prob at start and after, and the
    median under the old weights after."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, VOCAB, (4,), generator=g).tolist() for _ in range(8)]
        params = SamplingParams(n=4, max_tokens=5, temperature=1.0, logprobs=0, seed=0)

        def sample():
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
            return buffer.collate(samples, pad_id=0)

        def diffs(batch):
            with torch.no_grad():
                logp = update.completion_logprobs(model, batch, 1.0).logp
            return (logp - batch.behaviour_logp)[batch.mask].abs()

        at_start = float(diffs(sample()).max())
        old = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
        sync.publish_model(model, shared, 1, 0, 1)
        loaded = llm.collective_rpc("load_shared_weights", args=(1,))[0]
        llm.reset_prefix_cache()
        batch = sample()
        after = diffs(batch)
        with torch.no_grad():
            for p, w in zip(model.parameters(), old):
                p.copy_(w)
        out[family] = {
            "loaded": loaded,
            "tokens": int(batch.mask.sum()),
            "at_start": at_start,
            "after_publish": float(after.max()),
            "old_median": float(diffs(batch).median()),
            "seconds": time.perf_counter() - start,
        }
        llm = None  # (the closures above hold it too) the engine goes with its last reference
        end_in_process_engine()
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """serve_publish_and_score over MOE_FAMILIES, in one spawned child: {family: figures}."""
    models = {}
    for family in MOE_FAMILIES:
        # the copy tokenizer
        path = builtin.build_tiny_model(str(tmp_path_factory.mktemp(family) / "model"))
        tiny_moe(family).save_pretrained(path)
        models[family] = path
    return result_of_child(serve_publish_and_score, (models,), ENGINE_TIMEOUT_S)


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_trainer_and_vllm_agree_at_start_and_after_a_publish(model_type, served):
    got = served[model_type]
    print(
        f"{model_type}: max |trainer - vLLM| log-prob {got['at_start']:.1e} at start, "
        f"{got['after_publish']:.1e} after a publish (old weights: median {got['old_median']:.1e}; "
        f"{got['seconds']:.1f} s)"
    )
    assert got["loaded"] == 1 and got["tokens"] >= 100, got
    # vLLM serves the published weights, not the ones it started with
    assert got["old_median"] > 1e-3, got
    assert got["at_start"] <= 1e-4 and got["after_publish"] <= 1e-4, got


def test_moe_families_are_all_checked_here_or_refused():
    moe_types = {
        t for t in {**heads.PLAIN_HEADS, **heads.TRANSFORMED_HEADS} if "moe" in t or t == "mixtral"
    }
    assert moe_types == set(MOE_FAMILIES)
    assert not set(heads.MOE_REFUSED) & moe_types


@pytest.mark.parametrize("model_type", sorted(heads.MOE_REFUSED))
def test_a_moe_family_the_trainer_cannot_score_exactly_is_refused_in_one_line(model_type):
    problem = heads.head_problem(transformers.AutoConfig.for_model(model_type))
    assert (
        problem.startswith(f"model type {model_type!r}")
        and heads.MOE_REFUSED[model_type] in problem
    )
    assert "\n" not in problem


def test_a_config_scored_otherwise_than_vllm_samples_it_is_refused_in_one_line(tmp_path):
    from infra import devices

    # Cohere2's sliding layers: vLLM sees one token more
    # than transformers (0.14 apart with a window of 4)
    narrow = tiny_moe("cohere2_moe").config
    narrow.sliding_window = 4
    narrow.save_pretrained(tmp_path)
    [problem] = devices.engine_problems(str(tmp_path), False, 64, 5, 64, "fp32")
    assert (
        "one token wider" in problem
        and "--max-model-len 4 or less" in problem
        and "\n" not in problem
    )
    assert devices.engine_problems(str(tmp_path), False, 4, 2, 64, "fp32") == []
    # LoRA on an MoE model: vLLM's CPU backend has no
    # LoRA path for MoE layers (its Triton kernels only)
    [problem] = devices.engine_problems(str(tmp_path), False, 4, 2, 64, "fp32", lora_rank=8)
    assert "Mixture-of-Experts" in problem and "--lora-rank" in problem and "\n" not in problem
    # GPUs: not refused (not run)
    assert devices.engine_problems(str(tmp_path), True, 4, 2, 64, "fp32", lora_rank=8) == []
    # EXAONE-MoE with a window and no sliding layer: RoPE
    # in vLLM's layers, none in transformers' (0.12 apart)
    full = transformers.AutoConfig.for_model(
        "exaone_moe", layer_types=["full_attention"] * 2, num_hidden_layers=2
    )
    assert "applies no RoPE" in heads.head_problem(full)
    assert heads.head_problem(tiny_moe("exaone_moe").config) == ""
    # AFMoE as transformers 5 writes it: vLLM cannot start (no
    # score_func); otherwise routing vLLM reads, differently
    for fields in (
        {},
        {"score_func": "softmax", "route_norm": True},
        {"score_func": "sigmoid", "route_norm": False},
    ):
        problem = heads.head_problem(transformers.AutoConfig.for_model("afmoe", **fields))
        assert "score_func 'sigmoid', route_norm true" in problem and "\n" not in problem
    assert heads.head_problem(tiny_moe("afmoe").config) == ""


def test_train_refuses_a_moe_family_before_it_starts(tmp_path):
    import train

    path = builtin.build_tiny_model(str(tmp_path / "phimoe"))
    transformers.AutoConfig.for_model(
        "phimoe", **{**SHAPE, "num_local_experts": 4, **TOP2}
    ).save_pretrained(path)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main(["--model", path, "--out", str(out), "--steps", "1"])
    message = str(err.value)
    assert message.startswith("error: ") and "'phimoe'" in message and "\n" not in message
    assert not (out / "config.json").exists()


# --------------------------------------------------------------------------------------------------
# --model TINY_MOE through train.py
# --------------------------------------------------------------------------------------------------
def test_tiny_moe_trains_on_two_fsdp2_ranks_with_evaluation_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    args = [
        "--model",
        "TINY_MOE",
        "--out",
        str(out),
        "--steps",
        "4",
        "--train-ranks",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-lag",
        "0",
        "--log-every",
        "1",
        "--eval-every",
        "4",
        "--eval-prompts",
        "16",
        "--eval-samples",
        "1",
        "--save-every",
        "4",
    ]
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.load(open(out / "summary.json"))
    config = transformers.AutoConfig.from_pretrained(out / "init_moe_model")
    assert config.model_type == "qwen3_moe" and config.num_experts == builtin.TINY_MOE_EXPERTS
    assert summary["steps"] == 4 and summary["eval_last"] is not None
    print(
        f"TINY_MOE, 2 ranks: max |trainer - vLLM| on-policy log-prob "
        f"{summary['logprob_diff_after_sync']:.1e}"
    )
    assert (
        summary["logprob_diff_after_sync"] is not None
        and summary["logprob_diff_after_sync"] <= 1e-4
    )
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    synced = [
        r["logprob_diff_on_policy"]
        for r in rows
        if r.get("step", 0) >= 2 and "logprob_diff_on_policy" in r
    ]
    # steps trained on published weights
    assert synced and all(d is not None and d <= 1e-4 for d in synced)
    assert (out / "checkpoints" / "step_00000004").is_dir()
