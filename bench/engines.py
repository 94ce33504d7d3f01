"""bench/engines.py — a benchmark's vLLM engine and event loop: its own, or shared by the smokes of
one process.

Role: generator.py, env_latency.py and weight_sync.py build their engine with `engine_for(builder)`
(a `rollout.Generator`), run it on `event_loop()` and end with `release(engine, loop)`; generator.py
starts its stand-in trainers with `helper`. Run alone, that is the builder's own engine
(`Generator.build_engine`), a new loop, the engine shut down and the loop closed at the end, and a
process per stand-in: what the benchmark measures. Inside `Session` (tests/test_bench.py runs
several smokes in one process) an engine serves every benchmark that asks for the same model and
adapter rank, on one loop for all, shut down when the session closes; `common.in_child(...,
in_session=True)` then runs in this process (those measurements: the engine's, and the trainer steps
that start no vLLM), and `common.build_model` gives one folder per (seed, sizes). Figures measured
in a session are meaningless: an engine keeps the first asker's options (KV cache, threads) and the
weights the last one loaded, a stand-in trainer is a thread of this process (no process start), and
a peak RSS is the whole process's. Data contract: engines are vLLM `AsyncLLM`s; a shared one is
never shut down by a benchmark. May touch: the process's environment in a session
(VLLM_ALLOW_INSECURE_SERIALIZATION, read when an engine starts: weight_sync.py sends its profiling
function to the worker; VLLM_ENABLE_V1_MULTIPROCESSING=0 while an engine starts: no vLLM worker
process beside its EngineCore, half the start-up on 2 cores). Imports no project module at import
time (vLLM loads only where an engine is built).
"""

from __future__ import annotations

import asyncio
import os
import threading

SESSION = None  # the Session in force, if any


class Session:
    """Engines, models (built under `work`, which outlives every benchmark's scratch folder) and one
    loop shared by the smokes run inside `with Session(work): ...`."""

    def __init__(self, work):
        self.work, self.engines, self.models, self.loop = work, {}, {}, None

    def __enter__(self):
        global SESSION
        if SESSION is not None:
            raise RuntimeError("a benchmark session is already open")
        self._env = {k: os.environ.get(k) for k in ("VLLM_ALLOW_INSECURE_SERIALIZATION",)}
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.loop = asyncio.new_event_loop()
        SESSION = self
        return self

    def __exit__(self, *exc):
        global SESSION
        SESSION = None
        try:
            for engine in self.engines.values():
                engine.shutdown()
        finally:
            close_loop(self.loop)
            for k, v in self._env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.engines.clear()


def engine_for(builder):
    """`builder.build_engine()` (sets `builder.engine`), or in a session the engine already serving
    its model."""
    if SESSION is None:
        return builder.build_engine()
    key = (builder.settings.model, builder.cfg.lora_rank)
    if key not in SESSION.engines:
        before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        # read by the EngineCore process as it starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            SESSION.engines[key] = builder.build_engine()
        finally:
            if before is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    builder.engine = SESSION.engines[key]
    return builder.engine


def event_loop():
    """A new event loop for the benchmark, or the session's."""
    return asyncio.new_event_loop() if SESSION is None else SESSION.loop


def release(engine, loop) -> None:
    """The benchmark is done with `engine` and `loop`: shut down and closed, unless the
    session's."""
    if SESSION is not None:
        return
    try:
        engine.shutdown()
    finally:
        close_loop(loop)


class _Thread(threading.Thread):
    """A helper run as a thread, with the process methods the benchmarks call (kill: nothing to
    kill)."""

    def kill(self):
        pass


def helper(ctx, target, args):
    """`ctx.Process(target=target, args=args)`, or in a session a daemon thread (not started)."""
    if SESSION is None:
        return ctx.Process(target=target, args=args)
    return _Thread(target=target, args=args, daemon=True)


def close_loop(loop) -> None:
    """Let the engine's output handler (cancelled by its shutdown) finish on `loop`, then close it:
    left pending, its ZMQ socket stays open and the interpreter hangs at exit."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (gather() of nothing would belong to another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
