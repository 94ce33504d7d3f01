"""tests/spawned.py — run a test's engine work in one spawned child and take its one result.

Role: the engine checks of test_heads.py, test_moe.py, test_agreement.py and test_real_models.py
start vLLM engines in one child process (each engine in-process there, built by `served_llm` as the
generator serves a model), so a crash or hang in vLLM fails the test instead of the pytest process.
Data contract: `target(*args)` returns one picklable value; its exception fails the test with its
traceback.
May touch: PYTHONPATH (the repository, so the child finds vllm_worker by name).
"""

import gc
import os
import queue as queue_lib
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def served_llm(path: str, kv_cache_mb: int = 32, max_model_len: int = 64, **options):
    """In the child: an offline vLLM engine on the model at `path` as the generator serves it (fp32,
    eager, log-probs after temperature/top-k/top-p, the project's worker extension for weight
    loads from the shared buffer); `options`: further LLM keywords."""
    import torch
    from vllm import LLM

    return LLM(
        model=path,
        tokenizer=path,
        dtype=torch.float32,
        seed=0,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
        kv_cache_memory_bytes=kv_cache_mb * 2**20,
        max_model_len=max_model_len,
        **options,
    )


def run_and_report(target, args: tuple, results) -> None:
    """In the child: ("ok", target(*args)) or ("error", its traceback) on `results`."""
    try:
        results.put(("ok", target(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def end_in_process_engine() -> None:
    """Release an in-process vLLM engine (after `del` of the last reference) so the next one can
    start."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def result_of_child(target, args: tuple, timeout_s: float):
    """`target`'s value from a spawned child; the test fails with the child's error, or after
    `timeout_s`."""
    import torch.multiprocessing as mp

    # The child finds vllm_worker by name through the repository on its path.
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=run_and_report, args=(target, args, results))
    child.start()
    try:
        status, value = results.get(timeout=timeout_s)
    except queue_lib.Empty:
        status, value = "error", f"no result in {timeout_s} s (exit code {child.exitcode})"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert status == "ok", value
    return value
