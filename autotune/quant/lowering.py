"""What a plan's quantized layers are built with, and the typed ONNX graph a plan lowers to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx

from autotune.plan import Plan
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import rewrite

if TYPE_CHECKING:
    from autotune.model.layers import LoadedModel

Range = tuple[float, float]


@dataclass(frozen=True)
class Quantization:
    """The calibration a plan is built with: what every backend's ``build`` receives beside the plan.

    Attributes:
        ranges: Calibrated ``(lo, hi)`` per ONNX tensor name, by the plan's calibration method.
        layer_ranges: Per layer, ranges that replace ``ranges`` for that layer alone (``layerwise`` calibration).
        smoothing: Per layer, SmoothQuant factors (one per input channel); empty for backends without smoothing.
    """

    ranges: Mapping[str, Range] = field(default_factory=dict)
    layer_ranges: Mapping[str, Mapping[str, Range]] = field(default_factory=dict)
    smoothing: Mapping[str, np.ndarray] = field(default_factory=dict)


NONE = Quantization()
"""No calibration: enough for plans without quantized layers (the FP32 reference)."""


def lower(model: LoadedModel, plan: Plan, quantization: Quantization, recipe: QuantRecipe) -> onnx.ModelProto:
    """The explicitly typed ONNX graph of a plan (Q/DQ, Casts), as a graph backend builds it."""
    return rewrite(
        model.proto,
        model.layers,
        plan,
        quantization.ranges,
        recipe,
        quantization.layer_ranges,
        quantization.smoothing,
    )
