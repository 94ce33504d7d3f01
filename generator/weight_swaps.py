"""generator/weight_swaps.py — the generator's weight swaps: new weights into a running vLLM engine.

Role: between engine steps, the generator's loop (rollout.py) pauses the scheduler, has every vLLM
worker load the shared buffer's newest weights (vllm_worker.py reads shared_weights.py; with
--lora-rank the adapter, through lora.Served), resets the prefix cache or keeps it (--kv-on-swap),
stamps the new version and resumes: requests in flight go on under the new weights ("inflight") or
the pause waits for them to finish ("drain"). A buffer that starts empty (an adapter, a resume, a
remote generator) is loaded once first (`load_first_publish`). Every engine call here fails fast if
vLLM's EngineCore dies and waits at most --timeout-s (`engine_call`).
Data contract: after a swap, `gen.loaded_version` (and `control.loaded_version`) is the version the
workers report they loaded, the same on every worker (`load_same_version`), and every token sampled
from then on is tagged with it; each swap appends its publish-to-serving time and its parts (pause,
load, reset, resume, requests in flight) to the generator's counters for the trainer's log.
May touch: the generator it is handed (rollout.Generator: its engine, loaded version and swap
counters), `control.loaded_version`, the shared buffer (read only), its trace events (tracing.py).
"""

from __future__ import annotations

import asyncio
import time

from infra import tracing


async def load_same_version(load, max_tries: int = 20) -> int:
    """Call `load()` (every vLLM worker loads the buffer's newest weights and reports their version)
    until all workers report the same version, and return it. With tensor parallelism each worker
    reads the buffer on its own, so a publish that lands between two reads leaves them on different
    versions; tokens sampled then would mix two models under one tag. Loading again converges as
    soon as no publish lands during a load."""
    versions = []
    for _ in range(max_tries):
        versions = list(await load())
        if len(set(versions)) == 1:
            return versions[0]
    raise RuntimeError(
        f"the generator's workers loaded different weight versions {max_tries} times in a row "
        f"(last: {versions}): the trainer publishes faster than they load; raise --sync-every"
    )


async def engine_call(gen, awaitable, what: str):
    """Await an engine call, failing fast if vLLM's EngineCore dies (a dead engine never
    answers)."""
    task = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + gen.cfg.timeout_s
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if gen.engine.errored:
            task.cancel()
            raise RuntimeError(f"vLLM's engine died during {what}") from gen.engine.dead_error
        if time.monotonic() > deadline:
            task.cancel()
            raise TimeoutError(f"vLLM did not finish {what} within {gen.cfg.timeout_s:.0f} s")


async def swap_weights(gen, version: int):
    """Load the newest published weights between engine steps; tag later tokens with
    `version`."""
    t0 = time.perf_counter()
    mode = "keep" if gen.cfg.update_mode == "inflight" else "wait"
    # The scheduler's own pause, not `AsyncLLM.pause_generation`: with clear_cache=False that
    # method only adds a fixed 20 ms sleep (vLLM 0.32), meant to let outputs of the last step
    # reach their callers before it returns. We do not need that ordering: EngineCore stamps
    # each step's output with the version it was sampled under, so a token that arrives after
    # the swap still carries its own tag.
    await engine_call(
        gen, gen.engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=False), "the pause"
    )
    t1 = time.perf_counter()
    # samples (n > 1 counts n), running or waiting
    in_flight = gen.engine.get_num_unfinished_requests()
    # The buffer may already hold a newer version than
    # we were told: the workers report what they loaded.
    version = await load_same_version(
        lambda: engine_call(gen, load_rpc(gen, version), "the weight load")
    )
    t2 = time.perf_counter()
    # Cached blocks hold keys/values of the old weights. recompute: in-flight requests are
    # re-prefilled (NeMo-RL's recompute_kv_cache_after_weight_updates=true). keep: they go on
    # with their cache (PipelineRL's vllm1.py: pause "keep", no reset);
    # reset_prefix_cache(reset_running_requests=False) refuses while a block is in use (vLLM
    # 0.32), so nothing is reset and the cache salt keeps new requests off old blocks
    # (generator/engine.prompt_input).
    if gen.cfg.kv_on_swap == "recompute" and not await engine_call(
        gen, gen.engine.reset_prefix_cache(reset_running_requests=True), "the reset"
    ):
        raise RuntimeError(
            "reset_prefix_cache failed after a weight update: stale KV cache would be reused"
        )
    await engine_call(gen, gen.engine.update_weight_version(str(version)), "update_weight_version")
    t3 = time.perf_counter()
    await engine_call(gen, gen.engine.resume_generation(), "resume_generation")
    gen.loaded_version = version
    gen.control.loaded_version.value = version
    # the requests in flight were re-prefilled (recompute) or kept on their cache (keep)
    gen.stats.count_swap(
        in_flight,
        sync_ms=(time.time_ns() - gen.shared.publish_time_ns()) / 1e6,
        parts={
            "pause_ms": (t1 - t0) * 1e3,
            "load_ms": (t2 - t1) * 1e3,
            "reset_ms": (t3 - t2) * 1e3,
            "resume_ms": (time.perf_counter() - t3) * 1e3,
            "requests": in_flight,
        },
    )
    tracing.swap(t0, t1, t2, t3, version, in_flight)


def load_rpc(gen, version: int):
    """The worker call that loads the buffer's contents: the full weights, or the adapter in
    place."""
    method, args = gen.served.load_call(version)
    return gen.engine.collective_rpc(method, args=args)


async def load_first_publish(gen):
    """A buffer that starts empty (an adapter, a resume, a remote generator): the engine serves
    nothing until the trainer's first publish (at its start) is loaded, tagged with the version
    it carries."""
    deadline = time.monotonic() + gen.cfg.timeout_s
    while gen.shared.publish_time_ns() == 0 or gen.shared.version() < gen.settings.initial_version:
        if gen.control.stop.is_set():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer published no weights within {gen.cfg.timeout_s:.0f} s")
        await asyncio.sleep(0.01)
    gen.loaded_version = await load_same_version(
        lambda: engine_call(gen, load_rpc(gen, gen.settings.initial_version), "the first load")
    )
    # the tag of the tokens it samples
    await gen.engine.update_weight_version(str(gen.loaded_version))
    gen.control.loaded_version.value = gen.loaded_version
