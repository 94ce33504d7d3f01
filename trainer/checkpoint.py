"""trainer/checkpoint.py — sharded, atomic checkpoints and what a resume needs.

Role: the trainer ranks call `save_trainer_state` (each rank writes its own shards with PyTorch's
distributed checkpoint, DCP), `load_trainer_state` on a resume (on any number of ranks: DCP
reshards) and `save_final_model` (rank 0 writes the Hugging Face model, at the end or every
--save-hf-every steps). Every collective around a save runs on the `save_group` given (its timeout
is --save-timeout-s), so no rank times out while another writes. A checkpoint is written into a
hidden sibling folder and renamed into place when complete; one of the same step already there is
renamed aside first: every step_* folder is complete at every moment, whatever is killed when.
Data contract: OUT/checkpoints/step_00000100/ holds
    dcp/ (DCP: "model", the trained tensors, every parameter or with --lora-rank the adapter's, by
    parameter name; "optimizer", AdamW's state by parameter name; a .distcp file per rank that wrote
    and .metadata); rng.pt (rank 0's torch, python, numpy RNG states); trainer_state.json: step,
    version, base_model (the model the run first started from, carried through every resume),
    groups_dropped, world_size (the ranks that wrote it), config. A resumed run starts at `step`
    with `version`; its generator at group id step * prompts_per_step + groups_dropped: the next
    prompt of the walk (tasks/prompts.walk).
May touch: files under the checkpoint root, OUT/model and OUT/adapter.
"""

import dataclasses
import json
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from infra import devices, tracing
from infra.processes import saving
from trainer import lora

PREFIX = "step_"
HIDDEN = (".tmp-", ".old-")  # a checkpoint being written; one being replaced


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints, oldest first (hidden folders are not listed)."""
    if not os.path.isdir(root):
        return []
    names = sorted(
        n
        for n in os.listdir(root)
        if n.startswith(PREFIX) and os.path.exists(os.path.join(root, n, "trainer_state.json"))
    )
    return [os.path.join(root, n) for n in names]


def resolve(resume: str, out_dir: str) -> str:
    """`--resume latest` or a checkpoint folder -> that folder; one clear error line otherwise."""
    if resume == "latest":
        found = list_checkpoints(checkpoint_root(out_dir))
        if not found:
            raise SystemExit(
                f"error: --resume latest: no checkpoint under {checkpoint_root(out_dir)}; "
                "run with --save-every N first, or give a checkpoint folder"
            )
        path = found[-1]
    elif not os.path.exists(os.path.join(resume, "trainer_state.json")):
        raise SystemExit(
            f"error: --resume {resume}: not a checkpoint folder (no trainer_state.json)"
        )
    else:
        path = os.path.abspath(resume)
    if not os.path.exists(os.path.join(path, "dcp", ".metadata")):
        raise SystemExit(
            f"error: --resume: {path} has no sharded state (dcp/): it was written by an older "
            "version (model/ + optimizer.pt), which this one cannot resume"
        )
    return path


def load_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def config_differences(
    saved: dict, current: dict, ignore=("resume", "steps", "out", "train_ranks")
) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if k not in ignore and saved.get(k) != current.get(k)
    ]


def save_model(full_state: dict, base_model: str, dst: str) -> None:
    """Save full weights in Hugging Face format, with the tokenizer of `base_model` (the weights are
    not copied: a skeleton on the meta device takes them as they are)."""
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(base_model), dtype=devices.MASTER_DTYPE
        )
    plain.load_state_dict(full_state, assign=True)
    plain.tie_weights()  # assign=True replaced the shared tensor of tied embeddings by two
    plain.save_pretrained(dst)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(dst)


def fsync_tree(folder: str) -> None:
    for parent, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                os.fsync(f.fileno())


def move_into_place(tmp: str, final: str) -> None:
    """Rename the complete folder `tmp` to `final`. A folder already at `final` (the same step
    written again) is renamed aside first and deleted after: a kill at any point leaves no half
    folder at `final`."""
    aside = os.path.join(os.path.dirname(final), HIDDEN[1] + os.path.basename(final))
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


# --------------------------------------------------------------------------------------------------
# What the trainer ranks save and load (collectives: every rank calls)
# --------------------------------------------------------------------------------------------------
def trained_tensors(model, optimizer) -> dict:
    """The sharded state a checkpoint holds: each rank's own shards (DTensors), no gathering. With
    LoRA the model part is the adapter only (the base is the original model, which the run
    reloads)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if not all(p.requires_grad for p in model.parameters()):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    return {"model": model_state, "optimizer": optimizer_state}


def save_trainer_state(
    model,
    optimizer,
    base_model,
    cfg,
    step,
    version,
    rank,
    save_group,
    groups_dropped=0,
    storage_writer=None,
) -> str:
    """Write a checkpoint (every rank writes its shards; rank 0 the rest, then renames it into
    place) and keep the newest --keep-checkpoints. Returns its folder. `storage_writer`: DCP's
    (default: files)."""
    root = checkpoint_root(cfg.out)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    tmp = os.path.join(root, HIDDEN[0] + os.path.basename(final))  # the same name on every rank
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(save_group)
    # The writer fsyncs each rank's files (sync_files) before the collective that ends the save.
    dcp.save(
        trained_tensors(model, optimizer),
        process_group=save_group,
        storage_writer=storage_writer or dcp.FileSystemWriter(os.path.join(tmp, "dcp")),
    )
    if rank == 0:
        torch.save(
            {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
            os.path.join(tmp, "rng.pt"),
        )
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(
                {
                    "step": step,
                    "version": version,
                    "base_model": os.path.abspath(base_model),
                    "groups_dropped": groups_dropped,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "config": dataclasses.asdict(cfg),
                },
                f,
                indent=2,
            )
        fsync_tree(tmp)
        move_into_place(tmp, final)
        for stale in [os.path.join(root, n) for n in os.listdir(root) if n.startswith(HIDDEN)]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while writing
        if cfg.keep_checkpoints > 0:
            for old in list_checkpoints(root)[: -cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(save_group)  # every rank returns once the checkpoint is in place
    return final


def load_trainer_state(model, optimizer, resume_dir, save_group) -> None:
    """Load a checkpoint's model (or adapter) and optimizer state into this rank's shards, whatever
    the number of ranks that wrote it, and rank 0's RNG states."""
    state = trained_tensors(model, optimizer)
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(os.path.join(resume_dir, "dcp")),
        process_group=save_group,
    )
    adapter_only = not all(p.requires_grad for p in model.parameters())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=not adapter_only),
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        restore_rng(resume_dir)


def full_trained_state(model) -> dict:
    """The trained weights, gathered (a collective; rank 0 gets the tensors, on the CPU): every
    parameter, or with LoRA the adapter's (PEFT file names)."""
    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if all(p.requires_grad for p in model.parameters()):
        # full fine-tuning (also holds tied weights, which named_parameters lists once)
        return full_state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {lora.file_name(name): value for name, value in full_state.items() if name in trainable}


def save_final_model(model, model_path, cfg, rank, save_group=None):
    """Gather the trained weights (a collective) and save them on rank 0: OUT/model in Hugging Face
    format, or with LoRA OUT/adapter in PEFT format (and OUT/model merged with --merge-at-end). The
    other ranks wait for rank 0 on `save_group`."""
    state = full_trained_state(model)
    if rank == 0:

        def replace(out_dir, write):
            tmp = os.path.join(os.path.dirname(out_dir), HIDDEN[0] + os.path.basename(out_dir))
            shutil.rmtree(tmp, ignore_errors=True)
            write(tmp)
            move_into_place(tmp, out_dir)

        model_dir = os.path.join(cfg.out, "model")
        if not cfg.lora_rank:
            replace(model_dir, lambda dst: save_model(state, model_path, dst))
        else:
            adapter_dir = os.path.join(cfg.out, "adapter")
            replace(
                adapter_dir,
                lambda dst: lora.save_adapter(state, model.peft_config["default"], model_path, dst),
            )
            if cfg.merge_at_end:
                replace(model_dir, lambda dst: lora.merge(model_path, adapter_dir, dst))
    state = None  # (the writers above hold it too) the gathered weights go before the wait
    barrier(save_group)


def restore_rng(path: str) -> None:
    states = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


# --------------------------------------------------------------------------------------------------
# A trainer rank's saves (`trainer`: train.Rank)
# --------------------------------------------------------------------------------------------------
@tracing.timed("checkpoint")
def save_checkpoint(trainer, step: int) -> str:
    """A sharded checkpoint (every rank writes), inside `infra.processes.saving` (the parent waits
    for it if the run is ending meanwhile)."""
    t0 = time.perf_counter()
    where = save_trainer_state(
        trainer.model,
        trainer.optimizer,
        trainer.prepared.base_model,
        trainer.cfg,
        step=step,
        version=trainer.version,
        rank=trainer.rank,
        save_group=trainer.save_group,
        groups_dropped=trainer.control.groups_dropped.value,
    )
    if trainer.rank == 0:
        print(
            f"checkpoint {where} written in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return where


@tracing.timed("save model")
def save_hf_model(trainer) -> None:
    """OUT/model (with LoRA OUT/adapter): gathered, written by rank 0 (inside `saving`)."""
    save_final_model(
        trainer.model, trainer.prepared.base_model, trainer.cfg, trainer.rank, trainer.save_group
    )


def save_when_due(trainer, step: int, last: bool) -> None:
    """A checkpoint every --save-every steps; the Hugging Face model every --save-hf-every (but at
    the last step: the end writes it anyway)."""
    cfg = trainer.cfg
    checkpoint_due = cfg.save_every and (step + 1) % cfg.save_every == 0
    model_due = cfg.save_hf_every and (step + 1) % cfg.save_hf_every == 0 and not last
    if checkpoint_due or model_due:
        with saving(trainer.control):  # the parent waits for a save in progress
            if checkpoint_due:
                save_checkpoint(trainer, step + 1)
            if model_due:
                save_hf_model(trainer)
