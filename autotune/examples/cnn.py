"""A small CNN on raw-sensor digits: the ONNX model and its data splits, shipped in ``data/``.

``train_cnn.py`` makes everything here from scikit-learn's bundled digits (see its docstring for the task
and the model). ``configs/cnn-cpu.yaml`` points ``model.onnx`` at :data:`MODEL_PATH` and the data at
:func:`batches`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).parent / "data"
MODEL_PATH = DATA_DIR / "cnn.onnx"
INPUT_NAME = "image"
SPLITS = ("calibration", "evaluation", "holdout")


def split_path(split: str) -> Path:
    """The ``.npz`` file of one split.

    Raises:
        ValueError: Unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    return DATA_DIR / f"cnn_{split}.npz"


def batches(split: str, batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """The images and labels of one split in full batches.

    Args:
        split: ``"calibration"``, ``"evaluation"`` or ``"holdout"``.
        batch_size: Rows per batch; a last partial batch is dropped (the shipped splits are multiples of 32).

    Returns:
        ``[{"image": float32 [batch_size, 1, 16, 16], "labels": int64 [batch_size]}, ...]``.

    Raises:
        ValueError: Unknown split.
        FileNotFoundError: The data files are missing (re-run ``python -m autotune.examples.train_cnn``).
    """
    path = split_path(split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; re-create it with `python -m autotune.examples.train_cnn`")
    with np.load(path, allow_pickle=False) as data:
        images = data[INPUT_NAME].astype(np.float32)
        labels = data["labels"].astype(np.int64)
    return [
        {INPUT_NAME: images[start : start + batch_size], "labels": labels[start : start + batch_size]}
        for start in range(0, len(labels) - batch_size + 1, batch_size)
    ]
