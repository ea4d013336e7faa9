"""autotune.harness.sequential: the early stop's error rate, its power, and the evaluator path that uses it."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from autotune.harness.evaluator import Evaluator
from autotune.harness.sequential import SequentialTest, ratio_lower_bound, t_quantile
from autotune.metrics import drop_of_ratio
from autotune.run.store import TrialStore
from autotune.search.reward import meets_budget, reward, reward_of
from autotune.testing import tiny_config

BUDGET = 0.01
ALPHA = 0.05  # larger than the default 0.01, so a few thousand simulated plans tell a wrong rule from the right one
PLANS = 3000
Rule = Callable[[list, list], bool]


def _tolerance(alpha: float, plans: int) -> float:
    """The largest stopped fraction a rule of error rate ``alpha`` shows in ``plans`` plans, bar 1 in 30 000."""
    return alpha + 4 * math.sqrt(alpha * (1 - alpha) / plans)


def _stopped(
    numerators: np.ndarray, denominators: np.ndarray, rule: Rule, looks: tuple[int, ...]
) -> tuple[float, list]:
    """Scores one population of batches in ``PLANS`` shuffled orders, asking ``rule`` at each look.

    Returns:
        The fraction of orders stopped, and the batches scored when each stopped (None: never).
    """
    rng = np.random.default_rng(0)
    stops = []
    for _ in range(PLANS):
        order = rng.permutation(len(numerators))
        top, bottom = list(numerators[order]), list(denominators[order])
        stops.append(next((n for n in looks if rule(top[:n], bottom[:n])), None))
    return sum(stop is not None for stop in stops) / PLANS, stops


def _rule(test: SequentialTest, bound_to_drop: Callable[[float], float] = lambda ratio: ratio) -> Rule:
    return lambda top, bottom: test.look(top, bottom, bound_to_drop, BUDGET) is not None


def _mean_population(kind: str, batches: int, mean: float, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch drop sums of batches of 8 samples whose split-wide mean drop is exactly ``mean``."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        values = rng.normal(0.0, 1.0, batches)
    else:  # right-skewed, as the per-sample drops of a fidelity metric
        values = rng.gamma(0.5, 1.0, batches)
    values = mean + (values - values.mean()) * mean / values.std()  # spread: one budget per batch
    return values * 8, np.full(batches, 8.0)


@pytest.mark.parametrize("kind", ["normal", "skewed"])
def test_a_plan_at_the_budget_is_stopped_at_most_alpha_of_the_time_and_a_naive_rule_fails_that(kind):
    test = SequentialTest.for_split(32, ALPHA)
    numerators, denominators = _mean_population(kind, 32, BUDGET)
    rate, _ = _stopped(numerators, denominators, _rule(test), test.looks)
    assert rate <= _tolerance(ALPHA, PLANS)
    below, _ = _stopped(*_mean_population(kind, 32, 0.9 * BUDGET), _rule(test), test.looks)
    assert below <= rate
    # The simulation tells the rule from wrong ones: stopping at a look whenever the running mean is over the
    # budget; or, on this population skewed to the left (skewness -0.6), narrowing the bound by the
    # finite-population correction sqrt(1 - n/N).
    naive, _ = _stopped(numerators, denominators, lambda top, bottom: sum(top) / sum(bottom) > BUDGET, test.looks)
    assert naive > _tolerance(ALPHA, PLANS)
    if kind == "normal":

        def corrected(top, bottom):
            ratio = sum(top) / sum(bottom)
            bound = ratio - (ratio - ratio_lower_bound(top, bottom, test.level)) * math.sqrt(1 - len(top) / 32)
            return bound > BUDGET

        narrower, _ = _stopped(numerators, denominators, corrected, test.looks)
        assert narrower > _tolerance(ALPHA, PLANS)


def test_an_snr_plan_at_the_budget_is_stopped_at_most_alpha_of_the_time():
    rng = np.random.default_rng(2)
    signal = rng.gamma(2.0, 1.0, 24)
    noise = signal * rng.lognormal(0.0, 0.5, 24)
    reference_snr, budget_db = 100.0, 70.0  # at the budget: an SNR of 30 dB, noise / signal = 1e-3
    noise *= 1e-3 * signal.sum() / noise.sum()
    assert drop_of_ratio("snr", noise.sum() / signal.sum(), reference_snr) == pytest.approx(budget_db)
    test = SequentialTest.for_split(24, ALPHA, log_scale=True)

    def rule(top, bottom):
        return test.look(top, bottom, lambda ratio: drop_of_ratio("snr", ratio, reference_snr), budget_db) is not None

    rate, _ = _stopped(noise, signal, rule, test.looks)
    assert rate <= _tolerance(ALPHA, PLANS)
    far, stops = _stopped(noise * 100, signal, rule, test.looks)  # 20 dB over the budget
    assert far == 1.0 and set(stops) == {test.looks[0]}


def test_a_plan_at_several_times_the_budget_stops_at_the_first_look():
    test = SequentialTest.for_split(32, 0.01)
    numerators, denominators = _mean_population("skewed", 32, BUDGET)
    five = numerators + 4 * BUDGET * 8  # five budgets on average, one budget of spread per batch
    rate, stops = _stopped(five, denominators, _rule(test), test.looks)
    assert rate == 1.0 and set(stops) == {8}
    three, _ = _stopped(numerators + 2 * BUDGET * 8, denominators, _rule(test), test.looks)
    assert three == 1.0  # at three budgets most stop at the first look, the others at the second


def test_looks_and_when_the_test_is_off():
    assert SequentialTest.for_split(64, 0.01).looks == (16, 32, 48)
    assert SequentialTest.for_split(8, 0.01).looks == (4, 6)  # none before four batches
    assert SequentialTest.for_split(7, 0.01) is None
    assert SequentialTest.for_split(64, None) is None
    assert SequentialTest.for_split(64, 0.01).level == pytest.approx(0.01 / 3)


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for degrees in (1, 2, 3, 4, 7, 15, 47):
        for probability in (0.9, 0.995, 1 - 0.01 / 3):
            assert t_quantile(probability, degrees) == pytest.approx(stats.t.ppf(probability, degrees), rel=1e-9)


def test_a_plan_far_over_the_budget_stops_early_is_recorded_and_rescored_under_a_larger_budget(tmp_path):
    store = TrialStore(tmp_path / "trials.sqlite")
    tight = tiny_config(tmp_path, metric={"name": "cosine"}, accuracy_budget=1e-5)  # 8 batches: looks at 4 and 6
    with Evaluator(tight, store, isolate=False) as evaluator:
        space = evaluator._inline.space
        int8, fp32 = space.uniform("int8"), space.uniform("fp32")
        stopped = evaluator.evaluate(int8)
        whole = evaluator.measure(int8)  # every batch: what the plan scores without the test
        assert not evaluator.evaluate(fp32).stopped_early
    assert stopped.ok and stopped.speedup > 0 and not whole.stopped_early
    # It stops at a look (4 or 6 of 8 batches: which one depends on the INT8 numbers), not at the end.
    assert stopped.early_stop["batches"] in (4, 6) and stopped.early_stop["of"] == 8
    assert stopped.early_stop["drop_lower_bound"] > 1e-5 and stopped.accuracy_drop > 1e-5
    assert 0 < stopped.score_s and not meets_budget(stopped, 1e-5)
    assert reward(stopped, tight.reward, 1e-5) == reward_of(stopped.speedup, stopped.accuracy_drop, tight.reward, 1e-5)
    assert store.get(int8.hash).early_stop == stopped.early_stop
    # A run with a budget above the stop's bound does not take the stopped trial from the store: it scores every
    # batch, exactly as without the test.
    loose = tiny_config(tmp_path, metric={"name": "cosine"}, accuracy_budget=1.0)
    with Evaluator(loose, store, isolate=False) as evaluator:
        rescored = evaluator.evaluate(int8)
    assert not rescored.from_store and not rescored.stopped_early
    assert rescored.accuracy == whole.accuracy and rescored.accuracy_drop == whole.accuracy_drop
    store.close()
