"""The GPU path, as far as a CPU can check it (the machine CI runs on has no GPU).

- devices.py: parsing of --gen-devices/--train-devices, validation (one clear line), the CPU
  fallback, and the layouts: split GPUs, one shared GPU (bounded vLLM memory), tensor parallel,
  CUDA_VISIBLE_DEVICES.
- shared_weights.py's protocol with CPU tensors: handles as bytes across a spawned process with a
  version bump after it mapped the buffer; the CUDA IPC handle's lazy opening, forwarding without
  re-sharing, and the GPU found by UUID (a stand-in for torch's rebuild function); the device waits
  in the seqlock's order.
- sync.publish_model's GPU branch (cast to the buffer's dtype, gather the parameters, rank 0 the
  only writer) at world size 2 on gloo.
- --gpu-memory-utilization and --dtype auto in the layout; the vLLM worker's GPU load (in place from
  the IPC buffer under the seqlock, never a full-size snapshot), with a recording stand-in for
  vLLM's runner.
scripts/gpu_check.py is tested in tests/test_gpu_check.py.
"""

import pickle
import time
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

import sync
from generator import shared_weights, vllm_worker
from infra import devices
from run import prepare


# --------------------------------------------------------------------------------------------------
# devices.py
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [("", ()), ("cpu", ()), ("CPU", ()), (" 0 ", (0,)), ("1,2,3", (1, 2, 3)), ("3, 1", (3, 1))],
)
def test_parse_device_lists(text, expected):
    assert devices.parse_devices(text, "--gen-devices") == expected


@pytest.mark.parametrize(
    "text,needle",
    [
        ("a", "GPU indices"),
        ("-1", "GPU indices"),
        ("cuda:0", "GPU indices"),
        ("1,,2", "GPU indices"),
        ("0,0", "appears twice"),
    ],
)
def test_bad_device_lists_give_one_line_naming_the_flag(text, needle):
    with pytest.raises(devices.DeviceError) as err:
        devices.parse_devices(text, "--train-devices")
    message = str(err.value)
    assert needle in message and message.startswith("--train-devices") and "\n" not in message


def test_no_flags_is_the_cpu_path_unchanged():
    layout = devices.plan("", "", train_ranks=2)  # no GPU query at all
    assert (layout.kind, layout.world_size, layout.backend, layout.buffer_device) == (
        "cpu",
        2,
        "gloo",
        "cpu",
    )
    assert (
        layout.generator_settings() == {} and layout.train_device(1) == "cpu" and not layout.notice
    )
    cfg = prepare.parse_args([])
    assert (cfg.gen_devices, cfg.train_devices) == ("", "")
    assert devices.layout_for(cfg) == devices.DeviceLayout("cpu", world_size=1)


def test_gpus_asked_for_without_cuda_fall_back_to_the_cpu_with_a_notice():
    layout = devices.plan("0", "1,2", train_ranks=1, cuda_count=0)
    assert layout.kind == "cpu" and layout.world_size == 1 and layout.generator_settings() == {}
    assert "no CUDA device" in layout.notice and "CPU path" in layout.notice
    # this machine: the flags parse, the run would go the CPU path
    if not torch.cuda.is_available():
        cfg = prepare.parse_args(["--gen-devices", "0", "--train-devices", "1,2"])
        assert devices.layout_for(cfg).kind == "cpu"


@pytest.mark.parametrize(
    "gen,train_,ranks,count,needle",
    [
        ("0", "", 1, 4, "go together"),
        ("cpu", "1", 1, 4, "go together"),
        ("0", "4", 1, 4, "GPU 4 does not exist"),
        ("5", "1", 1, 4, "--gen-devices 5: GPU 5 does not exist"),
        ("0", "1,2", 3, 4, "--train-ranks 3 does not match"),
    ],
)
def test_layout_errors_are_one_clear_line(gen, train_, ranks, count, needle):
    with pytest.raises(devices.DeviceError) as err:
        devices.plan(gen, train_, train_ranks=ranks, cuda_count=count, visible_env="")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_device_flags_stop_train_before_anything_starts():
    with pytest.raises(SystemExit) as err:
        prepare.parse_args(["--gen-devices", "0"])
    assert "go together" in str(err.value)
    with pytest.raises(SystemExit) as err:
        prepare.parse_args(["--gen-devices", "x", "--train-devices", "1"])
    assert "--gen-devices 'x'" in str(err.value)


def test_split_layout_generator_on_its_gpu_trainers_on_the_others():
    layout = devices.plan("0", "1,2,3", train_ranks=1, cuda_count=4, visible_env="")
    assert layout.on_gpu and layout.world_size == 3 and layout.shared_gpus == ()
    assert [layout.train_device(r) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:3"]
    assert layout.backend == "cpu:gloo,cuda:nccl" and layout.buffer_device == "cuda:1"
    # vLLM on GPU 0; the worker also sees the buffer's
    # GPU (1) to open the handle and copy peer-to-peer
    assert layout.gen_visible_devices == "0,1"
    assert layout.generator_settings() == {
        "device": "cuda",
        "cuda_visible_devices": "0,1",
        "gpu_memory_utilization": devices.DEDICATED_GEN_FRACTION,
        "tensor_parallel_size": 1,
    }
    assert layout.train_memory_fraction is None and not layout.shares_gpu(0)
    assert devices.plan("0", "1,2,3", train_ranks=3, cuda_count=4, visible_env="").world_size == 3


def test_one_shared_gpu_bounds_vllm_and_the_trainer():
    layout = devices.plan("0", "0", cuda_count=1, visible_env=None)
    assert (
        layout.on_gpu
        and layout.world_size == 1
        and layout.shared_gpus == (0,)
        and layout.shares_gpu(0)
    )
    assert layout.gen_visible_devices == "0" and layout.buffer_device == "cuda:0"
    assert layout.gpu_memory_utilization == devices.SHARED_GEN_FRACTION
    assert layout.train_memory_fraction == devices.SHARED_TRAIN_FRACTION
    # room for contexts and buffers
    assert devices.SHARED_GEN_FRACTION + devices.SHARED_TRAIN_FRACTION <= 0.9


def test_gpu_names_follow_the_launchers_cuda_visible_devices_and_tensor_parallel():
    # the launcher sees physical GPUs 4..7 as 0..3: the generator must be given the physical names
    layout = devices.plan("1", "0", cuda_count=4, visible_env="4,5,6,7")
    assert layout.gen_visible_devices == "5,4" and layout.buffer_device == "cuda:0"
    tp = devices.plan("0,1", "2", cuda_count=3, visible_env="")
    assert tp.tensor_parallel_size == 2 and tp.gen_visible_devices == "0,1,2"
    # buffer on one of vLLM's own GPUs
    overlap = devices.plan("0,1", "1", cuda_count=2, visible_env="")
    assert overlap.gen_visible_devices == "0,1" and overlap.shared_gpus == (1,)
    assert overlap.gpu_memory_utilization == devices.SHARED_GEN_FRACTION


# --------------------------------------------------------------------------------------------------
# sync.py: versions and handles with CPU tensors
# --------------------------------------------------------------------------------------------------
SHAPES = [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 2))]


def _reader(data, commands, replies):
    """A second process: map the buffer once from bytes (or a pickled object), then snapshot on
    request."""
    shared = shared_weights.SharedWeights.from_bytes(data) if isinstance(data, bytes) else data
    out = torch.empty_like(shared.buffer)
    replies.put(("opened", shared.version()))
    while commands.get(timeout=60) != "stop":
        version = shared.read_snapshot(out)
        replies.put((version, {s.name: shared.view(s, out).tolist() for s in shared.layout}))


@pytest.mark.parametrize("how", ["bytes", "object"])
def test_a_version_published_after_the_reader_mapped_the_buffer_reaches_it(how):
    shared = shared_weights.SharedWeights.allocate(SHAPES)
    first = {name: torch.full(shape, 1.0) for name, shape in SHAPES}
    shared.publish(first, version=1)
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_reader, args=(shared.to_bytes() if how == "bytes" else shared, commands, replies)
    )
    child.start()
    try:
        assert replies.get(timeout=60) == ("opened", 1)
        second = {
            name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 10
            for name, shape in SHAPES
        }
        shared.publish(second, version=2)  # in place, after the handle crossed: no second hand-over
        commands.put("read")
        version, values = replies.get(timeout=60)
        assert version == 2
        for name, _ in SHAPES:
            assert torch.equal(torch.tensor(values[name]), second[name])
        commands.put("stop")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_writer_waits_for_the_device_before_the_version_and_reader_before_rechecking():
    """The CUDA waits, in the seqlock's order, with CPU tensors standing in for device memory."""
    calls = []

    class DeviceLike(shared_weights.SharedWeights):
        device_type = "cuda"

        # must run while seq is odd and before the version changes
        def _wait_for_device_writes(self):
            calls.append(("writes", int(self.header[shared_weights.SEQ]) % 2, self.version()))

        def _wait_for_device_copy(self, out):
            calls.append(("copy", int(self.header[shared_weights.SEQ])))
            if len(calls) == 2:  # a writer starts while the first copy is still in flight: retry
                self.header[shared_weights.SEQ] += 2

    plain = shared_weights.SharedWeights.allocate(SHAPES)
    shared = DeviceLike(plain.buffer, plain.header, plain.layout)
    shared.publish({name: torch.ones(shape) for name, shape in SHAPES}, version=5)
    assert (
        calls == [("writes", 1, 0)]
        and shared.version() == 5
        and int(shared.header[shared_weights.SEQ]) == 2
    )
    out = torch.empty_like(shared.buffer)
    assert shared.read_snapshot(out) == 5
    assert [c[0] for c in calls[1:]] == ["copy", "copy"]  # the torn first copy was retried


# A stand-in for a CUDA IPC handle: opening it gives
# a CPU tensor and counts how often it was opened.
OPENED = []


@dataclass(frozen=True)
class FakeCudaHandle(shared_weights.CudaIpcHandle):
    def open(self, uuids=None, rebuild=None):
        OPENED.append(self.gpu_uuid)
        return torch.zeros(11)


def test_cuda_handle_opens_on_this_processs_index_of_the_buffers_gpu():
    args = list(range(15))
    args[shared_weights._DEVICE_ARG] = None
    handle = shared_weights.CudaIpcHandle("GPU-bbbb", tuple(args))
    seen = []
    tensor = handle.open(
        uuids=["GPU-aaaa", "GPU-bbbb"], rebuild=lambda *a: seen.append(a) or torch.zeros(1)
    )
    # index 1 here, whatever it was there
    assert tensor.shape == (1,) and seen[0][shared_weights._DEVICE_ARG] == 1
    assert all(seen[0][i] == i for i in range(15) if i != shared_weights._DEVICE_ARG)
    with pytest.raises(RuntimeError, match="cannot see"):
        handle.open(uuids=["GPU-aaaa"], rebuild=lambda *a: None)
    assert pickle.loads(pickle.dumps(handle)) == handle


def test_received_cuda_buffer_opens_lazily_and_is_forwarded_without_reopening():
    OPENED.clear()
    header = torch.zeros(3, dtype=torch.int64).share_memory_()
    layout = shared_weights.make_layout([("w", (11,))])
    received = shared_weights.SharedWeights(
        None, header, layout, ipc_handle=FakeCudaHandle("GPU-x", ())
    )
    # the generator's front end never opens it
    assert received.device_type == "cuda" and OPENED == []
    # the bytes the worker gets
    forwarded = shared_weights.SharedWeights.from_bytes(received.to_bytes())
    again = pickle.loads(pickle.dumps(received))  # what spawn does with the object
    assert OPENED == [] and forwarded._ipc == again._ipc == received._ipc
    assert forwarded.device_type == "cuda" and forwarded.layout == layout
    header[shared_weights.VERSION] = 9
    # the header is shared memory, mapped without opening the buffer
    assert forwarded.version() == 9
    assert (
        forwarded.buffer.numel() == 11
        and forwarded.buffer is forwarded.buffer
        and OPENED == ["GPU-x"]
    )


def test_cpu_buffers_still_cross_as_shared_memory():
    shared = shared_weights.SharedWeights.allocate(SHAPES)
    assert shared.device_type == "cpu" and shared._shareable()[0] is shared.buffer
    back = shared_weights.SharedWeights.from_bytes(shared.to_bytes())
    assert back.device_type == "cpu" and back._ipc is None
    assert back.buffer.data_ptr() != 0 and back.buffer.numel() == shared.buffer.numel()


# --------------------------------------------------------------------------------------------------
# sync.publish_model's GPU branch at world size 2 (gloo stands in for NCCL)
# --------------------------------------------------------------------------------------------------
def _small_model(mesh=None):
    """Two layers of 5 and 3 rows (uneven FSDP2 shards over 2 ranks) and a parameter of the root's
    own that FSDP2 does not shard: with a `mesh`, replicated over it (neither whole on each rank nor
    rows: DTensor gathers it)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    scale = torch.arange(4.0) / 3
    scale = scale if mesh is None else distribute_tensor(scale, mesh, [Replicate()])
    model.register_parameter("scale", torch.nn.Parameter(scale))
    return model


def _gather_rank(rank, world, init_file, shared, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        waits = []

        # what a rank sees on the GPU path, with CPU memory underneath
        class OnGpu(shared_weights.SharedWeights):
            device_type = "cuda"

            def _wait_for_device_writes(self):
                waits.append(int(self.header[shared_weights.SEQ]) % 2)

        # rank 1 gets no buffer at all: touching it would fail
        mine = OnGpu(
            shared.buffer if rank == 0 else None, shared.header, shared.layout, dtype=shared.dtype
        )
        mesh = init_device_mesh("cpu", (world,))
        model = _small_model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        model.scale = _small_model(mesh).scale  # replicated: DTensor's own gather
        assert all(hasattr(p, "full_tensor") for p in model.parameters())  # sharded DTensors
        sync.publish_model(model, mine, 7, rank, world)
        results.put((rank, waits))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gpu_publish_gathers_and_rank0_alone_writes_the_full_weights(tmp_path):
    """In bf16: every rank casts its shard to the buffer's dtype before the gather (half the
    bytes)."""
    reference = dict(_small_model().named_parameters())
    shared = shared_weights.SharedWeights.allocate(
        shared_weights.named_shapes_of(_small_model()), dtype=torch.bfloat16
    )
    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _gather_rank,
        args=(2, str(tmp_path / "init"), shared, results),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the ranks did not finish"
    got = dict(results.get(timeout=10) for _ in range(2))
    # rank 0 waits once, while seq is odd (rank 1 has no buffer: what is below, rank 0 wrote)
    assert got == {0: [1], 1: []}
    assert shared.version() == 7 and int(shared.header[shared_weights.SEQ]) == 2
    for slot in shared.layout:
        assert torch.equal(shared.view(slot), reference[slot.name].detach().bfloat16()), slot.name


# --------------------------------------------------------------------------------------------------
# --gpu-memory-utilization and --dtype auto
# --------------------------------------------------------------------------------------------------
def test_gpu_memory_utilization_flag_is_vllms_share_and_bounds_a_shared_trainer():
    alone = devices.plan("0", "1", cuda_count=2, visible_env="", gpu_memory_utilization=0.7)
    assert alone.gpu_memory_utilization == 0.7 and alone.train_memory_fraction is None
    assert alone.generator_settings()["gpu_memory_utilization"] == 0.7
    shared = devices.plan("0", "0", cuda_count=1, visible_env="", gpu_memory_utilization=0.5)
    assert shared.gpu_memory_utilization == 0.5
    # the rest of the budget
    assert shared.train_memory_fraction == pytest.approx(devices.SHARED_BUDGET - 0.5)
    with pytest.raises(devices.DeviceError) as err:  # vLLM would leave the trainer rank too little
        devices.plan("0", "0", cuda_count=1, visible_env="", gpu_memory_utilization=0.8)
    assert "--gpu-memory-utilization 0.8" in str(err.value) and "\n" not in str(err.value)
    for bad in ("1.5", "-0.1", "1"):
        with pytest.raises(SystemExit, match="--gpu-memory-utilization must be in"):
            prepare.parse_args(["--gpu-memory-utilization", bad])
    # 0 keeps the defaults; on the CPU path the flag changes nothing
    assert (
        devices.plan("0", "0", cuda_count=1, visible_env="").gpu_memory_utilization
        == devices.SHARED_GEN_FRACTION
    )
    assert devices.plan("", "", gpu_memory_utilization=0.5) == devices.DeviceLayout(
        "cpu", world_size=1
    )


def test_vllms_share_leaves_room_for_the_weight_buffer_on_its_gpu():
    """vLLM starts only if its share of the GPU is free at its start, and the packed buffer is there
    first. A 7B model in bf16 (15.2 GB) on an 80 GB GPU: 19% of it. vLLM's default 0.9 beside it
    would not start."""
    seven_b = 7.6e9 * 2 / 80e9
    # vLLM + buffer + contexts fit, and the default is kept while it fits
    for buffer in (0.0, 0.02, seven_b, 0.5):
        share = devices.generator_share_beside_buffer(0.0, buffer)
        assert share + buffer + devices.RESERVED_FRACTION <= 1 + 1e-9
        assert share == min(
            devices.DEDICATED_GEN_FRACTION, round(1 - devices.RESERVED_FRACTION - buffer, 4)
        )
    assert devices.generator_share_beside_buffer(0.0, 0.0) == devices.DEDICATED_GEN_FRACTION
    assert devices.generator_share_beside_buffer(0.6, seven_b) == 0.6  # asked for, and it fits
    for requested, buffer, needle in (
        (0.9, seven_b, "give at most 0.76"),
        (0.0, 0.9, "too little is left"),
    ):
        with pytest.raises(devices.DeviceError) as err:
            devices.generator_share_beside_buffer(requested, buffer)
        assert needle in str(err.value) and "\n" not in str(err.value)
    # a GPU shared with a trainer rank: vLLM + the trainer's cap + the buffer + contexts fit
    small = devices.plan("0", "0", cuda_count=1, visible_env="", buffer_fraction=0.01)
    # a small buffer changes nothing
    assert small.train_memory_fraction == devices.SHARED_TRAIN_FRACTION
    big = devices.plan("0", "0", cuda_count=1, visible_env="", buffer_fraction=seven_b)
    assert big.gpu_memory_utilization == devices.SHARED_GEN_FRACTION
    assert (
        big.gpu_memory_utilization + big.train_memory_fraction + seven_b + devices.RESERVED_FRACTION
        <= 1 + 1e-9
    )
    with pytest.raises(devices.DeviceError) as err:
        devices.plan(
            "0",
            "0",
            cuda_count=1,
            visible_env="",
            gpu_memory_utilization=0.6,
            buffer_fraction=seven_b,
        )
    assert "with the weight buffer (19% of it)" in str(err.value)
    # a trainer GPU of its own holds the buffer: vLLM's share is untouched
    split = devices.plan("0", "1", cuda_count=2, visible_env="", buffer_fraction=seven_b)
    assert split.gpu_memory_utilization == devices.DEDICATED_GEN_FRACTION


def test_dtype_auto_is_bf16_on_gpus_and_the_measured_choice_on_cpu():
    gpu = devices.plan("0", "1", cuda_count=2, visible_env="")
    cpu = devices.plan("", "")
    assert devices.resolve_dtype("auto", gpu) == "bf16"
    assert devices.resolve_dtype("auto", cpu) == devices.CPU_DEFAULT_DTYPE
    assert (
        devices.resolve_dtype("fp32", gpu) == "fp32"
        and devices.resolve_dtype("bf16", cpu) == "bf16"
    )
    assert (
        devices.torch_dtype("bf16") is torch.bfloat16
        and devices.torch_dtype("fp32") is torch.float32
    )
    assert prepare.parse_args([]).dtype == "auto"
    assert prepare.parse_args(["--dtype", "bf16"]).dtype == "bf16"
    with pytest.raises(SystemExit):
        prepare.parse_args(["--dtype", "fp16"])


# --------------------------------------------------------------------------------------------------
# The vLLM worker's load on a GPU: straight from the IPC buffer, no snapshot (CPU tensors
# underneath) --------------------------------------------------------------------------------------
class RecordingRunner:
    """Stands in for vLLM's model runner: records what each reload received (names and values)."""

    def __init__(self, on_reload=None):
        from types import SimpleNamespace

        self.reloads, self.on_reload = [], on_reload
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False))

    def reload_weights(self, weights_iterator):
        self.reloads.append({name: t.clone() for name, t in weights_iterator})
        if self.on_reload:
            self.on_reload(len(self.reloads))

    def get_model(self):
        return torch.nn.Module()  # a model with no MoE layer (no kernel to rebuild)


def gpu_worker(shared, runner):
    events = []

    class OnGpu(shared_weights.SharedWeights):
        device_type = "cuda"

        def _wait_for_device_copy(self, out):
            events.append(("wait", out, len(runner.reloads)))

    worker = vllm_worker.WeightSyncWorker()
    worker.model_runner, worker.device = runner, torch.device("cpu")
    worker.attach_shared_weights(OnGpu(shared.buffer, shared.header, shared.layout).to_bytes())
    # from_bytes rebuilt a plain one
    worker._shared = OnGpu(shared.buffer, shared.header, shared.layout)
    return worker, events


def test_gpu_worker_loads_in_place_without_a_snapshot_and_retries_a_torn_load():
    shared = shared_weights.SharedWeights.allocate(SHAPES, dtype=torch.bfloat16)
    first = {name: torch.full(shape, 1.5) for name, shape in SHAPES}
    shared.publish(first, version=3)

    def writer_interrupts(n):  # a publish lands in the middle of the first reload: that one is torn
        if n == 1:
            shared.publish({name: torch.full(shape, 2.5) for name, shape in SHAPES}, version=4)

    runner = RecordingRunner(writer_interrupts)
    worker, events = gpu_worker(shared, runner)
    assert worker._snapshot is None  # attaching allocated nothing
    assert worker.load_shared_weights(min_version=3) == 4
    assert worker._snapshot is None, "a GPU worker must never allocate a copy of the whole buffer"
    assert len(runner.reloads) == 2  # the torn reload was repeated
    # each reload waited for its device copies before seq was re-checked
    assert events == [("wait", None, 1), ("wait", None, 2)]
    last = runner.reloads[-1]
    assert list(last) == [name for name, _ in SHAPES]
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, torch.full_like(t, 2.5)) for t in last.values()
    )
    with pytest.raises(RuntimeError, match="< wanted 9"):
        worker.load_shared_weights(min_version=9)
