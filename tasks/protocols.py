"""tasks/protocols.py — the seams of an episode: the env it plays, the generator it samples from.

Role: `Env` is the contract of an --env instance (what tasks/episodes.py calls); `Sampler` is what
an episode needs from the generator, and all it may use of it: the run's settings, the task, the
engine's context length, one sampled turn (`request_params`, `generate`), a request counted while
it generates (`generating_request`), the reward threads, the loaded weights' version and the
routes recorder. rollout.Generator satisfies `Sampler` with public names; tasks/ never imports
rollout.py.
Data contract: types only (typing.Protocol, checked statically); nothing here runs.
May touch: nothing.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any, AsyncIterator, Protocol

from config import Config


class Env(Protocol):
    """One episode's environment (a class, or a zero-argument factory, makes one per episode).
    Optional: `close()`, `get_reward() -> float` (then the episode's reward, else the sum of the
    step rewards) and `tools` (JSON schemas the chat template renders). `async def` methods are
    awaited on the generator's loop; plain ones run in worker threads."""

    def reset(self, **row) -> Any:
        """The row's columns in; text, a list of {"role", "content"} messages, or None (the
        prompt alone)."""

    def step(self, action: str) -> tuple[Any, float, bool]:
        """The model's turn as text in; (observation, reward, done)."""


class Sampler(Protocol):
    """What an episode needs from the generator (rollout.Generator)."""

    cfg: Config
    task: Any  # tasks.envs.EnvTask: factory, renderer, env_threads, score_episodes, report_faults
    max_model_len: int | None  # the engine's context length
    reward_threads: Executor  # where scoring runs, off the generator's event loop
    loaded_version: int  # the version of the weights the engine serves
    routes: Any  # routes.GeneratorRoutes when routes are recorded for training, else None
    engine: Any  # handed to `routes` only (it reads back what the engine recorded)

    def request_params(self, max_tokens: int | None = None, **sampling) -> Any:
        """vLLM's SamplingParams for one request (the run's stop strings, at most
        --max-new-tokens tokens)."""

    def generate(self, ids: list[int], params: Any, request_id: str) -> AsyncIterator:
        """The engine's outputs for one request of token `ids`, under the weights it serves."""

    def generating_request(self) -> AbstractContextManager:
        """Counts one request as generating while inside (the engine is idle while none is)."""
