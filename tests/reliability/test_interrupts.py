"""Ctrl-C, SIGTERM and SIGKILL of a whole run: the store stays consistent, no process is left behind, and
`autotune resume` finishes the run without losing a committed trial or measuring one twice. SIGKILL during the
search and during a store write are in tests/test_tune.py and tests/run/test_store.py."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections import Counter
from contextlib import closing

import onnx
import pytest

from autotune.run.store import TrialStore
from tests.reliability import faults
from tests.reliability.helpers import (
    ONE_LINERS_BEFORE_SEARCH,
    alive,
    assert_resumed_cleanly,
    autotune,
    children,
    env,
    fast_config,
    integrity,
    snapshot,
    start,
    trial_count,
    wait_for,
    write_config,
)


def _stop(process) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


@pytest.mark.parametrize(
    ("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)], ids=["Ctrl-C", "SIGTERM"]
)
def test_ctrl_c_or_sigterm_ends_the_run_cleanly_and_resume_finishes_it(tmp_path, signum, exit_code):
    """Ctrl-C in a terminal, and SIGTERM from `timeout` or a batch scheduler, reach the whole process group."""
    budget = 24
    config = fast_config(
        tmp_path,
        budget={"builds": budget},
        # A few imagined episodes per update and no priors (they start the rehearsals from the first build): the
        # test is about the interrupt, and on a model whose builds take milliseconds the rehearsals set the pace.
        ppo={"episodes_per_update": 2, "checkpoint_every_builds": 5, "imagined_episodes": 8},
        planner={"priors": False},
    )
    store_path = config.run_dir / "trials.sqlite"
    process = start("tune", write_config(tmp_path, config), "--no-progress", cwd=tmp_path)
    try:
        wait_for(lambda: trial_count(store_path) >= 8, process, what="8 trials")
        helpers = children(process.pid)  # the trial process (and multiprocessing's resource tracker)
        assert helpers
        os.killpg(process.pid, signum)
        _, err = process.communicate(timeout=60)
    finally:
        _stop(process)

    assert process.returncode == exit_code, err
    assert "autotune: interrupted; measured trials are kept: continue with `autotune resume" in err
    assert "Traceback" not in err  # neither the run nor its trial process prints one
    assert integrity(store_path) == [("ok",)]
    assert (config.run_dir / "checkpoints" / "latest.zip").is_file()  # the agent is saved at the interrupt
    assert not (config.run_dir / "summary.json").exists()
    for pid in helpers:
        wait_for(lambda pid=pid: not alive(pid), timeout=10, what=f"helper process {pid} to end")
    before = snapshot(store_path)
    assert 8 <= len(before) < budget
    wall_at_interrupt = _wall_s(store_path)
    assert wall_at_interrupt > 0  # the time spent so far is kept with the trials
    assert {result["status"] for result in before.values()} == {"ok"}  # the trial process was not killed mid-trial

    resumed = autotune("resume", config.run_dir, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_cleanly(store_path, before, budget)
    assert "winner" in resumed.stdout and (config.run_dir / "summary.json").is_file()
    assert _wall_s(store_path) > wall_at_interrupt  # the resumed run adds its time to it


def test_ctrl_c_with_workers_side_by_side_leaves_no_worker_and_resume_finishes(tmp_path):
    """Two trial workers, each on its own core: Ctrl-C mid-search ends both, and the resumed run (also on two
    workers) measures no committed trial again and spends the budget exactly."""
    budget = 16
    config = fast_config(
        tmp_path,
        budget={"builds": budget},
        ppo={"episodes_per_update": 2, "checkpoint_every_builds": 4, "imagined_episodes": 8},
        planner={"priors": False},
        execution={"workers": 2},
        backend={"intra_op_threads": 1},
    )
    store_path = config.run_dir / "trials.sqlite"
    process = start("tune", write_config(tmp_path, config), "--no-progress", cwd=tmp_path)
    try:
        wait_for(lambda: trial_count(store_path) >= 6, process, what="6 trials")
        helpers = children(process.pid)
        assert len(helpers) >= 2  # both workers
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        _stop(process)

    assert process.returncode == 130, err
    assert "Traceback" not in err
    for pid in helpers:
        wait_for(lambda pid=pid: not alive(pid), timeout=10, what=f"worker {pid} to end")
    before = snapshot(store_path)
    assert 6 <= len(before) < budget
    resumed = autotune("resume", config.run_dir, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_cleanly(store_path, before, budget)


def _wall_s(store_path):
    with closing(sqlite3.connect(store_path)) as db:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'wall_s'").fetchone()
    return json.loads(value)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_run_killed_while_confirming_leaves_no_orphan_and_resume_confirms_without_building_again(tmp_path, signum):
    """The run is killed while its trial process is busy (here: hung) on the second plan of its confirmation,
    which measures the finalists side by side in one request: nothing of it is committed, and the resume confirms
    them all again without building a trial of the search. SIGTERM to the run alone (`kill PID`) stops it as
    Ctrl-C does, and the same guarantees hold."""
    budget = 6
    folder = faults.write_plan(tmp_path / "faults", {str(ONE_LINERS_BEFORE_SEARCH + budget + 2): "hang"})
    config = fast_config(
        tmp_path,
        budget={"builds": budget},
        metric={"name": "custom", "function": faults.METRIC},
        backend={"timeout_s": 300},
    )
    path = write_config(tmp_path, config)
    store_path = config.run_dir / "trials.sqlite"
    faulty = env(**{faults.ENV: str(folder)})
    process = start(
        "baseline", path, "--strategy", "random", "--no-progress", "--set", "name=tiny", cwd=tmp_path, env=faulty
    )
    try:
        wait_for(lambda: (folder / "hanging").exists(), process, what="the second plan of the confirmation")
        hung = int((folder / "hanging").read_text())
        process.send_signal(signum)  # the run only, as `kill -9 PID` or `kill PID` does
        process.communicate(timeout=30)
    finally:
        _stop(process)
    wait_for(lambda: not alive(hung), timeout=10, what="the hung trial process to end with its run")

    assert integrity(store_path) == [("ok",)]
    before = snapshot(store_path)
    with TrialStore(store_path) as store:
        assert len(before) == budget and store.confirmations() == {} and store.references() == {}

    resumed = autotune("resume", config.run_dir, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_cleanly(store_path, before, budget)
    with TrialStore(store_path) as store:
        confirmed = [*store.confirmations().values(), *store.references().values()]
    # the finalists (top_k 2), FP32 and the two one-liners, timed in the same rounds (plans confirmed after them,
    # when no finalist meets the budget, are timed alone)
    shared = Counter(result.reference_latency_ms for result in confirmed).most_common(1)[0][1]
    assert shared == 5
    summary = json.loads((config.run_dir / "summary.json").read_text())
    assert json.loads((config.run_dir / "best" / "plan.json").read_text())["precisions"]
    assert json.loads((config.run_dir / "best" / "summary.json").read_text())["plan_hash"] == summary["plan_hash"]
    onnx.checker.check_model(onnx.load(str(config.run_dir / "best" / "model.onnx")))
