"""Sequence packing (--packing, packing.py): a micro-batch's rows run as one row of their real
tokens, and nothing the trainer computes changes.

- For a tiny random model of every family heads.py scores (tests/test_heads.py's table, dense and
  MoE), `completion_logprobs` packed equals it padded in fp32 (log-probs, untruncated log-probs,
  entropies within 1e-5) and the probe (`packing.problem`) passes: on SDPA under transformers'
  packed mask, and on packing.row_attention (which then really ran its rows side by side) for every
  family without sliding windows. Sliding windows that bite (a Mistral's and a Qwen2's window of 4)
  keep packed rows apart on transformers' mask, where `packing.verdict` leaves them.
- AFMoE builds its mask without the position ids: it packs on the row-wise attention, and is
  refused where it cannot use it (sliding windows, eager attention): `--packing on` in one line,
  `auto` falls back to padding with one note; one such model keeps the whole run padded.
- Every MoE family of tests/test_moe.py with routing replay on recorded routes (some missing): the
  same log-probs and router counts packed and padded, on both attentions; gradients too (one
  family).
- `update.update_on_batch` with a KL reference and a distillation teacher: the same loss, gradients
  and metrics packed and padded, and `pad_frac` 0 packed; under auto it packs where the start's
  probe passed every model (`update.packs`). The packed planner holds real tokens to the budget.
- The flag: its choices, and prepare.check's line where transformers cannot pack at all.
"""

import dataclasses

import pytest
import test_heads
import test_moe
import torch
import transformers
from test_fsdp import make_batch

import buffer
import update
from config import Config
from run import prepare
from run.flag_checks import parse_args
from trainer import packing, replay

# the family whose attention mask ignores packed
# position ids (its model builds the mask without them)
IGNORES_PACKING = "afmoe"
SAMPLING = test_heads.SAMPLINGS["T, top-k, top-p"]
# windows of 4 tokens bite in the test batch's rows of up to 9
SLIDING = {
    "mistral": dict(sliding_window=4),
    "qwen2": dict(sliding_window=4, use_sliding_window=True, max_window_layers=0),
}


def largest_difference(a: update.TokenScores, b: update.TokenScores, mask) -> float:
    """The largest |a - b| over the scored tokens of log-probs, untruncated log-probs and entropies
    (-inf on both sides: equal)."""
    return max(
        float(torch.where(x[mask] == y[mask], 0.0, x[mask] - y[mask]).abs().max())
        for x, y in zip(
            (a.logp, a.logp_untruncated, a.entropy), (b.logp, b.logp_untruncated, b.entropy)
        )
    )


def packed_and_padded(model, batch, sampling=SAMPLING):
    with torch.no_grad():
        return [
            update.completion_logprobs(model, batch, *sampling, untruncated=True, packed=packed)
            for packed in (True, False)
        ]


def tiny(model_type, attention="sdpa", seed=0):
    """test_heads' tiny model of the family, its head at its own scale (test_heads sharpens it to
    make its transforms show), on `attention` (sdpa: transformers' packed mask; packing.ATTENTION:
    packing.row_attention)."""
    model = test_heads.tiny_model(model_type, seed=seed, gain=1.0)
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = attention
    return model


def rows_attended(monkeypatch):
    """The row counts SDPA saw at once while packed rows ran (1: the packed row, under the mask)."""
    seen, sdpa = [], packing.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[0])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(packing, "sdpa_attention_forward", spy)
    return seen


BOTH = ("sdpa", packing.ATTENTION)


def cases(families: dict, shape: dict) -> list[tuple[str, str]]:
    """(family, attention): transformers' packed mask on SDPA for every family whose mask reads the
    position ids; the row-wise attention for every family without sliding windows."""
    out = []
    for family in sorted(families):
        config = transformers.AutoConfig.for_model(family, **{**shape, **families[family]})
        out += [(family, "sdpa")] if family != IGNORES_PACKING else []
        out += [(family, packing.ATTENTION)] if packing.windowless(config) else []
    return out


CASES = cases(test_heads.FAMILIES, test_heads.SHAPE)


@pytest.mark.parametrize("model_type,attention", CASES)
def test_packed_log_probs_equal_padded_in_every_family(model_type, attention, monkeypatch):
    model = tiny(model_type, attention)
    batch = test_heads.tiny_batch(model)
    assert packing.problem(model) is None
    packed, padded = packed_and_padded(model, batch)
    assert torch.isfinite(packed.logp[batch.mask]).sum() >= 10
    assert largest_difference(packed, padded, batch.mask) <= 1e-5
    # the row-wise attention ran its rows side by side (SDPA itself: never through packing.py)
    seen = rows_attended(monkeypatch)
    with torch.no_grad():
        update.completion_logprobs(model, batch, *SAMPLING, packed=True)
    assert set(seen) == ({len(batch)} if attention == packing.ATTENTION else set())


@pytest.mark.parametrize("model_type", SLIDING)
def test_a_sliding_window_that_bites_keeps_packed_rows_apart(model_type):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=test_heads.VOCAB, **{**test_heads.SHAPE, **SLIDING[model_type]}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    batch = test_heads.tiny_batch(model)
    # the window acts: with it widened, the rows' later tokens score otherwise
    widened = transformers.AutoModelForCausalLM.from_config(
        dataclasses.replace(config, sliding_window=64), dtype=torch.float32
    ).eval()
    widened.load_state_dict(model.state_dict())
    narrow, wide = (packed_and_padded(m, batch)[1] for m in (model, widened))
    assert largest_difference(narrow, wide, batch.mask) > 1e-3
    # on transformers' mask: the row-wise attention knows no windows, so it is not tried
    assert packing.verdict(model) == "" and model.config._attn_implementation == "sdpa"
    assert largest_difference(*packed_and_padded(model, batch), batch.mask) <= 1e-5


def test_sdpa_models_pack_with_the_row_wise_attention_where_it_passes():
    model = tiny("qwen3")
    assert packing.verdict(model) == "" and model.config._attn_implementation == packing.ATTENTION
    # AFMoE builds its mask without the position ids: without sliding
    # windows it packs on the row-wise attention all the same; with them
    # (test_moe's), or on eager attention (never switched), it cannot
    afmoe = tiny(IGNORES_PACKING)
    assert packing.verdict(afmoe) == "" and afmoe.config._attn_implementation == packing.ATTENTION
    for refused in (tiny(IGNORES_PACKING, "eager"), test_moe.tiny_moe(IGNORES_PACKING)):
        before = refused.config._attn_implementation
        assert "does not keep packed rows apart" in packing.verdict(refused)
        assert refused.config._attn_implementation == before


def test_a_model_that_ignores_packed_rows_is_refused_on_and_padded_under_auto(capsys):
    model = tiny(IGNORES_PACKING, "eager")
    batch = test_heads.tiny_batch(model)
    packed, padded = packed_and_padded(model, batch)
    # packed, its rows see each other: the probe is right to refuse it
    assert largest_difference(packed, padded, batch.mask) > 1e-2
    assert "does not keep packed rows apart" in packing.problem(model)
    with pytest.raises(SystemExit, match=f"^error: --packing on: the {IGNORES_PACKING} model"):
        packing.decide(Config(packing="on"), [model])
    other = tiny(IGNORES_PACKING, "eager")
    capsys.readouterr()
    assert not packing.decide(Config(packing="auto"), [other])
    assert not packing.decide(Config(packing="auto"), [other])  # (the verdict is kept)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: --packing auto: the {IGNORES_PACKING}")
    assert notes[0].endswith("micro-batches are padded")
    # one model that cannot pack keeps the whole run padded; off never probes
    plain = tiny("qwen3")
    assert packing.decide(Config(packing="auto"), [plain, None])
    assert not packing.decide(Config(packing="auto"), [plain, other])
    fresh = tiny("qwen3")
    assert not packing.decide(Config(packing="off"), [fresh])
    assert not hasattr(fresh, packing.ATTRIBUTE)
    # an update reads the verdicts the start left: auto packs where every model passed (never
    # probed: padded), on always, off never
    auto, on, off = (Config(packing=mode) for mode in ("auto", "on", "off"))
    assert update.packs(auto, [plain, None]) and not update.packs(auto, [plain, other])
    assert not update.packs(auto, [fresh]) and update.packs(on, [fresh])
    assert not update.packs(off, [plain])


# --------------------------------------------------------------------------------------------------
# Routing replay: the routes follow the packed tokens
# --------------------------------------------------------------------------------------------------
def replayed_moe(model_type, attention="sdpa"):
    model = test_moe.tiny_moe(model_type)
    model.config._attn_implementation = attention
    replay.install(model, model.model.layers, model.config, True)
    return model


def batch_with_routes(model, seed=0):
    """test_heads.tiny_batch's rows (of its vocabulary) with recorded routes drawn at random, some
    missing (a whole position; one layer of another)."""
    config = model.config
    batch = test_heads.tiny_batch(model, vocab=test_moe.VOCAB, seed=seed)
    b, length = batch.input_ids.shape
    experts = next(
        getattr(config, name)
        for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
        if hasattr(config, name)
    )
    top_k, layers = replay.top_k_of(config), config.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    routes = torch.rand(b, length, layers, experts, generator=g).argsort(-1)[..., :top_k]
    routes = routes.to(torch.uint8)
    routes[0, 2] = 255
    routes[1, 3, -1] = 255
    routes[~batch.attention_mask.bool()] = 255  # (as collate pads)
    return dataclasses.replace(batch, routes=routes)


def replayed_scores(model, batch, packed):
    with replay.routed_by(model, batch, True, packed) as counts:
        scores = update.completion_logprobs(model, batch, 1.0, untruncated=True, packed=packed)
    return scores, {name: int(v) for name, v in counts.items()}


MOE_CASES = cases(test_moe.MOE_FAMILIES, test_moe.SHAPE)


@pytest.mark.parametrize("model_type,attention", MOE_CASES)
def test_routing_replay_scores_and_counts_the_same_packed(model_type, attention):
    model = replayed_moe(model_type, attention)
    batch = batch_with_routes(model)
    with torch.no_grad():
        (packed, packed_counts), (padded, padded_counts) = (
            replayed_scores(model, batch, packed) for packed in (True, False)
        )
        own = update.completion_logprobs(model, batch, 1.0, untruncated=True)  # no replay
    assert largest_difference(packed, padded, batch.mask) <= 1e-5
    assert packed_counts == padded_counts and padded_counts["missing"] > 0
    assert padded_counts["agree"] < padded_counts["decisions"]  # random routes: replay acted
    assert largest_difference(packed, own, batch.mask) > 1e-3


@pytest.mark.parametrize("attention", BOTH)
def test_gradients_equal_packed_and_padded_with_routing_replay(attention):
    model = replayed_moe("qwen3_moe", attention).train()
    batch = batch_with_routes(model)
    grads = []
    for packed in (True, False):
        scores, _ = replayed_scores(model, batch, packed)
        kept = batch.mask & torch.isfinite(scores.logp)
        torch.where(kept, scores.logp, 0.0).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and any("gate" in n for n in grads[0])
    for name, ref in grads[1].items():
        assert float(ref.abs().max()) > 0, name
        err = float((grads[0][name] - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()) + 1e-8, f"{name}: off by {err}"


def test_packed_micro_batches_hold_real_tokens_within_the_budget():
    lengths = [9, 3, 7, 3, 30, 8, 2]
    plan = buffer.plan_micro_batches(lengths, 16, packed=True)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    # shortest first, up to 16 real tokens each; 30 > 16 alone
    assert plan == [[6, 1, 3, 2], [5], [0], [4]]
    assert all(sum(lengths[i] for i in mb) <= 16 for mb in plan if len(mb) > 1)
    # padded, rows x the longest: more micro-batches for the same budget
    assert len(buffer.plan_micro_batches(lengths, 15, packed=True)) < len(
        buffer.plan_micro_batches(lengths, 15)
    )
    assert buffer.plan_micro_batches(lengths, 0, packed=True) == [[6, 1, 3, 2, 5, 0, 4]]


# --------------------------------------------------------------------------------------------------
# The update: the same loss, gradients and metrics
# --------------------------------------------------------------------------------------------------
def test_update_on_batch_is_the_same_packed_and_padded():
    models = [tiny("qwen3", packing.ATTENTION, seed) for seed in range(3)]
    policy, reference, teacher = models
    for frozen in (reference, teacher):
        frozen.requires_grad_(False)
    batch = make_batch()
    cfg = Config(kl_coef=0.1, distill_coef=0.5, temperature=0.8, top_k=40, micro_batch_tokens=20)
    results, grads = {}, {}
    for mode in ("on", "off"):
        results[mode] = update.update_on_batch(
            policy,
            reference,
            None,
            batch,
            dataclasses.replace(cfg, packing=mode),
            rank=0,
            world_size=1,
            version=0,
            step=0,
            teacher=teacher,
        )
        grads[mode] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        policy.zero_grad(set_to_none=True)
    on, off = results["on"], results["off"]
    assert abs(off.loss) > 1e-3 and on.loss == pytest.approx(off.loss, rel=1e-5, abs=1e-7)
    for name, ref in grads["off"].items():
        err = float((grads["on"][name] - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()) + 1e-8, f"{name}: off by {err}"
    assert on.metrics["pad_frac"] == 0 and off.metrics["pad_frac"] > 0
    assert on.metrics["micro_batches"] < off.metrics["micro_batches"]  # real tokens fill them
    for key in ("kl_ref", "distill_reverse_kl", "entropy", "mismatch_k3"):
        assert on.metrics[key] == pytest.approx(off.metrics[key], rel=1e-5, abs=1e-7), key


# --------------------------------------------------------------------------------------------------
# The flag
# --------------------------------------------------------------------------------------------------
def test_the_flag_and_a_transformers_that_cannot_pack(monkeypatch):
    assert Config().packing == "auto" and parse_args(["--packing", "off"]).packing == "off"
    with pytest.raises(SystemExit):
        parse_args(["--packing", "sometimes"])
    assert not any("--packing" in line for line in prepare.check(Config(packing="on")))
    monkeypatch.delattr(packing.masking_utils, "find_packed_sequence_indices")
    [line] = [line for line in prepare.check(Config(packing="on")) if "--packing" in line]
    assert line.startswith("--packing on: cannot pack: this transformers builds no masks")
    assert not [line for line in prepare.check(Config(packing="auto")) if "--packing" in line]
    assert not packing.decide(Config(packing="auto"), [tiny("qwen3")])
