"""TensorRT on an NVIDIA GPU: strongly typed engines built from the typed ONNX graph, checked layer by layer.

TensorRT 11 is strongly typed only: there are no precision flags, no per-layer precision API and no calibrators.
Every precision choice therefore lives in the typed ONNX graph (Q/DQ with the ``TENSORRT`` recipe, Casts for
FP16/BF16), and this backend checks after each build that the engine really runs each layer in the precision
the graph asks for (a TensorRT 11 build that silently stays in FP32 is a known failure; docs/tensorrt.md,
"What a build does").

Both ``tensorrt`` and ``cuda-python`` are imported lazily, in the constructor: ``import autotune`` and
``import autotune.backends.tensorrt`` work without them.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from autotune.backends.base import BackendUnavailable, BuildError, GraphArtifact, GraphBackend
from autotune.backends.tensorrt.command import member_value, shell_script, trtexec_command
from autotune.backends.tensorrt.cuda import CudaRuntime, import_cudart
from autotune.backends.tensorrt.engine import TensorRTEngine, _Tensor
from autotune.backends.tensorrt.inspect import (
    InspectorFormatError,
    PrecisionReport,
    check_precisions,
    parse_engine_info,
)
from autotune.backends.tensorrt.options import (
    REFERENCES,
    base_knobs,
    builder_knobs,
    configure_builder,
    network_flags,
    onnx_input_shapes,
    profile_shapes,
    reference_plan,
    supported_precisions,
)
from autotune.backends.tensorrt.rules import QDQError, check_qdq, requested_precisions
from autotune.capabilities import Capabilities
from autotune.config.schema import TensorRTOptions
from autotune.plan import KnobValue, Plan
from autotune.quant.lowering import NONE
from autotune.quant.recipe import TENSORRT
from autotune.run.files import atomic_write

_log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it on a machine with an NVIDIA GPU and driver: `pip install tensorrt-cu13 cuda-python` "
    "(CUDA 13 driver; `pip install tensorrt-cu12 cuda-python` for CUDA 12), or `pip install -e .[tensorrt]`"
)
TIMING_CACHE_NAME = "tensorrt-timing.cache"
"""The run's timing cache, in the first ``workdir`` a backend builds in (the run directory)."""


def import_tensorrt() -> Any:
    """The ``tensorrt`` module.

    Raises:
        BackendUnavailable: It is not installed, with how to install it.
    """
    try:
        import tensorrt as trt
    except (ImportError, OSError) as error:  # OSError: the package is there but its libraries are not
        raise BackendUnavailable(f"TensorRT is not installed ({error}); {INSTALL_HINT}") from error
    return trt


def _collecting_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that forwards to Python logging and keeps errors for the BuildError message."""

    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                _log.error("TensorRT: %s", msg)
            elif level == int(trt.ILogger.Severity.WARNING):
                _log.warning("TensorRT: %s", msg)
            else:
                _log.debug("TensorRT: %s", msg)

    return CollectingLogger()


def _parser_errors(parser: Any) -> str:
    lines = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        where = f"node {error.node_name()!r} ({error.node_operator()})" if error.node_name() else "the model"
        lines.append(f"{where}: {error.desc()}")
    return "; ".join(lines) or "no parser error recorded"


class TensorRTBackend(GraphBackend):
    """TensorRT engines on one NVIDIA GPU.

    Args:
        options: ``backend.options``, validated by the config (``autotune.config.schema.TensorRTOptions``); default
            its defaults.

    Raises:
        BackendUnavailable: TensorRT or cuda-python is not installed, or there is no CUDA GPU.
        TypeError: ``options`` is not a ``TensorRTOptions``.
    """

    runs_on_gpu = True
    fp16_base_range_checked = True

    name = "tensorrt"
    recipe = TENSORRT

    def __init__(self, options: TensorRTOptions | None = None):
        if options is not None and not isinstance(options, TensorRTOptions):
            # Another backend's options (or a raw dict) would fail later with an obscure attribute error.
            raise TypeError(
                f"TensorRTBackend takes autotune.config.schema.TensorRTOptions, got {type(options).__name__}"
            )
        self.options = options if options is not None else TensorRTOptions()
        self.trt = import_tensorrt()
        self.cuda = CudaRuntime(import_cudart(), self.options.device)
        self.version = str(self.trt.__version__)
        self.logger = _collecting_logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self._timing_cache_path: Path | None = Path(self.options.timing_cache) if self.options.timing_cache else None
        self._timing_cache_bytes = b""

    # ----- capabilities ---------------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Precisions from the device's compute capability; knobs from what this TensorRT has, and the base.

        ``base_precision`` (fp32, fp16, and bf16 where the device has it) is the type the whole typed graph
        computes in; the plan's layer precisions override it (``autotune.quant.basetype``).
        """
        precisions = supported_precisions(self.trt, self.cuda.compute_capability())
        return Capabilities(
            precisions=precisions,
            knobs=(*builder_knobs(self.trt, self.options), *base_knobs(precisions)),
        )

    # ----- the one-liner references ---------------------------------------------------------------------------

    def references(self) -> tuple[str, ...]:
        """``trt-fp16`` and, where the device has BF16, ``trt-bf16``: the whole model in that type, no override.

        TensorRT 11 has no ``--fp16``/``--best`` any more; NVIDIA's one line is ModelOpt AutoCast's FP16 (BF16)
        graph, which is ``base_precision`` of that type with every layer in it.
        """
        bases = next(iter(base_knobs(supported_precisions(self.trt, self.cuda.compute_capability()))), None)
        return tuple(name for name, base in REFERENCES.items() if bases is not None and base in bases.values)

    def build_reference(
        self, name: str, calibration: Sequence[Mapping[str, np.ndarray]], workdir: Path
    ) -> GraphArtifact:
        """Builds the reference ``name`` (``references``) on the prepared model; it needs no calibration.

        Raises:
            BuildError: ``name`` is no reference on this device, or the build failed.
        """
        if name not in self.references():
            return super().build_reference(name, calibration, workdir)
        precisions = supported_precisions(self.trt, self.cuda.compute_capability())
        return self.build(reference_plan(self.model.layers, name, precisions), NONE, workdir)

    # ----- build ----------------------------------------------------------------------------------------------

    def _cache_file(self, workdir: Path | None) -> Path | None:
        # The first workdir is the run directory (TrialRunner builds the FP32 reference there first); later
        # builds (an export into best/) keep using the run's cache so they get the same tactics.
        if self._timing_cache_path is None and workdir is not None:
            self._timing_cache_path = Path(workdir) / TIMING_CACHE_NAME
        return self._timing_cache_path

    def _load_timing_cache(self, builder_config: Any, path: Path | None) -> Any:
        data = path.read_bytes() if path is not None and path.is_file() else self._timing_cache_bytes
        timing_cache = builder_config.create_timing_cache(data)
        if not builder_config.set_timing_cache(timing_cache, False):
            _log.warning("timing cache %s was made on another device or TensorRT; starting an empty one", path)
            timing_cache = builder_config.create_timing_cache(b"")
            builder_config.set_timing_cache(timing_cache, False)
        return timing_cache

    def _save_timing_cache(self, builder_config: Any, path: Path | None) -> None:
        data = bytes(memoryview(builder_config.get_timing_cache().serialize()))
        self._timing_cache_bytes = data
        if path is not None:
            atomic_write(path, data)  # a concurrent build reads the old cache or the new one, never half a file

    def _network(self, builder: Any, model: onnx.ModelProto) -> tuple[Any, Any]:
        network = builder.create_network(network_flags(self.trt))
        parser = self.trt.OnnxParser(network, self.logger)
        if not parser.parse(model.SerializeToString()):
            raise BuildError(f"TensorRT's ONNX parser rejected the model: {_parser_errors(parser)}")
        return network, parser

    def _add_profile(self, builder: Any, network: Any, builder_config: Any, model: onnx.ModelProto) -> None:
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        shapes = profile_shapes({t.name: tuple(t.shape) for t in inputs}, onnx_input_shapes(model))
        if not shapes:
            return
        profile = builder.create_optimization_profile()
        for name, shape in shapes.items():
            profile.set_shape(name, shape, shape, shape)
        if builder_config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT rejected the optimization profile {shapes}")

    def _verify(self, layer_info: str, requested: Mapping[str, str]) -> PrecisionReport:
        try:
            report = check_precisions(parse_engine_info(layer_info), requested)
        except InspectorFormatError as error:
            message = f"cannot verify layer precisions: {error}"
            if self.options.strict_precision and any(p != "fp32" for p in requested.values()):
                raise BuildError(message) from error
            _log.warning(message)
            return PrecisionReport()
        if report.mismatches:
            lines = "; ".join(check.describe() for check in report.mismatches)
            message = f"{lines}. The engine does not run the plan; the graph's Q/DQ or Casts did not take effect"
            if self.options.strict_precision:
                raise BuildError(message + " (set backend.options.strict_precision: false to only warn)")
            _log.warning(message)
        unverified = [c for c in report.unverified if c.requested != "fp32"]
        if unverified:
            shown = ", ".join(f"{c.node} ({c.note})" for c in unverified[:5])
            _log.warning("%d low-precision layers could not be verified: %s", len(unverified), shown)
        return report

    def build_graph(
        self, graph: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path | None = None
    ) -> TensorRTEngine:
        """Parses the typed graph, builds a strongly typed engine and checks every layer's precision.

        Raises:
            BuildError: The Q/DQ graph breaks TensorRT's rules, the parser or builder failed, or (strict) a
                layer runs in another precision than the graph asks for.
        """
        trt = self.trt
        try:
            check_qdq(graph)
        except QDQError as error:
            raise BuildError(str(error)) from error
        self.logger.errors.clear()
        builder = trt.Builder(self.logger)
        network, _parser = self._network(builder, graph)  # the parser owns weights the network still uses
        builder_config = builder.create_builder_config()
        try:
            configure_builder(trt, builder_config, knobs, self.options)
        except ValueError as error:
            raise BuildError(str(error)) from error
        self._add_profile(builder, network, builder_config, graph)
        cache_path = self._cache_file(workdir)
        self._load_timing_cache(builder_config, cache_path)
        serialized = builder.build_serialized_network(network, builder_config)
        if serialized is None:
            errors = "; ".join(self.logger.errors[-5:]) or "no error message"
            raise BuildError(f"TensorRT could not build the engine: {errors}")
        self._save_timing_cache(builder_config, cache_path)
        plan = bytes(memoryview(serialized))
        engine = self.runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise BuildError("TensorRT could not deserialize the engine it just built")
        inspector = engine.create_engine_inspector()
        layer_info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
        report = self._verify(layer_info, requested_precisions(graph))
        return self._engine(engine, plan, layer_info, report, knobs, graph)

    def _engine(
        self,
        engine: Any,
        plan: bytes,
        layer_info: str,
        report: PrecisionReport,
        knobs: Mapping[str, KnobValue],
        graph: onnx.ModelProto,
    ) -> TensorRTEngine:
        trt = self.trt
        context = engine.create_execution_context()
        if context is None:
            raise BuildError("TensorRT could not create an execution context (out of device memory?)")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [o.name for o in graph.graph.output if o.name in names]
        outputs += [n for n in names if n not in inputs and n not in outputs]
        tensors = {n: _Tensor(n, np.dtype(trt.nptype(engine.get_tensor_dtype(n)))) for n in names}
        return TensorRTEngine(
            engine=engine,
            context=context,
            plan=plan,
            layer_info=layer_info,
            report=report,
            knobs=dict(knobs),
            cuda=self.cuda,
            input_names=inputs,
            output_names=outputs,
            tensors=tensors,
            stream=self.cuda.stream(),
            start=self.cuda.event(),
            end=self.cuda.event(),
        )

    # ----- run and time ---------------------------------------------------------------------------------------
    # A TensorRTEngine is called ``built`` below: tests/backends/tensorrt/test_api.py checks ``engine.<name>`` as
    # ``trt.ICudaEngine.<name>`` against the real bindings.

    def run_engine(self, engine: TensorRTEngine, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Copies the inputs in, runs once on the engine's stream, copies the outputs back (graph order)."""
        built = engine
        hosts = built.enqueue_inputs(feeds)
        built.execute()
        outputs = built.fetch_outputs()
        del hosts  # the inputs stay alive until the stream has synchronized
        return outputs

    def time_run(self, artifact: GraphArtifact, feeds: Mapping[str, np.ndarray]) -> float:
        """GPU milliseconds of one inference: CUDA events around the enqueue, copies outside them."""
        built: TensorRTEngine = artifact.engine
        hosts = built.enqueue_inputs(feeds)
        self.cuda.record(built.start, built.stream)
        built.execute()
        self.cuda.record(built.end, built.stream)
        elapsed = self.cuda.elapsed_ms(built.start, built.end)  # waits for the end event
        del hosts
        return elapsed

    # ----- export ---------------------------------------------------------------------------------------------

    def trtexec_argv(self, built: TensorRTEngine, graph: onnx.ModelProto, timing_cache: str | None) -> list[str]:
        """The trtexec command (relative paths, run from the export folder) that rebuilds this engine."""
        shapes = {n: s for n, s in onnx_input_shapes(graph).items() if any(d is None for d in s)}
        return trtexec_command(
            built.knobs,
            onnx_path="model.onnx",
            engine_path="engine.trtexec.plan",  # never overwrite the tuned engine.plan
            version=self.version,
            timing_cache_path=timing_cache,
            layer_info_path="layers.trtexec.json",
            tactic_sources=sorted(
                self.trt.TacticSource.__members__,
                key=lambda n: member_value(self.trt.TacticSource.__members__[n]),
            ),
            avg_timing_iterations=self.options.avg_timing_iterations,
            shapes=shapes or None,
        )

    def export(self, artifact: GraphArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes ``engine.plan``, the typed ``model.onnx``, the layer info, ``trtexec.sh`` and the timing cache.

        Returns:
            The files written, the loadable ``engine.plan`` first.
        """
        built: TensorRTEngine = artifact.engine
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [atomic_write(out_dir / "engine.plan", built.plan), *super().export(artifact, plan, out_dir)]
        layers = out_dir / "layers.json"
        layers.write_text(built.layer_info)
        precision = out_dir / "precision.json"
        precision.write_text(json.dumps(built.report.to_dict(), indent=2))
        files += [layers, precision]
        cache = None
        if self._timing_cache_path is not None and self._timing_cache_path.is_file():
            shutil.copyfile(self._timing_cache_path, out_dir / "timing.cache")
            files.append(out_dir / "timing.cache")
            cache = "timing.cache"
        script = out_dir / "trtexec.sh"
        comment = f"TensorRT {self.version}; knobs: {built.knobs}"
        script.write_text(shell_script(self.trtexec_argv(built, artifact.graph, cache), comment))
        script.chmod(0o755)
        files.append(script)
        return files
