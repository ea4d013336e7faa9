"""bench/run.py: strategies x seeds, in one process or several at once, each pinned to its own cores."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config.schema import dump_config
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.testing import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _bench(config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "bench" / "run.py"), str(config), "--strategies", "fp32", "random"]
    command += ["--seeds", "0", "1", "--budget", "3", "--out", str(out), *extra]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, cwd=ROOT)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to run two runs at once")
def test_parallel_runs_each_pin_their_own_cores_and_report_every_run(tmp_path):
    config = tmp_path / "tiny.yaml"
    fast = {
        "measure": {"warmup": 1, "repeats": 1, "rounds": 1, "settle_s": 0, "busy_patience_s": 0, "busy_others": None},
        "confirm": {"top_k": 2, "repeats": 1, "rounds": 1},
    }
    config.write_text(dump_config(tiny_config(tmp_path, **fast)))
    out = tmp_path / "bench"
    done = _bench(config, out, "--jobs", "2", "--cores-per-job", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert [(r["strategy"], r["seed"]) for r in results] == [("fp32", 0), ("random", 0), ("random", 1)]
    assert all(r["builds"] <= 3 for r in results)
    for row in results:  # the exported plan is kept with the figures, to be measured again after the runs are gone
        exported = out / "runs" / f"{row['strategy']}-s{row['seed']}" / "best" / "plan.json"
        assert row["winner_plan"] == json.loads(exported.read_text())
    children = [r for r in results if r["strategy"] == "random"]
    assert all(len(r["cpus"]) == 1 for r in children)  # pinned: one core each, not the whole machine
    assert len(results[0]["cpus"]) == len(os.sched_getaffinity(0))  # the first run went alone, unpinned
    assert (out / "parts" / "random-s1.json").exists()
    with TrialStore(out / "runs" / "random-s1" / "trials.sqlite") as store:
        paid = sum(trial.total_s for trial in store.trials())
    assert paid > 0 and children[1]["trial_s"] == pytest.approx(paid)
    assert "2 runs at a time" in (out / "results.md").read_text()
    # a second call finds every run finished and measures nothing again
    trials_before = {r["seed"]: r["builds"] for r in children}
    again = _bench(config, out, "--jobs", "2", "--cores-per-job", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert {r["seed"]: r["builds"] for r in json.loads((out / "results.json").read_text())[1:]} == trials_before
    # --report runs nothing and tabulates what the runs hold
    report = _bench(config, out, "--report")
    assert report.returncode == 0, report.stdout + report.stderr
    text = (out / "results.md").read_text()
    assert "Report of the runs" in text and "Unfinished" not in text
    assert "| random | 2 |" in text and "| fp32 | 1 |" in text
    # every run measured the backend's one-liners beside its finalists: one row each, over the three runs
    assert re.search(r"^\| ort-static \(one-liner\) \| 3 runs \| - \| \d", text, flags=re.M), text
    assert re.search(r"^\| ort-dynamic \(one-liner\) \| 3 runs \| - \| \d", text, flags=re.M), text
    # --reevaluate measures every finished run's exported winner again, here, side by side with the one-liners
    again = _bench(config, out, "--reevaluate")
    assert again.returncode == 0, again.stdout + again.stderr
    rows = json.loads((out / "reevaluated.json").read_text())
    runs = [("fp32", 0), ("random", 0), ("random", 1)]
    assert [(r["strategy"], r["seed"]) for r in rows] == [*runs, ("ort-static", 0), ("ort-dynamic", 0)]
    for row in rows[3:]:  # the one-liners, measured in the same rounds as the winners
        assert row["plan"] == f"reference {row['strategy']} (the backend's one-liner)"
        assert row["speedup"] > 0 and row["error"] is None
    for row in rows[:3]:
        exported = json.loads((out / "runs" / f"{row['strategy']}-s{row['seed']}" / "best" / "plan.json").read_text())
        assert row["plan"] == Plan.from_dict(exported).describe()
        assert row["speedup"] > 0 and row["error"] is None
    assert "| random | 2 |" in (out / "reevaluated.md").read_text()


def test_the_table_times_every_strategy_against_greedys_confirmed_speedup():
    from bench.run import greedy_rows

    def run(strategy, confirmed, curve):
        return {"strategy": strategy, "confirmed_winner": {"speedup": confirmed}, "speedup_curve": curve}

    results = [
        run("greedy", 2.0, [1.0, 1.5, 1.99]),
        run("ppo", 2.1, [1.0, 1.97, 2.1]),
        run("ppo", 2.0, [1.0, 1.0, 1.5]),
    ]
    lines = greedy_rows(results)
    assert "(1.96x)" in lines[1]
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[3:]}
    assert rows["greedy"].endswith("| 3 |")
    assert rows["ppo"].endswith("| 2 (1/2 never) |")
    assert greedy_rows([run("ppo", 2.0, [1.0])]) == []


def test_a_winner_is_compared_with_greedy_round_by_round():
    from bench.run import over_rounds

    greedy = {"round_speedups": [1.0, 2.0, 1.5, 1.2]}
    agent = {"round_speedups": [1.1, 2.4, 1.2, 1.5]}  # per round: 1.1x, 1.2x, 0.8x, 1.25x of greedy
    assert over_rounds(agent, greedy) == "1.15x (3/4 rounds faster)"
    assert over_rounds(greedy, greedy) == "-"
    assert over_rounds(agent, None) == "-"
    assert over_rounds(agent, {"round_speedups": [1.0, 2.0]}) == "-"  # not timed in the same rounds
