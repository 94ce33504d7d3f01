"""bench/env_latency.py — does a slow environment stall generation? Tokens/s against the env's step
latency.

    # writes DIR/env_latency.json and DIR/env_latency.png
    python bench/env_latency.py --out DIR
    # the suite's size (tests/test_bench.py): 2 groups in flight, 1 s warm-ups and 1.5 s windows
    python bench/env_latency.py --smoke --out DIR

An environment whose `step` sleeps D ms (D = 0, 20, 100; a plain `time.sleep`, so it runs in the
generator's worker threads), 4 turns per episode, on one vLLM engine (the tiny model, 8 tokens per
turn). Two ways to run the same episodes on it, each for a fixed window after a warm-up (longer if
no group finished in it):
- pipeline: the project's generator (rollout.Generator with an env task, tasks/envs.py): every
  episode is its own chain of requests and env calls, up to 32 groups (`--groups`) of 8 episodes in
  flight, the staleness gate open;
- sync: a synchronous turn-by-turn rollout loop: a batch of 256 episodes (8 x `--groups`; sync32: of
  32), each turn one batched engine call for every live episode, then every env step (in parallel
  threads), and the next turn waits for all of them.
Reported: model tokens/s for each D and the ratio to D = 0 (goal: the pipeline keeps >= 0.9 at D =
100 ms).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import engines  # noqa: E402

DELAYS_MS = (0, 20, 100)
TURNS, TOKENS, GROUP = 4, 8, 8


class SleepEnv:
    """Four turns; each step sleeps `delay_s` (set per measurement) and returns `=`."""

    delay_s = 0.0

    def reset(self, **row):
        self.k = 0
        return "<bos>="

    def step(self, action):
        import time

        time.sleep(SleepEnv.delay_s)
        self.k += 1
        return "=", 0.0, self.k >= TURNS


def measure(model_path: str, warmup_s: float, window_s: float, groups_in_flight: int) -> dict:
    """In the child: one engine, then each (mode, D) in turn; returns tokens/s per mode and D."""
    import asyncio
    import queue as queue_lib
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch.multiprocessing as mp
    from transformers import AutoTokenizer

    import rollout
    from infra import processes
    from rollout import Generator
    from run import prepare
    from tasks import envs
    from tasks.episodes import model_turn

    cfg = common.default_config(
        model=model_path,
        max_new_tokens=TOKENS,
        group_size=GROUP,
        prompts_per_step=groups_in_flight,
        max_inflight_groups=groups_in_flight,
        max_turns=TURNS,
        eval_every=0,
        gen_threads=1,
        kv_cache_mb=128,
        env_workers=256,
    )
    settings = common.run_ahead_settings(cfg, model_path)
    rows = ([{"seed": i} for i in range(1000)], [{"seed": 10_000}])
    make_task, rollout.make_task = (
        rollout.make_task,
        lambda c, tokenizer, max_len=None: envs.EnvTask(
            # (put back at the end: a smoke session runs other benchmarks after)
            c,
            tokenizer,
            SleepEnv,
            rows,
        ),
    )
    ctx = mp.get_context("spawn")
    shared = prepare.allocate_shared_weights(model_path)
    engine = engines.engine_for(
        Generator(settings, shared, ctx.Queue(), processes.make_control(ctx))
    )
    loop = engines.event_loop()
    results = {"pipeline": {}, "sync": {}, "sync32": {}}

    def pipeline(delay_ms: int) -> float:
        gen = Generator(settings, shared, queue_lib.Queue(), processes.make_control(ctx))
        gen.engine = engine
        done = threading.Event()

        def consume():  # a stand-in trainer that takes every group at once
            while not done.is_set():
                try:
                    gen.queue.get(timeout=0.1)
                except queue_lib.Empty:
                    pass

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()

        async def scenario():
            task = asyncio.create_task(gen.run())
            await asyncio.sleep(warmup_s)
            t0, n0 = time.perf_counter(), gen.stats.tokens
            await asyncio.sleep(window_s)
            # until a group has finished in it
            while gen.stats.tokens == n0 and time.perf_counter() - t0 < 60:
                await asyncio.sleep(0.05)
            rate = (gen.stats.tokens - n0) / (time.perf_counter() - t0)
            gen.control.stop.set()
            await task
            return rate

        try:
            return loop.run_until_complete(scenario())
        finally:
            done.set()

    def sync(delay_ms: int, batch_size: int = GROUP * groups_in_flight) -> float:
        gen = Generator(settings, shared, queue_lib.Queue(), processes.make_control(ctx))
        gen.engine, gen.max_model_len = engine, 64
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        gen.task = envs.EnvTask(cfg, tokenizer, SleepEnv, rows)  # (its request settings)
        threads = ThreadPoolExecutor(max(batch_size, GROUP * groups_in_flight))
        start_ids = tokenizer("<bos>=", add_special_tokens=False)["input_ids"]
        obs_ids = tokenizer("=", add_special_tokens=False)["input_ids"]
        counter = [0]

        async def one_batch(batch: int) -> int:
            episodes = [SleepEnv() for _ in range(batch_size)]
            for env in episodes:
                env.reset()
            seqs, tokens = [list(start_ids) for _ in episodes], 0
            for turn in range(TURNS):
                params = gen.request_params(max_tokens=TOKENS, n=1, temperature=1.0)
                outs = await asyncio.gather(
                    *(
                        model_turn(gen, s, params, f"sync-{batch}-{j}-{turn}")
                        for j, s in enumerate(seqs)
                    )
                )
                steps = [
                    asyncio.get_running_loop().run_in_executor(threads, env.step, out.text)
                    for env, out in zip(episodes, outs)
                ]
                # the turn's barrier: every env answers before the next turn
                await asyncio.gather(*steps)
                for s, out in zip(seqs, outs):
                    s += list(out.token_ids) + obs_ids
                    tokens += len(out.token_ids)
            return tokens

        async def scenario():
            t_end = time.perf_counter() + warmup_s
            while time.perf_counter() < t_end:
                await one_batch(counter[0])
                counter[0] += 1
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < window_s:
                n += await one_batch(counter[0])
                counter[0] += 1
            return n / (time.perf_counter() - t0)

        try:
            return loop.run_until_complete(scenario())
        finally:
            threads.shutdown(wait=False)

    try:
        for delay_ms in DELAYS_MS:
            SleepEnv.delay_s = delay_ms / 1e3
            for mode, fn in (
                ("pipeline", pipeline),
                ("sync", sync),
                ("sync32", lambda d: sync(d, 32)),
            ):
                results[mode][str(delay_ms)] = fn(delay_ms)
                print(
                    f"[env_latency] {mode} D={delay_ms} ms: {results[mode][str(delay_ms)]:.0f} "
                    f"tokens/s",
                    flush=True,
                )
    finally:
        rollout.make_task = make_task
        engines.release(engine, loop)
    return results


def main(argv=None) -> int:
    p = common.parser(__doc__, smoke={"warmup_s": 1.0, "window_s": 1.5, "groups": 2})
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument(
        "--groups",
        type=int,
        default=32,
        help="groups of 8 episodes in flight (the sync batch: all)",
    )
    args = common.parse_args(p, argv)
    with common.Bench("env_latency", args) as bench:
        model = common.build_model(bench.work / "init_model", seed=args.seed)
        rates = common.in_child(
            measure,
            model,
            args.warmup_s,
            args.window_s,
            args.groups,
            timeout_s=600,
            what="env_latency",
            in_session=True,
        )
    ratios = {mode: {d: rates[mode][d] / rates[mode]["0"] for d in rates[mode]} for mode in rates}
    data = {
        "settings": {
            "delays_ms": list(DELAYS_MS),
            "turns": TURNS,
            "tokens_per_turn": TOKENS,
            "episodes_in_flight": GROUP * args.groups,
            "warmup_s": args.warmup_s,
            "window_s": args.window_s,
        },
        "tokens_per_s": rates,
        "ratio_to_d0": ratios,
    }
    path = bench.save(data, plot)
    print()
    modes = list(rates)
    print(
        common.table(
            ["D (ms)"] + [f"{m} {what}" for m in modes for what in ("tokens/s", "/ D=0")],
            [
                [d] + [x for m in modes for x in (rates[m][str(d)], ratios[m][str(d)])]
                for d in DELAYS_MS
            ],
        )
    )
    print(
        f"goal: the pipeline keeps >= 0.9 of its D=0 throughput at D=100 ms: "
        f"{ratios['pipeline']['100']:.2f} "
        f"({'met' if ratios['pipeline']['100'] >= 0.9 else 'not met'})"
    )
    print(bench.closing_line(path))
    return 0


def plot(data: dict, path: Path) -> None:
    plt = common.plt()
    fig, ax = plt.subplots(1, 1, figsize=(6, 4))
    for mode, color in (("pipeline", "#1f77b4"), ("sync", "#7f7f7f"), ("sync32", "#bcbd22")):
        ds = data["settings"]["delays_ms"]
        ax.plot(
            ds,
            [data["tokens_per_s"][mode][str(d)] for d in ds],
            marker="o",
            color=color,
            label=mode,
        )
    ax.set(
        xlabel="env step latency D (ms)",
        ylabel="model tokens/s",
        title="generation against env latency",
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    common.save_figure(fig, path, data, "env latency")


if __name__ == "__main__":
    sys.exit(main())
