"""bench/moe_paired.py — bench/moe.py's paired measurement, in a child process: vLLM (bf16, the
worker's route recording) samples copy prompts x 8 completions of exactly N tokens for each length
asked for; the trainer's model (`models.build_trainer_model`, bf16 compute, one gloo rank) scores
them twice, its routers live, then replaying the recorded routes (`update.completion_logprobs`
inside `replay.routed_by`): mismatch_k3, max |delta log p| and router agreement of each, on the very
same tokens. What it shows and why: bench/moe.py's docstring.
Data: in, a model folder (the tiny MoE, or the weights a run ended with), the prompts, the lengths,
the threads and the seed; out, {str(N): figures}. It touches only its own vLLM engine (in this
process, shut down before scoring) and a temporary file for the process group.
"""

from __future__ import annotations

# the project, torch and vLLM are imported inside the functions (common.setup_paths)


def paired(model_path: str, prompts: int, lengths: list[int], threads: int, seed: int) -> dict:
    """{N: figures} of one model's samples scored with live and with replayed routes (in a child
    process)."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import tempfile

    import torch
    import torch.distributed as dist
    from vllm import LLM, SamplingParams

    import buffer
    import losses
    import update
    from generator import routes
    from tasks import builtin, chat
    from trainer import models, replay

    torch.set_num_threads(threads)
    llm = LLM(
        model=model_path,
        dtype=torch.bfloat16,
        seed=seed,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        worker_extension_cls="vllm_worker.WeightSyncWorker",
        enable_prefix_caching=True,
    )
    layers, top_k, experts = llm.collective_rpc("start_routes", args=("",))[0]
    dtype = routes.route_dtype(experts)
    task = builtin.CopyTask(chat.load_tokenizer(model_path))
    batches = {}
    for n in lengths:
        outs = llm.generate(
            [{"prompt_token_ids": p.prompt_ids} for p in task.prompts[:prompts]],
            SamplingParams(n=8, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, seed=seed),
            use_tqdm=False,
        )
        groups = []
        for o in outs:
            taken = dict(llm.collective_rpc("take_routes", args=(o.request_id,))[0])
            cs = sorted(o.outputs, key=lambda c: c.index)
            logprobs = [[c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)] for c in cs]
            rows = [
                routes.fitted(
                    np_rows(taken[c.index], dtype, layers, top_k),
                    len(o.prompt_token_ids) + n,
                    layers,
                    top_k,
                    dtype,
                )
                for c in cs
            ]
            groups.append(
                buffer.RolloutGroup(
                    0,
                    list(o.prompt_token_ids),
                    [list(c.token_ids) for c in cs],
                    logprobs,
                    [[0] * n for _ in cs],
                    [0.0] * 8,
                    routes=rows,
                )
            )
        batches[n] = buffer.collate(
            buffer.to_samples(groups, torch.zeros(len(groups), 8)), pad_id=0
        )
    llm.llm_engine.engine_core.shutdown()
    init_file = tempfile.mktemp(prefix="asyncgrpo-bench-dist-")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = models.build_trainer_model(model_path, 1, compute_dtype=torch.bfloat16)
        base = model
        state = replay.install(model, base.model.layers, base.config, True)
        out = {}
        for n, batch in batches.items():
            row = {"samples": len(batch), "tokens": int(batch.mask.sum())}
            for name, on in (("live", False), ("replayed", True)):
                state.replay = on
                with torch.no_grad(), replay.routed_by(model, batch) as counts:
                    logp = update.completion_logprobs(model, batch, 1.0).logp
                k3 = losses.mismatch_k3(logp, batch.behaviour_logp, batch.mask)
                row[f"k3_{name}"] = float(k3[batch.mask].mean())
                row[f"max_diff_{name}"] = float(
                    (logp - batch.behaviour_logp).abs()[batch.mask].max()
                )
                if not on:
                    row["agreement"] = int(counts["agree"]) / max(1, int(counts["decisions"]))
            row["ratio"] = row["k3_live"] / row["k3_replayed"]
            out[str(n)] = row
        return out
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)


def np_rows(data: bytes, dtype, layers: int, top_k: int):
    import numpy as np

    return np.frombuffer(data, dtype=dtype).reshape(-1, layers, top_k)
