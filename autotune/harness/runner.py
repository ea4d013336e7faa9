"""One trial, end to end: plan -> backend build -> accuracy -> latency against the FP32 reference."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from autotune.backends import BackendUnavailable, BuildError, get_backend
from autotune.config.schema import ConfirmConfig, MeasureConfig, TuneConfig
from autotune.data import Dataset, Splits
from autotune.harness.deadline import layerwise_allowance_s
from autotune.harness.identity import pace_key
from autotune.harness.prepare import (
    LayerwiseBounds,
    Quantizations,
    SetupError,
    Stages,
    calibrate_ranges,
    choose_layerwise,
    load_model,
    prepare_backend,
    search_space,
    statistics_collector,
)
from autotune.harness.sequential import SequentialTest
from autotune.measure.interference import Sampler
from autotune.measure.pace import RememberedPace
from autotune.measure.timing import Latency, Protocol, ReferencePace, interleaved, side_by_side
from autotune.metrics import LOG_RATIO_METRICS, SEQUENTIAL_METRICS, batch_terms, drop_of_ratio, fidelity, score
from autotune.model.layers import factory_module
from autotune.plan import Plan
from autotune.quant.calibrate import data_hash
from autotune.quant.layerwise import LayerwiseChoices
from autotune.quant.lowering import NONE
from autotune.quant.recipe import QuantRecipe
from autotune.run.trial import TrialResult

log = logging.getLogger(__name__)

CONFIRMATION_SPLIT = "holdout"
"""The split the finalists and one-liners are confirmed on (``Evaluator.confirm_side_by_side``)."""
BACK_TO_BACK_LAUNCHES = 20
"""Launches per back-to-back timing (``Backend.time_back_to_back``)."""
BACK_TO_BACK_ROUNDS = 15
"""Back-to-back timings per confirmed plan; their median is ``TrialResult.back_to_back_ms``."""
SLOW_PLAN_FACTOR = 3.0
"""A plan whose run takes at least this many times FP32's is timed in one round (``Protocol.rounds`` 1 in its
result): its ratio cannot change a ranking, and its rounds would cost the most (ONNX Runtime's
``quantize_dynamic`` on the EfficientNet example: docs/method.md#measurements-behind-the-codes-choices)."""


def search_protocol(measure: MeasureConfig) -> Protocol:
    """The latency protocol of the search's trials: the config's ``measure`` section."""
    return Protocol(**measure.model_dump())


def confirmation_protocol(measure: MeasureConfig, confirm: ConfirmConfig, rounds: int | None = None) -> Protocol:
    """The confirmation's protocol: ``measure`` with the repeats and rounds of ``confirm`` (or ``rounds``)."""
    return replace(search_protocol(measure), repeats=confirm.repeats, rounds=rounds or confirm.rounds)


@dataclass(frozen=True)
class _Scoring:
    """Which of a split's batches a plan was scored on: all (``batches`` None), or those scored before a stop."""

    batches: list[int] | None = None
    early_stop: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Scored:
    """A plan built and scored, waiting to be timed.

    Attributes:
        plan: The plan.
        artifact: Its engine.
        outputs: Its scored output on the batches scored, in split order.
        accuracy: Its score on them.
        build_s: Seconds to build it.
        scored_s: Seconds to build and score it.
        scoring: The batches scored (None: all) and the sequential test's stop (``TrialResult.early_stop``).
    """

    plan: Plan
    artifact: Any
    outputs: list
    accuracy: float
    build_s: float
    scored_s: float
    scoring: _Scoring


def _time_alone(
    timer: Callable[[], float],
    reference: Callable[[], float],
    protocol: Protocol,
    pace: ReferencePace,
    sampler: Sampler,
) -> tuple[Latency | str, float]:
    """One engine against the reference alone: its latency or its error, and the seconds it took."""
    start = time.perf_counter()
    try:
        latency = interleaved(timer, reference, protocol, self_timed=True, pace=pace, sampler=sampler)
        return latency, time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - any failure of a trial is data, not a crash of the run
        return f"{type(error).__name__}: {error}", time.perf_counter() - start


def _slow_plans(timers: Sequence[Callable[[], float]], reference: Callable[[], float]) -> list[int]:
    """The indices of the timers whose faster of two runs takes ``SLOW_PLAN_FACTOR`` times FP32's or more.

    A timer that fails here is left to the timing proper, which records its error.
    """
    try:
        reference_ms = min(reference(), reference())
    except Exception:  # noqa: BLE001 - the timing proper records the failure
        return []
    slow = []
    for index, timer in enumerate(timers):
        try:
            if min(timer(), timer()) >= SLOW_PLAN_FACTOR * reference_ms:
                slow.append(index)
        except Exception:  # noqa: BLE001 - as above
            continue
    return slow


class TrialRunner:
    """Prepares a run once (model, data, calibration, FP32 reference) and runs trials.

    Args:
        config: The run's config, as shipped to the trial process (or Ray actor) it runs in: preparing the run
            reads nearly every section of it.
        gate: Called once the backend is loaded (its runtime imported, its device probed, ``load_ahead`` done),
            before the model is: a trial process started with the run waits there until the run has exported the
            model.

    Raises:
        SetupError: The model, data or backend cannot be used.
    """

    def __init__(self, config: TuneConfig, gate: Callable[[], None] | None = None):
        self.config = config
        factory_module.cache_clear()  # this runner calls the factory afresh, once
        stage = Stages()
        self.setup_stages_s = stage.seconds
        """Wall seconds of each stage of this runner's set-up (``Stages``), for the run's summary."""
        try:
            self._load(stage, gate)
        except (ValueError, OSError, BackendUnavailable) as error:
            raise SetupError(str(error)) from error
        self.output_index = self._output_index()
        self._one_liners: dict[str, Any] = {}
        self._paces: dict[str, tuple[ReferencePace, RememberedPace]] = {}  # per split: see ``pace``
        self.sampler = Sampler()  # reads how busy the others kept the cores while a plan was timed
        self._prepare_reference_and_calibration(stage)
        with stage("layerwise"):
            self.use_layerwise(self._choose_layerwise())
        with stage("fp32_outputs"):
            self.reference_outputs = {
                split: self._outputs(self.reference, data) for split, data in self.datasets.items()
            }
        self.reference_accuracy = self._reference_accuracy()

    def _load(self, stage: Stages, gate: Callable[[], None] | None) -> None:
        """Loads the backend (then waits at ``gate``), the model, its search space and the data splits."""
        config = self.config
        with stage("backend"):
            self.backend = get_backend(config.backend, config.model, config.accuracy_budget, config.metric.name)
        if gate is not None:
            with stage("load_ahead"):
                self.backend.load_ahead()
            with stage("waiting_for_the_run"):
                gate()
        with stage("model"):
            self.model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
            self.space = search_space(config.search, self.model, self.backend)
            prepare_backend(self.backend, self.model, self.space)
        with stage("data"):  # each split once: without a holdout of its own, the evaluation data is read once
            splits = Splits(config.data, config.seed)
            self.datasets: dict[str, Dataset] = {
                name: splits.load(name, self.model.inputs) for name in ("evaluation", "holdout")
            }
            self._calibration_data = splits.load("calibration", self.model.inputs)
        self.calibration_batches = self._calibration_data.batches  # what the platform's one-liners calibrate on

    def _prepare_reference_and_calibration(self, stage: Stages) -> None:
        """Builds the FP32 reference and computes the calibration ranges, side by side where the backend allows.

        Calibration on ONNX Runtime runs the ONNX graph on the CPU's threads while the backend builds the FP32
        reference (the encoder's torch.compile and calibration took 13 s and 12 s one after the other on a fresh
        H200 machine). A backend that gathers the statistics on its own device does so after the build: a CUDA
        graph's capture fails when another thread launches work on the device meanwhile.

        Raises:
            SetupError: The FP32 model does not build on the backend.
        """
        config, data = self.config, self._calibration_data
        collector = statistics_collector(self.model, self.backend)
        calibrated = None
        if collector is None:
            calibrating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotune-calibration")
            calibrated = calibrating.submit(
                calibrate_ranges, config.calibration, config.cache_dir, self.model, self.backend, data
            )
            calibrating.shutdown(wait=False)
        try:  # its error first: calibration runs the FP32 model too, and would fail with a less helpful message
            with stage("fp32_build"):
                self.fp32_plan, self.reference = self._build_fp32_reference()
        except BuildError as error:
            raise SetupError(
                f"{self.model.path}: the FP32 model does not build on {self.backend.name}: {error}; "
                f"replace the operator it names, or choose another backend"
            ) from error
        with stage("calibration"):  # on ONNX Runtime: what calibration took beyond the FP32 build
            if calibrated is not None:
                self.calibration = calibrated.result()
            else:
                self.calibration = calibrate_ranges(
                    config.calibration, config.cache_dir, self.model, self.backend, data, collector
                )

    def _reference_accuracy(self) -> dict[str, float]:
        """FP32's score on each split.

        Raises:
            SetupError: The metric cannot score a split's labels.
        """
        accuracy: dict[str, float] = {}
        for split in self.datasets:
            try:
                accuracy[split] = self._score(self.reference_outputs[split], split)
            except ValueError as error:  # MetricError: labels that do not fit the metric
                raise SetupError(f"metric {self.config.metric.name} cannot score the {split} data: {error}") from error
        return accuracy

    def _build_fp32_reference(self) -> tuple[Plan, Any]:
        """The FP32 plan with the backend's ``fp32_reference_knobs``, and its build.

        Where that build fails (a module whose eager forward cannot be captured in a CUDA graph, say), the FP32
        plan at the knobs' defaults is the reference, as the search would build it.

        Raises:
            BuildError: The FP32 plan does not build at the defaults either.
        """
        plan = self.space.uniform("fp32", self.backend.fp32_reference_knobs())
        try:
            return plan, self.backend.build(plan, NONE, self.config.run_dir)
        except BuildError as error:
            default = self.space.uniform("fp32")
            if default == plan:
                raise
            log.warning(
                "the FP32 reference did not build with %s (%s); it is built as the search builds FP32",
                plan.knob_map,
                error,
            )
            return default, self.backend.build(default, NONE, self.config.run_dir)

    def _output_index(self) -> int:
        wanted = self.config.metric.output
        if wanted is None:
            return 0
        if wanted not in self.model.output_names:
            raise SetupError(f"metric.output {wanted!r} is not a model output; outputs: {self.model.output_names}")
        return self.model.output_names.index(wanted)

    def use_layerwise(self, choices: LayerwiseChoices | None) -> None:
        """Sets the per-layer recipes that plans with ``calibration=layerwise`` are built with.

        ``choices`` are those of the backend's default INT8 scheme; a plan of another scheme (``int8_scheme``) is
        built with choices made with its own, chosen when the first such plan is built.
        """
        self.quantizations = Quantizations(
            self.model, self.calibration, choices, self.backend.recipe, self.backend.recipe_for, self._choose_layerwise
        )

    def _choose_layerwise(self, recipe: QuantRecipe | None = None) -> LayerwiseChoices | None:
        """The per-layer calibration recipes measured with ``recipe`` (None: the backend's default scheme)."""
        return choose_layerwise(
            LayerwiseBounds(self.config.cache_dir, layerwise_allowance_s(self.config.budget.minutes)),
            self.model,
            self.backend,
            self.space,
            self.calibration,
            self._calibration_data,
            self.output_index,
            recipe,
        )

    @property
    def layerwise(self) -> LayerwiseChoices | None:
        """The per-layer recipes of this run, or None when ``layerwise`` is not offered."""
        return self.quantizations.layerwise

    def _outputs(self, artifact: Any, data: Dataset) -> list:
        return [self.backend.run(artifact, batch)[self.output_index] for batch in data.batches]

    def _score(self, outputs: list, split: str, batches: Sequence[int] | None = None) -> float:
        """The metric of outputs of ``split``'s batches (all, or those in ``batches``, in split order)."""
        metric = self.config.metric
        reference, labels = self.reference_outputs[split], self.datasets[split].labels
        if batches is not None:
            reference = [reference[index] for index in batches]
            labels = None if labels is None else [labels[index] for index in batches]
        return score(metric.name, outputs, reference, labels, metric.function)

    def sequential_test(self, split: str) -> SequentialTest | None:
        """The sequential test of a search trial on ``split``, or None where every batch is scored.

        None for the confirmation's split, a ``custom`` metric (no batch terms), ``metric.early_stop_alpha`` None,
        or a split of fewer than ``MIN_SPLIT_BATCHES`` batches.
        """
        name = self.config.metric.name
        if split == CONFIRMATION_SPLIT or name not in SEQUENTIAL_METRICS:
            return None
        batches = len(self.datasets[split].batches)
        return SequentialTest.for_split(batches, self.config.metric.early_stop_alpha, name in LOG_RATIO_METRICS)

    def _scored_outputs(self, artifact: Any, split: str, sequential: bool) -> tuple[list, _Scoring]:
        """The plan's outputs on ``split``: every batch, or where the sequential test stopped (in split order).

        With the test, the batches run in its seeded shuffled order, so the batches scored at a look are a random
        sample of the split; a plan the test does not stop is scored on the outputs of every batch in split order,
        as without it.
        """
        data = self.datasets[split]
        test = self.sequential_test(split) if sequential else None
        if test is None:
            return self._outputs(artifact, data), _Scoring()
        name, budget = self.config.metric.name, self.config.accuracy_budget
        reference_accuracy = self.reference_accuracy[split]

        def bound_to_drop(ratio: float) -> float:
            return drop_of_ratio(name, ratio, reference_accuracy)

        outputs: dict[int, Any] = {}
        numerators, denominators = [], []
        for index in test.order(self.config.seed):
            outputs[index] = self.backend.run(artifact, data.batches[index])[self.output_index]
            labels = data.labels[index] if data.labels is not None else None
            numerator, denominator = batch_terms(name, outputs[index], self.reference_outputs[split][index], labels)
            numerators.append(numerator)
            denominators.append(denominator)
            bound = test.look(numerators, denominators, bound_to_drop, budget)
            if bound is not None:
                scored = sorted(outputs)
                stop = {"batches": len(scored), "of": test.total_batches, "drop_lower_bound": bound}
                stop.update(budget=budget, alpha=test.alpha)
                return [outputs[index] for index in scored], _Scoring(scored, stop)
        return [outputs[index] for index in range(len(data.batches))], _Scoring()

    def build(self, plan: Plan, workdir: Path) -> Any:
        """The backend's engine of a plan, or of the one-liner a reference plan names.

        A reference is built once per run (its one-liner is deterministic), so exporting it after measuring it
        does not quantize the model again; the FP32 plan is the FP32 reference where the backend
        ``reuses_fp32_build``.
        """
        if plan.reference is not None:
            if plan.reference not in self._one_liners:
                self._one_liners[plan.reference] = self.backend.build_reference(
                    plan.reference, self.calibration_batches, workdir
                )
            return self._one_liners[plan.reference]
        if self.backend.reuses_fp32_build and plan.hash == self.fp32_plan.hash:
            return self.reference
        try:
            quantization = self.quantizations(plan)
        except (ValueError, SetupError) as error:  # layerwise not offered, or failed for the plan's scheme
            raise BuildError(str(error)) from error
        return self.backend.build(plan, quantization, workdir)

    def run(
        self, plan: Plan, split: str = "evaluation", protocol: Protocol | None = None, sequential: bool = False
    ) -> TrialResult:
        """Builds, scores and times one plan; every failure comes back as a failed result.

        Args:
            plan: The plan.
            split: The data it is scored on.
            protocol: The latency protocol (default the config's ``measure``).
            sequential: Stop scoring once the plan is surely over the budget (``metric.early_stop_alpha``): for the
                search's trials only, whose over-budget plans are never finalists.
        """
        return self.run_side_by_side([plan], split, protocol, sequential)[0]

    def run_side_by_side(
        self,
        plans: Sequence[Plan],
        split: str = "evaluation",
        protocol: Protocol | None = None,
        sequential: bool = False,
    ) -> list[TrialResult]:
        """Builds and scores every plan, then times them all against FP32 in the same rounds (``side_by_side``).

        Every failure is the failed result of its own plan: a plan that does not build or score is left out of the
        timing, and when timing them together fails, each plan is timed alone, so one bad engine costs no other
        plan its measurement.

        A plan stopped by the sequential test (``sequential``) is timed as any other: the search fits per-layer
        latency savings on every trial, over the budget or not (``autotune.search.estimate``, ``prior``), and the
        plans that stop are the ones with the most layers in INT8, whose savings it learns from.

        Returns:
            One result per plan, in order.
        """
        protocol = protocol or search_protocol(self.config.measure)
        feeds = self.datasets[split].batches[0]
        results: list[TrialResult | None] = [None] * len(plans)
        pending: list[tuple[int, _Scored]] = []
        for index, plan in enumerate(plans):
            outcome = self._build_and_score(plan, split, sequential)
            if isinstance(outcome, TrialResult):
                results[index] = outcome
            else:
                pending.append((index, outcome))
        if not pending:  # nothing built: no FP32 rounds to time
            return [result for result in results if result is not None]
        timed = self._time_by_pace([item.artifact for _, item in pending], split, protocol)
        back_to_back = self._back_to_back([item.artifact for _, item in pending], feeds, split)
        for (index, item), (latency, seconds, used), pipelined in zip(pending, timed, back_to_back[:-1], strict=True):
            if isinstance(latency, str):
                results[index] = TrialResult.failure(item.plan, latency, split=split, total_s=item.scored_s + seconds)
                continue
            reference_back_to_back = back_to_back[-1] if pipelined is not None else None
            results[index] = self._timed_result(
                item, latency, split, used, (seconds, pipelined, reference_back_to_back)
            )
        return [result for result in results if result is not None]

    def pace(self, split: str) -> ReferencePace:
        """The FP32 reference's pace on ``split``'s timed batch: this process's rounds, and earlier processes'.

        Every measurement of the process shares it, so a trial timed in a slow spell knows the spell is one; it starts
        from earlier processes' pace on this machine (``autotune.measure.pace``): a spell can outlast one.
        """
        if split not in self._paces:
            feeds_hash = data_hash([self.datasets[split].batches[0]])
            key = pace_key(self.model.hash, feeds_hash, self.config.backend, self.config.measure, self.config.execution)
            remembered = RememberedPace(self.config.cache_dir, key)
            self._paces[split] = (ReferencePace(remembered_ms=remembered.typical_ms()), remembered)
        return self._paces[split][0]

    def _time_by_pace(
        self, artifacts: Sequence[Any], split: str, protocol: Protocol
    ) -> list[tuple[Latency | str, float, Protocol]]:
        """Each artifact's latency (or error), seconds and protocol: plans ``SLOW_PLAN_FACTOR`` slower in one round.

        The slow ones are timed apart, after the others, so their long runs leave the others' rounds as they were.
        The process's fastest reference round is kept for the next process (``pace``).
        """
        feeds, pace = self.datasets[split].batches[0], self.pace(split)
        slow = _slow_plans([self._timer(a, feeds) for a in artifacts], self._timer(self.reference, feeds))
        groups = [(list(range(len(artifacts))), protocol)]
        if protocol.rounds > 1 and slow:
            one_round = replace(protocol, rounds=1, max_rounds=1)
            groups = [([i for i in range(len(artifacts)) if i not in slow], protocol), (slow, one_round)]
        timed: list[tuple[Latency | str, float, Protocol]] = [("not timed", 0.0, protocol)] * len(artifacts)
        for group, used in groups:
            if group:
                results = self._time_together([artifacts[i] for i in group], feeds, used, pace)
                for index, result in zip(group, results, strict=True):
                    timed[index] = (*result, used)
        self._paces[split][1].record(pace.recent_ms)
        return timed

    def _time_together(
        self, artifacts: Sequence[Any], feeds: Any, protocol: Protocol, pace: ReferencePace
    ) -> list[tuple[Latency | str, float]]:
        """Each artifact's latency against FP32 in the same rounds (or its error), and its share of the seconds.

        When timing them together fails, each is timed alone, so the failure of one engine stays its own.
        """
        timers = [self._timer(artifact, feeds) for artifact in artifacts]
        reference = self._timer(self.reference, feeds)
        start = time.perf_counter()
        try:
            latencies = side_by_side(timers, reference, protocol, self_timed=True, pace=pace, sampler=self.sampler)
            share_s = (time.perf_counter() - start) / max(1, len(timers))
            return [(latency, share_s) for latency in latencies]
        except Exception as error:  # noqa: BLE001 - any failure of a trial is data, not a crash of the run
            if len(timers) == 1:
                return [(f"{type(error).__name__}: {error}", time.perf_counter() - start)]
            return [_time_alone(timer, reference, protocol, pace, self.sampler) for timer in timers]

    def _timed_result(
        self,
        item: _Scored,
        latency: Latency,
        split: str,
        protocol: Protocol,
        timing: tuple[float, float | None, float | None],
    ) -> TrialResult:
        """The result of a scored plan timed against FP32.

        Args:
            item: The plan built and scored.
            latency: Its latency against FP32.
            split: The data split it was scored on.
            protocol: The protocol it was timed with.
            timing: Seconds its timing took, and its and FP32's back-to-back latency per launch (or Nones).
        """
        seconds, pipelined, reference_back_to_back = timing
        reference_outputs = self.reference_outputs[split]
        reference_accuracy = self.reference_accuracy[split]
        if item.scoring.batches is not None:  # stopped early: FP32 on the same batches
            reference_outputs = [reference_outputs[index] for index in item.scoring.batches]
            reference_accuracy = self._score(reference_outputs, split, item.scoring.batches)
        return TrialResult(
            plan=item.plan,
            latency_ms=latency.median_ms,
            latency_iqr_ms=latency.iqr_ms,
            reference_latency_ms=latency.reference_median_ms,
            reference_latency_iqr_ms=latency.reference_iqr_ms,
            speedup=latency.speedup,
            round_speedups=list(latency.round_speedups),
            accuracy=item.accuracy,
            reference_accuracy=reference_accuracy,
            accuracy_drop=reference_accuracy - item.accuracy,
            fidelity=fidelity(item.outputs, reference_outputs),
            early_stop=item.scoring.early_stop,
            score_s=item.scored_s - item.build_s,
            build_s=item.build_s,
            build_stages_s=dict(getattr(item.artifact, "build_stages_s", None) or {}),
            total_s=item.scored_s + seconds,
            protocol=protocol.to_dict(),
            back_to_back_ms=pipelined,
            reference_back_to_back_ms=reference_back_to_back,
            split=split,
            busy=latency.busy.to_dict() if latency.busy is not None else None,
        )

    def _back_to_back(self, artifacts: Sequence[Any], feeds: Any, split: str) -> list[float | None]:
        """Each artifact's, then FP32's, latency per launch back to back; Nones outside the confirmation.

        Only the confirmation (``CONFIRMATION_SPLIT``) pays for it: the search ranks by one launch. A plan whose
        timing fails gets None, as do all where the backend has no such timer.
        """
        nothing: list[float | None] = [None] * (len(artifacts) + 1)
        if split != CONFIRMATION_SPLIT:
            return nothing
        timings: list[float | None] = []
        for artifact in [*artifacts, self.reference]:
            try:
                runs = [
                    self.backend.time_back_to_back(artifact, feeds, BACK_TO_BACK_LAUNCHES)
                    for _ in range(BACK_TO_BACK_ROUNDS)
                ]
            except Exception:  # noqa: BLE001 - the one-launch timing stands; this one is left out
                runs = [None]
            timings.append(None if None in runs else float(np.median(runs)))
        return timings

    def _timer(self, artifact: Any, feeds: Any) -> Callable[[], float]:
        return lambda: self.backend.time_run(artifact, feeds)

    def _build_and_score(self, plan: Plan, split: str, sequential: bool = False) -> _Scored | TrialResult:
        """The plan's engine and accuracy on ``split`` (``sequential``: see ``run``), or its failed result."""
        start = time.perf_counter()
        if plan == self.fp32_plan:  # the reference's knobs need not be in the search's space (a config may narrow it)
            problems = []
        elif plan.reference is None:
            problems = self.space.violations(plan)
        else:
            problems = self._reference_problems(plan)
        if problems:
            return TrialResult.failure(plan, "plan outside the search space: " + "; ".join(problems), split=split)
        try:
            artifact = self.build(plan, self.config.run_dir)
            build_s = time.perf_counter() - start
            outputs, scoring = self._scored_outputs(artifact, split, sequential)
            accuracy = self._score(outputs, split, scoring.batches)
        except Exception as error:  # noqa: BLE001 - any failure of a trial is data, not a crash of the run
            return TrialResult.failure(
                plan, f"{type(error).__name__}: {error}", split=split, total_s=time.perf_counter() - start
            )
        return _Scored(plan, artifact, outputs, accuracy, build_s, time.perf_counter() - start, scoring)

    def _reference_problems(self, plan: Plan) -> list[str]:
        """Why a reference plan is not one of this run's: an unknown one-liner, or other layers or knobs."""
        offered = self.backend.references()
        if plan.reference not in offered:
            return [f"{self.backend.name} has no reference {plan.reference!r}; its references: {list(offered)}"]
        if plan != Plan.reference_plan(self.space.layer_names, plan.reference):
            return [f"reference plan {plan.reference!r} must have this model's layers, all fp32, and no other knob"]
        return []

    def export(self, plan: Plan, out_dir: Path) -> list[str]:
        """Builds a plan into ``out_dir`` and writes its deployable files there."""
        artifact = self.build(plan, out_dir)
        return [str(path) for path in self.backend.export(artifact, plan, out_dir)]
