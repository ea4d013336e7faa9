"""One trial, end to end: plan -> typed ONNX -> build -> accuracy -> latency against the FP32 reference.

``TrialRunner`` does the work and holds what a run prepares once (model, data, calibration, reference).
``Evaluator`` is what strategies call: it answers from the trial store when it can, and otherwise runs the
trial in a child process with a timeout, so a crash or a hang is a failed trial and not a dead run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from autotune.backends import Backend, BackendUnavailable, BuildError, get_backend
from autotune.config import TuneConfig
from autotune.data import Dataset, load_dataset
from autotune.measure import Protocol, interleaved
from autotune.metrics import fidelity, score
from autotune.model import InputSpec, LoadedModel, export_torch, load_onnx, prepare_model
from autotune.plan import Plan
from autotune.quant.calibrate import METHODS, Calibration, CalibrationSettings, calibrate
from autotune.quant.layerwise import LAYERWISE, SMOOTHING, LayerwiseChoices, choose_layer_methods
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.search.space import CALIBRATION_KNOB, SearchSpace, build_space
from autotune.store import TrialStore
from autotune.trial import FAILED, TIMEOUT, TrialResult

log = logging.getLogger(__name__)


class SetupError(RuntimeError):
    """The run cannot start (bad model, data, or config); nothing was built."""


def config_inputs(config: TuneConfig) -> list[InputSpec]:
    """The config's input specs."""
    return [InputSpec(i.name, tuple(i.shape), i.dtype) for i in config.inputs]


def model_file(config: TuneConfig) -> Path:
    """The ONNX file of the config's model, exporting a PyTorch factory on first use (cached by factory and shapes)."""
    if config.model.onnx is not None:
        return config.model.onnx
    inputs = config_inputs(config)
    if not inputs:
        raise SetupError("model.torch needs inputs: with names, shapes and dtypes to export the module")
    key = hashlib.sha256(repr((config.model.torch, inputs, config.model.opset)).encode()).hexdigest()[:12]
    path = config.cache_dir / "models" / f"{config.model.torch.replace(':', '.')}-{key}.onnx"
    if not path.exists():
        log.info("exporting %s to %s", config.model.torch, path)
        export_torch(config.model.torch, inputs, path, opset=config.model.opset)
    return path


def load_model(config: TuneConfig) -> LoadedModel:
    """Loads (or exports) the model and builds its layer table."""
    path = model_file(config)
    return prepare_model(load_onnx(path), path, config_inputs(config) or None, config.model.include_activation_matmuls)


def with_runtime_shares(model: LoadedModel, backend: Backend, feeds: dict) -> LoadedModel:
    """The model with each layer's share of FP32 runtime filled in, where the backend can profile."""
    shares = backend.profile(model.proto, feeds, model.layer_names)
    if shares is None:
        return model
    model.layers = [dataclasses.replace(layer, runtime_share=shares.get(layer.name)) for layer in model.layers]
    return model


def search_space(config: TuneConfig, model: LoadedModel, backend: Backend) -> SearchSpace:
    """The search space of a run.

    Raises:
        SetupError: The config's search restrictions do not fit the backend.
    """
    try:
        return build_space(model.layers, backend.capabilities(), config.search)
    except ValueError as error:
        raise SetupError(str(error)) from error


class TrialRunner:
    """Prepares a run once (model, data, calibration, FP32 reference) and runs trials.

    Args:
        config: The run's config.

    Raises:
        SetupError: The model, data or backend cannot be used.
    """

    def __init__(self, config: TuneConfig):
        self.config = config
        try:
            self.backend = get_backend(config.backend, config.model)
            self.model = load_model(config)
            self.space = search_space(config, self.model, self.backend)
            if self.backend.builds_from_plan:
                self.backend.bind(self.model, [self.space.layer_names[i] for i in self.space.searchable])
            self.datasets: dict[str, Dataset] = {
                "evaluation": load_dataset(config.data.evaluation, self.model.inputs, "evaluation", config.seed),
            }
            holdout = config.data.holdout or config.data.evaluation
            self.datasets["holdout"] = load_dataset(holdout, self.model.inputs, "holdout", config.seed + 1)
            calibration_data = load_dataset(config.data.calibration, self.model.inputs, "calibration", config.seed + 2)
        except (ValueError, OSError, BackendUnavailable) as error:
            raise SetupError(str(error)) from error
        self.output_index = self._output_index()
        try:  # first: calibration runs the FP32 model too, and would fail with a less helpful message
            if self.backend.builds_from_plan:  # FP32 needs no ranges, and calibration has not run yet
                self.reference = self.backend.build_plan(
                    self.space.uniform("fp32"), self.model.layers, {}, config.run_dir
                )
            else:
                self.reference = self.backend.build(self.model.proto, {}, config.run_dir)
        except BuildError as error:
            raise SetupError(
                f"{self.model.path}: the FP32 model does not build on {self.backend.name}: {error}; "
                f"replace the operator it names, or choose another backend"
            ) from error
        self.calibration = self._calibrate(calibration_data)
        self.use_layerwise(self._choose_layer_methods(calibration_data))
        self.reference_outputs = {split: self._outputs(self.reference, data) for split, data in self.datasets.items()}
        self.reference_accuracy: dict[str, float] = {}
        for split in self.datasets:
            try:
                self.reference_accuracy[split] = self._score(self.reference_outputs[split], split)
            except ValueError as error:  # MetricError: labels that do not fit the metric
                raise SetupError(f"metric {config.metric.name} cannot score the {split} data: {error}") from error

    def _output_index(self) -> int:
        wanted = self.config.metric.output
        if wanted is None:
            return 0
        if wanted not in self.model.output_names:
            raise SetupError(f"metric.output {wanted!r} is not a model output; outputs: {self.model.output_names}")
        return self.model.output_names.index(wanted)

    def _calibrate(self, data: Dataset) -> Calibration:
        tensors = required_ranges(self.model.layers, self.backend.recipe, self.model.proto)
        settings = CalibrationSettings(
            percentile=self.config.calibration.percentile, num_bins=self.config.calibration.num_bins
        )
        try:
            return calibrate(
                self.model.proto,
                tensors,
                data.batches,
                self.config.cache_dir / "calibration",
                self.model.hash,
                settings,
            )
        except ValueError as error:
            raise SetupError(f"calibration failed: {error}") from error

    def _choose_layer_methods(self, data: Dataset) -> LayerwiseChoices | None:
        """Per-layer range methods, when the search may use ``layerwise`` calibration."""
        offered = next((knob.values for knob in self.space.knobs if knob.name == CALIBRATION_KNOB), ())
        if LAYERWISE not in offered:
            return None
        layers = [
            layer for layer, options in zip(self.space.layers, self.space.choices, strict=True) if "int8" in options
        ]
        try:
            return choose_layer_methods(
                self.model.proto,
                layers,
                self.backend.recipe,
                self.calibration,
                data.batches,
                self.output_index,
                self.config.cache_dir / "calibration",
                self.model.hash,
                # Plan-native backends rewrite their own modules: only range methods carry over to them.
                METHODS if self.backend.builds_from_plan else (*METHODS, *SMOOTHING),
            )
        except Exception as error:  # noqa: BLE001 - ORT raises its own exception types
            raise SetupError(
                f"layerwise calibration failed: {error}; leave 'layerwise' out of "
                f"search.calibration_methods to calibrate every layer alike"
            ) from error

    def use_layerwise(self, choices: LayerwiseChoices | None) -> None:
        """Sets the per-layer recipes that plans with ``calibration=layerwise`` are built with."""
        self.layerwise = choices
        self._smoothing = choices.smoothing(self.model.proto, self.model.layers) if choices else {}
        self._layer_ranges = (
            choices.layer_ranges(self.calibration, self._smoothing, self.model.layers) if choices else {}
        )

    def _ranges(self, plan: Plan) -> tuple[dict[str, tuple[float, float]], dict[str, Any], dict[str, Any]]:
        """Ranges for the plan's calibration method, per-layer ranges that replace them, SmoothQuant factors.

        The last two are empty unless the plan's calibration is ``layerwise``.
        """
        method = str(plan.knob(CALIBRATION_KNOB, "max"))
        if method == LAYERWISE:
            if self.layerwise is None:
                raise BuildError("calibration=layerwise is not offered by this run's search.calibration_methods")
            return self.calibration.ranges("max"), self._layer_ranges, self._smoothing
        return self.calibration.ranges(method), {}, {}

    def _outputs(self, artifact: Any, data: Dataset) -> list:
        return [self.backend.run(artifact, batch)[self.output_index] for batch in data.batches]

    def _score(self, outputs: list, split: str) -> float:
        metric = self.config.metric
        return score(metric.name, outputs, self.reference_outputs[split], self.datasets[split].labels, metric.function)

    def typed_model(self, plan: Plan) -> onnx.ModelProto:
        """The explicitly typed ONNX model of a plan."""
        ranges, layer_ranges, smoothing = self._ranges(plan)
        return rewrite(self.model.proto, self.model.layers, plan, ranges, self.backend.recipe, layer_ranges, smoothing)

    def build(self, plan: Plan, workdir: Path) -> Any:
        """The backend's artifact of a plan: from the plan itself, or from its typed ONNX model."""
        if self.backend.builds_from_plan:
            ranges, layer_ranges, _ = self._ranges(plan)  # no smoothing candidates for plan-native backends
            return self.backend.build_plan(plan, self.model.layers, ranges, workdir, layer_ranges)
        return self.backend.build(self.typed_model(plan), plan.knob_map, workdir)

    def run(self, plan: Plan, split: str = "evaluation", protocol: Protocol | None = None) -> TrialResult:
        """Builds, scores and times one plan; every failure comes back as a failed result."""
        protocol = protocol or Protocol(**self.config.measure.model_dump())
        start = time.perf_counter()
        problems = self.space.violations(plan)
        if problems:
            return TrialResult.failure(plan, "plan outside the search space: " + "; ".join(problems), split=split)
        try:
            artifact = self.build(plan, self.config.run_dir)
            build_s = time.perf_counter() - start
            outputs = self._outputs(artifact, self.datasets[split])
            accuracy = self._score(outputs, split)
            feeds = self.datasets[split].batches[0]
            latency = interleaved(
                lambda: self.backend.time_run(artifact, feeds),
                lambda: self.backend.time_run(self.reference, feeds),
                protocol,
                self_timed=True,
            )
        except Exception as error:  # noqa: BLE001 - any failure of a trial is data, not a crash of the run
            return TrialResult.failure(
                plan, f"{type(error).__name__}: {error}", split=split, total_s=time.perf_counter() - start
            )
        return TrialResult(
            plan=plan,
            latency_ms=latency.median_ms,
            latency_iqr_ms=latency.iqr_ms,
            reference_latency_ms=latency.reference_median_ms,
            reference_latency_iqr_ms=latency.reference_iqr_ms,
            speedup=latency.speedup,
            accuracy=accuracy,
            reference_accuracy=self.reference_accuracy[split],
            accuracy_drop=self.reference_accuracy[split] - accuracy,
            fidelity=fidelity(outputs, self.reference_outputs[split]),
            build_s=build_s,
            total_s=time.perf_counter() - start,
            protocol=protocol.to_dict(),
            split=split,
        )

    def export(self, plan: Plan, out_dir: Path) -> list[str]:
        """Writes the plan's deployable files into ``out_dir``."""
        if self.backend.builds_from_plan:
            artifact = self.build(plan, out_dir)
            return [str(p) for p in self.backend.export_plan(artifact, plan, out_dir)]
        typed = self.typed_model(plan)
        artifact = self.backend.build(typed, plan.knob_map, out_dir)
        return [str(p) for p in self.backend.export(artifact, typed, out_dir)]


# ---- the child process -------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Makes the trial process end with the run, even when the run is killed with SIGKILL.

    On Linux the kernel sends this process SIGKILL when the thread that started it exits (``PR_SET_PDEATHSIG``),
    so a killed run leaves no orphan building or hanging on a shared machine. Elsewhere the process still ends
    at its next request, when it reads the end of the pipe.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: keep the end-of-pipe behaviour
            return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(connection: Any, config_data: dict) -> None:
    """Serves trials until the parent closes the pipe.

    Ctrl-C in a terminal reaches the whole process group: the trial process ignores SIGINT and leaves the
    interrupt to the run, which stops it after committing what was measured.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        runner = TrialRunner(TuneConfig.model_validate(config_data))
        reply: tuple[str, Any] = ("ready", None)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        reply = ("setup_error", f"{error}" if isinstance(error, SetupError) else traceback.format_exc())
    while True:
        try:
            connection.send(reply)
        except OSError:  # the run closed the pipe (it was stopped or interrupted): nobody waits for the answer
            return
        if reply[0] == "setup_error":
            return
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):  # closed, or reset by the run with our answer unread
            return
        try:
            if kind == "trial":
                plan, split, protocol = payload
                result = runner.run(Plan.from_dict(plan), split, Protocol(**protocol) if protocol else None)
                reply = ("result", result.to_dict())
            elif kind == "export":
                plan, out_dir = payload
                reply = ("result", runner.export(Plan.from_dict(plan), Path(out_dir)))
            else:
                reply = ("error", f"unknown request {kind!r}")
        except Exception:  # noqa: BLE001
            reply = ("error", traceback.format_exc())


class _ChildRunner:
    """A ``TrialRunner`` in a child process, restarted after a crash or a timeout."""

    def __init__(self, config: TuneConfig, setup_timeout_s: float):
        self.config = config
        self.setup_timeout_s = setup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._connection: Any = None

    def start(self) -> None:
        """Starts the child process and waits until it has prepared the run.

        Raises:
            SetupError: Preparing failed, died or took longer than the setup timeout.
        """
        parent, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_worker_main, args=(child, self.config.model_dump(mode="json")), daemon=True
        )
        self._process.start()
        child.close()
        self._connection = parent
        if not parent.poll(self.setup_timeout_s):
            self.stop()
            raise SetupError(f"preparing the run took longer than {self.setup_timeout_s:.0f} s")
        try:
            kind, message = parent.recv()
        except EOFError:
            self._process.join(timeout=5)  # reap it, so the exit code is known
            code = self._process.exitcode
            self.stop()
            raise SetupError(f"the trial process died while preparing the run (exit code {code})") from None
        if kind != "ready":
            self.stop()
            raise SetupError(message)

    def stop(self) -> None:
        """Kills the child process."""
        if self._process is not None:
            if self._connection is not None:
                self._connection.close()
            self._process.join(timeout=2)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = None
        self._connection = None

    def request(self, kind: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """Sends one request; returns ``(status, payload)`` with status result, error, crash or timeout."""
        if self._process is None or not self._process.is_alive():
            self.start()
        self._connection.send((kind, payload))
        if not self._connection.poll(timeout_s):
            self._process.kill()
            self.stop()
            return "timeout", f"no result after {timeout_s:.0f} s; the trial process was killed"
        try:
            return self._connection.recv()
        except EOFError:
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.stop()
            return "crash", f"the trial process died (exit code {code})"


class Evaluator:
    """The one evaluation harness every strategy uses: store first, then a real build.

    Args:
        config: The run's config.
        store: The run's trial store.
        isolate: Run trials in a child process with a timeout (default). In-process runs are for tests.
        on_result: Called with every new result (not with store hits).

    Use an evaluator from the thread that created it: on Linux its trial process ends when that thread ends.
    """

    def __init__(
        self,
        config: TuneConfig,
        store: TrialStore,
        isolate: bool = True,
        on_result: Callable[[TrialResult], None] | None = None,
    ):
        self.config = config
        self.store = store
        self.on_result = on_result
        # Every stored trial is one build, so the count survives a kill between commit and bookkeeping.
        self.builds = len(store)
        self.cache_hits = 0
        self._inline: TrialRunner | None = None
        self._child: _ChildRunner | None = None
        if isolate:
            self._child = _ChildRunner(config, setup_timeout_s=max(600.0, 2 * config.backend.timeout_s))
            self._child.start()
        else:
            self._inline = TrialRunner(config)

    def close(self) -> None:
        """Stops the child process."""
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: Plan, split: str, protocol: Protocol | None) -> TrialResult:
        if self._inline is not None:
            return self._inline.run(plan, split, protocol)
        payload = (plan.to_dict(), split, protocol.to_dict() if protocol else None)
        status, data = self._child.request("trial", payload, self.config.backend.timeout_s)
        if status == "result":
            return TrialResult.from_dict(data)
        return TrialResult.failure(plan, data, status=TIMEOUT if status == "timeout" else FAILED, split=split)

    def evaluate(self, plan: Plan) -> TrialResult:
        """The plan's result on the evaluation data: from the store, or built, measured and committed."""
        stored = self.store.get(plan.hash)
        if stored is not None:
            self.cache_hits += 1
            return stored
        result = self._run(plan, "evaluation", None)
        self.store.put(result)
        self.builds = len(self.store)
        if self.on_result is not None:
            self.on_result(result)
        return result

    def measure(self, plan: Plan, split: str = "evaluation", protocol: Protocol | None = None) -> TrialResult:
        """Builds and measures a plan afresh, bypassing the store."""
        return self._run(plan, split, protocol)

    def confirm(self, plan: Plan) -> TrialResult:
        """Re-measures a finalist on held-out data with the longer confirmation protocol, and stores it."""
        confirm = self.config.confirm
        protocol = Protocol(warmup=self.config.measure.warmup, repeats=confirm.repeats, rounds=confirm.rounds)
        result = self._run(plan, "holdout", protocol)
        self.store.put_confirmation(result)
        return result

    def export(self, plan: Plan, out_dir: Path) -> list[str]:
        """Writes a plan's deployable files."""
        out_dir.mkdir(parents=True, exist_ok=True)
        if self._inline is not None:
            return self._inline.export(plan, out_dir)
        status, data = self._child.request("export", (plan.to_dict(), str(out_dir)), self.config.backend.timeout_s)
        if status != "result":
            raise BuildError(f"export failed: {data}")
        return data
