"""LoRA (`--lora-rank`): only the adapter trains; the real vLLM engine serves the adapter the
trainer publishes (in place, versioned like full weights) and agrees with the trainer's log-probs;
checkpoints and the final adapter are PEFT folders; a resumed run continues like an uninterrupted
one; --merge-at-end."""

import asyncio
import json
import os
import queue as queue_lib
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
from test_engine import settings_for, wait_until

from generator.shared_weights import SharedWeights
from infra import processes
from rollout import Generator
from run import flag_checks
from tasks.builtin import build_tiny_model
from trainer import checkpoint, lora, models

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
CONFIG = dict(rank=8, alpha=16, dropout=0.0, targets="all-linear")
PROMPTS = [[1, 13, 14, 15, 25], [1, 20, 21, 13, 25], [1, 16, 16, 22, 25]]  # <bos>abc= and the like


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"), seed=0)


def peft_model(path, b_scale=0.0, seed=1):
    """The base model with a LoRA adapter (B ~ N(0, b_scale): 0 is PEFT's initial, no-op
    adapter)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora.peft_config(**CONFIG)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_scale) if b_scale else p.zero_()
    return model.eval()


def adapter_tensors(model):
    return {
        lora.file_name(n): p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def test_only_the_adapter_trains_and_matches_the_buffer_layout(base_model):
    import torch.distributed as dist

    init_file = tempfile.mktemp(prefix="asyncgrpo-test-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(
            base_model, 1, lora_config=lora.peft_config(**CONFIG), seed=0
        )
        synced = lora.synced_parameters(model)
        shapes, _ = lora.adapter_shapes(base_model, lora.peft_config(**CONFIG))
        # the parent sizes the shared buffer from a meta
        # skeleton: same names, same order, same shapes
        assert [(n, tuple(p.shape)) for n, p in synced] == shapes
        assert all(".lora_A." in n or ".lora_B." in n for n, _ in synced) and len(synced) == 28
        optimizer = torch.optim.AdamW([p for _, p in synced], lr=1e-2)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        ids = torch.randint(3, 26, (4, 7))
        for _ in range(2):  # B starts at zero, so A gets a gradient only from the second step on
            loss = torch.log_softmax(model(input_ids=ids).logits, -1)[..., 5].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        changed = {
            n for n, p in model.named_parameters() if not torch.equal(before[n], p.full_tensor())
        }
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert changed == trainable, f"changed but frozen: {sorted(changed - trainable)[:3]}"
        assert len(optimizer.state) == len(synced)  # optimizer state for the adapter only
    finally:
        dist.destroy_process_group()
        os.path.exists(init_file) and os.unlink(init_file)


def test_generator_serves_each_published_adapter_and_agrees_with_the_trainer(base_model, tmp_path):
    """Adapters swapped every 40 ms while requests are mid-generation: every token's vLLM log-prob
    is the trainer's under the adapter its version tag names (per token, also within completions
    that span swaps), the two adapters give different distributions, and a PEFT folder serves like
    the merged model."""
    # vLLM's worker imports the extension (vllm_worker.WeightSyncWorker)
    os.environ["PYTHONPATH"] = REPO
    shapes, resolved = lora.adapter_shapes(base_model, lora.peft_config(**CONFIG))
    lora_dir = lora.write_config(resolved, base_model, str(tmp_path / "adapter_config"))
    shared = SharedWeights.allocate(shapes, starts_empty=True)  # as prepare.run_weights: an adapter
    settings = settings_for(
        base_model,
        group_size=4,
        prompts_per_step=4,
        max_new_tokens=16,
        max_lag=10**6,
        kv_cache_mb=64,
        initial_version=1,
        lora_rank=8,
        lora_dir=lora_dir,
    )
    ctx = mp.get_context("spawn")
    gen = Generator(settings, shared, ctx.Queue(), processes.make_control(ctx))
    engine = gen.build_engine()
    adapters = {1: peft_model(base_model, 0.0), 0: peft_model(base_model, 0.3)}  # by version parity

    async def scenario():
        shared.publish(adapter_tensors(adapters[1]), 1)  # what the trainer publishes at its start
        task = asyncio.create_task(gen.run())
        await wait_until(lambda: gen.stats.groups >= 4 or task.done(), "4 groups under adapter v1")
        version, deadline = 1, time.monotonic() + 5
        while time.monotonic() < deadline and not task.done():  # swap back and forth mid-generation
            await asyncio.sleep(0.04)
            version += 1
            shared.publish(adapter_tensors(adapters[version % 2]), version)
        if task.done():
            task.result()
        gen.control.stop.set()
        await task
        # vLLM also serves the adapter from a PEFT folder (what checkpoints and OUT/adapter hold):
        # greedy output equals the merged model's in transformers
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        folder = lora.save_adapter(
            adapter_tensors(adapters[0]), resolved, base_model, str(tmp_path / "peft")
        )
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        served = []
        for i, prompt in enumerate(PROMPTS):
            async for out in engine.generate(
                {"prompt_token_ids": prompt},
                greedy,
                request_id=f"greedy-{i}",
                lora_request=LoRARequest("from-folder", 2, folder),
            ):
                final = out
            served.append(list(final.outputs[0].token_ids))
        return served

    try:
        served = asyncio.run(scenario())
    finally:
        engine.shutdown()
        gen.engine = engine = None
    groups = []
    while True:
        try:
            groups.append(gen.queue.get(timeout=1.0))
        except queue_lib.Empty:
            break
    diffs, apart, mixed = [], [], 0
    for group in groups:
        for ids, lps, versions in zip(
            group.completion_ids, group.behaviour_logprobs, group.token_versions
        ):
            if not ids:
                continue
            inputs, targets = torch.tensor([group.prompt_ids + ids]), torch.tensor(ids)[:, None]
            with torch.no_grad():
                logp = {
                    parity: torch.log_softmax(
                        m(input_ids=inputs).logits[0, len(group.prompt_ids) - 1 : -1], -1
                    ).gather(-1, targets)[:, 0]
                    for parity, m in adapters.items()
                }
            for t, (lp, v) in enumerate(zip(lps, versions)):
                diffs.append(abs(float(logp[v % 2][t]) - lp))
                apart.append(abs(float(logp[0][t] - logp[1][t])))
            mixed += len(set(versions)) > 1
    assert gen.stats.loads >= 10 and mixed > 0, (gen.stats.loads, mixed)
    assert len(diffs) > 200
    assert max(diffs) < 1e-4  # each token's log-prob is the trainer's under the adapter of its tag
    assert sum(a > 0.1 for a in apart) > 50, (
        "the two adapters should give clearly different log-probs"
    )
    merged = adapters[0].merge_and_unload()
    with torch.no_grad():
        expected = [
            merged.generate(
                torch.tensor([p]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    assert served == expected


def run_train(out, *args, timeout=300):
    """A LoRA run on two FSDP2 ranks (each publishes, and checkpoints gather, its rows of the
    adapter)."""
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--out",
            out,
            *SMALL,
            "--lora-rank",
            "8",
            "--lr",
            "3e-3",
            "--train-ranks",
            "2",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, f))}


def test_lora_run_checkpoints_resumes_and_merges(tmp_path):
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "run")
    rows = run_train(out, "--steps", "6", "--save-every", "3", "--merge-at-end")
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (
        summary["logprob_diff_after_sync"] is not None and summary["logprob_diff_after_sync"] < 1e-4
    )
    base_dir = os.path.join(out, "init_model")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 13, 14, 15, 25]])

    # a checkpoint holds the adapter and its optimizer
    # state; the final adapter loads in PEFT and has moved
    saved = checkpoint.list_checkpoints(checkpoint.checkpoint_root(out))
    assert [os.path.basename(p) for p in saved] == ["step_00000003", "step_00000006"]
    stored = dcp.FileSystemReader(os.path.join(saved[0], "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model.")]
    assert len(model_keys) == 28 and all("lora_" in k for k in model_keys)  # adapter tensors only
    assert {
        k.rsplit(".", 1)[0].removeprefix("optimizer.state.")
        for k in stored
        if k.endswith(".exp_avg")
    } == {k.removeprefix("model.") for k in model_keys}  # and their optimizer state
    assert checkpoint.load_state(saved[0])["base_model"] == os.path.abspath(base_dir)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        os.path.join(out, "adapter"),
    )
    assert sum(p.norm() for n, p in model.named_parameters() if "lora_B" in n) > 0
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(
            os.path.join(out, "model"), dtype=torch.float32
        )
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)
        assert (adapted - base(input_ids=ids).logits).abs().max() > 1e-4
    merged_state, base_state = merged.state_dict(), base.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        # the base model's own weights never train
        assert torch.equal(merged_state[name], base_state[name])

    # resuming from the step-3 checkpoint gives the uninterrupted run's steps 3..5
    resumed = run_train(str(tmp_path / "resumed"), "--steps", "6", "--resume", saved[0])
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step]["version"] == rows[step]["version"]
        assert resumed[step]["reward"] == pytest.approx(rows[step]["reward"], abs=1e-6)
        assert resumed[step]["loss"] == pytest.approx(rows[step]["loss"], rel=1e-3, abs=1e-5)


def test_lora_flags_are_checked(tmp_path):
    for args, message in (
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--merge-at-end"], "--merge-at-end"),
        (
            ["--lora-rank", "8", "--lora-dropout", "0.05"],
            "--lora-dropout 0.05: RL fine-tuning runs without dropout",
        ),
    ):
        with pytest.raises(SystemExit, match=f"^error: .*{message}"):  # before anything starts
            flag_checks.parse_args(["--out", str(tmp_path / "x"), *args])
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--out",
            str(tmp_path / "y"),
            "--lora-rank",
            "8",
            "--lora-targets",
            "no_such_proj",
            "--steps",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no_such_proj" in proc.stderr
