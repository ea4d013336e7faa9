"""Each layer's error in the other INT8 forms: another exact scheme (7-bit weights) and ``int8-dynamic``.

The layerwise calibration (:mod:`autotune.quant.layerwise`) measures every layer's output error alone in the
default INT8 scheme, which the search's priors turn into per-layer drops (:mod:`autotune.search.prior`). Where
this CPU offers more INT8 forms, each errs differently per layer: 7-bit weights (``u8s7``) halve the weight
resolution, which costs a layer with a wide weight distribution more than one with a narrow one; a dynamic layer
quantizes its input over each run's own range, which suits a layer with input outliers a static range clips
badly and costs one whose input range a static range fits. So every layer is measured once more in each form,
with the range method the layerwise calibration chose for it, by the same probes (one session per layer runs
all its forms side by side, :func:`autotune.quant.probe.candidate_outputs`), and the priors read them: a layer
whose 7-bit error is too high keeps another form in the plans the model proposes.

The errors are cached on disk by model, data, layers, choices and forms; a run whose allowance ends first keeps
what it measured, and the next run measures the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from autotune.model.layers import Layer, LoadedModel
from autotune.quant import probe
from autotune.quant.calibrate import Calibration, data_hash
from autotune.quant.dynamic import DYNAMIC, DYNAMIC_OP_TYPES
from autotune.quant.layerwise import LayerwiseChoices, _layer_errors
from autotune.quant.recipe import QuantRecipe
from autotune.run.files import atomic_write

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1


@dataclass(frozen=True)
class Form:
    """One INT8 form a layer may take besides the default scheme.

    Attributes:
        name: The form's name in the priors: a scheme (``u8s7``) or ``int8-dynamic``.
        precision: ``int8`` (a scheme's static Q/DQ) or ``int8-dynamic``.
        recipe: The recipe the form lowers with.
    """

    name: str
    precision: str
    recipe: QuantRecipe

    def applies(self, layer: Layer) -> bool:
        """Whether ``layer`` can take this form (``int8-dynamic``: MatMul and Gemm with a weight)."""
        return self.precision != DYNAMIC or (layer.op_type in DYNAMIC_OP_TYPES and layer.weight is not None)

    def key(self) -> list:
        """What identifies the form's numbers in the cache."""
        return [self.name, self.precision, repr(self.recipe), self.recipe.dynamic_weight_max]


def form_errors(
    model: LoadedModel,
    forms: Sequence[Form],
    choices: LayerwiseChoices,
    calibration: Calibration,
    batches: Sequence[Mapping[str, object]],
    output_index: int,
    cache_dir: Path | None = None,
    allowance_s: float | None = None,
) -> dict[str, dict[str, float]]:
    """Per form, per layer: the model output's noise-to-signal with only that layer in the form.

    Each layer the layerwise calibration chose for is quantized with its choice (ranges, SmoothQuant factors for
    a static scheme); the layers it did not reach, and those a form does not apply to, have no entry.

    Args:
        model: The FP32 model and its layer table.
        forms: The forms to measure.
        choices: The layerwise calibration's choices.
        calibration: The run's activation statistics.
        batches: The calibration data.
        output_index: The scored output.
        cache_dir: Where the errors are cached (None: not cached).
        allowance_s: At most this many seconds (None: no limit); the layers not reached have no entry.
    """
    layers = [x for x in model.layers if x.name in choices.methods and x.name not in choices.defaulted]
    if not forms or not layers:
        return {}
    model_hash = model.hash
    path = None
    known: dict[str, dict[str, float]] = {}
    if cache_dir is not None:
        key = [model_hash, data_hash(batches), [layer.name for layer in layers], choices.methods]
        key += [[form.key() for form in forms], output_index, _CACHE_FORMAT]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"forms-{model_hash[:16]}-{digest}.json"
        if path.is_file():  # a run cut short by its allowance kept what it measured: measure the rest
            known = json.loads(path.read_text())
    todo = [x for x in layers if any(f.applies(x) and x.name not in known.get(f.name, {}) for f in forms)]
    if not todo:
        return {form.name: dict(known.get(form.name, {})) for form in forms}
    started = time.perf_counter()
    errors = _measure(model.proto, todo, forms, choices, calibration, batches, output_index, allowance_s)
    for form in forms:
        errors[form.name] = {**known.get(form.name, {}), **errors[form.name]}
    logger.info(
        "INT8 forms: %s measured on %d layers in %.1f s",
        ", ".join(f.name for f in forms),
        len(todo),
        time.perf_counter() - started,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(errors))
    return errors


def _measure(
    model: onnx.ModelProto,
    layers: Sequence[Layer],
    forms: Sequence[Form],
    choices: LayerwiseChoices,
    calibration: Calibration,
    batches: Sequence[Mapping[str, object]],
    output_index: int,
    allowance_s: float | None,
) -> dict[str, dict[str, float]]:
    """The errors of :func:`form_errors`, measured: one FP32 pass, then one probe session per layer."""
    output = model.graph.output[output_index].name
    cuts = {layer.name: probe.find_cut(model, layer, forms[0].recipe, output) for layer in layers}
    fetched = list(dict.fromkeys(name for cut in cuts.values() for name in cut.fetched))
    fp32 = probe.Fp32Run(output, *probe.fp32_pass(model, fetched, [], batches, output_index))  # type: ignore[arg-type]
    smoothing = choices.smoothing(model, layers)
    ranges = choices.layer_ranges(calibration, smoothing, layers)
    errors: dict[str, dict[str, float]] = {form.name: {} for form in forms}
    deadline = None if allowance_s is None else time.perf_counter() + allowance_s
    for layer in layers:
        if deadline is not None and time.perf_counter() > deadline:
            break
        own = [form for form in forms if form.applies(layer)]  # the caller left only layers with one to measure
        if not own:
            continue
        candidates = [
            (ranges[layer.name], None if form.precision == DYNAMIC else smoothing.get(layer.name)) for form in own
        ]
        measured = _layer_errors(
            model,
            layer,
            cuts[layer.name],
            own[0].recipe,
            candidates,
            fp32,
            exhaustive=True,
            forms=[(form.precision, form.recipe) for form in own],
        )
        for form, error in zip(own, measured, strict=True):
            errors[form.name][layer.name] = error
    return errors
