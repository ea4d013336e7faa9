"""Accuracy: task metrics against labels, fidelity metrics against the FP32 outputs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autotune.model import resolve_callable

SNR_CAP_DB = 100.0
"""SNR of identical outputs is infinite; capping it keeps drops finite (the reference scores the cap)."""


class MetricError(ValueError):
    """The metric cannot be computed from these outputs or labels."""


def _flat(outputs: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(o, dtype=np.float64).reshape(o.shape[0], -1) for o in outputs])


def cosine(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Mean per-sample cosine similarity to the reference outputs."""
    a, b = _flat(outputs), _flat(reference)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    return float(np.mean(np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)))


def top1_agreement(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Fraction of samples whose arg-max class equals the reference's."""
    return float(np.mean(_flat(outputs).argmax(axis=1) == _flat(reference).argmax(axis=1)))


def snr_db(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Signal-to-noise ratio of the outputs against the reference, in dB, capped at ``SNR_CAP_DB``."""
    a, b = _flat(outputs), _flat(reference)
    noise = float(((a - b) ** 2).sum())
    signal = float((b**2).sum())
    if noise == 0:
        return SNR_CAP_DB
    return float(min(SNR_CAP_DB, 10 * np.log10(max(signal, 1e-30) / noise)))


def top1(outputs: Sequence[np.ndarray], labels: Sequence[np.ndarray] | None) -> float:
    """Top-1 accuracy against integer labels, as a fraction."""
    if labels is None:
        raise MetricError("metric top1 needs labels: add a 'labels' array to the evaluation data")
    predictions = _flat(outputs).argmax(axis=1)
    truth = np.concatenate([np.asarray(label).reshape(-1) for label in labels])
    if truth.shape != predictions.shape:
        raise MetricError(f"top1: {truth.shape[0]} labels for {predictions.shape[0]} predictions")
    classes = _flat(outputs).shape[1]
    if truth.dtype.kind not in "iu" or truth.min() < 0 or truth.max() >= classes:
        raise MetricError(f"top1: labels must be integers in [0, {classes}) to match the model's {classes} outputs")
    return float(np.mean(predictions == truth))


def check_labels(
    name: str, labels: Sequence[np.ndarray] | None, batch_sizes: Sequence[int], classes: int | None, what: str
) -> None:
    """Checks, before anything is built, that a split's labels fit the metric (only ``top1`` reads labels).

    Args:
        name: The metric name.
        labels: The labels of each batch, or None when the data has none.
        batch_sizes: Samples in each batch.
        classes: Scores per sample of the scored output, or None where the model leaves it unknown.
        what: The split (``evaluation``, ``holdout``), for messages.

    Raises:
        MetricError: Labels are missing, not one integer per sample, or outside ``[0, classes)``.
    """
    if name != "top1":
        return
    if labels is None:
        raise MetricError(
            f"metric top1 needs labels: add a 'labels' array (one class index per sample) to the {what} data"
        )
    for index, (label, size) in enumerate(zip(labels, batch_sizes, strict=True)):
        array = np.asarray(label)
        if array.size != size:
            raise MetricError(
                f"{what} batch {index}: top1 needs one label per sample, expected shape [{size}], "
                f"got {list(array.shape)}"
            )
        if array.dtype.kind not in "iu":
            raise MetricError(
                f"{what} batch {index}: top1 labels must be integer class indexes, expected dtype int64, "
                f"got {array.dtype}"
            )
        if array.min() < 0 or (classes is not None and array.max() >= classes):
            allowed = f"in [0, {classes}) for the model's {classes} outputs" if classes is not None else ">= 0"
            raise MetricError(
                f"{what} batch {index}: top1 labels must be {allowed}, got labels from {array.min()} to {array.max()}"
            )


def fidelity(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> dict[str, float]:
    """Every fidelity metric at once, recorded with each trial."""
    return {
        "cosine": cosine(outputs, reference),
        "top1_agreement": top1_agreement(outputs, reference),
        "snr_db": snr_db(outputs, reference),
    }


def score(
    name: str,
    outputs: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    labels: Sequence[np.ndarray] | None,
    function: str | None = None,
) -> float:
    """The configured metric, higher is better.

    Args:
        name: cosine, top1_agreement, snr, top1 or custom.
        outputs: The scored output, one array per batch.
        reference: The FP32 reference's output, one array per batch.
        labels: Labels per batch, if the data has them.
        function: For custom: ``module:function(outputs, reference, labels) -> float``.
    """
    if name == "cosine":
        return cosine(outputs, reference)
    if name == "top1_agreement":
        return top1_agreement(outputs, reference)
    if name == "snr":
        return snr_db(outputs, reference)
    if name == "top1":
        return top1(outputs, labels)
    if name == "custom" and function:
        return float(resolve_callable(function)(outputs, reference, labels))
    raise MetricError(f"unknown metric {name!r}")
