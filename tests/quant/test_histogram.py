"""autotune.quant.histogram: a tensor's statistics merged batch by batch, the same whatever the chunks."""

import json
import math

import numpy as np
import pytest

from autotune.quant import histogram
from autotune.quant.calibrate import amax
from autotune.quant.histogram import TensorStats


def test_update_extends_bins_with_the_same_width():
    rng = np.random.default_rng(2)
    first = rng.normal(0.0, 1.0, 1000)
    second = rng.normal(0.0, 10.0, 1000)
    merged = TensorStats.from_batch(first, num_bins=256)
    width = merged.bin_width
    merged.update(second)

    both = np.concatenate([first, second])
    direct = TensorStats.from_batch(both, num_bins=256)
    assert merged.bin_width == width == np.abs(first).max() / 256
    assert len(merged.hist) == math.ceil(np.abs(second).max() / width)
    assert merged.hist.sum() == direct.hist.sum() == 2000
    assert merged.max == direct.max == both.max()
    assert merged.min == direct.min == both.min()
    assert amax(merged, "max") == amax(direct, "max")
    # the same counts as binning everything at once with the first batch's width, except that the first
    # batch's maximum, exactly on its top edge, stays in its last bin (np.histogram's closed last bin)
    length = len(merged.hist)
    expected = np.bincount(np.minimum((np.abs(both) / width).astype(int), length - 1), minlength=length)
    top = int(np.argmax(np.abs(first)))
    assert int(np.abs(first[top]) / width) == 256
    expected[256] -= 1
    expected[255] += 1
    np.testing.assert_array_equal(merged.hist, expected)


def test_update_without_extension_equals_from_batch_of_concatenation():
    rng = np.random.default_rng(3)
    big, small = rng.normal(0.0, 5.0, 500), rng.normal(0.0, 1.0, 500)
    merged = TensorStats.from_batch(big, num_bins=512)
    merged.update(small)
    assert merged == TensorStats.from_batch(np.concatenate([big, small]), num_bins=512)


def test_update_after_all_zero_batch_keeps_the_zeros():
    stats = TensorStats.from_batch(np.zeros(10), num_bins=2048)
    stats.update(np.array([-2.0, 1.0]))
    assert stats.bin_width == 2.0 / 2048
    assert stats.hist.sum() == 12
    assert stats.hist[0] == 10 and stats.hist[1024] == 1 and stats.hist[-1] == 1
    assert (stats.min, stats.max) == (-2.0, 1.0)


def test_huge_outlier_coarsens_instead_of_growing_without_bound():
    stats = TensorStats.from_batch(np.array([1.0, 0.1]), num_bins=4)
    stats.update(np.array([1e5]))
    assert len(stats.hist) <= 1 << 16
    assert stats.bin_width == 2.0  # 0.25 doubled three times: the smallest width that fits
    assert stats.hist.sum() == 3
    assert stats.hist[0] == 2 and stats.hist[-1] == 1
    assert amax(stats, "max") == 1e5


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_update_bins_chunk_by_chunk_as_one_pass_over_the_whole_tensor(dtype):
    rng = np.random.default_rng(4)
    first = rng.standard_t(4, 3 * histogram._CHUNK + 17).astype(dtype)  # three chunks and a part of one
    second = (rng.standard_t(3, histogram._CHUNK + 5) * 3).astype(dtype)  # larger values: bins are appended
    stats = TensorStats.from_batch(first, num_bins=2048)
    stats.update(second)

    width = float(np.abs(first).max()) / 2048
    length = max(2048, math.ceil(float(np.abs(second).max()) / width))
    expected = np.zeros(length, dtype=np.int64)
    for batch, top in ((first, 2048), (second, length)):
        index = (np.abs(batch).astype(np.float64) / width).astype(np.int64)
        expected += np.bincount(np.minimum(index, top - 1), minlength=length)
    assert stats.bin_width == width
    np.testing.assert_array_equal(stats.hist, expected)
    both = np.concatenate([first, second])
    assert (stats.min, stats.max) == (float(both.min()), float(both.max()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_in_any_chunk_is_rejected(bad):
    values = np.ones(2 * histogram._CHUNK + 3, dtype=np.float32)
    values[histogram._CHUNK + 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        TensorStats.from_batch(values)


def test_stats_round_trip_through_json():
    stats = TensorStats.from_batch(np.array([-1.5, 0.25, 3.0]), num_bins=16)
    again = TensorStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again == stats
    assert again.hist.dtype == np.int64


def test_nan_in_values_is_rejected():
    with pytest.raises(ValueError, match="NaN"):
        TensorStats.from_batch(np.array([1.0, np.nan]))
