"""Routing replay (issue 30) with vLLM: the routes vllm_worker.WeightSyncWorker records (routes.py)
are the experts the trainer's own routers choose, position by position.

- An engine in this process (fp32): a request of 4 samples on the tiny Qwen3-MoE, then the same
  prompt again, which reuses the first one's KV blocks: every sample's routes, prompt included, are
  the Hugging Face model's own top-k at every position vLLM read; two routers unlike Qwen's
  (GLM-4-MoE, Granite-MoE; tests/test_moe.py's tiny configs) recorded the same way, a dense layer's
  rows missing.
- One real run (`python train.py`, vLLM and the trainer, fp32): the multi-turn reveal task
  with --router-record, weights swapped in flight: every recorded route matches the trainer's own
  top-k at its position (a route off by one position or one sample would match about 1 in 28 times),
  none is missing.

The tiny Qwen3-MoE's shape (LAYERS, TOP_K) and the micro-batch stand-in `Batch`:
tests/test_replay.py (the trainer's side and the worker's store, without vLLM).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_replay import LAYERS, TOP_K, Batch

from tasks import builtin
from trainer import replay

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# vLLM: an engine in this process, then one real run
# --------------------------------------------------------------------------------------------------
def own_top_k(model, ids: list[int]) -> np.ndarray:
    """(positions, layers, top_k) sorted: the experts the Hugging Face model's routers choose for
    `ids`."""
    caught = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: caught.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack([caught[i] for i in range(len(caught))], 1).sort(-1).values.numpy()


def test_the_worker_records_each_sample_and_a_prefix_cache_hit_gets_its_blocks_routes(
    tmp_path, monkeypatch
):
    """vLLM (fp32, in this process): a request of 4 samples, then the same prompt again, which
    reuses the first one's KV blocks (32-token blocks here; the CPU path's default 128 is longer
    than the tiny model's context): every sample's routes, prompt included, are the Hugging Face
    model's own top-k at every position it read."""
    # (the engine in this process: a quicker start)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    path = builtin.build_tiny_model(str(tmp_path / "moe"), experts=builtin.TINY_MOE_EXPERTS)
    llm = LLM(
        model=path,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=32 * 2**20,
        worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
        enable_prefix_caching=True,
        block_size=32,
    )
    try:
        # An empty request-id prefix: record every request.
        layers, top_k, experts = llm.collective_rpc("start_routes", args=("",))[0]
        prompt = [1] + [3 + (7 * j) % 23 for j in range(39)]
        outs = [
            llm.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(n=n, max_tokens=8, seed=0),
                use_tqdm=False,
            )[0]
            for n in (4, 1)
        ]
        taken = [dict(llm.collective_rpc("take_routes", args=(o.request_id,))[0]) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert (layers, top_k, experts) == (2, builtin.TINY_MOE_ACTIVE, builtin.TINY_MOE_EXPERTS)
    assert (
        outs[1].num_cached_tokens == 32
        and sorted(taken[0]) == [0, 1, 2, 3]
        and sorted(taken[1]) == [0]
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    for out, by_index in zip(outs, taken):
        for c in out.outputs:
            ids = prompt + list(c.token_ids)
            got = np.frombuffer(by_index[c.index], np.uint8).reshape(-1, layers, top_k)
            # every position vLLM read; the last sampled token it never reads
            assert len(got) == len(ids) - 1
            assert np.array_equal(np.sort(got, -1), own_top_k(model, ids)[:-1])


@pytest.mark.parametrize("family", ["glm4_moe", "granitemoe"])
def test_vllm_records_the_routes_other_routers_choose(family, tmp_path, monkeypatch):
    """Two routers unlike Qwen's (tests/test_moe.py's tiny configs): GLM-4-MoE (a dense first layer,
    sigmoid scores, grouped choice with a bias) and Granite-MoE (a softmax over the chosen logits,
    its outputs in another order): vLLM's recorded routes are the Hugging Face model's own top-k, a
    dense layer's rows missing."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from test_moe import tiny_moe as family_moe
    from vllm import LLM, SamplingParams

    # (the copy tokenizer; the family's model replaces it)
    path = builtin.build_tiny_model(str(tmp_path / family))
    model = family_moe(family)
    model.save_pretrained(path)
    llm = LLM(
        model=path,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=32 * 2**20,
        worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
        max_model_len=64,
    )
    try:
        layers, top_k, _ = llm.collective_rpc("start_routes", args=("",))[0]
        out = llm.generate(
            [{"prompt_token_ids": [1, 5, 9, 7, 22]}],
            SamplingParams(n=2, max_tokens=8, seed=0),
            use_tqdm=False,
        )[0]
        taken = dict(llm.collective_rpc("take_routes", args=(out.request_id,))[0])
    finally:
        llm.llm_engine.engine_core.shutdown()
    caught = {}
    # (counts each layer's top-k)
    state = replay.install(model, model.model.layers, model.config, replay=False)
    state.count = lambda layer, own, recorded, present: caught.__setitem__(
        layer, own.sort(-1).values
    )
    for c in out.outputs:
        ids = [1, 5, 9, 7, 22] + list(c.token_ids)
        with (
            torch.no_grad(),
            replay.routed_by(
                model, Batch(torch.tensor([ids]), torch.full((1, len(ids), layers, top_k), -1))
            ),
        ):
            model(torch.tensor([ids]))
        got = np.sort(np.frombuffer(taken[c.index], np.uint8).reshape(-1, layers, top_k), -1)
        assert len(got) == len(ids) - 1 and len(caught) >= 1
        for layer in range(layers):
            if layer in caught:
                assert np.array_equal(got[:, layer], caught[layer][:-1].numpy())
            else:  # a dense layer
                assert (got[:, layer] == 255).all()
    assert (family == "glm4_moe") == (sorted(caught) == [1])  # (GLM-4-MoE's first layer is dense)


def test_recorded_routes_match_the_trainers_own_across_turns_swaps_and_micro_batches(tmp_path):
    out = tmp_path / "run"
    # --lr 1e-12 leaves the fp32 weights as they are while versions advance (every publish is
    # loaded, in flight): the trainer's own top-k is then what vLLM computed, position by position,
    # whatever the swaps did
    args = [
        "--model",
        "TINY_MOE",
        "--task",
        "reveal",
        "--router-record",
        "--dtype",
        "fp32",
        "--steps",
        "4",
        "--lr",
        "1e-12",
        "--max-lag",
        "3",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--micro-batch-tokens",
        "64",
        "--eval-every",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        # vLLM's worker in a process of its own (the CPU default): its slower steps keep requests
        # running when a publish lands (in the EngineCore's process the engine ran ahead to the
        # staleness gate and no swap met a running request)
        env=dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and max(r["micro_batches"] for r in rows) > 1
    # weights were swapped under running requests
    assert sum(r["gen_swap_requests"] for r in rows) > 0
    assert max(r["env/turns_mean"] for r in rows) > 1  # episodes of several requests
    for r in rows:
        assert r["router/missing"] == 0 and r["router/agreement"] > 0.99, r
        assert r["router/bytes_per_token"] == LAYERS * TOP_K  # uint8
