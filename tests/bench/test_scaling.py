"""bench/scaling.py on the tiny model: the scaling runs, the interference figure, the winners re-measured alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config.schema import dump_config
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.testing import tiny_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import scaling  # noqa: E402


def test_search_rate_counts_the_first_trial_from_the_start_of_the_search():
    plan = Plan.make({"a": "int8"})
    trials = [TrialResult(plan=plan, created_at=100.0 + 10 * i, total_s=10.0) for i in range(6)]
    rate = scaling.search_rate(trials)
    assert rate["search_s"] == pytest.approx(60.0)  # 50 s between the first and last commit, plus one trial
    assert rate["builds_per_minute"] == pytest.approx(6.0)
    assert rate["trial_s_mean"] == pytest.approx(10.0) and rate["busy_share"] == pytest.approx(1.0)
    # The same six trials on two workers: each worker was busy half of the 60 s.
    assert scaling.search_rate(trials, workers=2)["busy_share"] == pytest.approx(0.5)
    assert scaling.search_rate([])["builds_per_minute"] == 0.0


def test_ratios_compare_each_rate_with_n_times_one_worker():
    results = {"scaling": {"1": {"builds_per_minute": 2.0}, "4": {"builds_per_minute": 6.0}}}
    scaling.add_ratios(results)
    assert results["scaling"]["4"]["ratio"] == pytest.approx(0.75) and results["scaling"]["1"]["ratio"] == 1.0


def test_the_topology_counts_each_physical_core_once(monkeypatch, tmp_path):
    # Four CPUs, two cores of two hyperthreads: workers on 0 and 2 share nothing, workers on 0 and 1 share a core.
    siblings = {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}
    for cpu, text in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    topology = scaling.cpu_topology(sysfs=tmp_path)
    assert (topology["cpus"], topology["physical_cores"]) == (4, 2)
    assert topology["summary"] == "4 CPUs on 2 physical cores (2 threads each)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs for two workers")
def test_scaling_interference_and_reevaluation_on_the_tiny_model(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(tiny_config(tmp_path, confirm={"top_k": 1, "repeats": 2, "rounds": 1})))
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "scaling.py"), str(config), "--workers", "1", "2"]
    command += ["--cores-per-worker", "1", "--budget", "4", "--interference", "2", "--plans", "2"]
    command += ["--reevaluate", "--out", str(out)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "scaling.json").read_text())
    for key in ("1", "2"):
        row = results["scaling"][key]
        assert row["builds"] == 4 and row["builds_per_minute"] > 0
        assert row["winner_speedup_confirmed"] > 0 and row["winner_speedup_alone"] > 0
    assert results["scaling"]["1"]["ratio"] == 1.0 and results["scaling"]["2"]["ratio"] > 0
    rows = results["interference"]["2"]
    assert len(rows) == 2 and all(r["speedup_alone"] > 0 and r["speedup_busy"] > 0 for r in rows)
    table = (out / "scaling.md").read_text()
    assert "| 2 | 4 |" in table and "--interference 2" in table
    assert len(results["commands"]) == 1 and results["cpus"]["cpus"] == len(os.sched_getaffinity(0))
