"""generator/engine.py — the generator's vLLM engine: how it is built, what each request asks for.

Role: `build_engine` builds the generator's `AsyncLLM` (its devices entered first, then vLLM
imported; its KV cache sized by kv_cache.py) and `shutdown_engine` ends it; `request_params` and
`sampling_params` are vLLM's SamplingParams for one request and for one group's G samples;
`generate` sends one request of token ids, its prompt salted with the loaded version under
--kv-on-swap keep (`prompt_input`); `sampled` reads a finished group's outputs.
Data contract: the functions take the generator `gen` (rollout.Generator: its settings, config,
task, served weights, routes recorder, loaded version and counters) and only read it, except
`build_engine`, which sets `gen.engine` and `gen.stats.max_num_seqs`.
May touch: the engine, CUDA_VISIBLE_DEVICES (through devices.enter_generator_devices), the loggers
of vLLM's shutdown, its trace events (tracing.py). Nothing of the trainer.
"""

from __future__ import annotations

import logging

from buffer import tag_versions
from infra import tracing
from infra.devices import engine_concurrency, enter_generator_devices, torch_dtype
from infra.kv_cache import sized_engine_config

# what vLLM's EngineCore gets to exit on CPU before it is killed with its worker
CPU_ENGINE_SHUTDOWN_S = 1.0


def build_engine(gen):
    """The generator's vLLM engine, serving `gen.settings.model` (its full weights or an adapter,
    `gen.served`), its KV cache sized for the task (which sized_engine_config loads first)."""
    cfg = gen.cfg
    options = enter_generator_devices(gen.settings, cfg.kv_cache_mb)  # (sets CUDA_VISIBLE_DEVICES)
    # vLLM is imported here, in the generator process, never in the parent (nor before
    # CUDA_VISIBLE_DEVICES).
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    options.update(gen.served.engine_options, **(gen.routes.engine_options if gen.routes else {}))
    if cfg.max_model_len:
        options.update(max_model_len=cfg.max_model_len)
    options.update(engine_concurrency(cfg))
    gen.stats.max_num_seqs = options["max_num_seqs"]
    args = AsyncEngineArgs(
        model=gen.settings.model,
        tokenizer=gen.settings.model,
        dtype=torch_dtype(cfg.dtype),
        seed=cfg.seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
        **options,
        enable_prefix_caching=True,
        disable_log_stats=True,
        use_tqdm_on_load=cfg.log_level != "warning",
    )
    config = sized_engine_config(args, gen)  # the task first: it sizes the CPU KV cache
    gen.engine = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    return gen.engine


def request_params(gen, max_tokens: int | None = None, **sampling):
    """vLLM's SamplingParams for one request: final output only, the run's stop strings and length
    (an episode's turn: what is left of its budget, at most --max-new-tokens)."""
    from vllm import SamplingParams  # the generator process only (see build_engine)
    from vllm.sampling_params import RequestOutputKind

    # Detokenizing every token costs the front end CPU time; a task scored by token ids skips it
    # (stop strings are matched in the text: they need it).
    return SamplingParams(
        **sampling,
        max_tokens=max_tokens or gen.cfg.max_new_tokens,
        output_kind=RequestOutputKind.FINAL_ONLY,
        stop=list(gen.settings.stop) or None,
        detokenize=gen.task.needs_text or bool(gen.settings.stop),
    )


def sampling_params(gen, group_id: int):
    """A group's request: G samples with the run's sampling settings and their log-probs."""
    cfg = gen.cfg
    # A per-request seed makes a group's samples a function of (seed, group id, weights), so a
    # resumed run regenerates the same rollouts. Only when no request is ever preempted by a
    # weight swap: vLLM's CPU sampler cannot re-seed a preempted request ("CPU Generator does
    # not use offset"). --kv-on-swap keep preempts nothing at a swap, but the seed stays off:
    # vLLM still preempts for KV room, and where a swap lands is timing, so the tokens are no
    # function of the seed anyway.
    reproducible = cfg.max_lag == 0 or cfg.update_mode == "drain"
    return request_params(
        gen,
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        logprobs=0,
        seed=cfg.seed * 1_000_003 + group_id if reproducible else None,
    )


def prompt_input(gen, ids: list[int]) -> dict:
    """vLLM's prompt for token `ids`. Under --kv-on-swap keep the prefix cache is never reset, so a
    request is salted with the loaded version (vLLM hashes the salt into its first block): it
    shares cached blocks with requests sent under the same weights (a group's G samples), never
    with the old weights' ones."""
    salt = {"cache_salt": f"v{gen.loaded_version}"} if gen.cfg.kv_on_swap == "keep" else {}
    return {"prompt_token_ids": ids, **salt}


def generate(gen, ids: list[int], params, request_id: str):
    """The engine's outputs for one request of token `ids`, under the weights it serves."""
    return tracing.request(
        gen.engine.generate(
            prompt_input(gen, ids), params, request_id=request_id, **gen.served.request_options
        ),
        request_id,
        n=params.n,
    )


def sampled(outputs) -> tuple[list, list, list, list]:
    """A finished request's completions (sorted by index), as (token ids, their log-probs, the
    version that sampled each token, the text) per completion."""
    completions, logprobs, versions, texts = [], [], [], []
    for c in outputs:
        ids = list(c.token_ids)
        completions.append(ids)
        logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(ids)])
        versions.append(tag_versions(c.weight_versions, len(ids)))
        texts.append(c.text or "")  # "" when the task does not need text (detokenize=False)
    return completions, logprobs, versions, texts


def shutdown_engine(engine, settings) -> None:
    """End the engine at the end of the generator process."""
    if settings.cfg.log_level == "warning":
        quiet_requested_shutdown()
    # On CPU, vLLM 0.32's worker lingers after acknowledging the shutdown
    # and is force-killed after 5 s anyway; there is no device memory to
    # release, so the engine gets 1 s (GPUs: vLLM's own grace).
    engine.shutdown(timeout=CPU_ENGINE_SHUTDOWN_S if settings.device == "cpu" else None)


def quiet_requested_shutdown() -> None:
    """vLLM 0.32's CPU worker lingers after it acknowledges the shutdown, so at every end of a run
    vLLM force-kills it (after CPU_ENGINE_SHUTDOWN_S) and logs three "[shutdown] ... force killing"
    warnings. We asked for this shutdown and nothing is lost: those lines are left out (with
    --log-level info they show)."""

    class RequestedShutdown(logging.Filter):
        def filter(self, record):
            return not record.getMessage().startswith("[shutdown]")

    for name in ("vllm.v1.utils", "vllm.utils.system_utils"):
        logging.getLogger(name).addFilter(RequestedShutdown())
