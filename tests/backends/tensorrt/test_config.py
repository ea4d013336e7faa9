"""Golden tests of the knob -> IBuilderConfig mapping and of the trtexec command, for TensorRT 10.x and 11.x.

A fake ``trt`` module (``enum.IntEnum`` members exposing ``__members__``) stands in for each version; the 11.x
member values are checked against the real 11.4 bindings in test_api.py, the 10.x ones come from
NvInfer.h v10.16.
"""

from __future__ import annotations

import enum
import shlex
from pathlib import Path

import onnx
import pytest

from autotune.backends import BuildError
from autotune.backends.base import Capabilities
from autotune.backends.tensorrt import (
    builder_knobs,
    configure_builder,
    network_flags,
    onnx_input_shapes,
    profile_shapes,
    supported_precisions,
)
from autotune.backends.tensorrt.command import shell_script, tactic_mask, tactic_source_values, trtexec_command
from autotune.backends.tensorrt.rules import SUPPORTED_DQ_CONSUMERS
from autotune.config.schema import BackendConfig, SearchSpaceConfig, TensorRTOptions, parse_config
from autotune.model.layers import InputSpec, prepare_model
from autotune.model.optypes import WEIGHTED_OP_TYPES, WEIGHTLESS_OP_TYPES
from autotune.search.space import build_space
from autotune.testing import tiny_mlp
from tests.backends.tensorrt.fakes import OPTIONS, fake_trt

ALL_KNOBS = {
    "tactic_sources": "JIT_CONVOLUTIONS",
    "workspace_mib": 1024,
    "builder_optimization_level": 5,
    "max_num_tactics": 16,
    "tiling_optimization_level": "MODERATE",
    "max_aux_streams": 0,
    "calibration": "max",  # recipe knobs reach build() too and must be ignored
    "weight_granularity": "per_channel",
}


@pytest.mark.parametrize(
    ("version", "jit_mask"),
    [("11.4.0.106", 1 << 1), ("10.16.0.5", 1 << 4)],
)
def test_builder_config_golden(version, jit_mask):
    trt = fake_trt(version)
    builder_config = trt.IBuilderConfig()
    configure_builder(trt, builder_config, ALL_KNOBS, OPTIONS)
    assert builder_config.calls == [
        ("set", "profiling_verbosity", "DETAILED"),
        ("set", "avg_timing_iterations", 4),
        ("set_memory_pool_limit", "WORKSPACE", 1024 * 2**20),
        ("set_tactic_sources", jit_mask),
        ("set", "builder_optimization_level", 5),
        ("set", "max_num_tactics", 16),
        ("set", "tiling_optimization_level", "MODERATE"),
        ("set", "max_aux_streams", 0),
    ]
    assert not any(call[0] == "set_flag" for call in builder_config.calls)  # precision lives in the graph


def test_builder_config_defaults_leave_tensorrt_alone():
    trt = fake_trt("11.4.0.106")
    builder_config = trt.IBuilderConfig()
    configure_builder(trt, builder_config, {"max_num_tactics": -1, "max_aux_streams": -1}, OPTIONS)
    assert builder_config.calls == [("set", "profiling_verbosity", "DETAILED"), ("set", "avg_timing_iterations", 4)]


def test_tactic_masks_come_from_each_versions_member_values():
    both = ("EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS")
    assert tactic_mask(fake_trt("11.4").TacticSource.__members__, both) == 0b11
    assert tactic_mask(fake_trt("10.16").TacticSource.__members__, both) == 0b11000
    assert tactic_mask(fake_trt("10.16").TacticSource.__members__, ("CUBLAS", "CUDNN")) == 0b101
    with pytest.raises(ValueError, match="CUBLAS"):
        tactic_mask(fake_trt("11.4").TacticSource.__members__, ("CUBLAS",))
    trt = fake_trt("11.4.0.106")
    with pytest.raises(ValueError, match="CUBLAS"):
        configure_builder(trt, trt.IBuilderConfig(), {"tactic_sources": "CUBLAS+JIT_CONVOLUTIONS"}, OPTIONS)


def test_tactic_knob_values_are_few_and_default_first():
    assert tactic_source_values(fake_trt("11.4").TacticSource.__members__) == (
        "EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS",
        "EDGE_MASK_CONVOLUTIONS",
        "JIT_CONVOLUTIONS",
    )
    assert tactic_source_values(fake_trt("10.16").TacticSource.__members__) == (
        "EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS",
        "EDGE_MASK_CONVOLUTIONS",
        "JIT_CONVOLUTIONS",
        "CUBLAS+CUBLAS_LT+CUDNN+EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS",
    )


def test_bad_knob_values_and_missing_members_raise():
    trt = fake_trt("11.4.0.106")
    for knobs in ({"builder_optimization_level": 7}, {"workspace_mib": 0}, {"tiling_optimization_level": "MAX"}):
        with pytest.raises(ValueError):
            configure_builder(trt, trt.IBuilderConfig(), knobs, OPTIONS)
    old = fake_trt("10.3.0.26", new_members=False)
    with pytest.raises(ValueError, match="max_num_tactics"):
        configure_builder(old, old.IBuilderConfig(), {"max_num_tactics": 8}, OPTIONS)


def test_network_flags_strongly_typed_by_version():
    assert network_flags(fake_trt("11.4.0.106")) == 0  # deprecated in 11: always strongly typed
    assert network_flags(fake_trt("10.16.0.5")) == 1 << 1  # STRONGLY_TYPED is member 1 in 10.x
    no_flag = fake_trt("10.16.0.5")
    no_flag.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0})
    with pytest.raises(BuildError, match="strongly typed"):
        network_flags(no_flag)


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        ((9, 0), ("fp32", "fp16", "bf16", "int8", "fp8")),
        ((8, 9), ("fp32", "fp16", "bf16", "int8", "fp8")),
        ((8, 6), ("fp32", "fp16", "bf16", "int8")),
        ((7, 5), ("fp32", "fp16", "int8")),
    ],
)
def test_precisions_follow_compute_capability(cc, expected):
    precisions = supported_precisions(fake_trt("11.4.0.106"), cc)
    assert precisions["MatMul"] == expected
    assert "fp8" not in precisions["ConvTranspose"]
    assert set(WEIGHTED_OP_TYPES) <= set(precisions)
    # weightless layers (a residual Add, pooling) are INT8 or FP32 only, and only where TensorRT takes a DQ input
    for op in set(precisions) - set(WEIGHTED_OP_TYPES):
        assert op in WEIGHTLESS_OP_TYPES and op in SUPPORTED_DQ_CONSUMERS and precisions[op] == ("fp32", "int8")
    assert not any("int4" in options for options in precisions.values())  # the rewriter cannot write INT4


def test_knobs_follow_what_the_version_has():
    knobs = {k.name: k.values for k in builder_knobs(fake_trt("11.4.0.106"), OPTIONS)}
    assert knobs == {
        "tactic_sources": tactic_source_values(fake_trt("11.4").TacticSource.__members__),
        "workspace_mib": (256, 1024, 4096),
        "builder_optimization_level": (3, 4, 5),
        "max_num_tactics": (-1, 16),
        "tiling_optimization_level": ("NONE", "MODERATE"),
        "max_aux_streams": (-1, 0),
    }
    old = {k.name for k in builder_knobs(fake_trt("10.3.0.26", new_members=False), OPTIONS)}
    assert old == {"tactic_sources", "workspace_mib", "builder_optimization_level"}


def _parse_options(options: dict) -> TensorRTOptions:
    """``backend.options`` of a whole config, as the CLI and the API validate it (errors name the key path)."""
    config = parse_config(
        {
            "name": "trt",
            "model": {"onnx": "model.onnx"},
            "data": {"calibration": {"random": 1}, "evaluation": {"random": 1}},
            "backend": {"name": "tensorrt", "options": options},
        }
    )
    return config.backend.options


def test_options_override_ladders_and_reject_unknown_keys():
    options = BackendConfig(
        name="tensorrt",
        options={"workspace_ladder_mib": [512, 2048], "builder_optimization_levels": [5], "strict_precision": False},
    ).options
    assert options.workspace_ladder_mib == (512, 2048) and options.builder_optimization_levels == (5,)
    assert options.strict_precision is False and options.avg_timing_iterations == 4
    for bad in (
        {"workspace": [1]},
        {"workspace_ladder_mib": []},
        {"workspace_ladder_mib": [0]},
        {"builder_optimization_levels": [6]},
        {"tiling_optimization_levels": ["HIGH"]},
        {"strict_precision": "no"},
    ):
        with pytest.raises(ValueError, match=rf"backend\.options\.{next(iter(bad))}"):
            _parse_options(bad)


def test_capabilities_make_a_search_space():
    trt = fake_trt("11.4.0.106")
    model = prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])
    capabilities = Capabilities(supported_precisions(trt, (8, 0)), builder_knobs(trt, OPTIONS))
    space = build_space(model.layers, capabilities, SearchSpaceConfig())
    plan = space.uniform("int8")
    assert space.violations(plan) == []
    assert plan.knob("tactic_sources") == "EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS"
    assert plan.knob("workspace_mib") == 256 and plan.knob("builder_optimization_level") == 3


GOLDEN_11 = (
    "trtexec --onnx=model.onnx --saveEngine=engine.plan --memPoolSize=workspace:1024M "
    "--tacticSources=-EDGE_MASK_CONVOLUTIONS,+JIT_CONVOLUTIONS --builderOptimizationLevel=5 --maxTactics=16 "
    "--tilingOptimizationLevel=2 --maxAuxStreams=0 --avgTiming=4 --timingCacheFile=timing.cache "
    "--profilingVerbosity=detailed --exportLayerInfo=layers.json"
)
GOLDEN_10 = (
    "trtexec --onnx=model.onnx --saveEngine=engine.plan --stronglyTyped --memPoolSize=workspace:1024M "
    "--tacticSources=-CUBLAS,-CUBLAS_LT,-CUDNN,-EDGE_MASK_CONVOLUTIONS,+JIT_CONVOLUTIONS "
    "--builderOptimizationLevel=5 --maxTactics=16 --tilingOptimizationLevel=2 --maxAuxStreams=0 --avgTiming=4 "
    "--timingCacheFile=timing.cache --profilingVerbosity=detailed --exportLayerInfo=layers.json"
)


@pytest.mark.parametrize(("version", "golden"), [("11.4.0.106", GOLDEN_11), ("10.16.0.5", GOLDEN_10)])
def test_trtexec_command_golden(version, golden):
    argv = trtexec_command(
        ALL_KNOBS,
        onnx_path="model.onnx",
        engine_path="engine.plan",
        version=version,
        timing_cache_path="timing.cache",
        layer_info_path="layers.json",
        avg_timing_iterations=4,
    )
    assert shlex.join(argv) == golden


def test_trtexec_command_minimal_dynamic_shapes_and_bad_sources():
    argv = trtexec_command(
        {"tactic_sources": "EDGE_MASK_CONVOLUTIONS+JIT_CONVOLUTIONS"},
        onnx_path="m.onnx",
        engine_path="e.plan",
        version="11.4.0.106",
        shapes={"x": (16, 32)},
    )
    assert argv == [
        "trtexec",
        "--onnx=m.onnx",
        "--saveEngine=e.plan",
        "--tacticSources=+EDGE_MASK_CONVOLUTIONS,+JIT_CONVOLUTIONS",
        "--minShapes=x:16x32",
        "--optShapes=x:16x32",
        "--maxShapes=x:16x32",
        "--profilingVerbosity=detailed",
    ]
    with pytest.raises(ValueError, match="CUDNN"):
        trtexec_command({"tactic_sources": "CUDNN"}, onnx_path="m", engine_path="e", version="11.4.0.106")
    script = shell_script(argv, "knobs: {}")
    assert script.startswith("#!/usr/bin/env bash") and 'cd "$(dirname "$0")"' in script and shlex.join(argv) in script


def test_profile_shapes_only_for_dynamic_inputs():
    model = tiny_mlp()  # input x is ["batch", 32]
    assert onnx_input_shapes(model) == {"x": (None, 32)}
    assert profile_shapes({"x": (16, 32)}, onnx_input_shapes(model)) == {}
    assert profile_shapes({"x": (-1, 32)}, {"x": (16, 32)}) == {"x": (16, 32)}
    with pytest.raises(BuildError, match="inputs:"):
        profile_shapes({"x": (-1, 32)}, onnx_input_shapes(model))
    fixed = prepare_model(tiny_mlp(), Path("t.onnx"), [InputSpec("x", (8, 32), "float32")]).proto
    assert isinstance(fixed, onnx.ModelProto) and onnx_input_shapes(fixed) == {"x": (8, 32)}
