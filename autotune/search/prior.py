"""What is known of every layer before the first build: prior savings and drops. Pure.

The layerwise calibration already quantizes each layer alone and measures the model output's error
(noise-to-signal power against FP32, :mod:`autotune.quant.layerwise`), and the FP32 profile gives each layer's
share of the runtime. Both are close to what the additive model of the trials estimates per layer, up to one scale
each: the configured metric's drop per unit of output error, and the fraction of a layer's time that INT8 saves.
Each scale is a one-parameter least-squares fit through the origin over the trials so far (the all-INT8 plan,
built first by every search, fixes both), so every real trial corrects the mapping; before any trial a default
stands in (:data:`DEFAULT_DROP_PER_ERROR`, :data:`DEFAULT_INT8_SAVING`).

The additive fit (:mod:`autotune.search.estimate`) then shrinks toward these priors instead of toward zero: with
no trials it returns the prior, with many the data's own fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autotune.plan import DYNAMIC, INT8_SCHEME_KNOB
from autotune.run.trial import TrialResult

LAYERWISE = "layerwise"
"""The calibration knob value whose per-layer errors are those of each layer's chosen method (as in quant)."""

DEFAULT_DROP_PER_ERROR = {"cosine": 0.5}
"""Metric drop per unit of output noise-to-signal power before any trial. For small noise, ``1 - cos(y, y + n)`` is
about ``|n_perp|^2 / (2 |y|^2)``: half the noise-to-signal power. Other metrics have no default: their scale comes
from the first trial."""

DEFAULT_INT8_SAVING = 0.5
"""Fraction of a layer's FP32 time INT8 saves, before any trial (the all-INT8 build replaces it)."""


@dataclass(frozen=True)
class PriorInputs:
    """What a run knows per layer before building anything.

    Attributes:
        layer_names: Every tunable layer, in table order.
        runtime_shares: Per layer, its share of FP32 runtime from the profile (None where not profiled).
        errors: Per layer, ``{calibration method: single-layer output error}`` (layerwise calibration).
        chosen: Per layer, the method the layerwise calibration chose.
        metric: The configured metric's name (picks the default error-to-drop scale).
        default_granularity: The weight granularity the single-layer errors were measured with.
        forms: Per INT8 form besides the default scheme (another scheme such as ``u8s7``, ``int8-dynamic``), each
            layer's single-layer error with its layerwise choice (``autotune.quant.forms``).
    """

    layer_names: tuple[str, ...]
    runtime_shares: tuple[float | None, ...]
    errors: Mapping[str, Mapping[str, float]]
    chosen: Mapping[str, str]
    metric: str
    default_granularity: str | None = "per_channel"
    forms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def share_map(self) -> dict[str, float]:
        """Layer name to its share of FP32 runtime, for the layers the profile timed (what ranks finalists)."""
        pairs = zip(self.layer_names, self.runtime_shares, strict=True)
        return {name: share for name, share in pairs if share is not None}

    def layer_errors(self, calibration: str) -> np.ndarray | None:
        """Per layer, the single-layer output error of a calibration setting; None where none was measured."""
        if not self.errors:
            return None
        values = []
        for name in self.layer_names:
            by_method = self.errors.get(name)
            if by_method is None:
                values.append(0.0)  # a layer the calibration never quantized alone: no INT8 option, no term
                continue
            method = self.chosen.get(name) if calibration == LAYERWISE else calibration
            if method not in by_method:
                return None
            values.append(float(by_method[method]))
        return np.array(values)

    def form_errors(self, form: str) -> np.ndarray | None:
        """Per layer, the single-layer error in ``form`` (:attr:`forms`); None where the form was not measured.

        A layer the form was not measured on (the allowance ran out first) gets its layerwise error in the
        default scheme times the form's ratio to it over the layers measured in both; 0 without one.
        """
        measured = self.forms.get(form)
        if not measured:
            return None
        base = self.layer_errors(LAYERWISE)
        both = [i for i, name in enumerate(self.layer_names) if name in measured]
        ratio = 0.0
        if base is not None and both and float(base[both].sum()) > 0:
            ratio = sum(float(measured[self.layer_names[i]]) for i in both) / float(base[both].sum())
        values = [
            float(measured[name]) if name in measured else (0.0 if base is None else ratio * float(base[index]))
            for index, name in enumerate(self.layer_names)
        ]
        return np.array(values)

    def to_dict(self) -> dict:
        """A JSON-ready dict (what a run keeps in its store's meta, for the replay)."""
        return {
            "layer_names": list(self.layer_names),
            "runtime_shares": list(self.runtime_shares),
            "errors": {k: dict(v) for k, v in self.errors.items()},
            "chosen": dict(self.chosen),
            "metric": self.metric,
            "default_granularity": self.default_granularity,
            "forms": {k: dict(v) for k, v in self.forms.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> PriorInputs:
        """Reads :meth:`to_dict` output."""
        return cls(
            tuple(data["layer_names"]),
            tuple(data["runtime_shares"]),
            {str(k): {str(m): float(e) for m, e in v.items()} for k, v in data["errors"].items()},
            {str(k): str(v) for k, v in data["chosen"].items()},
            str(data["metric"]),
            data.get("default_granularity", "per_channel"),
            {str(f): {str(k): float(e) for k, e in v.items()} for f, v in (data.get("forms") or {}).items()},
        )


@dataclass(frozen=True)
class LayerPrior:
    """Per-layer prior savings and drops, for the trials so far.

    Attributes:
        saving: Per layer, the fraction of FP32 latency saved when it alone is INT8.
        drops: Per calibration method with measured single-layer errors, the per-layer drop in metric units
            (weights at the default granularity).
        drop_per_error: The fitted metric drop per unit of output error (None: no trial and no default).
        saving_per_share: The fitted fraction of a layer's FP32 time INT8 saves.
        granularity: The weight granularity ``drops`` hold for (None: the space has no such knob).
        form_drops: Per INT8 form besides the default scheme (:attr:`PriorInputs.forms`), the per-layer drop in it
            with the layerwise choices.
        dynamic_saving: Per layer, the fraction of FP32 latency saved when it alone is ``int8-dynamic``, from its own
            scale where plans with dynamic layers were measured; None: static INT8's (``saving``).
    """

    saving: np.ndarray
    drops: Mapping[str, np.ndarray]
    drop_per_error: float | None
    saving_per_share: float
    granularity: str | None
    form_drops: Mapping[str, np.ndarray] = field(default_factory=dict)
    dynamic_saving: np.ndarray | None = None

    def saving_of(self, precision: str) -> np.ndarray:
        """Per layer, the prior saving of ``precision`` (``int8`` or ``int8-dynamic``)."""
        return self.dynamic_saving if precision == DYNAMIC and self.dynamic_saving is not None else self.saving

    def drop(self, calibration: object, granularity: object, scheme: object = None) -> np.ndarray | None:
        """Per-layer prior drops of one setting of the accuracy knobs, or None where nothing was measured.

        ``scheme``: the plan's INT8 scheme where it is not the default (a form with measured errors, layerwise
        calibration only); None: the default scheme's.
        """
        if granularity != self.granularity:
            return None
        if scheme is not None:
            return self.form_drops.get(str(scheme)) if str(calibration) == LAYERWISE else None
        return self.drops.get(str(calibration))

    def dynamic_drop(self, granularity: object) -> np.ndarray | None:
        """Per-layer prior drops of ``int8-dynamic`` (no calibration: any method's setting), or None."""
        return self.form_drops.get(DYNAMIC) if granularity == self.granularity else None


def _slope_through_origin(features: Sequence[float], targets: Sequence[float]) -> float | None:
    """``k`` minimising ``sum (target - k feature)^2``; None when no feature is positive."""
    x, y = np.asarray(features, dtype=float), np.asarray(targets, dtype=float)
    denominator = float(x @ x)
    return float(x @ y) / denominator if denominator > 0 else None


def layer_prior(
    inputs: PriorInputs,
    results: Iterable[TrialResult],
    knob_defaults: Mapping[str, object],
    calibration_knob: str = "calibration",
    granularity_knob: str = "weight_granularity",
) -> LayerPrior:
    """The per-layer priors, with both scales fitted on the successful trials so far.

    Args:
        inputs: Single-layer errors and runtime shares.
        results: Trials so far; failed ones are skipped.
        knob_defaults: Each knob's default (a plan without a calibration knob uses the default).
        calibration_knob: The knob naming the calibration method.
        granularity_knob: The knob naming the weight granularity.

    Returns:
        The prior. Both scales are INT8's, so they are fitted only on plans whose layers are all INT8 or FP32
        (on a GPU an FP16 layer saves far more time than an INT8 one, which may cost time). The drop scale is
        fitted on those at the errors' granularity whose calibration has measured errors; the saving scale on
        those at the default of every knob but the calibration, where there are such plans (a knob such as
        ``allow_spinning`` off on ONNX Runtime can cost more time than INT8 saves), and it is negative where INT8
        costs time.
    """
    shares = np.array([share or 0.0 for share in inputs.runtime_shares])
    points = _FitPoints(inputs, shares)
    for result in results:
        points.add(result, knob_defaults, calibration_knob, granularity_knob)
    drop_scale = _slope_through_origin(points.error_features, points.drop_targets)
    if drop_scale is None:
        drop_scale = DEFAULT_DROP_PER_ERROR.get(inputs.metric)
    # Plans at the default knobs first: another knob's own cost would pass for INT8's (see above).
    saving_scale = _slope_through_origin(*points.savings[True])
    if saving_scale is None:
        saving_scale = _slope_through_origin(*points.savings[False])
    saving_scale = DEFAULT_INT8_SAVING if saving_scale is None else float(np.clip(saving_scale, -1.0, 1.0))
    # int8-dynamic's own scale, on what its layers saved beyond the plan's static INT8 layers: where the default
    # scheme runs on slow kernels (u8u8 on AVX2) a dynamic layer saves about twice what a static one does.
    dynamic_scale = _slope_through_origin(
        [dynamic for dynamic, _, _ in points.dynamic_savings],
        [saved - saving_scale * static for _, static, saved in points.dynamic_savings],
    )
    dynamic_saving = None if dynamic_scale is None else float(np.clip(dynamic_scale, -1.0, 1.0)) * shares
    drops = {} if drop_scale is None else _prior_drops(inputs, drop_scale, points.errors_by_method)
    form_drops = {}
    for form in inputs.forms if drop_scale is not None else ():
        errors = inputs.form_errors(form)
        if errors is not None:
            form_drops[form] = max(drop_scale, 0.0) * errors  # type: ignore[operator]
    return LayerPrior(
        saving_scale * shares, drops, drop_scale, saving_scale, inputs.default_granularity, form_drops, dynamic_saving
    )


class _FitPoints:
    """The points the two scales are fitted on, gathered trial by trial.

    Attributes:
        savings: By whether the plan had every other knob at its default: the INT8 runtime share of its
            quantized layers, and the time it saved (``1 - 1 / speedup``).
        dynamic_savings: Of each plan with ``int8-dynamic`` layers and every other knob at its default: the runtime
            share of its dynamic layers, that of its static INT8 layers, and the time it saved.
        error_features: The summed single-layer errors of a plan's INT8 layers.
        drop_targets: The plan's accuracy drop, beside its error feature.
        errors_by_method: The single-layer errors of each calibration method met so far.
    """

    def __init__(self, inputs: PriorInputs, shares: np.ndarray):
        self._inputs = inputs
        self._shares = shares
        self._index = {name: i for i, name in enumerate(inputs.layer_names)}
        self.savings: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
        self.dynamic_savings: list[tuple[float, float, float]] = []
        self.error_features: list[float] = []
        self.drop_targets: list[float] = []
        self.errors_by_method: dict[str, np.ndarray] = {}

    def add(
        self, result: TrialResult, knob_defaults: Mapping[str, object], calibration_knob: str, granularity_knob: str
    ) -> None:
        """Adds one trial's points; failed trials and plans with other precisions than INT8 and FP32 add none.

        Plans with ``int8-dynamic`` layers add no point to static INT8's saving scale but one to the dynamic form's
        (at the default knobs), and a drop point only where the dynamic form's errors were measured; a plan of
        another INT8 scheme adds its drop point with that scheme's errors (``PriorInputs.forms``).
        """
        if not result.ok or not result.speedup or result.accuracy_drop is None:
            return
        if any(p not in ("fp32", "int8", DYNAMIC) for _, p in result.plan.precisions):
            return
        quantized = [self._index[n] for n, p in result.plan.precisions if p == "int8" and n in self._index]
        dynamic = [self._index[n] for n, p in result.plan.precisions if p == DYNAMIC and n in self._index]
        default_knobs = all(
            value == knob_defaults.get(name) for name, value in result.plan.knobs if name != calibration_knob
        )
        saved = 1.0 - 1.0 / result.speedup
        if not dynamic:
            features, targets = self.savings[default_knobs]
            features.append(float(self._shares[quantized].sum()))
            targets.append(saved)
        elif default_knobs:
            shares = float(self._shares[dynamic].sum()), float(self._shares[quantized].sum())
            self.dynamic_savings.append((*shares, saved))
        if result.plan.knob(granularity_knob, knob_defaults.get(granularity_knob)) != self._inputs.default_granularity:
            return
        errors = self._errors(
            result, knob_defaults, str(result.plan.knob(calibration_knob, knob_defaults.get(calibration_knob)))
        )
        dynamic_errors = self._inputs.form_errors(DYNAMIC) if dynamic else None
        if errors is None or (dynamic and dynamic_errors is None):
            return
        feature = float(errors[quantized].sum()) + (
            float(dynamic_errors[dynamic].sum()) if dynamic_errors is not None else 0.0
        )
        self.error_features.append(feature)
        self.drop_targets.append(result.accuracy_drop)

    def _errors(self, result: TrialResult, knob_defaults: Mapping[str, object], method: str) -> np.ndarray | None:
        """The single-layer errors of the plan's INT8 layers: its calibration method's, or its scheme's form's."""
        scheme = result.plan.knob(INT8_SCHEME_KNOB, knob_defaults.get(INT8_SCHEME_KNOB))
        if scheme != knob_defaults.get(INT8_SCHEME_KNOB):
            return self._inputs.form_errors(str(scheme)) if method == LAYERWISE else None
        if method not in self.errors_by_method:
            layer_errors = self._inputs.layer_errors(method)
            if layer_errors is None:
                return None
            self.errors_by_method[method] = layer_errors
        return self.errors_by_method[method]


def _prior_drops(
    inputs: PriorInputs, drop_scale: float, errors_by_method: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Per calibration method with measured errors (and ``layerwise``), each layer's prior drop in INT8."""
    drops: dict[str, np.ndarray] = {}
    methods = {m for by_method in inputs.errors.values() for m in by_method} | {LAYERWISE}
    for method in sorted(methods):
        layer_errors = errors_by_method.get(method)
        if layer_errors is None:
            layer_errors = inputs.layer_errors(method)
        if layer_errors is not None:
            drops[method] = max(drop_scale, 0.0) * layer_errors
    return drops


def unsure_groups(
    groups: Sequence[Sequence[int]], drop: np.ndarray | None, budget: float, resolution: float = 1.0
) -> list[int]:
    """The decision groups whose prior drop leaves the choice open: the ones worth a probe build.

    A group whose prior drop is below ``budget / len(groups)`` costs too little to matter even if quantized with
    every other; one whose drop exceeds twice the budget breaks it alone even if the prior is off by 2x. Only the
    groups between are probed (all of them without a drop prior).

    Args:
        groups: The search space's decision groups (layer indexes).
        drop: Per-layer prior drops, or None.
        budget: The accuracy drop the search aims at.
        resolution: Scales the "too little to matter" bound.

    Returns:
        Indexes into ``groups``.
    """
    if drop is None or budget <= 0:
        return list(range(len(groups)))
    low, high = resolution * budget / max(1, len(groups)), 2.0 * budget
    group_drops = [float(drop[list(group)].sum()) for group in groups]
    return [g for g, value in enumerate(group_drops) if low <= value <= high]
