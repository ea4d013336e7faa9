"""The CPU plugin's properties of a build, the BF16 probe, and the ``openvino`` import (with its extra's hint)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.backends.int8_kernels import cpu_flags, reduced_range
from autotune.extras import require
from autotune.plan import KnobValue
from autotune.quant.recipe import QuantRecipe

EXTRA = "openvino"
WHAT = "backend.name: openvino"

INFERENCE_PRECISION_KNOB = "inference_precision"
"""The whole model's inference precision (``INFERENCE_PRECISION_HINT``): ``fp32`` or, where the CPU has it,
``bf16``. It follows the precision: the uniform BF16 plan is the whole model in bf16, as OpenVINO runs it by
default, not only its tunable layers."""

BF16_ISA_FLAGS = ("avx512_bf16", "amx_bf16")
"""The CPU features that give OpenVINO's CPU plugin bf16 kernels (``/proc/cpuinfo`` names)."""

OPENVINO_RECIPE = QuantRecipe(activation_dtype="uint8", quantize_gemm_bias=False, min_matmul_zero_point=1)
"""uint8 activations and int8 per-channel weights, the x86 scheme of OpenVINO's own quantizer (NNCF); biases stay
float, which OpenVINO adds after the integer product anyway. No MatMul or Gemm reads a zero point of 0
(docs/openvino.md#int8-on-an-avx2-cpu-the-probe: a chain of MatMuls computed garbage so on an AMX Xeon); convolutions
keep it: no error was seen there."""

OPENVINO_SCHEMES = (OPENVINO_RECIPE, reduced_range(OPENVINO_RECIPE))
"""The INT8 schemes the lowering may use, best first: 8-bit int8 weights where the CPU plugin's kernels compute them
exactly (VNNI, AMX), else 7-bit ones (``u8s7``), whose u8 x s7 pairs fit the int16 sums of the AVX2 kernels. Not
uint8 weights (``u8u8``, ONNX Runtime's first fallback): OpenVINO computes them exactly but dequantizes such
weights to float, which runs slower than its FP32 model."""

HINTS = {"fp32": "f32", "bf16": "bf16"}

FREE_KNOBS: tuple[tuple[str, str, tuple[KnobValue, ...], str], ...] = (
    ("cpu_pinning", "ENABLE_CPU_PINNING", (True, False), "pin the inference threads to cores"),
    (
        "cpu_denormals_optimization",
        "CPU_DENORMALS_OPTIMIZATION",
        (False, True),
        "flush denormal floats to zero (numbers change below 1e-38 only)",
    ),
    ("scheduling_core_type", "SCHEDULING_CORE_TYPE", ("ANY_CORE", "PCORE_ONLY"), "which cores of a hybrid CPU run"),
)
"""OpenVINO's CPU options that change speed and not the numbers: (knob, property, values, description). They are
free knobs, measured once on the fastest uniform seed and fixed for the rest of the run. ``NUM_STREAMS`` is not
among them: the latency protocol runs one request at a time, which one stream serves with every thread
(``PERFORMANCE_HINT`` LATENCY's choice); more streams split the threads and only help throughput."""


def bf16_features() -> tuple[str, ...]:
    """The BF16 features of the CPU this process runs on (of :data:`BF16_ISA_FLAGS`, ``cpu_flags``), sorted."""
    flags = cpu_flags()
    return tuple(sorted(flag for flag in BF16_ISA_FLAGS if flag in flags))


def openvino_module() -> Any:
    """The ``openvino`` package, or MissingExtra naming the extra that installs it."""
    return require("openvino", EXTRA, WHAT)


def compile_config(threads: int, knobs: Mapping[str, KnobValue], precision: str | None) -> dict[str, Any]:
    """The CPU plugin's properties for a build: LATENCY hint, the deployment's threads, the free knobs' values.

    Args:
        threads: ``INFERENCE_NUM_THREADS`` (``backend.intra_op_threads``).
        knobs: The plan's knobs; a free knob it leaves unset takes its first value.
        precision: ``fp32`` or ``bf16`` for ``INFERENCE_PRECISION_HINT``; None leaves OpenVINO's default (what a
            user who only switches runtime gets: bf16 on a CPU with BF16).
    """
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = HINTS[precision]
    for knob, prop, values, _ in FREE_KNOBS:
        config[prop] = knobs.get(knob, values[0])
    return config
