"""tasks/episodes.py — multi-turn episodes: a chain of engine requests, token in / token out.

Role
    `run_episode` (reset -> model turn -> step -> ... -> close, with --max-turns,
    --max-episode-tokens, --env-timeout-s and the fault rules), `run_episodes` (one prompt's
    episodes at once, each its own env and request chain). Observations become token ids through
    chat.Renderer: the model's tokens are never re-tokenized. Which env, the groups of episodes,
    the env task and its scoring: tasks/envs.py; the env's contract: tasks/protocols.Env.
Data contract
    An env's `async def` methods are awaited on the generator's loop, plain ones run in worker
    threads. A raise, a timeout or a malformed value ends the episode: its reward does not apply
    (tasks/rewards.py's None), counted with the error's first line.
    An episode is one token sequence: prompt ids + model turn ids (as sampled: log-prob, version)
    + observation ids (version -1, log-prob 0, never trained) + ...; each turn is a new engine
    request whose prompt is the whole sequence so far. Recorded routes (routes.py) cover the whole
    sequence: each turn adds what its request computed first.
May touch: the env instances it is given; the generator only through tasks/protocols.Sampler
(requests).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import time
from dataclasses import dataclass, field

from buffer import tag_versions
from generator.routes import known_prefix
from infra import tracing
from tasks.chat import as_messages
from tasks.datasets import is_conversation
from tasks.protocols import Env, Sampler
from tasks.tool_calls import assistant_message
from tasks.tools import ToolEnv


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# --------------------------------------------------------------------------------------------------
# One episode, token in and token out: chat.Renderer renders and tokenizes what is new, and the
# sampled ids stay as they are.
# --------------------------------------------------------------------------------------------------
class EnvFault(Exception):
    """An env call that raised, timed out or returned a malformed value: its episode ends."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class Episode:
    # the whole sequence: initial context, turns, observations
    ids: list[int] = field(default_factory=list)
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
    # model turns and observations (text or messages)
    transcript: list = field(default_factory=list)
    chat: bool = False
    # numpy (positions so far, layers, top_k) when routes are recorded (routes.py)
    routes: object = None

    def append(self, ids, logprobs=None, versions=None):
        model = logprobs is not None
        self.ids += ids
        self.model_mask += [model] * len(ids)
        self.logprobs += logprobs if model else [0.0] * len(ids)
        self.versions += versions if model else [-1] * len(ids)


async def call_env(ep: Episode, what: str, method, args, threads, timeout_s: float, kwargs=None):
    """`method(*args, **kwargs)`: awaited on this loop when it is async, else run in a worker
    thread; at most `timeout_s` seconds (a thread that hangs keeps its worker: --env-workers).
    Raises EnvFault."""
    t0 = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(method):
            result = await asyncio.wait_for(method(*args, **(kwargs or {})), timeout_s)
        else:
            result = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(
                    threads, functools.partial(method, *args, **(kwargs or {}))
                ),
                timeout_s,
            )
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
        return result
    except asyncio.TimeoutError:
        raise EnvFault(
            f"{what} timed out after {timeout_s:g} s (--env-timeout-s)", timed_out=True
        ) from None
    except Exception as e:
        raise EnvFault(f"{what} raised {type(e).__name__}: {first_line(e)}") from None
    finally:
        ep.env_s.append(time.perf_counter() - t0)
        tracing.complete(f"env.{what}", t0, track=tracing.LANE, cat="env")


def checked_observation(value, what: str, allow_none: bool):
    if value is None and allow_none:
        return None
    if isinstance(value, str) or (
        is_conversation(value)
        and value
        and all(
            m["role"] in ("user", "tool", "system") and isinstance(m["content"], str) for m in value
        )
    ):
        return value
    raise EnvFault(
        f"{what} returned a malformed observation ({type(value).__name__}: expected text or a list "
        "of {'role': 'user'|'tool', 'content': str} messages)"
    )


def checked_step(value):
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        size = "" if not hasattr(value, "__len__") else f" of {len(value)}"
        raise EnvFault(
            f"step returned {type(value).__name__}{size}, expected (observation, reward, done)"
        )
    observation, reward, done = value
    if (
        isinstance(reward, bool)
        or not isinstance(reward, numbers.Real)
        or not math.isfinite(float(reward))
    ):
        raise EnvFault(f"step returned a malformed reward {reward!r} (expected a finite float)")
    if type(done).__name__ not in ("bool", "bool_"):
        raise EnvFault(f"step returned a malformed done {done!r} (expected a bool)")
    return checked_observation(observation, "step", bool(done)), float(reward), bool(done)


@dataclass
class Turns:
    """What one episode may do: sampling settings (a vLLM SamplingParams per turn), limits, a
    request id."""

    sampling: dict
    request_id: str
    seed: int | None = None


@dataclass
class EpisodeRun:
    """What every step of one episode needs: the engine, the env, the turn settings and the limits
    that hold for the whole episode."""

    gen: Sampler
    env: Env
    turns: Turns
    budget: int  # tokens in the whole sequence: --max-episode-tokens, or the model's context
    tools: object  # the env's tools, when it has them
    parser: object  # the env's tool-call parser, when it has one
    special: dict  # the detokenizer's settings for a model turn
    routes: object  # the generator's route recorder, for training episodes only
    threads: object  # the task's worker threads for an env's plain methods
    timeout_s: float  # --env-timeout-s

    async def call(self, ep: Episode, what: str, method, args=(), kwargs=None):
        """`call_env` with the task's worker threads and --env-timeout-s."""
        return await call_env(ep, what, method, args, self.threads, self.timeout_s, kwargs=kwargs)


def episode_run(gen: Sampler, env: Env, turns: Turns) -> EpisodeRun:
    cfg = gen.cfg
    return EpisodeRun(
        gen=gen,
        env=env,
        turns=turns,
        budget=min(cfg.max_episode_tokens or 10**9, gen.max_model_len or 10**9),
        tools=getattr(env, "tools", None),
        parser=getattr(env, "parser", None),
        # Tool calls are parsed from the text with its special tokens (Llama's <|python_tag|>,
        # Mistral's [TOOL_CALLS]).
        special={"skip_special_tokens": False} if isinstance(env, ToolEnv) else {},
        # Routes are recorded for training only.
        routes=gen.routes if turns.request_id.startswith("group-") else None,
        threads=gen.task.env_threads,
        timeout_s=cfg.env_timeout_s,
    )


async def run_episode(gen: Sampler, env: Env, prompt, turns: Turns) -> Episode:
    """One episode on `gen`'s engine: never raises for a faulty env (the fault ends it,
    recorded)."""
    run = episode_run(gen, env, turns)
    ep, cancelled = Episode(), False
    try:
        await start_episode(run, ep, prompt)
        while await turn_and_step(run, ep):
            pass
        ep.reward = await final_reward(run, ep)
    except EnvFault as fault:
        ep.error, ep.timed_out, ep.reward = str(fault), fault.timed_out, None
    except asyncio.CancelledError:  # the run stops: no close() to wait for
        cancelled = True
        raise
    finally:
        if callable(getattr(env, "close", None)) and not cancelled:
            try:
                await run.call(ep, "close", env.close)
            except EnvFault as fault:
                ep.error = ep.error or str(fault)
    return ep


async def start_episode(run: EpisodeRun, ep: Episode, prompt):
    """The env's reset and the initial context: the prompt and what reset returned, rendered."""
    reset_out = checked_observation(
        await run.call(ep, "reset", run.env.reset, kwargs=prompt.row), "reset", True
    )
    try:
        ep.ids, ep.chat = run.gen.task.renderer.initial(prompt.prompt, reset_out, run.tools)
    except Exception as e:
        raise EnvFault(
            f"the initial context could not be rendered ({type(e).__name__}: {first_line(e)})"
        )
    ep.start = len(ep.ids)
    if not ep.ids or ep.start >= run.budget:
        raise EnvFault(
            f"the initial context has {ep.start} tokens: no room for a turn within "
            f"{run.budget} (--max-episode-tokens, or the model's context)"
        )


async def turn_and_step(run: EpisodeRun, ep: Episode) -> bool:
    """One model turn, the env's step on it and its observation appended; False when the episode
    ends here (done, or a limit reached)."""
    cfg = run.gen.cfg
    max_tokens = min(cfg.max_new_tokens, run.budget - len(ep.ids))
    out = await sample_turn(run, ep, max_tokens)
    if out.finish_reason == "length" and max_tokens < cfg.max_new_tokens:
        # The budget cut the turn: no step on half an action.
        ep.truncated = "max_episode_tokens"
        return False
    observation, reward, done = checked_step(
        await run.call(ep, "step", run.env.step, (out.text or "",))
    )
    ep.step_rewards.append(reward)
    if done:
        return False
    if ep.turns >= cfg.max_turns:
        ep.truncated = "max_turns"
        return False
    ids = list(out.token_ids)
    try:
        new = run.gen.task.renderer.observation(
            observation, ep.chat, ids[-1] if ids else None, run.tools
        )
    except Exception as e:
        raise EnvFault(
            f"the observation could not be rendered ({type(e).__name__}: {first_line(e)})"
        )
    if len(ep.ids) + len(new) >= run.budget:  # no room for the observation and a turn after it
        ep.truncated = "max_episode_tokens"
        return False
    ep.append(new)
    ep.transcript += [observation] if not ep.chat else as_messages(observation)
    return True


async def sample_turn(run: EpisodeRun, ep: Episode, max_tokens: int):
    """One model turn of at most `max_tokens`, appended to the episode as sampled (ids, log-probs,
    versions; its routes when they are recorded); the engine's output."""
    gen, turns, routes = run.gen, run.turns, run.routes
    seed = None if turns.seed is None else turns.seed + 7919 * ep.turns
    known = known_prefix(ep.routes) if routes else 0  # (positions whose routes it holds)
    request_id = f"{turns.request_id}-t{ep.turns}"
    params = gen.request_params(
        max_tokens=max_tokens,
        seed=seed,
        **turns.sampling,
        **run.special,
        **(routes.request_options(known) if routes else {}),
    )
    out = await model_turn(gen, ep.ids, params, request_id)
    if routes:
        ep.routes = await routes.turn(gen.engine, request_id, out, ep.routes, known)
    ids = list(out.token_ids)
    ep.append(
        ids,
        [out.logprobs[i][t].logprob for i, t in enumerate(ids)]
        if out.logprobs is not None
        else [0.0] * len(ids),
        tag_versions(out.weight_versions, len(ids)),
    )
    ep.turns += 1
    # The transcript is the history reward functions see: a tool call as tool_calls, as TRL's.
    text = out.text or ""
    ep.transcript.append(
        text
        if not ep.chat
        else assistant_message(text, run.parser, run.tools)
        if run.tools
        else {"role": "assistant", "content": text}
    )
    return out


async def final_reward(run: EpisodeRun, ep: Episode) -> float:
    """The env's get_reward when it has one, else the sum of its step rewards."""
    if not callable(getattr(run.env, "get_reward", None)):
        return float(sum(ep.step_rewards))
    value = await run.call(ep, "get_reward", run.env.get_reward)
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
    ):
        raise EnvFault(f"get_reward returned a malformed value {value!r} (expected a finite float)")
    return float(value)


async def model_turn(gen: Sampler, ids: list[int], params, request_id: str):
    """One engine request: the whole sequence so far as its prompt."""
    final = None
    with gen.generating_request():
        async for out in gen.generate(ids, params, request_id):
            final = out
    return final.outputs[0]


async def run_episodes(
    gen: Sampler, prompt, sampling: dict, request_id: str, count: int, seed: int | None
):
    """`count` episodes of one prompt at once, each its own env and request chain; ([Episode],
    [env])."""
    envs_ = []
    for _ in range(count):
        try:
            envs_.append(gen.task.factory())
        except Exception as e:  # the factory itself failed: that episode ends before it starts
            envs_.append(FailedEnv(f"creating the env raised {type(e).__name__}: {first_line(e)}"))
    episodes = await asyncio.gather(
        *(
            tracing.on_lane(
                run_episode(
                    gen,
                    env,
                    prompt,
                    Turns(sampling, f"{request_id}-{j}", None if seed is None else seed + 31 * j),
                ),
                "episode",
                id=f"{request_id}-{j}",
            )
            for j, env in enumerate(envs_)
        )
    )
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
