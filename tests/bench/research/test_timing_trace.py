"""bench/research/timing_trace.py: the spells of a trace are told from the reference's pace."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "research"))
from timing_trace import spells  # noqa: E402


def test_a_spell_of_the_trace_is_found_with_its_length_and_its_own_ratio():
    # 3 s at 100 rows a second: quiet FP32 2.6 ms / INT8 1.3 ms (2x), and a 1 s spell at 2.9 / 1.9 ms.
    times = np.arange(300) / 100
    in_spell = (times >= 1.0) & (times < 2.0)
    fp32 = np.where(in_spell, 2.9, 2.6)
    int8 = np.where(in_spell, 1.9, 1.3)
    found = spells(np.column_stack([times, fp32, int8, fp32]))
    assert found["spells"] == 1 and found["longest_spell_s"] == pytest.approx(1.0)
    assert found["slow_fraction"] == pytest.approx(1 / 3, abs=0.02)
    assert found["int8_ratio_quiet"] == pytest.approx(2.0)
    assert found["int8_ratio_slow"] == pytest.approx(2.9 / 1.9)
    assert found["fp32_self_ratio"] == pytest.approx(1.0)
