"""sync.py — the trainer's side of the weight sync: publish the trained weights into the packed
buffer.

Role: `publish_model` writes every trainable parameter of the trainer's model (the LoRA adapter
alone with --lora-rank: only it is trainable) into the packed buffer (shared_weights.py) and
publishes the trainer's version, from every FSDP2 rank; the vLLM worker extension (vllm_worker.py)
loads it between engine steps. Data contract: the buffer's layout lists the trainable parameters in
`model.named_parameters()` order (lora.synced_parameters names them); `version` = rollout batches
trained on. May touch: the buffer it is handed (the model: read only).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist


class WeightsSink(Protocol):
    """What the trainer publishes into: shared_weights.SharedWeights (this node's packed buffer) or
    remote.RemoteWeights (a generator on another machine). `layout` lists the trainable parameters'
    slots."""

    layout: list  # shared_weights.Slot, in trainable_parameters' order
    dtype: torch.dtype  # the serving dtype the buffer holds
    # rank 0 alone writes whole (gathered) parameters; else each rank writes its shard
    single_writer: bool
    starts_empty: bool  # the generator serves nothing until the first publish
    nbytes: int

    def begin_write(self) -> None: ...

    def write_param(self, slot, value: torch.Tensor, row_start: int = 0) -> None: ...

    def end_write(self, version: int) -> None: ...


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What crosses to the generator, in the buffer layout's order: every parameter that trains."""
    return [p for p in model.parameters() if p.requires_grad]


def fsdp_row_start(full_rows: int, rank: int, world_size: int) -> int:
    """First dim-0 row of `rank`'s FSDP2 shard (FSDP2 shards dim 0 like `torch.chunk`)."""
    chunk = math.ceil(full_rows / world_size)
    return min(rank * chunk, full_rows)


def publish_model(model, shared: WeightsSink, version, rank, world_size):
    """Write the current weights into the packed buffer and publish `version`.

    CPU: each rank writes its own FSDP2 rows straight into the shared-memory buffer, no gather.
    `shared.single_writer` (a GPU buffer: only rank 0 maps it; or a sender with the buffer's writer
    methods, like remote.RemoteWeights, whose rank 0 `end_write` sends the weights on): each
    parameter is gathered in turn (DTensor.full_tensor, an all-gather over NCCL; one parameter's
    worth of memory at a time) and rank 0, the only writer, copies it in; `end_write` runs after
    every gather (on a GPU it waits for the device copies before bumping the version).
    """
    if shared.single_writer:
        with torch.no_grad():
            if rank == 0:
                shared.begin_write()
            for slot, param in zip(shared.layout, trainable_parameters(model)):
                # cast first: in bf16 the gather moves half the bytes
                full = param.detach().to(shared.dtype)
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
        for slot, param in zip(shared.layout, trainable_parameters(model)):
            local = param.to_local() if hasattr(param, "to_local") else param
            shared.write_param(
                slot, local, fsdp_row_start(slot.shape[0], rank, world_size) if slot.shape else 0
            )
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shared.end_write(version)
