"""TensorRT build knobs as values: tactic-source masks, knob value ladders, and the equivalent ``trtexec`` command.

Pure: nothing here imports TensorRT. Enum members are always handled by *name* and turned into numbers from
the installed version's own members, because 11.0 renumbered ``TacticSource`` (10.x: CUBLAS=0, CUBLAS_LT=1,
CUDNN=2, EDGE_MASK_CONVOLUTIONS=3, JIT_CONVOLUTIONS=4; 11.x: EDGE_MASK_CONVOLUTIONS=0, JIT_CONVOLUTIONS=1) and
a mask saved under one version is wrong under the other.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.config.schema import TILING_LEVELS
from autotune.plan import KnobValue

WORKSPACE_KNOB = "workspace_mib"
TACTIC_KNOB = "tactic_sources"
OPT_LEVEL_KNOB = "builder_optimization_level"
MAX_TACTICS_KNOB = "max_num_tactics"
TILING_KNOB = "tiling_optimization_level"
AUX_STREAMS_KNOB = "max_aux_streams"

DEFAULT_TACTIC_SOURCES = ("EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS")
"""Enabled by default in 10.x and 11.x; CUBLAS, CUBLAS_LT and CUDNN (10.x only) are off by default there."""

TACTIC_SOURCES_10 = ("CUBLAS", "CUBLAS_LT", "CUDNN", "EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS")
TACTIC_SOURCES_11 = ("EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS")

AUTO = -1
"""Knob value for ``max_num_tactics`` / ``max_aux_streams``: leave TensorRT's heuristic."""


def major_version(version: str) -> int:
    """The major version of a TensorRT version string such as ``"11.4.0.106"``."""
    try:
        return int(str(version).split(".")[0])
    except ValueError as error:
        raise ValueError(f"not a TensorRT version: {version!r}") from error


def member_value(member: Any) -> int:
    """The integer of an enum member (pybind11 enums and ``enum.IntEnum`` alike)."""
    return int(getattr(member, "value", member))


def tactic_names(value: KnobValue) -> tuple[str, ...]:
    """The source names of a ``tactic_sources`` knob value such as ``"EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS"``."""
    text = str(value).strip()
    if text in ("", "none"):
        return ()
    return tuple(part.strip() for part in text.split("+") if part.strip())


def tactic_mask(members: Mapping[str, Any], enabled: Sequence[str]) -> int:
    """The ``set_tactic_sources`` bitmask of the enabled sources, from the installed version's member values.

    Args:
        members: ``trt.TacticSource.__members__`` of the installed version.
        enabled: Source names to enable.

    Returns:
        ``sum(1 << value)`` over the enabled members.

    Raises:
        ValueError: A name is not a member of this version (e.g. ``CUBLAS`` on 11.x).
    """
    mask = 0
    for name in enabled:
        if name not in members:
            raise ValueError(f"tactic source {name!r} does not exist in this TensorRT; it has {sorted(members)}")
        mask |= 1 << member_value(members[name])
    return mask


def tactic_source_values(members: Mapping[str, Any]) -> tuple[str, ...]:
    """Knob values for the tactic sources of one version: a small set, the TensorRT default first.

    The default pair, each alone, and (10.x) everything on; never the full power set (32 masks on 10.x).
    """
    by_value = sorted(members, key=lambda name: member_value(members[name]))
    default = [name for name in by_value if name in DEFAULT_TACTIC_SOURCES]
    values = ["+".join(default)] if default else []
    values += [name for name in default if len(default) > 1]
    if len(by_value) > len(default):
        values.append("+".join(by_value))
    return tuple(dict.fromkeys(v for v in values if v))


def _flag_for_tactics(value: KnobValue, available: Sequence[str]) -> str:
    enabled = set(tactic_names(value))
    unknown = enabled - set(available)
    if unknown:
        raise ValueError(f"tactic sources {sorted(unknown)} are not in this TensorRT; it has {list(available)}")
    return "--tacticSources=" + ",".join(("+" if name in enabled else "-") + name for name in available)


def _shape(dims: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in dims)


@dataclass(frozen=True)
class TrtexecOptions:
    """What a ``trtexec`` command reads and writes beside the model and the engine, and how it times.

    Attributes:
        timing_cache_path: ``--timingCacheFile`` (loaded if present, saved after the build).
        layer_info_path: ``--exportLayerInfo`` JSON, with ``--profilingVerbosity=detailed``.
        tactic_sources: Every source name of that version, in member-value order (default by major version).
        avg_timing_iterations: ``--avgTiming`` (trtexec's own default is 8, the API's 1: always emitted).
        shapes: Input name to shape for inputs with dynamic dimensions (min = opt = max).
        trtexec: The executable.
    """

    timing_cache_path: str | None = None
    layer_info_path: str | None = None
    tactic_sources: Sequence[str] | None = None
    avg_timing_iterations: int | None = None
    shapes: Mapping[str, Sequence[int]] | None = None
    trtexec: str = "trtexec"


def trtexec_command(
    knobs: Mapping[str, KnobValue], *, onnx_path: str, engine_path: str, version: str, **options: Any
) -> list[str]:
    """The ``trtexec`` arguments that build the same engine as the backend does for ``knobs``.

    Args:
        knobs: The plan's knobs (unknown ones, such as ``calibration``, are ignored).
        onnx_path: The typed model.
        engine_path: Where trtexec saves the engine.
        version: The installed TensorRT version (``trt.__version__``); 10.x adds ``--stronglyTyped``.
        **options: The fields of :class:`TrtexecOptions`, by name.

    Returns:
        argv, first element the executable; ``shlex.join`` makes it a shell line.

    Raises:
        ValueError: A knob value does not exist in that version.
    """
    settings = TrtexecOptions(**options)
    major = major_version(version)
    available = tuple(settings.tactic_sources or (TACTIC_SOURCES_11 if major >= 11 else TACTIC_SOURCES_10))
    args = [settings.trtexec, f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    if major < 11:
        args.append("--stronglyTyped")  # 11.x: always strongly typed, the flag is a deprecated no-op
    args += _knob_flags(knobs, available)
    if settings.avg_timing_iterations is not None:
        args.append(f"--avgTiming={int(settings.avg_timing_iterations)}")
    if settings.shapes:
        spec = ",".join(f"{name}:{_shape(dims)}" for name, dims in settings.shapes.items())
        args += [f"--minShapes={spec}", f"--optShapes={spec}", f"--maxShapes={spec}"]
    if settings.timing_cache_path is not None:
        args.append(f"--timingCacheFile={settings.timing_cache_path}")
    args.append("--profilingVerbosity=detailed")
    if settings.layer_info_path is not None:
        args.append(f"--exportLayerInfo={settings.layer_info_path}")
    return args


def _knob_flags(knobs: Mapping[str, KnobValue], available: Sequence[str]) -> list[str]:
    """The trtexec flags of the builder knobs present in ``knobs``, in trtexec's documented order.

    Raises:
        ValueError: A tactic source or tiling level does not exist in this version.
    """
    flags = []
    if WORKSPACE_KNOB in knobs:
        # Explicit unit: without a suffix trtexec reads MiB, but a bare number is easy to misread as bytes.
        flags.append(f"--memPoolSize=workspace:{int(knobs[WORKSPACE_KNOB])}M")
    if TACTIC_KNOB in knobs:
        flags.append(_flag_for_tactics(knobs[TACTIC_KNOB], available))
    if OPT_LEVEL_KNOB in knobs:
        flags.append(f"--builderOptimizationLevel={int(knobs[OPT_LEVEL_KNOB])}")
    if MAX_TACTICS_KNOB in knobs and int(knobs[MAX_TACTICS_KNOB]) != AUTO:
        flags.append(f"--maxTactics={int(knobs[MAX_TACTICS_KNOB])}")
    if TILING_KNOB in knobs:
        level = str(knobs[TILING_KNOB])
        if level not in TILING_LEVELS:
            raise ValueError(f"tiling_optimization_level {level!r} is not one of {TILING_LEVELS}")
        # TILING_LEVELS lists the members in value order, which is trtexec's 0..3.
        flags.append(f"--tilingOptimizationLevel={TILING_LEVELS.index(level)}")
    if AUX_STREAMS_KNOB in knobs and int(knobs[AUX_STREAMS_KNOB]) != AUTO:
        flags.append(f"--maxAuxStreams={int(knobs[AUX_STREAMS_KNOB])}")
    return flags


def shell_script(argv: Sequence[str], comment: str = "") -> str:
    """A bash script that runs ``argv`` from the script's own folder (relative paths then resolve there)."""
    lines = ["#!/usr/bin/env bash", "# Rebuilds the engine with trtexec, with the knobs the tuner chose."]
    lines += [f"# {line}" for line in comment.splitlines() if line]
    lines += ["set -euo pipefail", 'cd "$(dirname "$0")"', shlex.join(argv), ""]
    return "\n".join(lines)
