"""The reward of a trial. Pure."""

from __future__ import annotations

import math

from autotune.config.schema import RewardConfig
from autotune.run.trial import TrialResult


def reward(result: TrialResult, config: RewardConfig, accuracy_budget: float) -> float:
    """``log(t_ref / t_plan) - accuracy_penalty * excess``, or ``config.failure`` for a failed trial.

    The excess is ``max(0, drop - budget)``, divided by the budget when ``config.penalty_units`` is ``budget``
    (and the budget is positive).

    The latency term is scale-free (a log ratio to the FP32 reference timed in the same process), so the
    reward needs no normalisation and machine drift cancels.

    Args:
        result: The trial.
        config: Penalty weights.
        accuracy_budget: Largest drop allowed without penalty, in the metric's units.

    Returns:
        The reward.
    """
    if not result.ok or result.speedup is None or result.accuracy_drop is None or result.speedup <= 0:
        return config.failure
    return reward_of(result.speedup, result.accuracy_drop, config, accuracy_budget)


def reward_of(speedup: float, accuracy_drop: float, config: RewardConfig, accuracy_budget: float) -> float:
    """The reward of a successful trial with this speedup (> 0) and accuracy drop."""
    excess = max(0.0, accuracy_drop - accuracy_budget)
    if config.penalty_units == "budget" and accuracy_budget > 0:
        excess /= accuracy_budget
    return latency_gain(speedup, config.tie_within) - config.accuracy_penalty * excess


def latency_gain(speedup: float, tie_within: float | None) -> float:
    """``log(speedup)``, snapped to steps of ``log(1 + tie_within)`` when a timing noise is given.

    Snapped, two plans whose speedups differ by less than the run's measured noise (its FP32 self-check) mostly
    earn the same gain: the agent is not taught an order the protocol cannot measure, and greedy keeps a knob's
    earlier value unless another is measurably faster.
    """
    gain = math.log(speedup)
    if not tie_within:
        return gain
    step = math.log1p(tie_within)
    return round(gain / step) * step


def meets_budget(result: TrialResult, accuracy_budget: float) -> bool:
    """The trial succeeded and its accuracy drop is within the budget."""
    return result.ok and result.accuracy_drop is not None and result.accuracy_drop <= accuracy_budget
