"""sync.py — the trainer's side of the weight sync: publish the trained weights into the packed
buffer.

Role: `publish_model` writes every trainable parameter of the trainer's model (the LoRA adapter
alone with --lora-rank: only it is trainable) into the packed buffer (shared_weights.py) and
publishes the trainer's version, from every FSDP2 rank; the vLLM worker extension (vllm_worker.py)
loads it between engine steps. The copies go in batches (one `write_params` call, one
`torch._foreach_copy_`, per all-gather bucket), not one parameter at a time: per-parameter host
work was most of a publish on a GPU (issue 37). Data contract: the buffer's layout lists the
trainable parameters in `model.named_parameters()` order (lora.synced_parameters names them); the
buffer holds each parameter cast to its dtype, the same bytes whichever path wrote them; `version` =
rollout batches trained on. May touch: the buffer it is handed and the default process group's
collectives (the model: read only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# The most one all-gather of the single-writer publish moves, by device type: its parameters'
# gathered bytes in the buffer's dtype (a larger parameter goes alone). Memory stays bounded on
# every rank: two buckets in flight, each its rank's part and the gathered whole. On a GPU, few
# collectives for the whole model (Qwen3-0.6B in bf16: about 20; the caching allocator reuses the
# memory). On a CPU, below glibc's largest mmap threshold (32 MiB): a larger tensor is mapped afresh
# at each allocation and every page faults on first touch, which made 128 MiB buckets of a 100M
# model 2.5x slower than gathering each parameter, and 16 MiB ones faster
# (bench/weight_sync.py --cross-only --publish-sizes 100M).
GATHER_BUCKET_BYTES = {"cuda": 64 * 2**20, "cpu": 16 * 2**20}


class WeightsSink(Protocol):
    """What the trainer publishes into: shared_weights.SharedWeights (this node's packed buffer) or
    remote.RemoteWeights (a generator on another machine). `layout` lists the trainable parameters'
    slots.

    A write puts a value's elements, in row-major order, into its slot from dim-0 row `row_start`
    on: a whole parameter, a rank's own FSDP2 rows, or a block of several ranks' rows gathered side
    by side (shape (ranks, rows x columns)). `write_params` is many such writes at once (one
    `torch._foreach_copy_` into the buffer's views, casting to its dtype); `write_param`, one."""

    layout: list  # shared_weights.Slot, in trainable_parameters' order
    dtype: torch.dtype  # the serving dtype the buffer holds
    # rank 0 alone writes whole (gathered) parameters; else each rank writes its shard
    single_writer: bool
    starts_empty: bool  # the generator serves nothing until the first publish
    nbytes: int

    def begin_write(self) -> None: ...

    def write_param(self, slot, value: torch.Tensor, row_start: int = 0) -> None: ...

    def write_params(self, slots: list, values: list, row_starts: list[int]) -> None: ...

    def end_write(self, version: int) -> None: ...


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What crosses to the generator, in the buffer layout's order: every parameter that trains."""
    return [p for p in model.parameters() if p.requires_grad]


def fsdp_row_start(full_rows: int, rank: int, world_size: int) -> int:
    """First dim-0 row of `rank`'s FSDP2 shard (FSDP2 shards dim 0 like `torch.chunk`)."""
    chunk = math.ceil(full_rows / world_size)
    return min(rank * chunk, full_rows)


def local_part(param) -> torch.Tensor:
    """This rank's tensor of `param`: its DTensor's local shard (no autograd under no_grad), or the
    plain tensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def layout_of(param) -> str:
    """How the ranks hold `param`: "whole" (a plain tensor, or a DTensor on a one-rank mesh: this
    rank's tensor is all of it), "rows" (FSDP2's layout: dim 0 sharded like `torch.chunk` over a 1-D
    mesh) or "other" (left to DTensor's own gather)."""
    if not isinstance(param, DTensor):
        return "whole"
    mesh, placements = param.device_mesh, param.placements
    if mesh.size() == 1 and all(p.is_shard() or p.is_replicate() for p in placements):
        return "whole"
    first = placements[0]
    if mesh.ndim == 1 and param.dim() > 0 and type(first) is Shard and first.dim == 0:
        return "rows"
    return "other"


def publish_model(model, shared: WeightsSink, version, rank, world_size):
    """Write the current weights into the packed buffer and publish `version`.

    CPU: each rank writes its own FSDP2 rows straight into the shared-memory buffer, no gather
    (`write_own_rows`). `shared.single_writer` (a GPU buffer: only rank 0 maps it; or a sender with
    the buffer's writer methods, like remote.RemoteWeights, whose rank 0 `end_write` sends the
    weights on): the trainable parameters are gathered in buckets and rank 0, the only writer,
    copies them in (`write_gathered`); `end_write` runs after every gather (on a GPU it waits for
    the device copies before bumping the version).
    """
    params = trainable_parameters(model)
    if shared.single_writer:
        with torch.no_grad():
            if rank == 0:
                shared.begin_write()
            write_gathered(shared, params, rank)
            if rank == 0:
                shared.end_write(version)
        return
    if rank == 0:
        shared.begin_write()
    if world_size > 1:
        dist.barrier()
    with torch.no_grad():
        write_own_rows(shared, params, rank, world_size)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shared.end_write(version)


def write_own_rows(shared: WeightsSink, params, rank: int, world_size: int) -> None:
    """The multi-writer publish: this rank's rows of every parameter, in one `write_params`."""
    starts = [
        fsdp_row_start(slot.shape[0], rank, world_size) if slot.shape else 0
        for slot in shared.layout
    ]
    shared.write_params(shared.layout, [local_part(p) for p in params], starts)


def write_gathered(shared: WeightsSink, params, rank: int) -> None:
    """The single-writer publish: rank 0 writes every parameter whole; every rank takes part in the
    gathers. What rank 0 holds whole it writes at once; FSDP2's row-sharded parameters are gathered
    in buckets (`gather_rows_in_buckets`: each rank's rows cast to the buffer's dtype first, as
    DTensor's gather would move them); any other layout is gathered by DTensor, one parameter at a
    time. The order of the collectives depends on the parameters' layouts alone, the same on every
    rank."""
    pairs = [(slot, param, layout_of(param)) for slot, param in zip(shared.layout, params)]
    whole = [(slot, local_part(param)) for slot, param, kind in pairs if kind == "whole"]
    if rank == 0 and whole:
        slots, values = zip(*whole)
        shared.write_params(list(slots), list(values), [0] * len(slots))
    gather_rows_in_buckets(
        shared, [(slot, param) for slot, param, kind in pairs if kind == "rows"], rank
    )
    for slot, param, kind in pairs:
        if kind == "other":
            # cast first: in bf16 the gather moves half the bytes
            full = param.to(shared.dtype).full_tensor()
            if rank == 0:
                shared.write_param(slot, full)
            del full


@dataclass
class RowsBucket:
    """Row-sharded parameters gathered by one all-gather. A rank's part holds its rows of each
    parameter back to back, each padded to the parameter's `chunk` rows (FSDP2's rows per rank: the
    last ranks may hold fewer, or none), so that every rank's part has the same size."""

    mesh: object  # the DeviceMesh the parameters are sharded over
    world: int
    slots: list = field(default_factory=list)
    locals: list = field(default_factory=list)  # this rank's rows of each parameter
    chunks: list = field(default_factory=list)
    offsets: list = field(default_factory=list)  # of each parameter in a rank's part
    numel: int = 0  # of a rank's part


def plan_buckets(pairs, itemsize: int, limit_bytes: int | None = None) -> list[RowsBucket]:
    """(slot, row-sharded parameter) pairs in buckets of at most `limit_bytes` gathered (default:
    GATHER_BUCKET_BYTES of their device; a larger parameter alone), in order; a change of mesh
    starts a new bucket."""
    buckets: list[RowsBucket] = []
    for slot, param in pairs:
        mesh, world = param.device_mesh, param.device_mesh.size()
        limit = limit_bytes or GATHER_BUCKET_BYTES.get(mesh.device_type, GATHER_BUCKET_BYTES["cpu"])
        rows, columns = slot.shape[0], math.prod(slot.shape[1:])
        chunk = math.ceil(rows / world)
        local = param.to_local()
        first = fsdp_row_start(rows, mesh.get_local_rank(), world)
        if local.shape[0] != min(chunk, rows - first):
            raise RuntimeError(
                f"publish: {slot.name} holds {local.shape[0]} rows on this rank, not FSDP2's "
                f"{min(chunk, rows - first)} of {rows}"
            )
        bucket = buckets[-1] if buckets else None
        gathered_bytes = (bucket.numel + chunk * columns) * world * itemsize if bucket else 0
        if bucket is None or bucket.mesh != mesh or (bucket.slots and gathered_bytes > limit):
            bucket = RowsBucket(mesh, world)
            buckets.append(bucket)
        bucket.slots.append(slot)
        bucket.locals.append(local)
        bucket.chunks.append(chunk)
        bucket.offsets.append(bucket.numel)
        bucket.numel += chunk * columns
    return buckets


def gather_rows_in_buckets(shared: WeightsSink, pairs, rank: int) -> None:
    """All-gather the row-sharded parameters bucket by bucket, the next bucket's gather under way
    while rank 0 copies the last one into the buffer."""
    pending = None
    for bucket in plan_buckets(pairs, shared.dtype.itemsize):
        started = start_gather(bucket, shared.dtype)
        if pending is not None:
            finish_gather(shared, *pending, rank)
        pending = (bucket, *started)
    if pending is not None:
        finish_gather(shared, *pending, rank)


def start_gather(bucket: RowsBucket, dtype: torch.dtype):
    """Cast this rank's rows into its part (one `_foreach_copy_`) and start the all-gather: (the
    collective's work, the part, the gathered parts), all kept alive until it is waited for."""
    device = bucket.locals[0].device
    part = torch.empty(bucket.numel, dtype=dtype, device=device)
    held = [
        (offset, local) for offset, local in zip(bucket.offsets, bucket.locals) if local.numel()
    ]
    if held:
        torch._foreach_copy_(
            [part[o : o + local.numel()].view(local.shape) for o, local in held],
            [local for _, local in held],
        )
    gathered = torch.empty(bucket.world * bucket.numel, dtype=dtype, device=device)
    # torch 2.13 renamed it (the old name warns); older ones have the old name alone
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = all_gather(gathered, part, group=bucket.mesh.get_group(), async_op=True)
    return work, part, gathered


def finish_gather(shared: WeightsSink, bucket: RowsBucket, work, part, gathered, rank) -> None:
    """Wait for a bucket's gather; rank 0 writes every parameter of it in one `write_params`: the
    ranks that hold a whole chunk as one block (ranks x chunk rows, read across the parts), the
    rank with the last, shorter chunk as a second piece."""
    work.wait()
    if rank != 0:
        return
    parts = gathered.view(bucket.world, bucket.numel)
    slots, values, starts = [], [], []
    for slot, chunk, offset in zip(bucket.slots, bucket.chunks, bucket.offsets):
        rows = slot.shape[0]
        columns = slot.numel // rows if rows else 0
        whole_chunks = rows // chunk if chunk else 0
        if whole_chunks:
            slots.append(slot)
            values.append(parts[:whole_chunks, offset : offset + chunk * columns])
            starts.append(0)
        rest = rows - whole_chunks * chunk
        if rest:
            slots.append(slot)
            values.append(parts[whole_chunks, offset : offset + rest * columns])
            starts.append(whole_chunks * chunk)
    shared.write_params(slots, values, starts)
