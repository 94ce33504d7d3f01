"""tasks/envs.py — multi-turn environments: `--env FILE.py:NAME` loaded and checked, the env task.

Role
    `load_env`/`check` (prepare.check: one line per problem), `runs_tools`, `episode_factory`
    (what makes one episode's env: --env's class or factory, TRL's classes wrapped with any
    --tools, or --tools alone); `run_env_group` / `eval_env_prompt` (what rollout.Generator calls
    for an env task: a group's G episodes as one RolloutGroup, a held-out prompt's episodes);
    `episode_stats` (a group's counters; metrics.episode_metrics sums them into the env/... keys);
    `EnvTask` (rows, held-out rows, scoring: the task rollout.Generator holds for --env and
    --task reveal). One episode: tasks/episodes.py.
Data contract
    An env is one instance per episode of a class or zero-argument factory with `reset(**row) ->
    str | list[message] | None` (what it returns follows the prompt), `step(action: str) ->
    (observation, reward, done)`, optionally `close()` and `get_reward()` (then the episode's
    reward; else the sum of the step rewards) and `tools` (JSON schemas the chat template renders;
    tasks/tools.py sets it): tasks/protocols.Env. `--env` names it as `path/file.py:NAME` or
    `module:NAME` (TextArena's games: `tasks.textarena:TextArenaEnv`; the older
    `adapters:TextArenaEnv` still resolves).
    A group's shared prompt is its episodes' common prefix; each sample is the rest of its episode
    (env tokens masked out of training), with its routes when they are recorded.
May touch: the env instances it makes (a factory is called once by `check` to see what it
makes); the generator only through tasks/protocols.Sampler.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from concurrent.futures import ThreadPoolExecutor

from buffer import RolloutGroup
from generator.routes import fitted
from tasks import prompts, rewards
from tasks import tools as tools_lib
from tasks.chat import Renderer, as_messages  # noqa: F401  (Renderer: envs.Renderer, as before)
from tasks.datasets import DataError
from tasks.episodes import Episode, first_line, run_episodes
from tasks.prompts import Prompt
from tasks.protocols import Sampler

SEED_ROWS, HELD_OUT_SEED_ROWS = 10_000, 1_000  # an --env without --dataset: rows {"seed": i}
HELD_OUT_SEED_START = 1_000_000


# --------------------------------------------------------------------------------------------------
# Loading and checking --env
# --------------------------------------------------------------------------------------------------
def load_env(spec: str):
    """`path/file.py:NAME` or `module:NAME` -> the class or factory. Raises DataError."""
    factory = rewards.load_object(spec, "--env", "Class")
    if not callable(factory):
        raise DataError(
            f"--env {spec}: {spec.rpartition(':')[2]} is neither a class nor a factory function"
        )
    return factory


def check(cfg) -> list[str]:
    """prepare.check: what keeps --env from running, in one line. A factory function is called once
    here (and its instance closed) to see what it makes."""
    if not getattr(cfg, "env", ""):
        return []
    try:
        factory = load_env(cfg.env)
        target = factory if inspect.isclass(factory) else factory()
    except DataError as e:
        return [str(e)]
    except Exception as e:
        return [
            f"--env {cfg.env}: calling the factory failed ({type(e).__name__}: {first_line(e)})"
        ]
    name = getattr(target, "__name__", type(target).__name__)
    problems = []
    if not callable(getattr(target, "reset", None)):
        problems.append(f"--env {cfg.env}: {name} has no reset(**row) method")
    elif not callable(getattr(target, "step", None)):
        if not [
            n
            for n in dir(target)
            if not n.startswith("_")
            and n not in tools_lib.RESERVED_METHODS
            # TRL's environment_factory: its public methods are tools
            and callable(getattr(target, n, None))
        ]:
            problems.append(
                f"--env {cfg.env}: {name} has neither step(action) nor public methods (tools)"
            )
    elif getattr(cfg, "tools", ""):
        problems.append(
            f"--env {cfg.env}: {name} has step(action), so it answers the model's turns itself; "
            "--tools goes with a dataset task or a TRL environment class (no step: its methods are "
            "tools)"
        )
    if not inspect.isclass(target) and callable(getattr(target, "close", None)):
        try:
            target.close()
        except Exception:
            pass
    return problems


def runs_tools(cfg) -> bool:
    """Whether the run's episodes call tools: --tools, or an --env whose instances have no step
    (TRL's classes)."""
    if getattr(cfg, "tools", ""):
        return True
    if not getattr(cfg, "env", ""):
        return False
    factory = load_env(cfg.env)
    target = factory if inspect.isclass(factory) else factory()
    return not callable(getattr(target, "step", None))


def episode_factory(cfg, parser=lambda: None):
    """What makes one episode's env: --env's class or factory (instances without `step`, TRL's,
    wrapped by tools.TrlEnvironment with any --tools functions); --tools alone: a tools.ToolEnv.
    `parser()`: the tools.ToolCallParser their tool calls are read with (made on first use)."""
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


# --------------------------------------------------------------------------------------------------
# A group of episodes: what rollout.Generator calls for an env task
# --------------------------------------------------------------------------------------------------
def group_of(prompt, episodes: list[Episode]) -> tuple[list[int], list]:
    """(the shared prompt ids: the episodes' common prefix, per episode (ids, mask, logprobs,
    versions) after it). An episode that never started has an empty completion."""
    started = [ep.ids[: ep.start] for ep in episodes if ep.start]
    if not started:
        return (prompt.prompt_ids or [0]), [([], [], [], []) for _ in episodes]
    shared = min(started, key=len)
    for ids in started:
        n = next(
            (i for i, (a, b) in enumerate(zip(shared, ids)) if a != b), min(len(shared), len(ids))
        )
        shared = shared[:n]
    if not shared:
        raise RuntimeError(
            "the episodes of one group share no first token (their reset() outputs differ from "
            "the start): give the prompt a common start, such as a BOS token"
        )
    shared_len = len(shared)
    parts = []
    for ep in episodes:
        if not ep.start:
            parts.append(([], [], [], []))
            continue
        lead = ep.start - shared_len  # the per-episode rest of the initial context: env tokens
        parts.append(
            (
                ep.ids[shared_len:],
                [False] * lead + ep.model_mask,
                [0.0] * lead + ep.logprobs,
                [-1] * lead + ep.versions,
            )
        )
    return shared, parts


TOOL_COUNTERS = ("tool_calls", "tool_call_parse_failures", "tool_errors")  # tools.ToolEnv's


def episode_stats(episodes: list[Episode], envs_=()) -> dict:
    """A group's episode counters (RolloutGroup.episode_stats; summed over a step by
    `episode_metrics`), with the tool counters of envs that keep them."""
    truncated = {}
    for ep in episodes:
        if ep.truncated:
            truncated[ep.truncated] = truncated.get(ep.truncated, 0) + 1
    counted = [env for env in envs_ if hasattr(env, TOOL_COUNTERS[0])]
    tool_stats = (
        {name: sum(getattr(env, name) for env in counted) for name in TOOL_COUNTERS}
        if counted
        else {}
    )
    return {
        **tool_stats,
        "turns": [ep.turns for ep in episodes],
        "env_s": [t for ep in episodes for t in ep.env_s],
        "errors": sum(bool(ep.error) and not ep.timed_out for ep in episodes),
        "timeouts": sum(ep.timed_out for ep in episodes),
        "error_lines": list(dict.fromkeys(ep.error for ep in episodes if ep.error))[:3],
        "env_tokens": sum(ep.model_mask.count(False) + ep.start for ep in episodes),
        "episode_tokens": sum(len(ep.ids) for ep in episodes),
        "truncated": truncated,
    }


async def run_env_group(gen: Sampler, group_id: int, prompt, epoch: int) -> RolloutGroup:
    """rollout.Generator.run_group for an env task: G episodes, scored once each, as one
    RolloutGroup."""
    cfg = gen.cfg
    sampling = dict(n=1, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, logprobs=0)
    reproducible = cfg.max_lag == 0 or cfg.update_mode == "drain"
    seed = cfg.seed * 1_000_003 + group_id * 1009 if reproducible else None
    episodes, envs_ = await run_episodes(
        gen, prompt, sampling, f"group-{group_id}", cfg.group_size, seed
    )
    scores, reward_stats, unscored = await asyncio.get_running_loop().run_in_executor(
        gen.reward_threads, gen.task.score_episodes, prompt, episodes, envs_, gen.loaded_version
    )
    shared, parts = group_of(prompt, episodes)
    # each sample's sequence: the shared prompt + its part
    routes = (
        None
        if gen.routes is None
        else [
            fitted(
                ep.routes,
                len(shared) + len(p[0]),
                gen.routes.layers,
                gen.routes.top_k,
                gen.routes.dtype,
            )
            for ep, p in zip(episodes, parts)
        ]
    )
    return RolloutGroup(
        group_id=group_id,
        prompt_ids=shared,
        completion_ids=[p[0] for p in parts],
        behaviour_logprobs=[p[2] for p in parts],
        token_versions=[p[3] for p in parts],
        rewards=scores,
        answer=prompt.answer,
        reward_stats=reward_stats,
        unscored=unscored,
        epoch=epoch,
        routes=routes,
        finish_reasons=["length" if ep.truncated else "stop" for ep in episodes],
        model_masks=[p[1] for p in parts],
        episode_stats=episode_stats(episodes, envs_),
    )


async def eval_env_prompt(gen: Sampler, step: int, i: int, prompt, version: int):
    """A held-out prompt's episodes: one greedy, then --eval-samples sampled; (rewards, tokens, mean
    turns)."""
    cfg = gen.cfg
    runs = [
        run_episodes(gen, prompt, dict(n=1, temperature=0.0), f"eval-{step}-{i}-greedy", 1, None)
    ]
    if cfg.eval_samples:
        runs.append(
            run_episodes(
                gen,
                prompt,
                dict(n=1, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p),
                f"eval-{step}-{i}-sampled",
                cfg.eval_samples,
                None,
            )
        )
    results = await asyncio.gather(*runs)
    episodes = [ep for eps, _ in results for ep in eps]
    envs_ = [env for _, es in results for env in es]
    fixed = gen.cfg.eval_weights == "fixed"
    if fixed and any(v != version for ep in episodes for v in ep.versions if v >= 0):
        raise RuntimeError(f"evaluation of version {version} sampled tokens under other weights")
    scores, _, _ = await asyncio.get_running_loop().run_in_executor(
        gen.reward_threads, gen.task.score_episodes, prompt, episodes, envs_, version
    )
    return (
        list(scores),
        sum(ep.model_mask.count(True) for ep in episodes),
        sum(ep.turns for ep in episodes) / len(episodes),
    )


# --------------------------------------------------------------------------------------------------
# The task the generator sees
# --------------------------------------------------------------------------------------------------
class EnvTask:
    """Episodes of an env over rows: a dataset's (`--dataset`: prompts.dataset_rows, not
    column-checked), the
    built-in task's, or, with neither, rows {"seed": i} (held-out seeds from 1,000,000); `rows` is
    (training rows, held-out rows in prompts.held_out_order). Scored once per episode: the env's
    reward ("env", weight 1),
    plus the --reward functions on its transcript with the instances as `environments=` (TRL's
    convention; not with --reward-workers, whose processes cannot hold them)."""

    is_env = True
    needs_text = True  # step() gets the text of the model's turn

    def __init__(self, cfg, tokenizer, factory=None, rows=None):
        spec = prompts.spec_of(cfg)
        self.tool_parser = None
        self.factory = factory or episode_factory(
            cfg,
            functools.partial(self.parser, cfg.tool_parser, cfg.reasoning_parser, tokenizer),
        )
        self.names = ["env"] + (rewards.reward_names(spec.rewards) if spec else [])
        self.scorer = rewards.Scorer(
            spec.rewards if spec else (),
            spec.weights if spec else (),
            workers=spec.reward_workers if spec else 0,
        )
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

    def parser(self, name: str, reasoning: str, tokenizer):
        """vLLM's tool and reasoning parsers for this run's episodes (--tool-parser and
        --reasoning-parser, else the ones the chat template's format names), made once, on the
        first episode that has tools (prepare checked them before the run)."""
        if self.tool_parser is None:
            template = tokenizer.chat_template
            self.tool_parser = tools_lib.ToolCallParser(
                tools_lib.parser_name(name, template),
                tokenizer,
                tools_lib.reasoning_parser_name(reasoning, template),
            )
        return self.tool_parser

    @staticmethod
    def rows_of(spec, cfg):
        if spec is None or not spec.dataset:
            return (
                [{"seed": i} for i in range(SEED_ROWS)],
                [
                    {"seed": HELD_OUT_SEED_START + i}
                    for i in prompts.held_out_order(HELD_OUT_SEED_ROWS)
                ],
            )
        return prompts.dataset_rows(spec, check=False)

    @staticmethod
    def prompt_of(row: dict, column: str, answer: str):
        columns = {k: v for k, v in row.items() if k != column}
        if "answer" not in columns and answer in row:
            columns["answer"] = row[answer]
        return Prompt([], str(row.get(answer, "")), columns, row.get(column), row=dict(row))

    def report_faults(self, episodes) -> None:
        """Each distinct env fault once on the terminal (all of them are counted in env/errors,
        env/timeouts)."""
        for ep in episodes:
            if ep.error and ep.error not in self.reported and len(self.reported) < 20:
                self.reported.add(ep.error)
                print(
                    f"[env] {ep.error}\n[env] (that episode ended; its reward does not apply; "
                    f"counted in env/errors or env/timeouts, each message reported once)",
                    file=sys.stderr,
                    flush=True,
                )

    def score_episodes(self, prompt, episodes: list[Episode], envs_, step: int = 0):
        """(rewards, {name: stats}, unscored indices) of one prompt's episodes (tasks/rewards.py's
        fault rules)."""
        chat = any(ep.chat for ep in episodes)
        texts = [
            "".join(t for t in ep.transcript if isinstance(t, str))
            if not ep.chat
            else (ep.transcript[-1]["content"] if ep.transcript else "")
            for ep in episodes
        ]
        # reward functions get the user's own instances (TRL passes its instances), not our wrappers
        extra = {
            "environments": [
                env.env if isinstance(env, tools_lib.TrlEnvironment) else env for env in envs_
            ]
        }
        if chat:
            extra["completions"] = [ep.transcript for ep in episodes]
        return self.scorer.score(
            prompt.prompt if prompt.prompt is not None else "",
            texts,
            [[t for t, m in zip(ep.ids[ep.start :], ep.model_mask) if m] for ep in episodes],
            prompt.columns,
            step,
            first=(("env", 1.0, [ep.reward for ep in episodes]),),
            extra=extra,
        )

    def close(self):
        self.scorer.close()
        self.env_threads.shutdown(wait=False, cancel_futures=True)
