"""sync.py — the packed weight buffer between the trainer and the vLLM generator.

Role: one flat tensor of every trainable parameter (the LoRA adapter alone with --lora-rank), in the
serving dtype, allocated once (CPU shared memory; a CUDA tensor shared by CUDA IPC on GPUs), written in
place by the trainer (`publish_model`, every FSDP2 rank) and read by the vLLM worker extension
(`WeightSyncWorker`) between engine steps. Sections: the buffer and its seqlock; the trainer's publish;
the generator's worker extension.
Data contract: `Slot`s name each parameter as vLLM's `load_weights` (or PEFT's adapter files) expect;
header = [seq, version, publish_time_ns], `seq` odd while a writer is inside; a reader keeps only what
no writer touched, with its version (the trainer's version of those weights).
May touch: the tensors it is handed (the trainer's model: read only), the vLLM worker it is installed into.
"""
from __future__ import annotations

import io
import logging
import math
import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

import lora

SEQ, VERSION, PUBLISH_NS = 0, 1, 2
VIEW_TRIES = 3  # torn in-place reloads before the worker falls back to a snapshot copy (CPU)
GPU_VIEW_TRIES = 20  # torn in-place reloads before a GPU worker gives up (it has no snapshot to fall back to)
GPU_MIN_WAIT_S = 120.0  # the least a GPU worker waits for a publish (a gather over NCCL) to finish
MIN_WAIT_S = 1.0  # the least a reader waits for a writer inside the buffer
# A reader waits for a writer at least as long as a publish of the whole buffer takes at this rate, so large and
# remote publishes (bytes arriving over the network between begin_write and end_write) are waited for: the
# cross-machine publish measured 1.6 GB/s over loopback (bench/README.md); 50 MB/s leaves a wide margin.
SLOWEST_PUBLISH_BYTES_PER_S = 50e6

# Share CPU tensors by file name, from the start: a storage first shared by file descriptor and later
# pickled by name is silently *moved* to a new segment, and the two sides would stop seeing each other.
mp.set_sharing_strategy("file_system")


# ----------------------------------------------------------------------------------------------------
# The buffer and its seqlock
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


def make_layout(named_shapes: list[tuple[str, tuple[int, ...]]]) -> list[Slot]:
    """Assign each parameter a contiguous range of the flat buffer, in the order given."""
    slots, offset = [], 0
    for name, shape in named_shapes:
        numel = math.prod(shape)
        slots.append(Slot(name, tuple(shape), offset, numel))
        offset += numel
    return slots


def gpu_uuids() -> list[str]:
    """The UUID of each GPU this process sees, by index."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_gpu_index(uuid: str, uuids: list[str]) -> int:
    """This process's index of the GPU named `uuid`; a clear error when it cannot see that GPU."""
    if uuid in uuids:
        return uuids.index(uuid)
    raise RuntimeError(f"the packed weight buffer is on GPU {uuid}, which this process cannot see "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, "
                       f"{len(uuids)} GPU(s) visible): a reader must see the buffer's GPU to open its IPC handle")


_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments


@dataclass(frozen=True)
class CudaIpcHandle:
    """How another process maps the packed CUDA buffer: torch's CUDA IPC arguments, the GPU named by UUID."""

    gpu_uuid: str
    rebuild_args: tuple  # torch.multiprocessing.reductions.rebuild_cuda_tensor's, device index left None

    @staticmethod
    def of(tensor: torch.Tensor) -> "CudaIpcHandle":
        """Share `tensor` (owned by this process) once more; the owner must keep it alive."""
        rebuild, args = reduce_tensor(tensor)
        assert rebuild is rebuild_cuda_tensor, "CudaIpcHandle.of: not a CUDA tensor"
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        args = list(args)
        args[_DEVICE_ARG] = None
        return CudaIpcHandle(uuid, tuple(args))

    def open(self, uuids: list[str] | None = None, rebuild=None) -> torch.Tensor:
        """Map the buffer into this process, on this process's index of its GPU (a peer mapping)."""
        rebuild = rebuild or rebuild_cuda_tensor
        args = list(self.rebuild_args)
        args[_DEVICE_ARG] = local_gpu_index(self.gpu_uuid, gpu_uuids() if uuids is None else uuids)
        return rebuild(*args)


class SharedWeights:
    """The packed buffer, its header and its layout. Picklable across `torch.multiprocessing` spawn.

    Writers: `begin_write` / `write_param` / `end_write(version)` (one process, or FSDP2 ranks each writing
    their own rows between barriers). Readers: `read_snapshot` (retries until it copies a state no writer
    touched) or `read_in_place` (a repeatable read, the engine's reload, on the buffer itself under the same
    check: a GPU worker never allocates a copy). On CUDA the launching process owns the buffer (on the first
    trainer GPU) and outlives every reader; the header stays in CPU shared memory; `end_write` and the readers
    wait for their device copies before they touch `seq`. Others receive a `CudaIpcHandle` naming the GPU by
    UUID (indices differ under CUDA_VISIBLE_DEVICES) and open it on first use of `.buffer` (one that only
    forwards it, like vLLM's front end, never opens it: torch cannot re-share a CUDA tensor it received)."""

    def __init__(self, buffer: torch.Tensor | None, header: torch.Tensor, layout: list[Slot],
                 ipc_handle: CudaIpcHandle | None = None, dtype: torch.dtype | None = None):
        self._buffer = buffer  # flat, one dtype: CPU shared memory, or CUDA memory (None: not opened yet)
        self.header = header  # int64 [seq, version, publish_time_ns], always in CPU shared memory
        self.layout = layout
        self._ipc = ipc_handle  # set in processes that received a CUDA buffer
        # The serving dtype, known without opening a received CUDA buffer (FSDP2 ranks cast to it before gathering).
        self.dtype = buffer.dtype if buffer is not None else (dtype or torch.float32)

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self._ipc.open()  # first use in a receiving process: map the owner's memory
        return self._buffer

    @property
    def nbytes(self) -> int:
        """What one sync moves: every slot, in the buffer's dtype."""
        return sum(slot.numel for slot in self.layout) * self.dtype.itemsize

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda", without opening a received CUDA buffer."""
        return "cuda" if self._ipc is not None else self._buffer.device.type

    def _shareable(self) -> tuple:
        """(buffer or handle, header, layout, dtype): what crosses to another process."""
        if self._ipc is not None:  # received: forward the owner's handle (a received CUDA tensor cannot be re-shared)
            return self._ipc, self.header, self.layout, self.dtype
        if self._buffer.device.type == "cuda":
            return CudaIpcHandle.of(self._buffer), self.header, self.layout, self.dtype
        return self._buffer, self.header, self.layout, self.dtype

    def __reduce__(self):
        return _rebuild_shared, self._shareable()

    @staticmethod
    def allocate(named_shapes, dtype=torch.float32, device="cpu") -> "SharedWeights":
        layout = make_layout(named_shapes)
        buffer = torch.zeros(packed_numel(layout), dtype=dtype, device=device)
        if buffer.device.type == "cpu":
            buffer.share_memory_()
        header = torch.zeros(3, dtype=torch.int64).share_memory_()
        return SharedWeights(buffer, header, layout)

    def view(self, slot: Slot, buffer: torch.Tensor | None = None) -> torch.Tensor:
        buf = self.buffer if buffer is None else buffer
        return buf[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # ---- writer side (trainer) ----
    def begin_write(self) -> None:
        self.header[SEQ] += 1  # odd: readers retry

    def write_param(self, slot: Slot, value: torch.Tensor, row_start: int = 0) -> None:
        """Copy `value` into the slot; `row_start` lets a rank write only its dim-0 rows (FSDP2 shard)."""
        dst = self.view(slot)
        if row_start or value.shape != dst.shape:
            dst = dst[row_start : row_start + value.shape[0]]
        dst.copy_(value.detach(), non_blocking=False)

    def end_write(self, version: int) -> None:
        if self.device_type == "cuda":
            self._wait_for_device_writes()  # the writes are in device memory before the version says so
        self.header[VERSION] = version
        self.header[PUBLISH_NS] = time.time_ns()
        self.header[SEQ] += 1  # even: consistent

    def publish(self, named_tensors, version: int) -> None:
        """Single-writer convenience: write every parameter of `named_tensors` (name -> tensor)."""
        tensors = dict(named_tensors)
        missing = [s.name for s in self.layout if s.name not in tensors]
        if missing:
            raise KeyError(f"publish: missing parameters {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        self.begin_write()
        try:
            for slot in self.layout:
                self.write_param(slot, tensors[slot.name])
        finally:
            self.end_write(version)

    def _wait_for_device_writes(self) -> None:
        _synchronize(self.buffer.device, torch.device("cuda", torch.cuda.current_device()))

    # ---- reader side (generator) ----
    def version(self) -> int:
        return int(self.header[VERSION])

    def publish_time_ns(self) -> int:
        return int(self.header[PUBLISH_NS])

    def writer_wait_s(self, floor_s: float = MIN_WAIT_S) -> float:
        """How long a reader waits for a writer inside the buffer: scaled with its size (see
        SLOWEST_PUBLISH_BYTES_PER_S), at least `floor_s`."""
        return max(floor_s, self.nbytes / SLOWEST_PUBLISH_BYTES_PER_S)

    def _wait_while_written(self, wait_s: float) -> int | None:
        """The even seq once no writer is inside; None if one stays inside for `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            seq = int(self.header[SEQ])
            if seq % 2 == 0:
                return seq
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0005)

    def read_snapshot(self, out: torch.Tensor, max_tries: int = 1000, max_wait_s: float | None = None) -> int:
        """Copy a consistent snapshot of the buffer into `out`; return its version.

        Seqlock: read seq (must be even), copy, read seq again; equal means no writer touched the copy.
        Raises after `max_tries` torn copies, or a writer inside for `max_wait_s` (default `writer_wait_s()`).
        """
        wait_s = self.writer_wait_s() if max_wait_s is None else max_wait_s
        for _ in range(max_tries):
            seq_before = self._wait_while_written(wait_s)
            if seq_before is None:
                raise TimeoutError(f"read_snapshot: a writer stayed inside the buffer for {wait_s:.1f} s (writer stuck?)")
            version = int(self.header[VERSION])
            out.copy_(self.buffer)
            if out.device.type == "cuda" or self.device_type == "cuda":
                self._wait_for_device_copy(out)  # the copy is done before seq is re-read
            if int(self.header[SEQ]) == seq_before:
                return version
        raise TimeoutError(f"read_snapshot: no consistent snapshot after {max_tries} tries (writer stuck?)")

    def read_in_place(self, read, max_tries: int = 3, max_wait_s: float | None = None) -> int | None:
        """Call `read(buffer)` straight on the shared buffer (CPU), with no copy; return the version it read.

        The same seqlock as `read_snapshot`: read seq (waiting while it is odd), read, re-check seq. A writer
        that touched the buffer meanwhile means `read` saw a torn mix, and it is called again. `read` must
        therefore be safe to repeat, and its result must not be used before this returns. Returns None when
        every one of `max_tries` reads was torn, or a writer stayed inside for `max_wait_s` (default
        `writer_wait_s()`): the caller falls back to `read_snapshot`, whose copy is short enough to get through.
        """
        wait_s = self.writer_wait_s() if max_wait_s is None else max_wait_s
        for _ in range(max_tries):
            seq_before = self._wait_while_written(wait_s)
            if seq_before is None:
                return None
            version = int(self.header[VERSION])
            read(self.buffer)
            if self.device_type == "cuda":
                self._wait_for_device_copy(None)  # the reads are done before seq is re-read
            if int(self.header[SEQ]) == seq_before:
                return version
        return None

    def _wait_for_device_copy(self, out: torch.Tensor | None) -> None:
        """Wait for copies out of the buffer: into `out`, or (None) into this process's current GPU."""
        dst = out.device if out is not None else torch.device("cuda", torch.cuda.current_device())
        _synchronize(dst, self.buffer.device)  # a peer copy runs on the source GPU's stream

    # ---- handing the buffer to another process as bytes (vLLM RPC arguments must be bytes) ----
    def to_bytes(self) -> bytes:
        """Pickle the handles (not the data): the receiver maps the same memory. Keep `self` alive."""
        buf = io.BytesIO()
        ForkingPickler(buf).dump(self._shareable())
        return buf.getvalue()

    @staticmethod
    def from_bytes(data: bytes) -> "SharedWeights":
        return _rebuild_shared(*pickle.loads(data))


def _rebuild_shared(buffer_or_handle, header, layout, dtype=torch.float32) -> SharedWeights:
    if isinstance(buffer_or_handle, CudaIpcHandle):
        return SharedWeights(None, header, layout, ipc_handle=buffer_or_handle, dtype=dtype)  # opened on first use
    return SharedWeights(buffer_or_handle, header, layout)


def _synchronize(*devices: torch.device) -> None:
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        torch.cuda.synchronize(device)


def packed_numel(layout) -> int:
    """Elements of the packed buffer of a `make_layout` layout (what a GPU must hold before it is allocated)."""
    return layout[-1].offset + layout[-1].numel if layout else 0


def named_shapes_of(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes in checkpoint naming (tied weights appear once)."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def fsdp_row_start(full_rows: int, rank: int, world_size: int) -> int:
    """First dim-0 row of `rank`'s FSDP2 shard (FSDP2 shards dim 0 like `torch.chunk`)."""
    chunk = math.ceil(full_rows / world_size)
    return min(rank * chunk, full_rows)


# ----------------------------------------------------------------------------------------------------
# The trainer's side: what it writes, and how FSDP2 ranks write it
# ----------------------------------------------------------------------------------------------------
def synced_parameters(model):
    """(name in the shared buffer, parameter) for every trainable parameter: the whole model, or with
    LoRA only the adapter (in PEFT's file naming)."""
    return [(lora.file_name(name), p) for name, p in model.named_parameters() if p.requires_grad]


def publish_model(model, shared, version, rank, world_size):
    """Write the current weights into the packed buffer and publish `version`.

    CPU: each rank writes its own FSDP2 rows straight into the shared-memory buffer, no gather.
    GPU: the buffer is on rank 0's GPU and only rank 0 maps it: each parameter is gathered in turn
    (DTensor.full_tensor, an all-gather over NCCL; one parameter's worth of memory at a time) and rank 0,
    the only writer, copies it in; `end_write` waits for the device copies before bumping the version.
    Remote (remote.RemoteWeights, a generator on another machine): the same gather on every rank into rank
    0's local buffer; rank 0's `end_write`, after every gather, sends it.
    """
    if shared.device_type in ("cuda", "remote"):
        with torch.no_grad():
            if rank == 0:
                shared.begin_write()
            for slot, (_, param) in zip(shared.layout, synced_parameters(model)):
                full = param.detach().to(shared.dtype)  # cast first: in bf16 the gather moves half the bytes
                full = full.full_tensor() if hasattr(full, "full_tensor") else full
                if rank == 0:
                    shared.write_param(slot, full)
                del full
            if rank == 0:
                shared.end_write(version)
        return
    if rank == 0:
        shared.begin_write()
    if world_size > 1:
        dist.barrier()
    with torch.no_grad():
        for slot, (_, param) in zip(shared.layout, synced_parameters(model)):
            local = param.to_local() if hasattr(param, "to_local") else param
            shared.write_param(slot, local, fsdp_row_start(slot.shape[0], rank, world_size) if slot.shape else 0)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shared.end_write(version)



# ----------------------------------------------------------------------------------------------------
# The generator's side: the vLLM worker extension
# ----------------------------------------------------------------------------------------------------
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM 0.32's layer-wise reload


class ExpectedReloadWarnings(logging.Filter):
    """Drops the two "X: Failed to load weights" warnings vLLM's layer-wise reload logs at every sync, both
    expected: a rotary embedding has no weights to load (its cos/sin cache is computed), and with tied
    embeddings the buffer holds the embedding once, so the LM head gets nothing (`_refresh_tied_lm_head`
    re-ties it after each load). The same warning for any other layer is a real failure and still shows."""

    def __init__(self, tied_embeddings: bool):
        super().__init__()
        self.tied_embeddings = tied_embeddings

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        expected = layer.endswith("RotaryEmbedding") or (self.tied_embeddings and layer == "ParallelLMHead")
        return not expected


class WeightSyncWorker:
    """vLLM worker extension (`worker_extension_cls="sync.WeightSyncWorker"`).

    Mixed into vLLM's worker class, so `self` is the worker: `self.model_runner.reload_weights` does the
    layer-wise reload (and on CPU, the re-packing of linear weights for its kernels) correctly, where a
    plain `model.load_weights` fails. Called through `collective_rpc`; arguments are bytes.
    """

    def attach_shared_weights(self, handles: bytes) -> int:
        self._shared = SharedWeights.from_bytes(handles)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        logging.getLogger(RELOAD_LOGGER).addFilter(ExpectedReloadWarnings(tied))
        # On a GPU worker `.buffer` opens the CUDA IPC handle here, once (on the buffer's own GPU, which must be
        # visible to this process). No snapshot on a GPU: vLLM has already sized its KV cache to fill its share.
        # On CPU a snapshot is allocated only if an in-place load ever has to fall back to it.
        self._snapshot = None
        return self._shared.buffer.numel()

    def _load_device(self) -> torch.device:
        try:
            return torch.device(self.device)  # a GPU worker's own GPU
        except AttributeError:
            return torch.device("cpu")

    def load_shared_weights(self, min_version: int = -1) -> int:
        """Reload the newest consistent weights into the engine; returns the version loaded.

        Straight from views of the shared buffer, with no private copy of it. `reload_weights` copies every
        tensor into the engine's own parameters (the same storage: CUDA graphs stay valid; on CPU re-packed
        for its kernels), so the engine never aliases the buffer. The seqlock guards the reload: if the
        trainer wrote meanwhile, the engine holds a torn mix, and we reload again. Generation is paused during
        the whole load, so a torn state is never sampled from.
        CPU: after `VIEW_TRIES` torn reloads (a writer publishing faster than we reload) we fall back to a
        snapshot copy. GPU: the copies run device to device (peer to peer when the buffer is on another
        GPU, one tensor in flight at a time); a publish there gathers every parameter over NCCL while `seq`
        is odd, so the load waits longer, and never allocates a full-size snapshot.
        """
        shared = self._shared
        if shared.device_type == "cuda":
            wait_s = shared.writer_wait_s(GPU_MIN_WAIT_S)
            version = shared.read_in_place(self._reload_from, max_tries=GPU_VIEW_TRIES, max_wait_s=wait_s)
            if version is None:
                raise RuntimeError(f"load_shared_weights: no untorn reload in {GPU_VIEW_TRIES} tries within "
                                   f"{wait_s:.0f} s (is the trainer publishing back to back?)")
        else:
            version = shared.read_in_place(self._reload_from, max_tries=VIEW_TRIES)
            if version is None:
                if self._snapshot is None:
                    self._snapshot = torch.empty_like(shared.buffer)
                version = shared.read_snapshot(self._snapshot)
                self._reload_from(self._snapshot)
        if version < min_version:
            raise RuntimeError(f"load_shared_weights: buffer holds version {version} < wanted {min_version}")
        self._refresh_tied_lm_head()
        return version

    def _reload_from(self, buffer: torch.Tensor) -> None:
        """vLLM's layer-wise reload from views of `buffer` (the shared buffer itself, or our snapshot). A view
        on another GPU than the worker's is moved over one tensor at a time, as the loader asks for it."""
        shared, device = self._shared, self._load_device()

        def weights():
            for slot in shared.layout:
                view = shared.view(slot, buffer)
                yield slot.name, view if view.device == device else view.to(device, non_blocking=True)

        self.model_runner.reload_weights(weights_iterator=weights())

    def _refresh_tied_lm_head(self) -> None:
        """With tied embeddings the checkpoint has no `lm_head.weight`, so the layer-wise reload never
        re-processes `lm_head`: on CPU its kernel keeps a packed copy of the *old* embedding (logprobs
        then drift from the trainer's). Re-tie and re-pack it."""
        model = self.model_runner.get_model()
        lm_head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        config = self.model_runner.model_config.hf_config
        if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        if lm_head is not embed and lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)

    def load_shared_adapter(self, min_version: int, adapter_dir: str, lora_id: int) -> int:
        """LoRA (`--lora-rank`): the buffer holds only the adapter. Copy a consistent snapshot of it and make
        it the engine's adapter `lora_id` in place of the previous one (requests keep their LoRARequest).
        `adapter_dir` holds the adapter's `adapter_config.json` (rank, alpha). Returns the version loaded."""
        from vllm.lora.lora_model import LoRAModel  # vLLM only in its worker process (this file runs in the trainer too)
        from vllm.lora.peft_helper import PEFTHelper

        shared = self._shared
        if getattr(self, "_adapter_snapshot", None) is None:  # small: a private CPU copy, as vLLM loads adapters
            self._adapter_snapshot = torch.empty(shared.buffer.shape, dtype=shared.buffer.dtype)
        version = shared.read_snapshot(self._adapter_snapshot,
                                       max_tries=1000 if shared.device_type == "cpu" else 100_000)
        if version < min_version:
            raise RuntimeError(f"load_shared_adapter: buffer holds version {version} < wanted {min_version}")
        workers = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        manager = workers._adapter_manager
        helper = PEFTHelper.from_local_dir(adapter_dir, workers.max_position_embeddings)
        helper.validate_legal(workers.lora_config)
        # vLLM folds the scaling into lora_b in place when it packs q/k/v: hand it copies, not our snapshot.
        tensors = {slot.name: shared.view(slot, self._adapter_snapshot).clone() for slot in shared.layout}
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
        manager.remove_adapter(lora_id)
        manager.add_adapter(lora)  # packs q/k/v (and gate/up) into vLLM's fused modules
        unknown = [name for name in lora.loras if name not in manager.modules]
        if not lora.loras or unknown:  # an adapter that silently never reaches the engine is the classic bug
            raise RuntimeError(f"the adapter's modules {unknown or '(none)'} are not LoRA modules of vLLM's "
                               f"model (those are e.g. {sorted(manager.modules)[:4]})")
        manager.activate_adapter(lora_id)  # copies A and B into the engine's stacked LoRA buffers
        return version
