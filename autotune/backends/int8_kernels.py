"""Which INT8 schemes the runtime's own kernels compute exactly on this CPU, and the ISA features that decide it.

x86 CPUs without VNNI (AVX2, AVX-512F/BW) multiply uint8 activations by int8 weights with ``VPMADDUBSW``, which
adds each pair of u8 x s8 products in int16 and saturates: with activations of 255 and weights of 127 a pair is
64,770, clipped to 32,767, and a MatMul of K=64 returns about half the exact product. VNNI (``VPDPBUSD``) and AMX
accumulate in int32 and are exact. ONNX Runtime's quantization guide names the remedies: U8U8 (uint8 weights,
whose kernels widen to int16 before they multiply) and 7-bit weights (``reduce_range``), whose pairs
(2 x 255 x 64 = 32,640) fit int16.

The CPU flags say which kernels a runtime *may* pick, not which it picks (an emulator, a runtime built without a
kernel), so the verdict comes from a probe: one-node models as our lowering writes them (Q/DQ around MatMul,
Gemm, Conv, depthwise Conv) run with worst-case operands and compared with exact integer arithmetic.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from autotune.model.layers import build_layer_table
from autotune.plan import Plan
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import required_ranges, rewrite

log = logging.getLogger(__name__)

INT8_ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")
"""The CPU features that decide which INT8 kernels can run: x86 AVX2, AVX-512, VNNI (512 and 256-bit), AMX;
Arm's dot-product and int8 matrix-multiply extensions."""

_NUMPY_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX512F",
    "avx512bw": "AVX512BW",
    "avx512_vnni": "AVX512VNNI",
    "avx512_bf16": "AVX512BF16",
    "asimddp": "ASIMDDP",
}
"""Flags numpy's own CPUID probe reports (what this process sees, also under an emulator that hides features
which /proc/cpuinfo, the host's, still lists)."""

PATTERNS = ("MatMul", "Gemm", "Conv", "DepthwiseConv")
"""The layer patterns the probe builds, each as our lowering writes it."""

_RELATIVE_TOLERANCE = 1e-3
"""A saturating kernel is off by about half with worst-case operands; rounding of float scales by ~1e-7."""


def _numpy_cpu_features() -> dict[str, bool]:
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy < 2
        try:
            from numpy.core._multiarray_umath import __cpu_features__
        except ImportError:
            return {}
    return dict(__cpu_features__)


def cpu_flags() -> set[str]:
    """The feature flags of the CPU this process runs on (empty where ``/proc/cpuinfo`` lists none).

    numpy's CPUID probe decides the flags it knows (it sees what this process runs on, emulated or not); the
    others come from ``/proc/cpuinfo``, unless CPUID hides a flag that file lists: the process then runs on another
    CPU than the host's (``qemu-x86_64 -cpu Haswell`` on an AMX Xeon), and the file's other flags are the host's too.
    """
    listed = _cpuinfo_flags()
    numpy_seen = _numpy_cpu_features()
    known = {flag: bool(numpy_seen[key]) for flag, key in _NUMPY_FEATURES.items() if key in numpy_seen}
    hidden = any(flag in listed and not seen for flag, seen in known.items())
    unknown = set() if hidden else listed - set(known)
    return unknown | {flag for flag, seen in known.items() if seen}


def _cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_features() -> tuple[str, ...]:
    """The INT8-relevant ISA features of the CPU this process runs on (of :data:`INT8_ISA_FLAGS`, ``cpu_flags``)."""
    flags = cpu_flags()
    return tuple(sorted(flag for flag in INT8_ISA_FLAGS if flag in flags))


def isa_class(features: Sequence[str]) -> str:
    """A short name for the INT8 kernel class the features give.

    ``amx``, ``avx512-vnni``, ``avx-vnni``, ``avx512``, ``avx2``, ``arm-dotprod``, or the machine's architecture.
    """
    features = set(features)
    for flag, name in (
        ("amx_int8", "amx"),
        ("avx512_vnni", "avx512-vnni"),
        ("avx_vnni", "avx-vnni"),
        ("avx512bw", "avx512"),
        ("avx2", "avx2"),
        ("asimddp", "arm-dotprod"),
    ):
        if flag in features:
            return name
    return platform.machine() or "unknown"


@dataclass(frozen=True)
class PatternResult:
    """One pattern of the probe under one scheme.

    Attributes:
        pattern: One of :data:`PATTERNS`.
        exact: The runtime's output matched exact integer arithmetic.
        worst_relative_error: Largest ``|runtime - exact| / |exact|`` over the output.
    """

    pattern: str
    exact: bool
    worst_relative_error: float


@dataclass(frozen=True)
class SchemeVerdict:
    """Whether one INT8 scheme (a recipe's weight range) computes exactly in every pattern."""

    scheme: str
    results: tuple[PatternResult, ...]

    @property
    def exact(self) -> bool:
        """Every pattern matched exact arithmetic."""
        return all(result.exact for result in self.results)

    def describe(self) -> str:
        """``u8s8: saturating (MatMul 49.4%, Gemm 49.4%)`` or ``u8s7: exact``."""
        if self.exact:
            return f"{self.scheme}: exact"
        wrong = ", ".join(f"{r.pattern} {r.worst_relative_error:.1%}" for r in self.results if not r.exact)
        return f"{self.scheme}: saturating ({wrong})"


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _signed_channels(shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Weights of +1 on even output channels and -1 on odd ones: both int16 saturation limits get reached."""
    signs = np.where(np.arange(shape[axis]) % 2 == 0, 1.0, -1.0).astype(np.float32)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.broadcast_to(signs.reshape(view), shape).copy()


def _pattern_model(pattern: str) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """A float one-node model, its worst-case input and the exact output of the quantized model.

    The input is 255 everywhere, calibrated to ``[0, 255]``: uint8 scale 1, zero point 0, so every quantized
    activation is 255. Every weight is +-1, so per-channel quantization makes it the scheme's largest integer
    and the weight scale its inverse: the quantized model computes exactly what the float one does.
    """
    x_value = 255.0
    if pattern == "MatMul":
        k, n = 64, 16
        w = _signed_channels((k, n), 1)
        node = helper.make_node("MatMul", ["X", "W"], ["Y"], "probe")
        x_shape, y_shape, inits = [4, k], [4, n], [_init("W", w)]
        exact = np.full(x_shape, x_value, np.float64) @ w
    elif pattern == "Gemm":
        k, n = 64, 16
        w = _signed_channels((n, k), 0)
        node = helper.make_node("Gemm", ["X", "W", "B"], ["Y"], "probe", transB=1)
        x_shape, y_shape = [4, k], [4, n]
        inits = [_init("W", w), _init("B", np.zeros(n))]
        exact = np.full(x_shape, x_value, np.float64) @ w.T
    elif pattern in ("Conv", "DepthwiseConv"):
        channels, size = 16, 5
        group = channels if pattern == "DepthwiseConv" else 1
        w = _signed_channels((channels, channels // group, 3, 3), 0)
        node = helper.make_node("Conv", ["X", "W", "B"], ["Y"], "probe", kernel_shape=[3, 3], group=group)
        x_shape, y_shape = [1, channels, size, size], [1, channels, size - 2, size - 2]
        inits = [_init("W", w), _init("B", np.zeros(channels))]
        per_output = w.reshape(channels, -1).sum(axis=1) * x_value  # no padding: every output sums a full window
        exact = np.broadcast_to(per_output.reshape(1, channels, 1, 1), y_shape).astype(np.float64)
    else:
        raise ValueError(f"unknown probe pattern {pattern!r}; patterns: {PATTERNS}")
    graph = helper.make_graph(
        [node],
        f"int8_probe_{pattern}",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return shape_inference.infer_shapes(model), np.full(x_shape, x_value, np.float32), exact


def _lowered(
    pattern: str, recipe: QuantRecipe, precision: str = "int8"
) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """The pattern's model all in ``precision`` through our lowering, with its input and exact output."""
    model, x, exact = _pattern_model(pattern)
    layers = build_layer_table(model)
    peak = float(np.abs(exact).max())
    ranges: dict[str, tuple[float, float]] = {}
    for tensor in required_ranges(layers, recipe, model):
        # The output range holds the exact result (the output grid's step is then peak / 255 at most).
        ranges[tensor] = (0.0, 255.0) if tensor == "X" else (-peak, peak)
    plan = Plan.make({layer.name: precision for layer in layers})
    return rewrite(model, layers, plan, ranges, recipe), x, exact


def probe_pattern(pattern: str, recipe: QuantRecipe, session: Callable[[onnx.ModelProto], Any]) -> PatternResult:
    """Runs one pattern lowered with ``recipe`` on a session of the runtime and compares with exact arithmetic.

    Args:
        pattern: One of :data:`PATTERNS`.
        recipe: The scheme to probe (its ``weight_max`` sets the weight integers).
        session: Makes an inference session of a model, with the options a build uses (``run(None, feeds)``).
    """
    return _compare(pattern, recipe, session, *_lowered(pattern, recipe))


def probe_dynamic_pattern(pattern: str, weight_max: int, session: Callable[[onnx.ModelProto], Any]) -> PatternResult:
    """Runs one pattern in the ``int8-dynamic`` form with ``weight_max`` and compares with exact arithmetic.

    The input of 255 everywhere quantizes at run time to 255 with scale 1, as the static range does, and every
    weight is the largest integer: the same worst case as :func:`probe_pattern`'s.

    Args:
        pattern: One of :data:`DYNAMIC_PATTERNS`.
        weight_max: The int8 weights' range, 127 or 64.
        session: Makes an inference session of a model, with the options a build uses.
    """
    recipe = dataclasses.replace(QuantRecipe(), dynamic_weight_max=weight_max)
    return _compare(pattern, recipe, session, *_lowered(pattern, recipe, "int8-dynamic"))


def _compare(
    pattern: str,
    recipe: QuantRecipe,
    session: Callable[[onnx.ModelProto], Any],
    lowered: onnx.ModelProto,
    x: np.ndarray,
    exact: np.ndarray,
) -> PatternResult:
    """Runs a lowered pattern on a session and compares its output with the exact one."""
    try:
        got = np.asarray(session(lowered).run(None, {"X": x})[0], dtype=np.float64)
    except Exception as error:  # noqa: BLE001 - a runtime without a kernel for the scheme raises its own types
        log.info("INT8 probe: %s under %s does not run: %s", pattern, scheme_name(recipe), error)
        return PatternResult(pattern, False, float("inf"))
    # An output Q/DQ (Conv) rounds to its grid: one step of peak / 127.5 on a symmetric range around 0.
    output_quantized = any(node.op_type == "DequantizeLinear" and "Y" in node.output for node in lowered.graph.node)
    step = float(np.abs(exact).max()) / 127.5 if output_quantized else 0.0
    error = np.abs(got - exact)
    relative = float((error / np.maximum(np.abs(exact), 1.0)).max())
    exact_enough = bool(np.all(error <= step / 2 + _RELATIVE_TOLERANCE * np.abs(exact)))
    return PatternResult(pattern, exact_enough, relative)


DYNAMIC_PATTERNS = ("MatMul", "Gemm")
"""The patterns of the ``int8-dynamic`` probe: the op types that take it (``autotune.quant.dynamic``)."""


def dynamic_name(weight_max: int) -> str:
    """``dynamic-u8s8`` or ``dynamic-u8s7``: uint8 activations quantized per run, 8 or 7-bit int8 weights."""
    return f"dynamic-u8s{8 if weight_max > 64 else 7}"


def probe_dynamic(weight_max: int, session: Callable[[onnx.ModelProto], Any]) -> SchemeVerdict:
    """The verdict for the ``int8-dynamic`` form with ``weight_max`` over :data:`DYNAMIC_PATTERNS`."""
    results = tuple(probe_dynamic_pattern(p, weight_max, session) for p in DYNAMIC_PATTERNS)
    return SchemeVerdict(dynamic_name(weight_max), results)


def dynamic_verdicts(session: Callable[[onnx.ModelProto], Any], cache_key: Any = None) -> dict[str, SchemeVerdict]:
    """The verdicts of the dynamic form with 8-bit and 7-bit weights, probed once per process and ``cache_key``."""
    verdicts = {}
    for weight_max in (127, 64):
        key = (cache_key, "dynamic", weight_max)
        if key not in _VERDICTS:
            _VERDICTS[key] = probe_dynamic(weight_max, session)
        verdicts[dynamic_name(weight_max)] = _VERDICTS[key]
    return verdicts


def dynamic_weight_max(verdicts: Mapping[str, SchemeVerdict]) -> int | None:
    """127 where the dynamic form with 8-bit weights is exact, else 64 where 7-bit is, else None (not offered)."""
    for weight_max in (127, 64):
        verdict = verdicts.get(dynamic_name(weight_max))
        if verdict is not None and verdict.exact:
            return weight_max
    return None


def scheme_name(recipe: QuantRecipe) -> str:
    """``u8s8`` (uint8 activations, int8 weights), ``u8u8`` (uint8 weights), ``u8s7`` (7-bit int8 weights), ..."""
    activations = "u8" if recipe.activation_dtype == "uint8" else "s8"
    weights = "u" if recipe.weight_dtype == "uint8" else "s"
    return f"{activations}{weights}{8 if recipe.weight_max > 64 else 7}"


def probe_scheme(recipe: QuantRecipe, session: Callable[[onnx.ModelProto], Any]) -> SchemeVerdict:
    """The verdict for one scheme over every pattern of :data:`PATTERNS`."""
    return SchemeVerdict(scheme_name(recipe), tuple(probe_pattern(p, recipe, session) for p in PATTERNS))


_VERDICTS: dict[tuple, SchemeVerdict] = {}


def scheme_verdicts(
    candidates: Sequence[QuantRecipe], session: Callable[[onnx.ModelProto], Any], cache_key: Any = None
) -> dict[str, SchemeVerdict]:
    """The verdict of each candidate scheme, probed once per process and ``cache_key`` (the runtime's identity)."""
    verdicts = {}
    for recipe in candidates:
        key = (cache_key, repr(recipe))
        if key not in _VERDICTS:
            _VERDICTS[key] = probe_scheme(recipe, session)
        verdicts[scheme_name(recipe)] = _VERDICTS[key]
    return verdicts


def choose_recipe(candidates: Sequence[QuantRecipe], verdicts: Mapping[str, SchemeVerdict]) -> QuantRecipe:
    """The first candidate (fastest or most accurate first) whose scheme the probe found exact.

    Raises:
        RuntimeError: No candidate is exact: the runtime would compute a wrong result with each.
    """
    for recipe in candidates:
        if verdicts[scheme_name(recipe)].exact:
            return recipe
    found = "; ".join(verdict.describe() for verdict in verdicts.values())
    raise RuntimeError(f"no INT8 scheme computes exactly on this CPU ({found})")


def exact_candidates(recipe: QuantRecipe) -> tuple[QuantRecipe, ...]:
    """``recipe`` and the schemes to fall back to where it saturates, most accurate first.

    uint8 activations: uint8 weights (U8U8 kernels, the same 8-bit weight grid, so the same numbers as an exact
    ``recipe``), then 7-bit weights (the same U8S8 kernels, half the weight resolution). int8 activations: 7-bit
    weights.
    """
    if recipe.activation_dtype == "uint8" and recipe.weight_dtype == "int8":
        return recipe, dataclasses.replace(recipe, weight_dtype="uint8"), reduced_range(recipe)
    return recipe, reduced_range(recipe)


def reduced_range(recipe: QuantRecipe) -> QuantRecipe:
    """``recipe`` with 7-bit weights (``[-64, 64]``, ORT's ``reduce_range``): u8 x s8 pairs fit int16."""
    return dataclasses.replace(recipe, weight_max=64)
