"""The same trials on Ray Core actors (a local Ray cluster of 2 CPUs, started once for the module): a parallel
run, a worker killed mid-trial, and resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.harness import Evaluator
from autotune.harness.executor import RayPool
from autotune.run.store import TrialStore
from autotune.run.trial import OK
from autotune.tune import tune
from tests.reliability import faults
from tests.reliability.helpers import REPO, distinct_plans, fast_config, measure_counts

ray = pytest.importorskip("ray")
RAY = {"workers": 2, "backend": "ray"}
ONE_THREAD = {"intra_op_threads": 1, "timeout_s": 120}


@pytest.fixture(scope="module")
def fault_folder(tmp_path_factory) -> Path:
    """A local Ray cluster whose workers import this checkout and read the fault plan of the folder returned."""
    folder = faults.write_plan(tmp_path_factory.mktemp("faults"), {})
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), faults.ENV: str(folder)}},
    )
    yield folder
    ray.shutdown()


def test_a_run_on_ray_actors_spends_the_budget_and_resumes(tmp_path, fault_folder):
    faults.write_plan(fault_folder, {})
    config = fast_config(tmp_path, budget={"builds": 6}, execution=RAY, backend=ONE_THREAD)
    summary = tune(config, strategy="random", progress=False)
    store_path = config.run_dir / "trials.sqlite"
    with TrialStore(store_path) as store:
        assert len(store) == 6 and set(measure_counts(store).values()) == {1}
        before = {r.plan_hash: r.to_dict() for r in store.trials()}
    assert summary["winner"]["speedup"] > 0
    (config.run_dir / "summary.json").unlink()
    again = tune(resume_dir=config.run_dir, progress=False)  # nothing left to build: the store answers
    with TrialStore(store_path) as store:
        assert {r.plan_hash: r.to_dict() for r in store.trials()} == before
    assert again["plan_hash"] == summary["plan_hash"]


def test_a_ray_worker_killed_mid_trial_is_replaced_and_its_trial_runs_again(tmp_path, fault_folder):
    faults.write_plan(fault_folder, {"*": "kill-once"})
    (fault_folder / "killed").unlink(missing_ok=True)
    config = fast_config(
        tmp_path, execution=RAY, backend=ONE_THREAD, metric={"name": "custom", "function": faults.METRIC}
    )
    plans = distinct_plans(config, 4)
    with TrialStore(tmp_path / "trials.sqlite") as store, Evaluator(config, store) as evaluator:
        assert isinstance(evaluator._pool, RayPool)
        results = list(evaluator.evaluate_many(plans))
        assert (fault_folder / "killed").exists()
        assert [r.status for r in results] == [OK] * 4
        assert evaluator._pool.replaced == 1
        assert len(store) == 4 and set(measure_counts(store).values()) == {1}
