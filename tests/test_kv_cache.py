"""kv_cache.py: vLLM's CPU KV cache against what a run keeps in flight (issue 39: the default
256 MiB held ~5,500 tokens of SmolLM2 in fp32, and a real held-out evaluation at the start saw 33
preemptions). The sizing and its one line, on figures worked by hand; a run that sizes its cache
up: tests/test_real_models.py."""

from types import SimpleNamespace

from config import Config
from infra import kv_cache

# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, keys and values: 45 KiB a token in fp32
SMOLLM2 = SimpleNamespace(
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=30
)
PER_TOKEN = 46_080
GIB = 2**30


def test_bytes_per_token_and_tokens_in_flight():
    assert kv_cache.kv_bytes_per_token(SMOLLM2, "fp32") == PER_TOKEN
    assert kv_cache.kv_bytes_per_token(SMOLLM2, "bf16") == PER_TOKEN // 2
    # no head_dim: hidden_size / heads; no KV heads: as many as heads
    plain = SimpleNamespace(num_attention_heads=4, hidden_size=128, num_hidden_layers=2)
    assert kv_cache.kv_bytes_per_token(plain, "fp32") == 2 * 2 * 4 * 32 * 4
    # 8 prompts x 4 samples, 150 prompt tokens + 48 new: 2 blocks of 128 each
    assert kv_cache.tokens_in_flight([150], 8 * 4, 48, 512, 128) == 32 * 256
    # (a greedy completion + 4 samples) x 2 prompts: 148 -> 2 blocks, 348 -> 3
    assert kv_cache.tokens_in_flight([100, 300], 5, 48, 512, 128) == 5 * (256 + 384)
    assert kv_cache.tokens_in_flight([500], 1, 48, 512, 128) == 512  # within the context


def test_a_cache_too_small_is_sized_up_where_memory_allows_or_named_in_one_line():
    step, evaluation = 32 * 256, 5 * (256 + 384)
    # 256 MiB: 45 blocks of 128 tokens x 45 KiB, one held back by vLLM; the step and the evaluation
    # need 11,392 (+ that block): 507 MiB, within half of 20 GiB
    mb, line = kv_cache.size_kv_cache(256, PER_TOKEN, 128, step, evaluation, 20 * GIB)
    assert mb == -(-(step + evaluation + 128) * PER_TOKEN // 2**20) == 507
    assert line == (
        "note: vLLM's KV cache (--kv-cache-mb 256) holds 5,632 tokens of this model (45 KiB "
        "each); a step keeps up to 8,192 in flight and an evaluation 3,200 more: sized up to "
        "507 MiB (20.0 GiB of memory available)"
    )
    # enough already: as given, nothing said
    assert kv_cache.size_kv_cache(1024, PER_TOKEN, 128, step, evaluation, 20 * GIB) == (1024, "")
    # vLLM runs at most max_num_seqs sequences at once (here 16 of 2 blocks): that many count
    assert kv_cache.size_kv_cache(
        256, PER_TOKEN, 128, step, evaluation, 20 * GIB, at_once=16 * 256
    ) == (
        256,
        "",
    )
    mb, line = kv_cache.size_kv_cache(
        128, PER_TOKEN, 128, step, evaluation, 20 * GIB, at_once=16 * 256
    )
    assert mb == -(-(16 * 256 + 128) * PER_TOKEN // 2**20) == 186
    assert "an evaluation 3,200 more (at most 4,096 at once: vLLM's max_num_seqs): sized" in line
    # half the memory available falls short: sized up to that half, the shortfall named
    mb, line = kv_cache.size_kv_cache(256, PER_TOKEN, 128, step, 0, 600 * 2**20)
    assert mb == 300 and line.startswith("warning: ") and "\n" not in line
    assert "a step keeps up to 8,192 in flight:" in line and "short of the 366 MiB" in line
    # not even that: left as given, named with the figures
    mb, line = kv_cache.size_kv_cache(256, PER_TOKEN, 128, step, evaluation, 300 * 2**20)
    assert mb == 256 and line.startswith("warning: ") and "\n" not in line
    assert "holds 5,632 tokens" in line and "507 MiB would take over 50%" in line


def run_figures(cfg, prompts, held_out, is_env=False, max_num_seqs=256):
    """run_kv_cache_mb on a task of prompts of these lengths and vLLM's config as SmolLM2 gets it
    (context 512, 128-token blocks)."""
    task = SimpleNamespace(
        is_env=is_env,
        prompts=[SimpleNamespace(prompt_ids=[0] * n) for n in prompts],
        held_out=[SimpleNamespace(prompt_ids=[0] * n) for n in held_out],
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=512, hf_text_config=SMOLLM2),
        cache_config=SimpleNamespace(block_size=128),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )
    return kv_cache.run_kv_cache_mb(cfg, task, vllm_config, 20 * GIB)


def test_a_runs_figures_come_from_its_flags_and_its_prompts():
    cfg = Config(dtype="fp32", prompts_per_step=8, group_size=4, max_new_tokens=48, eval_samples=4)
    # training prompts of 140-160 tokens (mean 150), held-out ones of 100 and 300
    mb, line = run_figures(cfg, [140, 150, 160], [100, 300])
    assert mb == 507 and "a step keeps up to 8,192 in flight and an evaluation 3,200 more" in line
    # no evaluation: the step alone (366 MiB)
    from dataclasses import replace

    assert run_figures(replace(cfg, eval_every=0), [150], [100, 300])[0] == 366
    # --max-inflight-groups 2: 2 x 4 sequences fit in 256 MiB; --eval-prompts 1: the first only
    assert run_figures(replace(cfg, max_inflight_groups=2, eval_prompts=1), [150], [100, 300]) == (
        256,
        "",
    )
    # vLLM runs 16 sequences at once, of the longest (300 + 48: 3 blocks)
    mb, line = run_figures(cfg, [150], [100, 300], max_num_seqs=16)
    assert mb == -(-(16 * 384 + 128) * PER_TOKEN // 2**20) and "at most 6,144 at once" in line
    # an env task: episodes of no known length, left as given
    assert run_figures(cfg, [150], [100], is_env=True) == (256, "")
