"""rollout.py — the generator process: a vLLM `AsyncLLM` engine sampling G completions per prompt.

Role: streams the task's prompts (tasks/builtin.py) into the engine with continuous batching; each
finished group is scored in a worker thread and put on the rollout queue at once. New weights are
loaded from the shared buffer (shared_weights.py, through vllm_worker.py) between engine steps
(weight_swaps.py), requests kept in flight ("inflight") or let finish ("drain"); held-out
evaluations (evaluation.run_eval) run beside training requests. An env task (--env, --task reveal)
runs each of a group's G samples as an episode, a chain of requests (tasks/envs.py: `run_env_group`,
`eval_env_prompt`; the episodes use this class only through tasks/protocols.Sampler, which it
satisfies). What it serves (full weights or an adapter) comes through lora.Served, its devices
through devices.enter_generator_devices; with --router-replay or --router-record, each sample's
routes come through routes.GeneratorRoutes.
Data contract: writes `buffer.RolloutGroup`s with vLLM's processed log-probs (the behaviour policy)
and, per token, the version of the weights that sampled it (and, when recorded, its routes); a group
starts only if the loaded weights are at most --max-lag versions behind the trainer version that
will consume it (its step less the steps skipped).
Reads the buffer's version and `Control`.
May touch: its engine, the queue, the shared buffer (read only), `Control`, its trace events
(tracing.py). Nothing of the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue as queue_lib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from buffer import RolloutGroup, put_group, tag_versions
from config import Config
from generator.routes import GeneratorRoutes
from generator.weight_swaps import load_first_publish, swap_weights
from infra import tracing
from infra.devices import engine_concurrency, enter_generator_devices, torch_dtype
from infra.kv_cache import sized_engine_config
from tasks import chat, envs
from tasks.builtin import make_task
from tasks.evaluation import requested, run_eval
from tasks.prompts import Prompt, walk
from trainer.lora import Served, served_weights

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class GeneratorSettings:
    """The generator's start: the run's resolved Config (the one source of every setting) and what
    the parent derived for this process (prepare.generator_settings)."""

    cfg: Config
    model: str  # the directory vLLM serves (a resumed run: the checkpoint's model)
    initial_version: int = 0  # the version of the weights in `model`
    # a resumed run continues the sequence of group ids (and so the walk of prompts)
    first_group_id: int = 0
    # evaluate the initial weights (step 0) as the engine starts, beside the first steps
    eval_at_start: bool = False
    # with --lora-rank: holds the adapter's adapter_config.json (rank, alpha, targets)
    lora_dir: str = ""
    stop: tuple = ()  # --stop, unescaped (vLLM's SamplingParams.stop)
    # GPU placement (devices.DeviceLayout.generator_settings; the defaults are the CPU path)
    device: str = "cpu"  # "cpu" or "cuda"
    # this process's GPUs: the generator's first, then the weight buffer's
    cuda_visible_devices: str = ""
    # vLLM's share of each of its GPUs (bounded on a shared GPU)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # = number of generator GPUs


class Generator:
    """The asyncio side of the generator process: one engine, many concurrent groups."""

    def __init__(self, settings: GeneratorSettings, shared, rollout_queue, control):
        self.settings, self.shared, self.queue, self.control = (
            settings,
            shared,
            rollout_queue,
            control,
        )
        self.cfg = settings.cfg
        self.loaded_version = settings.initial_version
        self.issued = settings.first_group_id
        self.running: set[asyncio.Task] = set()
        self.generating = 0  # groups inside engine.generate: 0 means the engine is idle (waiting)
        self.idle_since: float | None = time.perf_counter()
        self.stats = {
            "tokens": 0,
            "groups": 0,
            "idle_s": 0.0,
            "queue_wait_s": 0.0,
            "elapsed_s": 0.0,
            "loads": 0,
            "swap_requests": 0,
        }
        # publish -> serving, per load, not yet handed to the trainer
        self.sync_ms: list[float] = []
        self.sync_parts: list[dict] = []
        self.error: BaseException | None = None
        # set when a group finishes: the loop may start the next at once
        self.wake: asyncio.Event | None = None
        # the evaluation in flight: no weight load until it is done
        self.eval_task: asyncio.Task | None = None
        self.last_eval_step = -1  # the newest evaluation request started
        self.task, self.task_max_len = None, None  # load_task, with the engine
        recorded = self.cfg.router_replay or self.cfg.router_record
        self.routes = GeneratorRoutes(settings.device == "cuda") if recorded else None

    def build_engine(self):
        # (sets CUDA_VISIBLE_DEVICES)
        options = enter_generator_devices(self.settings, self.cfg.kv_cache_mb)
        # vLLM is imported here, in the generator process, never in the parent (nor before
        # CUDA_VISIBLE_DEVICES).
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        options.update(
            self.served.engine_options, **(self.routes.engine_options if self.routes else {})
        )
        if self.cfg.max_model_len:
            options.update(max_model_len=self.cfg.max_model_len)
        options.update(engine_concurrency(self.cfg))
        self.stats["max_num_seqs"] = options["max_num_seqs"]
        args = AsyncEngineArgs(
            model=self.settings.model,
            tokenizer=self.settings.model,
            dtype=torch_dtype(self.cfg.dtype),
            seed=self.cfg.seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="generator.vllm_worker.WeightSyncWorker",
            **options,
            enable_prefix_caching=True,
            disable_log_stats=True,
            use_tqdm_on_load=self.cfg.log_level != "warning",
        )
        config = sized_engine_config(args, self)  # the task first: it sizes the CPU KV cache
        self.engine = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
        return self.engine

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

    def generate(self, ids: list[int], params, request_id: str):
        """The engine's outputs for one request of token `ids`, under the weights it serves."""
        return tracing.request(
            self.engine.generate(
                self.prompt_input(ids), params, request_id=request_id, **self.served.request_options
            ),
            request_id,
            n=params.n,
        )

    def request_params(self, max_tokens: int | None = None, **sampling):
        """vLLM's SamplingParams for one request: final output only, the run's stop strings and
        length (an episode's turn: what is left of its budget, at most --max-new-tokens)."""
        from vllm import SamplingParams  # the generator process only (see build_engine)
        from vllm.sampling_params import RequestOutputKind

        # Detokenizing every token costs the front end CPU time; a task scored by token ids skips it
        # (stop strings are matched in the text: they need it).
        return SamplingParams(
            **sampling,
            max_tokens=max_tokens or self.cfg.max_new_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,
            stop=list(self.settings.stop) or None,
            detokenize=self.task.needs_text or bool(self.settings.stop),
        )

    def sampling_params(self, group_id: int):
        # A per-request seed makes a group's samples a function of (seed, group id, weights), so a
        # resumed run regenerates the same rollouts. Only when no request is ever preempted by a
        # weight swap: vLLM's CPU sampler cannot re-seed a preempted request ("CPU Generator does
        # not use offset"). --kv-on-swap keep preempts nothing at a swap, but the seed stays off:
        # vLLM still preempts for KV room, and where a swap lands is timing, so the tokens are no
        # function of the seed anyway.
        reproducible = self.cfg.max_lag == 0 or self.cfg.update_mode == "drain"
        return self.request_params(
            n=self.cfg.group_size,
            temperature=self.cfg.temperature,
            top_k=self.cfg.top_k,
            top_p=self.cfg.top_p,
            logprobs=0,
            seed=self.cfg.seed * 1_000_003 + group_id if reproducible else None,
        )

    def prompt_input(self, ids: list[int]) -> dict:
        """vLLM's prompt for token `ids`. Under --kv-on-swap keep the prefix cache is never reset,
        so a request is salted with the loaded version (vLLM hashes the salt into its first block):
        it shares cached blocks with requests sent under the same weights (a group's G samples),
        never with the old weights' ones."""
        salt = {"cache_salt": f"v{self.loaded_version}"} if self.cfg.kv_on_swap == "keep" else {}
        return {"prompt_token_ids": ids, **salt}

    @contextlib.contextmanager
    def generating_request(self):
        """Counts one request as generating while inside: the engine is idle when none is (its idle
        time is traced and summed in stats["idle_s"])."""
        now = time.perf_counter()
        if self.generating == 0 and self.idle_since is not None:
            tracing.complete("engine idle", self.idle_since, now, track="engine idle", cat="idle")
            self.stats["idle_s"] += now - self.idle_since
            self.idle_since = None
        self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1
            if self.generating == 0:
                self.idle_since = time.perf_counter()

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

    async def run_group(self, group_id: int, prompt: Prompt, epoch: int = 0):
        if self.task.is_env:  # G episodes, each its own chain of requests (tasks/envs.py)
            await self.enqueue(await envs.run_env_group(self, group_id, prompt, epoch))
            return
        final = None
        with self.generating_request():
            async for out in self.generate(
                prompt.prompt_ids, self.sampling_params(group_id), f"group-{group_id}"
            ):
                final = out
        completions, logprobs, versions, texts = [], [], [], []
        for c in sorted(final.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            completions.append(ids)
            logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(ids)])
            versions.append(tag_versions(c.weight_versions, len(ids)))
            texts.append(c.text or "")  # "" when the task does not need text (detokenize=False)
        # Rewards run in worker threads (or the task's process pool), never on this event loop.
        rewards, reward_stats, unscored = await asyncio.get_running_loop().run_in_executor(
            self.reward_threads, self.task.score, prompt, texts, completions, self.loaded_version
        )
        outputs = sorted(final.outputs, key=lambda c: c.index)
        # prompt + completion, each
        routes = (
            None
            if self.routes is None
            else await self.routes.sequences(
                self.engine,
                f"group-{group_id}",
                outputs,
                [len(prompt.prompt_ids) + len(ids) for ids in completions],
            )
        )
        group = RolloutGroup(
            group_id,
            prompt.prompt_ids,
            completions,
            logprobs,
            versions,
            rewards,
            prompt.answer,
            reward_stats=reward_stats,
            unscored=unscored,
            epoch=epoch,
            routes=routes,
            finish_reasons=[c.finish_reason for c in outputs],
        )
        await self.enqueue(group)

    async def enqueue(self, group: RolloutGroup):
        """Count a scored group and put it on the rollout queue, stamped with the generator's
        counters."""
        self.stats["reward_s"] = self.stats.get("reward_s", 0.0) + sum(
            s["time_s"] for s in group.reward_stats.values()
        )
        self.stats["unscored"] = self.stats.get("unscored", 0) + len(group.unscored)
        # counted with its tokens once scored (a run stopping mid-score drops it)
        self.stats["groups"] += 1
        self.stats["tokens"] += (
            sum(map(sum, group.model_masks))
            if group.model_masks is not None
            else sum(map(len, group.completion_ids))
        )
        group.gen_stats = dict(
            self.stats,
            sync_ms=self.sync_ms,
            sync_parts=self.sync_parts,
            loaded_version=self.loaded_version,
        )
        self.sync_ms, self.sync_parts = [], []
        # usually there is room: no thread hop (mp.Queue.put only hands the group to its feeder
        # thread)
        try:
            self.queue.put_nowait(group)
        except queue_lib.Full:  # a full queue: wait in a thread, never on this event loop
            waited = await asyncio.to_thread(
                put_group, self.queue, group, self.control.stop.is_set, self.cfg.timeout_s
            )
            self.stats["queue_wait_s"] += waited
            tracing.complete(
                "queue full", time.perf_counter() - waited, track=tracing.LANE, cat="queue full"
            )
        tracing.counter("rollout queue", groups=tracing.qsize(self.queue))

    def may_start_group(self) -> bool:
        max_running = self.cfg.max_inflight_groups or self.cfg.prompts_per_step
        if len(self.running) >= max_running:
            return False
        # The trainer's version when this group lands: its step, less the steps skipped so far (a
        # skipped step keeps the version; skips still to come only lower it, so the bound holds).
        landing_step = (
            self.issued - self.control.groups_dropped.value
        ) // self.cfg.prompts_per_step
        landing_version = landing_step - self.control.steps_skipped.value
        return not tracing.state(
            "staleness gate",
            "no new group (--max-lag)",
            self.loaded_version < landing_version - self.cfg.max_lag,
        )

    def _done(self, group_id: int, task: asyncio.Task):
        self.running.discard(task)
        if self.routes is not None:  # what the worker still holds of it is freed (routes.py)
            self.routes.end(f"group-{group_id}")
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        if self.wake is not None:
            self.wake.set()

    async def run(self):
        self.max_model_len = getattr(
            getattr(self.engine, "model_config", None), "max_model_len", None
        )
        if self.task is None or self.task_max_len != self.max_model_len:  # (a test's own engine)
            self.load_task(self.max_model_len)
        self.stats.update(
            train_prompts=len(self.task.prompts),
            held_out_prompts=len(self.task.held_out),
            prompts_dropped_long=self.task.dropped_long,
        )
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
        start = time.perf_counter()
        self.idle_since = start
        if self.settings.eval_at_start:
            self.start_eval(0)
        while not self.control.stop.is_set():
            if self.error is not None:
                raise self.error
            if self.engine.errored:  # vLLM's EngineCore died (it is not our child: we must look)
                raise RuntimeError("vLLM's engine died") from self.engine.dead_error
            published = self.shared.version()
            if published > self.loaded_version and not self.eval_holds_weights(published):
                await swap_weights(self, published)
            if self.eval_task is None:
                self.maybe_start_eval()
            if self.may_start_group():
                # (epoch, row): a function of the id
                epoch, row = walk(self.issued, len(self.task.prompts), self.cfg.seed)
                group = self.run_group(self.issued, self.task.prompts[row], epoch)
                task = asyncio.create_task(
                    tracing.on_lane(group, f"group {self.issued}", group=self.issued)
                )
                task.add_done_callback(functools.partial(self._done, self.issued))
                self.running.add(task)
                self.issued += 1
                continue
            # Nothing to start: sleep until a group finishes (its slot frees at once), or 2 ms pass
            # (new weights, the trainer's progress and the stop flag live in shared memory: they are
            # polled).
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=0.002)
            except asyncio.TimeoutError:
                pass
            self.stats["elapsed_s"] = time.perf_counter() - start
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
    # for the extension
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, HERE)
    # (0: an unresolved Config)
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.cfg.gen_threads or 1))
    tracing.start("generator", sort=100)
    gen = Generator(settings, shared, rollout_queue, control)
    engine = gen.build_engine()
    try:
        asyncio.run(gen.run())
    finally:
        if settings.cfg.log_level == "warning":
            quiet_requested_shutdown()
        # On CPU, vLLM 0.32's worker lingers after acknowledging the shutdown and is force-killed
        # after 5 s anyway; there is no device memory to release, so the engine gets 1 s (GPUs:
        # vLLM's own grace).
        engine.shutdown(timeout=CPU_ENGINE_SHUTDOWN_S if settings.device == "cpu" else None)
        gen.engine = engine = None  # no second shutdown from __del__ at interpreter exit


# what vLLM's EngineCore gets to exit on CPU before it is killed with its worker
CPU_ENGINE_SHUTDOWN_S = 1.0


def quiet_requested_shutdown() -> None:
    """vLLM 0.32's CPU worker lingers after it acknowledges the shutdown, so at every end of a run
    vLLM force- kills it (after CPU_ENGINE_SHUTDOWN_S) and logs three "[shutdown] ... force killing"
    warnings. We asked for this shutdown and nothing is lost: those lines are left out
    (with --log-level info they show)."""

    class RequestedShutdown(logging.Filter):
        def filter(self, record):
            return not record.getMessage().startswith("[shutdown]")

    for name in ("vllm.v1.utils", "vllm.utils.system_utils"):
        logging.getLogger(name).addFilter(RequestedShutdown())
