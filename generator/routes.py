"""generator/routes.py — the generator's routes: the experts each MoE layer sent every token to,
recorded where vLLM sampled it, carried with the tokens (--router-replay, --router-record).

Role
    `RouteStore`: what a vLLM worker records, step by step (numpy only): each request's routes by
    position, and each KV-cache block's, so that a request whose prompt hits the prefix cache
    (positions vLLM does not recompute) gets the routes of the computation whose keys and values it
    reuses. `RouteRecorder`: mixed into the worker extension (vllm_worker.WeightSyncWorker) on the
    CPU path, where vLLM 0.32 returns no routes (`enable_return_routed_experts` needs its Model
    Runner V2, which needs Triton): binds every MoE layer's router `capture_fn` hook and wraps the
    model runner's `execute_model`. Eager execution only (the CPU path's `enforce_eager=True`):
    under torch.compile the hook records zeros. `GeneratorRoutes`: the generator process's side:
    starts the recording, takes a finished request's routes, and has the worker free those of a
    group that ended without taking them (with its next take). On GPUs vLLM records them itself
    (`enable_return_routed_experts`, each completion's `routed_experts`); that path has never run
    here (no GPU was available): it follows vLLM 0.32's documented API only.
Data contract
    A sample's routes: a numpy array (positions, layers, top_k), one row per position of prompt +
    completion (the routes of the token at that position as the model read it), uint8 below 256
    experts, else uint16, every bit set (-1 read as signed) where a route is missing: the last token
    of a completion (vLLM never reads it), a dense layer of a mixed model, a cached position whose
    block's routes were not recorded. A token's routes are those of the weights that produced it:
    the first record of a position wins (a request re-prefilled after a weight swap keeps its first
    routes; a later turn of an episode adds only what is new).
May touch: the vLLM worker it is mixed into (private vLLM 0.32 APIs: MoE runners' routers, the model
runner).
"""

from __future__ import annotations

import functools
import re

import numpy as np

# At most this many requests' routes wait to be taken; beyond it the oldest are dropped. It is a
# safety net: the records of a group's requests are freed when the group ends (`RouteStore.forget`).
MAX_RECORDS = 4096
CHILD = re.compile(r"^\d+_")  # vLLM names the n samples of one request "{index}_{request id}"


def route_dtype(num_experts: int):
    """The narrowest unsigned dtype that holds every expert index and the missing mark (all bits
    set)."""
    return np.uint8 if num_experts < 256 else np.uint16


def missing_rows(count: int, layers: int, top_k: int, dtype) -> np.ndarray:
    return np.full((count, layers, top_k), np.iinfo(dtype).max, dtype=dtype)


def fitted(routes: np.ndarray | None, length: int, layers: int, top_k: int, dtype) -> np.ndarray:
    """`routes` cut or padded (missing) to `length` positions."""
    out = missing_rows(length, layers, top_k, dtype)
    if routes is not None and len(routes):
        n = min(length, len(routes))
        out[:n] = routes[:n]
    return out


def merged(known: np.ndarray | None, new: np.ndarray, start: int) -> np.ndarray:
    """An episode's routes after one more turn: `known` (positions so far) kept wherever present
    (first record wins), `new` (the turn's request from position `start` on) filling the rest and
    extending it."""
    if known is None or not len(known):
        known = new[:0]
    length = max(len(known), start + len(new))
    out = missing_rows(length, *new.shape[1:], new.dtype)
    out[: len(known)] = known
    span = out[start : start + len(new)]
    absent = (span == np.iinfo(new.dtype).max).all(axis=(1, 2))
    span[absent] = new[absent]
    return out


def known_prefix(routes: np.ndarray | None) -> int:
    """Positions from the start with a route (where the next turn's request need not return them
    again)."""
    if routes is None or not len(routes):
        return 0
    absent = (routes == np.iinfo(routes.dtype).max).all(axis=(1, 2))
    return int(np.argmax(absent)) if absent.any() else len(routes)


# --------------------------------------------------------------------------------------------------
# The worker's side (CPU): what each engine step routed, by request and by KV-cache block
# --------------------------------------------------------------------------------------------------
class RouteStore:
    """Routes recorded in one vLLM worker. An engine step hands `capture` each MoE layer's top-k ids
    (rows in the order of the step's scheduled tokens) and `commit` the step's requests, their token
    counts and the positions of the rows; requests whose id starts with `prefix` (the training
    requests) keep a record until `take`n. Every computed row is also written to its physical
    KV-cache block: a later request reusing that block through the prefix cache gets those routes
    (an exact answer: they produced the keys it reads)."""

    def __init__(
        self, layers: int, top_k: int, num_experts: int, block_size: int, prefix: str = "group-"
    ):
        self.layers, self.top_k, self.block_size, self.prefix = layers, top_k, block_size, prefix
        self.dtype = route_dtype(num_experts)
        self.missing = np.iinfo(self.dtype).max
        self.records: dict[str, np.ndarray] = {}  # request id (vLLM's) -> (capacity, layers, top_k)
        self.known: dict[str, int] = {}  # request id -> positions from 0 that hold a route
        self.blocks: dict[int, np.ndarray] = {}  # physical block id -> (block_size, layers, top_k)
        self.step: dict[int, np.ndarray] = {}

    def begin_step(self) -> None:
        self.step = {}

    def capture(self, layer: int, topk_ids) -> None:
        """A MoE layer's router chose `topk_ids` (tokens, top_k) for this step's tokens (vLLM's
        capture_fn)."""
        self.step[layer] = topk_ids.detach().to("cpu").numpy().astype(self.dtype, copy=True)

    def step_rows(self, count: int) -> np.ndarray:
        rows = missing_rows(count, self.layers, self.top_k, self.dtype)
        for layer, ids in self.step.items():
            rows[:, layer] = ids[:count]
        return rows

    def commit(self, requests, positions: np.ndarray) -> None:
        """The step's `requests`, (request id, tokens scheduled, its KV block ids) in the order of
        its rows; `positions` the position of each row."""
        if not self.step:
            return
        rows = self.step_rows(len(positions))
        offset = 0
        for request_id, count, block_ids in requests:
            pos, got = positions[offset : offset + count], rows[offset : offset + count]
            offset += count
            if not count:
                continue
            self.write_blocks(block_ids, pos, got)
            if CHILD.sub("", request_id).startswith(self.prefix):
                self.record(request_id, pos, got, block_ids)
        self.step = {}

    def write_blocks(self, block_ids, pos: np.ndarray, rows: np.ndarray) -> None:
        for block in np.unique(pos // self.block_size):
            at = pos // self.block_size == block
            store = self.blocks.get(block_ids[block])
            if store is None:
                store = self.blocks[block_ids[block]] = missing_rows(
                    self.block_size, self.layers, self.top_k, self.dtype
                )
            store[pos[at] % self.block_size] = rows[at]

    def record(self, request_id: str, pos: np.ndarray, rows: np.ndarray, block_ids) -> None:
        record = self.records.get(request_id)
        end = int(pos.max()) + 1
        if record is None or len(record) < end:
            grown = missing_rows(
                max(end, 2 * len(record) if record is not None else 64),
                self.layers,
                self.top_k,
                self.dtype,
            )
            if record is not None:
                grown[: len(record)] = record
            record = self.records[request_id] = grown
            self.known.setdefault(request_id, 0)
            while len(self.records) > MAX_RECORDS:
                oldest = next(iter(self.records))
                del self.records[oldest], self.known[oldest]
        known = self.known[request_id]
        # positions vLLM took from the prefix cache: the routes of their blocks
        if known < pos.min():
            for p in range(known, int(pos.min())):
                block = self.blocks.get(block_ids[p // self.block_size])
                if block is not None and self.absent(record[p]):
                    record[p] = block[p % self.block_size]
        fresh = self.absent_rows(record[pos])  # the first record of a position wins
        record[pos[fresh]] = rows[fresh]
        while known < len(record) and not self.absent(record[known]):
            known += 1
        self.known[request_id] = known

    def absent(self, row: np.ndarray) -> bool:
        return bool((row == self.missing).all())

    def absent_rows(self, rows: np.ndarray) -> np.ndarray:
        return (rows == self.missing).all(axis=(1, 2))

    def take(self, request_id: str, start: int = 0) -> dict[int, np.ndarray]:
        """{sample index: routes from position `start`} of the request the generator named
        `request_id` (vLLM's ids add "-" and 8 random characters, and "{index}_" for each of n
        samples); forgotten here."""
        taken = {}
        for name in [name for name in self.records if self.named(name, request_id)]:
            match = CHILD.match(name)
            index = int(match.group()[:-1]) if match else 0
            record = self.records.pop(name)
            self.known.pop(name)
            present = np.flatnonzero(~self.absent_rows(record))
            taken[index] = record[start : int(present[-1]) + 1 if len(present) else 0]
        return taken

    def forget(self, groups) -> None:
        """Free the records of every request of the ended `groups` (the generator's group ids:
        "group-7" ends its samples' request and its episodes' turns, "group-7-2-t1"): nothing
        will take them now (a group cancelled or failed while its requests ran)."""
        for name in [n for n in self.records if any(self.of_group(n, g) for g in groups)]:
            del self.records[name], self.known[name]

    @staticmethod
    def of_group(name: str, group: str) -> bool:
        base = CHILD.sub("", name)
        return base == group or base.startswith(group + "-")

    @staticmethod
    def named(name: str, request_id: str) -> bool:
        base = CHILD.sub("", name)
        return base == request_id or (
            len(base) == len(request_id) + 9 and base.startswith(request_id + "-")
        )


class RouteRecorder:
    """Worker-extension methods (mixed into vLLM's worker with vllm_worker.WeightSyncWorker), called
    through `collective_rpc`: `start_routes` once, then `take_routes` for each finished request."""

    def start_routes(self, prefix: str = "group-") -> list[int]:
        """Record routes from now on; returns [decoder layers, top_k, experts]."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner
        model, config = runner.get_model(), runner.model_config
        layers, experts = config.get_total_num_hidden_layers(), config.get_num_experts()
        moe = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not moe or not all(hasattr(m.router, "set_capture_fn") for m in moe):
            raise RuntimeError(
                "vLLM's model has no MoE router with a capture hook: no routes to record"
            )
        top_k = moe[0].router.top_k
        self._routes = RouteStore(layers, top_k, experts, runner.cache_config.block_size, prefix)
        for m in moe:
            m.router.set_capture_fn(functools.partial(self._routes.capture, m.layer_id))
        model.register_forward_pre_hook(self._catch_positions, with_kwargs=True)
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._routes.begin_step()
            self._positions = None
            out = execute(scheduler_output, *args, **kwargs)
            if self._positions is not None:
                counts = scheduler_output.num_scheduled_tokens
                self._routes.commit(
                    [
                        (r, counts.get(r, 0), runner.requests[r].block_ids[0])
                        for r in runner.input_batch.req_ids
                        if r in counts
                    ],
                    self._positions,
                )
            return out

        runner.execute_model = execute_model
        return [layers, top_k, experts]

    def _catch_positions(self, module, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self._positions = positions.detach().to("cpu").numpy().copy()

    def take_routes(self, request_id: str, start: int = 0, ended=()) -> list:
        """[[sample index, the routes' bytes], ...] (RouteStore.take; bytes cross vLLM's RPC as they
        are); first frees what the `ended` groups left (RouteStore.forget)."""
        self._routes.forget(ended)
        return [
            [index, rows.tobytes()] for index, rows in self._routes.take(request_id, start).items()
        ]


# --------------------------------------------------------------------------------------------------
# The generator process's side
# --------------------------------------------------------------------------------------------------
class GeneratorRoutes:
    """How the generator gets its requests' routes: from vLLM itself on GPUs (`routed_experts` of
    each completion; `routed_experts_prompt_start` skips what an episode already holds), from the
    worker's RouteRecorder on CPU. `dtype`: the arrays' (route_dtype of the model's experts)."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.layers = self.top_k = 0
        self.dtype = np.uint8
        # groups ended since the last take: the worker frees what they left with the next one
        self.ended: list[str] = []

    def end(self, group: str) -> None:
        """The group `group` ("group-7") ended, taken or not (cancelled, failed): whatever the
        worker still holds of its requests is freed with the next take (no call of its own: this
        runs in a done callback, also while the run stops)."""
        if not self.on_gpu:
            self.ended.append(group)

    @property
    def engine_options(self) -> dict:
        return {"enable_return_routed_experts": True} if self.on_gpu else {}

    def request_options(self, start: int = 0) -> dict:
        """SamplingParams options of a request whose first `start` positions' routes are already
        held."""
        return {"routed_experts_prompt_start": start} if self.on_gpu and start else {}

    async def start(self, engine) -> None:
        config = engine.model_config
        self.layers, self.top_k = (
            config.get_total_num_hidden_layers(),
            config.get_num_experts_per_tok(),
        )
        self.dtype = route_dtype(config.get_num_experts())
        if not self.on_gpu:
            self.layers, self.top_k, _ = (
                await engine.collective_rpc("start_routes", args=("group-",))
            )[0]

    async def take(self, engine, request_id: str, completions, start: int = 0) -> list[np.ndarray]:
        """Each completion's routes from position `start` on, in the order of `completions` (vLLM's
        CompletionOutputs of the finished request `request_id`)."""
        if self.on_gpu:
            return [
                np.asarray(
                    c.routed_experts
                    if c.routed_experts is not None
                    else missing_rows(0, self.layers, self.top_k, self.dtype),
                    dtype=self.dtype,
                )
                for c in completions
            ]
        ended, self.ended = self.ended, []
        taken = {
            index: np.frombuffer(data, dtype=self.dtype).reshape(-1, self.layers, self.top_k)
            for index, data in (
                await engine.collective_rpc("take_routes", args=(request_id, start, ended))
            )[0]
        }
        return [
            taken.get(c.index, missing_rows(0, self.layers, self.top_k, self.dtype))
            for c in completions
        ]

    async def sequences(
        self, engine, request_id: str, completions, lengths: list[int]
    ) -> list[np.ndarray]:
        """Each completion's routes from position 0, `lengths` positions each (prompt +
        completion)."""
        taken = await self.take(engine, request_id, completions)
        return [fitted(r, n, self.layers, self.top_k, self.dtype) for r, n in zip(taken, lengths)]

    async def turn(
        self, engine, request_id: str, completion, known: np.ndarray | None, start: int
    ) -> np.ndarray:
        """An episode's routes after the turn `request_id` (asked with request_options(start)),
        merged into the `known` ones (first record wins)."""
        return merged(known, (await self.take(engine, request_id, [completion], start))[0], start)
