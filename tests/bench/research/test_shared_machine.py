"""Tests for bench/research/shared_machine.py's summary of its runs (the runs themselves are the benchmark)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "shared_machine", Path(__file__).parents[3] / "bench" / "research" / "shared_machine.py"
)
shared_machine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared_machine)

QUIET = {"quiet": True, "contended": 0}


def _run(fp32, int8, busy=QUIET, note=None):
    return {"fp32": fp32, "int8": int8, "busy": busy, "note": note, "wall_s": 9.0}


def test_a_run_that_said_it_was_too_busy_is_left_out_of_the_trusted_figures():
    runs = [
        _run([1.0, 0.99], 1.90),
        _run([0.5, 0.97], 0.8, {"quiet": False, "contended": 9}, "autotune: note: the machine was too busy"),
        _run([1.01, 1.0], 1.95, {"quiet": True, "contended": 3}, "autotune: note: the machine was busy"),
        {"error": ["boom"], "wall_s": 1.0},
    ]
    summary = shared_machine.summarize(runs)
    assert summary["fp32_rows"] == [1.0, 0.99, 0.5, 0.97, 1.01, 1.0]
    assert summary["runs_said_busy"] == 2 and summary["runs_said_too_busy"] == 1
    assert summary["trusted_fp32_range"] == [0.99, 1.01]
    assert summary["trusted_int8_max_over_min"] == pytest.approx(1.95 / 1.90)
    assert summary["errors"] == [["boom"]]
