import json
import logging
import math

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.quant import calibrate as calib
from autotune.quant.calibrate import (
    METHODS,
    Calibration,
    CalibrationSettings,
    TensorStats,
    activation_range,
    amax,
    calibrate,
    collect_statistics,
    data_hash,
)

# ---------------------------------------------------------------- max


def test_max_amax_and_range_hand_computed():
    stats = TensorStats.from_batch(np.array([-3.0, 1.0, 2.0]))
    assert amax(stats, "max") == 3.0
    assert activation_range(stats, "max") == (-3.0, 2.0)


def test_range_always_contains_zero():
    positive = TensorStats.from_batch(np.array([0.5, 2.0]))
    assert activation_range(positive, "max") == (0.0, 2.0)
    negative = TensorStats.from_batch(np.array([-4.0, -1.0]))
    assert activation_range(negative, "max") == (-4.0, 0.0)


def test_unknown_method_lists_the_methods():
    stats = TensorStats.from_batch(np.array([1.0]))
    with pytest.raises(ValueError, match="max, percentile, entropy"):
        amax(stats, "minmax")
    with pytest.raises(ValueError, match="percentile"):
        Calibration({"t": stats}, CalibrationSettings()).ranges("kl")


def test_all_zero_tensor_gives_zero_range():
    stats = TensorStats.from_batch(np.zeros(10))
    assert stats.bin_width == 0.0
    for method in METHODS:
        assert amax(stats, method) == 0.0
        assert activation_range(stats, method) == (0.0, 0.0)


# ---------------------------------------------------------------- percentile


def _uniform_stats() -> TensorStats:
    # 100 values, one in each bin of width 1 over [0, 100): the k-th percentile edge is k.
    return TensorStats(min=-50.0, max=99.5, hist=np.ones(100, dtype=np.int64), bin_width=1.0)


@pytest.mark.parametrize(("percentile", "expected"), [(90.0, 90.0), (50.0, 50.0), (99.5, 100.0), (100.0, 100.0)])
def test_percentile_is_upper_edge_of_crossing_bin(percentile, expected):
    settings = CalibrationSettings(percentile=percentile)
    assert amax(_uniform_stats(), "percentile", settings) == expected


def test_percentile_range_clips_only_the_long_side():
    settings = CalibrationSettings(percentile=90.0)
    assert activation_range(_uniform_stats(), "percentile", settings) == (-50.0, 90.0)


def test_percentile_with_uneven_bins():
    # cumulative 10, 10, 60, 100: 50 % of 100 is crossed in bin 2 -> edge 3 * 0.5
    stats = TensorStats(min=0.0, max=2.0, hist=np.array([10, 0, 50, 40]), bin_width=0.5)
    assert amax(stats, "percentile", CalibrationSettings(percentile=50.0)) == 1.5
    assert amax(stats, "percentile", CalibrationSettings(percentile=10.0)) == 0.5


def test_settings_validate():
    with pytest.raises(ValueError):
        CalibrationSettings(percentile=0.0)
    with pytest.raises(ValueError):
        CalibrationSettings(percentile=100.5)
    with pytest.raises(ValueError):
        CalibrationSettings(num_bins=0)


# ---------------------------------------------------------------- entropy


def test_entropy_ignores_a_few_huge_outliers():
    rng = np.random.default_rng(0)
    bulk = rng.normal(0.0, 1.0, 200_000)
    values = np.concatenate([bulk, [60.0, -60.0, 55.0, 58.0, -57.0]])
    stats = TensorStats.from_batch(values)
    clip = amax(stats, "entropy")
    assert 3.0 < clip < 0.25 * amax(stats, "max")
    lo, hi = activation_range(stats, "entropy")
    assert lo == -clip and hi == clip


def test_entropy_is_not_dragged_down_by_the_zero_spike_of_a_relu():
    # Half the values are exact zeros; left in bin 0, that spike makes wide groups look costly and the
    # search clips near 2 sigma.
    rng = np.random.default_rng(0)
    stats = TensorStats.from_batch(np.maximum(rng.normal(0.0, 1.0, 200_000), 0.0))
    assert amax(stats, "entropy") > 3.0
    assert activation_range(stats, "entropy")[0] == 0.0


def test_entropy_keeps_everything_when_the_quantized_histogram_is_exact():
    # 4 levels over 12 bins = groups of 3. Spread evenly over nonzero bins, Q equals P: KL 0, no clipping.
    hist = np.array([10, 10, 10, 10, 0, 0, 0, 0, 0, 0, 0, 1])
    stats = TensorStats(min=-12.0, max=12.0, hist=hist, bin_width=1.0)
    assert amax(stats, "entropy", CalibrationSettings(entropy_target_bins=4)) == 12.0


def test_entropy_clips_when_merging_bins_loses_more_than_clipping():
    # 8 levels over 16 bins merges the alternating 9/1 pairs into 5/5 (KL ~0.3); clipping at 8 bins keeps
    # them exact and only moves one count of outlier into the last bin (KL ~0.01). Clip points 9..15 end on
    # an empty bin that gets the outlier: Q has nothing there, a huge penalty.
    hist = np.array([1, 1, 9, 1, 9, 1, 9, 1, 0, 0, 0, 0, 0, 0, 0, 1])
    stats = TensorStats(min=0.0, max=16.0, hist=hist, bin_width=0.5)
    assert amax(stats, "entropy", CalibrationSettings(entropy_target_bins=8)) == 4.0


def test_entropy_ties_go_to_the_least_clipping():
    # every clip point from 2 to 6 bins reproduces P exactly (KL 0): prefer not to clip
    stats = TensorStats(min=0.0, max=2.0, hist=np.array([4, 4, 0, 0, 0, 0]), bin_width=1.0)
    assert amax(stats, "entropy", CalibrationSettings(entropy_target_bins=2)) == 6.0


def _reference_entropy_bin(hist: np.ndarray, target: int) -> int:
    """Brute force over every clip point, with plain loops."""
    h = [float(c) for c in hist]
    h[0] = h[1]  # the zero-spike flattening, as in pytorch-quantization
    best_i, best_kl = -1, math.inf
    for i in range(target, len(h) + 1):
        p = h[:i]
        p[-1] += sum(h[i:])
        q = [0.0] * i
        for g in range(target):
            start, stop = -(-g * i // target), -(-(g + 1) * i // target)  # ceil(g*i/target)
            members = range(start, stop)
            nonzero = [j for j in members if h[j] > 0]
            for j in nonzero:
                q[j] = sum(h[j] for j in members) / len(nonzero)
        p_total, q_total = sum(p), sum(q)
        kl = 0.0
        for pj, qj in zip(p, q, strict=True):
            if pj > 0:
                kl += pj / p_total * math.log((pj / p_total) / max(qj / q_total, 1e-10))
        if kl <= best_kl + 1e-12:
            best_i, best_kl = i, min(kl, best_kl)
    return best_i


@pytest.mark.parametrize("seed", range(40))
def test_entropy_matches_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    length = int(rng.integers(10, 40))
    hist = rng.integers(0, 20, length) * (rng.random(length) < 0.7)
    hist[-1] = max(hist[-1], 1)
    hist[1] = max(hist[1], 1)
    stats = TensorStats(min=-float(length), max=float(length), hist=hist, bin_width=0.25)
    expected = _reference_entropy_bin(hist, 6)
    assert amax(stats, "entropy", CalibrationSettings(entropy_target_bins=6)) == expected * 0.25


def test_entropy_with_no_more_bins_than_levels_is_max():
    stats = TensorStats.from_batch(np.array([-1.0, 3.0, 0.5]), num_bins=64)
    assert amax(stats, "entropy") == 3.0


def test_entropy_on_full_histogram_is_fast_and_inside_range():
    rng = np.random.default_rng(1)
    stats = TensorStats.from_batch(rng.laplace(size=100_000), num_bins=2048)
    stats.update(rng.laplace(size=100_000) * 3)  # extends the histogram past 2048 bins
    assert len(stats.hist) > 2048
    clip = amax(stats, "entropy")
    assert 128 * stats.bin_width <= clip <= amax(stats, "max") + stats.bin_width


# ---------------------------------------------------------------- collect_statistics

WEIGHT = np.array(
    [[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-2.0, 1.0, 0.75], [0.1, -0.3, 1.2]],
    dtype=np.float32,
)


def _tiny_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["mm"], name="matmul"),
            helper.make_node("Relu", ["mm"], ["Y"], name="relu"),
        ],
        "tiny",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(WEIGHT, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _batches(count: int = 3, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"X": rng.normal(0.0, 1.0 + k, (5, 4)).astype(np.float32)} for k in range(count)]


def test_collect_statistics_matches_numpy():
    batches = _batches()
    stats = collect_statistics(_tiny_model(), ["mm", "X", "Y"], iter(batches), num_bins=64)
    xs = np.concatenate([b["X"] for b in batches])
    mm = xs @ WEIGHT
    y = np.maximum(mm, 0)
    for name, values in (("X", xs), ("mm", mm), ("Y", y)):
        assert stats[name].min == pytest.approx(values.min(), rel=1e-5)
        assert stats[name].max == pytest.approx(values.max(), rel=1e-5)
        assert stats[name].hist.sum() == values.size
    assert stats["mm"].min < 0  # the tensor before the Relu, not after
    expected_x = TensorStats.from_batch(batches[0]["X"], num_bins=64)
    for batch in batches[1:]:
        expected_x.update(batch["X"])
    assert stats["X"] == expected_x


def test_collect_statistics_of_an_initializer():
    stats = collect_statistics(_tiny_model(), ["W"], _batches(2))
    assert stats["W"].max == WEIGHT.max()
    assert stats["W"].hist.sum() == 2 * WEIGHT.size


def test_unknown_tensor_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        collect_statistics(_tiny_model(), ["mm", "nope"], _batches())


def test_nan_in_activation_names_tensor_and_batch():
    batches = _batches()
    batches[1]["X"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"'mm' has NaN/Inf values on calibration batch 1"):
        collect_statistics(_tiny_model(), ["mm"], batches)


def test_empty_data_is_rejected():
    with pytest.raises(ValueError, match="calibration data is empty"):
        collect_statistics(_tiny_model(), ["mm"], [])
    with pytest.raises(ValueError, match="calibration data is empty"):
        calibrate(_tiny_model(), ["mm"], [], None, "hash")


def test_batch_missing_an_input_is_rejected():
    with pytest.raises(ValueError, match="lacks model inputs"):
        collect_statistics(_tiny_model(), ["mm"], [{"other": np.zeros(3)}])


# ---------------------------------------------------------------- calibrate and its cache


def _forbid_ort(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("ORT must not run on a cache hit")

    monkeypatch.setattr(onnxruntime, "InferenceSession", boom)
    monkeypatch.setattr(calib, "collect_statistics", boom)


def test_calibrate_without_cache_dir(tmp_path):
    result = calibrate(_tiny_model(), ["mm", "X"], _batches(), None, "modelhash")
    assert set(result.stats) == {"mm", "X"}
    assert list(tmp_path.iterdir()) == []


def test_calibrate_cache_hit_skips_ort(tmp_path, monkeypatch):
    model, batches = _tiny_model(), _batches()
    first = calibrate(model, ["mm", "X"], batches, tmp_path, "modelhash")
    assert len(list(tmp_path.glob("*.json"))) == 1
    _forbid_ort(monkeypatch)
    second = calibrate(model, ["X", "mm"], batches, tmp_path, "modelhash")
    assert second.stats == first.stats
    for method in METHODS:
        assert second.ranges(method) == first.ranges(method)
    # percentile and entropy settings are read off the cached histograms: still a hit
    settings = CalibrationSettings(percentile=99.0)
    third = calibrate(model, ["mm", "X"], batches, tmp_path, "modelhash", settings)
    assert third.ranges("max") == first.ranges("max")


@pytest.mark.parametrize(
    "change",
    [
        {"model_hash": "othermodel"},
        {"batches": _batches(seed=1)},
        {"batches": _batches(count=2)},
        {"tensors": ["mm"]},
        {"settings": CalibrationSettings(num_bins=128)},
    ],
    ids=["model", "data", "data-length", "tensors", "num_bins"],
)
def test_cache_key_changes(tmp_path, change):
    base = {"tensors": ["mm", "X"], "batches": _batches(), "model_hash": "modelhash"}
    calibrate(_tiny_model(), base["tensors"], base["batches"], tmp_path, base["model_hash"])
    args = {**base, **change}
    changed = calibrate(
        _tiny_model(),
        args["tensors"],
        args["batches"],
        tmp_path,
        args["model_hash"],
        change.get("settings", CalibrationSettings()),
    )
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert set(changed.stats) == set(args["tensors"])


def test_corrupt_cache_is_recovered(tmp_path, caplog):
    model, batches = _tiny_model(), _batches()
    first = calibrate(model, ["mm"], batches, tmp_path, "modelhash")
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"format": 1, "stats": {"mm": {"min": 0')
    with caplog.at_level(logging.WARNING, logger="autotune.quant.calibrate"):
        again = calibrate(model, ["mm"], batches, tmp_path, "modelhash")
    assert "calibration cache" in caplog.text
    assert again.stats == first.stats
    assert json.loads(path.read_text())["stats"]["mm"]["hist"] == first.stats["mm"].to_dict()["hist"]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_data_hash_sees_names_dtypes_shapes_and_bytes():
    base = [{"X": np.arange(6, dtype=np.float32).reshape(2, 3)}]
    assert len(data_hash(base)) == 16
    assert data_hash(base) == data_hash([{"X": np.arange(6, dtype=np.float32).reshape(2, 3)}])
    variants = [
        [{"Y": base[0]["X"]}],
        [{"X": base[0]["X"].astype(np.float64)}],
        [{"X": base[0]["X"].reshape(3, 2)}],
        [{"X": base[0]["X"] + 1}],
        base + base,
    ]
    assert len({data_hash(v) for v in variants} | {data_hash(base)}) == len(variants) + 1


def test_ranges_are_memoized(monkeypatch):
    calls = []
    original = calib.activation_range

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(calib, "activation_range", counting)
    stats = TensorStats.from_batch(np.array([-3.0, 1.0, 2.0]))
    calibration = Calibration({"t": stats}, CalibrationSettings())
    assert calibration.ranges("max") == {"t": (-3.0, 2.0)}
    calibration.ranges("max")["t"] = (0.0, 0.0)  # a returned dict is the caller's to change
    assert calibration.ranges("max") == {"t": (-3.0, 2.0)}
    assert calls == ["max"]


def _bin_by_bin_divergence(hist: np.ndarray, clip: int, target: int) -> float:
    """KL(P || Q) of one clip, bin by bin, as TensorRT's search writes it (the closed form's reference)."""
    kept = hist[:clip].copy()
    reference = kept.copy()
    reference[-1] += hist[clip:].sum()
    group = (np.arange(clip) * target) // clip
    nonzero = kept > 0
    mass = np.bincount(group, weights=kept, minlength=target)
    count = np.bincount(group, weights=nonzero, minlength=target)
    q = np.where(nonzero, mass[group] / np.maximum(count[group], 1.0), 0.0)
    p, q = reference / reference.sum(), q / q.sum()
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-10))))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target", [3, 16])
def test_the_closed_form_divergences_equal_the_bin_by_bin_ones(seed, target):
    from autotune.quant.calibrate import _kl_divergences

    rng = np.random.default_rng(seed)
    hist = rng.exponential(1.0, 200) * (rng.random(200) < 0.6)  # empty bins, including some last bins
    hist[0] = 1.0
    clips = np.arange(target, 201)
    expected = [_bin_by_bin_divergence(hist, int(clip), target) for clip in clips]
    np.testing.assert_allclose(_kl_divergences(hist, clips, target), expected, rtol=1e-9, atol=1e-12)
