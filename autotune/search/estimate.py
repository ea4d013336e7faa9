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

from autotune.plan import CALIBRATION_KNOB, DYNAMIC, GRANULARITY_KNOB, INT8_SCHEME_KNOB, Plan
from autotune.run.trial import TrialResult
from autotune.search.prior import LayerPrior, PriorInputs, layer_prior

MIN_TRIALS = 8
"""Fewer trials than this give no estimate (features stay 0), unless there is a prior."""

PRIOR_WEIGHT = 2.0
"""How many trials' worth a per-layer prior counts (the ridge weight toward it)."""


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


def ridge_least_squares(
    design: np.ndarray, targets: np.ndarray, ridge: float | np.ndarray, prior: np.ndarray | None = None
) -> np.ndarray:
    """The additive terms ``x`` minimising ``|design @ x - targets|^2 + sum_j ridge_j (x_j - prior_j)^2``.

    Every additive fit uses it. Without ``prior`` the terms shrink toward 0; with one, toward it: with no rows
    the solution is the prior, with many the data's own least-squares fit.

    Args:
        design: One row per trial, one column per term.
        targets: One row per trial (one column per target, or a vector).
        ridge: L2 weight, one for all terms or one per term.
        prior: What each term shrinks toward (shaped as the solution); None: 0.
    """
    weights = np.broadcast_to(np.asarray(ridge, dtype=float), (design.shape[1],))
    gram = design.T @ design + np.diag(weights)
    right = design.T @ targets
    if prior is not None:
        right = right + (weights * prior.T).T
    return np.linalg.solve(gram, right)


def fit_additive(
    layer_names: Sequence[str],
    results: Iterable[TrialResult],
    ridge: float = 0.5,
    min_trials: int = MIN_TRIALS,
    prior: tuple[np.ndarray, np.ndarray | None] | None = None,
    prior_weight: float = PRIOR_WEIGHT,
) -> LayerEstimates | None:
    """Fits ``1 - 1/speedup`` and the accuracy drop as sums of per-layer terms.

    Args:
        layer_names: Every tunable layer, in table order.
        results: Trials; failed ones are skipped.
        ridge: L2 weight; shrinks layers the trials say little about towards 0.
        min_trials: Fewer usable trials give no estimate (without a prior).
        prior: Per-layer prior savings and drops (None drops: shrink those toward 0): terms shrink toward them
            with weight ``prior_weight`` instead, and no minimum of trials applies.
        prior_weight: How many trials' worth the prior counts per layer.

    Returns:
        The estimates (clipped at 0), or None with fewer than ``min_trials`` usable trials and no prior.
    """
    ok = [r for r in results if r.ok and r.speedup and r.accuracy_drop is not None]
    if prior is None and (not ok or len(ok) < min_trials):
        return None
    index = {name: i for i, name in enumerate(layer_names)}
    design = np.zeros((len(ok), len(layer_names)))
    for row, result in enumerate(ok):
        for name, precision in result.plan.precisions:
            if precision != "fp32" and name in index:
                design[row, index[name]] = 1.0
    targets = np.array([[1.0 - 1.0 / r.speedup, r.accuracy_drop] for r in ok]).reshape(len(ok), 2)
    if prior is None:
        solution = ridge_least_squares(design, targets, ridge)
    else:
        saving, drop = prior
        drop_prior = np.zeros(len(layer_names)) if drop is None else drop
        columns = [ridge_least_squares(design, targets[:, 0], prior_weight, saving)]
        drop_weight = prior_weight if drop is not None else ridge
        columns.append(ridge_least_squares(design, targets[:, 1], drop_weight, drop_prior))
        solution = np.stack(columns, axis=1)
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


def _fit(
    rows: Sequence[list[tuple[str, str, Any]]],
    targets: np.ndarray,
    ridge: float,
    prior: Mapping[tuple[str, str, Any], float] | None = None,
    prior_weight: float = PRIOR_WEIGHT,
) -> _Additive:
    """Ridge terms per column; columns in ``prior`` shrink toward it (and exist even if no row has them)."""
    columns: dict[tuple[str, str, Any], int] = {key: i for i, key in enumerate(prior or {})}
    for keys in rows:
        for key in keys:
            columns.setdefault(key, len(columns))
    design = np.zeros((len(rows), max(1, len(columns))))
    for row, keys in enumerate(rows):
        for key in keys:
            design[row, columns[key]] = 1.0
    if not prior:
        return _Additive(columns, ridge_least_squares(design, targets, ridge))
    weights = np.full(design.shape[1], ridge)
    centre = np.zeros(design.shape[1])
    for key, value in prior.items():
        weights[columns[key]], centre[columns[key]] = prior_weight, value
    return _Additive(columns, ridge_least_squares(design, targets, weights, centre))


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
    prior: LayerPrior | None = None,
    layer_names: Sequence[str] = (),
    prior_weight: float = PRIOR_WEIGHT,
    saving_prior_weight: float | None = None,
) -> Surrogate | None:
    """Fits :class:`Surrogate` by ridge least squares over the successful trials.

    Args:
        results: Real trials; failed ones are skipped.
        knob_defaults: Each knob's default value (no term: the FP32 reference uses it).
        accuracy_knobs: Knobs that change the numbers; each of their settings gets its own drop terms.
        ridge: L2 weight; shrinks terms the trials say little about towards 0.
        prior: Per-layer prior savings and drops of INT8 (:mod:`autotune.search.prior`): their terms shrink
            toward it, a setting with prior drops has its own drop terms from the first trial on, and the model
            exists before any trial.
        layer_names: The layers ``prior`` holds values for, in its order (needed with ``prior``).
        prior_weight: How many trials' worth the prior counts per term.
        saving_prior_weight: The same for the saving terms alone (default ``prior_weight``).

    Returns:
        The model, or None with fewer than ``MIN_TRIALS`` usable trials and no prior.
    """
    ok = [r for r in results if r.ok and r.speedup and r.accuracy_drop is not None]
    if prior is None and len(ok) < MIN_TRIALS:
        return None
    rows = [_plan_columns(r.plan, knob_defaults) for r in ok]
    saving_prior = drop_priors = None
    if prior is not None:
        # int8-dynamic starts from static INT8's saving until a plan with dynamic layers has measured its own
        saving_prior = {
            ("layer", name, precision): float(v)
            for precision in ("int8", DYNAMIC)
            for name, v in zip(layer_names, prior.saving_of(precision), strict=True)
        }
        drop_priors = {}
    saving_weight = prior_weight if saving_prior_weight is None else saving_prior_weight
    saving = _fit(rows, np.array([1.0 - 1.0 / r.speedup for r in ok]), ridge, saving_prior, saving_weight)
    drop_targets = np.array([r.accuracy_drop for r in ok])
    settings = _prior_settings(prior, knob_defaults, accuracy_knobs)
    for index, result in enumerate(ok):
        settings.setdefault(tuple(result.plan.knob(name) for name in accuracy_knobs), []).append(index)
    drops = {}
    for setting, members in settings.items():
        named = dict(zip(accuracy_knobs, setting, strict=True))
        terms = _setting_prior(prior, layer_names, named, knob_defaults.get(INT8_SCHEME_KNOB))
        if drop_priors is not None and terms:
            drop_priors[setting] = terms
        if len(members) >= MIN_TRIALS or terms:
            member_rows = [[k for k in rows[i] if k[0] == "layer"] for i in members]
            drops[setting] = _fit(member_rows, drop_targets[members], ridge, terms, prior_weight)
    default = tuple(knob_defaults.get(name) for name in accuracy_knobs)
    pooled = _fit(rows, drop_targets, ridge, (drop_priors or {}).get(default), prior_weight)
    return Surrogate(saving, drops, pooled, tuple(accuracy_knobs), dict(knob_defaults), len(ok))


def _prior_settings(
    prior: LayerPrior | None, knob_defaults: Mapping[str, Any], accuracy_knobs: Sequence[str]
) -> dict[tuple[Any, ...], list[int]]:
    """The settings of the accuracy knobs that have drop terms before any trial (none without a prior).

    The defaults', and where the prior holds other INT8 schemes' per-layer drops (``LayerPrior.form_drops``),
    each such scheme's with the other knobs at their defaults.
    """
    if prior is None:
        return {}
    settings: dict[tuple[Any, ...], list[int]] = {tuple(knob_defaults.get(name) for name in accuracy_knobs): []}
    for form in prior.form_drops:
        if form != DYNAMIC and INT8_SCHEME_KNOB in accuracy_knobs:
            other = {**knob_defaults, INT8_SCHEME_KNOB: form}
            settings[tuple(other.get(name) for name in accuracy_knobs)] = []
    return settings


def _setting_prior(
    prior: LayerPrior | None, layer_names: Sequence[str], setting: Mapping[str, Any], default_scheme: Any = None
) -> dict[tuple[str, str, Any], float] | None:
    """The prior INT8 (and ``int8-dynamic``) drop terms of one setting of the accuracy knobs, or None.

    A setting of another INT8 scheme than ``default_scheme`` takes that scheme's per-layer drops, where measured.
    """
    if prior is None:
        return None
    scheme = setting.get(INT8_SCHEME_KNOB)
    other_scheme = scheme if scheme != default_scheme else None
    drop = prior.drop(setting.get(CALIBRATION_KNOB), setting.get(GRANULARITY_KNOB), other_scheme)
    if drop is None:
        return None
    terms = {("layer", name, "int8"): float(v) for name, v in zip(layer_names, drop, strict=True)}
    dynamic = prior.dynamic_drop(setting.get(GRANULARITY_KNOB))
    if dynamic is not None:
        terms.update({("layer", name, DYNAMIC): float(v) for name, v in zip(layer_names, dynamic, strict=True)})
    return terms


ACCURACY_KNOBS = (CALIBRATION_KNOB, GRANULARITY_KNOB, INT8_SCHEME_KNOB)
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
        prior_inputs: Single-layer errors and runtime shares: every fit shrinks toward the priors they give
            (:func:`autotune.search.prior.layer_prior`, rescaled on the trials so far); None: toward 0.
        prior_weight: How many trials' worth the prior counts per term.
    """

    def __init__(
        self,
        trials: Callable[[], Sequence[TrialResult]],
        layer_names: Sequence[str],
        knob_defaults: Mapping[str, Any],
        every: int = 5,
        count: Callable[[], int] | None = None,
        prior_inputs: PriorInputs | None = None,
        prior_weight: float = PRIOR_WEIGHT,
    ):
        self.trials = trials
        self.count = count or (lambda: len(trials()))
        self.layer_names = list(layer_names)
        self.knob_defaults = dict(knob_defaults)
        self.every = every
        self.prior_inputs = prior_inputs
        self.prior_weight = prior_weight
        self._fitted_at = -every
        self._estimates: LayerEstimates | None = None
        self._measured: tuple[int, frozenset[str]] | None = None

    def prior(self, trials: Sequence[TrialResult] | None = None) -> LayerPrior | None:
        """The per-layer priors, scaled on ``trials`` (default: all so far); None without prior inputs."""
        if self.prior_inputs is None:
            return None
        return layer_prior(self.prior_inputs, self.trials() if trials is None else trials, self.knob_defaults)

    def estimates(self) -> LayerEstimates | None:
        """The per-layer estimates, or None while there are too few trials (and no prior)."""
        if self.count() - self._fitted_at >= self.every:
            trials = self.trials()
            dominant = dominant_setting(trials, ACCURACY_KNOBS)
            prior = self.prior(trials)
            layer_prior_terms = None
            if prior is not None:
                plan = dominant[0].plan if dominant else None
                setting = {
                    name: plan.knob(name, self.knob_defaults.get(name)) if plan else self.knob_defaults.get(name)
                    for name in ACCURACY_KNOBS
                }
                drop = prior.drop(setting[CALIBRATION_KNOB], setting[GRANULARITY_KNOB])
                layer_prior_terms = (prior.saving, drop)
            self._estimates = fit_additive(
                self.layer_names, dominant, prior=layer_prior_terms, prior_weight=self.prior_weight
            )
            self._fitted_at = len(trials)
        return self._estimates

    def measured(self) -> frozenset[str]:
        """Hashes of the plans measured so far, read again only when a trial was added (every step masks by them)."""
        count = self.count()
        if self._measured is None or self._measured[0] != count:
            self._measured = (count, frozenset(trial.plan_hash for trial in self.trials()))
        return self._measured[1]

    def surrogate(self) -> Surrogate | None:
        """The additive model of whole plans over every trial so far, or None while there are too few."""
        trials = self.trials()
        return fit_surrogate(
            trials,
            self.knob_defaults,
            ACCURACY_KNOBS,
            prior=self.prior(trials),
            layer_names=self.layer_names,
            prior_weight=self.prior_weight,
        )
