"""Fake ``tensorrt`` modules for the TensorRT tests: the enums of 10.x and 11.x and a recording IBuilderConfig.

A fake ``trt`` module (``enum.IntEnum`` members exposing ``__members__``) stands in for each version; the 11.x
member values are checked against the real 11.4 bindings in test_api.py, the 10.x ones come from NvInfer.h v10.16.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

from autotune.config.schema import TensorRTOptions

ENUMS_11 = {
    "TacticSource": {"EDGE_MASK_CONVOLUTIONS": 0, "JIT_CONVOLUTIONS": 1},
    "MemoryPoolType": {
        "WORKSPACE": 0,
        "DLA_MANAGED_SRAM": 1,
        "DLA_LOCAL_DRAM": 2,
        "DLA_GLOBAL_DRAM": 3,
        "TACTIC_DRAM": 4,
        "TACTIC_SHARED_MEMORY": 5,
    },
    "ProfilingVerbosity": {"LAYER_NAMES_ONLY": 0, "NONE": 1, "DETAILED": 2},
    "TilingOptimizationLevel": {"NONE": 0, "FAST": 1, "MODERATE": 2, "FULL": 3},
    "NetworkDefinitionCreationFlag": {
        "STRONGLY_TYPED": 0,
        "PREFER_JIT_PYTHON_PLUGINS": 1,
        "PREFER_AOT_PYTHON_PLUGINS": 2,
    },
}
ENUMS_10 = {
    **ENUMS_11,
    "TacticSource": {"CUBLAS": 0, "CUBLAS_LT": 1, "CUDNN": 2, "EDGE_MASK_CONVOLUTIONS": 3, "JIT_CONVOLUTIONS": 4},
    "NetworkDefinitionCreationFlag": {
        "EXPLICIT_BATCH": 0,
        "STRONGLY_TYPED": 1,
        "PREFER_JIT_PYTHON_PLUGINS": 2,
        "PREFER_AOT_PYTHON_PLUGINS": 3,
    },
}
DATA_TYPES = {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5, "FP8": 6, "BF16": 7, "INT64": 8}
NEW_CONFIG_MEMBERS = ("max_num_tactics", "tiling_optimization_level", "max_aux_streams")


class RecordingConfig:
    """An IBuilderConfig that records every property set and method call, in order."""

    builder_optimization_level = 3
    profiling_verbosity = None
    avg_timing_iterations = 1
    max_num_tactics = -1
    tiling_optimization_level = None
    max_aux_streams = -1

    def __init__(self) -> None:
        object.__setattr__(self, "calls", [])

    def __setattr__(self, name, value):
        self.calls.append(("set", name, getattr(value, "name", value)))
        object.__setattr__(self, name, value)

    def set_memory_pool_limit(self, pool, size):
        self.calls.append(("set_memory_pool_limit", pool.name, size))

    def set_tactic_sources(self, mask):
        self.calls.append(("set_tactic_sources", mask))
        return True

    def set_flag(self, flag):
        self.calls.append(("set_flag", flag.name))


def _config_class(with_new_members: bool) -> type:
    """RecordingConfig, or a copy without the 11.x-era members (as an early 10.x has)."""
    if with_new_members:
        return RecordingConfig
    members = {k: v for k, v in vars(RecordingConfig).items() if k not in NEW_CONFIG_MEMBERS}
    return type("OldRecordingConfig", (), members)


def fake_trt(version: str, new_members: bool = True) -> SimpleNamespace:
    enums = ENUMS_11 if version.startswith("11.") else ENUMS_10
    members = {name: enum.IntEnum(name, values) for name, values in enums.items()}
    if not new_members:
        members.pop("TilingOptimizationLevel")
    return SimpleNamespace(
        __version__=version,
        DataType=enum.IntEnum("DataType", DATA_TYPES),
        IBuilderConfig=_config_class(new_members),
        BuilderFlag=enum.IntEnum("BuilderFlag", {"TF32": 6}),
        **members,
    )


OPTIONS = TensorRTOptions()
