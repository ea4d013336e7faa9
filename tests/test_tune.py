import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from autotune.api import analyze
from autotune.capabilities import Capabilities, Knob
from autotune.config.schema import ConfigError, dump_config, load_config
from autotune.confirm import finalist_order
from autotune.harness.evaluator import Evaluator
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.driver import Driver
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space
from autotune.tune import search, tune
from tests.reliability.helpers import measure_counts

REPO = Path(__file__).resolve().parents[1]


def _scalar_tags(tb_dir: Path) -> set[str]:
    tags = set()
    for event_file in tb_dir.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"]) | set(accumulator.Tags()["tensors"])
    return tags


def test_short_run_trains_logs_confirms_and_exports(tmp_path):
    config = tiny_config(tmp_path, budget={"builds": 24}, ppo={"episodes_per_update": 4, "checkpoint_every_builds": 10})
    summary = tune(config, isolate=False, progress=False)
    run_dir = config.run_dir

    with TrialStore(run_dir / "trials.sqlite") as store:
        assert len(store) == 24
        assert set(measure_counts(store).values()) == {1}
        confirmations = store.confirmations()
    assert summary["builds"] == 24
    assert summary["plan_hash"] in confirmations
    assert summary["winner"]["split"] == "holdout"
    assert summary["winner"]["accuracy_drop"] <= config.accuracy_budget

    tags = _scalar_tags(run_dir / "tb")
    for tag in (
        "trial/reward",
        "trial/speedup",
        "trial/latency_ratio",
        "trial/latency_ms",
        "trial/accuracy",
        "trial/accuracy_drop",
        "trial/build_s",
        "trial/cache_hit",
        "best/reward",
        "best/speedup",
        "best/accuracy_drop",
        "train/entropy_loss",
        "train/value_loss",
        "train/explained_variance",
    ):
        assert tag in tags, tag
    assert list((run_dir / "checkpoints").glob("ppo_*_builds.zip"))
    assert (run_dir / "checkpoints" / "latest.zip").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "summary.json").exists()

    best = run_dir / "best"
    plan = json.loads((best / "plan.json").read_text())
    assert set(plan["precisions"]) == {"fc1", "fc2", "fc3", "head"}
    session = ort.InferenceSession(str(best / "model.onnx"), providers=["CPUExecutionProvider"])
    holdout = np.load(tmp_path / "holdout.npz")
    predictions = np.concatenate(
        [session.run(None, {"x": holdout["x"][i : i + 16]})[0].argmax(axis=1) for i in range(0, len(holdout["x"]), 16)]
    )
    accuracy = float(np.mean(predictions == holdout["labels"]))
    assert accuracy == pytest.approx(summary["winner"]["accuracy"], abs=1e-9)


def test_a_second_run_with_the_same_name_is_refused_before_anything_is_timed(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, budget={"builds": 3}, ppo={"episodes_per_update": 2})
    tune(config, isolate=False, progress=False)
    # backend.name: auto times both runtimes' seeds first (40 s for MiniLM): a refused run must not wait for it.
    monkeypatch.setattr("autotune.tune.choose_runtime", lambda *args, **kwargs: pytest.fail("the choice ran"))
    with pytest.raises(ConfigError, match="autotune resume"):
        tune(config, isolate=False, progress=False)


def _wait_for_trials(store_path: Path, count: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert process.poll() is None, process.stderr.read().decode()
        if store_path.exists():
            with TrialStore(store_path) as store:
                if len(store) >= count:
                    return
        time.sleep(0.05)
    raise AssertionError("the run did not reach the trial count in time")


def test_sigkill_then_resume_loses_no_trial_and_measures_none_twice(tmp_path):
    # A tiny space: the resumed agent soon proposes only measured plans; stopping after 40 such episodes keeps the
    # test about the resume (no trial lost, none measured twice), not about how long a converged agent explores.
    config = tiny_config(
        tmp_path,
        budget={"builds": 30, "stall_episodes": 40},
        # Without the layerwise priors: on this model builds take milliseconds, so the rehearsals that priors start
        # from the first build would set the pace of the run, and the test is about the kill, not the agent.
        # Few imagined episodes and epochs per update for the same reason.
        ppo={
            "episodes_per_update": 2,
            "checkpoint_every_builds": 5,
            "imagined_episodes": 8,
            "n_epochs": 2,
        },
        planner={"priors": False},
    )
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(dump_config(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "autotune", "tune", str(config_path), "--no-progress"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    store_path = config.run_dir / "trials.sqlite"
    try:
        _wait_for_trials(store_path, 12, process)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    with TrialStore(store_path) as store:
        before = {r.plan_hash: r.to_dict() for r in store.trials()}
    assert 12 <= len(before) < 30

    resumed = subprocess.run(
        [sys.executable, "-m", "autotune", "resume", str(config.run_dir), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    with TrialStore(store_path) as store:
        after = {r.plan_hash: r.to_dict() for r in store.trials()}
        counts = measure_counts(store)
    assert len(before) <= len(after) <= 30
    for plan_hash, result in before.items():
        assert after[plan_hash] == result
    assert set(counts.values()) == {1}
    assert "winner" in resumed.stdout


def test_resume_of_a_missing_run_names_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        tune(resume_dir=tmp_path / "nope", isolate=False, progress=False)


def test_config_round_trips_through_the_run_directory(tmp_path):
    config = tiny_config(tmp_path, budget={"builds": 2}, ppo={"episodes_per_update": 2})
    tune(config, isolate=False, progress=False)
    assert load_config(config.run_dir / "config.yaml") == config


def test_the_saved_config_points_at_the_same_files_from_any_working_directory(tmp_path, monkeypatch):
    from autotune.run.directory import RunDir
    from autotune.testing import write_tiny_project

    project = tmp_path / "project"
    write_tiny_project(project)
    (project / "c.yaml").write_text(
        "name: rel\nmodel: {onnx: tiny.onnx}\ninputs: [{name: x, shape: [16, 32]}]\n"
        "data: {calibration: {npz: calibration.npz}, evaluation: {npz: evaluation.npz}}\n"
        "metric: {name: top1}\nbudget: {builds: 2}\nmeasure: {warmup: 1, repeats: 2, rounds: 1}\n"
    )
    monkeypatch.chdir(project)
    tune(load_config("c.yaml"), strategy="random", isolate=False, progress=False)
    monkeypatch.chdir(tmp_path)
    _, saved = RunDir.open(project / "runs" / "rel")
    assert saved.model.onnx == project / "tiny.onnx"
    assert saved.data.evaluation.npz == project / "evaluation.npz"
    assert saved.runs_dir == project / "runs" and saved.cache_dir == project / ".cache" / "autotune"


def test_the_one_liners_are_timed_in_the_finalists_rounds_and_reused_on_resume(tmp_path, monkeypatch):
    # confirm.repeats differs from measure.repeats: the one-liners must be measured with the confirmation protocol
    config = tiny_config(tmp_path, budget={"builds": 3}, confirm={"top_k": 1, "repeats": 4, "rounds": 1})
    summary = tune(config, strategy="random", isolate=False, progress=False)
    references = summary["references"]
    assert list(references) == ["ort-static", "ort-dynamic"]
    # no budget.minutes: the confirmation stops at its share of the search's time
    confirmation = {**config.measure.model_dump(), "repeats": 4, "rounds": 1}
    assert summary["confirmation_allowance_s"] > 0
    for name, row in references.items():
        assert row["status"] == "ok" and row["error"] is None, (name, row)
        stop_at = row["protocol"]["stop_at"]
        assert row["split"] == "holdout" and row["protocol"] == {**confirmation, "stop_at": stop_at} and stop_at
        assert row["speedup"] > 0 and row["accuracy_drop"] is not None
        assert row["build_s"] > 0  # a one-liner's build, beside which a trial build's cost reads
    assert summary["winner"]["build_s"] > 0
    assert summary["builds"] == 3  # the one-liners spend no build of the search
    assert summary["winner"]["back_to_back_ms"] is None  # ONNX Runtime has no back-to-back timer
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert len(store) == 3
        stored = {name: result.to_dict() for name, result in store.references().items()}
        assert not {row["plan_hash"] for row in references.values()} & set(store.confirmations())
        assert not any(result.plan.reference for result in store.trials())
    assert {name: row["plan_hash"] for name, row in references.items()} == {
        name: result["plan_hash"] for name, result in stored.items()
    }
    # the finalist, FP32 and the one-liners were timed in the same rounds: one FP32 reference timing for all
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        confirmed = [*store.confirmations().values(), *store.references().values()]
    assert len(confirmed) == 4 and len({result.reference_latency_ms for result in confirmed}) == 1
    within = [n for n, r in references.items() if r["accuracy_drop"] <= config.accuracy_budget]
    best = max(within, key=lambda n: references[n]["speedup"], default=None)
    assert summary["best_reference"] == best
    written = json.loads((config.run_dir / "summary.json").read_text())
    assert written["references"] == references

    from autotune.backends.onnxruntime import OnnxRuntimeCPU

    def no_second_build(*args, **kwargs):
        raise AssertionError("a resumed run measured a one-liner again")

    monkeypatch.setattr(OnnxRuntimeCPU, "build_reference", no_second_build)
    resumed = tune(resume_dir=config.run_dir, isolate=False, progress=False)
    assert resumed["references"] == references
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert {name: result.to_dict() for name, result in store.references().items()} == stored


def test_a_one_liner_that_fails_to_build_is_a_failed_result_and_the_run_goes_on(tmp_path, monkeypatch):
    import onnxruntime.quantization

    def broken(*args, **kwargs):
        raise RuntimeError("calibration exploded")

    monkeypatch.setattr(onnxruntime.quantization, "quantize_static", broken)
    config = tiny_config(tmp_path, budget={"builds": 2}, confirm={"top_k": 1, "repeats": 3, "rounds": 1})
    summary = tune(config, strategy="random", isolate=False, progress=False)
    failed = summary["references"]["ort-static"]
    assert failed["status"] == "failed" and failed["speedup"] is None
    assert "quantize_static failed: RuntimeError: calibration exploded" in failed["error"]
    assert summary["references"]["ort-dynamic"]["status"] == "ok"
    assert summary["best_reference"] in (None, "ort-dynamic")
    assert (config.run_dir / "best" / "model.onnx").exists()


def test_the_summary_says_so_when_a_one_liner_beats_the_winner_within_the_budget(tmp_path):
    from autotune.confirm import reference_rows
    from autotune.plan import Plan
    from autotune.run.trial import TrialResult

    layers = ["fc1", "fc2"]
    winner = TrialResult(plan=Plan.uniform(layers, "int8"), speedup=1.2, accuracy_drop=0.001, split="holdout")
    with TrialStore(tmp_path / "t.sqlite") as store:
        store.put_reference(
            TrialResult(plan=Plan.reference_plan(layers, "fast-but-wrong"), speedup=3.0, accuracy_drop=0.5)
        )
        rows = reference_rows(store, winner, accuracy_budget=0.01)
        assert rows["best_reference"] is None and rows["reference_note"] is None
        store.put_reference(TrialResult(plan=Plan.reference_plan(layers, "ort-static"), speedup=1.5, accuracy_drop=0))
        rows = reference_rows(store, winner, accuracy_budget=0.01)
        assert list(rows["references"]) == ["fast-but-wrong", "ort-static"]
        assert rows["best_reference"] == "ort-static"
        assert rows["winner_over_best_reference"] == pytest.approx(1.2 / 1.5)
        assert (
            "ort-static beats the winner" in rows["reference_note"] and "1.50x against 1.20x" in rows["reference_note"]
        )
        assert rows["winner_over_best_reference_back_to_back"] is None  # no back-to-back timer: no ratio
        with pytest.raises(ValueError, match="not a reference plan"):
            store.put_reference(winner)
    winner.speedup = 1.6
    with TrialStore(tmp_path / "t.sqlite") as store:
        assert reference_rows(store, winner, accuracy_budget=0.01)["reference_note"] is None


def test_the_back_to_back_ratio_is_the_fastest_one_liner_within_the_budget_over_the_winner(tmp_path):
    from autotune.confirm import reference_rows

    layers = ["fc1", "fc2"]
    winner = TrialResult(plan=Plan.uniform(layers, "fp8"), speedup=2.0, accuracy_drop=0.001, back_to_back_ms=4.0)
    rows_of = {"torch-bf16": (1.8, 0.0, 5.0), "torch-fp16": (1.7, 0.0, 4.8), "torchao-fp8": (2.2, 0.5, 3.0)}
    with TrialStore(tmp_path / "t.sqlite") as store:
        for name, (speedup, drop, pipelined) in rows_of.items():
            result = TrialResult(
                plan=Plan.reference_plan(layers, name), speedup=speedup, accuracy_drop=drop, back_to_back_ms=pipelined
            )
            store.put_reference(result)
        rows = reference_rows(store, winner, accuracy_budget=0.01)
    assert rows["best_reference"] == "torch-bf16" and rows["winner_over_best_reference"] == pytest.approx(2.0 / 1.8)
    # back to back, FP16 is the faster one-liner within the budget; torchao-fp8 (over the budget) does not count
    assert rows["winner_over_best_reference_back_to_back"] == pytest.approx(4.8 / 4.0)
    assert rows["references"]["torch-fp16"]["back_to_back_ms"] == 4.8


def test_confirm_references_picks_the_one_liners_and_rejects_unknown_ones(tmp_path):
    confirm = {"top_k": 1, "repeats": 3, "rounds": 1}
    config = tiny_config(tmp_path, budget={"builds": 1}, confirm={**confirm, "references": ["ort-static"]})
    assert list(tune(config, strategy="fp32", isolate=False, progress=False)["references"]) == ["ort-static"]
    none = tiny_config(tmp_path, name="none", budget={"builds": 1}, confirm={**confirm, "references": []})
    assert tune(none, strategy="fp32", isolate=False, progress=False)["references"] == {}
    bad = tiny_config(tmp_path, name="bad", confirm={**confirm, "references": ["ort-static", "tflite"]})
    with pytest.raises(ConfigError, match=r"confirm.references: \['tflite'\] not offered by the onnxruntime"):
        tune(bad, isolate=False, progress=False)
    assert not bad.run_dir.exists()


def test_an_imported_confirmation_that_outranks_the_finalists_is_the_winner_and_heads_the_ranking(tmp_path):
    # The second run exports from every confirmation in its store, the first run's imported ones included; its
    # summary's ranking must be the same list (it once ranked only its own finalists and failed to find the winner).
    first = tiny_config(tmp_path, name="first", budget={"builds": 6}, ppo={"episodes_per_update": 2})
    tune(first, isolate=False, progress=False)
    with TrialStore(first.run_dir / "trials.sqlite") as store:
        fp32_hash = store.get_meta("fp32_plan_hash")
        trials = [r for r in store.trials() if r.ok and r.plan_hash != fp32_hash]
        slowest = min(trials, key=lambda r: r.speedup)  # never among the second run's finalists (top_k 1)
        faster = {**slowest.to_dict(), "speedup": 100.0, "accuracy_drop": 0.0, "split": "holdout"}
        store.put_confirmation(TrialResult.from_dict(faster))
    second = tiny_config(
        tmp_path, name="second", budget={"builds": 2}, confirm={"top_k": 1}, from_runs=[str(first.run_dir)]
    )
    summary = tune(second, isolate=False, progress=False)
    assert summary["plan_hash"] == slowest.plan_hash
    assert summary["ranking"][0]["plan_hash"] == slowest.plan_hash


def test_a_second_run_from_the_first_builds_none_of_its_plans_and_counts_only_its_own_builds(tmp_path):
    first = tiny_config(tmp_path, name="first", budget={"builds": 10}, ppo={"episodes_per_update": 2})
    tune(first, isolate=False, progress=False)
    with TrialStore(first.run_dir / "trials.sqlite") as store:
        measured_first = {r.plan_hash: r.to_dict() for r in store.trials()}
    second = tiny_config(
        tmp_path,
        name="second",
        accuracy_budget=2 * first.accuracy_budget,
        budget={"builds": 4},
        ppo={"episodes_per_update": 2},
        from_runs=[str(first.run_dir)],
    )
    summary = tune(second, isolate=False, progress=False)
    with TrialStore(second.run_dir / "trials.sqlite") as store:
        measured_second = {r.plan_hash: r.to_dict() for r in store.trials()}
        imported = store.imported()
        counts = measure_counts(store)
    assert set(imported) == set(measured_first)
    for plan_hash, result in measured_first.items():  # the first run's measurement, not a second one
        assert measured_second[plan_hash] == result
    assert set(counts.values()) == {1}
    new = set(measured_second) - set(measured_first)
    assert summary["builds"] == len(new) <= 4
    assert summary["imported_trials"] == len(measured_first)


def test_trials_of_a_cpu_with_other_int8_isa_features_are_not_imported(tmp_path, monkeypatch):
    """One CPU model name covers AVX2-only and VNNI CPUs (a VM's "AMD EPYC"): their INT8 trials do not mix."""
    first = tiny_config(tmp_path, name="first", budget={"builds": 2}, ppo={"episodes_per_update": 2})
    tune(first, isolate=False, progress=False)
    monkeypatch.setattr("autotune.harness.identity.isa_features", lambda: ("a-cpu-other-than-this-one",))
    other = tiny_config(tmp_path, name="other", budget={"builds": 2}, from_runs=[str(first.run_dir)])
    with pytest.raises(ConfigError, match=r"not comparable with this run \(machine differ"):
        tune(other, isolate=False, progress=False)


def test_a_run_from_an_incomparable_run_is_refused_in_one_line(tmp_path):
    first = tiny_config(tmp_path, name="first", budget={"builds": 2}, ppo={"episodes_per_update": 2})
    tune(first, isolate=False, progress=False)
    other = tiny_config(
        tmp_path,
        name="other",
        measure={"warmup": 1, "repeats": 5, "rounds": 1, "settle_s": 0, "busy_patience_s": 0, "busy_others": None},
        from_runs=[str(first.run_dir)],
    )
    with pytest.raises(ConfigError, match=r"not comparable with this run \(measure differ\)") as error:
        tune(other, isolate=False, progress=False)
    assert "\n" not in str(error.value)
    assert not other.run_dir.exists()
    missing = tiny_config(tmp_path, name="missing", from_runs=[str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="has no trials.sqlite"):
        tune(missing, isolate=False, progress=False)


class _RecordingHarness:
    """A fake harness for the driver: the synthetic results, and every hand-over of plans recorded."""

    def __init__(self, space, workers, **synthetic):
        self.workers = workers
        self.inner = synthetic_evaluator(space, **synthetic)
        self.results = {}
        self.handed = []  # the plans of each evaluate_many

    @property
    def builds(self):
        return len(self.results)

    def evaluate_many(self, plans, limit=None):
        self.handed.append(list(plans))
        unique = list(dict((plan.hash, plan) for plan in plans).values())
        hits = [
            dataclasses.replace(self.results[plan.hash], from_store=True)
            for plan in unique
            if plan.hash in self.results
        ]
        fresh = [plan for plan in unique if plan.hash not in self.results][:limit]
        for plan in fresh:
            self.results[plan.hash] = self.inner(plan)
        return hits + [self.results[plan.hash] for plan in fresh]


def _search(config, space, harness, strategy):
    """The strategy's search with its seeds, driven over the fake harness; the free knobs fixed."""
    return search(config, space, Driver.for_budget(harness, config.budget), None, None, strategy, False)


@pytest.mark.parametrize("strategy", ["random", "greedy"])
def test_seeds_travel_with_the_first_random_plans_on_several_workers_and_come_first_on_one(tmp_path, strategy):
    config = tiny_config(tmp_path, budget={"builds": 8})
    _, space = analyze(config)
    seed = space.uniform("int8")  # the tiny model's one uniform seed on the ONNX Runtime CPU backend
    one = _RecordingHarness(space, workers=1)
    _search(config, space, one, strategy)
    assert one.handed[0] == [seed]  # one worker: the seed first, on its own, then the search
    many = _RecordingHarness(space, workers=4)
    _search(config, space, many, strategy)
    first_plans = many.handed[0]
    if strategy == "random":  # the seed heads the first batch, in one stream with the random plans
        assert first_plans[0] == seed and len(first_plans) == 8
        assert list(many.results) == list(one.results)  # the same builds in the same order as with one worker
    else:  # greedy starts from the seed's result: the seed round comes first
        assert first_plans == [seed]
    assert many.builds == one.builds and many.builds <= 8


def test_the_int8_forms_are_seeds_and_each_exact_scheme_is_timed_on_the_int8_seed(tmp_path):
    """ONNX Runtime on an AVX2 CPU: int8-dynamic a precision, u8u8 and u8s7 exact (the knob seeded)."""
    capabilities = Capabilities(
        {"Gemm": ("fp32", "int8", "int8-dynamic"), "MatMul": ("fp32", "int8", "int8-dynamic")},
        (Knob("int8_scheme", ("u8u8", "u8s7"), seeded=True),),
    )
    space = tiny_space(capabilities)
    config = tiny_config(tmp_path, budget={"builds": 6})
    harness = _RecordingHarness(space, workers=4, knob_latency={("int8_scheme", "u8s7"): 0.8})
    _search(config, space, harness, "random")
    int8, dynamic = space.uniform("int8"), space.uniform("int8-dynamic")
    assert harness.handed[0] == [int8, dynamic]  # the uniform seeds, in a round of their own even on 4 workers
    assert harness.handed[1] == [int8.with_knobs(int8_scheme="u8s7")]  # the other exact scheme, on the INT8 seed
    searched = [plan for plans in harness.handed[2:] for plan in plans]
    assert searched and {plan.knob("int8_scheme") for plan in searched} <= {"u8u8", "u8s7"}


def _gpu_like_space():
    """The tiny model with a base precision, two free knobs and a searched one (ONNX Runtime's allow_spinning)."""
    capabilities = Capabilities(
        {"Gemm": ("fp32", "fp16", "bf16", "int8"), "MatMul": ("fp32", "fp16", "bf16", "int8")},
        (
            Knob("base_precision", ("fp32", "fp16", "bf16"), follows_precision=True),
            Knob("attention", ("sdpa", "eager"), free=True),
            Knob("cuda_graphs", (True, False), free=True),
            Knob("allow_spinning", (True, False)),
        ),
        smoothing=False,
    )
    return tiny_space(capabilities)


# attention=eager is slower (the seed's sdpa stays); cuda_graphs=False is faster (it replaces the seed's True);
# allow_spinning=False is faster too, but it is not free: the search must still find it.
KNOB_LATENCY = {("attention", "eager"): 1.3, ("cuda_graphs", False): 0.8, ("allow_spinning", False): 0.9}


@pytest.mark.parametrize("strategy", ["random", "greedy"])
def test_free_knobs_are_measured_on_the_fastest_seed_then_fixed_for_the_search(tmp_path, strategy):
    config = tiny_config(tmp_path, budget={"builds": 16})
    space = _gpu_like_space()
    evaluator = _RecordingHarness(space, workers=1, knob_latency=KNOB_LATENCY)
    fixed = _search(config, space, evaluator, strategy)
    assert fixed == {"attention": "sdpa", "cuda_graphs": False}
    plans = [plan for plans in evaluator.handed for plan in plans]
    assert [p.knob("base_precision") for p in plans[:2]] == ["fp16", "bf16"]  # the float seeds first
    fastest = max(plans[:2], key=lambda p: evaluator.results[p.hash].speedup)
    # then each free knob's other value on the fastest seed, one knob at a time, on the best plan so far
    assert plans[2] == fastest.with_knobs(attention="eager")
    assert plans[3] == fastest.with_knobs(cuda_graphs=False)
    int8 = plans[4]  # the quantized seed, on the fastest float base, with the fixed values
    assert int8 == space.uniform("int8", {"base_precision": fastest.knob("base_precision"), **fixed})
    searched = plans[5:]
    assert searched and all(p.knob("attention") == "sdpa" and p.knob("cuda_graphs") is False for p in searched)
    assert len({p.hash for p in plans}) == evaluator.builds  # greedy asks for some plans again (cache hits)
    if strategy == "greedy":  # a searched knob is still searched
        assert any(p.knob("allow_spinning") is False for p in searched)


def test_free_knobs_left_unmeasured_by_the_budget_stay_in_the_search(tmp_path):
    config = tiny_config(tmp_path, budget={"builds": 3})
    space = _gpu_like_space()
    evaluator = _RecordingHarness(space, workers=1, knob_latency=KNOB_LATENCY)
    fixed = _search(config, space, evaluator, "random")
    assert fixed == {"attention": "sdpa"} and evaluator.builds == 3  # two float seeds, one attention build
    assert space.with_fixed_knobs(fixed).free_knobs == [k for k in space.knobs if k.name == "cuda_graphs"]


def test_a_faster_value_within_the_margin_is_a_tie_and_the_seeds_value_stays(tmp_path):
    config = tiny_config(tmp_path, budget={"builds": 16})
    space = _gpu_like_space()
    tie = {("attention", "eager"): 0.995, ("cuda_graphs", False): 1.2}
    evaluator = _RecordingHarness(space, workers=1, knob_latency=tie)
    assert _search(config, space, evaluator, "random") == {
        "attention": "sdpa",
        "cuda_graphs": True,
    }


def test_a_space_fixes_knobs_to_one_value_and_refuses_others():
    space = _gpu_like_space()
    assert [k.name for k in space.free_knobs] == ["attention", "cuda_graphs"]
    fixed = space.with_fixed_knobs({"attention": "eager"})
    knobs = {k.name: k for k in fixed.knobs}
    assert knobs["attention"].values == ("eager",) and knobs["attention"].free
    assert fixed.plan().knob("attention") == "eager" and space.plan().knob("attention") == "sdpa"
    assert not space.violations(fixed.plan())  # inside the original space too
    with pytest.raises(ValueError, match="cannot fix knob attention='flash'"):
        space.with_fixed_knobs({"attention": "flash"})
    with pytest.raises(ValueError, match="cannot fix knob nope"):
        space.with_fixed_knobs({"nope": 1})


def test_onnxruntime_allow_spinning_is_searched_not_free():
    from autotune.backends.onnxruntime import OnnxRuntimeCPU

    knobs = {k.name: k for k in OnnxRuntimeCPU().capabilities().knobs}
    assert "allow_spinning" in knobs and not knobs["allow_spinning"].free
    assert [name for name, knob in knobs.items() if knob.free] == ["skip_layer_norm_fusion"]


def test_finalists_are_ranked_by_the_profile_where_the_run_has_one(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, confirm={"top_k": 1})
    shares = {"a": 0.3, "b": 0.1}
    plans = {q: Plan.make({n: ("int8" if n in q else "fp32") for n in shares}) for q in ("", "a", "b", "ab")}
    # INT8 saves 0.6 of a layer's share; "b" alone measured lucky, faster than "a" alone and "ab"
    measured = {"": 1.0, "a": 1.0 / (1 - 0.18), "b": 1.4, "ab": 1.0 / (1 - 0.24)}
    trials = [TrialResult(plan=plans[q], speedup=measured[q], accuracy_drop=0.001 * len(q)) for q in plans]
    without, _ = finalist_order(trials, config.finalists, plans[""])
    with_profile, expected = finalist_order(trials, config.finalists, plans[""], shares)
    assert without[0] == plans["b"]
    assert with_profile[0] == plans["ab"] and plans[""] not in with_profile
    assert expected[plans["b"].hash] < expected[plans["a"].hash]


def test_a_run_times_fp32_against_itself_before_the_search_and_in_the_confirmation(tmp_path):
    from autotune.report import report

    confirm = {"top_k": 1, "repeats": 3, "rounds": 2, "self_check": True}
    config = tiny_config(tmp_path, budget={"builds": 2}, confirm=confirm)
    summary = tune(config, strategy="random", isolate=False, progress=False)
    checks = summary["self_check"]
    assert checks["search"]["rounds"] == config.measure.rounds
    assert checks["confirmation"]["rounds"] in (2, 4)  # 4: confirmed again after a reading outside the band
    assert checks["confirmation"]["ratio"] == pytest.approx(summary["fp32_reference"]["speedup"])
    assert checks["band"] == [0.97, 1.03]
    assert summary["builds"] == 2  # the check is no build of the search
    within = checks["search"]["within_band"] and checks["confirmation"]["within_band"]
    # the note speaks of the self-check exactly when one left the band (it may speak of a busy machine besides)
    assert ("timing self-check" in (summary["timing_note"] or "")) == (not within)
    text = report([config.run_dir], profile=False)["report"].read_text()
    assert f"FP32 against itself: {checks['search']['ratio']:.3f}x (search)" in text
    # where the minutes before the first build went: the run's stages, and the trial process's within its own
    stages = summary["setup_stages_s"]
    assert {"analyze", "check_data", "trial_process", "timing_self_check", "trial_process.calibration"} <= set(stages)
    assert sum(v for k, v in stages.items() if not k.startswith("trial_process.")) <= summary["setup_s"]
    inner = sum(v for k, v in stages.items() if k.startswith("trial_process."))
    assert 0 < inner <= stages["trial_process"] and summary["setup_s"] <= summary["wall_s"]


def test_the_self_checks_and_the_fp32_row_time_the_reference_as_built_not_the_searchs_fp32_plan(tmp_path, monkeypatch):
    from autotune.backends.onnxruntime import OnnxRuntimeCPU

    monkeypatch.setattr(OnnxRuntimeCPU, "fp32_reference_knobs", lambda self: {"allow_spinning": False})
    timed = []
    measure = Evaluator.measure_side_by_side
    monkeypatch.setattr(
        Evaluator,
        "measure_side_by_side",
        lambda self, plans, *a, **k: timed.append(plans[0]) or measure(self, plans, *a, **k),
    )
    confirm = {"top_k": 1, "repeats": 3, "rounds": 2, "self_check": True}
    # the config searches spinning sessions only: the reference is no plan of the search's space
    search = {"knobs": {"allow_spinning": [True]}}
    config = tiny_config(tmp_path, budget={"builds": 2}, confirm=confirm, search=search)
    summary = tune(config, strategy="random", isolate=False, progress=False)
    checked = timed[0]  # the search's self-check, the one-liners beside it (then the confirmation)
    assert checked.knob("allow_spinning") is False and set(checked.precision_map.values()) == {"fp32"}
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert store.get_meta("fp32_plan_hash") == checked.hash
        fp32_row = store.confirmations()[checked.hash]  # the confirmation's FP32 row
        assert fp32_row.plan == checked and fp32_row.ok
    assert summary["self_check"]["confirmation"]["ratio"] == pytest.approx(summary["fp32_reference"]["speedup"])


def test_resume_on_another_machine_is_refused_in_one_line_naming_what_differs(tmp_path):
    from autotune.harness.identity import KEY_META

    config = tiny_config(tmp_path, budget={"builds": 1})
    tune(config, strategy="random", isolate=False, progress=False)
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        key = store.get_meta(KEY_META)
        trials = len(store)
        store.set_meta(KEY_META, {**key, "machine": {**key["machine"], "cpu": "Another CPU"}})
    with pytest.raises(ConfigError) as refused:
        tune(resume_dir=config.run_dir, isolate=False, progress=False)
    message = str(refused.value)
    assert "\n" not in message and "machine.cpu" in message and "'Another CPU' in the run" in message
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        assert len(store) == trials  # nothing measured on this machine went into the run
        store.set_meta(KEY_META, key)
    tune(resume_dir=config.run_dir, isolate=False, progress=False)  # where it ran, it resumes


def test_a_search_out_of_minutes_says_so_and_still_confirms_a_winner(tmp_path, capsys):
    config = tiny_config(tmp_path, budget={"builds": 10, "minutes": 1e-6})  # past before the second build
    summary = tune(config, strategy="greedy", isolate=False, progress=False)
    assert summary["builds"] < 10 and summary["winner"]["split"] == "holdout"
    line = f"the search stopped at budget.minutes=1e-06 after {summary['builds']} of 10 builds"
    assert line in capsys.readouterr().err
