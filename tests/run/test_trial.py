"""A trial's result: its status, the round trip through JSON, failures as values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotune.plan import Plan
from autotune.run.trial import FAILED, OK, TIMEOUT, TrialResult

PLAN = Plan.make({"fc1": "int8", "fc2": "fp32"}, {"calibration": "percentile"})


def _measured() -> TrialResult:
    return TrialResult(
        plan=PLAN,
        latency_ms=2.0,
        latency_iqr_ms=0.1,
        reference_latency_ms=5.0,
        reference_latency_iqr_ms=0.2,
        speedup=2.5,
        round_speedups=[2.4, 2.5, 2.6],
        accuracy=0.9,
        reference_accuracy=0.92,
        accuracy_drop=0.02,
        fidelity={"cosine": 0.999},
        early_stop={"batches": 16, "of": 64, "drop_lower_bound": 0.015, "budget": 0.01, "alpha": 0.01},
        score_s=0.4,
        build_s=0.5,
        build_stages_s={"export": 0.2},
        total_s=1.5,
        protocol={"repeats": 3},
        back_to_back_ms=1.9,
        reference_back_to_back_ms=4.8,
        split="holdout",
        busy={"rounds": 9, "counted": 4, "contended": 5, "others": 0.4, "waited": 0.2, "cpus": "0-1", "quiet": True},
        artifact="runs/demo/best/model.onnx",
        created_at=123.0,
    )


def test_a_result_reads_back_from_its_json_field_for_field():
    result = _measured()
    data = json.loads(json.dumps(result.to_dict()))
    assert data["plan_hash"] == PLAN.hash and data["plan"] == PLAN.to_dict() and "from_store" not in data
    again = TrialResult.from_dict(data)
    assert again == result
    # Every field but these was set to a value other than its default, so the round trip covered it.
    unset = [f.name for f in dataclasses.fields(TrialResult) if getattr(again, f.name) == f.default]
    assert unset == ["status", "error", "from_store"]


def test_from_store_is_not_persisted():
    result = dataclasses.replace(_measured(), from_store=True)
    assert TrialResult.from_dict({**result.to_dict(), "from_store": True}).from_store is False


def test_only_an_ok_trial_is_ok_and_a_failure_keeps_its_error_and_extras():
    assert _measured().ok and _measured().plan_hash == PLAN.hash
    failed = TrialResult.failure(PLAN, "BuildError: no kernel", build_s=0.3)
    assert (failed.status, failed.error, failed.build_s, failed.ok) == (FAILED, "BuildError: no kernel", 0.3, False)
    timeout = TrialResult.failure(PLAN, "timed out after 5 s", status=TIMEOUT)
    assert timeout.status == TIMEOUT and not timeout.ok and timeout.speedup is None
    assert TrialResult.from_dict(timeout.to_dict()) == timeout
    assert (OK, FAILED, TIMEOUT) == ("ok", "failed", "timeout")  # what stores written earlier hold


def test_a_dict_that_is_not_a_trial_is_refused():
    with pytest.raises(TypeError, match="speed"):
        TrialResult.from_dict({**_measured().to_dict(), "speed": 2.0})
    with pytest.raises(ValueError, match="precisions"):
        TrialResult.from_dict({**_measured().to_dict(), "plan": {"layers": {}}})


def test_a_ratio_is_the_baselines_time_over_ours_in_either_timing():
    from autotune.run.trial import BACK_TO_BACK, ONE_LAUNCH, ratio

    plan = Plan.make({"a": "fp32"})
    baseline = TrialResult(plan=plan, speedup=2.0, back_to_back_ms=3.0)
    ours = TrialResult(plan=plan, speedup=2.5, back_to_back_ms=2.0)
    assert ratio(baseline, ours) == ratio(baseline, ours, ONE_LAUNCH) == pytest.approx(1.25)
    assert ratio(baseline, ours, BACK_TO_BACK) == pytest.approx(1.5)
    assert ratio(ours, baseline, BACK_TO_BACK) == pytest.approx(1 / 1.5)
    untimed = TrialResult.failure(plan, "build failed")
    assert ratio(baseline, untimed) is None and ratio(untimed, ours, BACK_TO_BACK) is None
    with pytest.raises(ValueError, match="unknown timing 'pipelined'"):
        ratio(baseline, ours, "pipelined")


def test_a_result_says_whether_other_work_got_in_the_way_of_its_timing():
    assert _measured().shared and not _measured().too_busy
    quiet = dataclasses.replace(_measured(), busy={**_measured().busy, "contended": 0})
    assert not quiet.shared and not quiet.too_busy
    too_busy = dataclasses.replace(_measured(), busy={**_measured().busy, "quiet": False})
    assert too_busy.shared and too_busy.too_busy
    assert not dataclasses.replace(_measured(), busy=None).shared
