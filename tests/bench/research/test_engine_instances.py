"""bench/research/engine_instances.py: every engine is timed in every round, its floor from its fastest samples."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "research"))
from engine_instances import floor_ms, rotated_samples  # noqa: E402


def test_the_rounds_rotate_and_every_engine_gets_the_same_samples():
    calls: list[int] = []
    runs = [lambda index=index: calls.append(index) for index in range(3)]
    samples = rotated_samples(runs, rounds=3)
    assert [len(engine) for engine in samples] == [9, 9, 9]
    blocks = [engine for i, engine in enumerate(calls) if i == 0 or calls[i - 1] != engine]
    assert blocks == [0, 1, 2, 1, 2, 0, 2, 0, 1]  # round r starts at engine r


def test_the_floor_is_the_mean_of_the_fastest_quarter():
    assert floor_ms([4.0, 1.0, 3.0, 2.0, 9.0, 8.0, 7.0, 6.0]) == pytest.approx(1.5)
