"""trainer/lora.py — LoRA adapters (`--lora-rank R`): what the trainer trains and the generator
serves.

Role: the PEFT config built from the flags, the adapter's tensor names and its on-disk format
(checkpoints, the final adapter, `--merge-at-end`). Only the adapter gets gradients, fills the
shared buffer (shared_weights.py) and is loaded by vLLM on each sync
(`vllm_worker.WeightSyncWorker.load_shared_adapter`).
Data contract
    - Tensor names are PEFT's file names (`base_model.model.<module>.lora_A.weight`): what
      adapter_model.safetensors holds, what vLLM's loader reads, and the shared buffer's slot names.
    - An adapter folder = adapter_config.json + adapter_model.safetensors.
    - The initial adapter is PEFT's (B = 0: it starts as the base model), from
      `torch.manual_seed(seed)`, so every FSDP2 rank builds the same one.
May touch: the model it is handed and the folders it is told to write.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from infra import devices
from trainer import replay

ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter; it is not part of the file names
# vLLM sizes its LoRA buffers for one of these ranks
# (`--max-lora-rank`); the adapter's rank may be lower.
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def config_of(cfg):
    """The run's adapter config (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets); None:
    full fine-tuning."""
    return (
        peft_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        if cfg.lora_rank
        else None
    )


def peft_config(rank: int, alpha: int, dropout: float, targets: str):
    """The LoraConfig for the flags. `targets`: "all-linear" (PEFT: every linear layer except the
    output head) or comma-separated module names such as "q_proj,v_proj"."""
    # peft only in LoRA runs (slow to import): each peft import here is lazy
    from peft import LoraConfig

    names = targets.strip()
    target_modules = (
        names if names == "all-linear" else [t.strip() for t in names.split(",") if t.strip()]
    )
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def engine_max_rank(rank: int) -> int:
    """The smallest rank vLLM can size its LoRA buffers for that holds an adapter of `rank`."""
    for allowed in VLLM_MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"--lora-rank {rank} is larger than vLLM supports ({VLLM_MAX_RANKS[-1]})")


SERVED_ID = 1  # vLLM's id of the one adapter the generator serves (ids start at 1)


@dataclass
class Served:
    """The generator's one seam for what it serves: the engine's options, what every request names,
    and the worker call that loads a publish. Full fine-tuning: no options, the weights reloaded in
    place."""

    engine_options: dict = field(default_factory=dict)  # AsyncEngineArgs extras
    request_options: dict = field(default_factory=dict)  # AsyncLLM.generate extras
    adapter_dir: str = ""  # the adapter's folder ("": the full weights)

    def load_call(self, version: int) -> tuple[str, tuple]:
        """The worker method (vllm_worker.py) and arguments that load the buffer: the adapter in
        place, or the full weights."""
        if self.adapter_dir:
            return "load_shared_adapter", (version, self.adapter_dir, SERVED_ID)
        return "load_shared_weights", (version,)


def served_weights(rank: int, adapter_dir: str) -> Served:
    """How the generator serves the trained weights: with --lora-rank the adapter from
    `adapter_dir`, which every request names (vLLM is imported here: in the generator process only);
    rank 0, the full weights."""
    if not rank:
        return Served()
    from vllm.lora.request import LoRARequest

    # PEFT doubles a fused MoE gate_up_proj's rank
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        rank = max([rank, *json.load(f).get("rank_pattern", {}).values()])
    return Served(
        dict(enable_lora=True, max_lora_rank=engine_max_rank(rank), max_loras=1, max_cpu_loras=1),
        dict(lora_request=LoRARequest("policy", SERVED_ID, adapter_dir)),
        adapter_dir,
    )


class AdapterOff:
    """The policy with its adapter switched off, scored like a model: the frozen reference
    of --kl-coef with LoRA (the base weights, so no second copy of them). Like the separate
    reference of full fine-tuning, it routes itself: with --router-replay its MoE routers (the
    policy's) set the generator's recorded routes aside for its forward (replay.own_routing says
    why)."""

    def __init__(self, policy):
        self.policy = policy
        self.config = policy.config

    def __call__(self, **inputs):
        with self.policy.disable_adapter(), replay.own_routing(self.policy):
            return self.policy(**inputs)

    def get_decoder(self):
        return self.policy.get_decoder()

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


def file_name(param_name: str) -> str:
    """PEFT parameter name -> the adapter file's tensor name (drops the adapter name)."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def synced_parameters(model):
    """(name in the shared buffer, parameter) for every trainable parameter: the whole model, or
    with LoRA only the adapter (in PEFT's file naming)."""
    return [(file_name(name), p) for name, p in model.named_parameters() if p.requires_grad]


def wrap(model, config, seed: int, adapter_dir: str = ""):
    """Wrap `model` in a trainable LoRA adapter; load the adapter's weights from `adapter_dir` if
    given."""
    from peft import get_peft_model

    torch.manual_seed(seed)  # the same random A on every rank (each rank builds the whole model)
    peft_model = get_peft_model(model, config)
    if adapter_dir:
        load_adapter_weights(peft_model, adapter_dir)
    return peft_model


def load_adapter_weights(peft_model, adapter_dir: str) -> None:
    from peft import set_peft_model_state_dict

    state = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise RuntimeError(
            f"{adapter_dir} lacks adapter weights for {missing[:3]} (and {len(missing)} in all): "
            "was it trained with other --lora-targets?"
        )


def base_model_of(model):
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adapter_shapes(model_path: str, config) -> tuple[list[tuple[str, tuple[int, ...]]], object]:
    """(file name, shape) of every adapter tensor, in parameter order, and the resolved config (with
    "all-linear" expanded to module names), from a skeleton on the meta device (no weights are
    read)."""
    from peft import get_peft_model

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=devices.MASTER_DTYPE
        )
    try:
        peft_model = get_peft_model(skeleton, config)
    except ValueError as err:  # PEFT: "Target modules {...} not found in the base model"
        raise SystemExit(
            f"error: --lora-targets {','.join(sorted(config.target_modules))}: {err}"
        ) from None
    shapes = [
        (file_name(n), tuple(p.shape)) for n, p in peft_model.named_parameters() if p.requires_grad
    ]
    if not shapes:
        raise SystemExit(
            f"error: --lora-targets {config.target_modules} matches no module of {model_path}"
        )
    return shapes, peft_model.peft_config[ADAPTER_NAME]


def write_config(config, base_model: str, dst: str) -> str:
    """Write `adapter_config.json` into `dst` (all the generator needs besides the tensors)."""
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    os.makedirs(dst, exist_ok=True)
    config.save_pretrained(dst)
    return dst


def save_adapter(state: dict, config, base_model: str, dst: str) -> str:
    """Save adapter tensors ({file name: tensor}) and config in PEFT format
    (PeftModel.from_pretrained)."""
    write_config(config, base_model, dst)
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in state.items()},
        os.path.join(dst, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst


def merge(base_model: str, adapter_dir: str, dst: str) -> str:
    """Write base + adapter as one plain Hugging Face model (`--merge-at-end`), with the
    tokenizer."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=devices.MASTER_DTYPE)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(dst)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(dst)
    return dst
