"""bench/generator_phases.py — bench/generator.py's measurement, in a child process (or, in a smoke
session, on bench/engines.py's engine): one vLLM engine built as `rollout.Generator` builds it, and
for each round, each workload of the plan, each phase (bare `AsyncLLM.generate`; the pipeline,
`Generator.run` feeding a stand-in trainer process from bench/stages_alone.py, with or without
weight swaps, or with `--kv-on-swap keep`), the tokens each step's groups held and when each step
ended, turned into a steady-state rate (`window_rate`). What the phases are and why:
bench/generator.py's docstring.
Data: in, the model folder, the plan ([{name, phases, steps, warmup, max_new_tokens, score}]), the
rounds, the seed and --kv-delta; out, {"runs": {workload: {phase: [rate per round]}},
"engine_start_s", "threads"}. It touches only the engine, the shared weights buffers and queues it
makes, and the stand-in trainer processes it starts (each killed if still alive when its phase
ends).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import engines  # noqa: E402
import kv_swap  # noqa: E402
import stages_alone  # noqa: E402

# torch, vLLM and the project are imported in the functions that run in child processes (common.py)


def window_rate(step_end: list[float], tokens: list[int], warmup: int) -> dict:
    span = step_end[-1] - step_end[warmup - 1]
    toks = sum(tokens[warmup:])
    return {
        "tokens_per_s": toks / span,
        "tokens": toks,
        "window_s": span,
        "step_s_mean": span / (len(step_end) - warmup),
    }


def stand_in_entry(results, *args):
    """`stages_alone.stand_in_trainer` as a process target: its result goes to `results`."""
    try:
        results.put(("ok", stages_alone.stand_in_trainer(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def measure(model_path: str, plan: list[dict], rounds: int, seed: int, kv_delta: float) -> dict:
    """In a child process: one engine; for each round, each workload, each phase."""
    import torch.multiprocessing as mp

    from infra import processes
    from rollout import Generator
    from run import prepare
    from tasks.builtin import make_task
    from tasks.prompts import walk

    cfg = common.default_config(model=model_path, seed=seed)
    ctx = mp.get_context("spawn")
    base = common.run_ahead_settings(cfg, model_path)  # the stand-in trainer never lags
    builder = Generator(
        base, prepare.allocate_shared_weights(model_path), ctx.Queue(), processes.make_control(ctx)
    )
    t = time.perf_counter()
    # (a smoke session's: bench/engines.py)
    engine, loop = engines.engine_for(builder), engines.event_loop()
    engine_s = time.perf_counter() - t
    pps = cfg.prompts_per_step

    async def bare(tag: str, settings, steps: int) -> dict:
        from transformers import AutoTokenizer

        # only for its sampling_params (they ask its task)
        sampler = Generator(settings, None, None, None)
        task = sampler.task = make_task(settings.cfg, AutoTokenizer.from_pretrained(model_path))
        slots = asyncio.Semaphore(pps)  # as many groups in flight as the generator allows
        n_groups = steps * pps
        done, toks = [], []
        start = time.perf_counter()

        async def one(i):
            final = None
            try:
                async for out in engine.generate(
                    {"prompt_token_ids": prompts[i].prompt_ids},
                    sampler.sampling_params(i),
                    request_id=f"{tag}-{i}",
                ):
                    final = out
            finally:
                slots.release()
            done.append(time.perf_counter() - start)
            toks.append(sum(len(c.token_ids) for c in final.outputs))

        # as Generator.run
        prompts = [task.prompts[walk(i, len(task.prompts), seed)[1]] for i in range(n_groups)]
        tasks = []
        for i in range(n_groups):
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        ends = [done[k * pps + pps - 1] for k in range(steps)]
        per_step = [sum(toks[k * pps : (k + 1) * pps]) for k in range(steps)]
        return {"step_end_s": ends, "tokens": per_step}

    def pipeline(settings, steps: int, publish: bool, score: bool, from_start: bool) -> dict:
        shared = prepare.allocate_shared_weights(model_path)
        # the engine may hold an earlier phase's last (perturbed) weights: serve the start ones
        if from_start:
            shared.publish(start_weights, 0)
            shared.starts_empty = True
        queue = ctx.Queue(maxsize=cfg.queue_size)
        queue.cancel_join_thread()  # leftovers in the queue must not hold this process at exit
        control = processes.make_control(ctx)
        gen = Generator(settings, shared, queue, control)
        gen.engine = engine
        results, armed = ctx.Queue(), ctx.Event()
        proc = engines.helper(
            ctx,
            stand_in_entry,
            (  # a process (a thread in a smoke session)
                results,
                queue,
                control,
                kv_swap.PerturbingPublisher(shared, kv_delta) if score else shared,
                model_path,
                steps,
                pps,
                publish,
                score,
                120.0,
                armed,
            ),
        )
        proc.start()
        try:
            processes.wait_for(armed, control.stop, 120, "the stand-in trainer")
            loop.run_until_complete(gen.run())
            status, value = results.get(timeout=60)
            proc.join(timeout=30)
        finally:
            control.stop.set()
            if proc.is_alive():
                proc.kill()
        if status != "ok":
            raise RuntimeError(value)
        value["gen_stats"] = gen.stats.counters()
        if score:  # the engine is idle now: the scoring is not in the rates
            value["mismatch"] = kv_swap.mismatch(
                model_path, value.pop("groups"), kv_delta, settings.cfg
            )
        return value

    runs = {w["name"]: {p: [] for p in w["phases"]} for w in plan}
    start_weights = kv_swap.start_weights(model_path) if any(w["score"] for w in plan) else None
    try:
        for r in range(rounds):
            for w in plan:
                longer = dataclasses.replace(base.cfg, max_new_tokens=w["max_new_tokens"])
                settings = dataclasses.replace(base, cfg=longer)
                keep = dataclasses.replace(
                    settings, cfg=dataclasses.replace(settings.cfg, kv_on_swap="keep")
                )
                # rotate the order from round to round: no phase always runs first
                k = r % len(w["phases"])
                for phase in w["phases"][k:] + w["phases"][:k]:
                    if phase == "bare":
                        res = loop.run_until_complete(
                            bare(f"bare-{w['name']}-{r}", settings, w["steps"])
                        )
                    else:
                        res = pipeline(
                            keep if phase == "pipeline_keep" else settings,
                            w["steps"],
                            publish=phase != "pipeline_nosync",
                            from_start=w["score"],
                            score=w["score"] and phase != "pipeline_nosync",
                        )
                    rate = window_rate(res["step_end_s"], res["tokens"], w["warmup"])
                    if res.get("sync_ms"):
                        rate["sync_ms_median"] = statistics.median(res["sync_ms"])
                        rate["syncs"] = len(res["sync_ms"])
                        rate["sync_parts_median"] = {
                            k: statistics.median(p[k] for p in res["sync_parts"])
                            for k in res["sync_parts"][0]
                        }
                    if res.get("gen_stats"):
                        rate["gen_idle_frac"] = res["gen_stats"]["idle_s"] / max(
                            res["gen_stats"]["elapsed_s"], 1e-9
                        )
                        rate["swap_requests"] = res["gen_stats"]["swap_requests"]
                    if res.get("mismatch"):
                        rate["mismatch"] = res["mismatch"]
                    runs[w["name"]][phase].append(rate)
                    print(
                        f"[generator] round {r} {w['name']:8s} {phase:16s} "
                        f"{rate['tokens_per_s']:8.0f} tok/s "
                        f"({rate['step_s_mean'] * 1e3:.0f} ms/step)",
                        flush=True,
                    )
    finally:
        engines.release(engine, loop)
        builder.engine = engine = None
    return {"runs": runs, "engine_start_s": engine_s, "threads": base.cfg.gen_threads}
