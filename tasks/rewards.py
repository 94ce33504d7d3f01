"""tasks/rewards.py — reward functions in TRL's convention, and the scorer the generator calls them
through.

Role: `load_reward` (`module:function`, `path/file.py:function` or a built-in name such as `math`),
`Scorer` (every --reward function on a group's completions, in a thread or a process pool; weighted
sum), `math_reward` (the final number against the answer), `reasoning_gym_reward` (reasoning-gym's
own scorer, for `--task rg:NAME`), `summarize` (per-function counters for metrics).
Data contract: functions are called as TRL's GRPOTrainer calls them, `f(prompts=, completions=,
completion_ids=, trainer_state=, **columns)` (the answer column also as `answer`), and return one
float | None each. None, NaN or a raise leave the function out of that sample's weighted sum,
counted; a sample no function scored gets its group's mean reward and is reported unscored (its
advantage: 0). `load_object` resolves every `module:NAME` flag (--reward, --env, --tools); the
module names the project had before tasks/ (`adapters`, `rewards`, ...: MOVED) still resolve, so
`--env adapters:TextArenaEnv` works.
May touch: the modules it is pointed at. Importable without vLLM or torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

from tasks.datasets import DataError, is_conversation
from tasks.prompts import BUILTIN_REWARDS, spec_of

# `module:NAME` spellings of the modules tasks/ holds now, as they were before it: they keep working
MOVED = {
    "adapters": "tasks.textarena",
    "rewards": "tasks.rewards",
    "envs": "tasks.envs",
    "tools": "tasks.tools",
    "tasks": "tasks.builtin",
    "data": "tasks.prompts",
}


def check(cfg) -> list[str]:
    """prepare.check: one line per --reward function that does not import."""
    try:
        spec = spec_of(cfg)
    except DataError:  # prompts.check_flags reports it
        return []
    problems = []
    for s in spec.rewards if spec is not None else []:
        try:
            load_reward(s)
        except DataError as e:
            problems.append(str(e))
    return problems


def load_module(module_name: str, what: str):
    """`path/to/file.py` or an importable module name -> the module (a file is loaded once per
    process, as `user_<file name>`: --reward, --env and --tools naming one file share it). `what`
    names the flag and value in the one-line DataError ("--reward x.py:f")."""
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(os.path.expanduser(module_name))
            if not os.path.isfile(path):
                raise DataError(f"{what}: no such file {module_name}")
            key = "user_" + os.path.splitext(os.path.basename(path))[0]
            module = sys.modules.get(key)
            if module is None or getattr(module, "__file__", None) != path:
                loader_spec = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(loader_spec)
                loader_spec.loader.exec_module(module)
                sys.modules[key] = module
            return module
        # `--reward my_rewards:f` with my_rewards.py where you run from
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        return importlib.import_module(MOVED.get(module_name, module_name))
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{what}: cannot import {module_name} ({type(e).__name__}: {e})") from None


def load_object(spec: str, flag: str, what: str = "function"):
    """`module:NAME` or `path/to/file.py:NAME` -> the object it names (a --reward function, an --env
    class). Raises DataError in one line, worded with `flag`."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise DataError(f"{flag} {spec!r}: expected module:{what} or path/to/file.py:{what}")
    found = getattr(load_module(module_name, f"{flag} {spec}"), name, None)
    if found is None:
        raise DataError(f"{flag} {spec}: {module_name} has no {name!r}")
    return found


def load_reward(spec: str):
    """`module:function`, `path/to/file.py:function` or a built-in name -> the function. Raises
    DataError."""
    func = load_object(BUILTIN_REWARDS.get(spec, spec), "--reward", "function")
    if not callable(func):
        raise DataError(f"--reward {spec}: {spec.rpartition(':')[2]} is not callable")
    return func


def reward_names(specs) -> list[str]:
    """A name per function for the metrics (the function's name, as TRL; #2, #3 on repeats)."""
    names = []
    for spec in specs:
        base = BUILTIN_REWARDS.get(spec, spec).rpartition(":")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}#{k}", k + 1
        names.append(name)
    return names


def call_kwargs(func, kwargs: dict) -> dict:
    """Only the keyword arguments `func` accepts, unless it takes **kwargs (TRL's functions all
    do)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def call_reward(func, n: int, kwargs: dict) -> tuple[list, dict, str | None]:
    """Call one reward function; return (values: float | None each, stats, fault message or
    None)."""
    stats = {
        "n": n,
        "count": 0,
        "sum": 0.0,
        "sumsq": 0.0,
        "none": 0,
        "invalid": 0,
        "errors": 0,
        "time_s": 0.0,
    }
    t0 = time.perf_counter()
    fault = None
    try:
        out = func(**call_kwargs(func, kwargs))
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise TypeError(f"returned {type(out).__name__}, expected a list of {n} floats or None")
        out = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(out) != n:
            raise TypeError(f"returned {len(out)} values for {n} completions")
    except Exception as e:
        fault = f"{type(e).__name__}: {e}"
        if not isinstance(e, TypeError) or "returned" not in str(e):
            fault += "\n" + "".join(traceback.format_exception(e)[-3:]).rstrip()
        out = [None] * n
        stats["errors"] = 1
    stats["time_s"] = time.perf_counter() - t0
    values = []
    for v in out:
        if v is None:
            stats["none"] += 0 if fault else 1
            values.append(None)
            continue
        # bools and numpy scalars are numbers
        f = float(v) if isinstance(v, numbers.Real) else math.nan
        if not math.isfinite(f):
            stats["invalid"] += 1
            values.append(None)
            continue
        values.append(f)
        stats["count"] += 1
        stats["sum"] += f
        stats["sumsq"] += f * f
    return values, stats, fault


def combine(values_per_func: list[list], weights, n: int) -> tuple[list[float], list[int]]:
    """Weighted sum over the functions that scored each sample; unscored samples get the mean of the
    scored ones (what the step's reward logs; their advantage is 0, advantages.estimate_advantages);
    no functions at all (a --teacher run learning from it alone): 0 each, none unscored. Returns
    (rewards, the unscored samples' indices)."""
    if not values_per_func:
        return [0.0] * n, []
    rewards, unscored = [], []
    for j in range(n):
        got = [(w, vals[j]) for w, vals in zip(weights, values_per_func) if vals[j] is not None]
        if got:
            rewards.append(sum(w * v for w, v in got))
        else:
            rewards.append(None)
            unscored.append(j)
    scored = [r for r in rewards if r is not None]
    fill = sum(scored) / len(scored) if scored else 0.0
    return [fill if r is None else r for r in rewards], unscored


def reward_kwargs(
    prompt, completions: list[str], completion_ids: list[list[int]], columns: dict, step: int = 0
) -> dict:
    """TRL's GRPOTrainer arguments for one group: one entry per completion."""
    n = len(completions)
    chat = is_conversation(prompt)
    kwargs = {key: [value] * n for key, value in columns.items()}
    kwargs.update(
        prompts=[prompt] * n,
        completions=[[{"role": "assistant", "content": c}] for c in completions]
        if chat
        else completions,
        completion_ids=completion_ids,
        trainer_state=SimpleNamespace(global_step=step),
    )
    return kwargs


def _score_all(funcs, kwargs: dict, n: int) -> list[tuple[list, dict, str | None]]:
    return [call_reward(func, n, kwargs) for func in funcs]


_WORKER_FUNCS: list = []


def _worker_init(specs, cwd):
    os.chdir(cwd)
    _WORKER_FUNCS[:] = [load_reward(s) for s in specs]


def _worker_score(kwargs: dict, n: int):
    return _score_all(_WORKER_FUNCS, kwargs, n)


class Scorer:
    """The reward functions of a run: TRL-convention calls, fault rules, weights, per-function
    stats.

    `workers=0`: the functions run in the calling thread (the generator calls `score` from a worker
    thread, never on its event loop). `workers=N`: a pool of N spawned processes (for slow rewards;
    each process imports the functions itself, and math-verify's own timeouts work there).
    """

    def __init__(self, specs, weights=None, workers: int = 0, log=None):
        self.specs = list(specs)
        self.names = reward_names(self.specs)
        self.weights = list(weights) if weights else [1.0] * len(self.specs)
        self.funcs = [load_reward(s) for s in self.specs]  # here too: import errors show at once
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.warned: set = set()
        self.pool = None
        if workers:
            self.pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.specs, os.getcwd()),
            )

    def score(
        self,
        prompt,
        completions: list[str],
        completion_ids: list[list[int]],
        columns: dict,
        step: int = 0,
        first: tuple = (),
        extra: dict | None = None,
    ) -> tuple[list[float], dict, int]:
        """(rewards, {name: stats}, unscored indices) for one group. Never raises for a faulty
        reward function. `first`: (name, weight, values) terms added before the functions' (an
        episode's environment reward); `extra`: keyword arguments for the functions beyond TRL's (in
        a thread only: `environments=`)."""
        n = len(completions)
        kwargs = reward_kwargs(prompt, completions, completion_ids, columns, step)
        if self.pool is not None:
            results = self.pool.submit(_worker_score, kwargs, n).result() if self.funcs else []
        else:
            results = _score_all(self.funcs, {**kwargs, **(extra or {})}, n)
        names, weights = [t[0] for t in first] + self.names, [t[1] for t in first] + self.weights
        results = [call_reward(lambda values=t[2]: values, n, {}) for t in first] + results
        stats = {}
        for name, (values, st, fault) in zip(names, results):
            stats[name] = st
            kinds = [("error", fault)] if fault else []
            if st["invalid"]:
                kinds.append(
                    (
                        "invalid",
                        f"gave {st['invalid']} NaN/inf/non-number value(s), treated as None",
                    )
                )
            for kind, message in kinds:
                if (name, kind) not in self.warned:
                    self.warned.add((name, kind))
                    self.log(
                        f"[reward] {name}: {message}\n[reward] (those samples get no value from "
                        f"{name}; counted in reward/{name}/errors and none_frac, reported once)"
                    )
        rewards, unscored = combine([r[0] for r in results], weights, n)
        return rewards, stats, unscored

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def summarize(stats_list: list[dict]) -> dict:
    """Sum per-group stats ({name: stats}) into per-function metrics for one step."""
    total: dict[str, dict] = {}
    for stats in stats_list:
        for name, st in stats.items():
            acc = total.setdefault(name, dict.fromkeys(st, 0))
            for k, v in st.items():
                acc[k] = acc.get(k, 0) + v
    out = {}
    for name, a in total.items():
        mean = a["sum"] / a["count"] if a["count"] else None
        std = math.sqrt(max(0.0, a["sumsq"] / a["count"] - mean * mean)) if a["count"] else None
        out[f"reward/{name}/mean"] = mean
        out[f"reward/{name}/std"] = std
        out[f"reward/{name}/none_frac"] = (a["n"] - a["count"]) / a["n"] if a["n"] else None
        out[f"reward/{name}/errors"] = a["errors"]
        out[f"reward/{name}/time_s"] = a["time_s"]
    return out


# --------------------------------------------------------------------------------------------------
# The built-in math reward
# --------------------------------------------------------------------------------------------------
def final_answer(text: str) -> str:
    """GSM8K-style text: what follows the last '####' (first line of it), without thousands
    commas."""
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        text = text.replace(",", "").replace("$", "").strip()
    return text


def math_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference (math-verify), else 0.0.

    The reference comes from the `answer` column (or `solution`, as in TRL's examples); for GSM8K
    answers the part after '####' is used, and so it is for completions that write '#### N';
    otherwise math-verify extracts the last answer-like expression (\\boxed{...}, "the answer is
    ...", the last number). None when the reference itself cannot be parsed (the reward does not
    apply to that sample).
    """
    # heavy (sympy): only runs that use the math reward load it
    from math_verify import parse, verify

    golds = answer if answer is not None else solution
    if golds is None:
        raise TypeError("math_reward needs an `answer` (or `solution`) column")
    # math-verify's timeouts use signal.alarm, which only works in a
    # process's main thread: in a thread we run without them (as its docs
    # advise); use --reward-workers N to keep them, in worker processes.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # its "timeout is disabled" notice, per call
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    rewards = []
    for completion, gold in zip(completions, golds):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        gold_parsed = parse(final_answer(str(gold)), parsing_timeout=timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        pred = parse(final_answer(text), parsing_timeout=timeout)
        rewards.append(1.0 if pred and verify(gold_parsed, pred, timeout_seconds=timeout) else 0.0)
    return rewards


# --------------------------------------------------------------------------------------------------
# reasoning-gym's scorers (`--task rg:NAME`, `--reward rg`)
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def reasoning_gym_scorer(name: str):
    import reasoning_gym  # only runs that use it load it

    return reasoning_gym.get_score_answer_fn(name)


def reasoning_gym_reward(prompts, completions, answer, metadata, **kwargs) -> list[float | None]:
    """reasoning-gym's own `score_answer(answer, entry)` (in [0, 1]) of the dataset that made the
    row (its `metadata["source_dataset"]`): the answer is the completion's last
    `<answer>...</answer>` (reasoning-gym's `extract_answer`, as its system prompt asks; none scores
    as reasoning-gym scores None, 0). None where the scorer raises (that sample is counted, not
    scored)."""
    from reasoning_gym.utils import extract_answer

    rewards = []
    for prompt, completion, gold, meta in zip(prompts, completions, answer, metadata):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        entry = {"question": prompt, "answer": gold, "metadata": meta}
        try:
            rewards.append(
                float(reasoning_gym_scorer(meta["source_dataset"])(extract_answer(text), entry))
            )
        except Exception:
            rewards.append(None)
    return rewards
