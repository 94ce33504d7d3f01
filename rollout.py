"""rollout.py — the generator process: a vLLM `AsyncLLM` engine sampling G completions per prompt.

Role: streams the task's prompts (tasks/builtin.py) into the engine with continuous batching; each
finished group is scored in a worker thread and put on the rollout queue at once. New weights are
loaded from the shared buffer (shared_weights.py, through vllm_worker.py) between engine steps
(weight_swaps.py), requests kept in flight ("inflight") or let finish ("drain"); held-out
evaluations (evaluation.run_eval) run beside training requests. An env task (--env, --task reveal)
runs each of a group's G samples as an episode, a chain of requests (tasks/envs.py: `run_env_group`,
`eval_env_prompt`; the episodes use this class only through tasks/protocols.Sampler, which it
satisfies). The engine, its requests and its shutdown are generator/engine.py's; the counters
generator/counters.py's. What it serves (full weights or an adapter) comes through lora.Served, its
devices through devices.enter_generator_devices; with --router-replay or --router-record, each
sample's routes come through routes.GeneratorRoutes.
Data contract: writes `buffer.RolloutGroup`s with vLLM's processed log-probs (the behaviour policy)
and, per token, the version of the weights that sampled it (and, when recorded, its routes); a group
starts only if the loaded weights are at most --max-lag versions behind the trainer version that
will consume it (its step less the steps skipped: `beyond_max_lag`, the staleness gate).
Reads the buffer's version and `Control`.
May touch: its engine, the queue, the shared buffer (read only), `Control`, its trace events
(tracing.py). Nothing of the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue as queue_lib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from buffer import RolloutGroup, put_group
from config import GeneratorSettings
from generator import engine as engine_part
from generator.counters import EngineIdle, GeneratorStats
from generator.routes import GeneratorRoutes
from generator.weight_swaps import load_first_publish, swap_weights
from infra import tracing
from tasks import chat, envs
from tasks.builtin import make_task
from tasks.evaluation import requested, run_eval
from tasks.prompts import Prompt, walk
from trainer.lora import Served, served_weights

HERE = os.path.dirname(os.path.abspath(__file__))


class Generator:
    """The asyncio side of the generator process: one engine, many concurrent groups."""

    def __init__(self, settings: GeneratorSettings, shared, rollout_queue, control):
        self.settings, self.cfg = settings, settings.cfg
        self.shared, self.queue, self.control = shared, rollout_queue, control
        self.loaded_version = settings.initial_version
        self.issued = settings.first_group_id  # the id of the next group to start
        self.running: set[asyncio.Task] = set()
        self.stats = GeneratorStats()
        self.idle = EngineIdle(self.stats)
        self.error: BaseException | None = None
        # set when a group finishes: the loop may start the next at once
        self.wake: asyncio.Event | None = None
        # the evaluation in flight: no weight load until it is done
        self.eval_task: asyncio.Task | None = None
        self.last_eval_step = -1  # the newest evaluation request started
        self.task, self.task_max_len = None, None  # load_task, with the engine
        self.max_model_len: int | None = None  # the engine's context (set as the loop starts)
        recorded = self.cfg.router_replay or self.cfg.router_record
        self.routes = GeneratorRoutes(settings.device == "cuda") if recorded else None

    # ----------------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------------
    async def run(self):
        """Load the newest weights between engine steps, start the evaluations asked for, and start
        a group whenever one more may run and the staleness gate is open; else sleep until a group
        finishes or 2 ms pass. Ends when the run stops (or raises what failed)."""
        await self.start()
        start = time.perf_counter()
        self.idle.since = start
        if self.settings.eval_at_start:
            self.start_eval(0)
        while not self.control.stop.is_set():
            self.raise_if_failed()
            published = self.shared.version()
            if published > self.loaded_version and not self.eval_holds_weights(published):
                await swap_weights(self, published)
            if self.eval_task is None:
                self.maybe_start_eval()
            # The staleness gate: the generator runs ahead of the trainer, and each group it starts
            # now is consumed at a later trainer version. Started under weights more than --max-lag
            # versions older than that, its samples would be too stale to train on (the buffer
            # drops them): the generator waits for the trainer instead of sampling for nothing.
            if len(self.running) < self.max_running() and not self.beyond_max_lag():
                self.start_group()
                continue
            await self.sleep_until_woken()
            self.stats.elapsed_s = time.perf_counter() - start
        await self.finish()

    def max_running(self) -> int:
        """Groups sampled at once, at most (--max-inflight-groups; default: one step's)."""
        return self.cfg.max_inflight_groups or self.cfg.prompts_per_step

    def beyond_max_lag(self) -> bool:
        """Whether a group started now would be sampled under weights more than --max-lag versions
        behind the trainer version that consumes it (traced: "staleness gate")."""
        # The trainer's version when this group lands: its step, less the steps skipped so far (a
        # skipped step keeps the version; skips still to come only lower it, so the bound holds).
        landing_step = (
            self.issued - self.control.groups_dropped.value
        ) // self.cfg.prompts_per_step
        landing_version = landing_step - self.control.steps_skipped.value
        return tracing.state(
            "staleness gate",
            "no new group (--max-lag)",
            self.loaded_version < landing_version - self.cfg.max_lag,
        )

    def start_group(self) -> None:
        """Start the next group: the prompt its id draws, sampled on a lane of its own."""
        epoch, row = walk(
            self.issued, len(self.task.prompts), self.cfg.seed
        )  # a function of the id
        group = self.run_group(self.issued, self.task.prompts[row], epoch)
        task = asyncio.create_task(
            tracing.on_lane(group, f"group {self.issued}", group=self.issued)
        )
        task.add_done_callback(functools.partial(self._done, self.issued))
        self.running.add(task)
        self.issued += 1

    def raise_if_failed(self) -> None:
        """Raise what failed: a group, an evaluation, or vLLM's engine."""
        if self.error is not None:
            raise self.error
        if self.engine.errored:  # vLLM's EngineCore died (it is not our child: we must look)
            raise RuntimeError("vLLM's engine died") from self.engine.dead_error

    async def sleep_until_woken(self) -> None:
        """Sleep until a group finishes (its slot frees at once), or 2 ms pass (new weights, the
        trainer's progress and the stop flag live in shared memory: they are polled)."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=0.002)
        except asyncio.TimeoutError:
            pass

    # ----------------------------------------------------------------------------------------------
    # One group: sampling -> scoring -> the queue
    # ----------------------------------------------------------------------------------------------
    async def run_group(self, group_id: int, prompt: Prompt, epoch: int = 0):
        """Sample a group's G completions, score them, put the group on the queue."""
        if self.task.is_env:  # G episodes, each its own chain of requests (tasks/envs.py)
            await self.enqueue(await envs.run_env_group(self, group_id, prompt, epoch))
            return
        request_id, final = f"group-{group_id}", None
        with self.generating_request():
            async for out in self.generate(
                prompt.prompt_ids, self.sampling_params(group_id), request_id
            ):
                final = out
        outputs = sorted(final.outputs, key=lambda c: c.index)
        completions, logprobs, versions, texts = engine_part.sampled(outputs)
        rewards, reward_stats, unscored = await self.score(prompt, texts, completions)
        routes = None
        if self.routes is not None:  # prompt + completion, each
            lengths = [len(prompt.prompt_ids) + len(ids) for ids in completions]
            routes = await self.routes.sequences(self.engine, request_id, outputs, lengths)
        group = RolloutGroup(
            group_id=group_id,
            prompt_ids=prompt.prompt_ids,
            completion_ids=completions,
            behaviour_logprobs=logprobs,
            token_versions=versions,
            rewards=rewards,
            answer=prompt.answer,
            reward_stats=reward_stats,
            unscored=unscored,
            epoch=epoch,
            routes=routes,
            finish_reasons=[c.finish_reason for c in outputs],
        )
        await self.enqueue(group)

    async def score(self, prompt: Prompt, texts: list[str], completions: list[list[int]]):
        """The task's (rewards, reward_stats, unscored) for a group's completions. Rewards run in
        worker threads (or the task's process pool), never on this event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self.reward_threads, self.task.score, prompt, texts, completions, self.loaded_version
        )

    async def enqueue(self, group: RolloutGroup):
        """Count a scored group and put it on the rollout queue, stamped with the generator's
        counters."""
        self.stats.count_group(group)  # once scored (a run stopping mid-score drops the group)
        group.gen_stats = self.stats.hand_off(self.loaded_version)
        # Usually there is room: no thread hop (mp.Queue.put
        # only hands the group to its feeder thread).
        try:
            self.queue.put_nowait(group)
        except queue_lib.Full:  # a full queue: wait in a thread, never on this event loop
            waited = await asyncio.to_thread(
                put_group, self.queue, group, self.control.stop.is_set, self.cfg.timeout_s
            )
            self.stats.queue_wait_s += waited
            tracing.complete(
                "queue full", time.perf_counter() - waited, track=tracing.LANE, cat="queue full"
            )
        tracing.counter("rollout queue", groups=tracing.qsize(self.queue))

    def _done(self, group_id: int, task: asyncio.Task):
        self.running.discard(task)
        if self.routes is not None:  # what the worker still holds of it is freed (routes.py)
            self.routes.end(f"group-{group_id}")
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        if self.wake is not None:
            self.wake.set()

    # ----------------------------------------------------------------------------------------------
    # Held-out evaluations, beside training requests (tasks/evaluation.py)
    # ----------------------------------------------------------------------------------------------
    def maybe_start_eval(self) -> None:
        """Start the newest requested evaluation once the weights it asks for (or newer) are
        loaded."""
        step, version = requested(self.control)
        if step > self.last_eval_step and self.loaded_version >= version:
            self.start_eval(step)

    def start_eval(self, step: int) -> None:
        """Evaluate the weights loaded now for `step`, beside training requests."""
        self.last_eval_step = step
        self.eval_task = asyncio.create_task(run_eval(self, step))
        self.eval_task.add_done_callback(self._eval_done)

    def eval_holds_weights(self, published: int) -> bool:
        """Whether a weight load waits for the evaluation in flight: only under --eval-weights
        fixed (one version per evaluation). By default it does not, since a held load left the
        trainer without fresh groups once it ran --max-lag steps ahead (1-2.4 s per evaluation on
        the default run, minutes for a real held-out set on a GPU); the trace shows each hold."""
        return tracing.state(
            "weight load",
            "held: evaluation in flight (--eval-weights fixed)",
            self.eval_task is not None
            and self.cfg.eval_weights == "fixed"
            and published > self.loaded_version,
        )

    def _eval_done(self, task: asyncio.Task):
        self.eval_task = None
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        if self.wake is not None:
            self.wake.set()

    # ----------------------------------------------------------------------------------------------
    # The engine (generator/engine.py), the task, the served weights; start and end
    # ----------------------------------------------------------------------------------------------
    def build_engine(self):
        """The vLLM engine (sets `self.engine`, loads the task to size its KV cache)."""
        return engine_part.build_engine(self)

    def load_task(self, max_model_len: int | None) -> None:
        """The task (prompts, reward), its prompts cut to fit the engine's context."""
        cfg = self.cfg
        tokenizer = chat.load_tokenizer(
            self.settings.model, cfg.chat_template, cfg.chat_template_kwargs
        )
        self.task, self.task_max_len = make_task(self.cfg, tokenizer, max_model_len), max_model_len

    @functools.cached_property
    def served(self) -> Served:
        """What the engine serves: the full weights, or an adapter (first asked for by build_engine,
        after the devices are set: vLLM's LoRA request is imported then)."""
        return served_weights(self.cfg.lora_rank, self.settings.lora_dir)

    def request_params(self, max_tokens: int | None = None, **sampling):
        """vLLM's SamplingParams for one request (generator/engine.py)."""
        return engine_part.request_params(self, max_tokens, **sampling)

    def sampling_params(self, group_id: int):
        """vLLM's SamplingParams for one group's G samples (generator/engine.py)."""
        return engine_part.sampling_params(self, group_id)

    def generate(self, ids: list[int], params, request_id: str):
        """The engine's outputs for one request of token `ids`, under the weights it serves."""
        return engine_part.generate(self, ids, params, request_id)

    def generating_request(self):
        """Counts one request as generating while inside: the engine is idle when none is (its idle
        time is traced and summed in stats.idle_s)."""
        return self.idle.generating_request()

    async def start(self):
        """Ready the engine for the loop, then tell the trainer it may start."""
        self.max_model_len = getattr(
            getattr(self.engine, "model_config", None), "max_model_len", None
        )
        if self.task is None or self.task_max_len != self.max_model_len:  # (a test's own engine)
            self.load_task(self.max_model_len)
        self.stats.train_prompts = len(self.task.prompts)
        self.stats.held_out_prompts = len(self.task.held_out)
        self.stats.prompts_dropped_long = self.task.dropped_long
        # One scoring thread (user reward functions need not be thread-safe); with a process pool,
        # one thread per worker process, to keep them all busy.
        self.reward_threads = ThreadPoolExecutor(
            max(1, self.cfg.reward_workers), thread_name_prefix="reward"
        )
        await self.engine.update_weight_version(str(self.loaded_version))
        await self.engine.collective_rpc("attach_shared_weights", args=(self.shared.to_bytes(),))
        if self.routes is not None:
            await self.routes.start(self.engine)
        # The trainer may use a GPU it shares with vLLM from now on; it must, before its first
        # publish, which a buffer that starts empty waits for below.
        self.control.engine_started.set()
        if self.shared.starts_empty:
            await load_first_publish(self)
        # The trainer waits for the engine, not for the held-out evaluation of the start: a long
        # one (a real model, a real held-out set) outlasted --timeout-s and ended the run as if the
        # engine had not started. It runs beside the first steps, on the weights loaded now, timed
        # in the trace like every evaluation.
        self.control.ready.set()
        self.wake = asyncio.Event()

    async def finish(self):
        """Cancel the groups and the evaluation in flight; close the reward threads and the task;
        flush the engine worker's trace."""
        pending = list(self.running) + ([self.eval_task] if self.eval_task is not None else [])
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.reward_threads.shutdown(wait=False, cancel_futures=True)
        self.task.close()
        # the worker's last events: vLLM kills it at shutdown, before its own last flush
        if tracing.enabled():
            try:
                await asyncio.wait_for(self.engine.collective_rpc("flush_trace"), timeout=10)
            except Exception:  # a dead engine: its trace ends where its last flush did
                pass


def generator_main(settings: GeneratorSettings, shared, rollout_queue, control) -> None:
    """Entry point of the generator process (spawned by launch.py, or remote.py on a generator
    node)."""
    rollout_queue.cancel_join_thread()  # exiting must not wait for a full queue to drain
    control.eval_results.cancel_join_thread()  # nor for evaluation answers nobody will read
    # the project's root on the path of vLLM's processes, which import the worker extension
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, HERE)
    # (an unresolved Config's gen_threads is 0: one thread then)
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.cfg.gen_threads or 1))
    tracing.start("generator", sort=100)
    gen = Generator(settings, shared, rollout_queue, control)
    engine = gen.build_engine()
    try:
        asyncio.run(gen.run())
    finally:
        engine_part.shutdown_engine(engine, settings)
        gen.engine = engine = None  # no second shutdown from __del__ at interpreter exit
