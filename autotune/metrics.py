"""Accuracy: task metrics against labels, fidelity metrics against the FP32 outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.model.layers import resolve_callable

SNR_CAP_DB = 100.0
"""SNR of identical outputs is infinite; capping it keeps drops finite (the reference scores the cap)."""


class MetricError(ValueError):
    """The metric cannot be computed from these outputs or labels."""


def _flat(outputs: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(o, dtype=np.float64).reshape(o.shape[0], -1) for o in outputs])


@dataclass(frozen=True)
class _Agreement:
    """Outputs against the reference, per sample and in total: what every fidelity metric is made of.

    Gathered batch by batch, each batch read once in float64: the encoder's outputs (2 x 128 x 128 x 1024 floats a
    split) took about 1 s per metric when each one concatenated both sides in float64 on its own.
    """

    dots: np.ndarray
    norms: np.ndarray
    reference_norms: np.ndarray
    same_argmax: np.ndarray
    noise: float
    signal: float

    @classmethod
    def of(cls, outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> _Agreement:
        if len(outputs) != len(reference):
            raise MetricError(f"{len(outputs)} output batches against {len(reference)} reference batches")
        dots, norms, reference_norms, same_argmax = [], [], [], []
        noise = signal = 0.0
        for output, expected in zip(outputs, reference, strict=True):
            a = np.asarray(output, dtype=np.float64).reshape(output.shape[0], -1)
            b = np.asarray(expected, dtype=np.float64).reshape(expected.shape[0], -1)
            if a.shape != b.shape:
                raise MetricError(f"outputs of shape {list(a.shape)} against a reference of {list(b.shape)}")
            squares = np.einsum("ij,ij->i", b, b)
            dots.append(np.einsum("ij,ij->i", a, b))
            norms.append(np.sqrt(np.einsum("ij,ij->i", a, a)))
            reference_norms.append(np.sqrt(squares))
            same_argmax.append(a.argmax(axis=1) == b.argmax(axis=1))
            difference = a - b
            noise += float(np.einsum("ij,ij->", difference, difference))
            signal += float(squares.sum())
        return cls(
            np.concatenate(dots),
            np.concatenate(norms),
            np.concatenate(reference_norms),
            np.concatenate(same_argmax),
            noise,
            signal,
        )

    @property
    def cosines(self) -> np.ndarray:
        """Per-sample cosine similarity; 1 where either side is all zeros."""
        norms = self.norms * self.reference_norms
        return np.where(norms > 0, self.dots / np.maximum(norms, 1e-30), 1.0)

    @property
    def reference_cosines(self) -> np.ndarray:
        """The reference's per-sample cosine with itself (1 up to rounding; 1 for an all-zero sample)."""
        squares = self.reference_norms * self.reference_norms
        return np.where(squares > 0, squares / np.maximum(squares, 1e-30), 1.0)

    @property
    def cosine(self) -> float:
        return float(np.mean(self.cosines))

    @property
    def top1_agreement(self) -> float:
        return float(np.mean(self.same_argmax))

    @property
    def snr_db(self) -> float:
        if self.noise == 0:
            return SNR_CAP_DB
        return float(min(SNR_CAP_DB, 10 * np.log10(max(self.signal, 1e-30) / self.noise)))


def cosine(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Mean per-sample cosine similarity to the reference outputs."""
    return _Agreement.of(outputs, reference).cosine


def top1_agreement(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Fraction of samples whose arg-max class equals the reference's."""
    return _Agreement.of(outputs, reference).top1_agreement


def snr_db(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """Signal-to-noise ratio of the outputs against the reference, in dB, capped at ``SNR_CAP_DB``."""
    return _Agreement.of(outputs, reference).snr_db


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


SEQUENTIAL_METRICS = ("cosine", "top1_agreement", "top1", "snr")
"""The metrics whose drop is a ratio of sums over batches (:func:`batch_terms`), which a sequential test can bound
before every batch is scored; a ``custom`` metric is scored on the whole split."""
LOG_RATIO_METRICS = ("snr",)
"""The metrics that are the log of their ratio of sums: a bound on them is taken on the log scale."""


def batch_terms(name: str, output: np.ndarray, reference: np.ndarray, labels: np.ndarray | None) -> tuple[float, float]:
    """One batch's share of a metric's drop: its numerator and denominator.

    Summed over batches, numerator over denominator is the ratio :func:`drop_of_ratio` turns into the drop. For a
    mean of per-sample values (``cosine``, ``top1_agreement``, ``top1``), the sum of the per-sample drops (the
    reference's value less the plan's, paired on each sample) over the batch's samples; for ``snr``, the batch's
    noise energy over its signal energy.

    Args:
        name: One of ``SEQUENTIAL_METRICS``.
        output: The plan's scored output on the batch.
        reference: The FP32 reference's output on the batch.
        labels: The batch's labels (``top1`` only).

    Raises:
        MetricError: A metric without batch terms, or outputs and labels that do not fit it.
    """
    agreement = _Agreement.of([output], [reference])
    samples = float(agreement.dots.shape[0])
    if name == "cosine":
        return float(np.sum(agreement.reference_cosines - agreement.cosines)), samples
    if name == "top1_agreement":
        return float(np.sum(~agreement.same_argmax)), samples
    if name == "snr":
        return agreement.noise, agreement.signal
    if name == "top1":
        if labels is None:
            raise MetricError("metric top1 needs labels: add a 'labels' array to the evaluation data")
        truth = np.asarray(labels).reshape(-1)
        plan = _flat([output]).argmax(axis=1) == truth
        fp32 = _flat([reference]).argmax(axis=1) == truth
        return float(np.sum(fp32.astype(np.float64) - plan)), samples
    raise MetricError(f"metric {name!r} has no batch terms; metrics with them: {', '.join(SEQUENTIAL_METRICS)}")


def drop_of_ratio(name: str, ratio: float, reference_accuracy: float) -> float:
    """The drop that summed :func:`batch_terms` imply: increasing in ``ratio`` for every metric.

    Args:
        name: One of ``SEQUENTIAL_METRICS``.
        ratio: Sum of numerators over sum of denominators.
        reference_accuracy: FP32's score on the split (the SNR the reference scores: ``SNR_CAP_DB``).
    """
    if name != "snr":
        return ratio
    if ratio <= 0:
        return reference_accuracy - SNR_CAP_DB
    return reference_accuracy - min(SNR_CAP_DB, -10 * float(np.log10(ratio)))


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
    """Every fidelity metric at once, recorded with each trial (the outputs read once for all three)."""
    agreement = _Agreement.of(outputs, reference)
    return {"cosine": agreement.cosine, "top1_agreement": agreement.top1_agreement, "snr_db": agreement.snr_db}


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
