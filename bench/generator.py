"""bench/generator.py — what does the generator cost on top of bare vLLM? Tokens/s side by side, one engine.

    python bench/generator.py --out DIR      # writes DIR/generator.json and DIR/generator.png

One vLLM engine, built by the project's own `rollout.Generator.build_engine` (same engine arguments, same
threads), serves three kinds of phases, interleaved for `--rounds` rounds:
- bare: the engine's own `AsyncLLM.generate` on the same prompts (the built-in task, same seed), with the
  same sampling parameters (`Generator.sampling_params`: n = G, temperature, top-k/p, log-probs) and the
  same number of groups in flight (prompts per step); nothing else.
- pipeline: the project's generator loop (`Generator.run`: rewards, per-token versions, the staleness
  gate, groups put on a bounded multiprocessing queue) feeding a stand-in trainer in another process that
  takes each step's groups and republishes the weights, so the generator swaps weights once per step as in
  a run (pause, load, prefix-cache reset, resume).
- pipeline, no sync: the same without weight swaps (the generator's own overhead alone).
- pipeline, no sleep (a what-if, not the project's code path): the pipeline phase with vLLM's fixed 20 ms
  sleep taken out of `pause_generation` (see `common.pause_without_sleep`).
Rates are tokens/s over the steps after `--warmup`; ratio = pipeline / bare (goal >= 0.90).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PHASES = ("bare", "pipeline", "pipeline_nosync", "pipeline_nosleep")


def window_rate(step_end: list[float], tokens: list[int], warmup: int) -> dict:
    span = step_end[-1] - step_end[warmup - 1]
    toks = sum(tokens[warmup:])
    return {"tokens_per_s": toks / span, "tokens": toks, "window_s": span,
            "step_s_mean": span / (len(step_end) - warmup)}


def measure(model_path: str, steps: int, warmup: int, rounds: int, seed: int) -> dict:
    """In a child process: one engine, phases interleaved."""
    import asyncio
    import random

    import torch.multiprocessing as mp

    import train
    from rollout import CopyTask, Generator

    cfg = common.default_config(model=model_path, seed=seed)
    ctx = mp.get_context("spawn")
    settings = common.generator_settings(cfg, model_path, max_lag=10**6)  # the stand-in never lags
    builder = Generator(settings, train.allocate_shared_weights(model_path), ctx.Queue(), train.make_control(ctx))
    t = time.perf_counter()
    engine = builder.build_engine()
    engine_s = time.perf_counter() - t
    loop = asyncio.new_event_loop()
    pps, n_groups = cfg.prompts_per_step, steps * cfg.prompts_per_step

    async def bare(tag: str) -> dict:
        from transformers import AutoTokenizer

        task = CopyTask(AutoTokenizer.from_pretrained(model_path))
        rng = random.Random(seed)  # the prompts Generator.run draws
        slots = asyncio.Semaphore(pps)  # as many groups in flight as the generator allows
        done, toks = [], []
        start = time.perf_counter()

        async def one(i):
            final = None
            try:
                async for out in engine.generate({"prompt_token_ids": prompts[i].prompt_ids},
                                                 builder.sampling_params(i), request_id=f"{tag}-{i}"):
                    final = out
            finally:
                slots.release()
            done.append(time.perf_counter() - start)
            toks.append(sum(len(c.token_ids) for c in final.outputs))

        prompts = [task.sample(rng) for _ in range(n_groups)]
        tasks = []
        for i in range(n_groups):
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        ends = [done[k * pps + pps - 1] for k in range(steps)]
        per_step = [sum(toks[k * pps:(k + 1) * pps]) for k in range(steps)]
        return {"step_end_s": ends, "tokens": per_step}

    def pipeline(publish: bool) -> dict:
        shared = train.allocate_shared_weights(model_path)
        queue = ctx.Queue(maxsize=cfg.queue_size)
        queue.cancel_join_thread()  # leftovers in the queue must not hold this process at exit
        control = train.make_control(ctx)
        gen = Generator(settings, shared, queue, control)
        gen.engine = engine
        results, armed = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=common.stand_in_entry, args=(
            results, queue, control, shared, model_path, steps, pps, publish, False, 120.0, armed))
        proc.start()
        try:
            train.wait_for(armed, control.stop, 120, "the stand-in trainer")
            loop.run_until_complete(gen.run())
            status, value = results.get(timeout=60)
            proc.join(timeout=30)
        finally:
            control.stop.set()
            if proc.is_alive():
                proc.kill()
        if status != "ok":
            raise RuntimeError(value)
        value["gen_stats"] = dict(gen.stats)
        return value

    runs = {p: [] for p in PHASES}
    try:
        for r in range(rounds):
            for phase in PHASES:
                if phase == "bare":
                    res = loop.run_until_complete(bare(f"bare{r}"))
                elif phase == "pipeline_nosleep":
                    undo = common.pause_without_sleep(engine)
                    try:
                        res = pipeline(publish=True)
                    finally:
                        undo()
                else:
                    res = pipeline(publish=(phase == "pipeline"))
                rate = window_rate(res["step_end_s"], res["tokens"], warmup)
                if res.get("sync_ms"):
                    rate["sync_ms_median"] = statistics.median(res["sync_ms"])
                    rate["syncs"] = len(res["sync_ms"])
                    rate["sync_parts_median"] = {k: statistics.median(p[k] for p in res["sync_parts"])
                                                 for k in res["sync_parts"][0]}
                if res.get("gen_stats"):
                    rate["gen_idle_frac"] = res["gen_stats"]["idle_s"] / max(res["gen_stats"]["elapsed_s"], 1e-9)
                runs[phase].append(rate)
                print(f"[generator] round {r} {phase:16s} {rate['tokens_per_s']:8.0f} tok/s "
                      f"({rate['step_s_mean'] * 1e3:.0f} ms/step)", flush=True)
    finally:
        engine.shutdown()
        builder.engine = engine = None
        pending = asyncio.all_tasks(loop)  # the engine's output handler, cancelled by shutdown
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
    return {"runs": runs, "engine_start_s": engine_s, "threads": settings.threads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_argument_out(p)
    p.add_argument("--steps", type=int, default=25, help="steps' worth of groups per phase")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each phase left out")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (bare, pipeline, pipeline without sync)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    info = common.machine_info()
    start = time.perf_counter()
    with common.LoadMonitor() as mon, common.Scratch(args.work, "generator") as work:
        model = common.build_model(work / "init_model", seed=args.seed)
        res = common.in_child(measure, model, args.steps, args.warmup, args.rounds, args.seed, timeout_s=900,
                              what="generator benchmark")
    load = mon.summary()
    runs = res["runs"]
    med = {ph: statistics.median(r["tokens_per_s"] for r in runs[ph]) for ph in PHASES}
    # per-round ratios (each phase next to the bare phase of the same round), then the median
    ratios = [pl["tokens_per_s"] / b["tokens_per_s"] for pl, b in zip(runs["pipeline"], runs["bare"])]
    ratios_nosync = [pl["tokens_per_s"] / b["tokens_per_s"] for pl, b in zip(runs["pipeline_nosync"], runs["bare"])]
    ratios_nosleep = [pl["tokens_per_s"] / b["tokens_per_s"] for pl, b in zip(runs["pipeline_nosleep"], runs["bare"])]
    sync = [r for r in runs["pipeline"] if r.get("sync_ms_median") is not None]
    step_s = statistics.median(r["step_s_mean"] for r in runs["pipeline"])
    sync_ms = statistics.median(r["sync_ms_median"] for r in sync) if sync else None
    data = {"benchmark": "generator", "machine": info, "load": load, "wall_s": time.perf_counter() - start,
            "settings": {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "seed": args.seed,
                         "workload": "default task and tiny model; 32 prompts x 8 completions in flight, 5 new tokens",
                         "generator_threads": res["threads"]},
            "bare_tokens_per_s": med["bare"], "pipeline_tokens_per_s": med["pipeline"],
            "pipeline_nosync_tokens_per_s": med["pipeline_nosync"],
            "pipeline_nosleep_tokens_per_s": med["pipeline_nosleep"],
            "ratio": statistics.median(ratios), "ratio_nosync": statistics.median(ratios_nosync),
            "ratio_nosleep": statistics.median(ratios_nosleep),
            "ratios": ratios, "ratios_nosync": ratios_nosync, "ratios_nosleep": ratios_nosleep,
            "sync_ms_median": sync_ms, "sync_share_of_step": (sync_ms / 1e3 / step_s) if sync_ms else None,
            "sync_parts_median": sync[-1]["sync_parts_median"] if sync else None,
            "engine_start_s": res["engine_start_s"], "runs": runs}
    path = common.write_json(args.out, "generator", data)
    plot(data, Path(args.out) / "generator.png")
    print()
    print(common.table(["phase", "tokens/s (median)", "ratio to bare", "per-round ratios"], [
        ["bare vLLM", med["bare"], 1.0, "-"],
        ["pipeline (weight swap every step)", med["pipeline"], data["ratio"], " ".join(f"{x:.2f}" for x in ratios)],
        ["pipeline, no weight swaps", med["pipeline_nosync"], data["ratio_nosync"],
         " ".join(f"{x:.2f}" for x in ratios_nosync)],
        ["what-if: swaps without vLLM's 20 ms pause sleep", med["pipeline_nosleep"], data["ratio_nosleep"],
         " ".join(f"{x:.2f}" for x in ratios_nosleep)]]))
    if sync_ms:
        print(f"weight swap: {sync_ms:.0f} ms median, {data['sync_share_of_step']:.0%} of a "
              f"{step_s * 1e3:.0f} ms step; parts (ms): "
              + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in data["sync_parts_median"].items()))
    print(f"machine: {common.machine_line(info)}; other processes used {load['foreign_cores_mean']} cores on "
          f"average. Wrote {path}")
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = ["bare vLLM", "pipeline\n(swap every step)", "pipeline\n(no swaps)", "what-if: swaps w/o\n20 ms pause sleep"]
    keys = ["bare", "pipeline", "pipeline_nosync", "pipeline_nosleep"]
    for i, k in enumerate(keys):
        vals = [r["tokens_per_s"] for r in data["runs"][k]]
        ax.bar(i, statistics.median(vals), color=["#999999", "#1f77b4", "#aec7e8", "#ffbb78"][i])
        ax.plot([i] * len(vals), vals, "k.", ms=5)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylabel("generated tokens / s (dots: rounds)")
    ax.set_title(f"generator overhead: ratio {data['ratio']:.2f} (no swaps: {data['ratio_nosync']:.2f}); goal 0.90",
                 fontsize=10)
    fig.suptitle(common.machine_line(data["machine"]), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
