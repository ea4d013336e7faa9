"""Per-layer latency savings and accuracy drops, fitted from the trials so far. Pure.

Per-layer savings and drops are close to additive, so a ridge least-squares fit over the measured plans
estimates what each layer costs and saves. The agent sees these estimates as features: what quantizing this layer
is likely to save and to cost, and how much of the accuracy budget the plan has used so far.

The same additivity makes a cheap model of whole plans (:class:`Surrogate`, with a term per layer precision and
per knob value): between real builds the agent rehearses on it (Dyna-style imagined episodes), so a few dozen
builds teach it what would otherwise take thousands. Real builds keep correcting the model; nothing it predicts
is stored or reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, Plan
from autotune.trial import TrialResult

MIN_TRIALS = 8
"""Fewer trials than this give no estimate (features stay 0)."""


@dataclass(frozen=True)
class LayerEstimates:
    """Additive per-layer estimates.

    Attributes:
        saving: Fraction of FP32 latency saved when the layer leaves FP32, per layer.
        drop: Accuracy drop when the layer leaves FP32, per layer, in metric units.
        trials: Trials the fit used.
    """

    saving: np.ndarray
    drop: np.ndarray
    trials: int


def ridge_least_squares(design: np.ndarray, targets: np.ndarray, ridge: float) -> np.ndarray:
    """The additive terms ``x`` minimising ``|design @ x - targets|^2 + ridge |x|^2``: every additive fit uses it."""
    gram = design.T @ design + ridge * np.eye(design.shape[1])
    return np.linalg.solve(gram, design.T @ targets)


def fit_additive(
    layer_names: Sequence[str], results: Iterable[TrialResult], ridge: float = 0.5, min_trials: int = MIN_TRIALS
) -> LayerEstimates | None:
    """Fits ``1 - 1/speedup`` and the accuracy drop as sums of per-layer terms.

    Args:
        layer_names: Every tunable layer, in table order.
        results: Trials; failed ones are skipped.
        ridge: L2 weight; shrinks layers the trials say little about towards 0.
        min_trials: Fewer usable trials give no estimate.

    Returns:
        The estimates (clipped at 0), or None with fewer than ``min_trials`` usable trials.
    """
    ok = [r for r in results if r.ok and r.speedup and r.accuracy_drop is not None]
    if not ok or len(ok) < min_trials:
        return None
    index = {name: i for i, name in enumerate(layer_names)}
    design = np.zeros((len(ok), len(layer_names)))
    for row, result in enumerate(ok):
        for name, precision in result.plan.precisions:
            if precision != "fp32" and name in index:
                design[row, index[name]] = 1.0
    targets = np.array([[1.0 - 1.0 / r.speedup, r.accuracy_drop] for r in ok])
    solution = ridge_least_squares(design, targets, ridge)
    return LayerEstimates(np.clip(solution[:, 0], 0, None), np.clip(solution[:, 1], 0, None), len(ok))


def dominant_setting(results: Iterable[TrialResult], accuracy_knobs: Sequence[str]) -> list[TrialResult]:
    """The trials of the most tried setting of ``accuracy_knobs``: per-layer drops add up only within one setting."""
    groups: dict[tuple[Any, ...], list[TrialResult]] = {}
    for result in results:
        groups.setdefault(tuple(result.plan.knob(name) for name in accuracy_knobs), []).append(result)
    return max(groups.values(), key=len, default=[])


@dataclass(frozen=True)
class _Additive:
    """Ridge least-squares terms, one per column."""

    columns: dict[tuple[str, str, Any], int]
    terms: np.ndarray

    def total(self, keys: Iterable[tuple[str, str, Any]]) -> float:
        active = [i for key in keys if (i := self.columns.get(key)) is not None]
        return float(self.terms[active].sum()) if active else 0.0


def _fit(rows: Sequence[list[tuple[str, str, Any]]], targets: np.ndarray, ridge: float) -> _Additive:
    columns: dict[tuple[str, str, Any], int] = {}
    for keys in rows:
        for key in keys:
            columns.setdefault(key, len(columns))
    design = np.zeros((len(rows), max(1, len(columns))))
    for row, keys in enumerate(rows):
        for key in keys:
            design[row, columns[key]] = 1.0
    return _Additive(columns, ridge_least_squares(design, targets, ridge))


@dataclass(frozen=True)
class Surrogate:
    """An additive model of a whole plan, fitted from real trials: what the agent rehearses on between builds.

    The latency saving ``1 - 1/speedup`` has one term per (layer, precision other than FP32) and per knob value
    other than the knob's default. The accuracy drop is additive over layers only within one setting of the knobs
    that change the numbers (calibration method, weight granularity): per-tensor scales or another calibration
    scale every layer's error, which no additive knob term can express (on MiniLM a pooled fit missed the drops by
    about 0.0013, a per-setting fit by 0.00006). So the drop has one set of layer terms per setting, and a pooled
    fit (with knob terms) for settings with too few trials.

    Attributes:
        saving: The latency-saving model.
        drops: Accuracy-drop model per setting of ``accuracy_knobs``.
        pooled_drop: Accuracy-drop model over all trials, with knob terms.
        accuracy_knobs: Knobs whose values select the drop model.
        trials: Trials the fit used.
    """

    saving: _Additive
    drops: dict[tuple[Any, ...], _Additive]
    pooled_drop: _Additive
    accuracy_knobs: tuple[str, ...]
    knob_defaults: Mapping[str, Any]
    trials: int

    def predict(self, plan: Plan) -> tuple[float, float]:
        """``(speedup, accuracy_drop)`` the model expects of ``plan``; terms it has never seen count 0."""
        keys = _plan_columns(plan, self.knob_defaults)
        saving = float(np.clip(self.saving.total(keys), -MAX_SAVING, MAX_SAVING))
        setting = tuple(plan.knob(name) for name in self.accuracy_knobs)
        drop_model = self.drops.get(setting)
        if drop_model is not None:
            drop = drop_model.total(k for k in keys if k[0] == "layer")
        else:
            drop = self.pooled_drop.total(keys)
        return 1.0 / (1.0 - saving), max(0.0, drop)

    def result(self, plan: Plan) -> TrialResult:
        """A made-up, never stored result carrying the predicted speedup and drop (the reward reads only these)."""
        speedup, drop = self.predict(plan)
        return TrialResult(plan=plan, speedup=speedup, accuracy_drop=drop, split="surrogate", from_store=True)


MAX_SAVING = 0.95
"""A plan can be predicted at most 20x faster (or slower) than FP32: keeps the log-ratio reward finite."""


def _plan_columns(plan: Plan, knob_defaults: Mapping[str, Any] | None = None) -> list[tuple[str, str, Any]]:
    keys: list[tuple[str, str, Any]] = [("layer", name, p) for name, p in plan.precisions if p != "fp32"]
    for name, value in plan.knobs:
        if knob_defaults is None or knob_defaults.get(name) != value:
            keys.append(("knob", name, value))
    return keys


def fit_surrogate(
    results: Iterable[TrialResult],
    knob_defaults: Mapping[str, Any],
    accuracy_knobs: Sequence[str] = ("calibration", "weight_granularity"),
    ridge: float = 0.5,
) -> Surrogate | None:
    """Fits :class:`Surrogate` by ridge least squares over the successful trials.

    Args:
        results: Real trials; failed ones are skipped.
        knob_defaults: Each knob's default value (no term: the FP32 reference uses it).
        accuracy_knobs: Knobs that change the numbers; each of their settings gets its own drop terms.
        ridge: L2 weight; shrinks terms the trials say little about towards 0.

    Returns:
        The model, or None with fewer than ``MIN_TRIALS`` usable trials.
    """
    ok = [r for r in results if r.ok and r.speedup and r.accuracy_drop is not None]
    if len(ok) < MIN_TRIALS:
        return None
    rows = [_plan_columns(r.plan, knob_defaults) for r in ok]
    saving = _fit(rows, np.array([1.0 - 1.0 / r.speedup for r in ok]), ridge)
    drop_targets = np.array([r.accuracy_drop for r in ok])
    settings: dict[tuple[Any, ...], list[int]] = {}
    for index, result in enumerate(ok):
        settings.setdefault(tuple(result.plan.knob(name) for name in accuracy_knobs), []).append(index)
    drops = {
        setting: _fit([[k for k in rows[i] if k[0] == "layer"] for i in members], drop_targets[members], ridge)
        for setting, members in settings.items()
        if len(members) >= MIN_TRIALS
    }
    pooled = _fit(rows, drop_targets, ridge)
    return Surrogate(saving, drops, pooled, tuple(accuracy_knobs), dict(knob_defaults), len(ok))


ACCURACY_KNOBS = (CALIBRATION_KNOB, GRANULARITY_KNOB)
"""Knobs that change a plan's numbers: per-layer drops add up only within one setting of them."""


class RefittedEstimates:
    """Per-layer estimates and the surrogate of a growing list of trials, refitted every ``every`` new trials.

    What the agent reads between builds, in a tuning run (trials from the store) and in a replay alike.

    Args:
        trials: The trials so far (called at every refit).
        layer_names: Every tunable layer, in table order.
        knob_defaults: Each knob's default value (no surrogate term).
        every: Refit after this many new trials.
        count: How many trials there are, without reading them (a store's row count); default ``len(trials())``.
            The env asks for the estimates every episode: only a refit should read every trial.
    """

    def __init__(
        self,
        trials: Callable[[], Sequence[TrialResult]],
        layer_names: Sequence[str],
        knob_defaults: Mapping[str, Any],
        every: int = 5,
        count: Callable[[], int] | None = None,
    ):
        self.trials = trials
        self.count = count or (lambda: len(trials()))
        self.layer_names = list(layer_names)
        self.knob_defaults = dict(knob_defaults)
        self.every = every
        self._fitted_at = -every
        self._estimates: LayerEstimates | None = None

    def estimates(self) -> LayerEstimates | None:
        """The per-layer estimates, or None while there are too few trials."""
        if self.count() - self._fitted_at >= self.every:
            trials = self.trials()
            self._estimates = fit_additive(self.layer_names, dominant_setting(trials, ACCURACY_KNOBS))
            self._fitted_at = len(trials)
        return self._estimates

    def measured(self) -> set[str]:
        """Hashes of the plans measured so far."""
        return {trial.plan_hash for trial in self.trials()}

    def surrogate(self) -> Surrogate | None:
        """The additive model of whole plans over every trial so far, or None while there are too few."""
        return fit_surrogate(self.trials(), self.knob_defaults, ACCURACY_KNOBS)
