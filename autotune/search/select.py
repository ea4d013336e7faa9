"""Which measured plans are worth confirming. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from autotune.config import TuneConfig
from autotune.search.reward import meets_budget, reward
from autotune.trial import TrialResult


def pareto_front(results: Iterable[TrialResult]) -> list[TrialResult]:
    """Successful results that no other beats on both speedup (higher) and accuracy drop (lower); fastest first."""
    front: list[TrialResult] = []
    best_drop = float("inf")
    ok = [r for r in results if r.ok and r.speedup is not None and r.accuracy_drop is not None]
    for result in sorted(ok, key=lambda r: (-r.speedup, r.accuracy_drop)):
        if result.accuracy_drop < best_drop:
            front.append(result)
            best_drop = result.accuracy_drop
    return front


def confirmation_order(results: Iterable[TrialResult], config: TuneConfig) -> list[TrialResult]:
    """Plans to confirm, best bet first.

    First the Pareto front of the plans within the accuracy budget on the search data, fastest first: walking
    down it trades speed for accuracy headroom, which is what a plan needs when held-out data shifts its drop.
    Then every other successful plan by reward.
    """
    results = [r for r in results if r.ok]
    front = pareto_front(r for r in results if meets_budget(r, config.search_budget))
    seen = {r.plan_hash for r in front}
    rest = sorted(
        (r for r in results if r.plan_hash not in seen),
        key=lambda r: reward(r, config.reward, config.search_budget),
        reverse=True,
    )
    return front + rest


def ranking(confirmed: list[TrialResult], accuracy_budget: float) -> list[TrialResult]:
    """Confirmed plans, best first: within budget by speedup, then the rest by drop."""
    within = sorted((r for r in confirmed if meets_budget(r, accuracy_budget)), key=lambda r: -(r.speedup or 0))
    others = sorted(
        (r for r in confirmed if not meets_budget(r, accuracy_budget)),
        key=lambda r: (not r.ok, r.accuracy_drop if r.accuracy_drop is not None else float("inf")),
    )
    return within + others
