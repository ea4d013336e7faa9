"""The driver's budget loop over the plain one-by-one harness: the budget, the stall rule, a strategy's end."""

from __future__ import annotations

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


def test_the_time_limit_stops_the_loop_after_the_build_that_crossed_it():
    space = tiny_space()
    harness, measured = _one_by_one(space)
    now = [0.0]
    built = harness._evaluate

    def slow(plan):  # every build takes one second of the fake clock
        now[0] += 0.0 if plan.hash in measured else 1.0
        return built(plan)

    harness._evaluate = slow
    driver = Driver(harness, budget=100, stall=50, seconds=1.5, clock=lambda: now[0])
    driver.run(_Repeating(space, fresh=3))
    assert len(measured) == 2 and driver.out_of_time and driver.left == 0  # started at 0 and 1 seconds


def test_budget_minutes_reaches_the_driver(tmp_path):
    from autotune.testing import tiny_config

    harness, _ = _one_by_one(tiny_space())
    assert Driver.for_config(harness, tiny_config(tmp_path)).deadline is None
    now = [100.0]
    driver = Driver.for_config(harness, tiny_config(tmp_path, budget={"builds": 9, "minutes": 0.5}))
    driver.clock = lambda: now[0]
    assert driver.deadline is not None and not driver.out_of_time
    driver.deadline = now[0] + 30  # for_config's deadline comes from time.monotonic: 0.5 minutes from now
    now[0] += 30
    assert driver.out_of_time and driver.left == 0
