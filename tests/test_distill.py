"""On-policy distillation (--teacher, --distill-coef): the student samples, the teacher scores each
sampled token.

- `losses.distill_advantages` against a hand computation: A_t = A - C (logp_t - teacher_logp_t), 0
  off the mask.
- The flags: both or neither; a teacher with another tokenizer is refused in one line before
  anything starts; a dataset task may leave out --reward when a teacher is given (rewards 0, none
  counted unscored).
- `update.update_on_batch` with a teacher (one update's gradients, no optimizer), on tiny models
  in-process: the loss and gradients are those of the plain computation (full logits) with the
  distillation advantages, `distill_reverse_kl` is the mean over the model's tokens only (an
  environment's tokens, mask False, are neither scored nor trained), and C > 0 changes the loss. A
  teacher identical to the student adds no reverse KL under top-k/top-p (both sides untruncated);
  DeepSeek-V3.2's mask reads the A_t the loss uses.
- One run through the real vLLM generator: a dataset task with no --reward learns from the teacher
  alone, and logs a finite `distill_reverse_kl`.
"""

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import buffer
import losses
import update
from config import Config
from run import prepare
from run.flag_checks import parse_args
from tasks import builtin, datasets, prompts, rewards
from trainer import logprobs

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 13, 14, 15, 24]  # "<bos>abc=" in the tiny model's character tokenizer


def test_distill_advantages_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-0.5, -4.0, -9.0], [-1.0, -0.1, -7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    task = torch.tensor([0.5, -1.0])
    adv, k = losses.distill_advantages(task, logp.requires_grad_(), teacher, mask, coef=0.2)
    # k = logp - teacher on the mask: [[-0.5, 2.0], [-2.0, 0.0]]; A_t = A - 0.2 k
    assert torch.allclose(k, torch.tensor([[-0.5, 2.0, 0.0], [-2.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.6, 0.1, 0.0], [-0.6, -1.0, 0.0]]))
    assert not adv.requires_grad  # an advantage: no gradient through the teacher's signal
    # (B, T) task advantages are kept per token
    per_token = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    assert losses.distill_advantages(per_token, logp, teacher, mask, 1.0)[0][
        1
    ].tolist() == pytest.approx([4.0, 2.0, 0.0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return {
        name: builtin.build_tiny_model(str(root / name), seed=seed, alphabet=alphabet)
        for name, seed, alphabet in [
            ("student", 0, "copy"),
            ("teacher", 1, "copy"),
            ("ascii", 0, "ascii"),
            ("ascii_teacher", 1, "ascii"),
        ]
    }


def test_flags_and_the_teacher_check(models, tmp_path):
    for argv in (
        ["--distill-coef", "0.5"],
        ["--teacher", models["teacher"]],
        ["--teacher", models["teacher"], "--distill-coef", "-1"],
    ):
        with pytest.raises(SystemExit, match="error: --distill-coef .* distillation needs both"):
            parse_args(argv)
    with pytest.raises(SystemExit, match="error: --teacher /no/such/model: no such directory"):
        parse_args(["--teacher", "/no/such/model", "--distill-coef", "1"])
    assert prepare.check_teacher(models["teacher"], models["student"]) == models["teacher"]
    # another tokenizer: one line, before anything starts
    with pytest.raises(SystemExit) as refused:
        prepare.check_teacher(models["ascii"], models["student"])
    message = str(refused.value)
    assert (
        message.startswith(f"error: --teacher {models['ascii']} cannot distill")
        and "\n" not in message
    )
    assert "vocabulary differs" in message
    # a dataset task without --reward: refused, unless a teacher is the learning signal
    with pytest.raises(datasets.DataError, match="needs --reward .* or --teacher"):
        prompts.resolve(dataset="x.jsonl")
    assert prompts.resolve(dataset="x.jsonl", teacher=models["teacher"]).rewards == ()
    # no reward functions: 0 each, none unscored
    assert rewards.combine([], [], 3) == ([0.0, 0.0, 0.0], [])


def env_batch():
    """Three samples; the first is an episode whose tokens 2-3 are an environment's (mask False)."""
    samples = [
        buffer.Sample(
            PROMPT,
            [13, 14, 9, 10, 15, 2],
            [-3.2] * 6,
            [0] * 6,
            1.0,
            0.8,
            model_mask=[True, True, False, False, True, True],
        ),
        buffer.Sample(PROMPT, [20, 21, 2], [-3.3] * 3, [0] * 3, 0.0, -0.5),
        buffer.Sample(PROMPT, [13, 2], [-3.1] * 2, [0] * 2, 0.5, 0.2),
    ]
    return buffer.collate(samples, 0)


def by_hand(model, teacher, batch, cfg):
    """Full logits, no chunking: the distillation advantages on the model's tokens, then
    `policy_loss`."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = logprobs.token_logprobs(logits, batch.targets, cfg.temperature)
    with torch.no_grad():
        teacher_logits = teacher(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits[:, :-1]
    teacher_logp = logprobs.token_logprobs(teacher_logits, batch.targets, cfg.temperature)
    mask = batch.mask
    adv, k = losses.distill_advantages(batch.advantages, logp, teacher_logp, mask, cfg.distill_coef)
    loss, _ = losses.policy_loss(
        torch.where(mask, logp, 0.0), batch.behaviour_logp, adv, mask, agg=cfg.agg
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    env = torch.zeros_like(mask)
    # the episode's tokens 2-3, as collate places them
    env[0, len(PROMPT) + 1 : len(PROMPT) + 3] = True
    assert not (mask & env).any()
    # had the teacher scored them
    with_env = float((logp - teacher_logp).detach()[mask | env].mean())
    return float(loss.detach()), grads, float(k[mask].mean()), with_env


def test_the_update_with_a_teacher_scores_only_the_model_tokens(models):
    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(
        models["teacher"], dtype=torch.float32
    ).requires_grad_(False)
    batch = env_batch()
    assert int(batch.mask.sum()) == 9  # 4 of the episode's 6 tokens, 3 and 2 of the others
    plain = Config(is_mode="off", temperature=0.9)
    distill = Config(is_mode="off", temperature=0.9, teacher=models["teacher"], distill_coef=0.5)
    results = {}
    for name, cfg in (("plain", plain), ("distill", distill)):
        results[name] = update.update_on_batch(
            student,
            None,
            None,
            batch,
            cfg,
            rank=0,
            world_size=1,
            version=0,
            step=0,
            teacher=teacher if cfg.distill_coef > 0 else None,
        )
        results[name].grads = {n: p.grad.clone() for n, p in student.named_parameters()}
        student.zero_grad(set_to_none=True)
    loss, grads, reverse_kl, with_env = by_hand(student, teacher, batch, distill)
    got = results["distill"]
    assert got.loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for name, ref in grads.items():
        assert float((got.grads[name] - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) + 1e-8, (
            name
        )
    assert got.metrics["distill_reverse_kl"] == pytest.approx(reverse_kl, rel=1e-5)
    assert abs(with_env - reverse_kl) > 1e-3  # the environment's tokens would have moved the mean
    assert "distill_reverse_kl" not in results["plain"].metrics
    assert abs(got.loss - results["plain"].loss) > 1e-3  # C > 0 changes the loss


def test_a_teacher_identical_to_the_student_adds_no_reverse_kl_under_top_k_and_top_p(models):
    """Both sides untruncated: under --top-p 0.9 a truncated student against the same model
    untruncated read -log(kept mass) of reverse KL on every token (0.105 nats at mass 0.9)."""
    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(
        models["student"], dtype=torch.float32
    ).requires_grad_(False)
    batch = env_batch()
    for sampling in (dict(top_p=0.9), dict(top_k=5), dict(top_k=8, top_p=0.8)):
        results = {}
        for name, changes in (
            ("plain", {}),
            ("distill", dict(teacher=models["student"], distill_coef=0.5)),
        ):
            cfg = Config(is_mode="off", temperature=0.9, **sampling, **changes)
            results[name] = update.update_on_batch(
                student,
                None,
                None,
                batch,
                cfg,
                rank=0,
                world_size=1,
                version=0,
                step=0,
                teacher=teacher if changes else None,
            )
            student.zero_grad(set_to_none=True)
        assert results["distill"].metrics["distill_reverse_kl"] == 0.0, sampling
        assert results["distill"].loss == pytest.approx(results["plain"].loss, abs=1e-7), sampling
    # some sampled tokens lie outside the set
    assert results["distill"].metrics["outside_support_tokens"] > 0


def test_deepseek_v32_mask_reads_the_distillation_advantage_the_loss_uses(models):
    """Every task advantage is +0.05, so on its own the mask keeps everything; the loss trains on
    A_t = 0.05 - C k_t, and the mask drops the tokens (of sequences far from the generator) where
    A_t < 0."""
    student = AutoModelForCausalLM.from_pretrained(models["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(
        models["teacher"], dtype=torch.float32
    ).requires_grad_(False)
    batch = env_batch()
    with torch.no_grad():
        own = update.completion_logprobs(student, batch, 1.0).logp
        teacher_logp = update.completion_logprobs(teacher, batch, 1.0).logp
    # log(mu/pi) 0.5
    batch = dataclasses.replace(batch, advantages=torch.full((3,), 0.05), behaviour_logp=own + 0.5)
    cfg = Config(teacher=models["teacher"], distill_coef=1.0, dsv32_mask_kl=0.1)
    tokens = int(batch.mask.sum())
    settings = losses.settings_from(cfg, cfg.model_token_budget)
    run = update.UpdatePass(
        model=student, ref_model=None, teacher=teacher, cfg=cfg, settings=settings
    )
    _, terms, _ = update.micro_batch_loss(run, batch, tokens, tokens)
    negative = batch.mask & (0.05 - (own - teacher_logp) < 0)  # A_t < 0, by hand
    assert 0 < int(negative.sum()) < tokens
    assert torch.equal(terms.kept["dsv32_masked_seq_frac"], batch.mask & ~negative)
    run = dataclasses.replace(run, teacher=None)
    _, alone, _ = update.micro_batch_loss(run, batch, tokens, tokens)
    assert torch.equal(alone.mask, batch.mask)


def test_a_dataset_task_learns_from_the_teacher_alone_with_every_off_policy_flag(models, tmp_path):
    """One vLLM run for both toolkits of issue 23: distillation alone (no --reward), beside the
    off-policy masks, rloo and the mismatch metrics, on policy (test_offpolicy.py checks their
    values by hand). The student is a Granite (its logits scaled: heads.py) with the teacher's
    tokenizer, so the run also checks, for the suite, that the trainer and vLLM agree after a sync
    on a transformed LM head in a whole run (test_heads.py checks every transformed family on a vLLM
    engine)."""
    from test_heads import RUN_HEAD_GAIN, tiny_model

    student = str(tmp_path / "granite_student")
    shutil.copytree(models["ascii"], student)  # its tokenizer; the weights: a Granite's
    tiny_model("granite", vocab=100, gain=RUN_HEAD_GAIN["granite"]).save_pretrained(student)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n"
            for w in ("cat", "dog", "sun", "sky", "red", "sea")
        )
    )
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "train.py",
        "--out",
        str(out),
        "--model",
        student,
        "--dataset",
        str(rows),
        "--teacher",
        models["ascii_teacher"],
        "--distill-coef",
        "1",
        "--steps",
        "6",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--eval-every",
        "0",
        "--max-lag",
        "0",
        "--adv-estimator",
        "rloo",
        "--geo-mask-high",
        "1.05",
        "--dsv32-mask-kl",
        "0.01",
        "--icepop-high",
        "5",
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in steps if "distill_reverse_kl" in row]
    assert len(steps) == 6
    assert all(math.isfinite(row["distill_reverse_kl"]) for row in steps)
    # no --reward: task advantage 0
    assert all(row["reward"] == 0 and row["unscored"] == 0 for row in steps)
    assert all(row["loss"] != 0 for row in steps)  # the teacher's signal alone moves the student
    for row in steps:
        # fp32 on both sides, on policy (k3 ~ diff^2 / 2)
        assert 0 <= row["mismatch_k3"] < 1e-6, row
        assert 0 < row["is_ess"] <= 1 + 1e-5  # (<= 1 by Cauchy-Schwarz; float32 sums)
        for share in (
            "is_truncated_frac",
            "geo_masked_seq_frac",
            "dsv32_masked_seq_frac",
            "icepop_masked_frac",
        ):
            assert 0 <= row[share] <= 1, (share, row[share])
        lags = [k for k in row if k.startswith("mismatch_k3/lag")]
        # With --max-lag 0 every row's tokens are on policy, so every row agrees; the metrics at
        # other lags are tested in training by test_offpolicy.py.
        assert lags == ["mismatch_k3/lag0"]
    assert any("mismatch_k3/lag0" in row for row in steps)
    after_sync = [row["logprob_diff_on_policy"] for row in steps if row["version"] >= 2]
    # fp32: the Granite head, as vLLM applies it
    assert len(after_sync) == 5 and max(after_sync) < 1e-3, after_sync
