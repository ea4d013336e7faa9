"""A sequential test that stops scoring a plan once its drop is surely over the accuracy budget. Pure.

A plan is scored on the evaluation split's batches in a seeded shuffled order. At a few looks (after a quarter, a
half and three quarters of the batches, none before ``MIN_LOOK_BATCHES``) the test bounds the drop over the whole
split from below; when the bound is above the budget, the plan is over the budget with confidence ``1 - alpha`` and
the remaining batches are not scored.

The bound. Every metric the test covers is a ratio of sums over batches (:func:`autotune.metrics.batch_terms`):
the mean metrics sum the per-sample drops over the samples, SNR the noise over the signal. The batches scored so far
are a simple random sample of the split's batches, so the ratio of their sums estimates the split's ratio (the
ratio estimator of cluster sampling) with the delta-method variance
``sum((numerator - ratio * denominator)^2) / ((n - 1) * n * mean(denominator)^2)``. The one-sided lower bound at
level ``alpha / looks`` takes Student's t with ``n - 1`` degrees of freedom; dividing ``alpha`` among the looks
(Bonferroni) bounds the chance that any look stops a plan within the budget by ``alpha``, however the looks
correlate. The drop is increasing in the ratio (:func:`autotune.metrics.drop_of_ratio`), so the ratio's lower bound
is the drop's. SNR, the log of its ratio, is bounded on the log scale (the same delta method for the log of the
ratio, relative standard error ``sqrt(variance) / ratio``): a noise-to-signal ratio spread over batches has a standard
error close to itself, so a linear bound stays below zero however far over the budget the plan is (the figures:
docs/method.md#stopping-a-plans-scoring-early-when-it-is-surely-over-the-budget).

Assumptions. The batches are exchangeable: the shuffle makes the order random, but the t bound also takes the
estimator to be near normal. The variance leaves out the finite-population correction ``1 - n/N`` that sampling
without replacement allows: with it, a split whose batch drops skew to the left was stopped at its budget more often
than ``alpha`` (``tests/harness/test_sequential.py``; docs/method.md, the section above). Per-sample
drops of the fidelity metrics are never negative and their batch sums skew to the right, for which the one-sided t
bound is conservative; a split whose drop hinges on a few batches where the plan does much better than FP32
(``top1`` against labels, say) can still be stopped more often than ``alpha``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.run.trial import TrialResult

MIN_SPLIT_BATCHES = 8
"""Splits with fewer batches are always scored whole: the first look would leave the t bound 2 degrees of freedom
or fewer, too wide to stop anything."""
MIN_LOOK_BATCHES = 4
"""No look before this many batches (3 degrees of freedom)."""
LOOK_FRACTIONS = (0.25, 0.5, 0.75)
"""Where the test looks, as fractions of the split's batches."""


def t_quantile(probability: float, degrees: int) -> float:
    """Student's t quantile: the value below which ``probability`` of the distribution lies (``probability > 0.5``).

    Inverts the exact distribution function of integer degrees of freedom by bisection (no scipy at run time).
    """
    return _t_quantile(round(probability, 12), int(degrees))


@functools.cache
def _t_quantile(probability: float, degrees: int) -> float:
    low, high = 0.0, 1.0
    while _t_cdf(high, degrees) < probability:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if _t_cdf(middle, degrees) < probability:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def _t_cdf(value: float, degrees: int) -> float:
    """Student's t distribution function at ``value >= 0``, exact for integer degrees of freedom.

    The closed form of the two-sided mass ``P(|T| < value)`` as a finite series in ``theta = atan(value/sqrt(v))``
    (Abramowitz and Stegun 26.7.3 and 26.7.4).
    """
    theta = math.atan(value / math.sqrt(degrees))
    sine, cosine = math.sin(theta), math.cos(theta)
    if degrees % 2:
        term, total = cosine, cosine if degrees > 1 else 0.0
        for k in range(3, degrees - 1, 2):
            term *= cosine * cosine * (k - 1) / k
            total += term
        central = 2 / math.pi * (theta + sine * total)
    else:
        term, total = 1.0, 1.0
        for k in range(2, degrees - 1, 2):
            term *= cosine * cosine * (k - 1) / k
            total += term
        central = sine * total
    return 0.5 + central / 2


def ratio_lower_bound(
    numerators: Sequence[float], denominators: Sequence[float], level: float, log_scale: bool = False
) -> float:
    """A one-sided lower confidence bound on the whole split's ratio of sums from the batches scored so far.

    Args:
        numerators: Each scored batch's numerator (:func:`autotune.metrics.batch_terms`).
        denominators: Their denominators (positive).
        level: The chance the bound is above the split's ratio.
        log_scale: Bound the log of the ratio (positive numerators), and return the exponential of that bound.

    Returns:
        The bound; minus infinity with fewer than two batches.
    """
    count = len(numerators)
    if count < 2:
        return -math.inf
    top, bottom = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if bottom.sum() <= 0:  # no signal (SNR of all-zero reference outputs): nothing to bound
        return -math.inf
    ratio = float(top.sum() / bottom.sum())
    residuals = top - ratio * bottom
    error = math.sqrt(float(residuals @ residuals) / ((count - 1) * count * float(bottom.mean()) ** 2))
    quantile = t_quantile(1.0 - level, count - 1)
    if not log_scale:
        return ratio - quantile * error
    return ratio * math.exp(-quantile * error / ratio) if ratio > 0 else 0.0


@dataclass(frozen=True)
class SequentialTest:
    """Where a plan's scoring looks, and at what level, for a split of ``total_batches``.

    Attributes:
        alpha: The chance that a plan whose drop over the whole split is within the budget is stopped.
        total_batches: Batches in the split.
        looks: Batches scored at each look, increasing, each below ``total_batches``.
        log_scale: Bound the ratio on the log scale (``ratio_lower_bound``): for a metric that is its log (SNR).
    """

    alpha: float
    total_batches: int
    looks: tuple[int, ...]
    log_scale: bool = False

    @classmethod
    def for_split(cls, total_batches: int, alpha: float | None, log_scale: bool = False) -> SequentialTest | None:
        """The test of a split, or None where the split is scored whole (``alpha`` None, or too few batches)."""
        if alpha is None or total_batches < MIN_SPLIT_BATCHES:
            return None
        looks = sorted(
            {max(MIN_LOOK_BATCHES, math.ceil(fraction * total_batches)) for fraction in LOOK_FRACTIONS}
            - {total_batches}
        )
        return cls(alpha, total_batches, tuple(look for look in looks if look < total_batches), log_scale)

    @property
    def level(self) -> float:
        """Each look's share of ``alpha`` (Bonferroni)."""
        return self.alpha / len(self.looks)

    def order(self, seed: int) -> list[int]:
        """The batches' scoring order: a permutation seeded by the run's seed, so a run is repeatable."""
        return [int(index) for index in np.random.default_rng(seed).permutation(self.total_batches)]

    def look(
        self,
        numerators: Sequence[float],
        denominators: Sequence[float],
        bound_to_drop: Callable[[float], float],
        budget: float,
    ) -> float | None:
        """The drop's lower confidence bound where scoring stops after these batches, else None.

        Scoring stops at a look whose bound on the drop is above ``budget``.

        Args:
            numerators: The scored batches' numerators, in scoring order.
            denominators: Their denominators.
            bound_to_drop: The drop a ratio implies (:func:`autotune.metrics.drop_of_ratio` of the metric).
            budget: The accuracy budget.
        """
        if len(numerators) not in self.looks:
            return None
        bound = bound_to_drop(ratio_lower_bound(numerators, denominators, self.level, self.log_scale))
        return bound if bound > budget else None


def scoring_counts(results: Sequence[TrialResult]) -> dict[str, float]:
    """What the search's scoring cost, for summary.json: trials scored, how many stopped early, batches, seconds.

    Args:
        results: The run's trials (failed ones, which scored nothing or not all, left out).
    """
    scored = [result for result in results if result.ok]
    stopped = [result for result in scored if result.stopped_early]
    return {
        "trials": len(scored),
        "stopped_early": len(stopped),
        "batches_left_out": sum(result.early_stop["of"] - result.early_stop["batches"] for result in stopped),
        "score_s": round(sum(result.score_s for result in scored), 3),
    }
