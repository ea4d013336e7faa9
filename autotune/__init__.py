"""autotune: per-layer precision and build knobs, searched for the fastest engine within an accuracy budget.

Importing autotune does not import TensorRT, PyTorch or ONNX Runtime; backends load their runtime on first use.
"""

from autotune.config import ConfigError, TuneConfig, load_config
from autotune.plan import Plan

__version__ = "0.1.0"

__all__ = ["ConfigError", "Plan", "TuneConfig", "load_config", "__version__"]
