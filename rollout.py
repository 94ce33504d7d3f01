"""rollout.py — the generator process: real vLLM (`AsyncLLM`), rewards, per-token versions; the built-in task.

Role
    Runs in its own process (and process group). Streams prompts into a vLLM `AsyncLLM` engine with
    continuous batching, G completions per prompt; each finished group is scored and put on the rollout
    queue at once. Loads new weights from the packed shared buffer (sync.py) between engine steps while
    requests stay in flight ("inflight", the default: pause with requests kept, load, reset the prefix
    cache, resume) or after running requests finish ("drain").

Data contract
    - Reads: the shared weight buffer (version in its header), the trainer's counters in `Control`.
    - Writes: `buffer.RolloutGroup`s to the rollout queue. Every token carries the version of the weights
      that sampled it: vLLM tags each engine step's output with the engine's weight version, and we set
      that version while generation is paused for the swap, so the tag is exact per token.
    - Staleness gate: a new group is started only if the weights loaded now are at most `max_lag` versions
      behind the trainer step that will consume the group, so `--max-lag 0` is strictly on-policy.
    - Log-probs are vLLM's *processed* log-probs (after temperature, top-k, top-p): the behaviour policy.

The built-in task ("copy"): the prompt is `<bos>` + 3 letters from a..j + `=`, the answer is the same
letters then `<eos>`. Reward = matching positions / max(len(prediction), len(answer)) in [0, 1], the
prediction being the tokens before the first `<eos>` (partial credit; never stopping does not pay).
`build_tiny_model` makes the default model for it: a 0.4M-parameter Qwen2 with random weights and a
26-symbol character tokenizer, built locally (no download); `alphabet="ascii"` makes one for real text.
With `--dataset` (or `--task gsm8k`) the task is a dataset task instead: prompts from the user's rows,
rewards from the user's functions (TRL's convention), both through data.py. Rewards are computed in a
worker thread (or a small process pool, `--reward-workers`), never on the event loop, and timed.

May touch: its engine, the queue, the shared buffer (read only), `Control`. Nothing of the trainer.
Data flows one way: rollout -> buffer -> train (losses) -> sync -> rollout.
"""
from __future__ import annotations

import asyncio
import os
import queue as queue_lib
import random
import sys
import time
from dataclasses import dataclass, field

from buffer import RolloutGroup, put_group

HERE = os.path.dirname(os.path.abspath(__file__))
LORA_ID = 1  # vLLM's id of the one adapter the generator serves with --lora-rank (ids start at 1)

# ----------------------------------------------------------------------------------------------------
# Tasks and the tiny model
#
# The generator sees one interface: `make_task(settings, tokenizer, max_len)` returns an object with
#     sample(rng) -> Prompt                                       (called on the event loop: cheap)
#     score(prompt, completion_texts, completion_ids, step) -> (rewards, {name: stats}, unscored)
#                                                                 (called in a worker thread)
#     close()
#     needs_text: bool   False: `score` reads only token ids, so vLLM skips detokenizing (the texts are "")
# `rewards` has one float per completion (never None/NaN: see data.py's fault rules); the stats are
# data.call_reward's per-function counters, summed by the trainer into reward/<name>/... metrics.
# ----------------------------------------------------------------------------------------------------
SPECIALS = ["<pad>", "<bos>", "<eos>"]
SYMBOLS = list("0123456789abcdefghij+=_")
ASCII = [chr(i) for i in range(32, 127)] + ["\n", "\t"]  # printable ASCII, newline, tab
LETTERS = "abcdefghij"
COPY_LENGTH = 3
# A chat template that uses only printable ASCII (so the "ascii" tiny tokenizer encodes it faithfully).
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def build_tiny_model(path: str, seed: int = 0, hidden: int = 128, layers: int = 2, heads: int = 4,
                     alphabet: str = "copy", vocab_size: int = 0) -> str:
    """Write a random-init Qwen2 model and its character tokenizer to `path` (Hugging Face format).

    alphabet="copy": the default 26 symbols (the copy task's), 64 positions.
    alphabet="ascii": one token per printable ASCII character plus newline and tab (100 tokens with the
    specials), 1024 positions and a small chat template: for trying datasets, prompts and rewards on real
    text (it is random-init: it writes garbage, but the whole path runs). Llama architecture, not Qwen2:
    transformers 5 loads any tokenizer saved next to a Qwen2 config as `Qwen2Tokenizer`, whose byte-level
    pre-tokenizer would drop every space and newline of a character vocabulary.
    vocab_size > the alphabet's: the vocabulary is filled up to that size with tokens `<|N|>` that text
    never encodes to but the model can sample (the LM head and softmax of a real model, e.g. 151,936)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    if alphabet not in ("copy", "ascii"):
        raise ValueError(f"alphabet must be 'copy' or 'ascii' (got {alphabet!r})")
    ascii_ = alphabet == "ascii"
    vocab = {tok: i for i, tok in enumerate(SPECIALS + (ASCII if ascii_ else SYMBOLS))}
    vocab.update({f"<|{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    pattern = r"<pad>|<bos>|<eos>|[\s\S]" if ascii_ else "<[a-z]+>|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>")
    if ascii_:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if ascii_ else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=4 * hidden,
                          max_position_embeddings=1024 if ascii_ else 64, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    torch.manual_seed(seed)
    model = model_class(config)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path) if not os.path.exists(path) else None
    return path


@dataclass
class Prompt:
    prompt_ids: list[int]
    answer: str
    columns: dict = field(default_factory=dict)  # keyword arguments for reward functions (the row's columns)
    prompt: object = None  # the prompt as the dataset gives it (text or messages): what rewards see


class CopyTask:
    """Copy 3 letters: `<bos>abc=` -> `abc<eos>`."""

    names = ["copy"]
    needs_text = False  # scored by token ids: vLLM need not detokenize

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}

    def sample(self, rng: random.Random) -> Prompt:
        letters = "".join(rng.choice(LETTERS) for _ in range(COPY_LENGTH))
        ids = self.tokenizer(f"<bos>{letters}=", add_special_tokens=False)["input_ids"]
        return Prompt(ids, letters)

    def reward(self, completion_ids: list[int], answer: str) -> float:
        prediction = []
        for token_id in completion_ids:
            if token_id == self.eos_id:
                break
            prediction.append(self.id_to_token.get(token_id, "?"))
        matches = sum(p == a for p, a in zip(prediction, answer))
        return matches / max(len(prediction), len(answer), 1)

    def score(self, prompt: Prompt, completion_texts, completion_ids, step: int = 0):
        t0 = time.perf_counter()
        rewards = [self.reward(ids, prompt.answer) for ids in completion_ids]
        n = len(rewards)
        stats = {"n": n, "count": n, "sum": sum(rewards), "sumsq": sum(r * r for r in rewards), "none": 0,
                 "invalid": 0, "errors": 0, "time_s": time.perf_counter() - t0}
        return rewards, {"copy": stats}, 0

    def close(self):
        pass


class DatasetTask:
    """Prompts from a dataset (data.py loads and checks it), scored by TRL-convention reward functions.

    Each group's prompt is a row drawn uniformly with the rng it is handed (a function of the seed and the
    group id, so a resumed run draws the same prompts). A prompt too long to leave room for
    `max_new_tokens` within the model's context is skipped and counted (reported once)."""

    needs_text = True  # reward functions get completion texts (TRL's convention)

    def __init__(self, spec, tokenizer, max_new_tokens: int, max_len: int | None = None):
        import data

        self.spec, self.tokenizer = spec, tokenizer
        self.rows = data.load_rows(spec.dataset, spec.split)
        data.check_rows(self.rows, spec.prompt_column, spec.answer_column)
        self.scorer = data.Scorer(spec.rewards, spec.weights, workers=spec.reward_workers)
        self.names = self.scorer.names
        self.max_prompt = (max_len - max_new_tokens) if max_len else None
        self.ids: dict[int, list[int] | None] = {}  # row -> prompt ids (None: too long)
        self.too_long = 0

    def encode(self, i: int) -> list[int] | None:
        import data

        if i not in self.ids:
            where, row = self.rows[i]
            ids = data.encode_prompt(self.tokenizer, row[self.spec.prompt_column], self.spec.system_prompt)
            if self.max_prompt is not None and len(ids) > self.max_prompt:
                self.too_long += 1
                if self.too_long == 1:
                    print(f"[data] {where}: a prompt of {len(ids)} tokens leaves no room for the completion "
                          f"(context - max-new-tokens = {self.max_prompt}): skipped (such rows are skipped, "
                          "reported once)", file=sys.stderr, flush=True)
                ids = None
            self.ids[i] = ids
        return self.ids[i]

    def sample(self, rng: random.Random) -> Prompt:
        import data

        while self.too_long < len(self.rows):
            i = rng.randrange(len(self.rows))
            ids = self.encode(i)
            if ids is not None:
                row = self.rows[i][1]
                columns = data.row_columns(row, self.spec.prompt_column, self.spec.answer_column)
                return Prompt(ids, str(row[self.spec.answer_column]), columns, row[self.spec.prompt_column])
        raise RuntimeError(f"every prompt of {self.spec.dataset} is too long for the model's context "
                           f"({self.max_prompt} tokens + max-new-tokens)")

    def score(self, prompt: Prompt, completion_texts, completion_ids, step: int = 0):
        return self.scorer.score(prompt.prompt, completion_texts, completion_ids, prompt.columns, step)

    def close(self):
        self.scorer.close()


def make_task(settings, tokenizer, max_len: int | None = None):
    """The task the run's flags ask for: the copy task (default) or a dataset task (--dataset / --task)."""
    import data

    spec = data.resolve(settings.task, settings.dataset, settings.split, settings.prompt_column,
                        settings.answer_column, settings.reward, settings.reward_weights, settings.system_prompt,
                        settings.reward_workers)
    if spec is None:
        return CopyTask(tokenizer)
    return DatasetTask(spec, tokenizer, settings.max_new_tokens, max_len)


# ----------------------------------------------------------------------------------------------------
# The generator process
# ----------------------------------------------------------------------------------------------------
@dataclass
class GeneratorSettings:
    """What the generator needs from the run's config (a plain copy, so this file stands alone)."""
    model: str
    seed: int
    group_size: int
    prompts_per_step: int
    max_new_tokens: int
    max_lag: int
    update_mode: str  # "inflight" or "drain"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_inflight_groups: int = 0  # 0: one step's worth
    kv_cache_mb: int = 256
    threads: int = 1
    queue_timeout_s: float = 600.0
    # data and reward (see data.py; the defaults give the built-in copy task)
    task: str = "auto"
    dataset: str = ""
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    reward: str = ""
    reward_weights: str = ""
    system_prompt: str = ""
    reward_workers: int = 0
    initial_version: int = 0  # the version of the weights in `model` (a resumed run's checkpoint version)
    first_group_id: int = 0  # a resumed run continues the sequence of group ids (and so of prompts)
    # LoRA (lora.py): serve `model` with the adapter the trainer publishes; the buffer holds only the adapter
    lora_rank: int = 0  # 0: full weights
    lora_dir: str = ""  # holds the adapter's adapter_config.json (rank, alpha, targets)
    # GPU path only (train.py fills these from devices.py; the defaults are the CPU path)
    device: str = "cpu"  # "cpu" or "cuda"
    cuda_visible_devices: str = ""  # this process's GPUs: the generator's first, then the weight buffer's
    gpu_memory_utilization: float = 0.9  # vLLM's share of each of its GPUs (bounded on a shared GPU)
    tensor_parallel_size: int = 1  # = number of generator GPUs


def tag_versions(weight_versions, num_tokens: int) -> list[int]:
    """Per-token versions from vLLM's spans ([start, end) per version label)."""
    if num_tokens == 0:
        return []
    if not weight_versions:
        raise RuntimeError("vLLM returned no weight-version spans: cannot tag tokens by version")
    tags = [-1] * num_tokens
    for span in weight_versions:
        for i in range(span.start, min(span.end, num_tokens)):
            tags[i] = int(span.version)
    if -1 in tags:
        raise RuntimeError(f"tokens without a version tag: {tags}")
    return tags


class Generator:
    """The asyncio side of the generator process: one engine, many concurrent groups."""

    def __init__(self, settings: GeneratorSettings, shared, rollout_queue, control):
        self.s, self.shared, self.queue, self.control = settings, shared, rollout_queue, control
        self.loaded_version = settings.initial_version
        self.issued = settings.first_group_id
        self.running: set[asyncio.Task] = set()
        self.generating = 0  # groups inside engine.generate: 0 means the engine is idle (waiting)
        self.idle_since: float | None = time.perf_counter()
        self.stats = {"tokens": 0, "groups": 0, "idle_s": 0.0, "queue_wait_s": 0.0, "elapsed_s": 0.0,
                      "loads": 0}
        self.sync_ms: list[float] = []  # publish -> serving, per load, not yet handed to the trainer
        self.sync_parts: list[dict] = []
        self.error: BaseException | None = None
        self.lora_request = None  # with LoRA: every request names the one adapter, which syncs replace in place
        self.wake: asyncio.Event | None = None  # set when a group finishes: the loop may start the next at once

    def build_engine(self):
        if self.s.device == "cuda":
            # Before vLLM is imported (its engine and worker processes inherit this): vLLM runs on the first
            # tensor_parallel_size visible GPUs; the trainer's weight buffer is on one of them or on the
            # last one, where the worker extension opens its CUDA IPC handle and copies peer-to-peer.
            os.environ["CUDA_VISIBLE_DEVICES"] = self.s.cuda_visible_devices
            memory = dict(gpu_memory_utilization=self.s.gpu_memory_utilization,
                          tensor_parallel_size=self.s.tensor_parallel_size)
        else:
            memory = dict(kv_cache_memory_bytes=self.s.kv_cache_mb * 2**20)
        if self.s.lora_rank:
            from lora import engine_max_rank
            from vllm.lora.request import LoRARequest

            memory.update(enable_lora=True, max_lora_rank=engine_max_rank(self.s.lora_rank), max_loras=1,
                          max_cpu_loras=1)
            self.lora_request = LoRARequest("policy", LORA_ID, self.s.lora_dir)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.s.model)
        args = AsyncEngineArgs(
            model=self.s.model, tokenizer=self.s.model, dtype="float32", seed=self.s.seed,
            enforce_eager=True, logprobs_mode="processed_logprobs",
            worker_extension_cls="sync.WeightSyncWorker", **memory,
            enable_prefix_caching=True, disable_log_stats=True,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        return self.engine

    def sampling_params(self, group_id: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # A per-request seed makes a group's samples a function of (seed, group id, weights), so a resumed
        # run regenerates the same rollouts. Only when no request is ever preempted by a weight swap:
        # vLLM's CPU sampler cannot re-seed a preempted request ("CPU Generator does not use offset").
        reproducible = self.s.max_lag == 0 or self.s.update_mode == "drain"
        # Detokenizing every token costs the front end CPU time; a task scored by token ids skips it.
        return SamplingParams(n=self.s.group_size, max_tokens=self.s.max_new_tokens,
                              temperature=self.s.temperature, top_k=self.s.top_k, top_p=self.s.top_p,
                              logprobs=0, seed=self.s.seed * 1_000_003 + group_id if reproducible else None,
                              output_kind=RequestOutputKind.FINAL_ONLY, detokenize=self.task.needs_text)

    def _count_generating(self, delta: int) -> None:
        now = time.perf_counter()
        if self.generating == 0 and delta > 0 and self.idle_since is not None:
            self.stats["idle_s"] += now - self.idle_since
            self.idle_since = None
        self.generating += delta
        if self.generating == 0:
            self.idle_since = now

    async def run_group(self, group_id: int, prompt: Prompt):
        final = None
        self._count_generating(+1)
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt.prompt_ids},
                                                  self.sampling_params(group_id), request_id=f"group-{group_id}",
                                                  lora_request=self.lora_request):
                final = out
        finally:
            self._count_generating(-1)
        completions, logprobs, versions, texts = [], [], [], []
        for c in sorted(final.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            completions.append(ids)
            logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(ids)])
            versions.append(tag_versions(c.weight_versions, len(ids)))
            texts.append(c.text or "")  # "" when the task does not need text (detokenize=False)
            self.stats["tokens"] += len(ids)
        # Rewards run in worker threads (or the task's process pool), never on this event loop.
        rewards, reward_stats, unscored = await asyncio.get_running_loop().run_in_executor(
            self.reward_threads, self.task.score, prompt, texts, completions, self.loaded_version)
        self.stats["reward_s"] = self.stats.get("reward_s", 0.0) + sum(s["time_s"] for s in reward_stats.values())
        self.stats["unscored"] = self.stats.get("unscored", 0) + unscored
        self.stats["groups"] += 1
        group = RolloutGroup(group_id, prompt.prompt_ids, completions, logprobs, versions, rewards, prompt.answer,
                             reward_stats=reward_stats, unscored=unscored)
        group.gen_stats = dict(self.stats, sync_ms=self.sync_ms, sync_parts=self.sync_parts,
                               loaded_version=self.loaded_version)
        self.sync_ms, self.sync_parts = [], []
        try:  # usually there is room: no thread hop (mp.Queue.put only hands the group to its feeder thread)
            self.queue.put_nowait(group)
        except queue_lib.Full:  # a full queue: wait in a thread, never on this event loop
            waited = await asyncio.to_thread(put_group, self.queue, group, self.control.stop.is_set,
                                             self.s.queue_timeout_s)
            self.stats["queue_wait_s"] += waited

    async def engine_call(self, awaitable, what: str):
        """Await an engine call, failing fast if vLLM's EngineCore dies (a dead engine never answers)."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + self.s.queue_timeout_s
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if self.engine.errored:
                task.cancel()
                raise RuntimeError(f"vLLM's engine died during {what}") from self.engine.dead_error
            if time.monotonic() > deadline:
                task.cancel()
                raise TimeoutError(f"vLLM did not finish {what} within {self.s.queue_timeout_s:.0f} s")

    async def swap_weights(self, version: int):
        """Load the newest published weights between engine steps; tag later tokens with `version`."""
        t0 = time.perf_counter()
        mode = "keep" if self.s.update_mode == "inflight" else "wait"
        # The scheduler's own pause, not `AsyncLLM.pause_generation`: with clear_cache=False that method only
        # adds a fixed 20 ms sleep (vLLM 0.32), meant to let outputs of the last step reach their callers
        # before it returns. We do not need that ordering: EngineCore stamps each step's output with the
        # version it was sampled under, so a token that arrives after the swap still carries its own tag.
        await self.engine_call(self.engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=False),
                               "the pause")
        t1 = time.perf_counter()
        loaded = await self.engine_call(self.load_rpc(version), "the weight load")
        version = min(loaded)  # the buffer may already hold a newer version than we were told
        t2 = time.perf_counter()
        # Cached blocks hold keys/values of the old weights; in-flight requests are re-prefilled.
        if not await self.engine_call(self.engine.reset_prefix_cache(reset_running_requests=True), "the reset"):
            raise RuntimeError("reset_prefix_cache failed after a weight update: stale KV cache would be reused")
        await self.engine_call(self.engine.update_weight_version(str(version)), "update_weight_version")
        t3 = time.perf_counter()
        await self.engine_call(self.engine.resume_generation(), "resume_generation")
        self.loaded_version = version
        self.control.loaded_version.value = version
        self.stats["loads"] += 1
        self.sync_ms.append((time.time_ns() - self.shared.publish_time_ns()) / 1e6)
        self.sync_parts.append({"pause_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3,
                                "reset_ms": (t3 - t2) * 1e3, "resume_ms": (time.perf_counter() - t3) * 1e3})

    def load_rpc(self, version: int):
        """The worker call that loads the buffer's contents: the full weights, or the adapter in place."""
        if self.s.lora_rank:
            return self.engine.collective_rpc("load_shared_adapter", args=(version, self.s.lora_dir, LORA_ID))
        return self.engine.collective_rpc("load_shared_weights", args=(version,))

    async def load_first_adapter(self):
        """LoRA: the engine serves no adapter until the trainer's first publish of it (at its start)."""
        deadline = time.monotonic() + self.s.queue_timeout_s
        while self.shared.publish_time_ns() == 0 or self.shared.version() < self.s.initial_version:
            if self.control.stop.is_set():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer published no adapter within {self.s.queue_timeout_s:.0f} s")
            await asyncio.sleep(0.01)
        self.loaded_version = min(await self.engine_call(self.load_rpc(self.s.initial_version), "the first load"))
        await self.engine.update_weight_version(str(self.loaded_version))  # the tag of the tokens it samples
        self.control.loaded_version.value = self.loaded_version

    def may_start_group(self) -> bool:
        max_running = self.s.max_inflight_groups or self.s.prompts_per_step
        if len(self.running) >= max_running:
            return False
        landing_step = (self.issued - self.control.groups_dropped.value) // self.s.prompts_per_step
        return self.loaded_version >= landing_step - self.s.max_lag

    def _done(self, task: asyncio.Task):
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        if self.wake is not None:
            self.wake.set()

    async def run(self):
        from concurrent.futures import ThreadPoolExecutor

        from transformers import AutoTokenizer

        max_len = getattr(getattr(self.engine, "model_config", None), "max_model_len", None)
        self.task = make_task(self.s, AutoTokenizer.from_pretrained(self.s.model), max_len)
        # One scoring thread (user reward functions need not be thread-safe); with a process pool, one
        # thread per worker process, to keep them all busy.
        self.reward_threads = ThreadPoolExecutor(max(1, self.s.reward_workers), thread_name_prefix="reward")
        await self.engine.update_weight_version(str(self.loaded_version))
        await self.engine.collective_rpc("attach_shared_weights", args=(self.shared.to_bytes(),))
        if self.s.lora_rank:
            await self.load_first_adapter()
        self.control.ready.set()
        self.wake = asyncio.Event()
        start = time.perf_counter()
        self.idle_since = start
        while not self.control.stop.is_set():
            if self.error is not None:
                raise self.error
            if self.engine.errored:  # vLLM's EngineCore died (it is not our child: we must look)
                raise RuntimeError("vLLM's engine died") from self.engine.dead_error
            published = self.shared.version()
            if published > self.loaded_version:
                await self.swap_weights(published)
            if self.may_start_group():
                prompt = self.task.sample(random.Random(f"{self.s.seed}-{self.issued}"))  # a function of the id
                task = asyncio.create_task(self.run_group(self.issued, prompt))
                task.add_done_callback(self._done)
                self.running.add(task)
                self.issued += 1
                continue
            # Nothing to start: sleep until a group finishes (its slot frees at once), or 2 ms pass (new
            # weights, the trainer's progress and the stop flag live in shared memory: they are polled).
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=0.002)
            except asyncio.TimeoutError:
                pass
            self.stats["elapsed_s"] = time.perf_counter() - start
        for task in list(self.running):
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        self.reward_threads.shutdown(wait=False, cancel_futures=True)
        self.task.close()


def generator_main(settings: GeneratorSettings, shared, rollout_queue, control) -> None:
    """Entry point of the generator process (spawned by train.py)."""
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")  # for the extension
    sys.path.insert(0, HERE)
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.threads))
    gen = Generator(settings, shared, rollout_queue, control)
    engine = gen.build_engine()
    try:
        asyncio.run(gen.run())
    finally:
        engine.shutdown()
        gen.engine = engine = None  # no second shutdown from __del__ at interpreter exit
