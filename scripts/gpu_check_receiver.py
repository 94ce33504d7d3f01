"""scripts/gpu_check_receiver.py — the receiver of scripts/gpu_check.py: a process that plays the
generator's worker extension (vllm_worker.WeightSyncWorker) without vLLM.

Role
    Started by gpu_check.py's trainer side (check_size) as a spawned process: it opens the packed
    weight buffer's handle once (shared_weights.SharedWeights.from_bytes: CUDA IPC, the trainer's
    GPU found by UUID, or shared memory on the CPU), copies seqlock-consistent snapshots onto its
    own device (read_snapshot), loads them into a transformers model and scores a batch with them;
    under fire it snapshots while the trainer rewrites the buffer and counts torn reads.

Data contract
    Commands on `cmd_q`: ("torn", seconds), ("load", (wanted version, batch as lists)), ("stop",
    None). Replies on `res_q`, one per command: ("ready", ...) once opened, ("torn", counts),
    ("load", version, timings and log-probs), ("bye", {}); ("error", traceback) on any failure.
    `wait_reply` is the trainer's side of that exchange: one reply of the kind it expects, or a
    clear error (the receiver died, failed, or went silent past its timeout).

May touch
    CUDA_VISIBLE_DEVICES of its own process (before CUDA starts), its device, the shared buffer
    (read only).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# The receiver: plays the generator's worker extension (vllm_worker.WeightSyncWorker) without vLLM
# --------------------------------------------------------------------------------------------------
def receiver_main(handle_bytes, model_dir, device, visible, cmd_q, res_q, threads):
    if visible is not None:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        import torch
        from transformers import AutoModelForCausalLM

        import config
        import update
        from generator.shared_weights import SharedWeights

        torch.set_num_threads(threads)
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t0 = time.perf_counter()
        shared = SharedWeights.from_bytes(handle_bytes)  # the handle crossed once, as bytes
        # opened here: CUDA IPC (the trainer's GPU found by UUID) or shared memory
        buf = shared.buffer
        open_ms = (time.perf_counter() - t0) * 1e3
        # private: a torn read never reaches the model
        snapshot = torch.empty_like(buf, device=device)
        model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        )
        params = dict(model.named_parameters())
        cfg = config.Config()
        res_q.put(
            (
                "ready",
                {
                    "open_ms": open_ms,
                    "buffer_device": str(buf.device),
                    "device": str(device),
                    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                },
            )
        )
        while True:
            cmd, arg = cmd_q.get(timeout=600)
            if cmd == "stop":
                break
            # snapshot while the trainer rewrites the buffer; each version is one constant
            if cmd == "torn":
                deadline, n, torn, seen = time.monotonic() + arg, 0, 0, set()
                while time.monotonic() < deadline:
                    version = shared.read_snapshot(snapshot, max_tries=10**6)
                    lo, hi = float(snapshot.min()), float(snapshot.max())
                    torn += int(not (lo == hi == float(version)))
                    seen.add(version)
                    n += 1
                res_q.put(("torn", {"snapshots": n, "torn": torn, "versions_seen": len(seen)}))
            elif cmd == "load":
                want, batch = arg
                t0 = time.perf_counter()
                version = shared.read_snapshot(snapshot)
                synchronize(device)
                done_ns = time.time_ns()
                snapshot_ms = (time.perf_counter() - t0) * 1e3
                t1 = time.perf_counter()
                with torch.no_grad():
                    for slot in shared.layout:
                        params[slot.name].copy_(shared.view(slot, snapshot))
                    synchronize(device)
                    load_ms = (time.perf_counter() - t1) * 1e3
                    b = argparse.Namespace(
                        **{k: torch.tensor(v).to(device) for k, v in batch.items()}
                    )
                    logp = update.completion_logprobs(
                        model, b, cfg.temperature, cfg.top_k, cfg.top_p
                    ).logp
                res_q.put(
                    (
                        "load",
                        {
                            "version": version,
                            "wanted": want,
                            "snapshot_ms": snapshot_ms,
                            "load_ms": load_ms,
                            "done_ns": done_ns,
                            "logp": logp.cpu().tolist(),
                        },
                    )
                )
        # release the mapping before the owner frees anything
        del model, params, snapshot, buf, shared
        synchronize(device)
        res_q.put(("bye", {}))
    except BaseException:
        res_q.put(("error", traceback.format_exc()))


def wait_reply(res_q, proc, kind, timeout_s=300):
    import queue as queue_lib

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got, payload = res_q.get(timeout=1.0)
        except queue_lib.Empty:
            if not proc.is_alive():
                raise RuntimeError(
                    f"the receiver process died (exit code {proc.exitcode}) before '{kind}'"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no '{kind}' from the receiver in {timeout_s} s")
            continue
        if got == "error":
            raise RuntimeError(f"receiver failed:\n{payload}")
        if got != kind:
            raise RuntimeError(f"expected '{kind}' from the receiver, got '{got}'")
        return payload
