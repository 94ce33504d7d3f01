"""infra/kv_cache.py — vLLM's KV cache on a CPU (--kv-cache-mb) against the tokens a run keeps in
flight.

Role: before the generator's engine starts, `sized_engine_config` has the generator load its task
(the prompts, cut to the engine's context) and counts the cache tokens a step keeps in flight
(groups x G sequences of prompt + --max-new-tokens, in vLLM's blocks) and an evaluation's (a greedy
completion and --eval-samples samples per held-out prompt), at most what vLLM runs at once
(max_num_seqs sequences). A cache that holds fewer tokens preempts requests and prefills them
again: it is sized up to what they need where that fits in KV_SHARE_OF_AVAILABLE of the memory
available, and one line says so with the figures, or names the shortfall. On GPUs vLLM sizes its
cache from --gpu-memory-utilization: nothing here.
Data contract: sizes in MiB, counts in tokens; `size_kv_cache` is a pure function.
May touch: the vLLM config it is given (cache_config.kv_cache_memory_bytes), stderr.
"""

from __future__ import annotations

import sys

import psutil

# The most of the memory available as the generator starts that a KV cache sized up here may take:
# the trainer's weights, gradients and optimizer states, and the weight buffer, need the rest.
KV_SHARE_OF_AVAILABLE = 0.5


def kv_bytes_per_token(text_config, dtype: str) -> int | None:
    """Keys and values of one token in every layer, in the serving dtype (each layer counted as
    full attention: sliding-window layers make it an upper bound). None where the config does not
    say."""
    heads = getattr(text_config, "num_attention_heads", None)
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // heads if heads else None
    )
    layers = getattr(text_config, "num_hidden_layers", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * (2 if dtype == "bf16" else 4)


def tokens_in_flight(lengths, copies: int, max_new_tokens: int, context: int, block: int) -> int:
    """The cache tokens `copies` sequences of each prompt length in `lengths` hold once they have
    generated `max_new_tokens` (at most `context` each), in whole `block`-token blocks as vLLM
    allocates them."""
    return sum(copies * -(-min(n + max_new_tokens, context) // block) * block for n in lengths)


def size_kv_cache(
    kv_cache_mb: int,
    per_token: int,
    block: int,
    step_tokens: int,
    eval_tokens: int,
    available: int,
    at_once: int | None = None,
) -> tuple[int, str]:
    """The KV cache to give vLLM (MiB), and one line for the terminal ("" when --kv-cache-mb holds
    what a step and an evaluation keep in flight: `step_tokens` + `eval_tokens`, from
    `tokens_in_flight`, at most `at_once`: vLLM runs max_num_seqs sequences at once, the others wait
    without a cache). Too small, it is sized up to what they need where that fits in
    KV_SHARE_OF_AVAILABLE of the `available` bytes of memory, else up to that share; the line gives
    the figures either way."""
    # whole blocks, one of which vLLM holds back
    holds = max(0, kv_cache_mb * 2**20 // (per_token * block) - 1) * block
    total = step_tokens + eval_tokens
    needs = min(total, at_once or total)
    if needs <= holds:
        return kv_cache_mb, ""
    need_mb = -(-(needs + block) * per_token // 2**20)
    allowed_mb = int(KV_SHARE_OF_AVAILABLE * available // 2**20)
    figures = (
        f"vLLM's KV cache (--kv-cache-mb {kv_cache_mb}) holds {holds:,} tokens of this model "
        f"({per_token / 1024:.0f} KiB each); a step keeps up to {step_tokens:,} in flight"
        + (f" and an evaluation {eval_tokens:,} more" if eval_tokens else "")
        + (f" (at most {needs:,} at once: vLLM's max_num_seqs)" if needs < total else "")
    )
    memory = f"{available / 2**30:.1f} GiB of memory available"
    share = f"{KV_SHARE_OF_AVAILABLE:.0%}"
    if need_mb <= allowed_mb:
        return need_mb, f"note: {figures}: sized up to {need_mb} MiB ({memory})"
    fix = "lower --prompts-per-step, --group-size or --eval-prompts, or free memory"
    if allowed_mb > kv_cache_mb:
        return allowed_mb, (
            f"warning: {figures}: sized up to {allowed_mb} MiB, {share} of the {memory}, short "
            f"of the {need_mb} MiB they need: requests will be preempted and prefilled again "
            f"({fix})"
        )
    return kv_cache_mb, (
        f"warning: {figures}; {need_mb} MiB would take over {share} of the {memory}: requests "
        f"will be preempted and prefilled again ({fix})"
    )


def run_kv_cache_mb(cfg, task, vllm_config, available: int) -> tuple[int, str]:
    """`size_kv_cache` for a run: the Config, its task's prompts and vLLM's config (block size,
    context, max_num_seqs, the model's layers). An env task's episodes have no length known before
    they run: its cache is left as given, nothing said."""
    model = vllm_config.model_config
    block, context = vllm_config.cache_config.block_size, model.max_model_len
    per_token = kv_bytes_per_token(model.hf_text_config, cfg.dtype)
    if task.is_env or not per_token or not task.prompts:
        return cfg.kv_cache_mb, ""
    lengths = [len(p.prompt_ids) for p in task.prompts]
    groups = cfg.max_inflight_groups or cfg.prompts_per_step
    mean = round(sum(lengths) / len(lengths))
    step = tokens_in_flight([mean], groups * cfg.group_size, cfg.max_new_tokens, context, block)
    held_out = [len(p.prompt_ids) for p in task.held_out[: cfg.eval_prompts]]
    held_out = held_out if cfg.eval_every else []
    # a greedy completion and the samples, per held-out prompt
    evaluation = tokens_in_flight(
        held_out, 1 + cfg.eval_samples, cfg.max_new_tokens, context, block
    )
    # the longest sequences, as many as vLLM runs at once
    seqs = vllm_config.scheduler_config.max_num_seqs
    at_once = tokens_in_flight([max(lengths + held_out)], seqs, cfg.max_new_tokens, context, block)
    return size_kv_cache(
        kv_cache_mb=cfg.kv_cache_mb,
        per_token=per_token,
        block=block,
        step_tokens=step,
        eval_tokens=evaluation,
        available=available,
        at_once=at_once,
    )


def sized_engine_config(args, gen):
    """vLLM's config for the generator `gen` (rollout.Generator) from its engine `args`
    (AsyncEngineArgs): its task loaded first, to the engine's context, and on a CPU the KV cache
    sized for it (the line, if any, on stderr)."""
    vllm_config = args.create_engine_config()
    gen.load_task(vllm_config.model_config.max_model_len)
    if gen.settings.device == "cpu":
        available = psutil.virtual_memory().available
        mb, line = run_kv_cache_mb(gen.cfg, gen.task, vllm_config, available)
        vllm_config.cache_config.kv_cache_memory_bytes = mb * 2**20
        if line:
            print(line, file=sys.stderr, flush=True)
    return vllm_config
