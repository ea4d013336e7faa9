"""``TensorStats``: a tensor's extremes and the histogram of its magnitudes, merged batch by batch.

What every calibration range is derived from (``autotune.quant.calibrate``), whichever runtime produced the values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# A later batch far larger than the first would otherwise grow the histogram without bound (one outlier
# 1e6 x the first batch's range means 2e9 bins); past this many bins, adjacent pairs are merged instead.
_MAX_BINS = 1 << 16

# Values binned per pass: the float64 magnitudes and int64 indices of a chunk stay in the core's cache. Whole-tensor
# passes wrote two arrays of 8 bytes a value to memory and read them back, several times slower on a large
# activation (docs/method.md#measurements-behind-the-codes-choices).
_CHUNK = 1 << 16


@dataclass(eq=False)
class TensorStats:
    """Running statistics of one tensor over the calibration data.

    Attributes:
        min: Smallest value seen (``inf`` before any value).
        max: Largest value seen (``-inf`` before any value).
        hist: Counts of ``|x|`` over bins ``[k * bin_width, (k + 1) * bin_width)``, int64; the largest
            magnitude is counted in the last bin.
        bin_width: Width of every bin. 0 while every value seen is exactly zero: those all sit in
            ``hist[0]``, which stays correct whatever width a later batch sets.
    """

    min: float
    max: float
    hist: np.ndarray
    bin_width: float

    def __post_init__(self) -> None:
        self.hist = np.asarray(self.hist, dtype=np.int64)
        if self.hist.ndim != 1 or len(self.hist) == 0:
            raise ValueError("hist must be a non-empty 1-D array of counts")
        self.min = float(self.min)
        self.max = float(self.max)
        self.bin_width = float(self.bin_width)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStats):
            return NotImplemented
        return (
            self.min == other.min
            and self.max == other.max
            and self.bin_width == other.bin_width
            and np.array_equal(self.hist, other.hist)
        )

    @property
    def count(self) -> int:
        """Number of values merged so far."""
        return int(self.hist.sum())

    @classmethod
    def empty(cls, num_bins: int = 2048) -> TensorStats:
        """Statistics of no values; the first non-zero batch merged in sets the bin width."""
        if num_bins < 1:
            raise ValueError(f"num_bins must be at least 1, got {num_bins}")
        return cls(min=math.inf, max=-math.inf, hist=np.zeros(num_bins, dtype=np.int64), bin_width=0.0)

    @classmethod
    def from_batch(cls, values: np.ndarray, num_bins: int = 2048) -> TensorStats:
        """Statistics of one batch: ``bin_width = max|x| / num_bins``.

        Args:
            values: Any array (any shape; converted to float64).
            num_bins: Number of histogram bins over ``[0, max|x|]``.

        Raises:
            ValueError: ``values`` holds NaN or Inf, or ``num_bins < 1``.
        """
        stats = cls.empty(num_bins)
        stats.update(values)
        return stats

    def update(self, values: np.ndarray) -> None:
        """Merges one batch into the statistics.

        Bins keep their width: when ``|x|`` exceeds the covered range, bins of the same width are appended
        (as pytorch-quantization's HistogramCalibrator does), so earlier counts are never re-binned. Only
        past ``_MAX_BINS`` bins are adjacent pairs merged (doubling the width), which is also exact.

        Raises:
            ValueError: ``values`` holds NaN or Inf.
        """
        x = np.asarray(values)
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        x = x.ravel()
        if x.size == 0:
            return
        # Extremes in the tensor's own float type are exact; NaN propagates into both, an infinity into one.
        self.update_binned(float(x.min()), float(x.max()), x.size, lambda width, length: _bin_counts(x, width, length))

    def update_binned(self, low: float, high: float, size: int, bin_counts: Callable[[float, int], np.ndarray]) -> None:
        """Merges one batch of ``size`` values, given their extremes and a function that bins them.

        ``update`` on values held elsewhere (a GPU's: ``autotune.backends.torch.calibration``), with the same result.

        Args:
            low: The batch's smallest value.
            high: The batch's largest value.
            size: How many values the batch has (at least one).
            bin_counts: ``(bin_width, length) -> counts``: how many ``|x|`` fall in each of ``length`` bins, by
                ``min(trunc(float64(|x|) / bin_width), length - 1)``, as int64; called once, unless every value is 0.

        Raises:
            ValueError: ``low`` or ``high`` is NaN or infinite.
        """
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError("values contain NaN or Inf")
        self.min = min(self.min, low)
        self.max = max(self.max, high)
        top = max(-low, high)
        if self.bin_width == 0.0:
            if top == 0.0:
                self.hist[0] += size
                return
            self.bin_width = top / len(self.hist)
            # top sits exactly on the upper edge: no extension, whatever rounding says
            length = len(self.hist)
        else:
            limit = max(_MAX_BINS, len(self.hist))
            while math.ceil(top / self.bin_width) > limit:
                self._coarsen()
            length = max(len(self.hist), math.ceil(top / self.bin_width))
        counts = np.asarray(bin_counts(self.bin_width, length), dtype=np.int64)
        if length > len(self.hist):
            self.hist = np.concatenate([self.hist, np.zeros(length - len(self.hist), dtype=np.int64)])
        self.hist += counts

    def _coarsen(self) -> None:
        hist = self.hist
        if len(hist) % 2:
            hist = np.concatenate([hist, np.zeros(1, dtype=np.int64)])
        self.hist = hist.reshape(-1, 2).sum(axis=1)
        self.bin_width *= 2.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``hist`` as a list of ints)."""
        return {
            "min": self.min,
            "max": self.max,
            "hist": [int(c) for c in self.hist],
            "bin_width": self.bin_width,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorStats:
        """The inverse of :meth:`to_dict`.

        Raises:
            KeyError: A field is missing.
            ValueError: A field has the wrong type or the histogram is malformed.
        """
        hist = data["hist"]
        if not isinstance(hist, list) or not all(isinstance(c, int) and c >= 0 for c in hist):
            raise ValueError("hist must be a list of non-negative ints")
        return cls(min=float(data["min"]), max=float(data["max"]), hist=np.array(hist), bin_width=data["bin_width"])


def _bin_counts(x: np.ndarray, bin_width: float, length: int) -> np.ndarray:
    """``TensorStats.update_binned``'s binning of a flat array, in chunks.

    The magnitude is divided in float64: a float32 or float16 magnitude widens exactly, so the counts do not depend
    on the input's float type.
    """
    counts = np.zeros(length, dtype=np.int64)
    scaled = np.empty(min(_CHUNK, x.size), dtype=np.float64)
    index = np.empty(len(scaled), dtype=np.int64)
    for start in range(0, x.size, _CHUNK):
        part = x[start : start + _CHUNK]
        magnitudes, bins = scaled[: part.size], index[: part.size]
        np.abs(part, out=magnitudes)
        np.divide(magnitudes, bin_width, out=magnitudes)
        bins[...] = magnitudes  # truncation toward zero, as astype(np.int64)
        np.minimum(bins, length - 1, out=bins)
        counts += np.bincount(bins, minlength=length)
    return counts
