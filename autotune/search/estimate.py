"""Per-layer latency savings and accuracy drops, fitted from the trials so far. Pure.

Per-layer savings and drops are close to additive (measurements-cpu.md: halves add to 94-98% of the whole), so
a ridge least-squares fit over the measured plans estimates what each layer costs and saves. The agent sees
these estimates as features: what quantizing this layer is likely to save and to cost, and how much of the
accuracy budget the plan has used so far.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

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


def fit_additive(
    layer_names: Sequence[str], results: Iterable[TrialResult], ridge: float = 0.5
) -> LayerEstimates | None:
    """Fits ``1 - 1/speedup`` and the accuracy drop as sums of per-layer terms.

    Args:
        layer_names: Every tunable layer, in table order.
        results: Trials; failed ones are skipped.
        ridge: L2 weight; shrinks layers the trials say little about towards 0.

    Returns:
        The estimates (clipped at 0), or None with fewer than ``MIN_TRIALS`` usable trials.
    """
    ok = [r for r in results if r.ok and r.speedup and r.accuracy_drop is not None]
    if len(ok) < MIN_TRIALS:
        return None
    index = {name: i for i, name in enumerate(layer_names)}
    design = np.zeros((len(ok), len(layer_names)))
    for row, result in enumerate(ok):
        for name, precision in result.plan.precisions:
            if precision != "fp32" and name in index:
                design[row, index[name]] = 1.0
    targets = np.array([[1.0 - 1.0 / r.speedup, r.accuracy_drop] for r in ok])
    gram = design.T @ design + ridge * np.eye(len(layer_names))
    solution = np.linalg.solve(gram, design.T @ targets)
    return LayerEstimates(np.clip(solution[:, 0], 0, None), np.clip(solution[:, 1], 0, None), len(ok))
