"""autotune.measure.confidence: the protocol's own noise, ties within it, and plans compared round by round."""

from __future__ import annotations

import pytest

from autotune.measure.confidence import SelfCheck, compare_rounds, ties_within


def test_two_plans_timed_side_by_side_compare_round_by_round():
    # per round: 1.25x, 0.8x, 1.2x of the baseline
    assert compare_rounds([2.5, 1.6, 1.8], [2.0, 2.0, 1.5]) == (pytest.approx(1.2), 2)
    assert compare_rounds([2.0, 2.0], [2.0, 2.0]) == (1.0, 0)  # a tie is not faster
    assert compare_rounds([2.0], [2.0, 2.0]) is None  # not the same rounds
    assert compare_rounds([], []) is None


def test_self_check_reads_its_noise_and_band_from_the_rounds():
    true = SelfCheck.of(1.01, [0.99, 1.01, 1.02])
    assert true.within_band and true.rounds == 3
    assert true.noise == pytest.approx(0.01)  # its distance from 1 exceeds half the rounds' IQR (0.0075)
    assert SelfCheck.of(1.0, [0.98, 0.99, 1.01, 1.02]).noise == pytest.approx(0.0125)  # the IQR's half exceeds it
    assert SelfCheck.of(1.0, [0.99, 1.0, 1.0, 1.0, 1.01, 1.6]).noise == pytest.approx(0.00375)  # one spoilt round
    shared = SelfCheck.of(0.69, [0.69, 2.07])  # FP32 against itself with another session spinning on the cores
    assert not shared.within_band
    assert shared.noise == pytest.approx(0.345)
    assert SelfCheck.of(1.05, []).noise == pytest.approx(0.05)  # one figure: its distance from 1
    assert SelfCheck.from_dict(true.to_dict()) == true
    assert "outside [0.97, 1.03]" in shared.describe() and "within" in true.describe()


def test_speedups_closer_than_the_noise_tie_with_the_fastest():
    assert ties_within([1.50, 1.49, 1.40, 1.51], 0.02) == [0, 1, 3]
    assert ties_within([1.50, 1.49, 1.40, 1.51], 0.0) == [3]
    assert ties_within([], 0.1) == []
