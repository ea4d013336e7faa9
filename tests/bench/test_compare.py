"""bench/compare.py: a benchmark falls below the stored one by more than its noise, and the check says so."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from compare import noise, regressions  # noqa: E402

STORED = ROOT / "bench" / "results" / "minilm-cpu" / "reevaluated.json"


def _rows():
    return json.loads(STORED.read_text())


def _scale(rows, strategy, factor):
    rows = copy.deepcopy(rows)
    for row in rows:
        if row["strategy"] == strategy:
            row["speedup"] *= factor
    return rows


def test_the_stored_results_pass_against_themselves():
    assert regressions(_rows(), _rows()) == []


def test_a_planted_fall_beyond_the_noise_names_the_strategy_and_the_figure():
    stored = _rows()
    allowed = noise(stored, "greedy")
    found = regressions(_scale(stored, "greedy", 1 - 2 * allowed), stored)
    assert len(found) == 1 and found[0].startswith("greedy:") and "stored 1.55x" in found[0]


def test_a_fall_within_the_noise_passes():
    stored = _rows()
    allowed = noise(stored, "ppo")
    assert allowed > 0.02  # three seeds spread wider than the floor
    assert regressions(_scale(stored, "ppo", 1 - allowed / 2), stored) == []


def test_a_winner_over_the_budget_is_a_regression():
    stored = _rows()
    current = copy.deepcopy(stored)
    for row in current:
        if row["strategy"] == "greedy":
            row["within_budget"] = False
    assert any("greedy: no run within the accuracy budget" in line for line in regressions(current, stored))


@pytest.mark.parametrize("factor, code", [(1.0, 0), (0.5, 1)])
def test_the_command_exits_1_on_a_regression(tmp_path, factor, code):
    current = tmp_path / "now.json"
    current.write_text(json.dumps(_scale(_rows(), "optuna", factor)))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "compare.py"), str(current), str(STORED)], capture_output=True, text=True
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert ("optuna: median speedup" in done.stderr) == (code == 1)


def test_a_fall_inside_the_new_benchmark_s_own_fp32_noise_is_a_tie():
    stored = [
        {"strategy": "fp32", "speedup": 1.0, "round_speedups": [1.0, 1.0], "within_budget": True},
        {"strategy": "greedy", "speedup": 1.50, "round_speedups": [], "within_budget": True},
    ]
    fell = copy.deepcopy(stored)
    fell[1]["speedup"] = 1.40  # 6.7 % below: beyond the stored noise (the 2 % floor)
    assert regressions(fell, stored)
    noisy = copy.deepcopy(fell)
    noisy[0].update(speedup=1.0, round_speedups=[0.8, 1.2])  # this machine's FP32 reads +-10 % of itself (IQR)
    assert noise(stored, "greedy", noisy) == pytest.approx(0.1)
    assert regressions(noisy, stored) == []
