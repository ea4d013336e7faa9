"""autotune.harness.evaluator: the store first, then a build; repeats once, the limit kept, failures stored."""

from __future__ import annotations

import pytest

from autotune.harness.evaluator import Evaluator, _result
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import FAILED, OK, TIMEOUT
from autotune.testing import tiny_config


@pytest.fixture
def evaluator(tmp_path):
    seen = []
    store = TrialStore(tmp_path / "trials.sqlite")
    with Evaluator(tiny_config(tmp_path), store, isolate=False, on_result=seen.append) as harness:
        harness.seen = seen
        yield harness
    store.close()


def _plans(evaluator):
    space = evaluator._inline.space
    names = space.layer_names
    return space, [space.plan({names[i]: "int8"}) for i in range(len(names))]


def test_a_plan_is_built_once_then_answered_from_the_store(evaluator):
    space, _ = _plans(evaluator)
    plan = space.uniform("int8")
    first = evaluator.evaluate(plan)
    again = evaluator.evaluate(plan)
    assert first.status == OK and first.speedup > 0
    assert evaluator.builds == 1 and evaluator.cache_hits == 1
    assert again.plan_hash == first.plan_hash and again.latency_ms == first.latency_ms
    assert evaluator.seen == [first]  # on_result hears of new results only
    assert evaluator.store.get(plan.hash) is not None


def test_evaluate_many_yields_store_hits_first_a_repeat_once_and_keeps_the_limit(evaluator):
    _, plans = _plans(evaluator)
    stored = evaluator.evaluate(plans[1])
    results = list(evaluator.evaluate_many([plans[0], plans[1], plans[0], *plans[2:]], limit=1))
    assert [r.plan_hash for r in results] == [stored.plan_hash, plans[0].hash]
    assert evaluator.builds == 2 and evaluator.cache_hits == 1
    assert evaluator.store.get(plans[2].hash) is None  # past the limit: neither built nor yielded


def test_a_plan_that_cannot_build_is_a_failed_trial_in_the_store_and_counts_as_a_build(evaluator):
    space, _ = _plans(evaluator)
    int8 = space.uniform("int8")
    outside = Plan.make({**int8.precision_map, space.layer_names[0]: "fp8"}, int8.knob_map)
    result = evaluator.evaluate(outside)
    assert result.status == FAILED and "plan outside the search space" in result.error
    assert evaluator.builds == 1 and evaluator.store.get(outside.hash).status == FAILED
    assert evaluator.evaluate(outside).status == FAILED and evaluator.builds == 1  # not built again


def test_confirmation_stores_finalists_and_one_liners_apart_and_bypasses_the_trials(evaluator):
    space, _ = _plans(evaluator)
    finalist = space.uniform("int8")
    one_liner = Plan.reference_plan(space.layer_names, evaluator.references()[0])
    results = evaluator.confirm_side_by_side([finalist, one_liner])
    assert [r.split for r in results] == ["holdout", "holdout"]
    assert set(evaluator.store.confirmations()) == {finalist.hash}
    assert set(evaluator.store.references()) == {one_liner.reference}  # keyed by the one-liner's name
    assert evaluator.builds == 0 and evaluator.store.get(finalist.hash) is None
    protocol = results[0].protocol
    assert protocol["repeats"] == evaluator.config.confirm.repeats
    assert protocol["rounds"] == evaluator.config.confirm.rounds


def test_the_fp32_plan_the_run_times_is_the_one_its_reference_was_built_from(evaluator):
    assert evaluator.fp32_plan() == evaluator._inline.fp32_plan == evaluator._inline.space.uniform("fp32")


def test_a_workers_answer_becomes_a_result_or_a_failure_with_its_message(evaluator):
    space, _ = _plans(evaluator)
    plan = space.uniform("fp32")
    timed_out = _result(plan, "evaluation", "timeout", "no answer in 120 s")
    crashed = _result(plan, "holdout", "crashed", "the trial process died (signal 11)")
    assert (timed_out.status, timed_out.error, timed_out.split) == (TIMEOUT, "no answer in 120 s", "evaluation")
    assert (crashed.status, crashed.split) == (FAILED, "holdout") and "signal 11" in crashed.error
    built = evaluator.measure(plan)
    assert _result(plan, "evaluation", "result", built.to_dict()).latency_ms == built.latency_ms
