"""Fixtures that more than one test module uses.

`recorded_run`: one real `python train.py` run of 12 steps (4 prompts x 4, on-policy, two
evaluations), made by `bench/memory.py --what peak_rss --smoke`, which also measures its memory.
tests/test_bench.py replays it for every benchmark's train.py run; tests/test_trace.py reads its
trace. Made once per session, on first use.

Every vLLM engine the suite starts (train.py's generator, the engines in test processes) runs its
worker inside its EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor a one-GPU run
uses too): on CPU vLLM otherwise starts a worker process of its own beside the EngineCore, 8-11 s of
each train.py run's start on 2 cores. test_pipeline's SIGKILL test runs the CPU default (a worker
process) to check that tree.

`start_run`: starts `python train.py` runs (tests/runs.py's `Run`) and, whatever happened in the
test, kills what is left of them after it (tests/test_pipeline.py, tests/test_multinode.py).

`ascii_model`, `tokenizer`: the tiny model with a printable-ASCII tokenizer and a chat template,
saved as a Hugging Face directory, and its tokenizer; one per test module (module scope: a module
may change what it was given without reaching another's), for tests/test_data.py, test_eval.py,
test_tools.py and test_reasoning_gym.py.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from runs import Run

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read by vLLM as each engine starts


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """(the run's OUT folder, peak_rss's figures)."""
    sys.path.insert(0, str(REPO / "bench"))
    import memory

    where = tmp_path_factory.mktemp("recorded")
    assert (
        memory.main(
            [
                "--what",
                "peak_rss",
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


@pytest.fixture
def start_run(tmp_path):
    runs = []

    def start(*args, name="run", launcher=(), env=None):
        run = Run(tmp_path / name, *args, launcher=launcher, env=env)
        runs.append(run)
        return run

    yield start
    for run in runs:  # whatever happened in the test, leave nothing of ours running
        run.kill_all()


@pytest.fixture(scope="module")
def ascii_model(tmp_path_factory):
    """The tiny model with a printable-ASCII tokenizer and a chat template, saved as a HF
    directory."""
    from tasks import builtin

    path = tmp_path_factory.mktemp("models") / "tiny_ascii"
    return builtin.build_tiny_model(str(path), alphabet="ascii")


@pytest.fixture(scope="module")
def tokenizer(ascii_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ascii_model)
