import numpy as np
import pytest

from autotune.plan import Plan
from autotune.search.episode import decisions, observe
from autotune.search.estimate import MIN_TRIALS, fit_additive
from autotune.testing import tiny_space
from autotune.trial import TrialResult

NAMES = ["a", "b", "c", "d"]
SAVING = {"a": 0.05, "b": 0.30, "c": 0.10, "d": 0.0}
DROP = {"a": 0.0001, "b": 0.004, "c": 0.0, "d": 0.002}


def _trial(quantized, names=NAMES, saving=SAVING, drop=DROP):
    plan = Plan.make({n: ("int8" if n in quantized else "fp32") for n in names})
    saved = sum(saving[n] for n in quantized)
    return TrialResult(plan=plan, speedup=1 / (1 - saved), accuracy_drop=sum(drop[n] for n in quantized))


def test_fit_recovers_additive_savings_and_drops():
    rng = np.random.default_rng(0)
    trials = [_trial({n for n in NAMES if rng.random() < 0.5}) for _ in range(40)]
    estimates = fit_additive(NAMES, trials, ridge=1e-6)
    assert estimates.trials == 40
    np.testing.assert_allclose(estimates.saving, [SAVING[n] for n in NAMES], atol=1e-4)
    np.testing.assert_allclose(estimates.drop, [DROP[n] for n in NAMES], atol=1e-6)


def test_too_few_or_failed_trials_give_no_estimate():
    trials = [_trial({"a"})] * (MIN_TRIALS - 1) + [TrialResult.failure(Plan.make(dict.fromkeys(NAMES, "int8")), "x")]
    assert fit_additive(NAMES, trials) is None


def test_observation_carries_the_estimates():
    space = tiny_space()
    steps = decisions(space)
    names = space.layer_names
    saving = {names[0]: 0.1, names[1]: 0.4, names[2]: 0.2, names[3]: 0.0}
    drop = {names[0]: 0.001, names[1]: 0.02, names[2]: 0.0, names[3]: 0.004}
    rng = np.random.default_rng(1)
    trials = [_trial({n for n in names if rng.random() < 0.5}, names, saving, drop) for _ in range(30)]
    estimates = fit_additive(names, trials, ridge=1e-6)
    plain = observe(space, steps, [1])
    informed = observe(space, steps, [1], estimates, accuracy_budget=0.01)
    assert plain.shape == informed.shape and np.all(plain[-4:] == 0)
    # second layer: the largest saving (1.0 relative) and a drop of 2 budgets (capped at 1)
    assert informed[-4] == pytest.approx(1.0, abs=1e-3)
    assert informed[-3] == pytest.approx(1.0)
    # so far: the first layer quantized, 0.001 drop = 0.1 budgets / 2, saving 0.1
    assert informed[-2] == pytest.approx(0.05, abs=1e-3)
    assert informed[-1] == pytest.approx(0.1, abs=1e-3)
    assert np.array_equal(plain[:-4], informed[:-4])
