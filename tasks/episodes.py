"""envs.py — multi-turn environments: `--env FILE.py:NAME`, an episode as a chain of engine requests, the env task.

Role
    `load_env`/`check` (config.validate: one line per problem), `run_episode` (reset -> model turn -> step -> ...
    -> close, with --max-turns, --max-episode-tokens, --env-timeout-s and the fault rules), `run_env_group` /
    `eval_env_prompt` (what rollout.Generator calls for an env task), `EnvTask` (rows, held-out rows, scoring);
    `episode_stats` (a group's counters; metrics.episode_metrics sums them into the env/... keys). Observations
    become token ids through chat.Renderer: the model's tokens are never re-tokenized.
Data contract
    An env is one instance per episode of a class or zero-argument factory with `reset(**row) -> str |
    list[message] | None` (what it returns follows the prompt), `step(action: str) -> (observation, reward,
    done)`, optionally `close()` and `get_reward()` (then the episode's reward; else the sum of the step
    rewards) and `tools` (JSON schemas the chat template renders; tools.py sets it). `async def` methods are
    awaited on the generator's loop, plain ones run in worker threads. A raise, a timeout or a malformed value
    ends the episode: its reward does not apply (rewards.py's None), counted with the error's first line.
    An episode is one token sequence: prompt ids + model turn ids (as sampled: log-prob, version) +
    observation ids (version -1, log-prob 0, never trained) + ...; each turn is a new engine request whose
    prompt is the whole sequence so far. A group's shared prompt is its episodes' common prefix. Recorded
    routes (routes.py) cover the whole sequence: each turn adds what its request computed first.
May touch: the env instances it makes, the generator's engine through `Generator` (requests only).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import data
import rewards
import tools as tools_lib
import tracing
from chat import Renderer, as_messages  # noqa: F401  (Renderer: envs.Renderer, as before)
from buffer import RolloutGroup, tag_versions
from routes import fitted, known_prefix
from data import DataError, Prompt, is_conversation

SEED_ROWS, HELD_OUT_SEED_ROWS = 10_000, 1_000  # an --env without --dataset: rows {"seed": i}
HELD_OUT_SEED_START = 1_000_000


# ----------------------------------------------------------------------------------------------------
# Loading and checking --env
# ----------------------------------------------------------------------------------------------------
def load_env(spec: str):
    """`path/file.py:NAME` or `module:NAME` -> the class or factory. Raises DataError."""
    factory = rewards.load_object(spec, "--env", "Class")
    if not callable(factory):
        raise DataError(f"--env {spec}: {spec.rpartition(':')[2]} is neither a class nor a factory function")
    return factory


def check(cfg) -> list[str]:
    """config.validate(): what keeps --env from running, in one line. A factory function is called once
    here (and its instance closed) to see what it makes."""
    if not getattr(cfg, "env", ""):
        return []
    try:
        factory = load_env(cfg.env)
        target = factory if inspect.isclass(factory) else factory()
    except DataError as e:
        return [str(e)]
    except Exception as e:
        return [f"--env {cfg.env}: calling the factory failed ({type(e).__name__}: {first_line(e)})"]
    name = getattr(target, "__name__", type(target).__name__)
    problems = []
    if not callable(getattr(target, "reset", None)):
        problems.append(f"--env {cfg.env}: {name} has no reset(**row) method")
    elif not callable(getattr(target, "step", None)):
        if not [n for n in dir(target) if not n.startswith("_") and n not in tools_lib.RESERVED_METHODS
                and callable(getattr(target, n, None))]:  # TRL's environment_factory: its public methods are tools
            problems.append(f"--env {cfg.env}: {name} has neither step(action) nor public methods (tools)")
    elif getattr(cfg, "tools", ""):
        problems.append(f"--env {cfg.env}: {name} has step(action), so it answers the model's turns itself; "
                        "--tools goes with a dataset task or a TRL environment class (no step: its methods are tools)")
    if not inspect.isclass(target) and callable(getattr(target, "close", None)):
        try:
            target.close()
        except Exception:
            pass
    return problems


def runs_tools(cfg) -> bool:
    """Whether the run's episodes call tools: --tools, or an --env whose instances have no step (TRL's classes)."""
    if getattr(cfg, "tools", ""):
        return True
    if not getattr(cfg, "env", ""):
        return False
    factory = load_env(cfg.env)
    target = factory if inspect.isclass(factory) else factory()
    return not callable(getattr(target, "step", None))


def episode_factory(cfg, parser=lambda: None):
    """What makes one episode's env: --env's class or factory (instances without `step`, TRL's, wrapped by
    tools.TrlEnvironment with any --tools functions); --tools alone: a tools.ToolEnv. `parser()`: the
    tools.ToolCallParser their tool calls are read with (made on first use)."""
    functions = tuple(tools_lib.load_functions(cfg.tools)) if getattr(cfg, "tools", "") else ()
    if not getattr(cfg, "env", ""):
        return lambda: tools_lib.ToolEnv(functions, parser())
    return functools.partial(make_env, load_env(cfg.env), functions, parser)


def make_env(factory, functions=(), parser=lambda: None):
    """One instance of `factory`, as an env of the contract (reset/step)."""
    instance = factory()
    if callable(getattr(instance, "step", None)):
        return instance
    return tools_lib.TrlEnvironment(lambda: instance, functions, parser())


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# ----------------------------------------------------------------------------------------------------
# One episode (token in, token out: chat.Renderer renders and tokenizes what is new; sampled ids stay as they are)
# ----------------------------------------------------------------------------------------------------
class EnvFault(Exception):
    """An env call that raised, timed out or returned a malformed value: its episode ends."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class Episode:
    ids: list[int] = field(default_factory=list)  # the whole sequence: initial context, turns, observations
    start: int = 0  # len of the initial context (prompt + reset's output)
    model_mask: list[bool] = field(default_factory=list)  # per token after `start`
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    reward: float | None = None  # None: does not apply (a fault)
    turns: int = 0
    truncated: str = ""  # "" | "max_turns" | "max_episode_tokens"
    error: str = ""  # the fault's first line
    timed_out: bool = False
    env_s: list[float] = field(default_factory=list)  # each reset/step/get_reward/close call
    transcript: list = field(default_factory=list)  # model turns and observations (text or messages)
    chat: bool = False
    routes: object = None  # numpy (positions so far, layers, top_k) when routes are recorded (routes.py)

    def append(self, ids, logprobs=None, versions=None):
        model = logprobs is not None
        self.ids += ids
        self.model_mask += [model] * len(ids)
        self.logprobs += logprobs if model else [0.0] * len(ids)
        self.versions += versions if model else [-1] * len(ids)


async def call_env(ep: Episode, what: str, method, args, threads, timeout_s: float, kwargs=None):
    """`method(*args, **kwargs)`: awaited on this loop when it is async, else run in a worker thread; at
    most `timeout_s` seconds (a thread that hangs keeps its worker: --env-workers). Raises EnvFault."""
    t0 = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(method):
            result = await asyncio.wait_for(method(*args, **(kwargs or {})), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                threads, functools.partial(method, *args, **(kwargs or {}))), timeout_s)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
        return result
    except asyncio.TimeoutError:
        raise EnvFault(f"{what} timed out after {timeout_s:g} s (--env-timeout-s)", timed_out=True) from None
    except Exception as e:
        raise EnvFault(f"{what} raised {type(e).__name__}: {first_line(e)}") from None
    finally:
        ep.env_s.append(time.perf_counter() - t0)
        tracing.complete(f"env.{what}", t0, track=tracing.LANE, cat="env")


def checked_observation(value, what: str, allow_none: bool):
    if value is None and allow_none:
        return None
    if isinstance(value, str) or (is_conversation(value) and value and all(
            m["role"] in ("user", "tool", "system") and isinstance(m["content"], str) for m in value)):
        return value
    raise EnvFault(f"{what} returned a malformed observation ({type(value).__name__}: expected text or a list of "
                   "{'role': 'user'|'tool', 'content': str} messages)")


def checked_step(value):
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        size = "" if not hasattr(value, "__len__") else f" of {len(value)}"
        raise EnvFault(f"step returned {type(value).__name__}{size}, expected (observation, reward, done)")
    observation, reward, done = value
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvFault(f"step returned a malformed reward {reward!r} (expected a finite float)")
    if type(done).__name__ not in ("bool", "bool_"):
        raise EnvFault(f"step returned a malformed done {done!r} (expected a bool)")
    return checked_observation(observation, "step", bool(done)), float(reward), bool(done)


@dataclass
class Turns:
    """What one episode may do: sampling settings (a vLLM SamplingParams per turn), limits, a request id."""
    sampling: dict
    request_id: str
    seed: int | None = None


async def run_episode(gen, env, prompt, turns: Turns) -> Episode:
    """One episode on `gen`'s engine: never raises for a faulty env (the fault ends it, recorded)."""
    cfg, task = gen.cfg, gen.task
    ep, cancelled = Episode(), False
    budget = min(cfg.max_episode_tokens or 10**9, gen.max_model_len or 10**9)
    tools = getattr(env, "tools", None)
    parser = getattr(env, "parser", None)
    # tool calls are parsed from the text with its special tokens (Llama's <|python_tag|>, Mistral's [TOOL_CALLS])
    special = {"skip_special_tokens": False} if isinstance(env, tools_lib.ToolEnv) else {}
    threads, timeout_s = task.env_threads, cfg.env_timeout_s
    routes = gen.routes if turns.request_id.startswith("group-") else None  # (recorded for training only)
    try:
        reset_out = checked_observation(await call_env(ep, "reset", env.reset, (), threads, timeout_s, prompt.row),
                                        "reset", True)
        try:
            ep.ids, ep.chat = task.renderer.initial(prompt.prompt, reset_out, tools)
        except Exception as e:
            raise EnvFault(f"the initial context could not be rendered ({type(e).__name__}: {first_line(e)})")
        ep.start = len(ep.ids)
        if not ep.ids or ep.start >= budget:
            raise EnvFault(f"the initial context has {ep.start} tokens: no room for a turn within "
                           f"{budget} (--max-episode-tokens, or the model's context)")
        while True:
            max_tokens = min(cfg.max_new_tokens, budget - len(ep.ids))
            seed = None if turns.seed is None else turns.seed + 7919 * ep.turns
            known = known_prefix(ep.routes) if routes else 0  # (positions whose routes it holds)
            request_id = f"{turns.request_id}-t{ep.turns}"
            out = await model_turn(gen, ep.ids, gen.request_params(
                max_tokens=max_tokens, seed=seed, **turns.sampling, **special,
                **(routes.request_options(known) if routes else {})), request_id)
            if routes:
                ep.routes = await routes.turn(gen.engine, request_id, out, ep.routes, known)
            ids = list(out.token_ids)
            ep.append(ids, [out.logprobs[i][t].logprob for i, t in enumerate(ids)] if out.logprobs is not None
                      else [0.0] * len(ids), tag_versions(out.weight_versions, len(ids)))
            ep.turns += 1
            text = out.text or ""  # (the history reward functions see: a tool call as tool_calls, as TRL's)
            ep.transcript.append(text if not ep.chat else tools_lib.assistant_message(text, parser) if tools
                                 else {"role": "assistant", "content": text})
            if out.finish_reason == "length" and max_tokens < cfg.max_new_tokens:
                ep.truncated = "max_episode_tokens"  # the budget cut the turn: no step on half an action
                break
            observation, reward, done = checked_step(await call_env(ep, "step", env.step, (out.text or "",),
                                                                     threads, timeout_s))
            ep.step_rewards.append(reward)
            if done:
                break
            if ep.turns >= cfg.max_turns:
                ep.truncated = "max_turns"
                break
            try:
                new = task.renderer.observation(observation, ep.chat, ids[-1] if ids else None, tools)
            except Exception as e:
                raise EnvFault(f"the observation could not be rendered ({type(e).__name__}: {first_line(e)})")
            if len(ep.ids) + len(new) >= budget:  # no room for the observation and a turn after it
                ep.truncated = "max_episode_tokens"
                break
            ep.append(new)
            ep.transcript += [observation] if not ep.chat else as_messages(observation)
        if callable(getattr(env, "get_reward", None)):
            value = await call_env(ep, "get_reward", env.get_reward, (), threads, timeout_s)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise EnvFault(f"get_reward returned a malformed value {value!r} (expected a finite float)")
            ep.reward = float(value)
        else:
            ep.reward = float(sum(ep.step_rewards))
    except EnvFault as fault:
        ep.error, ep.timed_out, ep.reward = str(fault), fault.timed_out, None
    except asyncio.CancelledError:  # the run stops: no close() to wait for
        cancelled = True
        raise
    finally:
        if callable(getattr(env, "close", None)) and not cancelled:
            try:
                await call_env(ep, "close", env.close, (), threads, timeout_s)
            except EnvFault as fault:
                ep.error = ep.error or str(fault)
    return ep


async def model_turn(gen, ids: list[int], params, request_id: str):
    """One engine request: the whole sequence so far as its prompt."""
    final = None
    gen._count_generating(+1)
    try:
        async for out in gen.generate(ids, params, request_id):
            final = out
    finally:
        gen._count_generating(-1)
    return final.outputs[0]


async def run_episodes(gen, prompt, sampling: dict, request_id: str, count: int, seed: int | None):
    """`count` episodes of one prompt at once, each its own env and request chain; ([Episode], [env])."""
    envs_ = []
    for _ in range(count):
        try:
            envs_.append(gen.task.factory())
        except Exception as e:  # the factory itself failed: that episode ends before it starts
            envs_.append(FailedEnv(f"creating the env raised {type(e).__name__}: {first_line(e)}"))
    episodes = await asyncio.gather(*(tracing.on_lane(
        run_episode(gen, env, prompt, Turns(sampling, f"{request_id}-{j}", None if seed is None else seed + 31 * j)),
        "episode", id=f"{request_id}-{j}") for j, env in enumerate(envs_)))
    gen.task.report_faults(episodes)
    return list(episodes), envs_


class FailedEnv:
    """Stands in for an env whose creation failed: its reset raises that failure."""

    def __init__(self, message: str):
        self.message = message

    def reset(self, **row):
        raise RuntimeError(self.message)

    def step(self, action):
        raise RuntimeError(self.message)


def group_of(prompt, episodes: list[Episode]) -> tuple[list[int], list]:
    """(the shared prompt ids: the episodes' common prefix, per episode (ids, mask, logprobs, versions)
    after it). An episode that never started has an empty completion."""
    started = [ep.ids[:ep.start] for ep in episodes if ep.start]
    if not started:
        return (prompt.prompt_ids or [0]), [([], [], [], []) for _ in episodes]
    shared = min(started, key=len)
    for ids in started:
        n = next((i for i, (a, b) in enumerate(zip(shared, ids)) if a != b), min(len(shared), len(ids)))
        shared = shared[:n]
    if not shared:
        raise RuntimeError("the episodes of one group share no first token (their reset() outputs differ from "
                           "the start): give the prompt a common start, such as a BOS token")
    shared_len = len(shared)
    parts = []
    for ep in episodes:
        if not ep.start:
            parts.append(([], [], [], []))
            continue
        lead = ep.start - shared_len  # the per-episode rest of the initial context: env tokens
        parts.append((ep.ids[shared_len:], [False] * lead + ep.model_mask, [0.0] * lead + ep.logprobs,
                      [-1] * lead + ep.versions))
    return shared, parts


TOOL_COUNTERS = ("tool_calls", "tool_call_parse_failures", "tool_errors")  # tools.ToolEnv's


def episode_stats(episodes: list[Episode], envs_=()) -> dict:
    """A group's episode counters (RolloutGroup.episode_stats; summed over a step by `episode_metrics`),
    with the tool counters of envs that keep them."""
    truncated = {}
    for ep in episodes:
        if ep.truncated:
            truncated[ep.truncated] = truncated.get(ep.truncated, 0) + 1
    counted = [env for env in envs_ if hasattr(env, TOOL_COUNTERS[0])]
    tool_stats = {name: sum(getattr(env, name) for env in counted) for name in TOOL_COUNTERS} if counted else {}
    return {**tool_stats, "turns": [ep.turns for ep in episodes], "env_s": [t for ep in episodes for t in ep.env_s],
            "errors": sum(bool(ep.error) and not ep.timed_out for ep in episodes),
            "timeouts": sum(ep.timed_out for ep in episodes),
            "error_lines": list(dict.fromkeys(ep.error for ep in episodes if ep.error))[:3],
            "env_tokens": sum(ep.model_mask.count(False) + ep.start for ep in episodes),
            "episode_tokens": sum(len(ep.ids) for ep in episodes), "truncated": truncated}


async def run_env_group(gen, group_id: int, prompt, epoch: int) -> RolloutGroup:
    """rollout.Generator.run_group for an env task: G episodes, scored once each, as one RolloutGroup."""
    cfg = gen.cfg
    sampling = dict(n=1, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, logprobs=0)
    reproducible = cfg.max_lag == 0 or cfg.update_mode == "drain"
    seed = cfg.seed * 1_000_003 + group_id * 1009 if reproducible else None
    episodes, envs_ = await run_episodes(gen, prompt, sampling, f"group-{group_id}", cfg.group_size, seed)
    scores, reward_stats, unscored = await asyncio.get_running_loop().run_in_executor(
        gen.reward_threads, gen.task.score_episodes, prompt, episodes, envs_, gen.loaded_version)
    shared, parts = group_of(prompt, episodes)
    routes = None if gen.routes is None else [  # each sample's sequence: the shared prompt + its part
        fitted(ep.routes, len(shared) + len(p[0]), gen.routes.layers, gen.routes.top_k, gen.routes.dtype)
        for ep, p in zip(episodes, parts)]
    return RolloutGroup(group_id, shared, [p[0] for p in parts], [p[2] for p in parts], [p[3] for p in parts],
                        scores, prompt.answer, reward_stats=reward_stats, unscored=unscored, epoch=epoch, routes=routes,
                        finish_reasons=["length" if ep.truncated else "stop" for ep in episodes],
                        model_masks=[p[1] for p in parts], episode_stats=episode_stats(episodes, envs_))


async def eval_env_prompt(gen, step: int, i: int, prompt, version: int):
    """A held-out prompt's episodes: one greedy, then --eval-samples sampled; (rewards, tokens, mean turns)."""
    cfg = gen.cfg
    runs = [run_episodes(gen, prompt, dict(n=1, temperature=0.0), f"eval-{step}-{i}-greedy", 1, None)]
    if cfg.eval_samples:
        runs.append(run_episodes(gen, prompt, dict(n=1, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p),
                                 f"eval-{step}-{i}-sampled", cfg.eval_samples, None))
    results = await asyncio.gather(*runs)
    episodes = [ep for eps, _ in results for ep in eps]
    envs_ = [env for _, es in results for env in es]
    if any(v != version for ep in episodes for v in ep.versions if v >= 0):
        raise RuntimeError(f"evaluation of version {version} sampled tokens under other weights")
    scores, _, _ = await asyncio.get_running_loop().run_in_executor(
        gen.reward_threads, gen.task.score_episodes, prompt, episodes, envs_, version)
    return list(scores), sum(ep.model_mask.count(True) for ep in episodes), \
        sum(ep.turns for ep in episodes) / len(episodes)


# ----------------------------------------------------------------------------------------------------
# The task the generator sees
# ----------------------------------------------------------------------------------------------------
class EnvTask:
    """Episodes of an env over rows: a dataset's (`--dataset`: data.dataset_rows, not column-checked), the
    built-in task's, or, with neither, rows {"seed": i} (held-out seeds from 1,000,000); `rows` is (training
    rows, held-out rows in data.held_out_order). Scored once per episode: the env's reward ("env", weight 1),
    plus the --reward functions on its transcript with the instances as `environments=` (TRL's convention;
    not with --reward-workers, whose processes cannot hold them)."""

    is_env = True
    needs_text = True  # step() gets the text of the model's turn

    def __init__(self, cfg, tokenizer, factory=None, rows=None):
        spec = data.spec_of(cfg)
        self.tool_parser = None
        self.factory = factory or episode_factory(cfg, functools.partial(self.parser, cfg.tool_parser, tokenizer))
        self.names = ["env"] + (rewards.reward_names(spec.rewards) if spec else [])
        self.scorer = rewards.Scorer(spec.rewards if spec else (), spec.weights if spec else (),
                                     workers=spec.reward_workers if spec else 0)
        self.renderer = Renderer(tokenizer, cfg.system_prompt)
        self.env_threads = ThreadPoolExecutor(max(1, cfg.env_workers), thread_name_prefix="env")
        self.reported: set = set()
        self.dropped_long = 0
        if rows is None:
            rows = self.rows_of(spec, cfg)
        train_rows, held_rows = rows
        column, answer = (spec.prompt_column, spec.answer_column) if spec else ("prompt", "answer")
        self.prompts = [self.prompt_of(row, column, answer) for row in train_rows]
        self.held_out = [self.prompt_of(row, column, answer) for row in held_rows]
        if not self.prompts:
            raise RuntimeError("the env task has no training rows")

    def parser(self, name: str, tokenizer):
        """vLLM's tool parser for this run's episodes (--tool-parser, else the one the chat template's format
        names), made once, on the first episode that has tools (prepare checked it before the run)."""
        if self.tool_parser is None:
            self.tool_parser = tools_lib.ToolCallParser(tools_lib.parser_name(name, tokenizer.chat_template),
                                                        tokenizer)
        return self.tool_parser

    @staticmethod
    def rows_of(spec, cfg):
        if spec is None or not spec.dataset:
            return ([{"seed": i} for i in range(SEED_ROWS)],
                    [{"seed": HELD_OUT_SEED_START + i} for i in data.held_out_order(HELD_OUT_SEED_ROWS)])
        return data.dataset_rows(spec, check=False)

    @staticmethod
    def prompt_of(row: dict, column: str, answer: str):
        columns = {k: v for k, v in row.items() if k != column}
        if "answer" not in columns and answer in row:
            columns["answer"] = row[answer]
        return Prompt([], str(row.get(answer, "")), columns, row.get(column), row=dict(row))

    def report_faults(self, episodes) -> None:
        """Each distinct env fault once on the terminal (all of them are counted in env/errors, env/timeouts)."""
        for ep in episodes:
            if ep.error and ep.error not in self.reported and len(self.reported) < 20:
                self.reported.add(ep.error)
                print(f"[env] {ep.error}\n[env] (that episode ended; its reward does not apply; counted in "
                      "env/errors or env/timeouts, each message reported once)", file=sys.stderr, flush=True)

    def score_episodes(self, prompt, episodes: list[Episode], envs_, step: int = 0):
        """(rewards, {name: stats}, unscored indices) of one prompt's episodes (rewards.py's fault rules)."""
        chat = any(ep.chat for ep in episodes)
        texts = ["".join(t for t in ep.transcript if isinstance(t, str)) if not ep.chat else
                 (ep.transcript[-1]["content"] if ep.transcript else "") for ep in episodes]
        # reward functions get the user's own instances (TRL passes its instances), not our wrappers
        extra = {"environments": [env.env if isinstance(env, tools_lib.TrlEnvironment) else env for env in envs_]}
        if chat:
            extra["completions"] = [ep.transcript for ep in episodes]
        return self.scorer.score(prompt.prompt if prompt.prompt is not None else "", texts,
                                 [[t for t, m in zip(ep.ids[ep.start:], ep.model_mask) if m] for ep in episodes],
                                 prompt.columns, step, first=(("env", 1.0, [ep.reward for ep in episodes]),),
                                 extra=extra)

    def close(self):
        self.scorer.close()
        self.env_threads.shutdown(wait=False, cancel_futures=True)
