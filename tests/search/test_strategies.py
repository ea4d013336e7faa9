import dataclasses

import pytest

from autotune.config.schema import ConfigError
from autotune.config.views import SearchSettings
from autotune.run.store import TrialStore
from autotune.search import strategies
from autotune.search.driver import Driver
from autotune.search.registry import STRATEGIES, SearchInputs
from autotune.search.reward import meets_budget
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space
from autotune.tune import tune
from tests.reliability.helpers import measure_counts


@pytest.fixture()
def space():
    return tiny_space()


class Harness:
    """A store-like harness over the synthetic evaluator: builds count distinct plans."""

    def __init__(self, space, **kwargs):
        self.inner = synthetic_evaluator(space, **kwargs)
        self.results = {}
        self.plans = []
        self.calls = []
        self.space = space

    def evaluate(self, plan):
        assert not self.space.violations(plan), self.space.violations(plan)
        self.plans.append(plan)
        if plan.hash not in self.results:
            self.results[plan.hash] = self.inner(plan)
        return self.results[plan.hash]

    workers = 1

    @property
    def builds(self):
        return len(self.results)

    def evaluate_many(self, plans, limit=None):
        """As ``Evaluator.evaluate_many``: a plan given twice once, store hits first, at most ``limit`` builds."""
        self.calls.append((list(plans), limit))
        unique = list(dict((plan.hash, plan) for plan in plans).values())
        hits = [
            dataclasses.replace(self.results[plan.hash], from_store=True)
            for plan in unique
            if plan.hash in self.results
        ]
        fresh = [plan for plan in unique if plan.hash not in self.results][:limit]
        return hits + [self.evaluate(plan) for plan in fresh]


def _run(tmp_path, space, harness, name, builds=12, seed=0, accuracy_budget=0.01, workers=1, ahead=()):
    """Runs the search ``name`` through the driver over ``harness``; returns the driver."""
    config = tiny_config(
        tmp_path, seed=seed, budget={"builds": builds, "stall_episodes": 50}, accuracy_budget=accuracy_budget
    )
    harness.calls = []
    harness.workers = workers
    driver = Driver.for_budget(harness, config.budget)
    driver.run(STRATEGIES[name].make(space, SearchInputs(SearchSettings.of(config), workers)), ahead)
    return driver


@pytest.mark.parametrize("name", ["random", "greedy", "optuna"])
def test_strategies_propose_valid_plans_within_budget(tmp_path, space, name):
    harness = Harness(space)
    _run(tmp_path, space, harness, name, builds=12)
    assert 1 <= harness.builds <= 12
    if name != "greedy":
        assert harness.builds == 12


def test_random_is_reproducible_by_seed(tmp_path, space):
    runs = []
    for seed in (3, 3, 4):
        harness = Harness(space)
        _run(tmp_path, space, harness, "random", builds=6, seed=seed)
        runs.append([p.hash for p in harness.plans])
    assert runs[0] == runs[1] != runs[2]


def test_random_with_several_workers_hands_the_pool_the_whole_budget_and_builds_what_one_worker_builds(tmp_path, space):
    one = Harness(space)
    _run(tmp_path, space, one, "random", builds=20, seed=5)
    many = Harness(space)
    _run(tmp_path, space, many, "random", builds=20, seed=5, workers=4)
    # one call with a plan for every build, not a round of 4 plans waiting for its slowest build
    first_plans, first_limit = many.calls[0]
    assert first_limit == 20 and len(first_plans) == 20
    # another call only for the builds that store hits and repeats left unspent, never a plan past the limit
    assert all(len(plans) == limit for plans, limit in many.calls)
    assert many.builds == one.builds == 20
    assert list(many.results) == list(one.results)  # the same seed builds the same plans, in the same order
    streamed = [p.hash for plans, _ in many.calls for p in plans]
    assert streamed == [p.hash for plans, _ in one.calls for p in plans]  # and proposes them in the same sequence
    assert all(len(plans) == 1 for plans, _ in one.calls)  # one worker: one plan at a time


def test_random_builds_the_plans_ahead_at_the_head_of_its_first_batch(tmp_path, space):
    seeds = [space.uniform("int8"), space.uniform("fp32")]
    many = Harness(space)
    _run(tmp_path, space, many, "random", builds=10, seed=2, workers=4, ahead=seeds)
    first_plans, first_limit = many.calls[0]
    assert first_plans[:2] == seeds and len(first_plans) == first_limit == 10  # seeds and 8 random plans at once
    assert list(many.results)[:2] == [p.hash for p in seeds] and many.builds == 10


def test_greedy_starts_all_int8_and_reverts_the_most_sensitive_layer_first(tmp_path, space):
    harness = Harness(space)
    all_int8 = harness.inner(space.uniform("int8"))
    # a budget all-INT8 misses by a little: reverting the single most sensitive layer must meet it
    budget = all_int8.accuracy_drop * 0.7
    _run(tmp_path, space, harness, "greedy", builds=30, accuracy_budget=budget)
    assert harness.plans[0] == space.uniform("int8")
    n_groups = len(space.groups)
    sensitivities = harness.plans[1 : 1 + n_groups]
    assert all(len(p.layers_in("fp32")) == 1 for p in sensitivities)
    gains = {
        p.layers_in("fp32")[0]: all_int8.accuracy_drop - harness.results[p.hash].accuracy_drop for p in sensitivities
    }
    first_revert = harness.plans[1 + n_groups]
    assert first_revert.layers_in("fp32") == [max(gains, key=gains.get)]
    assert any(meets_budget(r, budget) for r in harness.results.values())


def test_optuna_survives_failed_builds(tmp_path, space):
    harness = Harness(space, fail_knob=("graph_optimization_level", "basic"))
    _run(tmp_path, space, harness, "optuna", builds=15)
    statuses = {r.status for r in harness.results.values()}
    assert harness.builds == 15 and "ok" in statuses


@pytest.mark.parametrize("workers", [1, 4])
def test_stall_stops_a_strategy_that_only_hits_the_store(tmp_path, space, workers):
    harness = Harness(space)
    driver = _run(tmp_path, space, harness, "random", builds=10_000, workers=workers)  # the tiny space is finite
    assert driver.exhausted() and driver.stalled >= 50 and harness.builds < 10_000
    if workers > 1:
        assert len(harness.calls) <= 2  # the repeats of the first batch count as store hits


def test_the_driver_ends_the_loop_when_the_strategy_proposes_nothing(tmp_path, space):
    harness = Harness(space)
    config = tiny_config(tmp_path, budget={"builds": 10})
    driver = Driver.for_budget(harness, config.budget)
    driver.run(strategies.Fixed(space, "int8"))
    assert harness.plans == [space.uniform("int8")] and not driver.exhausted()


def test_a_stepwise_strategy_is_told_its_rounds_results_and_the_budget_cuts_the_last_round(tmp_path, space):
    names = space.layer_names
    first = [space.uniform("int8"), space.uniform("fp32")]
    second = [space.plan({names[0]: "int8"}), space.plan({names[1]: "int8"})]
    told = []

    def rounds():
        told.append((yield first))
        told.append((yield second))

    harness = Harness(space)
    driver = Driver.for_budget(harness, tiny_config(tmp_path, budget={"builds": 3}).budget)
    driver.run(strategies.Stepwise(rounds()))
    assert [[r.plan for r in results] for results in told] == [first]
    assert [limit for _, limit in harness.calls] == [3, 1] and harness.plans == [*first, second[0]]


@pytest.mark.parametrize("strategy", ["random", "greedy", "optuna", "int8"])
def test_each_strategy_writes_the_same_run_layout_with_real_builds(tmp_path, strategy):
    config = tiny_config(tmp_path, name=f"tiny-{strategy}", budget={"builds": 6})
    summary = tune(config, strategy=strategy, isolate=False, progress=False)
    run = config.run_dir
    for path in ("config.yaml", "trials.sqlite", "tb", "best/model.onnx", "best/plan.json", "summary.json"):
        assert (run / path).exists(), path
    with TrialStore(run / "trials.sqlite") as store:
        assert len(store) == (1 if strategy == "int8" else 6)
        assert store.get_meta("strategy") == strategy
        assert set(measure_counts(store).values()) == {1}
    assert summary["builds"] == len(list(TrialStore(run / "trials.sqlite").trials()))


def test_fp16_strategy_is_refused_where_the_backend_has_no_fp16(tmp_path):
    with pytest.raises(ConfigError, match="offers no fp16"):
        tune(tiny_config(tmp_path), strategy="fp16", isolate=False, progress=False)
