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
