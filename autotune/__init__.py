"""autotune: per-layer precision and build knobs, searched for the fastest engine within an accuracy budget.

Importing autotune does not import TensorRT, PyTorch or ONNX Runtime; backends load their runtime on first use.
"""

from typing import Any

from autotune.config.schema import ConfigError, TuneConfig, load_config
from autotune.plan import Plan

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # PEP 562: ``autotune.load`` is the API's loader, imported on first use so that ``import autotune``
    # stays config and plan only (the API pulls in onnx, numpy and the harness).
    if name == "load":
        from autotune.api import load

        return load
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


__all__ = ["ConfigError", "Plan", "TuneConfig", "load", "load_config", "__version__"]
