"""The knobs of today's GRPO recipes: the learning-rate schedule, DAPO's overlong penalty and
filter, and the warning for flags that cannot act; Dr. GRPO's constant normaliser (an episode's
token budget); the step's completion lengths (the sampled tokens, before stale and overlong
masking)."""

import math

import pytest
import torch

import buffer
import config
import update
from advantages import overlong_penalty, shaped_rewards
from run import flag_checks
from train import learning_rate
from trainer import models


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_learning_rate_schedule_at_warmup_end_and_last_step(schedule):
    cfg = config.Config(steps=100, lr=1e-3, min_lr=1e-4, lr_warmup_steps=10, lr_schedule=schedule)
    lrs = [learning_rate(step, cfg) for step in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4)  # 1/10 of the way up
    assert lrs[9] == pytest.approx(1e-3)  # the end of the warmup: the full rate
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    last = 1e-3 if schedule == "constant" else 1e-4
    assert lrs[-1] == pytest.approx(last)
    if schedule == "linear":
        assert lrs[10 + 89 // 2] == pytest.approx(1e-4 + 9e-4 * (1 - 44 / 89))
    if schedule == "cosine":
        assert lrs[10 + 89 // 2] == pytest.approx(
            1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 44 / 89))
        )
    # the default: constant, no warmup
    assert learning_rate(0, config.Config()) == config.Config().lr


def test_overlong_penalty_is_dapos_formula():
    lengths = torch.tensor([0, 10, 12, 13, 16, 19, 20, 21])
    # L_max 20, L_cache 8: free up to 12, then (12 - |y|) / 8 down to -1 at 20, -1 beyond
    expected = torch.tensor([0, 0, 0, -1 / 8, -4 / 8, -7 / 8, -1, -1])
    assert torch.allclose(overlong_penalty(lengths, 20, 8), expected)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


def test_shaped_rewards_add_the_penalty_and_mark_cut_completions():
    group = buffer.RolloutGroup(
        0,
        [1],
        [[5] * 3, [5] * 8, [5] * 10],
        [[0.0] * 3, [0.0] * 8, [0.0] * 10],
        [[0] * 3, [0] * 8, [0] * 10],
        [1.0, 0.5, 0.0],
        finish_reasons=["stop", "stop", "length"],
    )
    plain, truncated = shaped_rewards([group], max_len=10)
    assert plain.tolist() == [[1.0, 0.5, 0.0]] and truncated.tolist() == [[False, False, True]]
    cfg = config.Config(max_new_tokens=10, overlong_penalty=4)
    shaped, _ = shaped_rewards([group], cfg.model_token_budget, cfg.overlong_penalty)
    assert shaped[0].tolist() == pytest.approx([1.0, 0.5 - 2 / 4, -1.0])


def test_a_warning_names_the_flags_that_cannot_act():
    assert flag_checks.inactive_flags(config.Config()) == []
    assert flag_checks.inactive_flags(config.Config(loss="dapo", dual_clip=3.0)) == [
        "--loss dapo",
        "--dual-clip",
    ]
    assert (
        flag_checks.inactive_flags(config.Config(loss="cispo", eps_high=5.0, is_mode="off")) == []
    )


def test_recipe_flags_are_validated_in_one_line():
    for argv in (["--overlong-penalty", "5"], ["--min-lr", "1"], ["--lr-warmup-steps", "-1"]):
        with pytest.raises(SystemExit, match="^error: "):
            flag_checks.parse_args(argv)


def test_dr_grpo_gets_its_settings_unless_flags_set_others_which_are_refused_in_one_line():
    """--loss dr_grpo alone used to be exactly grpo: its surrogate is grpo's, and what makes it Dr.
    GRPO (no std scale, token sums over a constant) were two more flags nothing asked for."""
    from run import prepare

    dr = dict(adv_scale="none", agg="seq-mean-token-sum-norm")
    for parse in (flag_checks.parse_args, prepare.parse_args):  # (train.py's: prepare's)
        cfg = parse(["--loss", "dr_grpo"])
        assert (cfg.adv_scale, cfg.agg) == (dr["adv_scale"], dr["agg"])
    # given as they are, however spelt: accepted; rloo has its own scale: the aggregation alone
    assert (
        flag_checks.parse_args(["--loss", "dr_grpo", "--ag=seq-mean-token-sum-norm"]).agg
        == (dr["agg"])
    )
    rloo = flag_checks.parse_args(["--loss", "dr_grpo", "--adv-estimator", "rloo"])
    assert (rloo.adv_scale, rloo.agg) == ("group", dr["agg"])
    # other losses keep the defaults
    assert flag_checks.parse_args(["--loss", "grpo"]).agg == config.Config.agg
    for other in (["--adv-scale", "group"], ["--agg", "token-mean"]):
        with pytest.raises(SystemExit) as refused:
            flag_checks.parse_args(["--loss", "dr_grpo", *other])
        line = str(refused.value)
        assert line.startswith(f"error: --loss dr_grpo with {' '.join(other)} is not Dr. GRPO")
        assert "\n" not in line and "--loss grpo" in line


# --------------------------------------------------------------------------------------------------
# PPO mini-batches: the decoupled objective, by hand
# --------------------------------------------------------------------------------------------------
PPO = dict(
    mini_batches=2, lr=1.0, grad_clip=1.0, is_mode="truncate", is_high=2.0, micro_batch_tokens=12
)


def _ppo_worker(rank, world, init_file, model_path, results):
    """One FSDP2 rank: `update.update_on_batch` with two mini-batches, for grpo and cispo from the
    same start."""
    import torch.distributed as dist
    from test_fsdp import make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        for loss in ("grpo", "cispo"):
            cfg = config.Config(loss=loss, **PPO)
            model = models.build_trainer_model(model_path, world)
            # linear in the gradient: exact comparison
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
            result = update.update_on_batch(
                model,
                None,
                optimizer,
                make_batch(),
                cfg,
                rank=rank,
                world_size=world,
                version=0,
                step=3,
            )
            params = {
                n: p.full_tensor().detach().clone().numpy() for n, p in model.named_parameters()
            }
            out[loss] = {
                "params": params,
                "metrics": result.metrics,
                "applied": result.applied,
                "loss": result.loss,
            }
        if rank == 0:
            results.put(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def hand_ppo(model_path, cfg):
    """Two mini-batch PPO steps written out: proximal log-probs of the whole batch first (full
    logits, no chunking), then for each mini-batch the clipped surrogate against them, weighted by
    proximal/behaviour (truncated), token-mean over the mini-batch, clip, SGD (linear in the
    gradient, so the comparison is tight)."""
    from test_fsdp import make_batch
    from transformers import AutoModelForCausalLM

    from trainer.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batch = make_batch()

    def logprobs(b):
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
        return torch.where(b.mask, token_logprobs(logits, b.targets, cfg.temperature), 0.0)

    with torch.no_grad():
        proximal = logprobs(batch)
    ratios = []
    for rows in buffer.mini_batch_rows(len(batch), cfg.mini_batches, cfg.seed, step=3, epoch=0):
        mb = batch.select(rows)
        logp, old = logprobs(mb), proximal[rows]
        weights = torch.clamp(torch.exp(old - mb.behaviour_logp), max=cfg.is_high) * mb.mask
        ratio = torch.exp(logp - old)
        adv = mb.advantages[:, None]
        surrogate = torch.min(
            ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_low) * adv
        )
        if cfg.loss == "cispo":  # a clipped, detached ratio times REINFORCE
            surrogate = torch.clamp(ratio, max=1 + cfg.eps_low).detach() * adv * logp
        loss = -(weights * surrogate * mb.mask).sum() / mb.mask.sum()
        ratios.append(ratio.detach()[mb.mask])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, ratios


def test_two_mini_batch_ppo_update_matches_the_hand_computed_one(tmp_path):
    from test_fsdp import spawn_ranks

    from tasks import builtin

    model_path = builtin.build_tiny_model(str(tmp_path / "tiny"), seed=0)
    got = spawn_ranks(_ppo_worker, 2, tmp_path, model_path)
    expected, ratios = hand_ppo(model_path, config.Config(loss="grpo", **PPO))
    # the first update: ratio 1
    assert torch.allclose(ratios[0], torch.ones_like(ratios[0]), atol=1e-5)
    assert float((ratios[1] - 1).abs().max()) > 0.05  # the second starts from moved weights
    run = got["grpo"]
    assert run["applied"] == 2 and run["metrics"]["updates"] == 2
    for name, value in expected.items():
        diff = float((torch.from_numpy(run["params"][name]) - value).abs().max())
        assert diff < 2e-5, f"{name} off by {diff}"
    # the clip acted on the second update, and the variants now train differently
    assert run["metrics"]["clip_frac_low"] + run["metrics"]["clip_frac_high"] > 0
    assert run["metrics"]["ratio_max"] > 1.05
    cispo = got["cispo"]["params"]
    assert max(float(abs(cispo[n] - run["params"][n]).max()) for n in cispo) > 1e-4


def test_dr_grpos_constant_normaliser_is_the_episodes_token_budget(tmp_path):
    """seq-mean-token-sum-norm divides by the most model tokens a sample can hold: --max-new-tokens,
    and for an episode (here --task reveal) --max-turns x --max-new-tokens, the budget DAPO's
    overlong penalty uses."""
    from test_offpolicy import on_policy_batch
    from transformers import AutoModelForCausalLM

    from tasks import builtin

    path = builtin.build_tiny_model(str(tmp_path / "tiny"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = on_policy_batch(model, [[5, 6, 7], [8, 9, 10, 11, 12]], [0.5, -1.0])
    token_sums = 3 * -0.5 + 5 * 1.0  # ratio 1 against the generator: each token's loss is -A
    cfgs = {
        budget: config.Config(
            is_mode="off", agg="seq-mean-token-sum-norm", max_new_tokens=5, max_turns=4, **changes
        )
        for changes, budget in ((dict(), 5), (dict(task="reveal"), 20))
    }
    for budget, cfg in cfgs.items():
        result = update.update_on_batch(
            model, None, None, batch, cfg, rank=0, world_size=1, version=1, step=0
        )
        model.zero_grad(set_to_none=True)
        # (reveal, before: / 5)
        assert result.loss == pytest.approx(token_sums / 2 / budget, rel=1e-5), cfg.task
    assert [cfg.model_token_budget for cfg in cfgs.values()] == [5, 20]


def test_completion_lengths_count_the_sampled_tokens_before_stale_and_overlong_masking(tmp_path):
    """A fully stale sample is not an empty completion: completion_len (and _min, _max,
    empty_completions) counts the model's sampled tokens, trained_len what the masks left to
    train."""
    from run import metrics

    group = buffer.RolloutGroup(
        0,
        [1],
        [[5] * 4, [5] * 2, [5] * 6],
        [[-1.0] * 4, [-1.0] * 2, [-1.0] * 6],
        [[3] * 4, [1] * 2, [3] * 3 + [-1, -1] + [3]],
        [1.0, 0.0, 0.5],
        model_masks=[[True] * 4, [True] * 2, [True] * 3 + [False] * 2 + [True]],
    )
    taken = buffer.TakeResult([group], 3, 0, 0, 0.0)
    batch = buffer.collate(buffer.to_samples([group], torch.zeros(1, 3)), 0)
    # sample 1 (version 1) is all stale
    batch.mask &= ~buffer.stale_mask(batch, trainer_version=3, max_lag=1)
    assert batch.mask.sum(1).tolist() == [4, 0, 4]
    log = metrics.RunLog(config.Config(out=str(tmp_path), steps=1), world_size=1)
    log.step(
        0,
        4,
        taken,
        batch,
        {},
        loss=0.0,
        grad_norm=0.0,
        logprob_diff=None,
        wait_s=0.0,
        train_s=0.0,
        publish_ms=0.0,
        skipped=False,
    )
    log.file.close()
    row = log.rows[-1]
    assert row["empty_completions"] == 0 and row["completion_len"] == pytest.approx((4 + 2 + 4) / 3)
    # an episode's env tokens left out
    assert (row["completion_len_min"], row["completion_len_max"]) == (2, 4)
    assert row["trained_len"] == pytest.approx(8 / 3) and row["tokens"] == 8
