"""autotune: per-layer precision and build knobs, searched for the fastest engine within an accuracy budget.

Importing autotune does not import TensorRT, PyTorch or ONNX Runtime; backends load their runtime on first use.
"""

from pathlib import Path
from typing import Any

from autotune.config import ConfigError, TuneConfig, load_config
from autotune.plan import Plan

__version__ = "0.1.0"


def load(best_dir: str | Path, device: str | None = None) -> Any:
    """A run's exported winner, ready to call at the speed the run measured: ``autotune.load("runs/NAME/best")``.

    A torch export (``manifest.json``) comes back compiled and captured with the winner's knobs
    (``autotune.backends.torch.load_engine``); call it with the model's inputs.

    Args:
        best_dir: The export directory (a run's ``best/``).
        device: Where to run; default the device the run built for.

    Raises:
        ValueError: The directory holds no torch export (ONNX Runtime's ``model.onnx`` and TensorRT's
            ``engine.plan`` load with their own runtimes).
    """
    best_dir = Path(best_dir)
    if not (best_dir / "manifest.json").is_file():
        found = sorted(path.name for path in best_dir.iterdir()) if best_dir.is_dir() else []
        raise ValueError(
            f"{best_dir}: no manifest.json, so no torch export (found {found}); an ONNX Runtime export is "
            f"model.onnx (onnxruntime.InferenceSession) and a TensorRT one engine.plan"
        )
    from autotune.backends.torch import load_engine

    return load_engine(best_dir, device)


__all__ = ["ConfigError", "Plan", "TuneConfig", "load", "load_config", "__version__"]
