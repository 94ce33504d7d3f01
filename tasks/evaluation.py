"""tasks/evaluation.py — held-out evaluation: what the trainer asks for, what the generator answers,
what it means.

Role: rank 0 asks every --eval-every steps and at the end (`request`); the generator (rollout.py)
evaluates the weights it holds on its own engine, beside training requests (`run_eval`,
`eval_prompt`), and answers on a queue of its own, so evaluation outputs are never trained on. The
trainer picks answers up between steps (`collect`); `summarize` turns one into the eval/... keys.
Data contract
    - The request, `control.eval_request` = [step, version]: evaluate the weights of `version` or
      newer; only the newest request counts.
    - `EvalResult`: the step asked for, the versions loaded at its start and at its end (the same
      under --eval-weights fixed; by default weight loads go on during an evaluation, so its tokens
      come from those versions and the ones between), and per held-out prompt the
      reward of its greedy completion then those of S sampled ones (an env task: of its greedy and S
      sampled episodes, and their mean turns); pass@k is Chen et al.'s unbiased estimator.
May touch: the two eval fields of `processes.Control`; in the generator, the engine's requests and
reward threads of the rollout.Generator it is handed, its eval counters, its trace events
(tracing.py). No model of the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import math
import queue as queue_lib
import sys
import time
from dataclasses import dataclass, field

from buffer import tag_versions
from infra import tracing
from tasks import envs
from tasks.prompts import Prompt


@dataclass
class EvalResult:
    step: int  # steps done when it was asked for (0: the initial weights)
    version: int  # the version of the weights loaded when it started
    # per held-out prompt: [greedy completion's reward, then the S samples' rewards]
    rewards: list[list[float]]
    time_s: float = 0.0
    tokens: int = 0
    # an env task: per held-out prompt, its episodes' mean turns
    turns: list[float] = field(default_factory=list)
    last_version: int = -1  # the version loaded when it ended (-1: not recorded)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k completions drawn without replacement from n, of which
    c pass, passes: 1 - C(n - c, k) / C(n, k) (the unbiased estimator of Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code")."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(samples: int) -> list[int]:
    """The k reported for S samples: 1, 2, 4, ... up to S, and S."""
    ks = [k for k in (2**i for i in range(samples.bit_length())) if k <= samples]
    return sorted(set(ks + [samples])) if samples else []


def summarize(result: EvalResult, pass_reward: float = 1.0) -> dict:
    """The eval/... keys of one evaluation (None where it had no prompts or no samples)."""
    prompts = [r for r in result.rewards if r]
    n = len(prompts)
    samples = min((len(r) - 1 for r in prompts), default=0)
    out = {
        "eval/step": result.step,
        "eval/version": result.version,
        "eval/last_version": max(result.version, result.last_version),
        "eval/prompts": n,
        "eval/greedy_pass@1": sum(r[0] >= pass_reward for r in prompts) / n if n else None,
        "eval/greedy_reward": sum(r[0] for r in prompts) / n if n else None,
        "eval/reward": sum(sum(r[1 : samples + 1]) for r in prompts) / (n * samples)
        if n and samples
        else None,
    }
    for k in ks_for(samples):
        out[f"eval/pass@{k}"] = (
            sum(
                pass_at_k(samples, sum(x >= pass_reward for x in r[1 : samples + 1]), k)
                for r in prompts
            )
            / n
        )
    if result.turns:  # an env task: the greedy pass@1 is its success rate
        out["eval/turns_mean"] = sum(result.turns) / len(result.turns)
    out["eval/time_s"] = result.time_s
    out["eval/tokens"] = result.tokens
    return out


# --------------------------------------------------------------------------------------------------
# Crossing processes (processes.Control holds `eval_request` and `eval_results`)
# --------------------------------------------------------------------------------------------------
def request(control, step: int, version: int) -> None:
    """The trainer asks for an evaluation of the weights after `step` steps (published as
    `version`)."""
    with control.eval_request.get_lock():
        control.eval_request[0], control.eval_request[1] = step, version


def requested(control) -> tuple[int, int]:
    """(step, version) of the newest request; step -1 before the first."""
    with control.eval_request.get_lock():
        return control.eval_request[0], control.eval_request[1]


def collect(
    control, wait_for_step: int | None = None, timeout_s: float = 0.0, should_stop=lambda: False
) -> list[EvalResult]:
    """The answers that have arrived, without waiting; with `wait_for_step`, wait (at most
    `timeout_s`, and not once `should_stop()`) until the answer for that step is among them."""
    results: list[EvalResult] = []
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = wait_for_step is not None and not any(r.step >= wait_for_step for r in results)
        try:
            results.append(
                control.eval_results.get(timeout=0.2)
                if waiting
                else control.eval_results.get_nowait()
            )
        except queue_lib.Empty:
            if not waiting:
                return results
            if should_stop():
                return results
            if time.monotonic() > deadline:
                print(
                    f"warning: the generator sent no evaluation for step {wait_for_step} within "
                    f"{timeout_s:.0f} s (--timeout-s): the run ends without it",
                    file=sys.stderr,
                    flush=True,
                )
                return results


# --------------------------------------------------------------------------------------------------
# The generator's side: rollout.Generator runs these on its event loop, on its own engine, beside
# training requests (`gen`: the Generator; an env task's prompts run as episodes, tasks/envs.py)
# --------------------------------------------------------------------------------------------------
async def run_eval(gen, step: int):
    """Evaluate the weights held now on the first `eval_prompts` held-out prompts; answer on
    control.eval_results (never the rollout queue). Under --eval-weights fixed the loop loads no
    weights while this runs."""
    t0, version = time.perf_counter(), gen.loaded_version
    prompts = gen.task.held_out[: gen.cfg.eval_prompts]
    evaluate = (
        functools.partial(envs.eval_env_prompt, gen)
        if gen.task.is_env
        else functools.partial(eval_prompt, gen)
    )
    results = await asyncio.gather(*(evaluate(step, i, p, version) for i, p in enumerate(prompts)))
    tokens = sum(r[1] for r in results)
    gen.stats.eval_tokens += tokens
    gen.control.eval_results.put(
        EvalResult(
            step=step,
            version=version,
            rewards=[r[0] for r in results],
            time_s=time.perf_counter() - t0,
            tokens=tokens,
            turns=[r[2] for r in results if len(r) > 2],
            last_version=gen.loaded_version,
        )
    )
    tracing.complete(
        f"evaluation (step {step})", t0, track="evaluation", cat="evaluation", version=version
    )


async def eval_prompt(
    gen, step: int, i: int, prompt: Prompt, version: int
) -> tuple[list[float], int]:
    """[reward of the greedy completion, rewards of the samples] for one held-out prompt, and
    its tokens."""

    async def generate(greedy: bool):
        final = None
        async for out in gen.generate(
            prompt.prompt_ids,
            eval_params(gen, greedy),
            f"eval-{step}-{i}-{'greedy' if greedy else 'sampled'}",
        ):
            final = out
        return sorted(final.outputs, key=lambda c: c.index)

    with gen.generating_request():
        outputs = await asyncio.gather(
            generate(True), *([generate(False)] if gen.cfg.eval_samples else [])
        )
    completions = [c for group in outputs for c in group]
    ids = [list(c.token_ids) for c in completions]
    if gen.cfg.eval_weights == "fixed" and any(
        v != version
        for c, t in zip(completions, ids)
        for v in tag_versions(c.weight_versions, len(t))
    ):
        raise RuntimeError(f"evaluation of version {version} sampled tokens under other weights")
    rewards, _, _ = await asyncio.get_running_loop().run_in_executor(
        gen.reward_threads,
        gen.task.score,
        prompt,
        [c.text or "" for c in completions],
        ids,
        version,
    )
    return list(rewards), sum(map(len, ids))


def eval_params(gen, greedy: bool):
    """An evaluation request: one greedy completion, or S samples with the run's sampling
    settings; no log-probs, no seed (a seeded request re-prefilled after a chunked prefill fails
    on vLLM's CPU sampler)."""
    if greedy:
        return gen.request_params(n=1, temperature=0.0)
    return gen.request_params(
        n=gen.cfg.eval_samples,
        temperature=gen.cfg.temperature,
        top_k=gen.cfg.top_k,
        top_p=gen.cfg.top_p,
    )
