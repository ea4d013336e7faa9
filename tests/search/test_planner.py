"""The surrogate planner as a strategy of its own, driven over a fake harness (no build, no policy)."""

from __future__ import annotations

from autotune.search.design import model_best_plan, probe_plans
from autotune.search.driver import Driver, OneByOne
from autotune.search.planner import Planner
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space


class _FixedModel:
    """A model of the trials that rates every layer alike: each INT8 layer saves 10 % and costs 0.006."""

    def predict(self, plan):
        quantized = sum(precision != "fp32" for _, precision in plan.precisions)
        return 1.0 / (1.0 - 0.1 * quantized), 0.006 * quantized


def _planner_run(tmp_path, builds, **planner):
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    measured: dict[str, object] = {}
    order = []

    def stored(plan):
        order.append(plan)
        if plan.hash not in measured:
            measured[plan.hash] = evaluate(plan)
        return measured[plan.hash]

    config = tiny_config(tmp_path, budget={"builds": builds, "stall_episodes": 400}, planner=planner)
    driver = Driver.for_budget(OneByOne(stored, lambda: len(measured)), config.budget)
    model = _FixedModel()
    driver.run(Planner(config.planning, space, lambda: model, lambda: set(measured)))
    return config, space, model, driver, order, measured


def test_the_planner_alone_builds_the_probes_then_the_models_best_unmeasured_plans(tmp_path):
    config, space, model, driver, order, measured = _planner_run(tmp_path, builds=12)
    probes = probe_plans(space, 12 // 3)
    assert order[: len(probes)] == probes
    after = order[len(probes)]
    assert after == model_best_plan(
        model, space, config.search_budget, seed=config.seed + len(probes), exclude=measured
    )
    assert model.predict(after)[1] <= config.search_budget
    assert len(measured) == 12 and len(order) == 12  # every plan proposed was new: no store hit, the budget spent


def test_the_planner_alone_ends_the_run_only_when_no_unbuilt_plan_is_left(tmp_path):
    # The tiny space has 2**4 precision plans times its knob values: a budget above that is never spent.
    config, space, model, driver, order, measured = _planner_run(tmp_path, builds=5000, probe_plans=False)
    assert 0 < len(measured) < 5000
    assert len(order) == len(measured)  # it stopped proposing, not stalled on store hits
    assert driver.stalled == 0
