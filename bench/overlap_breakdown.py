"""bench/overlap_breakdown.py — where the missing share of the overlap bound goes, per mode of
bench/overlap.py: from each run's trace (bench/traces.py `steady_breakdown`, over the steady window)
and the stages' times alone, the share of a step the bound allows and, split exactly, the trainer's
waits (on swaps, on the staleness gate, on an idle engine, on a full queue, on generation beyond
what the bound leaves, of which an estimate of CPU contention), its evaluations and its training
slower than alone. The formulas and what each part means: bench/overlap.py's docstring.
Data: in, the per-repeat breakdowns (dicts of seconds per step, None without a trace), t_gen and
t_train (seconds per step alone) and vLLM's engine seconds per token alone; out, a dict of shares
of a step. Pure arithmetic: it reads and writes nothing.
"""

from __future__ import annotations

import statistics


def missing_share(
    breakdowns: list, t_gen: float, t_train: float, engine_s_per_token: float | None
) -> dict | None:
    """The missing share of the bound and its parts, as shares of a step (medians over repeats); see
    bench/overlap.py's docstring. None without a trace."""
    rows = [b for b in breakdowns if b]
    if not rows:
        return None

    def med(key):
        return statistics.median(b[key] for b in rows)

    step, bound = med("step_s"), max(t_gen, t_train)
    generating = med("wait_while_generating_s") - max(0.0, t_gen - t_train)
    contention = 0.0
    # the engine's time per step in the run less the same tokens at its speed alone
    if engine_s_per_token:
        contention = max(
            0.0, min(generating, med("engine_s") - engine_s_per_token * med("engine_tokens"))
        )
    out = {
        "share_of_pipelined": bound / step,
        "missing": 1 - bound / step,
        "wait_swap": med("wait_during_swap_s") / step,
        "wait_weights": med("wait_for_weights_s") / step,
        "wait_idle": med("wait_engine_idle_s") / step,
        "wait_full_queue": med("wait_during_full_queue_s") / step,
        "gen_contention": contention / step,
        "wait_generating": generating / step,
        "evaluation": med("evaluation_s") / step,
        "train_contention": (med("trainer_busy_s") - med("evaluation_s") - t_train) / step,
        "gen_swap": med("gen_swap_s") / step,
        "gen_weights": med("gen_for_weights_s") / step,
        "gen_full_queue": med("gen_full_queue_s") / step,
        "step_s": step,
        "trace": rows[-1],
    }
    return out
