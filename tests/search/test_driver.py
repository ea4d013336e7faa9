"""The driver's budget loop over the plain one-by-one harness: the budget, the stall rule, a strategy's end."""

from __future__ import annotations

from autotune.run.trial import TrialResult
from autotune.search.driver import Driver, OneByOne
from autotune.testing import synthetic_evaluator, tiny_space


class _Repeating:
    """A strategy that proposes the same plan for ever, after ``fresh`` new ones."""

    independent = False

    def __init__(self, space, fresh):
        names = space.layer_names
        self.plans = [space.plan({names[i]: "int8"}) for i in range(fresh)]
        self.repeat = space.uniform("int8")
        self.told = []

    def propose(self, n):
        return [self.plans.pop(0) if self.plans else self.repeat]

    def observe(self, results):
        self.told.append(results)


def _one_by_one(space):
    evaluate = synthetic_evaluator(space)
    measured = {}

    def stored(plan):  # the answer of a repeat says nothing of the store: the harness tells it by the build count
        measured.setdefault(plan.hash, evaluate(plan))
        return measured[plan.hash]

    return OneByOne(stored, lambda: len(measured)), measured


def test_a_strategy_that_repeats_a_measured_plan_stops_after_the_stall_count():
    space = tiny_space()
    harness, measured = _one_by_one(space)
    driver = Driver(harness, budget=100, stall=5)
    strategy = _Repeating(space, fresh=3)
    driver.run(strategy)
    assert len(measured) == 4  # three fresh plans, then the repeated one once
    assert driver.stalled == 5 and len(strategy.told) == 4 + 5
    assert [r.from_store for results in strategy.told for r in results] == [False] * 4 + [True] * 5


def test_the_budget_cuts_a_batch_and_the_plans_past_it_get_no_result():
    space = tiny_space()
    harness, measured = _one_by_one(space)
    names = space.layer_names
    plans = [space.plan({names[i]: "int8"}) for i in range(4)]
    driver = Driver(harness, budget=2, stall=5)
    assert [r.plan for r in driver.build(plans)] == plans[:2]
    assert driver.build(plans) == [] and driver.exhausted() and len(measured) == 2


def _driver_of_one_second_builds(space):
    """A driver with 1.5 s of a fake clock over builds of one second each (store hits take none), and its store."""
    harness, measured = _one_by_one(space)
    now = [0.0]
    built = harness._evaluate

    def slow(plan):
        now[0] += 0.0 if plan.hash in measured else 1.0
        return built(plan)

    harness._evaluate = slow
    return Driver(harness, budget=100, stall=50, seconds=1.5, clock=lambda: now[0]), measured


def test_the_time_limit_stops_the_loop_after_the_build_that_crossed_it():
    space = tiny_space()
    driver, measured = _driver_of_one_second_builds(space)
    driver.run(_Repeating(space, fresh=3))
    assert len(measured) == 2 and driver.out_of_time and driver.left == 0  # started at 0 and 1 seconds


def test_the_time_limit_stops_a_batch_after_the_build_that_crossed_it():
    space = tiny_space()
    driver, measured = _driver_of_one_second_builds(space)
    names = space.layer_names
    probes = [space.plan({names[i]: "int8"}) for i in range(4)]
    assert [r.plan for r in driver.build(probes)] == probes[:2] and len(measured) == 2  # the batch of 4 stopped


def test_budget_minutes_reaches_the_driver(tmp_path):
    from autotune.testing import tiny_config

    harness, _ = _one_by_one(tiny_space())
    assert Driver.for_budget(harness, tiny_config(tmp_path).budget).deadline is None
    now = [100.0]
    budget = tiny_config(tmp_path, budget={"builds": 9, "minutes": 0.5}).budget
    driver = Driver.for_budget(harness, budget, clock=lambda: now[0])
    assert driver.deadline == 130.0 and not driver.out_of_time  # 0.5 minutes from now
    now[0] += 29.9
    assert not driver.out_of_time and driver.left == 9
    now[0] += 0.1
    assert driver.out_of_time and driver.left == 0


def test_a_search_of_a_space_with_nothing_left_to_measure_stops_promptly():
    # One tunable layer, the knobs fixed: two plans. The store soon answers both, and the search must end there,
    # not at the build budget (a real one-layer model drew 3,491 store hits in 22 builds).
    import dataclasses

    from autotune.search.driver import STALLS_PER_PLAN
    from autotune.search.strategies import Random

    space = tiny_space(precisions=["int8"])
    one_layer = dataclasses.replace(space, choices=(space.choices[0], *[("fp32",)] * (len(space.choices) - 1)))
    one_layer = one_layer.with_fixed_knobs({knob.name: knob.default for knob in space.knobs})
    harness, measured = _one_by_one(one_layer)
    answered = []
    evaluate = harness._evaluate
    harness._evaluate = lambda plan: answered.append(plan) or evaluate(plan)
    driver = Driver(harness, budget=100, stall=400, plans=one_layer.size)
    driver.run(Random(one_layer, seed=0))
    assert one_layer.size == 2 and len(measured) == 2  # FP32 and INT8, each built once
    assert driver.stall == STALLS_PER_PLAN * 2 and driver.exhausted() and driver.left == 98
    # a run of store hits shorter than the stall rule may come before the second build, then the run that ends it
    assert len(answered) <= 2 + 2 * driver.stall


def test_the_stall_rule_is_the_configured_one_in_a_large_space():
    import math

    space = tiny_space(precisions=["int8"])
    harness, _ = _one_by_one(space)
    assert space.size == 2**4 * math.prod(len(knob.values) for knob in space.knobs)
    assert Driver(harness, budget=10, stall=5, plans=space.size).stall == 5


def test_the_seeded_knob_is_timed_on_the_fastest_int8_seed_with_each_other_value():
    from autotune.capabilities import Knob
    from autotune.model.layers import Layer
    from autotune.search.driver import time_seeded_knobs
    from autotune.search.space import SearchSpace

    table = tuple(
        Layer(f"mm{i}", "MatMul", i, (f"x{i}",), f"w{i}", 1, None, f"y{i}", ((8, 8),), (8, 8), 512, 64, i)
        for i in range(3)
    )
    knobs = (
        Knob("allow_spinning", (True, False)),
        Knob("int8_scheme", ("u8u8", "u8s7", "u8s8"), seeded=True),
    )
    space = SearchSpace(table, tuple(("fp32", "int8", "int8-dynamic") for _ in table), knobs)
    seeds = [
        TrialResult(plan=space.uniform("int8"), speedup=1.15, accuracy_drop=0.002),
        TrialResult(plan=space.uniform("int8-dynamic"), speedup=1.5, accuracy_drop=0.004),  # no INT8 scheme in it
    ]
    built = []
    results = time_seeded_knobs(space, seeds, lambda plans: built.extend(plans) or [])
    assert results == []
    assert built == [space.uniform("int8", {"int8_scheme": "u8s7"}), space.uniform("int8", {"int8_scheme": "u8s8"})]
    assert time_seeded_knobs(space, seeds[1:], lambda plans: built.extend(plans) or []) == []  # no INT8 seed


def test_the_callbacks_are_told_of_each_result_as_it_lands_and_in_their_order():
    space = tiny_space()
    harness, measured = _one_by_one(space)
    names = space.layer_names
    plans = [space.plan({names[i]: "int8"}) for i in range(2)]
    told: list[tuple[str, str, int]] = []

    class Watcher:
        def __init__(self, name):
            self.name = name

        def on_result(self, result, driver):
            told.append((self.name, result.plan_hash, len(measured)))  # before the next plan is built

    driver = Driver(harness, budget=10, stall=5, callbacks=[Watcher("monitor"), Watcher("books")])
    results = driver.build([*plans, plans[0]])
    hashes = [plan.hash for plan in plans]
    assert told == [(name, h, i + 1) for i, h in enumerate(hashes) for name in ("monitor", "books")]
    assert [r.plan_hash for r in results] == hashes
