"""tests/spawned.py — run a test's engine work in one spawned child and take its one result.

Role: the engine checks of test_heads.py and test_moe.py start several vLLM engines in one child process (each
engine in-process there), so a crash or hang in vLLM fails the test instead of the pytest process.
Data contract: `target(*args, results)` puts one ("ok", value) or ("error", text) on `results`.
May touch: PYTHONPATH (the repository, so the child finds vllm_worker by name).
"""
import os
import queue as queue_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def result_of_child(target, args: tuple, timeout_s: float):
    """`target`'s value from a spawned child; the test fails with the child's error, or after `timeout_s`."""
    import torch.multiprocessing as mp

    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])  # vllm_worker by name
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
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
