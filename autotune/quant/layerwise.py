"""Layerwise calibration: every layer's INT8 recipe by what costs the model least.

No single recipe suits every layer: on all-MiniLM-L6-v2 the percentile clipping that helps one layer most hurts
another most (docs/method.md#measurements-behind-the-codes-choices). Most of a layer's drop comes from its
activations, whose outliers sit in a few channels; SmoothQuant (Xiao et al., 2023) divides each input channel by
``s = max|x|^a / max|W|^(1-a)`` and multiplies the weight's row by it, at the price of one elementwise Mul.

The ``layerwise`` calibration therefore quantizes each layer alone with each candidate (the range methods, and
SmoothQuant at a few strengths on MatMuls with a 2-D weight), on the calibration data, and keeps the candidate whose
model output stays closest to FP32 (per-layer errors are close to additive, so the single-layer winner is the right
choice in any plan). The choices are made once per model, data and recipe and cached on disk.

The model output is the criterion, not the layer's own output error: that one would pick another candidate for
some of MiniLM's layers, where the clipping that wins at the output leaves a large error in the layer's own. It is
measured without rewriting or running the
whole model per candidate: one FP32 run caches every tensor the layers and the parts after them read, one probe
session per layer runs all its candidates side by side on those tensors, and only the part of the model
downstream of the layer runs per candidate and batch (``autotune/quant/probe.py``), with the same kernels and so
the same numbers as the whole rewritten model.

A candidate stops early once it is clearly beaten (``probe.MARGIN``).

A run with ``budget.minutes`` gives the choice a quarter of them (``allowance_s``, from
``autotune.harness.deadline.LAYERWISE_SHARE``): the layers not reached by then take the range method chosen most
often, the log says how many were chosen and how many defaulted, and the next run on the same cache measures
them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import numpy_helper
from tqdm import tqdm

from autotune.metrics import SNR_CAP_DB
from autotune.model.layers import Layer
from autotune.quant import probe
from autotune.quant.calibrate import (
    METHODS,
    Calibration,
    data_hash,
    read_cache,
)
from autotune.quant.probe import Cut, find_cut
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import required_ranges, smoothable
from autotune.run.files import atomic_write

logger = logging.getLogger(__name__)

LAYERWISE = "layerwise"
"""The calibration knob value that picks a recipe per layer."""

SMOOTHING = {"smooth-0.5": 0.5, "smooth-0.75": 0.75}
"""SmoothQuant candidates by name: the migration strength ``a`` (0: all on the weight side, 1: all removed)."""

_CACHE_FORMAT = 6


class LayerProbe(Protocol):
    """Runs one layer's INT8 candidates on a backend's own device instead of ONNX Runtime's CPU.

    A backend offers one (``Backend.layer_probe``) where it runs the model itself on an accelerator: the torch
    backend on CUDA runs each candidate as its own quantized module inside the FP32 module, on the GPU, in
    seconds where the CPU probes took minutes. It quantizes the layer as the backend's builds do, so its errors
    are the backend's own numbers; the choice rule (:func:`choose_methods`) and the output format are the same.

    Attributes:
        name: Where it runs, e.g. ``torch:cuda``: part of the cache key, so choices made on one device are not
            read back as another's.
    """

    name: str

    def noise(
        self,
        layer: Layer,
        candidates: Sequence[Mapping[str, tuple[float, float]]],
        batches: Sequence[Mapping[str, np.ndarray]],
        output_index: int,
        smoothing: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[float], float]:
        """Per candidate, the scored output's noise-to-signal summed over the samples; and how many samples.

        Each candidate is the ranges ``layer`` is quantized with, and in ``smoothing`` its SmoothQuant factors or
        None (all None when ``smoothing`` is None); a sample's noise-to-signal is its squared error over its FP32
        output's power (``probe.sample_powers``), on the probe's device, over the samples of ``batches``.

        Raises:
            ValueError: The layer cannot be quantized alone here (no module, a missing range).
        """
        ...

    def channel_ranges(
        self, layers: Sequence[Layer], batches: Sequence[Mapping[str, np.ndarray]]
    ) -> dict[str, tuple[list[float], list[float]]]:
        """Per input tensor of ``layers``, its per-channel ``(min, max)`` over ``batches`` (for smoothing)."""
        ...


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
        errors: Layer name to ``{candidate: output error}`` (the model output's noise-to-signal power, the mean
            over the samples): exact
            for the chosen candidate and every one measured on all the data; a candidate that stopped early
            holds the estimate from the batches it ran, which is above the chosen one's (``probe.race``).
        channel_ranges: Per smoothable input tensor, the per-channel ``(min, max)`` over the calibration data.
        defaulted: The layers not measured before the allowance ran out (``LayerwiseOptions.allowance_s``): they
            take the method chosen most often among the measured ones, and have no errors.
        seconds: How long choosing took in this process; 0 when the choices came from the cache (not compared).
    """

    methods: dict[str, str]
    errors: dict[str, dict[str, float]]
    channel_ranges: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    defaulted: tuple[str, ...] = ()
    seconds: float = field(default=0.0, compare=False)

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


_Candidate = tuple[Mapping[str, tuple[float, float]], "np.ndarray | None"]
"""A way to quantize one layer: the ranges ``rewrite`` reads for it, and its SmoothQuant factors or None."""


def _candidates(
    model: onnx.ModelProto,
    layer: Layer,
    recipe: QuantRecipe,
    calibration: Calibration,
    by_method: Mapping[str, Mapping[str, tuple[float, float]]],
    channels: Mapping[str, tuple[list[float], list[float]]],
    methods: Sequence[str],
    smoothable_layers: set[str],
) -> dict[str, tuple[tuple, _Candidate] | None]:
    """Per method, a key and the layer's candidate; equal keys are the same Q/DQ; None where it does not apply."""
    required = required_ranges([layer], recipe, model)
    options: dict[str, tuple[tuple, _Candidate] | None] = {}
    for method in methods:
        if method not in SMOOTHING:
            # Range methods that agree on every range the layer reads build the same layer: measure it once.
            ranges = by_method[method]
            options[method] = (("ranges", *(ranges.get(t) for t in required)), (ranges, None))
        elif layer.name in smoothable_layers:
            alone = LayerwiseChoices({layer.name: method}, {}, channels)
            smoothing = alone.smoothing(model, [layer])
            ranges = alone.layer_ranges(calibration, smoothing, [layer])[layer.name]
            options[method] = (("smooth", method), (ranges, smoothing[layer.name]))
        else:
            options[method] = None
    return options


def _layer_errors(
    model: onnx.ModelProto,
    layer: Layer,
    cut: Cut,
    recipe: QuantRecipe,
    candidates: Sequence[_Candidate],
    fp32: probe.Fp32Run,
    exhaustive: bool = False,
    forms: Sequence[tuple[str, QuantRecipe]] | None = None,
) -> list[float]:
    """Each candidate's model-output noise-to-signal, the samples' mean (an estimate for a clear loser: ``race``).

    Only the layer differs between the single-layer INT8 model and FP32, so the model output is the downstream
    part of the model applied to the layer's quantized output, fed the FP32 values of everything else it reads.
    ``exhaustive`` runs every candidate on every batch; ``forms``: each candidate's precision and recipe
    (``probe.candidate_outputs``).
    """
    powers = fp32.powers
    samples = [float(len(power)) for power in powers]
    if not cut.reaches_output:  # the layer cannot move the output: every candidate scores as FP32 does
        return [_noise_to_signal(0.0, sum(samples))] * len(candidates)
    changed, downstream = probe.candidate_outputs(model, layer, cut, recipe, candidates, fp32, forms)

    def noise_of(candidate: int, batch: int) -> float:
        out = changed[batch][candidate]
        if downstream is not None:
            feeds = {name: fp32.values[batch][name] for name in cut.downstream_inputs}
            out = downstream.run([fp32.output], {cut.target: out, **feeds})[0]
        difference = (np.asarray(out, np.float64) - fp32.reference[batch]).reshape(len(powers[batch]), -1)
        return float((np.einsum("ij,ij->i", difference, difference) / powers[batch]).sum())

    noise = probe.race(len(candidates), noise_of, samples, exhaustive)
    return [_noise_to_signal(value, sum(samples)) for value in noise]


def _probed_errors(
    layer_probe: LayerProbe,
    layer: Layer,
    cut: Cut,
    candidates: Sequence[_Candidate],
    batches: Sequence[Mapping[str, np.ndarray]],
    output_index: int,
) -> list[float]:
    """Each candidate's model-output noise-to-signal (the samples' mean), measured by ``layer_probe`` on all batches."""
    if not cut.reaches_output:  # as in _layer_errors: the layer cannot move the scored output
        return [_noise_to_signal(0.0, 1.0)] * len(candidates)
    ranges = [candidate_ranges for candidate_ranges, _ in candidates]
    factors = [candidate_factors for _, candidate_factors in candidates]
    if all(candidate_factors is None for candidate_factors in factors):
        noise, samples = layer_probe.noise(layer, ranges, batches, output_index)
    else:
        noise, samples = layer_probe.noise(layer, ranges, batches, output_index, smoothing=factors)
    return [_noise_to_signal(value, samples) for value in noise]


def _noise_to_signal(noise: float, signal: float) -> float:
    """``noise / signal`` as ``snr_db`` sees it: identical outputs score its SNR cap, not 0."""
    floor = 10.0 ** (-SNR_CAP_DB / 10.0)
    return floor if noise == 0 else max(floor, noise / max(signal, 1e-30))


def _cache_path(
    cache_dir: Path,
    model_hash: str,
    batches: Sequence[Mapping[str, np.ndarray]],
    layers: Sequence[Layer],
    recipe: QuantRecipe,
    calibration: Calibration,
    options: tuple,
) -> Path:
    key = json.dumps(
        {
            "format": _CACHE_FORMAT,
            "layers": [layer.name for layer in layers],
            "recipe": repr(recipe),
            "settings": repr(calibration.settings),
            "options": repr(options),
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
        defaulted = tuple(str(name) for name in data.get("defaulted", []))
        if set(chosen) != {layer.name for layer in layers} or not set(chosen.values()) <= set(methods):
            raise ValueError("cached layers or methods differ from the requested ones")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("ignoring unreadable layerwise calibration cache %s (%s); choosing again", path, error)
        return None
    return LayerwiseChoices(chosen, errors, channels, defaulted)


@dataclass(frozen=True)
class LayerwiseOptions:
    """How :func:`choose_layer_methods` chooses: what it scores, with which candidates, where, and its cache.

    Attributes:
        output_index: The scored model output.
        cache_dir: Where the choices are cached, or None.
        model_hash: Content hash of the model (part of the cache key).
        methods: Candidates, preferred first: range methods and keys of :data:`SMOOTHING`.
        progress: Show a progress bar (on stderr) over the layers.
        exhaustive: Measure every candidate on every batch, so every recorded error is exact (the choices are
            the same either way; slower).
        layer_probe: Runs the single-layer candidates on the backend's device (:class:`LayerProbe`), every
            candidate on every batch, SmoothQuant ones too (it reads the per-channel ranges there); None runs them
            on ONNX Runtime's CPU.
        allowance_s: Seconds choosing may take; the layers not reached by then take the method chosen most
            often (:attr:`LayerwiseChoices.defaulted`), and a later call with the same cache measures them. None:
            no limit. Not part of the cache key.
    """

    output_index: int = 0
    cache_dir: Path | None = None
    model_hash: str = ""
    methods: Sequence[str] = (*METHODS, *SMOOTHING)
    progress: bool = True
    exhaustive: bool = False
    layer_probe: LayerProbe | None = None
    allowance_s: float | None = None

    def cache_key(self) -> tuple:
        """The options that change the choices (beside the model, data, layers and recipe)."""
        key = (self.output_index, tuple(self.methods), self.exhaustive)
        return key if self.layer_probe is None else (*key, self.layer_probe.name)


def choose_layer_methods(
    model: onnx.ModelProto,
    layers: Sequence[Layer],
    recipe: QuantRecipe,
    calibration: Calibration,
    batches: Sequence[Mapping[str, np.ndarray]],
    output_index: int = 0,
    **options: Any,
) -> LayerwiseChoices:
    """Quantizes each layer alone to INT8 with each candidate and keeps the least harmful one.

    The error is the model output's noise-to-signal power against FP32, the mean over the samples of ``batches``
    (the calibration data: no labels needed, and the evaluation data stays unseen). Runs on ONNX Runtime's CPU (the
    Q/DQ graphs are the same numbers wherever they run) unless a ``layer_probe`` runs it on the backend's device.
    On the CPU, one FP32 run caches what every layer reads; then, per layer, one probe session computes all its
    candidates and only the model downstream of the layer runs per candidate (see ``autotune/quant/probe.py``),
    skipping the rest of a candidate's batches once it cannot win (``probe.race``). The cached FP32 tensors of all
    batches stay in memory meanwhile (MiniLM: 130 MB per batch of 8 x 128 tokens). A range method whose ranges for
    the layer equal an earlier method's is not run again; smoothing candidates count only for MatMuls with a 2-D
    weight.

    Args:
        model: The FP32 model.
        layers: The layers to choose for (those the search may put in INT8).
        recipe: The backend's Q/DQ recipe.
        calibration: Statistics of every tensor the layers need.
        batches: Calibration feeds.
        output_index: The scored model output.
        **options: The other fields of :class:`LayerwiseOptions`, by name.

    Returns:
        The choices, from the cache when one matches (a cached choice cut short by its allowance measures the
        layers it defaulted, within this call's allowance); ``seconds`` says how long choosing took.
    """
    start = time.perf_counter()
    settings = LayerwiseOptions(output_index=output_index, **options)
    if not settings.methods:
        raise ValueError("layerwise calibration needs at least one candidate method")
    path, known = None, LayerwiseChoices({}, {})
    if settings.cache_dir is not None:
        key = settings.cache_key()
        path = _cache_path(Path(settings.cache_dir), settings.model_hash, batches, layers, recipe, calibration, key)
        cached = _load(path, layers, settings.methods)
        if cached is not None and not cached.defaulted:
            return cached
        known = cached or known  # cut short by an allowance: measure the layers it defaulted
    todo = [layer for layer in layers if layer.name not in known.errors]
    deadline = None if settings.allowance_s is None else start + settings.allowance_s
    errors, channels = _measure_layers(model, todo, recipe, calibration, batches, settings, deadline)
    chosen = _with_defaults(
        [layer.name for layer in layers],
        {**known.errors, **errors},
        {**known.channel_ranges, **channels},
        settings.methods,
        time.perf_counter() - start,
    )
    _log_choices(chosen, len(layers), settings.allowance_s)
    if path is not None:
        _save(path, chosen)
    return chosen


def _with_defaults(
    names: Sequence[str],
    errors: dict[str, dict[str, float]],
    channels: dict[str, tuple[list[float], list[float]]],
    methods: Sequence[str],
    seconds: float,
) -> LayerwiseChoices:
    """Every measured layer's least harmful method; the others take the range method chosen most often.

    Ties in the count go to the method listed first; with nothing measured, the first range method.
    """
    measured = [name for name in names if name in errors]
    chosen = choose_methods(measured, methods, lambda name, method: errors[name].get(method, math.inf))
    range_methods = [method for method in methods if method not in SMOOTHING] or list(methods)
    counts = Counter(chosen.values())
    default = max(range_methods, key=lambda method: (counts[method], -range_methods.index(method)))
    defaulted = tuple(name for name in names if name not in errors)
    return LayerwiseChoices(
        {name: chosen.get(name, default) for name in names}, errors, channels, defaulted, seconds=seconds
    )


def _log_choices(chosen: LayerwiseChoices, layers: int, allowance_s: float | None) -> None:
    """One line: how many layers in how long, and how many defaulted when the allowance ran out."""
    if not chosen.defaulted:
        logger.info("layerwise calibration: %d layers in %.1f s", layers, chosen.seconds)
        return
    default = chosen.methods[chosen.defaulted[0]]
    logger.warning(
        "layerwise calibration: %d layers in %.1f s; its allowance of %.0f s ran out: %d chosen, %d defaulted to "
        "%r (the method chosen most often); a later run with the same cache measures them",
        layers,
        chosen.seconds,
        allowance_s or 0.0,
        layers - len(chosen.defaulted),
        len(chosen.defaulted),
        default,
    )


def _save(path: Path, chosen: LayerwiseChoices) -> None:
    """Caches the choices; a cache that cannot be written only costs time, so a failure is logged, not raised."""
    payload = {
        "format": _CACHE_FORMAT,
        "methods": chosen.methods,
        "errors": chosen.errors,
        "channels": chosen.channel_ranges,
        "defaulted": list(chosen.defaulted),
    }
    try:
        atomic_write(path, json.dumps(payload))
    except OSError as error:
        logger.warning("cannot write the layerwise calibration cache %s (%s)", path, error)


def _smoothable_layers(model: onnx.ModelProto, layers: Sequence[Layer]) -> set[str]:
    """The layers SmoothQuant applies to: smoothable ops whose weight is 2-D."""
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    return {layer.name for layer in layers if smoothable(layer) and len(weights.get(layer.weight or "", ())) == 2}


def _measure_layers(
    model: onnx.ModelProto,
    layers: Sequence[Layer],
    recipe: QuantRecipe,
    calibration: Calibration,
    batches: Sequence[Mapping[str, np.ndarray]],
    settings: LayerwiseOptions,
    deadline: float | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, tuple[list[float], list[float]]]]:
    """Per layer reached before ``deadline`` (``perf_counter``), its error per method; and the per-channel ranges.

    The per-channel ranges are those smoothing needs.

    """
    smoothable_layers = _smoothable_layers(model, layers)
    smooth = any(method in SMOOTHING for method in settings.methods)
    channel_tensors = list(
        dict.fromkeys(layer.activation_inputs[0] for layer in layers if smooth and layer.name in smoothable_layers)
    )
    output = model.graph.output[settings.output_index].name
    cuts = {layer.name: find_cut(model, layer, recipe, output) for layer in layers}
    fetched = list(dict.fromkeys(name for cut in cuts.values() for name in cut.fetched))
    errors: dict[str, dict[str, float]] = {}
    if not layers:
        return errors, {}
    # The FP32 run counts as one step of the bar: on MiniLM it takes about as long as one early layer.
    with tqdm(total=len(layers) + 1, desc="layerwise calibration", unit="step", disable=not settings.progress) as bar:
        if settings.layer_probe is None:
            fp32 = probe.Fp32Run(
                output, *probe.fp32_pass(model, fetched, channel_tensors, batches, settings.output_index)
            )
        else:  # the probe runs its own FP32 model on its device, and reads the channels smoothing needs there
            smoothed = [layer for layer in layers if smooth and layer.name in smoothable_layers]
            channels = settings.layer_probe.channel_ranges(smoothed, batches) if smoothed else {}
            fp32 = probe.Fp32Run(output, [], [], channels)
        bar.update()
        by_method = {method: calibration.ranges(method) for method in settings.methods if method not in SMOOTHING}
        for layer in layers:
            if deadline is not None and time.perf_counter() > deadline:
                break
            options = _candidates(
                model, layer, recipe, calibration, by_method, fp32.channels, settings.methods, smoothable_layers
            )
            errors[layer.name] = _measure_layer(
                layer, cuts[layer.name], options, fp32, (model, recipe), settings, batches
            )
            bar.update()
    return errors, fp32.channels


def _measure_layer(
    layer: Layer,
    cut: Cut,
    options: Mapping[str, tuple[tuple, _Candidate] | None],
    fp32: probe.Fp32Run,
    model_and_recipe: tuple[onnx.ModelProto, QuantRecipe],
    settings: LayerwiseOptions,
    batches: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, float]:
    """One layer's error per candidate method; methods that build the same Q/DQ are measured once."""
    model, recipe = model_and_recipe
    unique: dict[tuple, _Candidate] = {}
    for option in options.values():
        if option is not None:
            unique.setdefault(*option)
    if settings.layer_probe is None:
        measured = _layer_errors(model, layer, cut, recipe, list(unique.values()), fp32, settings.exhaustive)
    else:
        measured = _probed_errors(
            settings.layer_probe, layer, cut, list(unique.values()), batches, settings.output_index
        )
    by_key = dict(zip(unique, measured, strict=True))
    return {method: by_key[option[0]] for method, option in options.items() if option}
