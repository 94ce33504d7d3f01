"""scripts/gpu_check.py — the GPU path on one GPU, with only PyTorch and transformers (no vLLM).

Role
    Checks, on a GPU machine (one GPU is enough), what `python train.py --gen-devices
    G --train-devices T` relies on, without vLLM's CUDA build:
    1. FSDP2 training steps on the GPU through the project's own functions
       (models.build_trainer_model, update.update_on_batch, sync.publish_model) in a process group
       with the GPU layout's backend (devices.GPU_BACKEND).
    2. The CUDA IPC packed sync between two processes. This process is the trainer's rank 0 and owns
       the packed device buffer (shared_weights.SharedWeights.allocate on its GPU); a second process
       plays the generator's worker: it opens the IPC handle once (SharedWeights.from_bytes), copies
       seqlock-consistent snapshots onto its own device (read_snapshot) and loads them into a
       transformers model. With 2+ GPUs it runs on GPU 1 under a reordered CUDA_VISIBLE_DEVICES (so
       the handle's GPU is found by UUID and the copy is peer-to-peer); with one GPU both processes
       share it. Latency: publish (gather + write + sync) and snapshot (copy + sync), against a
       plain device-to-device copy of the same bytes.
    3. The seqlock under fire: the trainer rewrites the whole buffer back to back (each version a
       constant) while the receiver snapshots it; a snapshot that is not one constant would be a
       torn read.
    4. Log-prob agreement after a sync: the receiver scores a batch with the weights it copied; the
       trainer scores it with its FSDP2 model; the max |difference| must be < 1e-4 (fp32).

Data contract
    stdout: exactly one JSON line, also on failure ({"ok": false, "error": ..., ...}); progress on
    stderr. Exit 0 when every check passes, 1 when one fails, 2 when no GPU is visible or a package
    is missing. `--device cpu` runs the same flow on the CPU (gloo, shared memory): what the CPU
    tests run.

Files
    This script: the flags, the environment check, the trainer's side (check_size) and the one-line
    report. The receiver process (the generator worker's stand-in) and the exchange with it:
    scripts/gpu_check_receiver.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_check_receiver import receiver_main, synchronize, wait_reply  # noqa: E402

# name -> (hidden, layers, heads); the vocabulary is tiny, so the parameters are all in the layers
SIZES = {"tiny": (128, 2, 4), "large": (1024, 8, 16)}
VOCAB = 32
LOGPROB_TOLERANCE = 1e-4


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def emit(result: dict) -> None:
    print(json.dumps(result, sort_keys=True), flush=True)


def median(xs):
    return statistics.median(xs) if xs else None


def environment_problem(device: str) -> str | None:
    """Why this check cannot run here (None: it can)."""
    try:
        import torch
    except ImportError as err:
        return f"PyTorch is not installed ({err})"
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        return (
            f"transformers is not installed ({err}); carry it as wheels "
            "(see README, 'The GPU path')"
        )
    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"no CUDA GPU visible: torch {torch.__version__} (CUDA build: {torch.version.cuda}), "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; this check "
            f"needs one GPU (use --device cpu for a dry run of the same flow)"
        )
    return None


def build_model(path: str, size: str, seed: int = 0) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads = SIZES[size]
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def synthetic_batch(
    seed: int, rows: int = 16, prompt_len: int = 6, completion_len: int = 8, group: int = 4
):
    """A GRPO batch as the trainer sees it: random prompts and completions, group-relative
    advantages."""
    import torch

    import buffer
    from advantages import group_advantages

    rng = torch.Generator().manual_seed(seed)
    rewards = torch.rand(rows // group, group, generator=rng)
    advantages = group_advantages(rewards).flatten()
    samples = []
    for i in range(rows):
        prompt = [1] + torch.randint(3, VOCAB, (prompt_len - 1,), generator=rng).tolist()
        completion = torch.randint(3, VOCAB, (completion_len,), generator=rng).tolist()
        samples.append(
            buffer.Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                behaviour_logprobs=[-3.4] * completion_len,
                token_versions=[0] * completion_len,
                reward=float(rewards.flatten()[i]),
                advantage=float(advantages[i]),
            )
        )
    return buffer.collate(samples, pad_id=0)


def to_device(batch, device):
    return batch.to(device)


# --------------------------------------------------------------------------------------------------
# The trainer side (this process: rank 0 of a one-rank FSDP2 group)
# --------------------------------------------------------------------------------------------------
def check_size(size, args, device, receiver_device, receiver_visible, peer_here, workdir):
    import torch
    import torch.multiprocessing as mp

    import config
    import sync
    import update
    from run import prepare
    from trainer import models

    result = {"size": size}
    path = build_model(os.path.join(workdir, size), size)
    cfg = config.Config()
    model = models.build_trainer_model(path, 1, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # before any forward (FSDP2 pitfall)
    # the owner: this process, on its device
    shared = prepare.allocate_shared_weights(path, device=device)
    names = [name for name, _ in model.named_parameters()]
    assert names == [slot.name for slot in shared.layout], "trainer parameters != buffer layout"
    numel = shared.buffer.numel()
    result.update(
        params=numel,
        bytes=numel * shared.buffer.element_size(),
        buffer_device=str(shared.buffer.device),
    )

    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=receiver_main,
        args=(
            shared.to_bytes(),
            path,
            receiver_device,
            receiver_visible,
            cmd_q,
            res_q,
            args.threads,
        ),
    )
    proc.start()
    try:
        ready = wait_reply(res_q, proc, "ready")
        result.update(
            receiver_device=ready["device"],
            receiver_sees_buffer_on=ready["buffer_device"],
            receiver_visible=ready["visible"],
            ipc_open_ms=ready["open_ms"],
        )

        # 1. torn reads: rewrite the whole buffer back to back while the receiver snapshots it
        cmd_q.put(("torn", args.torn_seconds))
        deadline, version, writes = time.monotonic() + args.torn_seconds + 0.3, 10**6, 0
        with torch.no_grad():
            while time.monotonic() < deadline:
                version += 1
                shared.begin_write()
                shared.buffer.fill_(float(version))
                shared.end_write(version)
                writes += 1
                time.sleep(0.001)  # a writer that never pauses can starve a seqlock reader
        result["torn_check"] = dict(wait_reply(res_q, proc, "torn"), writes=writes)

        # 2. FSDP2 steps, each published and checked on the other side
        eval_batch = synthetic_batch(seed=10_000)
        eval_lists = {
            k: getattr(eval_batch, k).tolist()
            for k in ("input_ids", "attention_mask", "targets", "mask")
        }
        eval_dev = to_device(eval_batch, device)
        steps, losses, diffs, versions_ok = [], [], [], True
        publish_ms, snapshot_ms, load_ms, e2e_ms = [], [], [], []
        for step in range(args.steps):
            # update_on_batch moves each micro-batch to the device
            batch = synthetic_batch(seed=step)
            synchronize(device)
            t0 = time.perf_counter()
            stepped = update.update_on_batch(
                model,
                None,
                optimizer,
                batch,
                cfg,
                rank=0,
                world_size=1,
                version=step,
                step=step,
                device=device,
            )
            synchronize(device)
            steps.append((time.perf_counter() - t0) * 1e3)
            losses.append(stepped.loss)

            published_ns = time.time_ns()
            t0 = time.perf_counter()
            sync.publish_model(model, shared, step + 1, 0, 1)
            publish_ms.append((time.perf_counter() - t0) * 1e3)
            with torch.no_grad():
                mine = update.completion_logprobs(
                    model, eval_dev, cfg.temperature, cfg.top_k, cfg.top_p
                ).logp.cpu()
            if hasattr(model, "reshard"):
                model.reshard()  # after a no-grad forward (FSDP2 pitfall: see shared notes)
            cmd_q.put(("load", (step + 1, eval_lists)))
            got = wait_reply(res_q, proc, "load")
            versions_ok &= got["version"] == step + 1
            theirs = torch.tensor(got["logp"], dtype=torch.float32)
            diffs.append(float((mine - theirs).abs()[eval_batch.mask].max()))
            snapshot_ms.append(got["snapshot_ms"])
            load_ms.append(got["load_ms"])
            e2e_ms.append((got["done_ns"] - published_ns) / 1e6)

        # 3. the bound: one device-to-device copy of the same
        # bytes (and peer-to-peer to the receiver's GPU)
        def copy_ms(dst):
            times = []
            for _ in range(args.reps):
                synchronize(device)
                synchronize(dst.device)
                t0 = time.perf_counter()
                dst.copy_(shared.buffer)
                synchronize(device)
                synchronize(dst.device)
                times.append((time.perf_counter() - t0) * 1e3)
            return median(times[1:] or times)

        same = torch.empty_like(shared.buffer)
        result["d2d_copy_ms"] = copy_ms(same)
        del same
        if peer_here:  # the receiver's GPU, as this process names it
            peer = torch.empty_like(shared.buffer, device=peer_here)
            result["p2p_copy_ms"] = copy_ms(peer)
            del peer

        result.update(
            fsdp_steps=args.steps,
            train_step_ms=median(steps[1:] or steps),
            loss_first=losses[0],
            loss_last=losses[-1],
            losses_finite=all(math.isfinite(x) for x in losses),
            publish_ms=median(publish_ms),
            snapshot_ms=median(snapshot_ms),
            load_into_model_ms=median(load_ms),
            publish_to_snapshot_e2e_ms=median(e2e_ms),
            logprob_max_diff=max(diffs),
            versions_ok=versions_ok,
        )
        result["sync_ms"] = result["publish_ms"] + result["snapshot_ms"]
        result["sync_over_d2d_copy"] = (
            (result["sync_ms"] / result["d2d_copy_ms"]) if result["d2d_copy_ms"] else None
        )
        result["ok"] = bool(
            versions_ok
            and result["losses_finite"]
            and max(diffs) < LOGPROB_TOLERANCE
            and result["torn_check"]["torn"] == 0
            and result["torn_check"]["snapshots"] > 0
        )
        cmd_q.put(("stop", None))
        wait_reply(res_q, proc, "bye")
        proc.join(timeout=60)
        return result
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--sizes", default="tiny,large", help=f"comma-separated, of {sorted(SIZES)}"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="FSDP2 steps per size (each one published)"
    )
    parser.add_argument("--reps", type=int, default=20, help="repetitions of the copy baseline")
    parser.add_argument("--torn-seconds", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"check": "asyncgrpo gpu path", "ok": False, "device": args.device}

    problem = environment_problem(args.device)
    if problem:
        log(f"cannot run: {problem}")
        emit(dict(result, error=problem))
        return 2

    import torch
    import torch.distributed as dist
    import transformers

    from infra import devices

    torch.set_num_threads(args.threads)
    result.update(
        torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__
    )
    stage = "setup"
    workdir = tempfile.mkdtemp(prefix="asyncgrpo-gpu-check-")
    try:
        if args.device == "cuda":
            count = torch.cuda.device_count()
            device, backend = "cuda:0", devices.GPU_BACKEND
            torch.cuda.set_device(0)
            result.update(gpus=count, gpu=torch.cuda.get_device_name(0))
            if count >= 2:  # the generator-on-another-GPU layout: peer copy, GPU found by UUID
                names = devices.visible_tokens(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
                receiver_device, receiver_visible = (
                    "cuda:0",
                    ",".join([names[1], names[0]] + names[2:]),
                )
                peer_here = "cuda:1"
                result["layout"] = "trainer on GPU 0, receiver on GPU 1 (peer-to-peer copy)"
            else:  # async on a single GPU: both processes share it
                receiver_device, receiver_visible, peer_here = "cuda:0", None, None
                result["layout"] = "one GPU shared by the trainer and the receiver"
        else:
            device, backend = "cpu", devices.CPU_BACKEND
            receiver_device, receiver_visible, peer_here = "cpu", None, None
            result["layout"] = "cpu dry run (gloo, shared memory)"
        init_file = os.path.join(workdir, "dist-init")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
        result["backend"] = backend
        result["sizes"] = {}
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            if size not in SIZES:
                raise ValueError(f"unknown size {size!r} (choose from {sorted(SIZES)})")
            stage = f"size {size}"
            log(
                f"{size}: {SIZES[size]} (hidden, layers, heads) on {device}, receiver on "
                f"{receiver_device}"
            )
            result["sizes"][size] = check_size(
                size,
                args,
                device,
                receiver_device=receiver_device,
                receiver_visible=receiver_visible,
                peer_here=peer_here,
                workdir=workdir,
            )
            log(f"{size}: {json.dumps(result['sizes'][size], sort_keys=True)}")
            if args.device == "cuda":
                torch.cuda.empty_cache()
        result["ok"] = all(r["ok"] for r in result["sizes"].values())
        stage = "done"
    except BaseException as err:
        result["error"] = f"{stage}: {type(err).__name__}: {err}"
        log(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - start
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
