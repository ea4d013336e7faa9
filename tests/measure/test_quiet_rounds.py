"""Tests for autotune.measure.quiet_rounds: which rounds of a measurement count, judged on made-up round medians."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autotune.measure.quiet_rounds import (
    PACE_WINDOW_S,
    SPELL_BAND,
    SPREAD_MIN_ROUNDS,
    ReferencePace,
    quiet_rows,
    shared_rows,
    spread_band,
)


def test_the_spread_band_reads_the_scatter_of_the_fastest_rounds_and_ignores_a_spell():
    rng = np.random.default_rng(0)
    scatter = 2.0 * (1.0 + np.abs(rng.normal(0.0, 0.05, size=24)))  # an idle machine whose rounds scatter by 5 %
    band = spread_band(scatter)
    assert 0.05 < band <= SPELL_BAND  # wider than the default quiet band
    assert spread_band(scatter[::-1]) == pytest.approx(band)  # the order of the rounds is no part of it
    assert np.mean(scatter <= scatter.min() * (1 + band)) > 0.7  # most of its rounds fit the band
    spelled = np.concatenate([scatter, 2.0 * np.full(30, 1.13)])  # more rounds in a spell than out of it
    assert spread_band(spelled) == pytest.approx(band)  # the spell's rounds are no part of the scatter
    assert spread_band(scatter[: SPREAD_MIN_ROUNDS - 1]) == 0.0  # too few rounds to tell a spell from a scatter


def test_a_round_counts_for_each_plan_at_its_own_pace_and_plans_share_rounds_where_they_can():
    # reference, two plans; plan 1 hiccups in round 1, plan 2 in round 3; the reference is slow in round 4
    medians = np.array(
        [
            [2.0, 2.0, 2.0, 2.0, 2.6, 2.0],
            [1.0, 2.0, 1.0, 1.0, 1.0, 1.0],
            [1.5, 1.5, 1.5, 3.0, 1.5, 1.5],
        ]
    )
    rows = quiet_rows(medians, list(range(6)), 0.05, ReferencePace())
    assert rows == [[0, 2, 3, 5], [0, 1, 2, 5]]
    assert shared_rows(rows, 3) == [[0, 2, 5], [0, 2, 5]]  # three rounds quiet for both: compared in the same
    assert shared_rows(rows, 4) == rows  # too few in common: each plan's own
    assert quiet_rows(medians, list(range(6)), None, ReferencePace()) == [list(range(6))] * 2  # no band: all


def test_a_measurement_whole_in_a_spell_counts_no_round_against_the_last_minutes_pace():
    now = [0.0]
    pace = ReferencePace(clock=lambda: now[0])
    pace.add(2.0, 1.0)
    medians = np.array([[2.3, 2.3, 2.32], [1.4, 1.4, 1.4]])  # FP32 15 % slower than a moment ago
    assert quiet_rows(medians, [0, 1, 2], 0.05, pace) == [[]]
    now[0] = PACE_WINDOW_S + 1.0  # minutes later the same pace is the machine's
    assert quiet_rows(medians, [0, 1, 2], 0.05, pace) == [[0, 1, 2]]


def test_the_remembered_pace_counts_within_a_processs_first_window_only():
    now = [0.0]
    pace = ReferencePace(clock=lambda: now[0], remembered_ms=2.0)
    assert pace.quiet_ms == 2.0 and pace.behind(2.3) and pace.slower_by(2.3) == pytest.approx(0.15)
    pace.add(2.3, 1.0)
    assert pace.recent_ms == 2.3  # what the process writes for the next: its own pace, never the one it was told
    now[0] = PACE_WINDOW_S + 1.0
    pace.add(2.3, 1.0)
    assert pace.quiet_ms == 2.3 and not pace.behind(2.3)
    now[0] = 3 * PACE_WINDOW_S
    assert pace.recent_ms == math.inf  # nothing timed in the last minute


def test_a_pace_whose_rounds_scatter_more_than_a_spell_slows_them_sees_no_spell_in_a_few_slow_rounds():
    now = [0.0]
    pace = ReferencePace(clock=lambda: now[0])
    for k in range(40):  # a model timed in microseconds: its rounds scatter by a third
        now[0] += 0.1
        pace.add(0.010 * (1.0 + 0.33 * (k % 3)), 0.1)
    pace.begin()
    assert pace.spell_band() > 0.3 and not pace.behind(0.0115)  # 15 % above its fastest: its own scatter
    steady = ReferencePace(clock=lambda: now[0])
    for _ in range(40):
        steady.add(2.0, 0.1)
    steady.begin()
    assert steady.spell_band() == SPELL_BAND and steady.behind(2.3)
