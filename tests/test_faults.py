"""Signals, checkpoints and resume, for real: signals sent to a running train.py (its parent, or a
trainer rank), a checkpoint writer SIGKILLed mid-write, and a resumed run (on another number of
ranks) compared with an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from trainer import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-lag",
    "0",
    "--log-every",
    "1",
    "--eval-prompts",
    "16",
    "--eval-samples",
    "2",
]  # a small evaluation


def rows(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def start(out, *args):
    log = open(os.path.join(os.path.dirname(out), os.path.basename(out) + ".log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--out", out, *SMALL, *args],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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


def trainer_ranks(proc) -> list[int]:
    """The trainer ranks of a run: spawned children in the parent's process group (the generator has
    its own), started after the generator, trainer1 last."""
    import psutil

    return sorted(
        p.pid
        for p in psutil.Process(proc.pid).children()
        if "spawn_main" in " ".join(p.cmdline()) and os.getpgid(p.pid) == os.getpgid(proc.pid)
    )


def assert_nothing_left(family) -> None:
    import psutil

    deadline = time.monotonic() + 10  # torch_shm_manager exits on its own once its clients are gone
    while True:
        alive = [
            pid
            for pid in family
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
        ]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, [psutil.Process(pid).name() for pid in alive]


def test_sigterm_then_sigint_and_resumes_on_other_rank_counts_continue_an_uninterrupted_run(
    tmp_path,
):
    """SLURM sends SIGTERM to every process of a job step: SIGTERM (twice: the same stop, not a stop
    at once) to trainer rank 1 of a 2-rank run stops it after the step with a checkpoint, exit 143,
    nothing left running. Resume on 1 rank (the sharded checkpoint reshards), save and rotate well
    past the checkpoint resumed from (--keep-checkpoints 1), Ctrl-C (exit 130), resume again on 2
    ranks, finish: every step equals the uninterrupted (1-rank) run's, the final model loads, and
    with --kl-coef the reference stays the original model (were it the checkpoint, kl_ref would
    restart at 0 after each resume)."""
    import psutil
    from transformers import AutoModelForCausalLM

    steps, kl = 16, ["--kl-coef", "0.05", "--save-every", "2", "--keep-checkpoints", "1"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    # both at once: --max-lag 0 leaves cores idle
    full_proc, full_log = start(full, "--steps", str(steps), *kl)
    proc, log = start(cut, "--steps", str(steps), "--train-ranks", "2", *kl)
    wait_rows(cut, 3, proc)
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    ranks = trainer_ranks(proc)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGTERM)
    os.kill(ranks[1], signal.SIGTERM)
    t0 = time.monotonic()
    assert finish(proc, 90) == 143 and time.monotonic() - t0 < 60, open(log).read()[-3000:]
    text = open(log).read()
    assert "SIGTERM: stopping after the current step" in text and "--resume latest" in text
    assert_nothing_left(family)
    saved = checkpoint.list_checkpoints(checkpoint.checkpoint_root(cut))
    assert len(saved) == 1, "no checkpoint written on SIGTERM (or rotation kept more than one)"
    state = checkpoint.load_state(saved[-1])
    first_stop = state["step"]
    # max-lag 0: one version per step
    assert 3 <= first_stop <= steps - 8 and state["version"] == first_stop
    assert (
        state["base_model"] == os.path.abspath(os.path.join(cut, "init_model"))
        and state["world_size"] == 2
    )
    assert finish(full_proc, 300) == 0, open(full_log).read()[-3000:]
    reference = {r["step"]: r for r in rows(full)}

    # First resume, on 1 rank: several saves after the checkpoint
    # it resumed from, which rotation deletes; Ctrl-C.
    proc, log = start(cut, "--steps", str(steps), "--resume", "latest", "--train-ranks", "1", *kl)
    wait_rows(cut, first_stop + 5, proc)
    os.kill(proc.pid, signal.SIGINT)
    assert finish(proc, 90) == 130, open(log).read()[-3000:]
    assert "SIGINT" in open(log).read()
    assert not os.path.exists(saved[-1])
    second = checkpoint.list_checkpoints(checkpoint.checkpoint_root(cut))
    assert len(second) == 1 and checkpoint.load_state(second[0])["step"] > first_stop + 2
    # carried, not the checkpoint
    assert checkpoint.load_state(second[0])["base_model"] == state["base_model"]
    second_stop = checkpoint.load_state(second[0])["step"]
    assert second_stop <= steps - 2, "the run finished before Ctrl-C reached it"

    # Second resume, on 2 ranks, to the end.
    proc, log = start(cut, "--steps", str(steps), "--resume", "latest", "--train-ranks", "2", *kl)
    assert finish(proc, 300) == 0, open(log).read()[-3000:]
    resumed = rows(cut)
    assert [r["step"] for r in resumed] == list(range(steps))
    assert resumed[-1]["version"] == reference[steps - 1]["version"] == steps
    # the walk of prompts continued where it stopped: same epochs (and, below, the same rewards)
    assert [r["epoch"] for r in resumed] == [reference[s]["epoch"] for s in range(steps)]
    for step in (first_stop, second_stop, steps - 1):  # the first step of each resume, and the last
        # Same weights, optimizer state, (seeded) rollouts
        # and reference model: the uninterrupted run's step.
        assert resumed[step]["reward"] == pytest.approx(reference[step]["reward"], abs=1e-6)
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-3, abs=1e-5)
        assert reference[step]["kl_ref"] > 1e-5
        assert resumed[step]["kl_ref"] == pytest.approx(
            reference[step]["kl_ref"], rel=1e-2, abs=1e-7
        )
    summary = json.load(open(os.path.join(cut, "summary.json")))
    assert summary["steps"] == steps
    AutoModelForCausalLM.from_pretrained(os.path.join(cut, "model"))


WRITER = r"""
import sys, torch
sys.path.insert(0, {repo!r})
import config
from trainer import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=512, num_hidden_layers=6,
                                     num_attention_heads=8, num_key_value_heads=8,
                                     intermediate_size=2048))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.tensor([[1, 2, 3, 4]])
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
cfg = config.Config(out=sys.argv[1], keep_checkpoints=2)
n = 0
while True:  # each step written twice: the second write replaces the first
    step = 1 + n // 2
    checkpoint.save_trainer_state(model, optimizer, sys.argv[1], cfg, step=step, version=step,
                                  rank=0, save_group=None)
    print("saved", step, flush=True)
    n += 1
"""


def test_sigkill_while_writing_or_replacing_leaves_complete_checkpoints_only(tmp_path):
    """A kill inside a write, or inside the replacing of a checkpoint of the same step, leaves every
    step_* folder complete: the newest loads (model and optimizer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = str(tmp_path / "run")
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(repo=REPO))
    for delay in (0.2, 0.6):
        proc = subprocess.Popen(
            [sys.executable, str(script), out], stdout=subprocess.PIPE, text=True
        )
        for line in proc.stdout:  # wait for one complete checkpoint, then kill inside a later write
            if line.startswith("saved"):
                break
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=30)
        found = checkpoint.list_checkpoints(checkpoint.checkpoint_root(out))
        assert found
        latest = checkpoint.resolve("latest", out)
        state = checkpoint.load_state(latest)
        assert os.path.basename(latest) == f"step_{state['step']:08d}"
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=1000,
                hidden_size=512,
                num_hidden_layers=6,
                num_attention_heads=8,
                num_key_value_heads=8,
                intermediate_size=2048,
            )
        )
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoint.load_trainer_state(model, optimizer, latest, None)
        assert all(float(s["exp_avg"].abs().sum()) > 0 for s in optimizer.state.values())


def test_bad_model_inputs_get_one_clear_line(tmp_path):
    import config
    from run import prepare
    from tasks.builtin import build_tiny_model

    with pytest.raises(SystemExit, match="not a local directory"):
        prepare.prepare_model(config.Config(model="no-such-model-dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        prepare.prepare_model(config.Config(model=str(tmp_path / "empty")))
    path = build_tiny_model(str(tmp_path / "tiny"))
    prepare.check_tokenizer(path)  # the default model's tokenizer is fine
    config = json.loads((tmp_path / "tiny" / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="no eos token the model knows"):
        prepare.check_tokenizer(path)


def test_skipped_steps_spread_over_a_run_keep_generation_flowing_and_are_counted(tmp_path):
    """A reward of 1e38 (finite, so no reward fault) with unscaled advantages overflows the loss:
    such a step is skipped (no update, no new version) and counted. 4 of 8 steps, every other one,
    with --max-lag 0: the generator's staleness gate must count versions, not steps (counting steps,
    the first skip would leave no group allowed to start and the run would die waiting for one)."""
    from tasks.builtin import build_tiny_model

    model = build_tiny_model(str(tmp_path / "ascii"), alphabet="ascii")
    (tmp_path / "huge.py").write_text(
        "calls = 0\n\n\n"
        "def huge(completions, **kwargs):  # one call per group, 2 groups per step, steps in order "
        "(--max-lag 0)\n    global calls\n    step, calls = calls // 2, calls + 1\n"
        "    return [(1e38 if step % 2 == 0 else 1.0) if i % 2 else 0.0 for i in "
        "range(len(completions))]\n"
    )
    out = str(tmp_path / "run")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--out",
            out,
            "--model",
            model,
            "--dataset",
            "tasks/data/gsm8k_sample.jsonl",
            "--prompt-column",
            "question",
            "--reward",
            f"{tmp_path / 'huge.py'}:huge",
            "--adv-scale",
            "none",
            "--max-bad-steps",
            "10",
            "--max-lag",
            "0",
            "--eval-every",
            "0",
            "--timeout-s",
            "60",
            "--steps",
            "8",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "8",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = rows(out)
    assert [r["skipped"] for r in logged] == [True, False] * 4
    assert [r["version"] for r in logged] == [(step + 1) // 2 for step in range(8)]
    assert all(r["lag_max"] == 0 for r in logged)
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["bad_steps"] == 4


def test_more_bad_steps_than_allowed_stop_the_run_with_the_reason():
    """A bad step is a step with any update skipped (not each skipped update); the (N+1)-th stops
    the run."""
    import train

    r = train.Rank.__new__(train.Rank)
    r.cfg, r.bad_steps = SimpleNamespace(max_bad_steps=2), 0
    train.count_bad_steps(r, 4)  # one step of --mini-batches 4, every update skipped: one bad step
    train.count_bad_steps(r, 0)
    train.count_bad_steps(r, 1)
    assert r.bad_steps == 2
    with pytest.raises(
        RuntimeError, match="3 steps with NaN/inf loss or gradients .--max-bad-steps 2."
    ):
        train.count_bad_steps(r, 1)


def test_a_model_vllms_cpu_backend_cannot_run_is_refused_before_anything_starts(tmp_path, capsys):
    """Head size 16 (hidden 64, 4 heads): vLLM's CPU attention would start and then fail at the
    first forward, inside its worker. The parent refuses it first, in one line; nothing is
    spawned."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    import train
    from infra import devices
    from tasks.builtin import build_tiny_model

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == devices.CPU_ATTENTION_HEAD_SIZES
    model = build_tiny_model(str(tmp_path / "head16"), hidden=64, heads=4)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main(["--model", model, "--out", str(out), "--steps", "1"])
    message = str(err.value)
    assert message.startswith("error: ") and "head size 16" in message and "\n" not in message
    assert not (out / "metrics.jsonl").exists() and not (out / "config.json").exists()
    # the other limits found from config.json: a context the model was not built for, a KV cache too
    # small for one sequence (the default tiny model: 64 positions, 2 layers x 4 heads x 32 dims)
    tiny = build_tiny_model(str(tmp_path / "tiny"))
    assert devices.engine_problems(tiny, False, 0, 5, 256, "fp32") == []
    [long] = devices.engine_problems(tiny, False, 100, 5, 256, "fp32")
    assert "--max-model-len 100" in long and "max_position_embeddings 64" in long
    [full] = devices.engine_problems(tiny, False, 0, 64, 256, "fp32")
    assert "--max-new-tokens 64" in full
    # 64 x 1 KB per token x 64 tokens = 4 MB
    deep = build_tiny_model(str(tmp_path / "deep"), layers=64)
    [kv] = devices.engine_problems(deep, False, 0, 5, 3, "fp32")
    assert "--kv-cache-mb 3" in kv and "at least 4 MB" in kv
    assert devices.engine_problems(deep, False, 0, 5, 3, "bf16") == []  # bf16 halves the KV cache
    assert devices.engine_problems(model, True, 0, 5, 256, "bf16") == []  # GPUs run head size 16


def _kill_myself():
    os.kill(os.getpid(), signal.SIGKILL)


def _raise():
    raise ValueError("not a memory problem")


def _idle():
    time.sleep(10)  # outlives the victim (it fails at once); the run then waits for it to end


@pytest.mark.parametrize(
    "victim,how,flag",
    [
        ("trainer0", "sigkill", "--micro-batch-tokens"),
        ("generator", "sigkill", "--kv-cache-mb"),
        ("trainer0", "raise", None),
    ],
)
def test_a_child_killed_by_the_kernel_is_reported_as_memory_with_the_flag_that_lowers_it(
    victim, how, flag, capsys
):
    """A SIGKILL the run did not send (here the child sends it to itself, as the OOM killer would)
    gets a line naming memory and the flag; an ordinary failure does not."""
    import torch.multiprocessing as mp

    from infra import processes

    ctx = mp.get_context("spawn")
    fail = _kill_myself if how == "sigkill" else _raise
    children = {
        "generator": (fail if victim == "generator" else _idle, (), True),
        "trainer0": (fail if victim == "trainer0" else _idle, (), False),
    }
    t0 = time.monotonic()
    code = processes.run_children(ctx, children, ctx.Queue(), processes.make_control(ctx))
    err = capsys.readouterr().err
    assert code == 1 and time.monotonic() - t0 < 60
    if how == "sigkill":
        assert f"error: {victim} died (signal SIGKILL)" in err
        assert "memory" in err and flag in err, err
    else:
        assert "error: trainer0 died (exit code 1)" in err and "not a memory problem" in err
        assert "memory" not in err.replace("not a memory problem", "")


ORPHAN_SCRIPT = """
import subprocess, sys, time
import torch.multiprocessing as mp
from infra import processes

# its own process group, with a process of its own inside it (as vLLM's EngineCore)
def generator():
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("engine", engine.pid, flush=True)
    time.sleep(120)

def trainer():
    time.sleep(120)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    children = {"generator": (generator, (), True), "trainer0": (trainer, (), False)}
    processes.run_children(ctx, children, ctx.Queue(), processes.make_control(ctx))
"""


def test_a_run_whose_parent_is_killed_leaves_no_process_behind(tmp_path):
    """SIGKILL of the run's parent (a CI timeout, the OOM killer) ends its children and what they
    started (a generator's group holds vLLM's EngineCore): nothing is left running, reparented to
    init."""
    import psutil

    script = tmp_path / "run.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    line = parent.stdout.readline()  # the grandchild is up: every process of the run exists now
    assert line.startswith("engine"), line
    family = psutil.Process(parent.pid).children(recursive=True)
    assert len(family) >= 3 and int(line.split()[1]) in {p.pid for p in family}
    parent.kill()
    parent.wait(timeout=10)
    gone, alive = psutil.wait_procs(family, timeout=20)
    for proc in alive:
        proc.kill()
    assert not alive, f"left running after the parent died: {[p.pid for p in alive]}"
