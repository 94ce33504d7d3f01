"""trainer/models.py — the trainer's models: FSDP2 sharding, one copy of the weights per node while
loading, LoRA's wrapper, the frozen reference (and teacher), activation checkpointing.

Role: train.start_rank builds its models here (`build_policy`, `build_frozen_models`) and sees them
only through this file: a causal LM under FSDP2, wrapped in a trainable adapter with --lora-rank
(lora.py), so the trainer's loop and update.py read the same either way.
Data contract: a Hugging Face model directory in; an FSDP2 module out (fp32 master weights; a frozen
model in the serving dtype), the same on every rank of the default process group.
May touch: the default process group (loading sends rank 0's weights to the others).
"""

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint as recompute
from transformers import AutoConfig, AutoModelForCausalLM

from infra import devices
from trainer import lora, replay


def build_policy(cfg, model_path, world_size, device):
    """The model the run trains (with --lora-rank a trainable adapter on frozen base weights); with
    --router-replay its MoE routers replay the generator's routes (--router-record: they compare
    with them)."""
    model = build_trainer_model(
        model_path,
        world_size,
        device,
        lora.config_of(cfg),
        seed=cfg.seed,
        compute_dtype=devices.torch_dtype(cfg.dtype),
    )
    if cfg.router_replay or cfg.router_record:
        base = lora.base_model_of(model)
        replay.install(model, base.model.layers, base.config, cfg.router_replay)
    return model


def build_frozen_models(cfg, prepared, policy, world_size, device):
    """(reference, teacher), each None when the run has none: the KL reference of --kl-coef (the
    original weights by `build_reference_model`; with LoRA the policy itself with its adapter off,
    no second copy) and on-policy distillation's teacher (--teacher, by `build_reference_model`,
    with LoRA too)."""
    dtype = devices.torch_dtype(cfg.dtype)
    reference = None
    if cfg.kl_coef > 0:
        reference = (
            lora.AdapterOff(policy)
            if cfg.lora_rank
            else build_reference_model(prepared.base_model, world_size, device, dtype)
        )
    teacher = (
        build_reference_model(prepared.teacher_model, world_size, device, dtype)
        if cfg.distill_coef > 0
        else None
    )
    return reference, teacher


def build_trainer_model(
    model_path,
    world_size,
    device="cpu",
    lora_config=None,
    adapter_dir="",
    seed=0,
    compute_dtype=devices.MASTER_DTYPE,
):
    """The model under FSDP2 (one copy of the weights per node while loading: see `load_sharded`);
    with a LoRA config, wrapped in a trainable adapter first (its weights from `adapter_dir` if
    given) and the base weights frozen. The parameters (master
    weights), their gradients and the optimizer state stay fp32; with `compute_dtype` bf16, FSDP2's
    mixed precision gathers the parameters in bf16 for forward and backward and reduces gradients in
    fp32 (verl's recipe). A resume loads its checkpoint into this model afterwards
    (checkpoint.load_trainer_state)."""

    def wrap(model):  # the rank that reads the weights reads the adapter's too; it sends both
        return lora.wrap(
            model, lora_config, seed, "" if model.device.type == "meta" else adapter_dir
        )

    wrap = wrap if lora_config is not None else None
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=devices.MASTER_DTYPE)
    return load_sharded(
        model_path, world_size, device, devices.MASTER_DTYPE, wrap, mp_policy=policy
    )


def build_reference_model(model_path, world_size, device="cpu", dtype=devices.MASTER_DTYPE):
    """The frozen reference of `--kl-coef` (full fine-tuning): the original weights, in the serving
    dtype, sharded under FSDP2 like the policy, so each rank holds 1/world_size of it. The root
    reshards after each forward too (FSDP2 keeps a root's parameters gathered for the backward that
    a no-grad reference never runs: the embedding and output head, the largest tensors, would stay
    whole on every rank)."""
    model = load_sharded(model_path, world_size, device, dtype, reshard_after_forward=True)
    return model.requires_grad_(False)


def load_sharded(model_path, world_size, device, dtype, wrap=None, **shard_options):
    """Rank 0 reads the weights; every rank builds the same model on the meta device, shards it
    (FSDP2), allocates its own shards only and receives them from rank 0, one tensor at a time (rank
    0 frees each as it goes), then rank 0's buffers (the rotary `inv_freq` is in no state dict:
    built on the meta device it would be garbage). `wrap` (LoRA) runs before sharding: rank 0's
    initial adapter is every rank's."""
    device = torch.device(device)
    reads = world_size == 1 or dist.get_rank() == 0
    if world_size == 1:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model = wrap(model) if wrap is not None else model
        return shard_layers_and_root(
            model, lora.base_model_of(model).model.layers, 1, device, **shard_options
        )
    full, buffers = {}, {}
    if reads:
        loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        loaded = wrap(loaded) if wrap is not None else loaded
        full, buffers = dict(loaded.state_dict()), dict(loaded.named_buffers())
        del loaded  # only `full` holds the weights now: each goes once it is sent
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=dtype
        )
    model.eval()  # as from_pretrained leaves it (dropout off)
    model = wrap(model) if wrap is not None else model
    model = shard_layers_and_root(
        model, lora.base_model_of(model).model.layers, world_size, device, **shard_options
    )
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if not isinstance(param, DTensor):
                continue  # buffers: below
            value = (
                full.pop(name)
                if reads
                else torch.empty(param.shape, dtype=param.dtype, device=device)
            )
            shard = distribute_tensor(
                value.to(device), param.device_mesh, param.placements, src_data_rank=0
            )
            param.to_local().copy_(shard.to_local())
            del value, shard
        for name, buffer in model.named_buffers():
            if reads:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)
    return model


def shard_layers_and_root(model, layers, world_size, device, **options):
    """fully_shard each decoder layer, then the root (FSDP2's usual wrapping; it moves each layer
    onto the device as it shards it)."""
    # An explicit mesh: with a CUDA build of torch, fully_shard's
    # default mesh is on the GPU even on the CPU path.
    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def checkpoint_layers(model) -> None:
    """Activation checkpointing (`--grad-checkpointing`): each decoder layer keeps only its input
    for the backward pass and recomputes the rest there, trading about one more forward for the
    activations of every layer. Applied inside FSDP2's hooks (they run around the layer's call; the
    recompute runs after the layer's pre-backward hook has gathered its weights), so it composes
    with sharding and with LoRA."""
    for layer in lora.base_model_of(model).model.layers:
        layer.forward = functools.partial(recompute, layer.forward, use_reentrant=False)


def check_layout(model, layout) -> None:
    """The packed buffer's slots name the model's trainable parameters, in order (a mismatch would
    scramble the weights the generator loads)."""
    if [name for name, _ in lora.synced_parameters(model)] != [slot.name for slot in layout]:
        raise RuntimeError("trainer parameters do not match the shared buffer's layout")
