"""Layerwise calibration: every layer's INT8 recipe by what costs the model least.

No single recipe suits every layer. On all-MiniLM-L6-v2, clipping the GELU output that feeds layer 0's FFN
down-projection at the 99.99th percentile cuts the drop of quantizing that layer 2.8x, while the same clipping on
the input of a key projection multiplies that layer's drop by up to 800x. Most of a layer's drop comes from its
activations (the weights alone: 4-22 % of it on six sensitive MiniLM layers), whose outliers sit in a few
channels; SmoothQuant (Xiao et al., 2023) divides each input channel by ``s = max|x|^a / max|W|^(1-a)`` and
multiplies the weight's row by it, which cut the drop of an FFN up-projection 9x in our measurements, at the
price of one elementwise Mul.

The ``layerwise`` calibration therefore quantizes each layer alone with each candidate (the range methods, and
SmoothQuant at a few strengths on MatMuls with a 2-D weight), on the calibration data, and keeps the candidate whose
model output stays closest to FP32 (per-layer errors are close to additive, so the single-layer winner is the right
choice in any plan). The choices are made once per model, data and recipe and cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from autotune.metrics import snr_db
from autotune.model import Layer
from autotune.plan import Plan
from autotune.quant.calibrate import (
    METHODS,
    Calibration,
    atomic_write_text,
    data_hash,
    read_cache,
    session_with_outputs,
)
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import required_ranges, rewrite, smoothable

logger = logging.getLogger(__name__)

LAYERWISE = "layerwise"
"""The calibration knob value that picks a recipe per layer."""

SMOOTHING = {"smooth-0.5": 0.5, "smooth-0.75": 0.75}
"""SmoothQuant candidates by name: the migration strength ``a`` (0: all on the weight side, 1: all removed)."""

_CACHE_FORMAT = 2


def choose_methods(layers: Sequence[str], methods: Sequence[str], error: Callable[[str, str], float]) -> dict[str, str]:
    """The method with the smallest ``error(layer, method)`` for every layer. Pure.

    Ties go to the method listed first, so a layer that no method helps keeps the first one.

    Args:
        layers: Layer names.
        methods: Candidates, preferred first.
        error: The output error of the model with only ``layer`` quantized by ``method``.

    Returns:
        Layer name to method.

    Raises:
        ValueError: ``methods`` is empty.
    """
    if not methods:
        raise ValueError("layerwise calibration needs at least one candidate method")
    choices = {}
    for layer in layers:
        errors = [error(layer, method) for method in methods]
        choices[layer] = methods[int(np.argmin(errors))]  # argmin returns the first of equal minima
    return choices


@dataclass(frozen=True)
class LayerwiseChoices:
    """The recipe chosen for each layer, the errors that chose it, and what smoothing needs.

    Attributes:
        methods: Layer name to its candidate: a range method, or a key of :data:`SMOOTHING` (max ranges of the
            smoothed input).
        errors: Layer name to ``{candidate: output error}`` (noise-to-signal power of the model output).
        channel_ranges: Per smoothable input tensor, the per-channel ``(min, max)`` over the calibration data.
    """

    methods: dict[str, str]
    errors: dict[str, dict[str, float]]
    channel_ranges: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    def smoothing(self, model: onnx.ModelProto, layers: Sequence[Layer]) -> dict[str, np.ndarray]:
        """Per smoothed layer, its SmoothQuant factors (what ``rewrite``'s ``smoothing`` takes)."""
        weights = {init.name: init for init in model.graph.initializer}
        factors = {}
        for layer in layers:
            alpha = SMOOTHING.get(self.methods.get(layer.name, ""))
            if alpha is not None and layer.weight is not None:
                lo, hi = self.channel_ranges[layer.activation_inputs[0]]
                weight = numpy_helper.to_array(weights[layer.weight])
                factors[layer.name] = smoothing_factors(np.asarray(lo), np.asarray(hi), weight, alpha)
        return factors

    def layer_ranges(
        self, calibration: Calibration, smoothing: Mapping[str, np.ndarray], layers: Sequence[Layer]
    ) -> dict[str, dict[str, tuple[float, float]]]:
        """Per layer, the ranges of its method; a smoothed layer's input range is that of ``x / s``."""
        by_method = {m: calibration.ranges(m) for m in {*self.methods.values(), "max"} if m not in SMOOTHING}
        ranges = {}
        for layer in layers:
            method = self.methods.get(layer.name)
            if method is None:
                continue
            if method in SMOOTHING:
                tensor = layer.activation_inputs[0]
                lo, hi = self.channel_ranges[tensor]
                ranges[layer.name] = {**by_method["max"], tensor: smoothed_range(lo, hi, smoothing[layer.name])}
            else:
                ranges[layer.name] = by_method[method]
        return ranges


def smoothing_factors(lo: np.ndarray, hi: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's ``s_j = max|x_j|^a / max|W_j|^(1-a)`` per input channel ``j`` (row ``j`` of ``weight``). Pure.

    Channels that are all zero on either side keep ``s = 1``.
    """
    x_max = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float64)
    w_max = np.abs(weight).max(axis=1).astype(np.float64)
    factors = np.ones_like(x_max)
    live = (x_max > 0) & (w_max > 0)
    factors[live] = x_max[live] ** alpha / w_max[live] ** (1.0 - alpha)
    return factors.astype(np.float32)


def smoothed_range(lo: Sequence[float], hi: Sequence[float], factors: np.ndarray) -> tuple[float, float]:
    """The ``max`` range of ``x / s`` from the per-channel ranges of ``x``; exact, as ``s > 0`` keeps order."""
    scaled_lo = np.asarray(lo, dtype=np.float64) / factors
    scaled_hi = np.asarray(hi, dtype=np.float64) / factors
    return float(min(scaled_lo.min(), 0.0)), float(max(scaled_hi.max(), 0.0))


def _channel_ranges(
    model: onnx.ModelProto, tensors: Sequence[str], batches: Sequence[Mapping[str, np.ndarray]], output_index: int
) -> tuple[list[np.ndarray], dict[str, tuple[list[float], list[float]]]]:
    """The model's scored output per batch, and the per-channel (last axis) min and max of ``tensors``."""
    session = session_with_outputs(model, tensors) if tensors else _session(model)
    names = [output.name for output in session.get_outputs()]
    outputs, lows, highs = [], {}, {}
    for batch in batches:
        values = dict(zip(names, session.run(None, dict(batch)), strict=True))
        outputs.append(values[names[output_index]])
        for tensor in tensors:
            flat = values[tensor].reshape(-1, values[tensor].shape[-1])
            lows[tensor] = np.minimum(lows.get(tensor, np.inf), flat.min(axis=0))
            highs[tensor] = np.maximum(highs.get(tensor, -np.inf), flat.max(axis=0))
    return outputs, {t: (lows[t].tolist(), highs[t].tolist()) for t in tensors}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # Only the numbers matter here: skipping graph optimizations makes each of the ~180 sessions (MiniLM) cheap.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _outputs(model: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]], index: int) -> list[np.ndarray]:
    session = _session(model)
    return [session.run(None, dict(batch))[index] for batch in batches]


def _cache_path(
    cache_dir: Path,
    model_hash: str,
    batches: Sequence[Mapping[str, np.ndarray]],
    layers: Sequence[Layer],
    recipe: QuantRecipe,
    calibration: Calibration,
    output_index: int,
    methods: Sequence[str],
) -> Path:
    key = json.dumps(
        {
            "format": _CACHE_FORMAT,
            "layers": [layer.name for layer in layers],
            "recipe": repr(recipe),
            "settings": repr(calibration.settings),
            "output": output_index,
            "methods": list(methods),
        }
    )
    key_hash = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"layerwise-{model_hash[:16]}-{data_hash(batches)}-{key_hash}.json"


def _load(path: Path, layers: Sequence[Layer], methods: Sequence[str]) -> LayerwiseChoices | None:
    try:
        data = read_cache(path, _CACHE_FORMAT)
        if data is None:
            return None
        chosen = {str(k): str(v) for k, v in data["methods"].items()}
        errors = {str(k): {str(m): float(e) for m, e in v.items()} for k, v in data["errors"].items()}
        channels = {str(k): (list(map(float, lo)), list(map(float, hi))) for k, (lo, hi) in data["channels"].items()}
        if set(chosen) != {layer.name for layer in layers} or not set(chosen.values()) <= set(methods):
            raise ValueError("cached layers or methods differ from the requested ones")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("ignoring unreadable layerwise calibration cache %s (%s); choosing again", path, error)
        return None
    return LayerwiseChoices(chosen, errors, channels)


def choose_layer_methods(
    model: onnx.ModelProto,
    layers: Sequence[Layer],
    recipe: QuantRecipe,
    calibration: Calibration,
    batches: Sequence[Mapping[str, np.ndarray]],
    output_index: int = 0,
    cache_dir: Path | None = None,
    model_hash: str = "",
    methods: Sequence[str] = (*METHODS, *SMOOTHING),
) -> LayerwiseChoices:
    """Quantizes each layer alone to INT8 with each candidate and keeps the least harmful one.

    The error is the noise-to-signal power ratio of the model output against FP32 on ``batches`` (the
    calibration data: no labels needed, and the evaluation data stays unseen). Runs on ONNX Runtime's CPU for
    every backend: the Q/DQ graphs are the same numbers wherever they run. A range method whose ranges for the
    layer equal an earlier method's is not run again; smoothing candidates count only for MatMuls with a 2-D weight.

    Args:
        model: The FP32 model.
        layers: The layers to choose for (those the search may put in INT8).
        recipe: The backend's Q/DQ recipe.
        calibration: Statistics of every tensor the layers need.
        batches: Calibration feeds.
        output_index: The scored model output.
        cache_dir: Where the choices are cached, or None.
        model_hash: Content hash of ``model`` (part of the cache key).
        methods: Candidates, preferred first: range methods and keys of :data:`SMOOTHING`.

    Returns:
        The choices, from the cache when one matches.
    """
    path = None
    if cache_dir is not None:
        path = _cache_path(Path(cache_dir), model_hash, batches, layers, recipe, calibration, output_index, methods)
        cached = _load(path, layers, methods)
        if cached is not None:
            return cached
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    smoothable_layers = [
        layer for layer in layers if smoothable(layer) and len(weights.get(layer.weight or "", ())) == 2
    ]
    tensors = list(dict.fromkeys(layer.activation_inputs[0] for layer in smoothable_layers))
    smooth = any(method in SMOOTHING for method in methods)
    reference, channels = _channel_ranges(model, tensors if smooth else [], batches, output_index)
    by_method = {method: calibration.ranges(method) for method in methods if method not in SMOOTHING}
    by_name = {layer.name: layer for layer in layers}
    errors: dict[str, dict[str, float]] = {name: {} for name in by_name}
    seen: dict[tuple, float] = {}

    def error(name: str, method: str) -> float:
        layer = by_name[name]
        plan = Plan.make({name: "int8"})
        if method in SMOOTHING:
            if layer not in smoothable_layers:
                return math.inf
            alone = LayerwiseChoices({name: method}, {}, channels)
            smoothing = alone.smoothing(model, [layer])
            ranges = alone.layer_ranges(calibration, smoothing, [layer])[name]
            typed = rewrite(model, layers, plan, ranges, recipe, smoothing=smoothing)
            key: tuple = (name, method)
        else:
            key = (name, tuple(by_method[method].get(t) for t in required_ranges([layer], recipe, model)))
            typed = rewrite(model, layers, plan, by_method[method], recipe) if key not in seen else None
        if key not in seen:
            seen[key] = float(10.0 ** (-snr_db(_outputs(typed, batches, output_index), reference) / 10.0))
        errors[name][method] = seen[key]
        return seen[key]

    chosen = LayerwiseChoices(choose_methods(list(by_name), methods, error), errors, channels)
    if path is not None:
        payload = {"format": _CACHE_FORMAT, "methods": chosen.methods, "errors": chosen.errors, "channels": channels}
        try:
            atomic_write_text(path, json.dumps(payload))
        except OSError as error_:  # a cache that cannot be written only costs time
            logger.warning("cannot write the layerwise calibration cache %s (%s)", path, error_)
    return chosen
