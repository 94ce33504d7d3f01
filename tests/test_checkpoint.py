"""Loading and checkpointing on FSDP2 ranks, in spawned processes over gloo (no vLLM).

- A 2-rank start (rank 0 reads the weights, rank 1 builds on the meta device and receives its
  shards) holds exactly the pretrained weights, tied embeddings still tied and rank 0's rotary
  buffers, for the policy, the LoRA-wrapped policy and the reference; a forward gives the plain
  model's loss on every rank.
- A save whose writing (a slow storage writer on one rank) takes longer than the process group's
  timeout does not fail: every collective around it waits on the save group. Writing the same step
  again replaces it. A 2-rank checkpoint loads on 1 rank and back (DCP reshards) with every tensor
  equal.
- The parent of a run waits for a trainer inside a save when another child fails (bounded), and only
  then.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from test_fsdp import spawn_ranks

import config
from infra import processes
from tasks import builtin
from trainer import checkpoint, lora, models

LORA = dict(rank=4, alpha=8, dropout=0.0, targets="all-linear")
IDS = torch.tensor([[1, 13, 14, 15, 24, 13, 14]])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return builtin.build_tiny_model(str(tmp_path_factory.mktemp("ckpt") / "tiny"), seed=0)


def gathered(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def as_arrays(tree):
    """Tensors -> numpy copies, for the results queue (plain bytes: a tensor shared by fd keeps its
    sender from exiting cleanly)."""
    if isinstance(tree, dict):
        return {k: as_arrays(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(as_arrays(v) for v in tree)
    return tree.detach().clone().numpy() if torch.is_tensor(tree) else tree


def as_tensors(tree):
    if isinstance(tree, dict):
        return {k: as_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(as_tensors(v) for v in tree)
    return torch.from_numpy(tree) if hasattr(tree, "dtype") and hasattr(tree, "shape") else tree


def all_ranks_agree(flag: bool) -> bool:
    import torch.distributed as dist

    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def report(rank, results, value) -> None:
    """Rank 0 sends the worker's result (as arrays: tensors do not outlive their process)."""
    if rank == 0:
        results.put(as_arrays(value))


def leave_group() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _start_worker(rank, world, init_file, model_path, results):
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # its buffers: the config's
        fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        expected_buffers = dict(fresh.named_buffers())
        out = {}
        for kind in ("policy", "lora", "reference"):
            if kind == "reference":
                model = models.build_reference_model(model_path, world)
            else:
                model = models.build_trainer_model(
                    model_path,
                    world,
                    lora_config=lora.peft_config(**LORA) if kind == "lora" else None,
                    seed=3,
                )
            base = lora.base_model_of(model)
            tied = base.lm_head.weight is base.model.embed_tokens.weight
            buffers = all(
                torch.equal(b, expected_buffers[n.split("base_model.model.")[-1]])
                for n, b in model.named_buffers()
            )
            with torch.no_grad():
                loss = model(input_ids=IDS, labels=IDS).loss
            out[kind] = dict(
                tied=all_ranks_agree(tied),
                buffers=all_ranks_agree(buffers),
                loss=loss.item(),
                state=gathered(model),
            )
            out[kind]["same_loss"] = all_ranks_agree(abs(loss.item() - out[kind]["loss"]) == 0)
            del model
        report(rank, results, out)
    finally:
        leave_group()


def test_a_two_rank_start_holds_the_pretrained_weights_on_every_rank(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    got = as_tensors(spawn_ranks(_start_worker, 2, tmp_path, model_path))
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert plain.config.tie_word_embeddings
    with torch.no_grad():
        plain_loss = plain(input_ids=IDS, labels=IDS).loss.item()
    expected = plain.state_dict()
    torch.manual_seed(3)
    adapted = lora.wrap(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        lora.peft_config(**LORA),
        seed=3,
    ).state_dict()
    for kind, reference in (("policy", expected), ("reference", expected), ("lora", adapted)):
        result = got[kind]
        assert result["tied"] and result["buffers"] and result["same_loss"], (kind, result)
        assert sorted(result["state"]) == sorted(reference)
        for name, value in reference.items():
            assert torch.equal(result["state"][name], value), (kind, name)
        assert result["loss"] == pytest.approx(plain_loss, abs=1e-6)
    assert any("lora_A" in name and got["lora"]["state"][name].abs().sum() > 0 for name in adapted)


class SlowWriter(dcp.FileSystemWriter):
    """DCP's file writer on a slow disk: this rank's data takes `delay_s` longer to write."""

    def __init__(self, path, delay_s):
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def trained_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return gathered(model), get_optimizer_state_dict(model, optimizer, options=options)


def _save_worker(rank, world, init_file, model_path, out, task, results):
    """`task` "save": one AdamW step, then a slow save (rank 1 writes 8 s, the process group waits 4
    s) and the same step again; "load:<dir>": load that checkpoint, then save it again as step 9."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=4),
    )
    save_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    cfg = config.Config(out=out, keep_checkpoints=0)
    try:
        model = models.build_trainer_model(model_path, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if task == "save":
            model(input_ids=IDS, labels=IDS).loss.backward()
            optimizer.step()
            root = checkpoint.checkpoint_root(out)
            slow = SlowWriter(
                os.path.join(root, ".tmp-step_00000003", "dcp"), 8 if rank == 1 else 0
            )
            checkpoint.save_trainer_state(
                model,
                optimizer,
                model_path,
                cfg,
                step=3,
                version=1,
                rank=rank,
                save_group=save_group,
                storage_writer=slow,
            )
            # The run's group after the save: nobody timed out meanwhile.
            dist.all_reduce(torch.ones(1))
            # The same step saved again: this save replaces the first.
            checkpoint.save_trainer_state(
                model,
                optimizer,
                model_path,
                cfg,
                step=3,
                version=1,
                rank=rank,
                save_group=save_group,
            )
        else:
            checkpoint.load_trainer_state(model, optimizer, task.removeprefix("load:"), save_group)
            checkpoint.save_trainer_state(
                model,
                optimizer,
                model_path,
                cfg,
                step=9,
                version=1,
                rank=rank,
                save_group=save_group,
            )
        report(rank, results, trained_state(model, optimizer))
    finally:
        leave_group()


def test_a_slow_save_does_not_time_out_and_a_checkpoint_reshards_from_2_ranks_to_1_and_back(
    model_path, tmp_path
):
    two = str(tmp_path / "two")
    saved_model, saved_optimizer = as_tensors(
        spawn_ranks(_save_worker, 2, tmp_path, model_path, two, "save")
    )
    [step3] = checkpoint.list_checkpoints(checkpoint.checkpoint_root(two))
    assert checkpoint.load_state(step3)["world_size"] == 2
    assert sorted(os.listdir(os.path.join(step3, "dcp"))) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # nothing hidden left
    assert sorted(os.listdir(checkpoint.checkpoint_root(two))) == ["step_00000003"]
    one = str(tmp_path / "one")
    for world, source, out in (
        (1, step3, one),
        (2, os.path.join(one, "checkpoints", "step_00000009"), two),
    ):
        model_state, optimizer_state = as_tensors(
            spawn_ranks(_save_worker, world, tmp_path, model_path, out, f"load:{source}")
        )
        assert sorted(model_state) == sorted(saved_model)
        for name, value in saved_model.items():
            assert torch.equal(model_state[name], value), (world, name)
        assert optimizer_state["state"].keys() == saved_optimizer["state"].keys()
        for name, moments in saved_optimizer["state"].items():
            for key, value in moments.items():
                assert torch.equal(optimizer_state["state"][name][key], value), (world, name, key)
        assert (
            checkpoint.load_state(os.path.join(out, "checkpoints", "step_00000009"))["world_size"]
            == world
        )
    assert any(m["exp_avg"].abs().sum() > 0 for m in saved_optimizer["state"].values())


def _saving_trainer(control, marker, seconds):
    with processes.saving(control):
        time.sleep(seconds)  # a save that takes this long
        open(marker, "w").close()


def _failing_generator(control):
    deadline = time.monotonic() + 120
    while control.saving.value == 0 and time.monotonic() < deadline:  # fail while the trainer saves
        time.sleep(0.05)
    raise RuntimeError("the generator failed")


@pytest.mark.parametrize("grace_s", [30.0, 0.0])
def test_a_failure_elsewhere_leaves_a_save_in_progress_time_to_finish(
    grace_s, tmp_path, monkeypatch
):
    monkeypatch.setattr(processes, "GRACE_S", 0.5)  # the ordinary grace, shorter than the save
    ctx = mp.get_context("spawn")
    control = processes.make_control(ctx)
    marker = str(tmp_path / "saved")
    children = {
        "generator": (_failing_generator, (control,), True),
        "trainer0": (_saving_trainer, (control, marker, 6), False),
    }
    code = processes.run_children(ctx, children, ctx.Queue(), control, save_grace_s=grace_s)
    assert code == 1
    # waited for while it saved; killed after 0.5 s without
    assert os.path.exists(marker) == (grace_s > 0)
