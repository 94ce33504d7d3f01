"""checkpoint.py — atomic checkpoints and what a resume needs.

Role: the trainer ranks call `save_trainer_state` and `save_final_model` (collectives; rank 0 writes). A
checkpoint is written into a hidden folder and renamed into place when complete: a run killed while writing
leaves the previous one loadable.
Data contract: OUT/checkpoints/step_00000100/ holds
    model/ (Hugging Face format) or, with --lora-rank, adapter/ (PEFT format); optimizer.pt (unsharded, keyed
    by parameter name); rng.pt (rank 0's torch, python, numpy RNG states); trainer_state.json: step, version,
    base_model (the model the run first started from, carried through every resume), groups_dropped, config.
    A resumed run starts at `step` with `version`; its generator at group id step * prompts_per_step +
    groups_dropped: the next prompt of the walk (data.walk).
May touch: files under the checkpoint root, OUT/model and OUT/adapter.
"""
import dataclasses
import json
import os
import random
import shutil

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from transformers import AutoModelForCausalLM, AutoTokenizer

import devices
import lora

PREFIX = "step_"


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary folders are not listed)."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith(PREFIX)
                   and os.path.exists(os.path.join(root, n, "trainer_state.json")))
    return [os.path.join(root, n) for n in names]


def resolve(resume: str, out_dir: str) -> str:
    """`--resume latest` or a checkpoint folder -> that folder; one clear error line otherwise."""
    if resume == "latest":
        found = list_checkpoints(checkpoint_root(out_dir))
        if not found:
            raise SystemExit(f"error: --resume latest: no checkpoint under {checkpoint_root(out_dir)}; "
                             "run with --save-every N first, or give a checkpoint folder")
        return found[-1]
    if not os.path.exists(os.path.join(resume, "trainer_state.json")):
        raise SystemExit(f"error: --resume {resume}: not a checkpoint folder (no trainer_state.json)")
    return os.path.abspath(resume)


def load_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def config_differences(saved: dict, current: dict, ignore=("resume", "steps", "out")) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
            if k not in ignore and saved.get(k) != current.get(k)]


def save_model(full_state: dict, base_model: str, dst: str) -> None:
    """Save full weights in Hugging Face format, with the tokenizer of `base_model`."""
    plain = AutoModelForCausalLM.from_pretrained(base_model, dtype=devices.MASTER_DTYPE)
    plain.load_state_dict(full_state)
    plain.save_pretrained(dst)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(dst)


def save(root: str, step: int, version: int, model_state: dict, optimizer_state: dict, base_model: str,
         config: dict, keep: int, adapter_config=None, groups_dropped: int = 0) -> str:
    """Write a checkpoint atomically; keep the newest `keep` (0 keeps all). Returns its folder.
    With `adapter_config` (a peft LoraConfig), `model_state` is the adapter's tensors (PEFT file names)."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    tmp = os.path.join(root, f".tmp-{PREFIX}{step:08d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if adapter_config is None:
        save_model(model_state, base_model, os.path.join(tmp, "model"))
    else:
        lora.save_adapter(model_state, adapter_config, base_model, os.path.join(tmp, "adapter"))
    torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": step, "version": version, "base_model": os.path.abspath(base_model),
                   "groups_dropped": groups_dropped, "config": config}, f, indent=2)
    for folder, _, files in os.walk(tmp):  # on disk before the rename makes it visible
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    for stale in [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".tmp-")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while writing
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------
# What the trainer ranks save (collectives: every rank calls; rank 0 writes)
# ----------------------------------------------------------------------------------------------------
def save_trainer_state(model, optimizer, model_path, cfg, step, version, rank, groups_dropped=0):
    """Gather full model and optimizer state (collectives: every rank calls) and write them on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = trained_state(model, get_model_state_dict(model, options=options))
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if rank != 0:
        return None
    return save(checkpoint_root(cfg.out), step, version, model_state, optimizer_state,
                           model_path, dataclasses.asdict(cfg), cfg.keep_checkpoints,
                           adapter_config=model.peft_config["default"] if cfg.lora_rank else None,
                           groups_dropped=groups_dropped)


def trained_state(model, full_state):
    """What a checkpoint keeps of the model: everything, or with LoRA the adapter (PEFT file names)."""
    if all(p.requires_grad for p in model.parameters()):
        return full_state  # full fine-tuning (also holds tied weights, which named_parameters lists once)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {lora.file_name(name): value for name, value in full_state.items() if name in trainable}


def save_final_model(model, model_path, cfg, rank):
    """Gather the trained weights (a collective) and save them on rank 0: OUT/model in Hugging Face format,
    or with LoRA OUT/adapter in PEFT format (and OUT/model merged with --merge-at-end)."""
    state = trained_state(model, get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if rank != 0:
        return

    def replace(out_dir, write):
        tmp = out_dir + ".tmp"
        write(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)

    model_dir = os.path.join(cfg.out, "model")
    if not cfg.lora_rank:
        return replace(model_dir, lambda dst: save_model(state, model_path, dst))
    adapter_dir = os.path.join(cfg.out, "adapter")
    replace(adapter_dir, lambda dst: lora.save_adapter(state, model.peft_config["default"], model_path, dst))
    if cfg.merge_at_end:
        replace(model_dir, lambda dst: lora.merge(model_path, adapter_dir, dst))


def restore_rng(path: str) -> None:
    states = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
