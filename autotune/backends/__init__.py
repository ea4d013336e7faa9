"""Backends build and run engines; each imports its runtime lazily."""

from __future__ import annotations

from autotune.backends.base import Backend, BackendUnavailable, BuildError, Capabilities, Knob
from autotune.config import BackendConfig


def get_backend(config: BackendConfig) -> Backend:
    """The backend a config names.

    Raises:
        BackendUnavailable: Its runtime is not installed; the message says how to install it.
        ValueError: ``backend.options`` has an unknown key or a bad value.
    """
    if config.name == "onnxruntime":
        from autotune.backends.onnxruntime import OnnxRuntimeCPU

        return OnnxRuntimeCPU(intra_op_threads=config.intra_op_threads)
    if config.name == "tensorrt":
        from autotune.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(options=config.options)
    raise BackendUnavailable(f"backend {config.name!r} is not available in this version of autotune yet")


__all__ = ["Backend", "BackendUnavailable", "BuildError", "Capabilities", "Knob", "get_backend"]
