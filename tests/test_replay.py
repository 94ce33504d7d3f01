"""Routing replay (issue 30): routes.py records the generator's routes, buffer.py carries them,
replay.py replays them in the trainer's MoE routers.

- The trainer's side on a tiny random-init Qwen3-MoE (fp32, in this process): with replay off, or on
  without routes, the forward is the plain Hugging Face one; with replay on each MoE block runs
  exactly the recorded experts, a missing route (-1) falls back to the live router and is counted,
  the router gets a gradient, the same under activation checkpointing (whose recompute must route as
  the forward did), and the same whatever the micro-batches (routes follow their rows through
  collation, the split and the trim).
- The worker's store (routes.RouteStore, numpy, engine steps written by hand): a request's routes by
  position, the first record of a position wins (a re-prefill after a swap keeps them), a
  prefix-cache hit gets the routes of the block it reuses, vLLM's request ids map back to the
  generator's; an episode's turns merge.

vLLM's side (routes recorded by an engine in this process, and one real run):
tests/test_replay_engine.py.
"""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import buffer
import update
from config import Config
from generator import routes
from tasks import builtin
from trainer import lora, models, replay

LAYERS, EXPERTS, TOP_K = 2, 8, 2


def tiny_moe_config(vocab: int = 27, hidden: int = 64) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_moe(seed: int = 0, replay_on: bool | None = None):
    """A random-init Qwen3-MoE in fp32; with replay_on True/False its routers patched (replay /
    record only)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config()).eval()
    if replay_on is not None:
        replay.install(model, model.model.layers, model.config, replay_on)
    return model


def random_routes(b: int, t: int, seed: int = 1) -> torch.Tensor:
    """(b, t, layers, top_k) int16 routes: top_k distinct experts per token and layer, drawn at
    random."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, t, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.int16)


class Batch:  # what replay.routed_by reads of a micro-batch
    def __init__(self, ids, routes):
        self.input_ids, self.routes = ids, routes
        self.attention_mask, self.mask = (
            torch.ones_like(ids),
            torch.ones(ids.shape[0], ids.shape[1] - 1).bool(),
        )


def experts_run(model):
    """Hooks that catch the experts each MoE block runs: a list (per forward call) of (layer, top_k
    index)."""
    seen = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(
            lambda m, args, i=i: seen.append((i, args[1].clone()))
        )
    return seen


def test_replay_off_or_without_routes_is_the_plain_hugging_face_forward():
    ids = torch.randint(3, 27, (3, 9), generator=torch.Generator().manual_seed(0))
    plain = tiny_moe()
    own = experts_run(plain)
    with torch.no_grad():
        expected = plain(ids).logits
    recorded = (
        torch.stack([own[i][1] for i in range(LAYERS)], 1)
        .reshape(3, 9, LAYERS, TOP_K)
        .to(torch.int16)
    )
    for replay_on, batch_routes in ((False, random_routes(3, 9)), (True, None), (True, recorded)):
        model = tiny_moe(replay_on=replay_on)
        with torch.no_grad(), replay.routed_by(model, Batch(ids, batch_routes)):
            logits = model(ids).logits
        if batch_routes is recorded:  # replaying its own choice: the same experts, the same weights
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
        else:
            assert torch.equal(logits, expected)


def test_replay_runs_the_recorded_experts_falls_back_where_missing_and_counts():
    ids = torch.randint(3, 27, (2, 7), generator=torch.Generator().manual_seed(1))
    recorded = random_routes(2, 7)
    recorded[0, 2] = -1  # a missing route (every layer)
    recorded[1, 4, 1] = -1  # missing in one layer
    model = tiny_moe(replay_on=True)
    seen, inputs = experts_run(model), {}
    # each block's input: what its live router would choose
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(
            lambda m, args, i=i: inputs.__setitem__(i, args[0].reshape(14, -1))
        )
    with torch.no_grad(), replay.routed_by(model, Batch(ids, recorded)) as counts:
        model(ids)
    flat = recorded.reshape(14, LAYERS, TOP_K).long()
    for layer, used in seen:
        present = (flat[:, layer] >= 0).all(-1)
        # the recorded experts, in their order
        assert torch.equal(used[present], flat[present, layer])
        gate = model.model.layers[layer].mlp.gate.weight
        live = torch.nn.functional.linear(inputs[layer], gate).topk(TOP_K).indices
        # Where no route was recorded, the live router's experts are used.
        assert torch.equal(used[~present].sort(-1).values, live[~present].sort(-1).values)
    # The last position of each row predicts nothing and is never counted; the missing routes are
    # (0, 2) in 2 layers and (1, 4) in 1.
    assert int(counts["missing"]) == 3 and int(counts["decisions"]) == 2 * 6 * LAYERS - 3
    # random routes: the live router disagrees
    assert 0 <= int(counts["agree"]) < int(counts["decisions"])


def router_grads(checkpointed: bool, routes_on: bool = True) -> list[torch.Tensor]:
    ids = torch.randint(3, 27, (2, 8), generator=torch.Generator().manual_seed(2))
    model = tiny_moe(replay_on=True).train()
    if checkpointed:
        models.checkpoint_layers(model)
    with replay.routed_by(model, Batch(ids, random_routes(2, 8) if routes_on else None)):
        logp = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        # inside the context: a checkpointed layer's recompute routes as the forward did
        logp.sum().backward()
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]


def test_the_router_gets_a_gradient_through_replay_also_under_activation_checkpointing():
    grads = router_grads(checkpointed=False)
    assert all(g.abs().sum() > 0 for g in grads)
    for plain, recomputed in zip(grads, router_grads(checkpointed=True)):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-7)
    live = router_grads(checkpointed=False, routes_on=False)  # (the routes do change the gradient)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, live))


def test_routes_follow_their_tokens_through_collation_and_micro_batches():
    """The same batch trained in one micro-batch or in many (sorted by length, trimmed) gives the
    same gradient under replay: each row's routes stay with its tokens. Random routes, so that a
    shifted row would not."""
    rng = np.random.default_rng(3)
    samples = []
    for i, (p, c) in enumerate([(3, 5), (2, 9), (4, 2), (3, 7), (5, 4)]):
        rows = rng.random((p + c, LAYERS, EXPERTS)).argsort(-1)[..., :TOP_K].astype(np.uint8)
        rows[-1] = 255  # the last token: never read by vLLM, missing
        samples.append(
            buffer.Sample(
                [1] + list(rng.integers(3, 27, p - 1)),
                list(rng.integers(3, 27, c)),
                [-1.0] * c,
                [0] * c,
                1.0,
                float(rng.normal()),
                routes=rows,
            )
        )
    batch = buffer.collate(samples, pad_id=0)
    assert batch.routes.shape == (5, 11, LAYERS, TOP_K) and batch.routes.dtype == torch.uint8
    assert (batch.routes[0, 7:] == 255).all() and (
        batch.routes[0, :8].numpy() == samples[0].routes
    ).all()
    rows = samples[0].routes.astype(np.uint16) * 300  # (uint16: 256 experts or more)
    rows[-1] = 65535
    wide = buffer.collate([dataclasses.replace(samples[0], routes=rows)], 0)
    assert wide.routes.dtype == torch.int32 and torch.equal(
        wide.routes[0], torch.from_numpy(rows.astype(np.int32))
    )
    grads = []
    # one micro-batch; micro-batches of at most 12 padded tokens (one or two rows)
    for tokens in (0, 12):
        model = tiny_moe(replay_on=True)
        cfg = Config(micro_batch_tokens=tokens, max_lag=0)
        result = update.update_on_batch(
            model, None, None, batch, cfg, rank=0, world_size=1, version=0, step=0
        )
        assert result.metrics["router/missing"] == 0 and 0 < result.metrics["router/agreement"] < 1
        assert (result.metrics["micro_batches"] == 1) == (tokens == 0)
        grads.append([p.grad.clone() for p in model.parameters()])
    for whole, split in zip(*grads):
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def moe_batch(seed: int = 6) -> buffer.Batch:
    """Three samples with random recorded routes (the last token of each: missing)."""
    rng = np.random.default_rng(seed)
    samples = []
    for p, c in [(3, 5), (4, 3), (2, 6)]:
        rows = rng.random((p + c, LAYERS, EXPERTS)).argsort(-1)[..., :TOP_K].astype(np.uint8)
        rows[-1] = 255
        prompt = [1] + list(rng.integers(3, 27, p - 1))
        completion = list(rng.integers(3, 27, c))
        samples.append(
            buffer.Sample(prompt, completion, [-1.0] * c, [0] * c, 1.0, 1.0, routes=rows)
        )
    return buffer.collate(samples, pad_id=0)


def test_the_kl_reference_routes_itself_with_lora_and_with_full_fine_tuning(monkeypatch):
    """One rule for both paths (issue 38): the --kl-coef reference scores with its own routers'
    choice, never the recorded routes the policy replays; with LoRA it is the policy with its
    adapter off (the same patched routers), with full fine-tuning a separate model."""
    batch, plain = moe_batch(), tiny_moe()
    with torch.no_grad():
        own = update.completion_logprobs(plain, batch, 1.0).logp
    scored = []  # (the micro-batch, the reference's log-probs of it)
    real = update.reference_logprobs
    monkeypatch.setattr(
        update,
        "reference_logprobs",
        lambda ref, mb, *rest: scored.append((mb, real(ref, mb, *rest))) or scored[-1][1],
    )
    cfg = Config(micro_batch_tokens=0, max_lag=0, kl_coef=0.1)
    full_policy = tiny_moe(replay_on=True)
    adapted = lora.wrap(tiny_moe(), lora.peft_config(4, 8, 0.0, "q_proj,v_proj"), seed=0)
    replay.install(adapted, lora.base_model_of(adapted).model.layers, adapted.config, True)
    for policy, reference in ((full_policy, tiny_moe()), (adapted, lora.AdapterOff(adapted))):
        result = update.update_on_batch(
            policy, reference, None, batch, cfg, rank=0, world_size=1, version=0, step=0
        )
        # the policy replayed the routes (random: its own router disagrees with them)
        assert result.metrics["router/agreement"] < 1
        with torch.no_grad(), replay.routed_by(policy, batch):
            replayed = update.completion_logprobs(policy, batch, 1.0).logp
        assert not torch.allclose(replayed, own, atol=1e-3)
        mb, reference_logp = scored.pop()  # (its rows sorted by length, trimmed)
        with torch.no_grad():
            expected = update.completion_logprobs(plain, mb, 1.0).logp
        torch.testing.assert_close(reference_logp, expected, rtol=0, atol=1e-5)


def test_a_model_without_replayable_routes_is_refused_in_one_line():
    assert replay.problem(tiny_moe_config()) is None
    dense = builtin.Qwen2Config(
        vocab_size=27, hidden_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    assert "need a Mixture-of-Experts model" in replay.problem(dense)
    other = tiny_moe_config()
    other.model_type = "deepseek_v3"
    assert "not of deepseek_v3" in replay.problem(other)


@pytest.mark.parametrize("family", sorted(replay.ROUTERS))
def test_each_family_replays_its_own_choice_exactly_and_other_routes_with_a_router_gradient(family):
    """Replaying a model's own top-k gives its plain forward (the weights rule is the family's own);
    replaying random routes changes the output and the router gets a gradient (tests/test_moe.py's
    tiny configs)."""
    from test_moe import tiny_moe as family_moe

    ids = torch.randint(3, 26, (2, 6), generator=torch.Generator().manual_seed(4))
    model = family_moe(family)
    with torch.no_grad():
        expected = model(ids).logits
    layers = model.model.layers
    state = replay.install(model, layers, model.config, replay=False)
    seen = {}
    state.count = lambda layer, own, recorded, present: seen.__setitem__(
        layer, own.detach().clone()
    )
    top_k = state.top_k
    with (
        torch.no_grad(),
        replay.routed_by(model, Batch(ids, torch.full((2, 6, len(layers), top_k), -1))),
    ):
        model(ids)
    assert seen, family
    own = torch.full((12, len(layers), top_k), -1)
    for layer, experts in seen.items():
        own[:, layer] = experts
    state.replay = True
    with (
        torch.no_grad(),
        replay.routed_by(model, Batch(ids, own.reshape(2, 6, len(layers), top_k))),
    ):
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(5)
    experts = model.config.to_dict()
    count = next(
        experts[k]
        for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
        if experts.get(k)
    )
    other = torch.rand(2, 6, len(layers), count, generator=g).argsort(-1)[..., :top_k]
    other[:, :, [i for i in range(len(layers)) if i not in seen]] = -1
    with replay.routed_by(model, Batch(ids, other)):
        logits = model(ids).logits
        logits.float().logsumexp(-1).sum().backward()
    assert not torch.allclose(logits.detach(), expected, atol=1e-4)
    routers = [
        p
        for n, p in model.named_parameters()
        if p.grad is not None
        and any(
            key in n
            for key in ("gate.weight", "router.weight", "router.gate.weight", "router.layer.weight")
        )
        and "gate_up" not in n
        and "shared_expert_gate" not in n
    ]
    assert routers and all(p.grad.abs().sum() > 0 for p in routers), family


# --------------------------------------------------------------------------------------------------
# The worker's store and the episode merge (numpy; engine steps written by hand)
# --------------------------------------------------------------------------------------------------
def step(store, rows, requests, positions):
    """One engine step: each layer's top-k ids for the step's rows (rows: (tokens, layers, top_k)),
    committed."""
    store.begin_step()
    for layer in range(LAYERS):
        store.capture(layer, torch.as_tensor(rows[:, layer]))
    store.commit(requests, np.asarray(positions))


def test_the_store_keeps_first_routes_fills_prefix_cache_hits_and_maps_request_ids():
    store = routes.RouteStore(LAYERS, TOP_K, EXPERTS, block_size=4, prefix="group-")
    rng = np.random.default_rng(0)
    first = rng.integers(0, EXPERTS, (6, LAYERS, TOP_K))
    # vLLM's ids of the generator's "group-1", samples 0, 1
    a, b = "0_group-1-abcdef12", "1_group-1-abcdef12"
    step(store, first, [(a, 6, [10, 11])], range(6))  # a's prefill: positions 0-5 in blocks 10, 11
    # b hits the prefix cache for block 10 (positions 0-3) and computes 4-5 in its own block 12; an
    # evaluation request is not recorded, but its blocks are
    mine = rng.integers(0, EXPERTS, (2, LAYERS, TOP_K))
    step(
        store,
        np.concatenate([mine, first[:1]]),
        [(b, 2, [10, 12]), ("eval-0-x-abcdef12", 1, [13])],
        [4, 5, 0],
    )
    # a weight swap re-prefills a (new routes for 0-5)
    # and it decodes position 6: its first routes stay
    again = rng.integers(0, EXPERTS, (7, LAYERS, TOP_K))
    step(store, again, [(a, 7, [20, 21])], range(7))
    assert store.named("group-1-abcdef12", "group-1") and not store.named(
        "group-10-abcdef12", "group-1"
    )
    taken = store.take("group-1")
    assert sorted(taken) == [0, 1] and store.take("group-1") == {} and not store.records
    assert np.array_equal(taken[0][:6], first) and np.array_equal(taken[0][6], again[6])
    # the hit: the routes of block 10
    assert np.array_equal(taken[1], np.concatenate([first[:4], mine]))
    # 255: the missing mark of uint8
    assert store.dtype == np.uint8 and routes.route_dtype(256) == np.uint16


def test_a_group_that_ends_without_taking_its_routes_leaves_nothing_in_the_worker():
    """(issue 38) Records of requests nothing will take (a group cancelled or failed while its
    requests ran) are freed when the group ends: the generator's done callback names the group,
    its next take frees what the group left in the worker; not 4,096 records later."""
    import asyncio
    import types

    import rollout

    store = routes.RouteStore(LAYERS, TOP_K, EXPERTS, block_size=4, prefix="group-")
    names = [
        "0_group-3-aaaaaaaa",  # group 3's two samples, cut short
        "1_group-3-aaaaaaaa",
        "group-5-1-t0-cccccccc",  # a turn of one of group 5's episodes
        "group-30-bbbbbbbb",  # group 30: still running
        "0_group-7-dddddddd",  # group 7: done, taken next
    ]
    rows = np.random.default_rng(1).integers(0, EXPERTS, (len(names), LAYERS, TOP_K))
    step(store, rows, [(name, 1, [i]) for i, name in enumerate(names)], [0] * len(names))
    recorder = routes.RouteRecorder()
    recorder._routes = store

    class Engine:  # vLLM's collective_rpc into the worker, in this process
        async def collective_rpc(self, method, args=()):
            return [getattr(recorder, method)(*args)]

    taker = routes.GeneratorRoutes(on_gpu=False)
    taker.layers, taker.top_k = LAYERS, TOP_K
    generator = types.SimpleNamespace(running=set(), routes=taker, error=None, wake=None)

    async def groups_end_then_one_is_taken():
        for group_id in (3, 5):  # cancelled while their requests ran
            task = asyncio.create_task(asyncio.sleep(60))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            rollout.Generator._done(generator, group_id, task)
        assert len(store.records) == len(names)  # (until the next take)
        return await taker.take(Engine(), "group-7", [types.SimpleNamespace(index=0)])

    taken = asyncio.run(groups_end_then_one_is_taken())
    assert np.array_equal(taken[0], rows[4:5]) and taker.ended == []
    assert list(store.records) == ["group-30-bbbbbbbb"] and list(store.known) == list(store.records)


def test_an_episode_keeps_each_positions_first_routes_turn_after_turn():
    layers, k, dtype = 1, 2, np.uint8
    # positions 0-4 (5: the turn's last token, unread)
    turn1 = np.arange(10, dtype=dtype).reshape(5, layers, k)
    episode = routes.merged(None, turn1, 0)
    assert routes.known_prefix(episode) == 5
    turn2 = np.full((4, layers, k), 7, dtype=dtype)  # the next request from position 5: 5-8
    episode = routes.merged(episode, turn2, routes.known_prefix(episode))
    assert (
        episode.shape == (9, layers, k)
        and np.array_equal(episode[:5], turn1)
        and (episode[5:] == 7).all()
    )
    fitted = routes.fitted(episode, 11, layers, k, dtype)
    assert (fitted[9:] == 255).all() and routes.known_prefix(fitted) == 9
