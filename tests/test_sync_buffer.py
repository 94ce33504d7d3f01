"""shared_weights.py, sync.py and buffer.py without an engine: packing, the seqlock, handles across
processes, the staleness rule and batch assembly."""

import dataclasses
import queue as queue_lib
import random
import threading

import pytest
import torch
import torch.multiprocessing as mp

import buffer
import sync
from generator import shared_weights
from infra import devices
from run import flag_checks, prepare


def small_shared():
    return shared_weights.SharedWeights.allocate(
        [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 2))]
    )


def test_layout_packs_parameters_back_to_back():
    layout = shared_weights.make_layout([("x", (2, 3)), ("y", (4,)), ("z", (1, 1))])
    assert [(s.offset, s.numel) for s in layout] == [(0, 6), (6, 4), (10, 1)]


def test_publish_then_snapshot_round_trips_every_parameter():
    shared = small_shared()
    values = {
        "a.weight": torch.randn(3, 4),
        "b.bias": torch.randn(5),
        "c.weight": torch.randn(2, 2),
    }
    shared.publish(values, version=7)
    out = torch.empty_like(shared.buffer)
    assert shared.read_snapshot(out) == 7
    for slot in shared.layout:
        assert torch.equal(shared.view(slot, out), values[slot.name])
    with pytest.raises(KeyError):
        shared.publish({"a.weight": values["a.weight"]}, version=8)


def test_a_bf16_buffer_holds_the_cast_weights_in_half_the_bytes_and_its_dtype_across_processes():
    shapes = [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 2))]
    allocate = shared_weights.SharedWeights.allocate
    fp32, bf16 = allocate(shapes), allocate(shapes, dtype=torch.bfloat16)
    # what summary.json's sync_mb says
    assert fp32.nbytes == 21 * 4 and bf16.nbytes == 21 * 2 == fp32.nbytes // 2
    # the trainer's fp32 master weights
    values = {name: torch.randn(shape) for name, shape in shapes}
    bf16.publish(values, version=3)  # cast on the way in
    for slot in bf16.layout:
        assert bf16.view(slot).dtype == torch.bfloat16
        assert torch.equal(bf16.view(slot), values[slot.name].bfloat16())
    back = shared_weights.SharedWeights.from_bytes(bf16.to_bytes())
    assert (
        back.dtype == torch.bfloat16
        and back.version() == 3
        and torch.equal(back.buffer, bf16.buffer)
    )
    # a received CUDA buffer is not opened to learn its dtype: the dtype travels with the handle
    handle = shared_weights.SharedWeights(
        None, bf16.header, bf16.layout, ipc_handle=object(), dtype=torch.bfloat16
    )
    assert handle.dtype == torch.bfloat16 and handle._shareable()[3] == torch.bfloat16


def test_fsdp_rows_of_all_ranks_tile_the_parameter():
    for rows in (1, 3, 26, 128):
        for world in (1, 2, 3):
            starts = [sync.fsdp_row_start(rows, r, world) for r in range(world)]
            sizes = [c.shape[0] for c in torch.arange(rows).chunk(world)] + [0] * world
            assert starts[0] == 0
            covered = sum(sizes[:world])
            assert covered == rows
            for r in range(1, len([s for s in sizes if s])):
                assert starts[r] == starts[r - 1] + sizes[r - 1]


def test_seqlock_never_returns_a_torn_snapshot():
    shared = shared_weights.SharedWeights.allocate([("w", (50_000,))])
    stop = threading.Event()

    def writer():
        v = 0
        while not stop.is_set():
            v += 1
            shared.begin_write()
            shared.buffer.fill_(float(v))  # a consistent snapshot is constant
            shared.end_write(v)

    thread = threading.Thread(target=writer)
    thread.start()
    out = torch.empty_like(shared.buffer)
    try:
        for _ in range(20):
            version = shared.read_snapshot(out, max_tries=100_000)
            assert out.min() == out.max() == float(version)
    finally:
        stop.set()
        thread.join()


def test_read_in_place_repeats_a_torn_read_and_gives_up_after_its_tries():
    """The in-place read the vLLM worker reloads from (CPU): a writer inside the read means read
    again; a read that is always torn, or a writer that never leaves, gives None (the caller then
    snapshots)."""
    shared = small_shared()
    shared.publish({s.name: torch.full(s.shape, 1.0) for s in shared.layout}, version=1)
    seen = []

    def read_once_torn(buf):  # the trainer publishes v2 while the first read runs
        seen.append(buf.sum().item())
        if len(seen) == 1:
            shared.publish({s.name: torch.full(s.shape, 2.0) for s in shared.layout}, version=2)

    assert shared.read_in_place(read_once_torn) == 2
    assert seen == [1.0 * shared.buffer.numel(), 2.0 * shared.buffer.numel()]

    def always_torn(buf):
        shared.begin_write()
        shared.end_write(shared.version() + 1)

    assert shared.read_in_place(always_torn, max_tries=3) is None
    shared.begin_write()  # a writer that stays inside: never read
    assert (
        shared.read_in_place(lambda buf: seen.append("read"), max_wait_s=0.01) is None
        and seen[-1] != "read"
    )
    shared.end_write(9)
    assert shared.read_in_place(lambda buf: None) == 9


def test_readers_wait_for_a_writer_as_long_as_a_publish_of_the_buffers_size_takes():
    """A large or remote publish keeps the seqlock odd for seconds (remote.py receives the bytes
    from the network between begin_write and end_write): the wait scales with the buffer, so such a
    publish is waited for."""
    small = small_shared()
    assert small.writer_wait_s() == shared_weights.MIN_WAIT_S
    # 100 MB: 2 s at the slowest publish rate
    large = shared_weights.SharedWeights.allocate([("w", (25_000_000,))])
    assert (
        large.writer_wait_s()
        == pytest.approx(large.nbytes / shared_weights.SLOWEST_PUBLISH_BYTES_PER_S)
        == 2.0
    )
    for read in (
        lambda: large.read_snapshot(torch.empty_like(large.buffer)),
        lambda: large.read_in_place(lambda b: None),
    ):
        large.begin_write()
        # longer than the 1 s floor
        writer = threading.Timer(1.5, large.end_write, args=(large.version() + 1,))
        writer.start()
        try:
            assert read() == large.version()
        finally:
            writer.join()
    large.begin_write()  # a writer that never leaves still ends the wait, with the reason
    with pytest.raises(TimeoutError, match="stayed inside the buffer"):
        large.read_snapshot(torch.empty_like(large.buffer), max_wait_s=0.05)


def _child_reads(data, result_queue):
    shared = shared_weights.SharedWeights.from_bytes(data)
    out = torch.empty_like(shared.buffer)
    result_queue.put((shared.read_snapshot(out), out.sum().item()))


def test_handles_as_bytes_map_the_same_memory_in_another_process():
    shared = small_shared()
    data = shared.to_bytes()
    assert len(data) < 10_000  # handles, not the weights
    # after pickling
    shared.publish({s.name: torch.full(s.shape, 2.0) for s in shared.layout}, version=3)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(data, results))
    child.start()
    version, total = results.get(timeout=60)
    child.join(timeout=30)
    assert version == 3 and total == 2.0 * shared.buffer.numel()


def group(gid, versions, rewards=None):
    n = len(versions)
    return buffer.RolloutGroup(
        gid,
        [1, 13, 14, 15, 25],
        [[13 + j] * len(v) for j, v in enumerate(versions)],
        [[-0.5] * len(v) for v in versions],
        versions,
        rewards or [float(j) for j in range(n)],
    )


def test_a_group_with_a_stale_sample_is_dropped_whole_and_counted():
    q = queue_lib.Queue()
    q.put(group(0, [[5, 5], [3, 4]]))  # lag 0 and lag 2 at trainer version 5: the whole group goes
    q.put(group(1, [[2, 3], [1, 1]]))  # entirely stale
    q.put(group(2, [[4, 5], [5]]))
    q.put(group(3, [[5], []]))  # an empty completion is never stale
    taken = buffer.take_groups(q, 2, trainer_version=5, max_lag=1, timeout_s=1)
    assert [g.group_id for g in taken.groups] == [2, 3]
    assert (taken.samples_kept, taken.samples_dropped, taken.groups_dropped) == (4, 4, 2)
    samples = buffer.to_samples(taken.groups, torch.tensor([[0.5, -0.5], [1.0, -1.0]]))
    # over exactly the samples trained
    assert [s.advantage for s in samples] == [0.5, -0.5, 1.0, -1.0]
    assert all(5 - min(s.token_versions) <= 1 for s in samples if s.token_versions)
    with pytest.raises(TimeoutError):
        buffer.take_groups(q, 1, trainer_version=5, max_lag=1, timeout_s=0.3)


def test_max_lag_zero_keeps_only_current_version_groups():
    q = queue_lib.Queue()
    q.put(group(0, [[7, 7, 7], [6, 7]]))
    q.put(group(1, [[7, 7], [7]]))
    taken = buffer.take_groups(q, 1, trainer_version=7, max_lag=0, timeout_s=1)
    assert [g.group_id for g in taken.groups] == [1] and taken.samples_dropped == 2


def test_dynamic_sampling_never_keeps_a_group_with_equal_rewards():
    q = queue_lib.Queue()
    for gid, rewards in enumerate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.2, 0.1]]):
        q.put(group(gid, [[5], [5]], rewards))
    replaced = []
    taken = buffer.take_groups(
        q,
        2,
        trainer_version=5,
        max_lag=1,
        timeout_s=1,
        filter_groups=True,
        on_drop=lambda: replaced.append(1),
    )
    assert (
        [g.group_id for g in taken.groups] == [1, 4]
        and taken.groups_filtered == 3
        and len(replaced) == 3
    )
    assert all(max(g.rewards) > min(g.rewards) for g in taken.groups)
    q.put(group(9, [[5], [5]], [1.0, 1.0]))
    q.put(group(10, [[5], [5]], [0.0, 1.0]))
    unfiltered = buffer.take_groups(q, 1, trainer_version=5, max_lag=1, timeout_s=1)
    assert [g.group_id for g in unfiltered.groups] == [9] and unfiltered.groups_filtered == 0
    q.get()
    for gid in range(6):  # nothing but solved prompts: a clear error, not a step that never fills
        q.put(group(gid, [[5], [5]], [1.0, 1.0]))
    with pytest.raises(RuntimeError, match="equal rewards"):
        buffer.take_groups(
            q,
            2,
            trainer_version=5,
            max_lag=1,
            timeout_s=1,
            filter_groups=True,
            max_groups_per_step=5,
        )


def test_collate_aligns_completion_targets():
    s1 = buffer.Sample([1, 13, 24], [15, 16, 2], [-0.1, -0.2, -0.3], [4, 4, 5], 1.0, 0.5)
    s2 = buffer.Sample([1, 14, 15, 24], [], [], [], 0.0, -0.5)
    batch = buffer.collate([s1, s2], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 13, 24, 15, 16, 2], [1, 14, 15, 24, 0, 0]]
    assert batch.targets[0][batch.mask[0]].tolist() == [15, 16, 2]
    assert batch.behaviour_logp[0][batch.mask[0]].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.token_versions[0][batch.mask[0]].tolist() == [4, 4, 5]
    assert not batch.mask[1].any()  # an empty completion trains nothing
    stats = buffer.staleness_stats(batch, trainer_version=5)
    assert stats["lag_max"] == 1 and stats["lag_mean"] == pytest.approx(2 / 3)


def test_rows_for_rank_partition_the_batch_balanced_by_tokens():
    generator = random.Random(0)
    for n in (1, 5, 8, 33):
        lengths = [generator.randint(1, 100) for _ in range(n)]
        for world in (1, 2, 3):
            rows = [buffer.rows_for_rank(lengths, r, world) for r in range(world)]
            assert sorted(sum(rows, [])) == list(range(n))
            loads = [sum(lengths[i] for i in share) for share in rows]
            # tokens, not rows: no two ranks further apart than the longest row
            assert max(loads) - min(loads) <= max(lengths)
    # rows of one long and many short: a split by count would give one rank nearly everything
    lengths = [1000] + [10] * 99
    loads = [sum(lengths[i] for i in buffer.rows_for_rank(lengths, r, 2)) for r in range(2)]
    assert sorted(loads) == [990, 1000]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--max-lag", "-1"], "--max-lag must be >= 0"),
        (["--group-size", "1"], "--group-size 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--sync-every", "3", "--max-lag", "1"], "--sync-every"),
        (["--model", "./does-not-exist"], "no such directory"),
    ],
)
def test_bad_flags_give_one_clear_line(argv, needle):
    with pytest.raises(SystemExit) as err:
        flag_checks.parse_args(argv)
    assert needle in str(err.value)


def test_every_config_field_is_a_flag():
    cfg = flag_checks.parse_args(
        [
            "--steps",
            "7",
            "--max-lag",
            "0",
            "--update-mode",
            "drain",
            "--eps-high",
            "0.28",
            "--wandb",
            "offline",
            "--train-ranks",
            "2",
        ]
    )
    assert (cfg.steps, cfg.max_lag, cfg.update_mode, cfg.eps_high, cfg.wandb, cfg.train_ranks) == (
        7,
        0,
        "drain",
        0.28,
        "offline",
        2,
    )
    assert flag_checks.parse_args(["--eps-high", "none"]).eps_high is None


def test_generator_settings_carry_the_config_and_the_resume_point():
    """One builder for the generator's settings (launch.run and the benchmarks both use it): the
    run's resolved Config itself, and the resume point."""
    cfg = prepare.resolve(
        flag_checks.parse_args(
            [
                "--max-lag",
                "3",
                "--top-k",
                "5",
                "--prompts-per-step",
                "4",
                "--group-size",
                "2",
                "--update-mode",
                "drain",
                "--gen-threads",
                "3",
            ]
        )
    )
    s = prepare.generator_settings(
        cfg,
        prepare.Prepared("some/model", "base", devices.plan("", ""), start_step=5, start_version=4),
    )
    assert s.cfg is cfg and (s.model, s.cfg.gen_threads, s.cfg.dtype) == ("some/model", 3, "fp32")
    assert (s.initial_version, s.first_group_id, s.device) == (4, 20, "cpu")
    # nothing changes the run's config after it is resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_lag = 1


def test_a_buffer_that_starts_empty_says_so_in_every_process(tmp_path):
    """The trainer publishes at its start, and the generator waits for that publish, exactly when
    the run's buffer starts empty: an adapter vLLM does not hold yet, or a resume's weights
    (prepare.run_weights); the flag crosses to the processes the buffer is handed to."""
    from tasks import builtin

    model = builtin.build_tiny_model(str(tmp_path / "m"))
    layout = devices.plan("", "")
    cases = {
        "full": ([], {}, False),
        "lora": (["--lora-rank", "2"], {}, True),
        "resume": ([], {"resume_dir": str(tmp_path)}, True),
    }
    for name, (argv, resume, expected) in cases.items():
        cfg = prepare.resolve(flag_checks.parse_args(argv + ["--out", str(tmp_path / name)]))
        shared, adapter_dir = prepare.run_weights(
            cfg, prepare.Prepared(model, model, layout, **resume), "cpu"
        )
        assert bool(adapter_dir) == (name == "lora")
        assert shared.starts_empty is expected, name
        assert (
            shared_weights.SharedWeights.from_bytes(shared.to_bytes()).starts_empty is expected
        ), name
