"""Faults inside the trial process: a crash, a signal, a hang or an exception is a failed trial with its error,
the trial process is restarted, and the search goes on. Injected with tests/reliability/faults.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.harness import Evaluator, SetupError
from autotune.run.store import TrialStore
from autotune.run.trial import FAILED, OK, TIMEOUT
from autotune.tune import tune
from tests.reliability import faults
from tests.reliability.helpers import (
    ONE_LINERS_BEFORE_SEARCH,
    alive,
    cli,
    distinct_plans,
    fast_config,
    measure_counts,
    write_config,
)


def _faulty_config(root: Path, timeout_s: float, **overrides):
    return fast_config(
        root, metric={"name": "custom", "function": faults.METRIC}, backend={"timeout_s": timeout_s}, **overrides
    )


def test_crash_signal_hang_and_exception_each_become_a_failed_trial(tmp_path, monkeypatch):
    folder = faults.write_plan(tmp_path / "faults", {"2": "kill", "3": "segv", "4": "hang", "5": "raise"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=3)
    plans = distinct_plans(config, 6)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        first_pid = evaluator._child._process.pid
        results = [evaluator.evaluate(plan) for plan in plans]
        last_pid = evaluator._child._process.pid

        assert [r.status for r in results] == [OK, FAILED, FAILED, TIMEOUT, FAILED, OK]
        assert results[1].error == "the trial process died (exit code -9, SIGKILL)"
        assert results[2].error == "the trial process died (exit code -11, SIGSEGV)"
        assert results[3].error == "no result after 3 s; the trial process was killed"
        assert results[4].error.startswith("RuntimeError: injected metric failure")
        assert results[5].accuracy is not None and results[5].speedup > 0
        # each failure is committed once and never built again
        assert len(store) == 6 and set(measure_counts(store).values()) == {1}
        assert evaluator.builds == 6
        again = evaluator.evaluate(plans[1])
        assert again.from_store and again.error == results[1].error
        assert evaluator.cache_hits == 1 and faults.calls(folder) == 6
    assert first_pid != last_pid  # restarted after the crashes
    hung = int((folder / "hanging").read_text())
    for pid in (first_pid, last_pid, hung):
        assert not alive(pid), f"trial process {pid} outlived the evaluator"


def test_trial_process_killed_from_outside_during_a_trial(tmp_path, monkeypatch):
    """SIGKILL of the trial process mid-trial (the OOM killer, a user's kill -9): a failed trial, not a lost run."""
    folder = faults.write_plan(tmp_path / "faults", {"1": "hang"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=120)
    plans = distinct_plans(config, 2)

    def kill_when_hanging() -> None:
        deadline = time.monotonic() + 60
        while not (folder / "hanging").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(int((folder / "hanging").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_hanging, daemon=True)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        killer.start()
        started = time.monotonic()
        killed = evaluator.evaluate(plans[0])
        assert time.monotonic() - started < 60  # not the 120 s timeout
        assert killed.status == FAILED and killed.error == "the trial process died (exit code -9, SIGKILL)"
        assert evaluator.evaluate(plans[1]).ok
        assert len(store) == 2
    killer.join()


def test_trial_process_crash_while_preparing_is_a_clear_error_and_resumable(tmp_path, monkeypatch, capsys):
    folder = faults.write_plan(tmp_path / "faults", {"setup": "kill"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=30, budget={"builds": 3})
    with TrialStore(tmp_path / "direct.sqlite") as store:
        with pytest.raises(
            SetupError, match=r"the trial process died while preparing the run \(exit code -9, SIGKILL\)"
        ):
            Evaluator(config, store)

    code, err = cli(
        capsys,
        "baseline",
        write_config(tmp_path, config),
        "--strategy",
        "random",
        "--no-progress",
        "--set",
        "name=tiny",
    )
    assert code == 2
    assert err == "autotune: error: the trial process died while preparing the run (exit code -9, SIGKILL)\n"
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert len(store) == 0

    monkeypatch.delenv(faults.ENV)  # the cause is fixed: the run resumes and finishes
    code, err = cli(capsys, "resume", config.run_dir, "--no-progress")
    assert code == 0, err
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert len(store) == 3 and set(measure_counts(store).values()) == {1}


def test_the_search_goes_on_after_a_crash_and_a_hang(tmp_path, monkeypatch):
    before = ONE_LINERS_BEFORE_SEARCH  # the second and fourth builds' calls come after the one-liners'
    folder = faults.write_plan(tmp_path / "faults", {str(before + 2): "kill", str(before + 4): "hang"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=3, budget={"builds": 8})
    summary = tune(config, strategy="random", progress=False)

    with TrialStore(config.run_dir / "trials.sqlite") as store:
        statuses = [r.status for r in store.trials()]
        errors = [r.error for r in store.trials() if not r.ok]
        counts = measure_counts(store)
    # The kill and the hang two builds apart, wherever they land: a one-liner timed before the search that fails on
    # a loaded machine (its side-by-side measurement past its timeout) scores one call less before the builds.
    killed = statuses.index(FAILED)
    assert statuses.count(OK) == 6 and killed in (0, 1) and statuses[killed + 2] == TIMEOUT
    assert errors == [
        "the trial process died (exit code -9, SIGKILL)",
        "no result after 3 s; the trial process was killed",
    ]
    assert set(counts.values()) == {1}
    assert summary["builds"] == 8 and summary["winner"]["split"] == "holdout"
    assert (config.run_dir / "best" / "model.onnx").is_file()


def test_trial_process_ends_quietly_when_the_run_stops_mid_trial(tmp_path, monkeypatch, capfd):
    """After Ctrl-C the run closes the pipe while a trial is still running: no traceback from the trial process."""
    folder = faults.write_plan(tmp_path / "faults", {"1": "slow"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=60)
    plan = distinct_plans(config, 1)[0]
    with TrialStore(tmp_path / "trials.sqlite") as store:
        evaluator = Evaluator(config, store)
        process = evaluator._child._process
        evaluator._child._connection.send(("trial", (plan.to_dict(), "evaluation", None)))
        evaluator.close()  # as the interrupted run does, while the trial is still measuring
    assert faults.calls(folder) == 1  # the trial did run to its answer
    assert process.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_plan_that_kills_the_trial_process_side_by_side_costs_the_others_nothing(tmp_path, monkeypatch):
    # calls 1-2: the first two plans scored side by side, the second kills the process; then each alone:
    # call 3 the first (ok), call 4 the second (killed again), call 5 the third (ok)
    folder = faults.write_plan(tmp_path / "faults", {"2": "kill", "4": "kill"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = _faulty_config(tmp_path, timeout_s=30)
    plans = distinct_plans(config, 3)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        results = evaluator.measure_side_by_side(plans, "holdout")
        assert [r.status for r in results] == [OK, FAILED, OK]
        assert results[1].error == "the trial process died (exit code -9, SIGKILL)"
        assert all(r.speedup > 0 and r.split == "holdout" for r in (results[0], results[2]))
        assert len(store) == 0  # measured, not committed: side by side bypasses the store
    assert faults.calls(folder) == 5


def test_evaluate_reports_a_plan_that_aborts_the_runtime_in_one_line(tmp_path, monkeypatch, capfd):
    """A runtime's failed C++ assertion (SIGABRT) is a failed plan named in one line; the other plan is reported."""
    # call 1: both plans side by side, the first aborts; then each alone: call 2 the first (aborts), 3 the second
    folder = faults.write_plan(tmp_path / "faults", {"1": "abort", "2": "abort"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config_file = write_config(tmp_path, _faulty_config(tmp_path, timeout_s=30))
    capfd.readouterr()

    code = main(["evaluate", str(config_file), "--plan", "int8", "--plan", "fp32"])

    out, err = capfd.readouterr()
    assert code == 1
    assert (
        err
        == f"autotune: plan int8 failed: the trial process died (exit code -6, SIGABRT): python: {faults.ASSERTION}\n"
    )
    int8_row, fp32_row = out.splitlines()[1:]
    assert int8_row.split() == ["int8", *err.split()[3:]]  # the table's row says the same
    assert fp32_row.split()[0] == "fp32" and float(fp32_row.split()[1]) > 0
    assert faults.calls(folder) == 3
