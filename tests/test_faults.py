"""Signals, checkpoints and resume, for real: signals sent to a running train.py, a checkpoint writer
SIGKILLed mid-write, and a resumed run compared with an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-lag", "0", "--log-every", "1"]


def rows(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def start(out, *args):
    log = open(os.path.join(os.path.dirname(out), os.path.basename(out) + ".log"), "w")
    proc = subprocess.Popen([sys.executable, "train.py", "--out", out, *SMALL, *args], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log.name


def finish(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def wait_rows(out, n, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while len(rows(out)) < n:
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, f"no {n} metrics rows after {timeout} s"
        time.sleep(0.2)


def test_sigint_checkpoints_and_resume_continues_like_an_uninterrupted_run(tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    proc, _ = start(full, "--steps", "8")
    assert finish(proc, 300) == 0
    reference = {r["step"]: r for r in rows(full)}

    proc, log = start(cut, "--steps", "8")
    wait_rows(cut, 3, proc)
    os.kill(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    code = finish(proc, 60)
    assert code == 130 and time.monotonic() - t0 < 30
    text = open(log).read()
    assert "SIGINT" in text and "--resume latest" in text
    saved = checkpoint.list_checkpoints(checkpoint.checkpoint_root(cut))
    assert saved, "no checkpoint written on SIGINT"
    state = checkpoint.load_state(saved[-1])
    stopped_at = state["step"]
    assert 3 <= stopped_at < 8 and state["version"] == stopped_at  # max-lag 0: one version per step

    proc, log = start(cut, "--steps", "8", "--resume", "latest")
    assert finish(proc, 300) == 0, open(log).read()[-3000:]
    resumed = rows(cut)
    assert [r["step"] for r in resumed] == list(range(8))
    assert resumed[-1]["version"] == reference[7]["version"] == 8
    # the walk of prompts continued where it stopped: same epochs (and, below, the same rewards)
    assert [r["epoch"] for r in resumed] == [reference[s]["epoch"] for s in range(8)]
    first_new = resumed[stopped_at]
    # Same weights, optimizer state and (seeded) rollouts: the next loss is the uninterrupted run's.
    assert first_new["reward"] == pytest.approx(reference[stopped_at]["reward"], abs=1e-6)
    assert first_new["loss"] == pytest.approx(reference[stopped_at]["loss"], rel=1e-3, abs=1e-5)
    summary = json.load(open(os.path.join(cut, "summary.json")))
    assert summary["steps"] == 8


def test_sigterm_stops_with_a_checkpoint_and_nothing_left(tmp_path):
    import psutil

    out = str(tmp_path / "run")
    proc, log = start(out, "--steps", "1000")
    wait_rows(out, 2, proc)
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.kill(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    assert finish(proc, 60) == 143 and time.monotonic() - t0 < 30
    assert checkpoint.list_checkpoints(checkpoint.checkpoint_root(out))
    deadline = time.monotonic() + 10  # torch_shm_manager exits on its own once its clients are gone
    while True:
        alive = [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, [psutil.Process(pid).name() for pid in alive]


WRITER = r"""
import sys, torch
sys.path.insert(0, {repo!r})
import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM
base = sys.argv[1]
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=512, num_hidden_layers=6,
                                     num_attention_heads=8, num_key_value_heads=8, intermediate_size=2048))
model.save_pretrained(base)
from rollout import build_tiny_model
from transformers import AutoTokenizer
build_tiny_model(base + "-tok")
AutoTokenizer.from_pretrained(base + "-tok").save_pretrained(base)
state = model.state_dict()
optimizer = {{"state": {{k: {{"exp_avg": v.clone()}} for k, v in list(state.items())[:20]}}}}
step = 0
while True:
    step += 1
    checkpoint.save(sys.argv[2], step, step, state, optimizer, base, {{"step": step}}, keep=2)
    print("saved", step, flush=True)
"""


def test_sigkill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
    from transformers import AutoModelForCausalLM

    root = str(tmp_path / "ckpts")
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(repo=REPO))
    for delay in (0.15, 0.45):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "base"), root],
                                stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:  # wait for one complete checkpoint, then kill inside a later write
            if line.startswith("saved"):
                break
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=30)
        found = checkpoint.list_checkpoints(root)
        assert found
        latest = found[-1]
        state = checkpoint.load_state(latest)
        assert os.path.basename(latest) == f"step_{state['step']:08d}"
        AutoModelForCausalLM.from_pretrained(os.path.join(latest, "model"))
        torch.load(os.path.join(latest, "optimizer.pt"), weights_only=False)


def test_bad_model_inputs_get_one_clear_line(tmp_path):
    import train
    from rollout import build_tiny_model

    with pytest.raises(SystemExit, match="not a local directory"):
        train.prepare_model(train.Config(model="no-such-model-dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        train.prepare_model(train.Config(model=str(tmp_path / "empty")))
    path = build_tiny_model(str(tmp_path / "tiny"))
    train.check_tokenizer(path)  # the default model's tokenizer is fine
    config = json.loads((tmp_path / "tiny" / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="no eos token the model knows"):
        train.check_tokenizer(path)


def test_inf_loss_steps_are_skipped_counted_then_stop_the_run(tmp_path):
    """A reward of 1e38 (finite, so no reward fault) with unscaled advantages overflows the loss: each such
    step is skipped and counted, and more than --max-bad-steps of them stop the run with the reason."""
    from rollout import build_tiny_model

    model = build_tiny_model(str(tmp_path / "ascii"), alphabet="ascii")
    (tmp_path / "huge.py").write_text(
        "def huge(completions, **kwargs):\n    return [1e38 if i % 2 else 0.0 for i in range(len(completions))]\n")
    out = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "train.py", "--out", out, "--model", model, "--dataset",
                           "data/gsm8k_sample.jsonl", "--prompt-column", "question", "--reward",
                           f"{tmp_path / 'huge.py'}:huge", "--adv-scale", "none", "--max-bad-steps", "2",
                           "--steps", "20", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "3 steps with NaN/inf loss or gradients" in proc.stderr
    logged = rows(out)
    assert len(logged) == 2 and all(r["skipped"] for r in logged)
    assert all(r["version"] == 0 for r in logged)  # no optimizer step was taken, nothing was published
