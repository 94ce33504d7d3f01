"""Fixtures that more than one test module uses.

`recorded_run`: one real `python train.py` run of 12 steps (4 prompts x 4, on-policy, two
evaluations), made by `bench/peak_rss.py --smoke`, which also measures its memory.
tests/test_bench.py replays it for every benchmark's train.py run; tests/test_trace.py reads its
trace. Made once per session, on first use; vLLM runs without a worker process beside its EngineCore
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as bench/engines.py's: half the start-up).

Every vLLM engine the suite starts (train.py's generator, the engines in test processes) runs its
worker inside its EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor a one-GPU run
uses too): on CPU vLLM otherwise starts a worker process of its own beside the EngineCore, 8-11 s of
each train.py run's start on 2 cores. test_pipeline's SIGKILL test runs the CPU default (a worker
process) to check that tree.
"""

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read by vLLM as each engine starts


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """(the run's OUT folder, peak_rss's figures)."""
    sys.path.insert(0, str(REPO / "bench"))
    import peak_rss

    where = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        assert (
            peak_rss.main(
                [
                    "--smoke",
                    "--out",
                    str(where / "peak_rss.json"),
                    "--",
                    "--out",
                    str(where / "run"),
                ]
            )
            == 0
        )
    return where / "run", json.loads((where / "peak_rss.json").read_text())
