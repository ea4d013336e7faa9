"""autotune.harness.runner: plans measured side by side, each failure its own."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.harness.runner import TrialRunner
from autotune.measure.timing import Protocol
from autotune.plan import Plan
from autotune.run.trial import FAILED, OK
from autotune.testing import tiny_config


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return TrialRunner(tiny_config(tmp_path_factory.mktemp("runner")))


def test_plans_side_by_side_share_the_rounds_and_a_plan_outside_the_space_fails_alone(runner):
    int8, fp32 = runner.space.uniform("int8"), runner.space.uniform("fp32")
    outside = Plan.make({**int8.precision_map, runner.space.layer_names[0]: "fp8"}, int8.knob_map)
    protocol = Protocol(warmup=1, repeats=2, rounds=3, settle_s=0.0)
    results = runner.run_side_by_side([int8, outside, fp32], "holdout", protocol)
    assert [r.status for r in results] == [OK, FAILED, OK]
    assert [r.plan for r in results] == [int8, outside, fp32]
    assert "plan outside the search space" in results[1].error
    # one FP32 reference timing serves both: they were timed in the same rounds
    assert results[0].reference_latency_ms == results[2].reference_latency_ms
    assert all(r.split == "holdout" and r.protocol == protocol.to_dict() for r in (results[0], results[2]))
    assert results[0].accuracy_drop is not None and results[2].accuracy_drop == pytest.approx(0.0)
    for result in (results[0], results[2]):  # the speedup is the median of the rounds each result keeps
        assert len(result.round_speedups) == protocol.rounds
        assert result.speedup == pytest.approx(float(np.median(result.round_speedups)))


def test_an_engine_that_fails_while_timed_fails_alone_and_the_others_are_timed_without_it(runner, monkeypatch):
    int8, fp32 = runner.space.uniform("int8"), runner.space.uniform("fp32")
    engines = []
    build = runner.build

    def remember(plan, workdir):
        engine = build(plan, workdir)
        engines.append((plan, engine))
        return engine

    time_run = runner.backend.time_run

    def broken_for_int8(artifact, feeds):
        if any(plan == int8 and engine is artifact for plan, engine in engines):
            raise RuntimeError("the engine stopped")
        return time_run(artifact, feeds)

    monkeypatch.setattr(runner, "build", remember)
    monkeypatch.setattr(runner.backend, "time_run", broken_for_int8)
    results = runner.run_side_by_side([int8, fp32], "evaluation", Protocol(warmup=0, repeats=2, rounds=2, settle_s=0.0))
    assert [r.status for r in results] == [FAILED, OK]
    assert results[0].error == "RuntimeError: the engine stopped"
    assert results[1].speedup > 0
    (alone,) = runner.run_side_by_side([int8], "evaluation", Protocol(warmup=0, repeats=1, rounds=1, settle_s=0.0))
    assert alone.status == FAILED and alone.error == "RuntimeError: the engine stopped"


def test_a_plan_several_times_slower_than_fp32_is_timed_in_one_round_and_says_so(runner, monkeypatch):
    from autotune.confirm import slow_timing_note
    from autotune.harness.runner import SLOW_PLAN_FACTOR

    int8, fp32 = runner.space.uniform("int8"), runner.space.uniform("fp32")
    engines = []
    build = runner.build
    monkeypatch.setattr(
        runner, "build", lambda plan, workdir: engines.append((plan, build(plan, workdir))) or engines[-1][1]
    )
    slow_ms = SLOW_PLAN_FACTOR + 0.5  # FP32 takes 1 ms

    def fake_time_run(artifact, feeds):
        return slow_ms if any(plan == int8 and engine is artifact for plan, engine in engines) else 1.0

    monkeypatch.setattr(runner.backend, "time_run", fake_time_run)
    # Fake 1 ms timings read as a slow spell beside the pace real FP32 runs left on this runner: no patience for it.
    protocol = Protocol(warmup=0, repeats=2, rounds=3, settle_s=0.0, busy_wait=None, spell_patience_s=0.0)
    slow, same = runner.run_side_by_side([int8, fp32], "holdout", protocol)
    assert slow.protocol["rounds"] == 1 and len(slow.round_speedups) == 1
    assert slow.speedup == pytest.approx(1.0 / slow_ms)
    assert same.protocol == protocol.to_dict() and len(same.round_speedups) == protocol.rounds
    assert (
        slow_timing_note(slow) == f"runs {slow_ms:.1f}x slower than FP32: timed in one round, not ranked by its speed"
    )
    assert slow_timing_note(same) is None
    slow_ms = SLOW_PLAN_FACTOR - 0.5
    (close,) = runner.run_side_by_side([int8], "holdout", protocol)  # under the factor: every round, as any plan
    assert close.protocol["rounds"] == protocol.rounds


def test_a_side_by_side_request_of_plans_that_all_fail_times_nothing(runner, monkeypatch):
    int8 = runner.space.uniform("int8")
    outside = Plan.make({**int8.precision_map, runner.space.layer_names[0]: "fp8"}, int8.knob_map)

    timed = []
    monkeypatch.setattr(runner.backend, "time_run", lambda artifact, feeds: timed.append(artifact) or 1.0)
    (result,) = runner.run_side_by_side([outside], "evaluation")
    assert result.status == FAILED and "plan outside the search space" in result.error
    assert timed == []  # FP32 was not timed with no plan beside it


def test_the_trial_process_settles_once_and_its_later_trials_time_only_their_rounds(runner, monkeypatch, tmp_path):
    from autotune.measure.pace import RememberedPace
    from autotune.measure.timing import ReferencePace

    pace = ReferencePace()  # a process on a machine nothing remembers
    monkeypatch.setattr(runner, "_paces", {"evaluation": (pace, RememberedPace(tmp_path, "a key"))})
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.05, busy_wait=None)  # the settling alone
    int8 = runner.space.uniform("int8")
    (first,) = runner.run_side_by_side([int8], "evaluation", protocol)
    settled_rounds = pace.rounds
    assert pace.timed_s >= 0.05 and settled_rounds > 2 * protocol.rounds
    assert len(first.round_speedups) >= protocol.rounds
    (second,) = runner.run_side_by_side([int8], "evaluation", protocol)
    assert pace.rounds - settled_rounds <= protocol.round_limit  # the pace of the first trial carried over
    # a round that another process's burst made busy does not count (the full suite on two cores): at least one does
    assert second.ok and 1 <= len(second.round_speedups) <= protocol.rounds


def test_the_next_trial_process_starts_from_the_pace_this_one_timed_fp32_at(runner, monkeypatch):
    int8 = runner.space.uniform("int8")
    runner.run_side_by_side([int8], "holdout", Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0))
    fastest = runner.pace("holdout").fastest_ms
    monkeypatch.setattr(runner, "_paces", {})  # what a new trial process of the same run starts with
    assert runner.pace("holdout").remembered_ms == pytest.approx(fastest)
    one_thread = runner.config.backend.model_copy(update={"intra_op_threads": 1})
    other = runner.config.model_copy(update={"backend": one_thread})
    monkeypatch.setattr(runner, "config", other)
    monkeypatch.setattr(runner, "_paces", {})
    assert runner.pace("holdout").remembered_ms is None  # another thread count: another pace


def test_the_fp32_plan_is_built_anew_on_onnxruntime_and_is_the_reference_on_torch(runner, tmp_path):
    from autotune.testing import tiny_torch_config

    fp32 = runner.space.uniform("fp32")
    assert runner.build(fp32, tmp_path) is not runner.reference  # two sessions, two thread pools: timed as such
    assert set(runner.setup_stages_s) == {
        "backend",
        "model",
        "data",
        "fp32_build",
        "calibration",
        "layerwise",
        "fp32_outputs",
    }
    assert all(seconds >= 0 for seconds in runner.setup_stages_s.values())
    torch_runner = TrialRunner(tiny_torch_config(tmp_path / "torch"))
    assert torch_runner.build(torch_runner.space.uniform("fp32"), tmp_path) is torch_runner.reference
    assert torch_runner.build(torch_runner.space.uniform("int8"), tmp_path) is not torch_runner.reference


def test_the_reference_is_built_with_the_backends_reference_knobs_and_at_the_defaults_where_that_fails(
    tmp_path, monkeypatch
):
    from autotune.backends.base import BuildError
    from autotune.backends.onnxruntime import OnnxRuntimeCPU
    from autotune.harness.process import handle

    monkeypatch.setattr(OnnxRuntimeCPU, "fp32_reference_knobs", lambda self: {"allow_spinning": False})
    # the config searches spinning sessions only: the reference is no plan of its space, and is measured all the same
    runner = TrialRunner(tiny_config(tmp_path / "knobs", search={"knobs": {"allow_spinning": [True]}}))
    assert runner.fp32_plan == runner.space.uniform("fp32", {"allow_spinning": False})
    assert runner.fp32_plan != runner.space.uniform("fp32")
    assert runner.space.violations(runner.fp32_plan)
    protocol = Protocol(warmup=0, repeats=1, rounds=1, settle_s=0.0)
    assert runner.run(runner.fp32_plan, "evaluation", protocol).ok  # the self-check's and the FP32 row's timing
    status, answer = handle(runner, "fp32_plan", None)  # what a trial process tells the run
    assert status == "result" and Plan.from_dict(answer) == runner.fp32_plan
    assert runner.build(runner.fp32_plan, tmp_path) is not runner.reference  # ONNX Runtime: a second session
    options = runner.reference.engine.get_session_options()  # what was built is what the plan says
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"

    build = OnnxRuntimeCPU.build

    def no_capture(self, plan, quantization, workdir):
        if plan.knob("allow_spinning") is False:
            raise BuildError("cannot capture")
        return build(self, plan, quantization, workdir)

    monkeypatch.setattr(OnnxRuntimeCPU, "build", no_capture)
    runner = TrialRunner(tiny_config(tmp_path / "fallback"))
    assert runner.fp32_plan == runner.space.uniform("fp32")
    assert runner.reference_accuracy  # the run goes on with the reference the search would build


def test_a_gated_torch_runner_makes_the_factorys_module_before_it_waits_and_not_again(tmp_path):
    from autotune.model.layers import factory_module
    from autotune.testing import tiny_torch_config

    config = tiny_torch_config(tmp_path)
    made_before_the_go_ahead = []
    runner = TrialRunner(config, gate=lambda: made_before_the_go_ahead.append(factory_module.cache_info().currsize))
    assert made_before_the_go_ahead == [1]
    assert runner.setup_stages_s["load_ahead"] > 0
    assert factory_module.cache_info().misses == 1  # the binding used the module made ahead


def test_calibration_runs_beside_the_fp32_build_and_the_fp32_builds_error_is_the_one_reported(tmp_path, monkeypatch):
    import threading
    import time

    from autotune.backends import BuildError
    from autotune.backends.onnxruntime import OnnxRuntimeCPU
    from autotune.harness import SetupError
    from autotune.harness import runner as runner_module

    config = tiny_config(tmp_path)
    calibrated = runner_module.calibrate_ranges
    seen = {}
    fp32_built = threading.Event()

    def calibrate(*args):
        seen["during_the_fp32_build"] = not fp32_built.is_set()
        return calibrated(*args)

    real_build = OnnxRuntimeCPU.build

    def slow_build(self, plan, quantization, workdir):
        time.sleep(1.0)  # long enough for calibration to have started beside it
        artifact = real_build(self, plan, quantization, workdir)
        fp32_built.set()
        return artifact

    monkeypatch.setattr(runner_module, "calibrate_ranges", calibrate)
    monkeypatch.setattr(OnnxRuntimeCPU, "build", slow_build)
    runner = TrialRunner(config)
    assert seen == {"during_the_fp32_build": True} and runner.calibration.stats

    def failing_calibration(*args):
        raise SetupError("calibration failed: it would hide the cause")

    def failing_build(self, plan, quantization, workdir):
        raise BuildError("an operator it lacks")

    monkeypatch.setattr(runner_module, "calibrate_ranges", failing_calibration)
    monkeypatch.setattr(OnnxRuntimeCPU, "build", failing_build)
    with pytest.raises(SetupError, match="the FP32 model does not build on onnxruntime: an operator it lacks"):
        TrialRunner(config)
