"""generator/shared_weights.py — the packed weight buffer and its seqlock: one flat tensor shared
between processes.

Role: every synced parameter packed back to back in one tensor of one dtype, allocated once (CPU
shared memory; on GPUs a CUDA tensor that other processes map through a CUDA IPC handle), written in
place by one side and read by the other under a seqlock, with the version of what was written. The
trainer writes it (sync.publish_model), the vLLM worker extension reads it
(vllm_worker.WeightSyncWorker).
Data contract: a `Slot` per parameter (name, shape, offset, numel), in the order given; header =
[seq, version, publish_time_ns] in CPU shared memory, `seq` odd while a writer is inside; a reader
keeps only what no writer touched, with its version.
May touch: the tensors it allocates or is handed, and torch's CPU sharing strategy
(`share_by_file_name`, when a buffer is allocated or received). Imports torch and the standard
library only, so it copies out on its own.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

SEQ, VERSION, PUBLISH_NS = 0, 1, 2
MIN_WAIT_S = 1.0  # the least a reader waits for a writer inside the buffer
# A reader waits for a writer at least as long as a publish of the whole buffer takes at this rate,
# so large and remote publishes (bytes arriving over the network between begin_write and end_write)
# are waited for: the cross-machine publish measured 1.6 GB/s over loopback (bench/README.md); 50
# MB/s leaves a wide margin.
SLOWEST_PUBLISH_BYTES_PER_S = 50e6


def share_by_file_name() -> None:
    """Share CPU tensors by file name in this process (torch's "file_system" strategy), before the
    buffer is first shared: a storage first shared by file descriptor and later pickled by name is
    silently *moved* to a new segment, and the two sides would stop seeing each other. Called by
    `SharedWeights.allocate` and on receiving a buffer (every process that holds one may forward
    it)."""
    mp.set_sharing_strategy("file_system")


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
    raise RuntimeError(
        f"the packed weight buffer is on GPU {uuid}, which this process cannot see "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, "
        f"{len(uuids)} GPU(s) visible): a reader must see the buffer's GPU to open its IPC handle"
    )


_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments


@dataclass(frozen=True)
class CudaIpcHandle:
    """How another process maps the packed CUDA buffer: torch's CUDA IPC arguments, the GPU named by
    UUID."""

    gpu_uuid: str
    # torch.multiprocessing.reductions.rebuild_cuda_tensor's, device index left None
    rebuild_args: tuple

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

    Writers: `begin_write` / `write_param` or `write_params` (many at once) / `end_write(version)`
    (one process, or FSDP2 ranks each writing their own rows between barriers). Readers:
    `read_snapshot` (retries until it copies a state no writer touched) or `read_in_place` (a
    repeatable read, the engine's reload, on the buffer itself under the same check: a GPU worker
    never allocates a copy). On CUDA the launching process owns the buffer (on the first trainer
    GPU) and outlives every reader; the header stays in CPU shared memory; `end_write` and the
    readers wait for their device copies before they touch `seq`. Others receive a
    `CudaIpcHandle` naming the GPU by UUID (indices differ under CUDA_VISIBLE_DEVICES) and open it
    on first use of `.buffer` (one that only forwards it, like vLLM's front end, never opens it:
    torch cannot re-share a CUDA tensor it received)."""

    def __init__(
        self,
        buffer: torch.Tensor | None,
        header: torch.Tensor,
        layout: list[Slot],
        ipc_handle: CudaIpcHandle | None = None,
        dtype: torch.dtype | None = None,
        starts_empty: bool = False,
    ):
        # flat, one dtype: CPU shared memory, or CUDA memory (None: not opened yet)
        self._buffer = buffer
        self.header = header  # int64 [seq, version, publish_time_ns], always in CPU shared memory
        self.layout = layout
        self._ipc = ipc_handle  # set in processes that received a CUDA buffer
        # The serving dtype, known without opening a received
        # CUDA buffer (FSDP2 ranks cast to it before gathering).
        self.dtype = buffer.dtype if buffer is not None else (dtype or torch.float32)
        # True: the generator serves nothing until it has loaded the trainer's first publish (an
        # adapter that vLLM does not hold yet, a resume's weights); False: it starts from the
        # weights it loaded itself.
        self.starts_empty = starts_empty

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            # first use in a receiving process: map the owner's memory
            self._buffer = self._ipc.open()
        return self._buffer

    @property
    def nbytes(self) -> int:
        """What one sync moves: every slot, in the buffer's dtype."""
        return sum(slot.numel for slot in self.layout) * self.dtype.itemsize

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda", without opening a received CUDA buffer."""
        return "cuda" if self._ipc is not None else self._buffer.device.type

    def _shareable(self) -> tuple:
        """(buffer or handle, header, layout, dtype, starts_empty): what crosses to another
        process."""
        # received: forward the owner's handle (a received CUDA tensor cannot be re-shared)
        if self._ipc is not None:
            return self._ipc, self.header, self.layout, self.dtype, self.starts_empty
        if self._buffer.device.type == "cuda":
            return (
                CudaIpcHandle.of(self._buffer),
                self.header,
                self.layout,
                self.dtype,
                self.starts_empty,
            )
        return self._buffer, self.header, self.layout, self.dtype, self.starts_empty

    def __reduce__(self):
        return _rebuild_shared, self._shareable()

    @property
    def single_writer(self) -> bool:
        """Only the owner's process writes it (a CUDA buffer, mapped by the first trainer rank
        alone): sync.publish_model gathers the parameters on every rank and rank 0 writes them
        whole."""
        return self.device_type == "cuda"

    @staticmethod
    def allocate(
        named_shapes, dtype=torch.float32, device="cpu", starts_empty=False
    ) -> "SharedWeights":
        share_by_file_name()
        layout = make_layout(named_shapes)
        buffer = torch.zeros(packed_numel(layout), dtype=dtype, device=device)
        if buffer.device.type == "cpu":
            buffer.share_memory_()
        header = torch.zeros(3, dtype=torch.int64).share_memory_()
        return SharedWeights(buffer, header, layout, starts_empty=starts_empty)

    def view(self, slot: Slot, buffer: torch.Tensor | None = None) -> torch.Tensor:
        buf = self.buffer if buffer is None else buffer
        return buf[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # ---- writer side (trainer) ----
    def begin_write(self) -> None:
        self.header[SEQ] += 1  # odd: readers retry

    def write_param(self, slot: Slot, value: torch.Tensor, row_start: int = 0) -> None:
        """Copy `value` into the slot; `row_start` lets a rank write only its dim-0 rows (FSDP2
        shard)."""
        dst = self.view(slot)
        if row_start or value.shape != dst.shape:
            dst = dst[row_start : row_start + value.shape[0]]
        dst.copy_(value.detach(), non_blocking=False)

    def write_params(self, slots: list, values: list, row_starts: list[int]) -> None:
        """Many writes at once (sync.publish_model's): each value's elements, in row-major order,
        into its slot from dim-0 row `row_start` on (`copy_into_slots`)."""
        copy_into_slots(self.buffer, slots, values, row_starts)

    def end_write(self, version: int) -> None:
        if self.device_type == "cuda":
            # the writes are in device memory before the version says so
            self._wait_for_device_writes()
        self.header[VERSION] = version
        self.header[PUBLISH_NS] = time.time_ns()
        self.header[SEQ] += 1  # even: consistent

    def publish(self, named_tensors, version: int) -> None:
        """Single-writer convenience: write every parameter of `named_tensors` (name -> tensor)."""
        tensors = dict(named_tensors)
        missing = [s.name for s in self.layout if s.name not in tensors]
        if missing:
            raise KeyError(
                f"publish: missing parameters {missing[:5]} (and {max(0, len(missing) - 5)} more)"
            )
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

    def read_snapshot(
        self, out: torch.Tensor, max_tries: int = 1000, max_wait_s: float | None = None
    ) -> int:
        """Copy a consistent snapshot of the buffer into `out`; return its version.

        Seqlock: read seq (must be even), copy, read seq again; equal means no writer touched the
        copy. Raises after `max_tries` torn copies, or a writer inside for `max_wait_s` (default
        `writer_wait_s()`).
        """
        wait_s = self.writer_wait_s() if max_wait_s is None else max_wait_s
        for _ in range(max_tries):
            seq_before = self._wait_while_written(wait_s)
            if seq_before is None:
                raise TimeoutError(
                    f"read_snapshot: a writer stayed inside the buffer for {wait_s:.1f} s "
                    "(writer stuck?)"
                )
            version = int(self.header[VERSION])
            out.copy_(self.buffer)
            if out.device.type == "cuda" or self.device_type == "cuda":
                self._wait_for_device_copy(out)  # the copy is done before seq is re-read
            if int(self.header[SEQ]) == seq_before:
                return version
        raise TimeoutError(
            f"read_snapshot: no consistent snapshot after {max_tries} tries (writer stuck?)"
        )

    def read_in_place(
        self, read, max_tries: int = 3, max_wait_s: float | None = None
    ) -> int | None:
        """Call `read(buffer)` straight on the shared buffer (CPU), with no copy; return the version
        it read.

        The same seqlock as `read_snapshot`: read seq (waiting while it is odd), read, re-check seq.
        A writer that touched the buffer meanwhile means `read` saw a torn mix, and it is called
        again. `read` must therefore be safe to repeat, and its result must not be used before this
        returns. Returns None when every one of `max_tries` reads was torn, or a writer stayed
        inside for `max_wait_s` (default `writer_wait_s()`): the caller falls back to
        `read_snapshot`, whose copy is short enough to get through.
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
        """Wait for copies out of the buffer: into `out`, or (None) into this process's current
        GPU."""
        dst = out.device if out is not None else torch.device("cuda", torch.cuda.current_device())
        _synchronize(dst, self.buffer.device)  # a peer copy runs on the source GPU's stream

    # ---- handing the buffer to another process as bytes (vLLM RPC arguments must be bytes) ----
    def to_bytes(self) -> bytes:
        """Pickle the handles (not the data): the receiver maps the same memory. Keep `self`
        alive."""
        buf = io.BytesIO()
        ForkingPickler(buf).dump(self._shareable())
        return buf.getvalue()

    @staticmethod
    def from_bytes(data: bytes) -> "SharedWeights":
        return _rebuild_shared(*pickle.loads(data))


def _rebuild_shared(
    buffer_or_handle, header, layout, dtype=torch.float32, starts_empty=False
) -> SharedWeights:
    # This process may forward the buffer: the generator hands it on to vLLM's worker.
    share_by_file_name()
    if isinstance(buffer_or_handle, CudaIpcHandle):
        # A received CUDA buffer is opened on first use.
        return SharedWeights(
            None,
            header,
            layout,
            ipc_handle=buffer_or_handle,
            dtype=dtype,
            starts_empty=starts_empty,
        )
    return SharedWeights(buffer_or_handle, header, layout, starts_empty=starts_empty)


def _synchronize(*devices: torch.device) -> None:
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        torch.cuda.synchronize(device)


def slot_rows(
    buffer: torch.Tensor, slot: Slot, value: torch.Tensor, row_start: int
) -> torch.Tensor:
    """The view of `buffer` that `value` fills: its elements, in row-major order, into `slot` from
    dim-0 row `row_start` on, viewed in `value`'s shape (a whole parameter; a rank's rows; several
    ranks' rows gathered side by side)."""
    start = slot.offset + row_start * math.prod(slot.shape[1:])
    if start + value.numel() > slot.offset + slot.numel:
        raise ValueError(
            f"{slot.name}: {value.numel()} elements from row {row_start} overflow its slot "
            f"{slot.shape}"
        )
    return buffer[start : start + value.numel()].view(value.shape)


def copy_into_slots(buffer: torch.Tensor, slots, values, row_starts) -> None:
    """Write each value into its `slot_rows` with one `torch._foreach_copy_` (cast to the buffer's
    dtype: the bytes of a `copy_` each; one launch for the lot on a GPU, where per-copy host work
    was most of a publish)."""
    if not values:
        return
    destinations = [
        slot_rows(buffer, slot, value, start)
        for slot, value, start in zip(slots, values, row_starts, strict=True)
    ]
    with torch.no_grad():
        torch._foreach_copy_(destinations, list(values))


def packed_numel(layout) -> int:
    """Elements of the packed buffer of a `make_layout` layout (what a GPU must hold before it is
    allocated)."""
    return layout[-1].offset + layout[-1].numel if layout else 0


def named_shapes_of(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes as the trainer's model (transformers) has them, tied weights once:
    for most families the checkpoint's, for MoE ones fused expert tensors (the vLLM worker converts
    them on load)."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]
