"""The torch backend: PyTorch on NVIDIA GPUs (eager on the CPU for tests), a plan built as a module rewrite.

The ONNX export of the ``model.torch`` factory still gives the layer table and our calibration; this backend maps
each ONNX layer back onto the ``nn.Linear`` or ``nn.Conv*d`` it came from and replaces that module by a wrapper
running in the chosen precision.

Modules, by concept:

- ``device``: ``DeviceInfo``, probing a device, ``torch_capabilities`` and the knob names.
- ``binding``: ONNX node names -> module paths, ``bind_layers`` and ``count_calls``.
- ``wrappers``: the wrapper modules ``CastLayer``, ``Int8Linear``, ``Fp8Linear`` and ``PrecisionBoundary``.
- ``torchao_linear``: the other implementation of int8/fp8 Linears, torchao's static configs
  (``backend.options.quantized_gemm: torchao``).
- ``attention``: swapping a transformers model's attention implementation (the ``attention`` knob).
- ``modules``: what each module runs in (``module_choices``, ``activation_scale``) and ``rewrite_module`` (the
  base precision of the whole module, the per-layer overrides on it).
- ``runtime``: ``TorchArtifact``, compile and CUDA graphs, runtime flags, staging feeds and timing.
- ``export``: the exported files and ``load_exported``.
- ``backend``: ``TorchBackend`` (the ``Backend`` contract of ``autotune.backends.base``, with the one-liner
  references ``torch-tf32``, ``torch-fp16`` and ``torch-bf16``).

Importing this package does not import torch (``import torch`` inside it is absolute: PyTorch); the wrapper
classes are defined on first access.
"""

from __future__ import annotations

from typing import Any

from autotune.backends.torch.backend import NEEDS_FACTORY, TorchBackend
from autotune.backends.torch.binding import bind_layers, count_calls, module_path, resolve_module_path
from autotune.backends.torch.device import (
    DeviceInfo,
    probe_device,
    probe_here,
    probe_isolated,
    torch_capabilities,
)
from autotune.backends.torch.export import LoadedEngine, load_engine, load_exported
from autotune.backends.torch.modules import ModuleChoice, activation_scale, module_choices, rewrite_module
from autotune.backends.torch.runtime import TorchArtifact, flatten_outputs, runtime_flags, set_runtime_flags
from autotune.backends.torch.wrappers import WRAPPER_NAMES, wrappers


def __getattr__(name: str) -> Any:
    """The wrapper classes (``WRAPPER_NAMES``) are defined on first access (they need torch)."""
    if name in WRAPPER_NAMES:
        return getattr(wrappers(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NEEDS_FACTORY",
    "DeviceInfo",
    "LoadedEngine",
    "ModuleChoice",
    "TorchArtifact",
    "TorchBackend",
    "activation_scale",
    "bind_layers",
    "count_calls",
    "flatten_outputs",
    "load_engine",
    "load_exported",
    "module_choices",
    "module_path",
    "probe_device",
    "probe_here",
    "probe_isolated",
    "resolve_module_path",
    "rewrite_module",
    "runtime_flags",
    "set_runtime_flags",
    "torch_capabilities",
]
