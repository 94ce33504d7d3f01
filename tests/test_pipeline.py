"""End to end: `python train.py` with the real vLLM generator and real FSDP2 trainers, as
subprocesses.

Each test is one small run (each costs a vLLM engine start, ~20 s here), so the runs are few and
short:
- `--max-lag 0` is exactly on-policy, the summary is complete, and the saved model loads and
  generates.
- `--max-lag 1` (drain and inflight weight updates): no trained token is more than one version old.
- `--dtype bf16`: trainer and generator agree within a measured bound the importance correction
  absorbs; syncs move bf16; the final model is fp32; prompts over `--max-model-len` are skipped and
  counted.
- a child that raises (the generator, at engine start) ends the run promptly, non-zero, with its
  traceback.
- SIGKILL of the generator, or of a trainer rank, mid-run ends the run non-zero with nothing
  orphaned.
After every run, every process the run started (recorded while it ran: trainers, generator, vLLM's
EngineCore and workers, helpers) must be gone.

The run harness (`Run`, `finish_ok`, `SMALL`) is tests/runs.py; the `start_run` fixture,
tests/conftest.py.
"""

import os
import signal
import time
from pathlib import Path

import pytest
from runs import RUN_TIMEOUT_S, SMALL, Run, finish_ok, gone, is_engine_core

REPO = Path(__file__).resolve().parent.parent
SUMMARY_FIELDS = (
    "steps",
    "wall_s",
    "reward_first10",
    "reward_last20",
    "tokens_trained",
    "max_token_lag",
    "dropped_stale",
    "trainer_wait_frac",
    "generator_wait_frac",
    "sync_ms_median",
    "gen_tokens_per_s",
    "train_tokens_per_s",
    "logprob_diff_after_sync",
    "eval_first",
    "eval_last",
    "config",
)


def test_max_lag_0_is_on_policy_and_saves_a_usable_model(start_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = 6
    # classic synchronous PPO: two optimizer steps per rollout batch, every batch sampled by the
    # weights its first update starts from, nothing dropped as stale
    run = start_run(
        "--steps",
        str(steps),
        "--max-lag",
        "0",
        "--mini-batches",
        "2",
        "--eval-every",
        "3",
        "--eval-samples",
        "2",
        *SMALL,
    )
    rows, summary = finish_ok(run, steps)
    assert all(r["updates"] == 2 and r["version"] == r["step"] + 1 for r in rows)

    # held-out evaluations at step 0, 3 and the end; the last one waited for, in the last row
    evals = [r for r in rows if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [0, 3, 6] and rows[-1]["eval/step"] == 6
    # on-policy: version = steps done
    assert all(r["eval/version"] == r["eval/step"] for r in evals)
    assert all(
        r["eval/prompts"] == 16 and 0 <= r["eval/greedy_pass@1"] <= r["eval/pass@2"] <= 1
        for r in evals
    )
    assert summary["eval_first"] == evals[0]["eval/greedy_pass@1"]
    assert summary["eval_last"] == evals[-1]["eval/greedy_pass@1"]
    assert [r["epoch"] for r in rows] == [0] * steps and summary["train_prompts"] > 800

    for field in SUMMARY_FIELDS:
        assert field in summary, f"summary.json lacks {field}"
    for field in SUMMARY_FIELDS[:-1]:
        if field not in ("reward_first10", "reward_last20", "logprob_diff_after_sync"):
            assert summary[field] is not None, f"summary {field} is None"
    assert summary["config"]["max_lag"] == 0 and summary["config"]["steps"] == steps
    assert (
        summary["wall_s"] > 0
        and summary["gen_tokens_per_s"] > 0
        and summary["train_tokens_per_s"] > 0
    )
    assert 0 <= summary["trainer_wait_frac"] <= 1 and 0 <= summary["generator_wait_frac"] <= 1

    # a quiet terminal: progress lines, no per-sync vLLM
    # log, no expected reload warnings, no progress bars
    terminal = run.stdout_path.read_text() + run.stderr_path.read_text()
    assert f"step {steps}/{steps}" in terminal and "done:" in terminal
    for noise in (
        "setting pause state",
        "Reloading weights",
        "Failed to load weights",
        "Loading weights:",
        "Writing model shards",
        "Successfully reset prefix cache",
    ):
        assert noise not in terminal, noise
    assert len(terminal.splitlines()) < 40, terminal

    # strictly on-policy: every trained token was sampled by the weights being trained
    assert all(r["lag_max"] == 0 and r["lag_mean"] == 0 for r in rows), [r["lag_max"] for r in rows]
    assert all(r["fresh_token_frac"] == 1.0 for r in rows)
    assert summary["max_token_lag"] == 0 and summary["dropped_stale"] == 0
    # right after each sync the trainer and the generator agree on the log-probs of the same tokens
    diffs = [r["logprob_diff_on_policy"] for r in rows]
    assert all(d is not None and 0 <= d < 1e-4 for d in diffs), diffs
    assert (
        summary["logprob_diff_after_sync"] is not None and summary["logprob_diff_after_sync"] < 1e-4
    )
    assert summary["logprob_diff_after_sync"] == pytest.approx(max(diffs))

    # the final model is a Hugging Face model that loads and generates, and it was trained
    model_dir = run.out / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("<bos>abc=", add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(
            **prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    prompt_len = prompt["input_ids"].shape[1]
    assert generated.shape[0] == 1 and prompt_len < generated.shape[1] <= prompt_len + 4
    assert torch.equal(generated[0, : prompt["input_ids"].shape[1]], prompt["input_ids"][0])
    initial = AutoModelForCausalLM.from_pretrained(run.out / "init_model", dtype=torch.float32)
    trained = model.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in initial.state_dict().items()), (
        "weights never changed"
    )


def test_max_lag_1_bounds_staleness(start_run):
    """--update-mode inflight; the same bound with --update-mode drain is asserted by
    test_multinode's two-node run (the same generator)."""
    steps, update_mode = 8, "inflight"
    run = start_run(
        "--steps",
        str(steps),
        "--max-lag",
        "1",
        "--queue-size",
        "8",
        "--update-mode",
        update_mode,
        *SMALL,
        "--log-level",
        "info",
    )
    rows, summary = finish_ok(run, steps)
    terminal = run.stdout_path.read_text() + run.stderr_path.read_text()
    # vLLM's own log comes back on request (by default: test above)
    assert "setting pause state" in terminal
    # expected at every sync: dropped at the source either way
    assert "Failed to load weights" not in terminal

    assert summary["config"]["max_lag"] == 1 and summary["config"]["update_mode"] == update_mode
    lags = [r["lag_max"] for r in rows]
    assert all(0 <= lag <= 1 for lag in lags), lags
    assert summary["max_token_lag"] <= 1
    # the run was really asynchronous: the generator ran
    # ahead, so some trained tokens were one version old
    assert 1 in lags, (
        f"no stale token at all with --max-lag 1: the test did not exercise the bound ({lags})"
    )
    assert sum(r["dropped_stale"] for r in rows) == summary["dropped_stale"]
    diff = summary["logprob_diff_after_sync"]
    assert diff is None or diff < 1e-4


def test_child_that_raises_ends_the_run_with_its_traceback(start_run, tmp_path):
    """A model whose KV cache cannot hold one sequence in 1 MB: vLLM raises inside the generator
    process (EngineCore fails, AsyncLLM raises), after every process of the run has started. (An
    env task: its cache is left as given, where a dataset's would be sized up to its prompts.)"""
    from tasks.builtin import build_tiny_model

    model = build_tiny_model(str(tmp_path / "deep_model"), seed=0, layers=16)
    run = start_run(
        *("--steps", "50", "--kv-cache-mb", "1", "--model", model, "--task", "reveal"), *SMALL
    )
    code = run.wait(60)
    elapsed = time.monotonic() - run.start
    err = run.stderr()
    assert code != 0, f"the run succeeded?\n{run.tail()}"
    assert elapsed < 60
    assert "error: generator died (exit code 1)" in err, run.tail()
    assert "--- traceback from generator ---" in err, run.tail()
    report = err[err.index("--- traceback from generator ---") :]
    assert (
        "Traceback (most recent call last)" in report
        and "Engine core initialization failed" in report
    )
    assert "rollout.py" in report and "build_engine" in report  # the generator's own frames
    assert len(run.seen) >= 3  # the trainer and the generator had really started
    assert run.leftovers(grace_s=5) == [], "processes of the failed run outlived it"
    assert not (run.out / "summary.json").exists()


# The trainer/generator log-prob difference on on-policy tokens in bf16. Measured on the
# default model (python bench/training.py --what dtype, 2 x 60 on-policy steps): max
# 0.022, mean 0.0010 (fp32: max 1.4e-6); bench/README.md. bf16 keeps 8 significant bits
# (a relative rounding of 2^-9 per operation) and the two sides round in different orders
# (vLLM's CPU kernels against torch's), so logits of a few units differ by ~1e-2. 0.1
# leaves 4.5x over the largest difference measured and is still 7x inside the importance
# correction's window (|log rho| <= log 2 = 0.69 for the default --is-high 2): no
# on-policy token is masked (--is-mode mask) or truncated (truncate) for bf16 noise.
BF16_LOGPROB_DIFF_BOUND = 0.1


def test_bf16_run_agrees_within_the_correction_syncs_half_the_bytes_and_skips_long_prompts(
    start_run, tmp_path
):
    """--dtype bf16, on policy, with the sharded bf16 reference (--kl-coef) and --is-mode mask, on a
    dataset whose longer prompts do not fit --max-model-len."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.builtin import build_tiny_model

    model = build_tiny_model(str(tmp_path / "ascii"), alphabet="ascii")
    (tmp_path / "letters.py").write_text(
        "def letters(completions, **kwargs):\n    return [sum(c.isalpha() for c in t) / 8 for t in "
        "completions]\n"
    )
    steps = 6
    run = start_run(
        "--steps",
        str(steps),
        "--dtype",
        "bf16",
        "--max-lag",
        "0",
        "--is-mode",
        "mask",
        "--kl-coef",
        "0.01",
        "--model",
        model,
        "--dataset",
        str(REPO / "tasks" / "data" / "gsm8k_sample.jsonl"),
        "--prompt-column",
        "question",
        "--reward",
        f"{tmp_path / 'letters.py'}:letters",
        "--max-model-len",
        "110",
        "--max-new-tokens",
        "8",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
    )
    rows, summary = finish_ok(run, steps)
    assert summary["config"]["dtype"] == "bf16"
    diffs = [r["logprob_diff_on_policy"] for r in rows]
    assert all(d is not None and d < BF16_LOGPROB_DIFF_BOUND for d in diffs), diffs
    # measured: 0.001
    assert all(r["logprob_diff_mean"] < BF16_LOGPROB_DIFF_BOUND / 5 for r in rows)
    assert max(diffs) > 1e-6, (
        "bf16 should not agree to fp32 precision: did the run really use bf16?"
    )
    assert all(r["is_weight_mean"] == 1.0 for r in rows), (
        "on-policy tokens were masked for bf16 noise"
    )
    assert all(abs(r["kl_ref"]) < 0.01 for r in rows[:1])  # the reference starts as the policy
    # the buffer holds bf16: one sync moves 2 bytes per parameter
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    params = sum(p.numel() for p in skeleton.parameters())  # tied embeddings once, as in the buffer
    assert summary["sync_mb"] == pytest.approx(params * 2 / 2**20)
    # the final model is the fp32 master weights
    with safe_open(str(run.out / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    # prompts longer than 110 - 8 tokens were skipped and counted; the others trained
    assert 0 < summary["prompts_dropped_long"] < 32


def _generator_and_trainers(run: Run):
    """The parent's multiprocessing children: the generator is the one leading its own process
    group."""
    generator, trainers = None, []
    for child in run.root.children():
        if "spawn_main" not in " ".join(child.cmdline()):
            continue  # torch_shm_manager (also its own group leader), the resource tracker
        if os.getpgid(child.pid) == child.pid:
            generator = child
        else:
            trainers.append(child)
    return generator, trainers


# (A SIGKILLed generator or trainer process: its report is test_faults' kernel-kill test; the
# generator's EngineCore reaped when the parent stops the generator, test_faults' SIGTERM-and-resume
# test ("nothing left"); a SIGKILLed real trainer rank, test_multinode's trainer-killed test. Each
# vLLM run costs ~40 s of suite time.)
@pytest.mark.parametrize("victim", ["engine_core"])
def test_sigkill_of_a_child_ends_the_run_with_nothing_left(victim, start_run):
    # vLLM's CPU default (tests/conftest.py sets the other): a worker process beside the EngineCore,
    # the tree a CPU run has, must be gone too
    run = start_run(
        "--steps", "1000", "--max-lag", "1", *SMALL, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    )
    run.wait_rows(2, timeout=RUN_TIMEOUT_S)
    generator, trainers = _generator_and_trainers(run)
    assert generator is not None and len(trainers) == 1, f"{generator} {trainers}"
    recorded = {pid: run.names[pid] for pid, p in run.seen.items() if not gone(p)}
    engine_cores = [pid for pid, name in recorded.items() if is_engine_core(name)]
    # its worker
    assert any(name.startswith("VLLM::Worker") for name in recorded.values()), recorded
    assert engine_cores and all(
        run.seen[pid] in generator.children(recursive=True) for pid in engine_cores
    )

    target = {"generator": generator, "trainer0": trainers[0]}.get(victim) or run.seen[
        engine_cores[0]
    ]
    killed_at = time.monotonic()
    os.kill(target.pid, signal.SIGKILL)
    code = run.wait(30)
    assert time.monotonic() - killed_at < 30
    assert code != 0
    err = run.stderr()
    # vLLM's own process: the generator notices and fails with the reason
    if victim == "engine_core":
        assert "error: generator died" in err and "EngineDeadError" in err, run.tail()
    else:
        assert f"error: {victim} died (signal SIGKILL)" in err, run.tail()
    assert run.leftovers(grace_s=5) == [], (
        f"orphans after killing the {victim} (recorded: {recorded})"
    )
    if victim == "trainer0":
        assert not (run.out / "summary.json").exists()
    else:  # the trainer outlives the failure: it stops cleanly and keeps what it learned
        assert list((run.out / "checkpoints").glob("step_*/dcp/.metadata")), run.tail()
