"""The TensorRT backend: strongly typed engines from the typed ONNX graph, on one NVIDIA GPU (docs/tensorrt.md).

Modules, by concept:

- ``backend``: ``TensorRTBackend`` (the ``GraphBackend`` contract of ``autotune.backends.base``).
- ``options``: ``backend.options`` and plan knobs mapped onto the builder config, precisions, profile shapes.
- ``command``: knob names, tactic-source masks and the equivalent ``trtexec`` command.
- ``rules``: TensorRT's rules for Q/DQ graphs, checked before a build.
- ``inspect``: the engine inspector's JSON and the per-layer precision check.
- ``cuda``: the CUDA runtime calls, through cuda-python.
- ``engine``: a built engine with its buffers, stream and events.

Importing this package imports neither TensorRT nor cuda-python: the backend's constructor does.
"""

from __future__ import annotations

from autotune.backends.tensorrt.backend import (
    INSTALL_HINT,
    TIMING_CACHE_NAME,
    TensorRTBackend,
    import_tensorrt,
)
from autotune.backends.tensorrt.command import shell_script, tactic_mask, tactic_source_values, trtexec_command
from autotune.backends.tensorrt.cuda import CudaRuntime, import_cudart
from autotune.backends.tensorrt.engine import TensorRTEngine
from autotune.backends.tensorrt.inspect import (
    InspectorFormatError,
    PrecisionReport,
    check_precisions,
    parse_engine_info,
)
from autotune.backends.tensorrt.options import (
    builder_knobs,
    configure_builder,
    network_flags,
    onnx_input_shapes,
    profile_shapes,
    supported_precisions,
)
from autotune.backends.tensorrt.rules import QDQError, check_qdq, qdq_problems, requested_precisions

__all__ = [
    "INSTALL_HINT",
    "TIMING_CACHE_NAME",
    "CudaRuntime",
    "InspectorFormatError",
    "PrecisionReport",
    "QDQError",
    "TensorRTBackend",
    "TensorRTEngine",
    "builder_knobs",
    "check_precisions",
    "check_qdq",
    "configure_builder",
    "import_cudart",
    "import_tensorrt",
    "network_flags",
    "onnx_input_shapes",
    "parse_engine_info",
    "profile_shapes",
    "qdq_problems",
    "requested_precisions",
    "shell_script",
    "supported_precisions",
    "tactic_mask",
    "tactic_source_values",
    "trtexec_command",
]
