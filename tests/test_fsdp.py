"""FSDP2 data parallelism of the trainer (real FSDP2 over gloo on CPU, no vLLM).

- World size 1 and 2 give the same loss and the same updated weights on the same batch: each rank's
  `update.update_on_batch`'s micro-batch terms are normalised by the whole step's count, so that the
  ranks' terms add up to the whole batch's loss, and FSDP2's gradient averaging is undone by the
  world-size factor.
- `sync.publish_model` at world size > 1: every rank writes only its own FSDP2 rows into the packed
  shared buffer, and the result is exactly the full (gathered) state dict, with the version in the
  header.

Every distributed run is a set of spawned processes (torch.multiprocessing, start method "spawn");
rank 0 sends its results back through a queue as numpy arrays (plain bytes: nothing shared).
"""

import os
import queue as queue_lib
import random
import time

import pytest
import torch
import torch.multiprocessing as mp

import buffer
import config
import sync
import update
from generator import shared_weights
from tasks import builtin
from trainer import models

PROMPT = [1, 13, 14, 15, 24]  # "<bos>abc=" in the tiny model's character tokenizer
PAD_ID = 0
NUM_SAMPLES = 7
COMPLETION_LENGTHS = (5, 1, 3, 0, 4, 2, 5)
# the world-size test's: its ranks' shares (balanced by tokens: buffer.rows_for_rank) hold unequal
# completion tokens and unequal non-empty rows, so the per-rank shares really matter
UNEVEN_LENGTHS = (5, 0, 3, 0, 4, 2, 5)
SPAWN_TIMEOUT_S = 240


def backward(
    model, ref_model, batch, cfg, rank, world, version, device="cpu"
) -> update.UpdateResult:
    """One update's gradients, left on the parameters unclipped (no optimizer), and its reduced
    figures."""
    return update.update_on_batch(
        model, ref_model, None, batch, cfg, rank, world, version, 0, device
    )


def make_batch(seed=0, lengths=COMPLETION_LENGTHS):
    """A fixed synthetic batch: completions of different lengths (one empty), varied advantages."""
    rng = random.Random(seed)
    assert len(lengths) == NUM_SAMPLES
    samples = []
    for i, n in enumerate(lengths):
        completion = [rng.randint(3, 25) for _ in range(n)]
        # near log(1/26): weights vary
        behaviour = [-3.26 + rng.uniform(-0.5, 0.5) for _ in range(n)]
        advantage = (-1.0) ** i * (0.3 + 0.25 * i)  # nonzero, all different, both signs
        samples.append(
            buffer.Sample(list(PROMPT), completion, behaviour, [0] * n, float(i % 2), advantage)
        )
    return buffer.collate(samples, PAD_ID)


def _worker(rank, world, init_file, model_path, agg, shared, version, lengths, results):
    """One trainer rank: build, one loss + backward + clip + AdamW step, optionally publish."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = config.Config() if agg is None else config.Config(agg=agg)
        model = models.build_trainer_model(model_path, world)
        # The optimizer is built before the first forward.
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

        result = backward(model, None, make_batch(lengths=lengths), cfg, rank, world, version=0)
        grads = {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            .detach()
            .clone()
            # before clipping (which would hide a scale error)
            for name, p in model.named_parameters()
        }
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = float(
            grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if shared is not None:
            sync.publish_model(model, shared, version, rank, world)
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            results.put(
                {
                    "loss": result.loss,
                    "grad_norm": grad_norm,
                    "grads": {k: v.numpy() for k, v in grads.items()},
                    "state": {k: v.detach().clone().numpy() for k, v in state.items()},
                    "names": [name for name, _ in model.named_parameters()],
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and torn down: skip the interpreter's exit, where a gloo thread has aborted the process
    # (SIGABRT, "terminate called without an active exception") about once in a few hundred runs.
    results.close()
    results.join_thread()
    os._exit(0)


def run_world(
    world, model_path, tmp_path, agg=None, shared=None, version=0, lengths=COMPLETION_LENGTHS
):
    """Spawn `world` ranks of `_worker`; return rank 0's results (raises if any rank fails)."""
    got = spawn_ranks(_worker, world, tmp_path, model_path, agg, shared, version, lengths)
    got["grads"] = {k: torch.from_numpy(v) for k, v in got["grads"].items()}
    got["state"] = {k: torch.from_numpy(v) for k, v in got["state"].items()}
    return got


def spawn_ranks(worker, world, tmp_path, *args):
    """Run `worker(rank, world, init_file, *args, results)` on `world` spawned ranks; return what
    rank 0 puts into `results` (raises if any rank fails or time runs out)."""
    init_file = str(tmp_path / f"dist-init-{world}-{time.monotonic_ns()}")
    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        worker,
        args=(world, init_file, *args, results),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    got = None
    try:
        # Read the result before joining: rank 0 cannot
        # exit until its (large) queue item is consumed.
        while got is None:
            try:
                got = results.get(timeout=0.5)
            except queue_lib.Empty:
                # raises ProcessRaisedException / ProcessExitedException
                if context.join(timeout=0):
                    raise AssertionError("all ranks exited without sending a result")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no result from world size {world} within {SPAWN_TIMEOUT_S} s"
                    )
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"world size {world} did not exit within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return got


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return builtin.build_tiny_model(str(tmp_path_factory.mktemp("fsdp") / "tiny"), seed=0)


@pytest.fixture(scope="module")
def initial_state(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_batch_is_what_the_test_means():
    batch = make_batch()
    assert len(batch) == NUM_SAMPLES
    assert batch.mask.sum(1).tolist() == [5, 1, 3, 0, 4, 2, 5]
    assert len(set(batch.advantages.tolist())) == NUM_SAMPLES and (batch.advantages != 0).all()
    # the world-size test's batch: its two ranks' shares hold unequal completion tokens and unequal
    # non-empty rows, so the per-rank shares really matter (each normalised by its own count and
    # averaged, the loss would differ)
    uneven = make_batch(lengths=UNEVEN_LENGTHS)
    lengths = uneven.attention_mask.sum(1).tolist()
    a, b = buffer.rows_for_rank(lengths, 0, 2), buffer.rows_for_rank(lengths, 1, 2)
    assert sorted(a + b) == list(range(NUM_SAMPLES))
    assert int(uneven.mask[a].sum()) != int(uneven.mask[b].sum())
    assert int(uneven.mask[a].any(1).sum()) != int(uneven.mask[b].any(1).sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_world_size_1_and_2_agree(agg, model_path, initial_state, tmp_path):
    one = run_world(1, model_path, tmp_path, agg=agg, lengths=UNEVEN_LENGTHS)
    two = run_world(2, model_path, tmp_path, agg=agg, lengths=UNEVEN_LENGTHS)

    assert one["names"] == two["names"]
    assert abs(one["loss"]) > 1e-3  # a real loss, not a degenerate zero
    assert one["loss"] == pytest.approx(two["loss"], abs=1e-6, rel=1e-6)
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    for name in one["names"]:
        ref, got = one["grads"][name], two["grads"][name]
        scale = float(ref.abs().max())
        assert float((got - ref).abs().max()) <= 1e-5 * scale + 1e-9, f"gradient of {name} differs"

    # Each world's step is AdamW's on its own gradients, not the states against each other: a step
    # moves a weight by lr * g / (|g| + eps), so a gradient at the rounding floor (1.8e-8 against
    # 2.2e-8, the tensor's largest 0.2) moves it by a different fraction of lr in each world.
    cfg = config.Config(agg=agg)
    for result in (one, two):
        expected = first_adamw_step(initial_state, result["grads"], result["grad_norm"], cfg)
        got = {name: result["state"][name] for name in expected}  # (not a tied lm_head)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    changed = sum(not torch.equal(v, initial_state[k]) for k, v in one["state"].items())
    assert changed >= len(one["state"]) // 2  # the optimizer step really moved the weights


def first_adamw_step(initial, grads, grad_norm, cfg, eps=1e-8):
    """The weights after torch's AdamW's first step (eps: its default) on `grads` clipped to
    cfg.grad_clip: the bias corrections cancel, so each moves by lr * g / (|g| + eps)."""
    clip, decay = min(1.0, cfg.grad_clip / (grad_norm + 1e-6)), 1 - cfg.lr * cfg.weight_decay
    g = {name: grad.double() * clip for name, grad in grads.items()}
    return {k: (initial[k] * decay - cfg.lr * g[k] / (g[k].abs() + eps)).float() for k in g}


def _skeleton_shapes(model_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=torch.float32
        )
    return shared_weights.named_shapes_of(skeleton)


# 3: uneven FSDP2 shards (26 vocab rows -> 9/9/8, 128
# -> 43/43/42); there in bf16: each rank casts its rows
@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16)])
def test_publish_writes_the_full_state_dict(world, dtype, model_path, initial_state, tmp_path):
    shared = shared_weights.SharedWeights.allocate(_skeleton_shapes(model_path), dtype=dtype)
    assert shared.buffer.abs().sum() == 0 and shared.version() == 0

    got = run_world(world, model_path, tmp_path, shared=shared, version=7)

    assert [slot.name for slot in shared.layout] == got["names"]
    assert shared.version() == 7
    assert int(shared.header[shared_weights.SEQ]) == 2  # one complete write: even, not torn
    assert shared.publish_time_ns() > 0
    state = got["state"]
    for slot in shared.layout:
        published = shared.view(slot)
        assert torch.equal(published, state[slot.name].to(dtype)), (
            f"{slot.name}: published != gathered state"
        )
    # the buffer holds the trained weights, not the checkpoint's
    assert any(
        not torch.equal(shared.view(s), initial_state[s.name].to(dtype)) for s in shared.layout
    )
    # a reader gets a consistent snapshot with the published version
    out = torch.empty_like(shared.buffer)
    assert shared.read_snapshot(out) == 7 and torch.equal(out, shared.buffer)


# --------------------------------------------------------------------------------------------------
# bf16: the policy under FSDP2 mixed precision, and the sharded reference model
# --------------------------------------------------------------------------------------------------
def _bf16_worker(rank, world, model_path, init_file, results):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        policy = models.build_trainer_model(model_path, world, compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        reference = models.build_reference_model(model_path, world, dtype=torch.bfloat16)
        batch = make_batch()
        ref_logits = reference(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits
        embed = reference.model.embed_tokens.weight
        # sharded, bf16, and the root resharded after a
        # no-grad forward (it would stay whole otherwise)
        ref_sharded = all(
            isinstance(p, DTensor) and p.dtype == torch.bfloat16 and not p.requires_grad
            for p in reference.parameters()
        )
        ref_rows = embed.to_local().shape[0] if isinstance(embed, DTensor) else None
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        results.put(
            {
                "rank": rank,
                "ref_logits": ref_logits.float().numpy(),
                "ref_dtype": str(ref_logits.dtype),
                "policy_logits": logits.detach().float().numpy(),
                "policy_dtype": str(logits.dtype),
                "ref_sharded": ref_sharded,
                "ref_rows": ref_rows,
                "masters": sorted({str(p.dtype) for p in policy.parameters()}),
                "grads": sorted({str(p.grad.dtype) for p in policy.parameters()}),
                "optimizer_state": sorted(
                    {
                        str(v.dtype)
                        for st in optimizer.state.values()
                        for k, v in st.items()
                        if k != "step"
                    }
                ),
            }
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_bf16_policy_keeps_fp32_masters_and_the_reference_is_the_original_model_sharded(
    model_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    world = 2
    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _bf16_worker,
        args=(world, model_path, str(tmp_path / "init"), results),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    got = {}
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while len(got) < world:
        try:
            r = results.get(timeout=0.5)
            got[r["rank"]] = r
        except queue_lib.Empty:
            assert not context.join(timeout=0), "the ranks exited without their results"
            assert time.monotonic() < deadline, "no results from the ranks"
    while not context.join(timeout=1):
        assert time.monotonic() < deadline
    vocab = 26  # rows of the embedding: 13 per rank at world size 2
    batch = make_batch()
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = plain(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits.float()
    for rank in range(world):
        r = got[rank]
        assert r["ref_sharded"] and r["ref_rows"] == vocab // world
        assert r["ref_dtype"] == "torch.bfloat16" and r["policy_dtype"] == "torch.bfloat16"
        # the reference is the original weights in bf16: the same logits as an unsharded bf16 copy
        torch.testing.assert_close(torch.from_numpy(r["ref_logits"]), expected, rtol=0, atol=1e-2)
        # The policy, before its first step, computes the same bf16 forward as the reference (KL 0).
        torch.testing.assert_close(
            torch.from_numpy(r["policy_logits"]),
            torch.from_numpy(r["ref_logits"]),
            rtol=0,
            atol=1e-2,
        )
        assert r["masters"] == r["grads"] == r["optimizer_state"] == ["torch.float32"]


# --------------------------------------------------------------------------------------------------
# The publish in batches (issue 37): the same bytes as the per-parameter publish it replaced
# --------------------------------------------------------------------------------------------------
LORA_RANK = 3  # lora_A's 3 rows split 2 / 1 over two ranks: a rank with a shorter chunk
PUBLISH_CASES = ("tied", "untied", "lora")
PUBLISH_DTYPES = (torch.float32, torch.bfloat16)


def _lora_config():
    from trainer import lora

    return lora.peft_config(LORA_RANK, 2 * LORA_RANK, 0.0, "all-linear")


def per_parameter_publish(model, layout, dtype, rank):
    """The publish before issue 37, as the reference: each parameter cast to the buffer's dtype,
    gathered (DTensor.full_tensor) and copied into its slot by rank 0. Rank 0 gets the buffer."""
    expected = torch.zeros(shared_weights.packed_numel(layout), dtype=dtype)
    with torch.no_grad():
        for slot, param in zip(layout, sync.trainable_parameters(model)):
            full = param.detach().to(dtype)
            full = full.full_tensor() if hasattr(full, "full_tensor") else full
            if rank == 0:
                expected[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(full)
    return expected


def _publish_worker(rank, world, init_file, paths, multi_writer, results):
    """Per model: new values on every rank's shards, then the per-parameter reference and the
    publish into each sink (the shared CPU buffer's many writers; a single writer, as on a GPU; the
    remote sink); rank 0 reports which buffers equal the reference, and the elements gathered."""
    import torch.distributed as dist

    from run import remote
    from trainer import models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gathered = []

    def counting(all_gather):
        def counting_all_gather(output, *args, **kwargs):
            gathered.append(output.numel())
            return all_gather(output, *args, **kwargs)

        return counting_all_gather

    for name in ("all_gather_single", "all_gather_into_tensor"):  # sync's buckets (not DTensor's)
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))

    class SingleWriter(shared_weights.SharedWeights):
        single_writer = True  # what a GPU buffer is: rank 0 alone maps it

    class Sent:
        def send_weights(self, version, flat):
            self.version, self.flat = version, flat.clone()

    report = {}
    try:
        for case in PUBLISH_CASES:
            model = models.build_trainer_model(
                paths[case], world, lora_config=_lora_config() if case == "lora" else None
            )
            torch.manual_seed(rank)
            with torch.no_grad():  # B = 0 in a fresh adapter: move every weight
                for param in sync.trainable_parameters(model):
                    local = sync.local_part(param)
                    local.add_(0.01 * torch.randn(local.shape))
            for dtype in PUBLISH_DTYPES:
                layout = multi_writer[case, dtype].layout
                expected = per_parameter_publish(model, layout, dtype, rank)
                header = torch.zeros(3, dtype=torch.int64)
                single = SingleWriter(
                    torch.zeros_like(expected) if rank == 0 else None, header, layout, dtype=dtype
                )
                sent = Sent()
                remote_sink = remote.RemoteWeights(layout, dtype, sent if rank == 0 else None)
                del gathered[:]
                sync.publish_model(model, single, 5, rank, world)
                elements = sum(gathered)
                sync.publish_model(model, remote_sink, 6, rank, world)
                sync.publish_model(model, multi_writer[case, dtype], 7, rank, world)
                if rank == 0:
                    report[case, str(dtype)] = dict(
                        single=torch.equal(single.buffer, expected) and single.version() == 5,
                        remote=torch.equal(sent.flat, expected) and sent.version == 6,
                        multi=torch.equal(multi_writer[case, dtype].buffer, expected),
                        gathered=elements,
                        trainable=expected.numel(),
                        frozen=sum(p.numel() for p in model.parameters() if not p.requires_grad),
                    )
        if rank == 0:
            results.put(report)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def untied_model_path(model_path, tmp_path_factory):
    """The tiny model with its own output head (the tiny models tie it to the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.5)
    path = str(tmp_path_factory.mktemp("untied") / "tiny")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("world", [1, 2])
def test_the_batched_publish_writes_the_bytes_of_the_per_parameter_one(
    world, model_path, untied_model_path, tmp_path
):
    """Every sink, fp32 and bf16, a tied and an untied model and a LoRA adapter: bit-equal to the
    per-parameter publish. The single writer gathers FSDP2's row shards in buckets: what trains and
    no more (LoRA: the adapter, not the frozen base), in few all-gathers; at world size 1 none."""
    from run import prepare
    from trainer import lora

    paths = {"tied": model_path, "untied": untied_model_path, "lora": model_path}
    shapes = {case: prepare.model_shapes(paths[case]) for case in ("tied", "untied")}
    shapes["lora"] = lora.adapter_shapes(model_path, _lora_config())[0]
    assert len(shapes["untied"]) == len(shapes["tied"]) + 1  # the head is a parameter of its own
    multi_writer = {
        (case, dtype): shared_weights.SharedWeights.allocate(shapes[case], dtype=dtype)
        for case in PUBLISH_CASES
        for dtype in PUBLISH_DTYPES
    }
    report = spawn_ranks(_publish_worker, world, tmp_path, paths, multi_writer)
    assert len(report) == len(PUBLISH_CASES) * len(PUBLISH_DTYPES)
    for key, got in report.items():
        assert got["single"] and got["remote"] and got["multi"], f"{key}: {got}"
        if world == 1:
            assert got["gathered"] == 0, key
        else:  # each rank's rows padded to a whole chunk: a little more than what trains
            assert got["trainable"] <= got["gathered"] < 1.2 * got["trainable"], f"{key}: {got}"
        assert (got["frozen"] > 10 * got["trainable"]) == (key[0] == "lora"), key
