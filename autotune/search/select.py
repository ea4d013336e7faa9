"""Which measured plans are worth confirming. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from autotune.config.schema import FinalistRule
from autotune.measure.confidence import ties_within
from autotune.run.trial import TrialResult
from autotune.search.estimate import ACCURACY_KNOBS, Surrogate, fit_surrogate
from autotune.search.prior import PriorInputs, layer_prior
from autotune.search.reward import meets_budget, reward


def pareto_front(
    results: Iterable[TrialResult], speedup: Callable[[TrialResult], float] | None = None
) -> list[TrialResult]:
    """Successful results that no other beats on both speedup (higher) and accuracy drop (lower); fastest first.

    Args:
        results: Measured trials; failed ones are left out.
        speedup: The speedup to compare (default: the measured one).
    """
    speed = speedup or (lambda r: r.speedup)
    front: list[TrialResult] = []
    best_drop = float("inf")
    ok = [r for r in results if r.ok and r.speedup is not None and r.accuracy_drop is not None]
    for result in sorted(ok, key=lambda r: (-speed(r), r.accuracy_drop)):
        if result.accuracy_drop < best_drop:
            front.append(result)
            best_drop = result.accuracy_drop
    return front


PROFILE_WEIGHT = 1000.0
"""How many trials' worth the FP32 profile's per-layer savings count when the finalists are ranked: so many that the
trials only scale INT8's saving per unit of runtime share and set the knobs' terms. A search trial's speedup moves
between measurements by more than one layer is worth, so per-layer terms fitted on a few dozen trials rank plans by
their noise, while the profile times every layer in one long run. Of the estimates compared on MiniLM's finalists,
this one ranked them most as their confirmations did (``bench/research/ranking_check.py``; the figures:
docs/method.md#ranking-the-finalists-which-estimate-foretells-the-confirmation)."""


def expected_speedups(results: Sequence[TrialResult], model: Surrogate | None) -> dict[str, float]:
    """Each successful plan's speedup as the geometric mean of its own measurement and the model's prediction.

    What ranks a run's finalists where the backend gave no FP32 profile (with one, :func:`profile_speedups`).

    A search trial is timed in a few short rounds, and the fastest of a hundred such measurements is mostly luck:
    a plan with few layers in INT8 can measure fast and hold nothing when confirmed, and, being fastest, knock every
    real candidate off the measured front. The additive model (fitted on every trial) averages each layer's effect
    over all the trials that contain it, but misses what is particular to one plan. On MiniLM's finalists the mean
    of the two logs ranked the plans as their confirmation did better than either alone
    (``bench/research/ranking_check.py``; the figures:
    docs/method.md#ranking-the-finalists-which-estimate-foretells-the-confirmation).

    Args:
        results: Measured trials.
        model: The additive model of those trials (None: too few trials; the measurements stand alone).

    Returns:
        Plan hash to expected speedup, for every successful trial with a speedup.
    """
    expected = {}
    for result in results:
        if not result.ok or not result.speedup:
            continue
        measured = result.speedup
        if model is not None:
            predicted = model.predict(result.plan)[0]
            measured = math.sqrt(measured * predicted)
        expected[result.plan_hash] = measured
    return expected


def profile_model(
    results: Sequence[TrialResult],
    knob_defaults: Mapping[str, object],
    runtime_shares: Mapping[str, float],
    layer_names: Sequence[str],
) -> Surrogate:
    """The additive model whose INT8 saving per layer is its FP32 profile share times one scale (``PROFILE_WEIGHT``).

    Args:
        results: Measured trials (they fit the scale, the knobs' terms and the drops).
        knob_defaults: Each knob's default (no model term).
        runtime_shares: Layer name to its share of FP32 runtime; layers the profile did not time are left out.
        layer_names: Every tunable layer, in table order.
    """
    shares = tuple(runtime_shares.get(name) for name in layer_names)
    inputs = PriorInputs(tuple(layer_names), shares, {}, {}, metric="")
    prior = layer_prior(inputs, results, knob_defaults)
    model = fit_surrogate(
        results, knob_defaults, ACCURACY_KNOBS, prior=prior, layer_names=layer_names, saving_prior_weight=PROFILE_WEIGHT
    )
    assert model is not None  # with a prior there is always a model
    return model


def profile_speedups(
    results: Sequence[TrialResult],
    knob_defaults: Mapping[str, object],
    runtime_shares: Mapping[str, float],
    layer_names: Sequence[str],
) -> dict[str, float] | None:
    """Each successful plan's speedup as :func:`profile_model` of all the trials predicts it.

    Returns:
        Plan hash to predicted speedup, or None without a successful trial.
    """
    ok = [r for r in results if r.ok and r.speedup]
    if not ok:
        return None
    model = profile_model(ok, knob_defaults, runtime_shares, layer_names)
    return {r.plan_hash: model.predict(r.plan)[0] for r in ok}


def confirmation_order(
    results: Iterable[TrialResult], rule: FinalistRule, expected: Mapping[str, float] | None = None
) -> list[TrialResult]:
    """Plans to confirm, best bet first.

    The first ``confirm.top_k`` places: the fastest plans within the search budget, then (where there are any)
    bolder bets: up to ``planner.bold_places`` of the fastest plans between the search budget and the accuracy
    budget itself, each faster than all of them. The headroom only steers the search; the held-out data decides
    whether such a plan meets the budget. A second place raises the odds that one of the bold bets holds: the
    held-out drop of a plan near the budget is a coin toss (docs/method.md#why-the-search-aims-20--under-the-budget).
    Then, for when no finalist meets the budget on held-out data, the Pareto front of the other plans within the
    search budget, fastest first: walking down it trades speed for accuracy headroom, which is what a plan needs
    when held-out data shifts its drop. Then every other successful plan by reward.

    Args:
        results: Measured trials.
        rule: The run's budgets, reward and places (``TuneConfig.finalists``).
        expected: Plan hash to the speedup to rank by (:func:`expected_speedups`); default the measured one.
    """
    results = [r for r in results if r.ok]

    def speed(result: TrialResult) -> float:
        measured = result.speedup or 0.0
        return expected.get(result.plan_hash, measured) if expected is not None else measured

    within = sorted((r for r in results if meets_budget(r, rule.search_budget)), key=speed, reverse=True)
    bolder = sorted(
        (
            r
            for r in results
            if meets_budget(r, rule.accuracy_budget)
            and not meets_budget(r, rule.search_budget)
            and (not within or speed(r) > speed(within[0]))
        ),
        key=speed,
        reverse=True,
    )[: min(rule.bold_places, rule.top_k - 1 if within else rule.top_k)]
    fastest = within[: max(1, rule.top_k - len(bolder))]
    order = [*fastest, *bolder]
    seen = {r.plan_hash for r in order}
    order += pareto_front((r for r in within if r.plan_hash not in seen), speed)
    seen = {r.plan_hash for r in order}
    rest = sorted(
        (r for r in results if r.plan_hash not in seen),
        key=lambda r: reward(r, rule.reward, rule.search_budget),
        reverse=True,
    )
    return order + rest


def ranking(confirmed: list[TrialResult], accuracy_budget: float, noise: float = 0.0) -> list[TrialResult]:
    """Confirmed plans, best first: within budget by speedup, then the rest by drop.

    Plans whose speedups differ by less than the protocol's measured ``noise`` (the FP32 self-check of the same
    confirmation, ``autotune.measure.confidence.SelfCheck.noise``) are a tie: of those, the one with the smallest
    accuracy drop comes first, since the measurement cannot say which is faster.
    """
    within = sorted((r for r in confirmed if meets_budget(r, accuracy_budget)), key=lambda r: -(r.speedup or 0))
    tied = [within[index] for index in ties_within([r.speedup or 0.0 for r in within], noise)]
    if tied:
        first = min(tied, key=lambda r: (r.accuracy_drop, -(r.speedup or 0.0)))
        within = [first, *(r for r in within if r is not first)]
    others = sorted(
        (r for r in confirmed if not meets_budget(r, accuracy_budget)),
        key=lambda r: (not r.ok, r.accuracy_drop if r.accuracy_drop is not None else float("inf")),
    )
    return within + others
