"""Tests for autotune.metrics with hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autotune.metrics import (
    SEQUENTIAL_METRICS,
    SNR_CAP_DB,
    MetricError,
    batch_terms,
    cosine,
    drop_of_ratio,
    fidelity,
    score,
    snr_db,
    top1,
    top1_agreement,
)

CUSTOM_CALLS: list[tuple] = []


def custom_metric(outputs, reference, labels):
    """Referenced as tests.test_metrics:custom_metric: mean absolute difference, negated."""
    CUSTOM_CALLS.append((outputs, reference, labels))
    return -float(np.mean([np.abs(o - r).mean() for o, r in zip(outputs, reference, strict=True)]))


def custom_metric_returns_int(outputs, reference, labels):
    return 3


def _a(*rows):
    return np.array(rows, dtype=np.float32)


def test_cosine_identical_orthogonal_opposite():
    x = [_a([1.0, 2.0, 3.0])]
    assert cosine(x, x) == pytest.approx(1.0)
    assert cosine([_a([1.0, 0.0])], [_a([0.0, 5.0])]) == pytest.approx(0.0)
    assert cosine([_a([1.0, -2.0])], [_a([-3.0, 6.0])]) == pytest.approx(-1.0)


def test_cosine_scale_invariant_and_hand_value():
    assert cosine([_a([2.0, 4.0])], [_a([1.0, 2.0])]) == pytest.approx(1.0)
    # [1, 0] vs [1, 1]: cos 45 degrees
    assert cosine([_a([1.0, 0.0])], [_a([1.0, 1.0])]) == pytest.approx(1 / math.sqrt(2))


def test_cosine_is_mean_over_samples_and_batches():
    outputs = [_a([1.0, 0.0], [1.0, 0.0]), _a([1.0, 0.0])]
    reference = [_a([1.0, 0.0], [0.0, 1.0]), _a([-1.0, 0.0])]
    # per-sample cosines 1, 0, -1 -> mean 0
    assert cosine(outputs, reference) == pytest.approx(0.0)
    # per-sample, not over the flattened batch: [1,0],[0,1] vs [1,0],[1,0] -> (1 + 0) / 2
    assert cosine([_a([1.0, 0.0], [0.0, 1.0])], [_a([1.0, 0.0], [1.0, 0.0])]) == pytest.approx(0.5)


def test_cosine_flattens_trailing_dims():
    out = np.ones((2, 3, 4), dtype=np.float32)
    ref = out.copy()
    ref[1] *= -1
    assert cosine([out], [ref]) == pytest.approx(0.0)


def test_cosine_zero_vectors_count_as_equal():
    zero = [_a([0.0, 0.0])]
    assert cosine(zero, zero) == 1.0


def test_top1_agreement():
    outputs = [_a([0.9, 0.1, 0.0], [0.1, 0.8, 0.1]), _a([0.0, 0.2, 0.7], [0.5, 0.4, 0.1])]
    reference = [_a([0.6, 0.3, 0.1], [0.1, 0.2, 0.7]), _a([0.0, 0.1, 0.9], [0.1, 0.8, 0.1])]
    # agree, disagree, agree, disagree
    assert top1_agreement(outputs, reference) == pytest.approx(0.5)
    assert top1_agreement(outputs, outputs) == 1.0


def test_snr_hand_computed():
    reference = [_a([3.0, 4.0])]  # signal 25
    outputs = [_a([3.0, 4.5])]  # noise 0.25 -> 10 log10(100) = 20 dB
    assert snr_db(outputs, reference) == pytest.approx(20.0)
    # noise 25 -> 0 dB
    assert snr_db([_a([3.0, -1.0])], reference) == pytest.approx(0.0)
    # across batches: signal 1 + 1 = 2, noise 0.02 -> 20 dB
    assert snr_db([_a([1.1]), _a([0.9])], [_a([1.0]), _a([1.0])]) == pytest.approx(20.0, abs=1e-4)


def test_snr_cap_for_identical_and_tiny_noise():
    x = [_a([1.0, 2.0])]
    assert snr_db(x, x) == SNR_CAP_DB
    assert snr_db([_a([1.0, 2.0 + 1e-7])], x) == SNR_CAP_DB
    assert SNR_CAP_DB == 100.0


def test_snr_zero_reference_is_finite():
    value = snr_db([_a([1.0])], [_a([0.0])])
    assert math.isfinite(value) and value < 0


def test_top1_with_labels():
    outputs = [_a([0.1, 0.9], [0.8, 0.2]), _a([0.3, 0.7])]
    labels = [np.array([1, 1]), np.array([1])]
    assert top1(outputs, labels) == pytest.approx(2 / 3)
    assert top1(outputs, [np.array([[1], [0]]), np.array([1])]) == 1.0


def test_top1_missing_labels():
    with pytest.raises(MetricError, match="needs labels"):
        top1([_a([0.1, 0.9])], None)


@pytest.mark.parametrize("bad", [np.array([2]), np.array([-1]), np.array([0.0]), np.array([1.0])])
def test_top1_labels_out_of_range_or_not_integer(bad):
    with pytest.raises(MetricError, match=r"integers in \[0, 2\)"):
        top1([_a([0.1, 0.9])], [bad])


def test_top1_count_mismatch():
    with pytest.raises(MetricError, match="3 labels for 2 predictions"):
        top1([_a([0.1, 0.9], [0.9, 0.1])], [np.array([0, 1, 1])])


def test_fidelity_has_all_three():
    x = [_a([1.0, 2.0])]
    assert fidelity(x, x) == {"cosine": pytest.approx(1.0), "top1_agreement": 1.0, "snr_db": SNR_CAP_DB}


def test_score_dispatch():
    outputs = [_a([3.0, 4.5])]
    reference = [_a([3.0, 4.0])]
    labels = [np.array([0])]
    assert score("cosine", outputs, reference, labels) == cosine(outputs, reference)
    assert score("snr", outputs, reference, None) == pytest.approx(20.0)
    assert score("top1_agreement", outputs, reference, None) == 1.0
    assert score("top1", outputs, reference, labels) == 0.0
    with pytest.raises(MetricError):
        score("top1", outputs, reference, None)


def test_score_custom_function():
    CUSTOM_CALLS.clear()
    outputs = [_a([1.0, 2.0])]
    reference = [_a([1.0, 3.0])]
    labels = [np.array([1])]
    value = score("custom", outputs, reference, labels, function="tests.test_metrics:custom_metric")
    assert value == pytest.approx(-0.5)
    assert len(CUSTOM_CALLS) == 1
    got_outputs, got_reference, got_labels = CUSTOM_CALLS[0]
    assert got_outputs is outputs and got_reference is reference and got_labels is labels
    result = score("custom", outputs, reference, None, function="tests.test_metrics:custom_metric_returns_int")
    assert result == 3.0 and type(result) is float


def test_score_custom_bad_function():
    with pytest.raises(ValueError, match="no 'missing'"):
        score("custom", [_a([1.0])], [_a([1.0])], None, function="tests.test_metrics:missing")


@pytest.mark.parametrize(("name", "function"), [("custom", None), ("bogus", None), ("COSINE", None)])
def test_score_unknown(name, function):
    with pytest.raises(MetricError, match="unknown metric"):
        score(name, [_a([1.0])], [_a([1.0])], None, function=function)


def test_fidelity_reads_batch_by_batch_what_the_concatenated_outputs_give():
    rng = np.random.default_rng(3)
    reference = [rng.standard_normal((4, 3, 5)).astype(np.float32) for _ in range(3)]
    outputs = [(r + 0.1 * rng.standard_normal(r.shape)).astype(np.float32) for r in reference]
    a = np.concatenate([o.reshape(4, -1) for o in outputs]).astype(np.float64)
    b = np.concatenate([r.reshape(4, -1) for r in reference]).astype(np.float64)
    cosines = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    expected = {
        "cosine": float(cosines.mean()),
        "top1_agreement": float(np.mean(a.argmax(axis=1) == b.argmax(axis=1))),
        "snr_db": float(10 * np.log10((b**2).sum() / ((a - b) ** 2).sum())),
    }
    assert fidelity(outputs, reference) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(MetricError, match="2 output batches against 3"):
        fidelity(outputs[:2], reference)
    with pytest.raises(MetricError, match="shape"):
        cosine([outputs[0]], [reference[0][:, :2]])


@pytest.mark.parametrize("name", SEQUENTIAL_METRICS)
def test_batch_terms_summed_over_batches_give_the_metrics_drop(name):
    rng = np.random.default_rng(0)
    reference = [rng.standard_normal((size, 5)) for size in (4, 4, 3)]  # a short last batch
    outputs = [r + 0.4 * rng.standard_normal(r.shape) for r in reference]
    outputs[0][1] = 0.0  # an all-zero sample: cosine 1 by convention
    labels = [
        np.where(rng.random(r.shape[0]) < 0.8, r.argmax(axis=1), rng.integers(0, 5, r.shape[0])) for r in reference
    ]
    terms = [batch_terms(name, o, r, label) for o, r, label in zip(outputs, reference, labels, strict=True)]
    ratio = sum(top for top, _ in terms) / sum(bottom for _, bottom in terms)
    reference_accuracy = score(name, reference, reference, labels)
    drop = reference_accuracy - score(name, outputs, reference, labels)
    assert drop > 0.01 and drop_of_ratio(name, ratio, reference_accuracy) == pytest.approx(drop, rel=1e-9)


def test_a_custom_metric_has_no_batch_terms():
    with pytest.raises(MetricError, match="no batch terms"):
        batch_terms("custom", _a([1.0]), _a([1.0]), None)
