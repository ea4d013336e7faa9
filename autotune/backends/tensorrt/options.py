"""``backend.options`` and plan knobs mapped onto TensorRT: precisions, knobs, builder config, network, profile.

Pure mappings: every function takes the ``tensorrt`` module as an argument (``trt``), so the tests drive them
with a fake module of each version. Names that exist only in some TensorRT versions are looked up by string
(``trt.TacticSource.__members__``, ``hasattr``), and enum members always by name: 11.0 renumbered several enums.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from autotune.backends.base import BuildError
from autotune.backends.tensorrt.command import (
    AUTO,
    AUX_STREAMS_KNOB,
    MAX_TACTICS_KNOB,
    OPT_LEVEL_KNOB,
    TACTIC_KNOB,
    TILING_KNOB,
    WORKSPACE_KNOB,
    major_version,
    member_value,
    tactic_mask,
    tactic_names,
    tactic_source_values,
)
from autotune.backends.tensorrt.rules import SUPPORTED_DQ_CONSUMERS
from autotune.capabilities import Knob
from autotune.config.schema import TensorRTOptions
from autotune.model.layers import Layer
from autotune.model.optypes import WEIGHTED_OP_TYPES, WEIGHTLESS_OP_TYPES
from autotune.plan import KnobValue, Plan
from autotune.quant.basetype import BASE_PRECISION_KNOB, BASE_PRECISIONS

REFERENCES = {"trt-fp16": "fp16", "trt-bf16": "bf16"}
"""The one-liner references: the whole model in FP16 or BF16, as ModelOpt AutoCast (or 10.x's ``trtexec --fp16``)
gives it; each is ``base_precision`` of that type with no override."""


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
    precisions = {op: (*common, "int8") for op in WEIGHTED_OP_TYPES}
    # A weightless layer (a residual Add, pooling) is INT8 or FP32: its Q/DQ lets TensorRT fuse it into the
    # integer kernel before it. Only where a DequantizeLinear may feed it (rules.py); the rest stay FP32.
    precisions.update({op: ("fp32", "int8") for op in WEIGHTLESS_OP_TYPES if op in SUPPORTED_DQ_CONSUMERS})
    if compute_capability >= (8, 9) and "FP8" in types:
        for op in ("Conv", "Gemm", "MatMul"):
            precisions[op] = (*precisions[op], "fp8")
    return precisions


def base_knobs(precisions: Mapping[str, Sequence[str]]) -> tuple[Knob, ...]:
    """The ``base_precision`` knob: fp32 first (the default), then the half types some op type may take.

    It ``follows_precision``: the uniform FP16 plan is the whole graph in FP16, not only its tunable layers.
    """
    offered = {precision for options in precisions.values() for precision in options}
    floats = tuple(p for p in BASE_PRECISIONS if p == "fp32" or p in offered)
    if len(floats) < 2:
        return ()
    description = "type the whole typed graph computes in (Casts at its I/O); each layer's precision overrides it"
    return (Knob(BASE_PRECISION_KNOB, floats, description, follows_precision=True),)


def reference_plan(layers: Sequence[Layer], name: str, precisions: Mapping[str, Sequence[str]]) -> Plan:
    """The plan of the one-liner ``name`` (``REFERENCES``): its base for the whole graph and no override.

    Every layer whose op type takes the base is in it (a layer in the base precision is no override); the rest
    (weightless layers, whose ``fp32`` is the base) keep ``fp32``. No build knob is set: TensorRT's defaults.

    Raises:
        ValueError: ``name`` is no reference, or the device has not its precision.
    """
    if name not in REFERENCES:
        raise ValueError(f"TensorRT has no reference {name!r}; its references: {sorted(REFERENCES)}")
    base = REFERENCES[name]
    knob = next(iter(base_knobs(precisions)), None)
    if knob is None or base not in knob.values:
        raise ValueError(f"{name}: this device has no {base}")
    chosen = {layer.name: base if base in precisions.get(layer.op_type, ()) else "fp32" for layer in layers}
    return Plan.make(chosen, {BASE_PRECISION_KNOB: base})


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
