"""bench/generation.py — the generator's cost: against bare vLLM, its swaps, slow environments.

    python bench/generation.py [--what generator] --out DIR   # DIR/generator.json and .png
    python bench/generation.py --what env_latency --out DIR   # DIR/env_latency.json and .png
    # the suite's sizes (tests/test_bench.py): generator: one round, 4 + 3 steps; env_latency: 2
    # groups in flight, 1 s warm-ups and 1.5 s windows
    python bench/generation.py [--what NAME] --smoke --out DIR

`generator`: what does the generator cost on top of bare vLLM? One engine (the project's
`Generator.build_engine`) serves these phases, interleaved for `--rounds` rounds (order rotated):
bare (`AsyncLLM.generate` on the same prompts, sampling and groups in flight); pipeline
(`Generator.run` feeding a stand-in trainer, overlap.py's, that republishes every step: one swap
per step); pipeline_nosync (no swaps); pipeline_keep (long workload: `--kv-on-swap keep`). Two
workloads: the default (as `python train.py`) and a long one (`--long-tokens`), where the stand-in
publishes weights that differ per version (start + N(0, --kv-delta^2), about one AdamW step) and
every sampled token is scored by the trainer's `update.completion_logprobs` under its version,
against vLLM's log-prob: after a swap inside its request, and in requests no swap reached. Tokens/s
after the warm-up; ratio = pipeline / the bare phase of its round (goal >= 0.90).

`env_latency`: does a slow environment stall generation? An env whose `step` sleeps D ms (0, 20,
100), 4 turns of 8 tokens, on one engine: pipeline (the project's generator, tasks/envs.py, each
episode its own chain of requests) against sync / sync32 (a turn-by-turn loop over 8 x `--groups`
/ 32 episodes, a barrier each turn). Tokens/s by D, ratio to D = 0 (goal: pipeline >= 0.9 at 100).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue as queue_lib
import statistics
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import machine  # noqa: E402
import overlap  # noqa: E402  (the stand-in trainer)
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import buffer  # noqa: E402  (the project's, on sys.path through common; vLLM loads with an engine)
import rollout  # noqa: E402
import update  # noqa: E402
from infra import processes  # noqa: E402
from run import prepare  # noqa: E402
from tasks import envs  # noqa: E402
from tasks.builtin import make_task  # noqa: E402
from tasks.episodes import model_turn  # noqa: E402
from tasks.prompts import walk  # noqa: E402

PHASES = ("bare", "pipeline", "pipeline_nosync")
DELAYS_MS, TURNS, TOKENS, GROUP = (0, 20, 100), 4, 8, 8


def start_weights(model_path: str) -> dict:
    """The model's parameters by name, fp32 (what the stand-in publishes, and version 0)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def version_weights(weights: dict, version: int, delta: float) -> dict:
    """The start `weights` plus N(0, delta^2) per element, drawn with the seed `version`."""
    if version == 0:
        return weights
    g = torch.Generator().manual_seed(1_000_003 * version)
    noise = {k: torch.randn(w.shape, generator=g, dtype=w.dtype) for k, w in weights.items()}
    return {k: w + delta * noise[k] for k, w in weights.items()}


class PerturbingPublisher:
    """Stands in for `sync.SharedWeights` where the stand-in trainer publishes: version v goes out
    as `version_weights(weights, v, delta)`, so each swap changes the weights."""

    def __init__(self, shared, delta: float):
        self.shared, self.delta = shared, delta

    def publish(self, weights: dict, version: int) -> None:
        self.shared.publish(version_weights(weights, version, self.delta), version)


def mismatch(model_path: str, groups: list, delta: float, cfg, rows_per_batch: int = 256) -> dict:
    """|behaviour - trainer log-prob| per token, split into: after a swap inside its request, before
    it (the same requests' first-version tokens), and requests no swap reached."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    start = start_weights(model_path)
    rows = [(g, j) for g in groups for j in range(len(g.completion_ids)) if g.completion_ids[j]]
    diffs = {"after_swap": [], "before_swap": [], "unswapped": []}
    for version in sorted({v for g, j in rows for v in g.token_versions[j]}):
        model.load_state_dict(version_weights(start, version, delta), strict=False)
        mine = [(g, j) for g, j in rows if version in g.token_versions[j]]
        for k in range(0, len(mine), rows_per_batch):
            part = mine[k : k + rows_per_batch]
            got = [(g.prompt_ids, g.completion_ids[j], g.behaviour_logprobs[j]) for g, j in part]
            samples = [
                buffer.Sample(*x, g.token_versions[j], 0.0, 0.0) for x, (g, j) in zip(got, part)
            ]
            batch = buffer.collate(samples, pad_id=0)
            with torch.no_grad():
                scored = update.completion_logprobs(
                    model, batch, cfg.temperature, cfg.top_k, cfg.top_p
                )
            diff = (scored.logp - batch.behaviour_logp).abs()
            for i, (g, j) in enumerate(part):
                tags = g.token_versions[j]
                at = batch.mask[i] & (batch.token_versions[i] == version)
                swapped = "before_swap" if version == tags[0] else "after_swap"
                diffs["unswapped" if len(set(tags)) == 1 else swapped] += diff[i][at].tolist()
    return {k: summary(len(d), statistics.fmean(d) if d else None, d) for k, d in diffs.items()}


def summary(tokens: int, mean: float | None, maxima) -> dict:
    return {"tokens": tokens, "mean": mean, "max": max(maxima, default=None)}


def merge(parts: list[dict]) -> dict:
    """Rounds' `mismatch` results as one: token-weighted means, the largest max."""
    out = {}
    for kind in parts[0]:
        got = [p[kind] for p in parts if p[kind]["tokens"]]
        tokens = sum(p["tokens"] for p in got)
        mean = sum(p["mean"] * p["tokens"] for p in got) / tokens if tokens else None
        out[kind] = summary(tokens, mean, [p["max"] for p in got])
    return out


def window_rate(step_end: list[float], tokens: list[int], warmup: int) -> dict:
    span, toks = step_end[-1] - step_end[warmup - 1], sum(tokens[warmup:])
    steps = len(step_end) - warmup
    return dict(tokens_per_s=toks / span, tokens=toks, window_s=span, step_s_mean=span / steps)


def stand_in_entry(results, job):
    """`overlap.stand_in_trainer` as a process target: its result goes to `results`."""
    try:
        results.put(("ok", overlap.stand_in_trainer(job)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


class Phases:
    """One engine (a child's, or the session's) and the phases run on it."""

    def __init__(self, model_path: str, seed: int, kv_delta: float):
        self.model_path, self.seed, self.kv_delta = model_path, seed, kv_delta
        self.cfg = common.default_config(model=model_path, seed=seed)
        self.ctx = mp.get_context("spawn")
        self.base = common.run_ahead_settings(self.cfg, model_path)  # the stand-in never lags
        shared = prepare.allocate_shared_weights(model_path)
        control = processes.make_control(self.ctx)
        self.builder = rollout.Generator(self.base, shared, self.ctx.Queue(), control)
        t = time.perf_counter()
        self.engine, self.loop = machine.engine_for(self.builder), machine.event_loop()
        self.engine_s = time.perf_counter() - t
        self.start_weights = None

    async def bare(self, tag: str, settings, steps: int) -> dict:
        """The engine alone, as many groups in flight as the generator allows."""
        pps = self.cfg.prompts_per_step
        sampler = rollout.Generator(settings, None, None, None)  # only for its sampling_params
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        task = sampler.task = make_task(settings.cfg, tokenizer)
        slots, n_groups, done, toks = asyncio.Semaphore(pps), steps * pps, [], []
        prompts = [task.prompts[walk(i, len(task.prompts), self.seed)[1]] for i in range(n_groups)]
        start = time.perf_counter()

        async def one(i):
            ask = {"prompt_token_ids": prompts[i].prompt_ids}
            try:
                async for final in self.engine.generate(
                    ask, sampler.sampling_params(i), request_id=f"{tag}-{i}"
                ):
                    pass
            finally:
                slots.release()
            done.append(time.perf_counter() - start)
            toks.append(sum(len(c.token_ids) for c in final.outputs))

        tasks = []
        for i in range(n_groups):
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        ends = [done[k * pps + pps - 1] for k in range(steps)]
        return {
            "step_end_s": ends,
            "tokens": [sum(toks[k * pps : (k + 1) * pps]) for k in range(steps)],
        }

    def pipeline(self, settings, steps: int, publish: bool, score: bool) -> dict:
        """`Generator.run` feeding a stand-in trainer (a process; a thread in a smoke session)."""
        shared = prepare.allocate_shared_weights(self.model_path)
        if self.start_weights is not None:  # the engine may hold an earlier phase's weights
            shared.publish(self.start_weights, 0)
            shared.starts_empty = True
        queue = self.ctx.Queue(maxsize=self.cfg.queue_size)
        queue.cancel_join_thread()  # leftovers in the queue must not hold this process at exit
        control = processes.make_control(self.ctx)
        gen = rollout.Generator(settings, shared, queue, control)
        gen.engine = self.engine
        results, armed = self.ctx.Queue(), self.ctx.Event()
        sink = PerturbingPublisher(shared, self.kv_delta) if score else shared
        pps = self.cfg.prompts_per_step
        job = overlap.StandIn(queue, control, sink, self.model_path, steps, pps)
        job = dataclasses.replace(job, publish=publish, keep_groups=score, timeout_s=120.0)
        job.armed = armed
        proc = machine.helper(self.ctx, stand_in_entry, (results, job))
        proc.start()
        try:
            processes.wait_for(armed, control.stop, 120, "the stand-in trainer")
            self.loop.run_until_complete(gen.run())
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
            groups = value.pop("groups")
            value["mismatch"] = mismatch(self.model_path, groups, self.kv_delta, settings.cfg)
        return value

    def phase(self, w: dict, phase: str, r: int) -> dict:
        """One phase of workload `w` in round `r`: its rate, swaps and mismatch."""
        cfg = dataclasses.replace(self.base.cfg, max_new_tokens=w["max_new_tokens"])
        if phase == "pipeline_keep":
            cfg = dataclasses.replace(cfg, kv_on_swap="keep")
        settings = dataclasses.replace(self.base, cfg=cfg)
        if phase == "bare":
            bare = self.bare(f"bare-{w['name']}-{r}", settings, w["steps"])
            res = self.loop.run_until_complete(bare)
        else:
            publish = phase != "pipeline_nosync"
            res = self.pipeline(settings, w["steps"], publish, score=w["score"] and publish)
        rate = window_rate(res["step_end_s"], res["tokens"], w["warmup"])
        if res.get("sync_ms"):
            rate.update(sync_ms_median=statistics.median(res["sync_ms"]), syncs=len(res["sync_ms"]))
            rate["sync_parts_median"] = medians(res["sync_parts"])
        if res.get("gen_stats"):
            stats = res["gen_stats"]
            rate["gen_idle_frac"] = stats["idle_s"] / max(stats["elapsed_s"], 1e-9)
            rate["swap_requests"] = stats["swap_requests"]
        if res.get("mismatch"):
            rate["mismatch"] = res["mismatch"]
        print(f"[generator] round {r} {w['name']} {phase}: {rate['tokens_per_s']:.0f} tok/s")
        return rate


def measure(model_path: str, plan: list[dict], rounds: int, seed: int, kv_delta: float) -> dict:
    """In a child process: one engine; for each round, each workload, each phase (rotated)."""
    on = Phases(model_path, seed, kv_delta)
    if any(w["score"] for w in plan):
        on.start_weights = start_weights(model_path)
    runs = {w["name"]: {p: [] for p in w["phases"]} for w in plan}
    try:
        for r in range(rounds):
            for w in plan:
                k = r % len(w["phases"])  # no phase always runs first
                for phase in w["phases"][k:] + w["phases"][:k]:
                    runs[w["name"]][phase].append(on.phase(w, phase, r))
    finally:
        machine.release(on.engine, on.loop)
        on.builder.engine = on.engine = None
    return {"runs": runs, "engine_start_s": on.engine_s, "threads": on.base.cfg.gen_threads}


def medians(dicts: list[dict]) -> dict:
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


def summarize(runs: dict) -> dict:
    """Medians per phase; ratios per round (each phase against the bare phase of the same round)."""
    out = {}
    for phase, rates in runs.items():
        out[f"{phase}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rates)
        if phase != "bare":
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rates, runs["bare"])]
            key = "ratio" + phase[len("pipeline") :]
            out[key], out[key.replace("ratio", "ratios")] = statistics.median(ratios), ratios
        if rates[0].get("mismatch"):
            out[f"{phase}_mismatch"] = merge([r["mismatch"] for r in rates])
        if rates[0].get("sync_parts_median"):
            out[f"{phase}_sync_parts_median"] = medians([r["sync_parts_median"] for r in rates])
    pipe = runs.get("pipeline", [])
    sync = [r for r in pipe if r.get("sync_ms_median") is not None]
    if sync:
        step_s = statistics.median(r["step_s_mean"] for r in pipe)
        out["pipeline_step_ms"] = step_s * 1e3
        out["bare_step_ms"] = statistics.median(r["step_s_mean"] for r in runs["bare"]) * 1e3
        out["sync_ms_median"] = statistics.median(r["sync_ms_median"] for r in sync)
        out["sync_share_of_step"] = out["sync_ms_median"] / 1e3 / step_s
        out["sync_parts_median"] = out["pipeline_sync_parts_median"]
    return out


def generator(argv=None) -> int:
    """`--what generator`: the phases on one engine, their rates and ratios."""
    smoke = {"steps": 4, "warmup": 2, "long_tokens": 8, "long_steps": 3, "rounds": 1}
    p = common.parser(__doc__, smoke=smoke)
    p.add_argument("--steps", type=int, default=25, help="steps per phase (default workload)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out (default workload)")
    p.add_argument("--long-tokens", type=int, default=40, help="long workload (0: skip)")
    p.add_argument("--long-steps", type=int, default=10, help="steps per phase, long workload")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all phases")
    p.add_argument("--kv-delta", type=float, default=3e-4, help="std of a version's offset")
    args = common.parse_args(p, argv)
    cfg = common.default_config()
    plan = [{"name": "default", "max_new_tokens": cfg.max_new_tokens, "steps": args.steps}]
    plan[0].update(warmup=args.warmup, phases=list(PHASES), score=False)
    if args.long_tokens:
        plan.append({"name": "long", "max_new_tokens": args.long_tokens, "steps": args.long_steps})
        plan[1].update(warmup=2, phases=[*PHASES, "pipeline_keep"], score=True)
        plan[1]["kv_delta"] = args.kv_delta
    with common.Bench("generator", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        job = (model, plan, args.rounds, args.seed, args.kv_delta)
        res = common.in_child(measure, *job, timeout_s=900, what="generator", in_session=True)
    workloads = {w.pop("name"): w for w in plan}
    for name, w in workloads.items():
        w.update(summarize(res["runs"][name]))
    d = workloads["default"]
    settings = {"rounds": args.rounds, "seed": args.seed, "generator_threads": res["threads"]}
    settings["workload"] = f"default task, tiny model; {cfg.prompts_per_step} x {cfg.group_size}"
    data = {"settings": settings, "ratio": d["ratio"], "ratio_nosync": d["ratio_nosync"]}
    data.update({k: d[k] for k in ("bare_tokens_per_s", "pipeline_tokens_per_s")})
    data.update(workloads=workloads, engine_start_s=res["engine_start_s"], runs=res["runs"])
    path = bench.save(data, plot)
    rows = []
    for name, s in workloads.items():
        for phase in s["phases"]:
            key = "ratio" + phase[len("pipeline") :]
            row = {"workload": name, "phase": phase, "tokens/s": s[f"{phase}_tokens_per_s"]}
            row.update(ratio=1.0 if phase == "bare" else s[key], sync_ms=s.get("sync_ms_median"))
            m = s.get(f"{phase}_mismatch")
            row.update({f"{k}_diff": m[k]["mean"] for k in ("after_swap", "unswapped") if m})
            rows.append(row)
    keys = "workload phase tokens/s ratio sync_ms after_swap_diff unswapped_diff"
    print(common.table_of(rows, keys, "tokens/s, medians; ratio to bare (goal >= 0.90)"))
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    values = {
        f"{name}\n{phase}": [r["tokens_per_s"] for r in rates]
        for name, phases in data["runs"].items()
        for phase, rates in phases.items()
    }
    common.bars(data, path, "generator overhead", values, ylabel="generated tokens / s")


class SleepEnv:
    """Four turns; each step sleeps `delay_s` (set per measurement) and returns `=`."""

    delay_s = 0.0

    def reset(self, **row):
        self.k = 0
        return "<bos>="

    def step(self, action):
        time.sleep(SleepEnv.delay_s)
        self.k += 1
        return "=", 0.0, self.k >= TURNS


def env_pipeline(gen, loop, warmup_s: float, window_s: float) -> float:
    """Tokens/s of the generator's own loop, a stand-in thread taking every group at once."""
    done = threading.Event()

    def consume():
        while not done.is_set():
            try:
                gen.queue.get(timeout=0.1)
            except queue_lib.Empty:
                pass

    threading.Thread(target=consume, daemon=True).start()

    async def scenario():
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(warmup_s)
        t0, n0 = time.perf_counter(), gen.stats.tokens
        await asyncio.sleep(window_s)
        while gen.stats.tokens == n0 and time.perf_counter() - t0 < 60:  # a group finished
            await asyncio.sleep(0.05)
        rate = (gen.stats.tokens - n0) / (time.perf_counter() - t0)
        gen.control.stop.set()
        await task
        return rate

    try:
        return loop.run_until_complete(scenario())
    finally:
        done.set()


def env_sync(gen, loop, batch_size: int, warmup_s: float, window_s: float) -> float:
    """Tokens/s of a turn-by-turn loop over `batch_size` episodes (a barrier every turn)."""
    threads = ThreadPoolExecutor(batch_size)
    tokenizer = AutoTokenizer.from_pretrained(gen.settings.model)
    start_ids, obs_ids = tokenizer(["<bos>=", "="], add_special_tokens=False)["input_ids"]
    counter = [0]

    async def one_batch() -> int:
        episodes, counter[0] = [SleepEnv() for _ in range(batch_size)], counter[0] + 1
        for env in episodes:
            env.reset()
        seqs, tokens = [list(start_ids) for _ in episodes], 0
        for turn in range(TURNS):
            params = gen.request_params(max_tokens=TOKENS, n=1, temperature=1.0)
            names = [f"sync-{counter[0]}-{j}-{turn}" for j in range(batch_size)]
            outs = await asyncio.gather(
                *(model_turn(gen, s, params, n) for s, n in zip(seqs, names))
            )
            run = asyncio.get_running_loop().run_in_executor
            await asyncio.gather(*(run(threads, e.step, o.text) for e, o in zip(episodes, outs)))
            for s, out in zip(seqs, outs):
                s += list(out.token_ids) + obs_ids
                tokens += len(out.token_ids)
        return tokens

    async def scenario():
        t_end = time.perf_counter() + warmup_s
        while time.perf_counter() < t_end:
            await one_batch()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < window_s:
            n += await one_batch()
        return n / (time.perf_counter() - t0)

    try:
        return loop.run_until_complete(scenario())
    finally:
        threads.shutdown(wait=False)


def env_measure(model_path: str, warmup_s: float, window_s: float, groups: int) -> dict:
    """In the child: one engine, then each (mode, D) in turn; tokens/s per mode and D."""
    shape = dict(max_new_tokens=TOKENS, group_size=GROUP, prompts_per_step=groups, max_turns=TURNS)
    small = dict(max_inflight_groups=groups, eval_every=0, gen_threads=1, kv_cache_mb=128)
    cfg = common.default_config(model=model_path, env_workers=256, **shape, **small)
    settings = common.run_ahead_settings(cfg, model_path)
    rows = ([{"seed": i} for i in range(1000)], [{"seed": 10_000}])
    make_task = rollout.make_task  # (put back at the end: a session runs other benchmarks after)
    rollout.make_task = lambda c, tok, max_len=None: envs.EnvTask(c, tok, SleepEnv, rows)
    ctx, shared = mp.get_context("spawn"), prepare.allocate_shared_weights(model_path)

    def generator(sync=True):
        gen = rollout.Generator(settings, shared, queue_lib.Queue(), processes.make_control(ctx))
        gen.engine = engine
        if sync:  # (the loop's own run loads its task and reads the engine's length)
            gen.max_model_len = 64
            gen.task = envs.EnvTask(cfg, AutoTokenizer.from_pretrained(model_path), SleepEnv, rows)
        return gen

    loop, control = machine.event_loop(), processes.make_control(ctx)
    engine = machine.engine_for(rollout.Generator(settings, shared, ctx.Queue(), control))
    modes = {
        "pipeline": lambda: env_pipeline(generator(sync=False), loop, warmup_s, window_s),
        "sync": lambda: env_sync(generator(), loop, GROUP * groups, warmup_s, window_s),
        "sync32": lambda: env_sync(generator(), loop, 32, warmup_s, window_s),
    }
    results = {mode: {} for mode in modes}
    try:
        for delay_ms in DELAYS_MS:
            SleepEnv.delay_s = delay_ms / 1e3
            for mode, rate in modes.items():
                results[mode][str(delay_ms)] = rate()
                print(f"[env_latency] {mode} D={delay_ms} ms: {results[mode][str(delay_ms)]:.0f}")
    finally:
        rollout.make_task = make_task
        machine.release(engine, loop)
    return results


def env_latency(argv=None) -> int:
    """`--what env_latency`: tokens/s against the env's step latency, pipeline and sync loops."""
    p = common.parser(__doc__, smoke={"warmup_s": 1.0, "window_s": 1.5, "groups": 2})
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument("--groups", type=int, default=32, help="groups of 8 episodes in flight")
    args = common.parse_args(p, argv)
    with common.Bench("env_latency", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        job = (model, args.warmup_s, args.window_s, args.groups)
        rates = common.in_child(env_measure, *job, what="env_latency", in_session=True)
    ratios = {mode: {d: rates[mode][d] / rates[mode]["0"] for d in rates[mode]} for mode in rates}
    settings = {"delays_ms": list(DELAYS_MS), "turns": TURNS, "tokens_per_turn": TOKENS}
    settings.update(
        episodes_in_flight=GROUP * args.groups, warmup_s=args.warmup_s, window_s=args.window_s
    )
    data = {"settings": settings, "tokens_per_s": rates, "ratio_to_d0": ratios}
    values = {f"{m} {d} ms": [rates[m][str(d)]] for m in rates for d in DELAYS_MS}
    path = bench.save(data, lambda d, p: common.bars(d, p, "env latency", values, "tokens/s"))
    rows = [{"D_ms": d, **{m: rates[m][str(d)] for m in rates}} for d in DELAYS_MS]
    rows += [{"D_ms": f"{d} / 0", **{m: ratios[m][str(d)] for m in rates}} for d in DELAYS_MS]
    print(common.table_of(rows, "D_ms pipeline sync sync32", "tokens/s (goal: pipeline >= 0.9)"))
    print(bench.closing_line(path))
    return 0


def main(argv=None) -> int:
    return common.dispatch(__doc__, {"generator": generator, "env_latency": env_latency}, argv)


if __name__ == "__main__":
    sys.exit(main())
