"""TensorRT on an NVIDIA GPU: strongly typed engines built from the typed ONNX model, checked layer by layer.

TensorRT 11 is strongly typed only: there are no precision flags, no per-layer precision API and no calibrators.
Every precision choice therefore lives in the typed ONNX graph (Q/DQ with the ``TENSORRT`` recipe, Casts for
FP16/BF16), and this backend checks after each build that the engine really runs each layer in the precision
the graph asks for (a TensorRT 11 build that silently stays in FP32 is a known failure, tensorrt.md section 4).

Both ``tensorrt`` and ``cuda-python`` are imported lazily, in the constructor: ``import autotune`` and
``import autotune.backends.tensorrt`` work without them (Polygraphy's lazy-import rule, style-anchors.md).
Names that exist only in some TensorRT versions are looked up by string (``trt.TacticSource.__members__``,
``hasattr``), and enum members always by name: 11.0 renumbered several enums.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from autotune.backends.base import Backend, BackendUnavailable, BuildError, Capabilities, Knob
from autotune.backends.trt_command import (
    AUTO,
    AUX_STREAMS_KNOB,
    MAX_TACTICS_KNOB,
    OPT_LEVEL_KNOB,
    TACTIC_KNOB,
    TILING_KNOB,
    TILING_LEVELS,
    WORKSPACE_KNOB,
    major_version,
    member_value,
    shell_script,
    tactic_mask,
    tactic_names,
    tactic_source_values,
    trtexec_command,
)
from autotune.backends.trt_inspect import (
    InspectorFormatError,
    PrecisionReport,
    check_precisions,
    parse_engine_info,
)
from autotune.backends.trt_rules import COMPUTE_OPS, QDQError, check_qdq, requested_precisions
from autotune.plan import KnobValue
from autotune.quant.recipe import TENSORRT

_log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it on a machine with an NVIDIA GPU and driver: `pip install tensorrt-cu13 cuda-python` "
    "(CUDA 13 driver; `pip install tensorrt-cu12 cuda-python` for CUDA 12), or `pip install -e .[tensorrt]`"
)
TIMING_CACHE_NAME = "tensorrt-timing.cache"
"""The run's timing cache, in the first ``workdir`` a backend builds in (the run directory)."""

# ---- options and pure mappings (tested with a fake ``trt`` module) -------------------------------------------


@dataclass(frozen=True)
class TensorRTOptions:
    """``backend.options`` of a TensorRT run; every ladder's first value is its knob's default.

    Attributes:
        workspace_ladder_mib: Workspace memory-pool limits offered, in MiB.
        builder_optimization_levels: ``builder_optimization_level`` values offered (0-5; TensorRT's default is 3).
        max_num_tactics: ``max_num_tactics`` values offered (-1 = TensorRT's heuristic).
        tiling_optimization_levels: ``TilingOptimizationLevel`` member names offered.
        max_aux_streams: ``max_aux_streams`` values offered (-1 = TensorRT's heuristic).
        avg_timing_iterations: Timing runs averaged per tactic (API default 1, trtexec's 8).
        strict_precision: A requested precision that did not land fails the trial; False only logs a warning.
        device: CUDA device index.
        timing_cache: Timing-cache file; default ``<first workdir>/tensorrt-timing.cache``.
    """

    workspace_ladder_mib: tuple[int, ...] = (256, 1024, 4096)
    builder_optimization_levels: tuple[int, ...] = (3, 4, 5)
    max_num_tactics: tuple[int, ...] = (AUTO, 16)
    tiling_optimization_levels: tuple[str, ...] = ("NONE", "MODERATE")
    max_aux_streams: tuple[int, ...] = (AUTO, 0)
    avg_timing_iterations: int = 4
    strict_precision: bool = True
    device: int = 0
    timing_cache: str | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> TensorRTOptions:
        """Validates ``backend.options``.

        Raises:
            ValueError: An unknown key or a bad value, naming the allowed keys and values.
        """
        options = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown backend.options {sorted(unknown)} for tensorrt; allowed: {sorted(known)}")
        values: dict[str, Any] = {}
        for key in ("workspace_ladder_mib", "builder_optimization_levels", "max_num_tactics", "max_aux_streams"):
            if key in options:
                values[key] = _int_ladder(key, options[key])
        if any(mib <= 0 for mib in values.get("workspace_ladder_mib", (1,))):
            raise ValueError("backend.options.workspace_ladder_mib: sizes must be positive MiB")
        if any(not 0 <= level <= 5 for level in values.get("builder_optimization_levels", (3,))):
            raise ValueError("backend.options.builder_optimization_levels: levels are 0 to 5")
        if "tiling_optimization_levels" in options:
            levels = tuple(
                str(v).upper() for v in _as_list("tiling_optimization_levels", options["tiling_optimization_levels"])
            )
            if any(level not in TILING_LEVELS for level in levels):
                raise ValueError(f"backend.options.tiling_optimization_levels: names from {list(TILING_LEVELS)}")
            values["tiling_optimization_levels"] = tuple(dict.fromkeys(levels))
        for key, kind in (("avg_timing_iterations", int), ("device", int), ("strict_precision", bool)):
            if key in options:
                if not isinstance(options[key], kind) or (kind is int and isinstance(options[key], bool)):
                    raise ValueError(f"backend.options.{key} must be {kind.__name__}, got {options[key]!r}")
                values[key] = options[key]
        if values.get("avg_timing_iterations", 1) < 1:
            raise ValueError("backend.options.avg_timing_iterations must be >= 1")
        if "timing_cache" in options:
            values["timing_cache"] = None if options["timing_cache"] is None else str(options["timing_cache"])
        return cls(**values)


def _as_list(key: str, value: Any) -> list[Any]:
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"backend.options.{key} must be a non-empty list, got {value!r}")
    return list(value)


def _int_ladder(key: str, value: Any) -> tuple[int, ...]:
    items = _as_list(key, value)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in items):
        raise ValueError(f"backend.options.{key} must list integers, got {value!r}")
    return tuple(dict.fromkeys(items))


def supported_precisions(trt: Any, compute_capability: tuple[int, int]) -> dict[str, tuple[str, ...]]:
    """Precisions per op type on this TensorRT and device.

    FP16 and INT8 (Q/DQ) everywhere TensorRT 10/11 runs; BF16 from compute capability 8.0 (Ampere); FP8 from
    8.9 (Ada, Hopper) for Conv/Gemm/MatMul, where NVIDIA's PTQ places it. INT4 is left out: TensorRT supports it
    only as weight-only block quantization of MatMul/Gemm, which the graph rewriter does not write.
    """
    types = trt.DataType.__members__
    common = ["fp32", "fp16"]
    if compute_capability >= (8, 0) and "BF16" in types:
        common.append("bf16")
    precisions = {op: (*common, "int8") for op in COMPUTE_OPS}
    if compute_capability >= (8, 9) and "FP8" in types:
        for op in ("Conv", "Gemm", "MatMul"):
            precisions[op] = (*precisions[op], "fp8")
    return precisions


def builder_knobs(trt: Any, options: TensorRTOptions) -> tuple[Knob, ...]:
    """The build knobs this TensorRT has, with the configured value ladders."""
    knobs = [
        Knob(
            TACTIC_KNOB,
            tactic_source_values(trt.TacticSource.__members__),
            "optional kernel sources ('+'-joined TacticSource names of the installed version)",
        ),
        Knob(WORKSPACE_KNOB, options.workspace_ladder_mib, "workspace memory-pool limit in MiB"),
    ]
    if hasattr(trt.IBuilderConfig, "builder_optimization_level"):
        knobs.append(
            Knob(OPT_LEVEL_KNOB, options.builder_optimization_levels, "builder effort: 3 default, 4-5 JIT kernels")
        )
    if hasattr(trt.IBuilderConfig, "max_num_tactics"):
        knobs.append(Knob(MAX_TACTICS_KNOB, options.max_num_tactics, "tactics timed per layer (-1: heuristic)"))
    if hasattr(trt.IBuilderConfig, "tiling_optimization_level") and hasattr(trt, "TilingOptimizationLevel"):
        present = trt.TilingOptimizationLevel.__members__
        levels = tuple(level for level in options.tiling_optimization_levels if level in present)
        if levels:
            knobs.append(Knob(TILING_KNOB, levels, "cross-kernel tiling search effort (TilingOptimizationLevel)"))
    if hasattr(trt.IBuilderConfig, "max_aux_streams"):
        knobs.append(Knob(AUX_STREAMS_KNOB, options.max_aux_streams, "auxiliary streams (-1: heuristic)"))
    return tuple(knobs)


def network_flags(trt: Any) -> int:
    """``create_network`` flags: STRONGLY_TYPED on 10.x; 0 on 11.x, where it is deprecated and always on.

    Raises:
        BuildError: The installed TensorRT cannot build strongly typed networks.
    """
    if major_version(trt.__version__) >= 11:
        return 0
    flag = trt.NetworkDefinitionCreationFlag.__members__.get("STRONGLY_TYPED")
    if flag is None:
        raise BuildError(f"TensorRT {trt.__version__} has no strongly typed networks; autotune needs TensorRT >= 10")
    return 1 << member_value(flag)


def _require(builder_config: Any, attribute: str, knob: str) -> None:
    if not hasattr(builder_config, attribute):
        raise ValueError(f"knob {knob} needs IBuilderConfig.{attribute}, which this TensorRT does not have")


def configure_builder(trt: Any, builder_config: Any, knobs: Mapping[str, KnobValue], options: TensorRTOptions) -> None:
    """Writes a plan's knobs into an ``IBuilderConfig``; knobs the plan does not set keep TensorRT's defaults.

    No ``BuilderFlag`` is set: precision flags do not exist in TensorRT 11 and strong typing makes them
    meaningless in 10.x; precision is in the graph.

    Args:
        trt: The ``tensorrt`` module (or a fake with the same names).
        builder_config: The config to write.
        knobs: The plan's knobs; others (``calibration``, ``weight_granularity``) are ignored.
        options: The backend options.

    Raises:
        ValueError: A knob value this TensorRT cannot take.
    """
    builder_config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector needs layer details
    builder_config.avg_timing_iterations = options.avg_timing_iterations
    if WORKSPACE_KNOB in knobs:
        mib = int(knobs[WORKSPACE_KNOB])
        if mib <= 0:
            raise ValueError(f"workspace_mib must be positive, got {mib}")
        # A bad size does not raise in TensorRT (the call is a no-op plus an error-recorder entry), so check here.
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, mib << 20)
    if TACTIC_KNOB in knobs:
        mask = tactic_mask(trt.TacticSource.__members__, tactic_names(knobs[TACTIC_KNOB]))
        if not builder_config.set_tactic_sources(mask):
            raise ValueError(f"TensorRT rejected tactic-source mask {mask:#x} ({knobs[TACTIC_KNOB]})")
    if OPT_LEVEL_KNOB in knobs:
        level = int(knobs[OPT_LEVEL_KNOB])
        if not 0 <= level <= 5:
            raise ValueError(f"builder_optimization_level must be 0 to 5, got {level}")
        builder_config.builder_optimization_level = level
    if MAX_TACTICS_KNOB in knobs and int(knobs[MAX_TACTICS_KNOB]) != AUTO:
        _require(builder_config, "max_num_tactics", MAX_TACTICS_KNOB)
        builder_config.max_num_tactics = int(knobs[MAX_TACTICS_KNOB])
    if TILING_KNOB in knobs:
        _require(builder_config, "tiling_optimization_level", TILING_KNOB)
        members = trt.TilingOptimizationLevel.__members__
        name = str(knobs[TILING_KNOB])
        if name not in members:
            raise ValueError(f"tiling_optimization_level {name!r} is not one of {sorted(members)}")
        builder_config.tiling_optimization_level = members[name]
    if AUX_STREAMS_KNOB in knobs and int(knobs[AUX_STREAMS_KNOB]) != AUTO:
        _require(builder_config, "max_aux_streams", AUX_STREAMS_KNOB)
        builder_config.max_aux_streams = int(knobs[AUX_STREAMS_KNOB])


def onnx_input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Each graph input's dims (None where symbolic), initializers excluded."""
    initializers = {init.name for init in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    return shapes


def profile_shapes(
    network_shapes: Mapping[str, Sequence[int]], model_shapes: Mapping[str, Sequence[int | None]]
) -> dict[str, tuple[int, ...]]:
    """Shapes for an optimization profile (min = opt = max) of the network inputs with dynamic dims.

    Args:
        network_shapes: Network input name to its dims as parsed (-1 = dynamic).
        model_shapes: The ONNX input dims (the tuner fixes them from ``inputs:`` in the config).

    Returns:
        Input name to a fully known shape, for dynamic inputs only (empty for a static network).

    Raises:
        BuildError: A dynamic dim has no size in the model either.
    """
    shapes = {}
    for name, dims in network_shapes.items():
        dims = tuple(int(d) for d in dims)
        if all(d >= 0 for d in dims):
            continue
        known = tuple(model_shapes.get(name, ()))
        fixed = [d if d >= 0 else (known[i] if i < len(known) else None) for i, d in enumerate(dims)]
        if any(d is None or d < 0 for d in fixed):
            raise BuildError(
                f"input {name!r} has dynamic dims {list(dims)} and the model does not fix them; "
                f"give its shape under inputs: in the config"
            )
        shapes[name] = tuple(int(d or 0) for d in fixed)
    return shapes


# ---- CUDA through cuda-python -------------------------------------------------------------------------------


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


def import_cudart() -> Any:
    """cuda-python's CUDA runtime module.

    Raises:
        BackendUnavailable: cuda-python is not installed.
    """
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6 had only this layout
        except ImportError as error:
            raise BackendUnavailable(
                f"cuda-python is not installed ({error}); the TensorRT backend moves data and times runs through "
                f"it: `pip install cuda-python` (or `pip install -e .[tensorrt]`)"
            ) from error
    return cudart


class CudaRuntime:
    """The few CUDA runtime calls the backend needs, through cuda-python, with errors raised as exceptions.

    Args:
        cudart: ``cuda.bindings.runtime``.
        device: The device index.

    Raises:
        BackendUnavailable: No CUDA GPU (or no driver) is found.
    """

    def __init__(self, cudart: Any, device: int = 0):
        self.cudart = cudart
        self.device = device
        error, count = cudart.cudaGetDeviceCount()
        if error != cudart.cudaError_t.cudaSuccess or count == 0:
            raise BackendUnavailable(
                f"no CUDA GPU: cudaGetDeviceCount says {self._describe(error)} with {count} devices; "
                f"the TensorRT backend needs an NVIDIA GPU and driver (use backend.name: onnxruntime on CPUs)"
            )
        if device >= count:
            raise BackendUnavailable(f"backend.options.device is {device} but only {count} CUDA devices exist")
        self.check(cudart.cudaSetDevice(device), "cudaSetDevice")

    def _describe(self, error: Any) -> str:
        try:
            name = self.cudart.cudaGetErrorString(error)[1]
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - only used to word an error message
            return str(error)

    def check(self, result: Any, what: str) -> Any:
        """Unwraps cuda-python's ``(error, value...)`` tuples.

        Raises:
            RuntimeError: The call failed.
        """
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self.cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {self._describe(error)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)`` of the device."""
        props = self.check(self.cudart.cudaGetDeviceProperties(self.device), "cudaGetDeviceProperties")
        return int(props.major), int(props.minor)

    def device_name(self) -> str:
        """The device's name."""
        props = self.check(self.cudart.cudaGetDeviceProperties(self.device), "cudaGetDeviceProperties")
        name = props.name
        return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00")

    def malloc(self, nbytes: int) -> int:
        """A device allocation of at least one byte."""
        return int(self.check(self.cudart.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))

    def free(self, pointer: int) -> None:
        """Frees a device allocation."""
        self.check(self.cudart.cudaFree(pointer), "cudaFree")

    def stream(self) -> Any:
        """A new non-default stream (TensorRT adds device syncs on the default stream)."""
        return self.check(self.cudart.cudaStreamCreate(), "cudaStreamCreate")

    def destroy_stream(self, stream: Any) -> None:
        """Destroys a stream."""
        self.check(self.cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def event(self) -> Any:
        """A new CUDA event (timing enabled)."""
        return self.check(self.cudart.cudaEventCreate(), "cudaEventCreate")

    def destroy_event(self, event: Any) -> None:
        """Destroys an event."""
        self.check(self.cudart.cudaEventDestroy(event), "cudaEventDestroy")

    def to_device(self, pointer: int, array: np.ndarray, stream: Any) -> None:
        """Copies a C-contiguous host array to the device, ordered on ``stream``."""
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.check(
            self.cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, kind, stream), "cudaMemcpyAsync"
        )

    def to_host(self, array: np.ndarray, pointer: int, stream: Any) -> None:
        """Copies device memory into a C-contiguous host array, ordered on ``stream``."""
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.check(
            self.cudart.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, kind, stream), "cudaMemcpyAsync"
        )

    def record(self, event: Any, stream: Any) -> None:
        """Records ``event`` on ``stream``."""
        self.check(self.cudart.cudaEventRecord(event, stream), "cudaEventRecord")

    def synchronize(self, stream: Any) -> None:
        """Waits for everything queued on ``stream``."""
        self.check(self.cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events, after waiting for the second."""
        self.check(self.cudart.cudaEventSynchronize(end), "cudaEventSynchronize")
        return float(self.check(self.cudart.cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))


@dataclass
class _Tensor:
    """One engine I/O tensor and its device buffer."""

    name: str
    dtype: np.dtype
    pointer: int = 0
    nbytes: int = 0


@dataclass
class TensorRTEngine:
    """A built engine with its execution context, device buffers, stream and timing events.

    Attributes:
        engine: The ``ICudaEngine``.
        context: Its ``IExecutionContext``.
        plan: The serialized engine (``engine.plan``).
        layer_info: The inspector's JSON for the engine.
        report: Requested versus observed precision of every compute node.
        knobs: The knobs it was built with.
        input_names: Engine inputs.
        output_names: Outputs in the ONNX graph's order.
    """

    engine: Any
    context: Any
    plan: bytes
    layer_info: str
    report: PrecisionReport
    knobs: dict[str, KnobValue]
    cuda: CudaRuntime
    input_names: list[str]
    output_names: list[str]
    tensors: dict[str, _Tensor] = field(default_factory=dict)
    stream: Any = None
    start: Any = None
    end: Any = None

    def _buffer(self, tensor: _Tensor, nbytes: int) -> None:
        if nbytes > tensor.nbytes:  # grow only: shapes are fixed by the config, so this happens once
            if tensor.pointer:
                self.cuda.free(tensor.pointer)
            tensor.pointer, tensor.nbytes = self.cuda.malloc(nbytes), nbytes
            if not self.context.set_tensor_address(tensor.name, tensor.pointer):
                raise RuntimeError(f"TensorRT rejected the device address of {tensor.name!r}")

    def enqueue_inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Sets input shapes and queues the host-to-device copies; returns the host arrays (keep them alive)."""
        hosts = []
        for name in self.input_names:
            if name not in feeds:
                raise KeyError(f"feeds lack engine input {name!r}; they have {sorted(feeds)}")
            tensor = self.tensors[name]
            host = np.ascontiguousarray(feeds[name], dtype=tensor.dtype)
            if not self.context.set_input_shape(name, tuple(host.shape)):
                raise ValueError(f"input {name!r}: shape {host.shape} does not fit the engine's profile")
            self._buffer(tensor, host.nbytes)
            self.cuda.to_device(tensor.pointer, host, self.stream)
            hosts.append(host)
        for name in self.output_names:
            tensor = self.tensors[name]
            shape = tuple(self.context.get_tensor_shape(name))
            self._buffer(tensor, int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize)
        return hosts

    def execute(self) -> None:
        """Queues one inference on the stream."""
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")

    def fetch_outputs(self) -> list[np.ndarray]:
        """Copies the outputs back and waits for the stream."""
        outputs = []
        for name in self.output_names:
            tensor = self.tensors[name]
            host = np.empty(tuple(self.context.get_tensor_shape(name)), dtype=tensor.dtype)
            self.cuda.to_host(host, tensor.pointer, self.stream)
            outputs.append(host)
        self.cuda.synchronize(self.stream)
        return outputs

    def close(self) -> None:
        """Frees device buffers, events and the stream; the engine goes with the last reference."""
        for tensor in self.tensors.values():
            if tensor.pointer:
                self.cuda.free(tensor.pointer)
                tensor.pointer, tensor.nbytes = 0, 0
        for event in (self.start, self.end):
            if event is not None:
                self.cuda.destroy_event(event)
        if self.stream is not None:
            self.cuda.destroy_stream(self.stream)
        self.start = self.end = self.stream = None
        self.context = None  # the context must go before the engine it came from

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down cuda-python already
            pass


# ---- the backend --------------------------------------------------------------------------------------------


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


class TensorRTBackend(Backend):
    """TensorRT engines on one NVIDIA GPU.

    Args:
        options: ``backend.options`` (see ``TensorRTOptions``).

    Raises:
        BackendUnavailable: TensorRT or cuda-python is not installed, or there is no CUDA GPU.
        ValueError: ``options`` has an unknown key or a bad value.
    """

    name = "tensorrt"
    recipe = TENSORRT

    def __init__(self, options: Mapping[str, Any] | None = None):
        self.options = TensorRTOptions.from_mapping(options)
        self.trt = import_tensorrt()
        self.cuda = CudaRuntime(import_cudart(), self.options.device)
        self.version = str(self.trt.__version__)
        self.logger = _collecting_logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self._timing_cache_path: Path | None = Path(self.options.timing_cache) if self.options.timing_cache else None
        self._timing_cache_bytes = b""

    # ----- capabilities ---------------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Precisions from the device's compute capability; knobs from what this TensorRT has."""
        return Capabilities(
            precisions=supported_precisions(self.trt, self.cuda.compute_capability()),
            knobs=builder_knobs(self.trt, self.options),
        )

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
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # a reader sees the old cache or the new one, never half a file

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

    def build(self, model: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path | None = None) -> Any:
        """Parses the typed model, builds a strongly typed engine and checks every layer's precision.

        Raises:
            BuildError: The Q/DQ graph breaks TensorRT's rules, the parser or builder failed, or (strict) a
                layer runs in another precision than the graph asks for.
        """
        trt = self.trt
        try:
            check_qdq(model)
        except QDQError as error:
            raise BuildError(str(error)) from error
        self.logger.errors.clear()
        builder = trt.Builder(self.logger)
        network, _parser = self._network(builder, model)  # the parser owns weights the network still uses
        builder_config = builder.create_builder_config()
        try:
            configure_builder(trt, builder_config, knobs, self.options)
        except ValueError as error:
            raise BuildError(str(error)) from error
        self._add_profile(builder, network, builder_config, model)
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
        report = self._verify(layer_info, requested_precisions(model))
        return self._artifact(engine, plan, layer_info, report, knobs, model)

    def _artifact(
        self,
        engine: Any,
        plan: bytes,
        layer_info: str,
        report: PrecisionReport,
        knobs: Mapping[str, KnobValue],
        model: onnx.ModelProto,
    ) -> TensorRTEngine:
        trt = self.trt
        context = engine.create_execution_context()
        if context is None:
            raise BuildError("TensorRT could not create an execution context (out of device memory?)")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [o.name for o in model.graph.output if o.name in names]
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

    def run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Copies the inputs in, runs once on the engine's stream, copies the outputs back (graph order)."""
        hosts = artifact.enqueue_inputs(feeds)
        artifact.execute()
        outputs = artifact.fetch_outputs()
        del hosts  # the inputs stay alive until the stream has synchronized
        return outputs

    def time_run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> float:
        """GPU milliseconds of one inference: CUDA events around the enqueue, copies outside them."""
        hosts = artifact.enqueue_inputs(feeds)
        self.cuda.record(artifact.start, artifact.stream)
        artifact.execute()
        self.cuda.record(artifact.end, artifact.stream)
        elapsed = self.cuda.elapsed_ms(artifact.start, artifact.end)  # waits for the end event
        del hosts
        return elapsed

    # ----- export ---------------------------------------------------------------------------------------------

    def trtexec_argv(self, artifact: TensorRTEngine, model: onnx.ModelProto, timing_cache: str | None) -> list[str]:
        """The trtexec command (relative paths, run from the export folder) that rebuilds this engine."""
        shapes = {n: s for n, s in onnx_input_shapes(model).items() if any(d is None for d in s)}
        return trtexec_command(
            artifact.knobs,
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

    def export(self, artifact: Any, model: onnx.ModelProto, out_dir: Path) -> list[Path]:
        """Writes ``engine.plan``, the typed ``model.onnx``, ``trtexec.sh``, the layer info and the timing cache."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        engine_path = out_dir / "engine.plan"
        tmp = out_dir / ".engine.plan.tmp"
        tmp.write_bytes(artifact.plan)
        tmp.replace(engine_path)
        files = [engine_path, *super().export(artifact, model, out_dir)]
        layers = out_dir / "layers.json"
        layers.write_text(artifact.layer_info)
        precision = out_dir / "precision.json"
        precision.write_text(json.dumps(artifact.report.to_dict(), indent=2))
        files += [layers, precision]
        cache = None
        if self._timing_cache_path is not None and self._timing_cache_path.is_file():
            shutil.copyfile(self._timing_cache_path, out_dir / "timing.cache")
            files.append(out_dir / "timing.cache")
            cache = "timing.cache"
        script = out_dir / "trtexec.sh"
        comment = f"TensorRT {self.version}; knobs: {artifact.knobs}"
        script.write_text(shell_script(self.trtexec_argv(artifact, model, cache), comment))
        script.chmod(0o755)
        files.append(script)
        return files
