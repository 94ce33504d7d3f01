"""Micro-batches, chunked log-probs and activation checkpointing in the trainer step
(`update.update_on_batch`).

- `buffer.plan_micro_batches` / `rank_micro_batches`: rows grouped by length within the token
  budget (padded: rows x the longest; packed: real tokens), every row exactly once, the same number
  of micro-batches on every rank (fillers add nothing).
- `update.completion_logprobs` keeps no vocabulary-sized tensor for the backward pass.
- Gradient parity: for every aggregation mode, at world size 1 and 2 (FSDP2 over gloo),
  micro-batches of one row, of a few rows and the whole batch give the gradients and the loss (and
  the logged means) of the plain whole-batch computation: an unsharded model, full logits, one
  `policy_loss` over every row. Likewise with top-k/top-p, a temperature and the KL term against a
  reference model, with LoRA (the reference is the model with its adapter off), and with
  `--grad-checkpointing`; packed (--packing, the default: after the start's probe, on the row-wise
  attention) and padded (`--packing off`) alike, and `pad_frac` says which ran.
"""

import dataclasses

import pytest
import torch
from test_fsdp import backward, make_batch, spawn_ranks

import buffer
import losses
import update
from config import Config
from run.flag_checks import parse_args
from tasks import builtin
from trainer import logprobs, lora, models, packing

# --micro-batch-tokens: the test batch's rows hold 5 to 10 tokens
ONE_ROW, FEW_ROWS, WHOLE = 1, 20, 0
SPLITS = {"one row": ONE_ROW, "a few rows": FEW_ROWS, "whole batch": WHOLE}
LORA = dict(rank=4, alpha=8, dropout=0.0, targets="all-linear")
# name -> Config changes; each is run with every split
# ratios vary: clipping acts
CASES = {
    **{f"agg={agg}": dict(agg=agg, is_mode="off") for agg in losses.AGGS},
    "kl+sampling": dict(kl_coef=0.1, temperature=0.8, top_k=8, top_p=0.9, is_mode="truncate"),
    "lora+kl": dict(kl_coef=0.1, top_k=8, lora=True),
}
# name -> (case, --micro-batch-tokens), with --grad-checkpointing
CHECKPOINTED = {
    "checkpointed": ("kl+sampling", FEW_ROWS),
    "lora checkpointed": ("lora+kl", FEW_ROWS),
}
# name -> (case, --micro-batch-tokens), with --packing off (every other run packs: the tiny model
# keeps packed rows apart, and --packing auto is the default)
PADDED = {
    "padded": ("agg=token-mean", WHOLE),
    "kl+sampling padded": ("kl+sampling", FEW_ROWS),
    "lora padded": ("lora+kl", FEW_ROWS),
}


def config(case):
    changes = {k: v for k, v in CASES[case].items() if k != "lora"}
    return Config(**changes)


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------
def test_plan_groups_rows_by_length_within_the_budget():
    lengths = [9, 3, 7, 3, 30, 8, 2]
    plan = buffer.plan_micro_batches(lengths, 16)
    # every row exactly once
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert plan == [[6, 1, 3], [2, 5], [0], [4]]  # shortest first; 30 > 16 alone
    for mb in plan[:-1]:
        assert len(mb) * max(lengths[i] for i in mb) <= 16
    assert buffer.plan_micro_batches(lengths, 0) == [[6, 1, 3, 2, 5, 0, 4]]
    assert buffer.plan_micro_batches(lengths, 1) == [[i] for i in (6, 1, 3, 2, 5, 0, 4)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("world,max_tokens", [(1, 20), (2, 1), (2, 20), (3, 0), (3, 1), (8, 20)])
def test_every_rank_gets_as_many_micro_batches_and_its_own_rows(world, max_tokens, packed):
    batch = make_batch()
    per_rank = [
        buffer.rank_micro_batches(batch, r, world, max_tokens, packed) for r in range(world)
    ]
    assert len({len(m) for m in per_rank}) == 1
    for r, micro in enumerate(per_rank):
        rows = batch.select(buffer.rows_for_rank(batch.attention_mask.sum(1).tolist(), r, world))

        # (advantage, completion tokens) of each row that trains (fillers do not)
        def trained(batches):
            return sorted(
                (float(mb.advantages[i]), int(mb.mask[i].sum()))
                for mb in batches
                for i in range(len(mb))
                if mb.mask[i].any()
            )

        assert trained(micro) == trained([rows])
        for mb in micro:
            assert mb.attention_mask[:, -1].any()  # trimmed: no column that is padding in every row
            assert mb.input_ids.shape[1] == mb.targets.shape[1] + 1
            if max_tokens and len(mb) > 1:
                tokens = mb.attention_mask.sum() if packed else mb.attention_mask.numel()
                assert tokens <= max_tokens


def test_bad_flags_are_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="error: --micro-batch-tokens must be >= 0"):
        parse_args(["--micro-batch-tokens", "-1"])
    with pytest.raises(SystemExit, match="error: --lora-targets lm_head"):
        parse_args(["--lora-rank", "4", "--lora-targets", "q_proj,lm_head"])
    assert parse_args(["--micro-batch-tokens", "0", "--grad-checkpointing"]).grad_checkpointing


# --------------------------------------------------------------------------------------------------
# No (tokens x vocabulary) tensor is kept for the backward pass
# --------------------------------------------------------------------------------------------------
def test_completion_logprobs_saves_nothing_vocabulary_sized(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    batch = make_batch()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scores = update.completion_logprobs(model, batch, 0.8, top_k=8, top_p=0.9, untruncated=True)
    (scores.logp.sum() + scores.logp_untruncated.sum()).backward()
    assert saved, "nothing was saved: the hook saw no graph"
    with_vocab = [s for s in saved if vocab in s]
    # the LM head's weight (or .T)
    head = {(vocab, model.config.hidden_size), (model.config.hidden_size, vocab)}
    assert with_vocab and all(s in head for s in with_vocab), with_vocab
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# Gradient parity
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return builtin.build_tiny_model(str(tmp_path_factory.mktemp("micro") / "tiny"), seed=0)


@pytest.fixture(scope="module")
# the KL reference: other weights, so the KL term and its gradient are not 0
def ref_path(tmp_path_factory):
    return builtin.build_tiny_model(str(tmp_path_factory.mktemp("micro") / "ref"), seed=1)


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory):
    """A LoRA adapter with nonzero B (PEFT starts B at 0: the adapter would be the identity)."""
    from transformers import AutoModelForCausalLM

    model = lora.wrap(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        lora.peft_config(**LORA),
        seed=0,
    )
    torch.manual_seed(1)
    state = {
        lora.file_name(n): torch.randn_like(p) * 0.1
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    config = model.peft_config[lora.ADAPTER_NAME]
    return lora.save_adapter(
        state, config, model_path, str(tmp_path_factory.mktemp("micro") / "adapter")
    )


def _parity_worker(rank, world, init_file, model_path, ref_path, adapter_dir, results):
    """Every case and split on this world: gradients (gathered), loss and metrics of one update
    (`update_on_batch` without an optimizer)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        full = models.build_trainer_model(model_path, world)
        with_lora = models.build_trainer_model(
            model_path, world, lora_config=lora.peft_config(**LORA), adapter_dir=adapter_dir, seed=0
        )
        ref_model = (
            AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32)
            .eval()
            .requires_grad_(False)
        )
        # as a run's start does: the probe on every rank, each model on the row-wise attention
        models_here = (full, with_lora, ref_model)
        assert packing.decide(Config(packing="on"), models_here, rank, world)
        attention = {m.config._attn_implementation for m in models_here}
        runs = [
            (f"{case} / {split}", case, tokens)
            for case in CASES
            for split, tokens in SPLITS.items()
        ]
        runs += [(name, case, tokens) for name, (case, tokens) in PADDED.items()]
        runs += [(name, case, tokens) for name, (case, tokens) in CHECKPOINTED.items()]
        out = {}
        for name, case, tokens in runs:
            cfg = dataclasses.replace(
                config(case), micro_batch_tokens=tokens, packing="off" if name in PADDED else "on"
            )
            model = with_lora if CASES[case].get("lora") else full
            if name in CHECKPOINTED:
                models.checkpoint_layers(model)  # for good: the checkpointed runs come last
            result = backward(
                model,
                lora.AdapterOff(model) if model is with_lora else ref_model,
                make_batch(),
                cfg,
                rank,
                world,
                version=0,
            )
            grads = {
                n: p.grad.full_tensor().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            model.zero_grad(set_to_none=True)
            out[name] = {
                "loss": result.loss,
                "logprob_diff": result.logprob_diff,
                "metrics": result.metrics,
                "grads": {n: g.numpy() for n, g in grads.items()},
            }
        if rank == 0:
            results.put({"attention": attention, **out})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(model, ref_model, batch, cfg):
    """The whole batch the plain way: full logits of an unsharded model, one `policy_loss` over
    every row, normalised by the batch's completion tokens (token-mean) or non-empty sequences."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = logprobs.token_logprobs(logits, batch.targets, cfg.temperature, cfg.top_k, cfg.top_p)
    mask = batch.mask & torch.isfinite(logp)
    logp = torch.where(mask, logp, 0.0)
    if cfg.is_mode == "off":
        old, weights = batch.behaviour_logp, None
    else:
        old = logp.detach()
        weights = losses.behaviour_weights(
            old, batch.behaviour_logp, mask, mode=cfg.is_mode, high=cfg.is_high
        )
    tokens = int(batch.mask.sum())
    units = tokens if cfg.agg == "token-mean" else int((batch.mask.sum(1) > 0).sum())
    loss, metrics = losses.policy_loss(
        logp,
        old,
        batch.advantages,
        mask,
        variant=cfg.loss,
        agg=cfg.agg,
        max_len=cfg.max_new_tokens,
        weights=weights,
        units=units,
        seq_lens=batch.mask.sum(-1),
    )  # |o_i|, counted as units are
    metrics = {name: float(value) for name, value in metrics.items()}
    if cfg.kl_coef > 0:
        with torch.no_grad():
            if ref_model is None:
                with model.disable_adapter():
                    ref_logits = model(
                        input_ids=batch.input_ids, attention_mask=batch.attention_mask
                    ).logits[:, :-1]
            else:
                ref_logits = ref_model(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask
                ).logits[:, :-1]
        ref_logp = logprobs.token_logprobs(ref_logits, batch.targets, cfg.temperature)
        full_logp = logprobs.token_logprobs(logits, batch.targets, cfg.temperature)
        kl = torch.where(mask, losses.kl_penalty(full_logp, ref_logp, cfg.kl_kind), 0.0).sum()
        loss = loss + cfg.kl_coef * kl / tokens
        metrics["kl_ref"] = float(kl) / int(mask.sum())
    if weights is not None:
        metrics["is_weight_mean"] = float(weights[mask].mean())
    metrics["entropy"] = float(
        logprobs.entropy_from_logits(
            logprobs.sampling_logits(logits.detach(), cfg.temperature, cfg.top_k, cfg.top_p)
        )[batch.mask].mean()
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads, metrics


@pytest.fixture(scope="module")
def references(model_path, ref_path, adapter_dir):
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with_lora = lora.wrap(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        lora.peft_config(**LORA),
        seed=0,
        adapter_dir=adapter_dir,
    )
    ref_model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32)
    return {
        case: reference(with_lora, None, make_batch(), config(case))
        if CASES[case].get("lora")
        else reference(full, ref_model, make_batch(), config(case))
        for case in CASES
    }


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_and_loss_do_not_depend_on_the_split(
    world, model_path, ref_path, adapter_dir, references, tmp_path
):
    got = spawn_ranks(_parity_worker, world, tmp_path, model_path, ref_path, adapter_dir)
    assert got.pop("attention") == {packing.ATTENTION}
    for name, run in got.items():
        case = name.split(" / ")[0] if " / " in name else {**PADDED, **CHECKPOINTED}[name][0]
        loss, grads, metrics = references[case]
        assert abs(loss) > 1e-3, f"{name}: a degenerate loss"
        assert run["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), name
        assert set(run["grads"]) == set(grads) and grads, name
        for param, ref in grads.items():
            assert float(ref.abs().max()) > 0, f"{name}: {param} has no gradient"
            err = float((torch.from_numpy(run["grads"][param]) - ref).abs().max())
            assert err <= 1e-5 * float(ref.abs().max()) + 1e-8, (
                f"{name}: gradient of {param} off by {err}"
            )
        # means over every micro-batch and rank, not one micro-batch's
        for key, value in metrics.items():
            assert run["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key}"
        assert run["logprob_diff"] is not None and run["metrics"]["micro_batches"] >= 1
        assert 0 <= run["metrics"]["pad_frac"] < 1
    # the splits really differ: packed or one row per micro-batch, no padding runs; padded, some
    # does; and the clipping is active
    assert got["agg=token-mean / one row"]["metrics"]["pad_frac"] == 0
    assert got["agg=token-mean / whole batch"]["metrics"]["pad_frac"] == 0
    assert got["padded"]["metrics"]["pad_frac"] > 0
    assert got["agg=token-mean / one row"]["metrics"]["micro_batches"] == (7 if world == 1 else 4)
    assert (
        references["agg=token-mean"][2]["clip_frac_high"]
        + references["agg=token-mean"][2]["clip_frac_low"]
        > 0
    )
    assert references["kl+sampling"][2]["kl_ref"] > 0 and references["lora+kl"][2]["kl_ref"] > 0
