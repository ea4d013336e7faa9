"""Tests for autotune.search.reward with hand-computed values."""

from __future__ import annotations

import math

import pytest

from autotune.config.schema import RewardConfig
from autotune.plan import Plan
from autotune.run.trial import TIMEOUT, TrialResult
from autotune.search.reward import meets_budget, reward

PLAN = Plan.make({"fc1": "int8"})


def _ok(speedup: float | None, drop: float | None) -> TrialResult:
    return TrialResult(plan=PLAN, speedup=speedup, accuracy_drop=drop)


def test_log_speedup_within_budget():
    config = RewardConfig()
    assert reward(_ok(2.0, 0.0), config, 0.01) == pytest.approx(math.log(2.0))
    assert reward(_ok(2.0, 0.01), config, 0.01) == pytest.approx(math.log(2.0))  # at the budget: no penalty
    assert reward(_ok(1.0, 0.005), config, 0.01) == pytest.approx(0.0)
    assert reward(_ok(0.5, 0.0), config, 0.01) == pytest.approx(-math.log(2.0))


def test_negative_drop_no_bonus():
    assert reward(_ok(3.0, -0.2), RewardConfig(), 0.01) == pytest.approx(math.log(3.0))


def test_penalty_only_above_budget():
    config = RewardConfig(accuracy_penalty=100.0, penalty_units="metric")
    # drop 0.03, budget 0.01: excess 0.02 x 100 = 2
    assert reward(_ok(2.0, 0.03), config, 0.01) == pytest.approx(math.log(2.0) - 2.0)
    # penalty 10, drop 0.5, budget 0.1: excess 0.4 x 10 = 4
    assert reward(_ok(4.0, 0.5), RewardConfig(accuracy_penalty=10.0, penalty_units="metric"), 0.1) == pytest.approx(
        math.log(4.0) - 4.0
    )
    assert reward(_ok(4.0, 0.5), RewardConfig(accuracy_penalty=0.0, penalty_units="metric"), 0.1) == pytest.approx(
        math.log(4.0)
    )
    assert reward(_ok(2.0, 0.03), config, 0.0) == pytest.approx(math.log(2.0) - 3.0)


def test_penalty_in_budget_units_is_scale_free():
    config = RewardConfig(accuracy_penalty=5.0)
    # 10% over a budget of 0.002 costs 0.5, the same as 10% over a budget of 0.2
    assert reward(_ok(2.0, 0.0022), config, 0.002) == pytest.approx(math.log(2.0) - 0.5)
    assert reward(_ok(2.0, 0.22), config, 0.2) == pytest.approx(math.log(2.0) - 0.5)
    assert reward(_ok(2.0, 0.0019), config, 0.002) == pytest.approx(math.log(2.0))
    # a zero budget has no scale: the excess stays in metric units
    assert reward(_ok(2.0, 0.03), config, 0.0) == pytest.approx(math.log(2.0) - 0.15)


def test_failure_gets_config_failure():
    config = RewardConfig(failure=-7.5)
    assert reward(TrialResult.failure(PLAN, "BuildError: x"), config, 0.01) == -7.5
    assert (
        reward(TrialResult.failure(PLAN, "slow", status=TIMEOUT, speedup=5.0, accuracy_drop=0.0), config, 0.01) == -7.5
    )
    assert reward(TrialResult.failure(PLAN, "x"), RewardConfig(), 0.01) == -1.0


@pytest.mark.parametrize(("speedup", "drop"), [(None, 0.0), (2.0, None), (0.0, 0.0), (-1.0, 0.0)])
def test_incomplete_ok_result_is_failure(speedup, drop):
    assert reward(_ok(speedup, drop), RewardConfig(failure=-3.0), 0.01) == -3.0


def test_meets_budget():
    assert meets_budget(_ok(2.0, 0.0), 0.01)
    assert meets_budget(_ok(2.0, 0.01), 0.01)
    assert not meets_budget(_ok(2.0, 0.0100001), 0.01)
    assert meets_budget(_ok(0.5, -0.1), 0.0)
    assert not meets_budget(_ok(2.0, None), 0.01)
    assert not meets_budget(TrialResult.failure(PLAN, "x", accuracy_drop=0.0), 0.01)


def test_speedups_within_the_tie_noise_earn_the_same_gain():
    from autotune.search.reward import latency_gain

    tied = RewardConfig(tie_within=0.05)
    assert reward(_ok(1.50, 0.0), tied, 0.01) == reward(_ok(1.51, 0.0), tied, 0.01)
    assert reward(_ok(1.50, 0.0), tied, 0.01) < reward(_ok(1.70, 0.0), tied, 0.01)
    assert latency_gain(1.0, 0.05) == 0.0 and latency_gain(1.01, 0.05) == 0.0
    assert latency_gain(1.5, None) == pytest.approx(math.log(1.5))
    assert latency_gain(1.5, 0.0) == pytest.approx(math.log(1.5))
    assert abs(latency_gain(1.5, 0.05) - math.log(1.5)) <= math.log1p(0.05) / 2 + 1e-12
