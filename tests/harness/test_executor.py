"""Trials side by side on local workers: disjoint cores, results in completion order, a dead worker's trial tried
again on another worker, and a run of several workers that spends its budget exactly."""

from __future__ import annotations

import os

import pytest

from autotune.config.schema import ConfigError
from autotune.harness import Evaluator
from autotune.harness.executor import LocalPool, core_groups
from autotune.run.store import TrialStore
from autotune.run.trial import FAILED, OK
from autotune.tune import tune
from tests.reliability import faults
from tests.reliability.helpers import distinct_plans, fast_config, measure_counts

TWO_WORKERS = {"workers": 2}
ONE_THREAD = {"intra_op_threads": 1, "timeout_s": 120}


def test_core_groups_are_disjoint_and_too_many_workers_get_one_line():
    assert core_groups(3, 2, [7, 1, 2, 3, 4, 5, 6]) == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(ConfigError, match=r"execution.workers 4 x backend.intra_op_threads 2 needs 8 CPUs, but"):
        core_groups(4, 2, [0, 1, 2, 3])


def test_execution_config_is_validated_like_the_rest(tmp_path):
    with pytest.raises(ConfigError, match="execution.worker: unknown key"):
        fast_config(tmp_path, execution={"worker": 2})
    with pytest.raises(ConfigError, match="ray_address is only used with backend: ray"):
        fast_config(tmp_path, execution={"workers": 2, "ray_address": "auto"})
    with pytest.raises(ConfigError, match="execution.backend"):
        fast_config(tmp_path, execution={"backend": "dask"})


def test_workers_run_on_their_own_cores_and_every_result_is_committed_once(tmp_path):
    config = fast_config(tmp_path, execution=TWO_WORKERS, backend=ONE_THREAD)
    plans = distinct_plans(config, 5)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        pool = evaluator._pool
        assert isinstance(pool, LocalPool) and evaluator.workers == 2
        pinned = [os.sched_getaffinity(child.pid) for child in pool.children]
        assert pinned[0].isdisjoint(pinned[1]) and all(len(cores) == 1 for cores in pinned)
        results = list(evaluator.evaluate_many([*plans, plans[0]], limit=4))
        assert sorted(r.plan_hash for r in results) == sorted(p.hash for p in plans[:4])
        assert all(r.status == OK and r.speedup > 0 for r in results)
        assert len(store) == 4 and set(measure_counts(store).values()) == {1} and evaluator.builds == 4
        again = list(evaluator.evaluate_many(plans))  # four from the store, one new build
        assert sum(r.from_store for r in again) == 4 and len(store) == 5
        assert evaluator.confirm(plans[0]).split == "holdout"  # on one worker, as in a run of one


def test_a_worker_killed_mid_trial_is_replaced_and_its_trial_runs_again_elsewhere(tmp_path, monkeypatch):
    folder = faults.write_plan(tmp_path / "faults", {"*": "kill-once"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = fast_config(
        tmp_path, execution=TWO_WORKERS, backend=ONE_THREAD, metric={"name": "custom", "function": faults.METRIC}
    )
    plans = distinct_plans(config, 4)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        results = list(evaluator.evaluate_many(plans))
        assert (folder / "killed").exists()
        assert [r.status for r in results] == [OK] * 4  # the killed trial was tried again, not lost
        assert evaluator._pool.replaced == 1
        assert len(store) == 4 and set(measure_counts(store).values()) == {1}


def test_a_trial_whose_worker_dies_twice_is_a_failed_trial_and_the_run_goes_on(tmp_path, monkeypatch):
    folder = faults.write_plan(tmp_path / "faults", {"*": "kill"})
    monkeypatch.setenv(faults.ENV, str(folder))
    config = fast_config(
        tmp_path, execution=TWO_WORKERS, backend=ONE_THREAD, metric={"name": "custom", "function": faults.METRIC}
    )
    plans = distinct_plans(config, 2)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        results = list(evaluator.evaluate_many(plans))
        assert [r.status for r in results] == [FAILED, FAILED]
        assert all(r.error == "the trial process died (exit code -9, SIGKILL)" for r in results)
        assert evaluator._pool.replaced == 4  # each trial: its worker, then the one it was retried on
        assert len(store) == 2


@pytest.mark.parametrize("strategy", ["random", "greedy", "optuna", "ppo"])
def test_a_run_of_two_workers_spends_the_budget_exactly(tmp_path, strategy):
    budget = 10
    config = fast_config(
        tmp_path, budget={"builds": budget}, execution=TWO_WORKERS, backend=ONE_THREAD, ppo={"episodes_per_update": 2}
    )
    summary = tune(config, strategy=strategy, progress=False)
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert set(measure_counts(store).values()) == {1}
        built = len(store)
    assert built == budget if strategy != "greedy" else 1 < built <= budget
    assert summary["builds"] == built and summary["winner"]["speedup"] > 0
