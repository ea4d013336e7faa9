"""Activation calibration: one pass collects histograms, and every range method is derived from them.

The pass runs the ONNX graph on ONNX Runtime's CPU, or the backend's own model on its device where it offers a
``StatisticsCollector``; either merges the values into ``TensorStats`` (``autotune.quant.histogram``).

TensorRT 11 dropped its INT8 calibrators, so the ranges written into the Q/DQ nodes come from here for
every backend. Statistics are collected once per (model, data, tensors, bin count) and cached on disk;
``max``, ``percentile`` and ``entropy`` ranges are then computed from the same histograms, so switching
method never re-runs the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from autotune.model.shapes import infer_shapes
from autotune.quant.histogram import TensorStats
from autotune.run.files import atomic_write

logger = logging.getLogger(__name__)

METHODS = ("max", "percentile", "entropy")

_CACHE_FORMAT = 1

# Enough candidates to resolve the KL minimum to ~0.4 % of the range; trying all 2048 costs 4x for nothing.
_MAX_ENTROPY_CANDIDATES = 512

# Floor for Q where P has mass but Q has none (an empty last bin that received the outlier mass): the
# candidate gets a large but finite penalty instead of inf, so a histogram of such candidates still ranks.
_KL_EPSILON = 1e-10

# Divergences this close are ties (TensorRT's own search compares the floats as they come).
_KL_TIE = 1e-12


@dataclass(frozen=True)
class CalibrationSettings:
    """How histograms are built and how ranges are read from them.

    Attributes:
        percentile: The percentile of ``|x|`` used by the ``percentile`` method, in (0, 100].
        num_bins: Histogram bins over the first batch's ``[0, max|x|]``.
        entropy_target_bins: Quantized magnitude levels in the KL search (128 for 8-bit symmetric).
    """

    percentile: float = 99.99
    num_bins: int = 2048
    entropy_target_bins: int = 128

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.num_bins < 1:
            raise ValueError(f"num_bins must be at least 1, got {self.num_bins}")
        if self.entropy_target_bins < 1:
            raise ValueError(f"entropy_target_bins must be at least 1, got {self.entropy_target_bins}")


DEFAULT_SETTINGS = CalibrationSettings()
"""The defaults: 2048 bins, 99.99th percentile, 128 entropy levels (frozen, so safe to share)."""


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")


def amax(stats: TensorStats, method: str, settings: CalibrationSettings = DEFAULT_SETTINGS) -> float:
    """The magnitude to clip at, by ``method``.

    Args:
        stats: Statistics of one tensor.
        method: ``"max"``: ``max(|min|, |max|)``. ``"percentile"``: the upper edge of the bin where the
            cumulative count of ``|x|`` reaches ``settings.percentile`` %. ``"entropy"``: TensorRT's
            KL-divergence search (see :func:`_entropy_amax`).
        settings: Percentile and entropy parameters.

    Returns:
        A non-negative magnitude; 0.0 for a tensor with no values or only zeros.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.
    """
    _check_method(method)
    if stats.count == 0:
        return 0.0
    if method == "max":
        return _max_amax(stats)
    if method == "percentile":
        return _percentile_amax(stats, settings.percentile)
    return _entropy_amax(stats, settings.entropy_target_bins)


def _max_amax(stats: TensorStats) -> float:
    return float(max(abs(stats.min), abs(stats.max)))


def _percentile_amax(stats: TensorStats, percentile: float) -> float:
    cumulative = np.cumsum(stats.hist)
    needed = percentile / 100.0 * cumulative[-1]
    index = int(np.searchsorted(cumulative, needed, side="left"))
    index = min(index, len(stats.hist) - 1)  # float rounding of needed at 100 %
    return float((index + 1) * stats.bin_width)


def _kl_divergences(hist: np.ndarray, clips: np.ndarray, target_bins: int) -> np.ndarray:
    """KL(P || Q) for clipping the (float) histogram at each bin of ``clips`` (each at least ``target_bins``).

    P is ``hist[:clip]`` with the outlier mass ``hist[clip:]`` added to its last bin (clipped values saturate at
    the last level). Q is built from the kept bins only, as TensorRT does: they are merged into ``target_bins``
    contiguous groups (bin ``j`` into group ``j * target_bins // clip``) and each group's mass is spread evenly
    over its nonzero bins (an empty bin must stay empty after quantization, else Q invents mass where the data has
    none); the outlier mass sits in P's last bin and not in Q, which is what penalises clipping too much.

    Within a group every nonzero bin has the same Q, so the sum over bins collapses to one over groups, read from
    prefix sums: ``O(target_bins)`` per clip instead of ``O(clip)`` (the per-bin loop took 6 s of a YOLO-sized
    detector's 19 s layerwise calibration).
    """
    total = hist.sum()  # P's mass: the kept bins plus the outliers
    nonzero = hist > 0
    p_log_p = np.zeros_like(hist)
    p_log_p[nonzero] = hist[nonzero] / total * np.log(hist[nonzero] / total)
    mass_before = np.concatenate([[0.0], np.cumsum(hist)])
    count_before = np.concatenate([[0], np.cumsum(nonzero)])
    entropy_before = np.concatenate([[0.0], np.cumsum(p_log_p)])
    clip = np.asarray(clips)[:, None]
    edges = -((-np.arange(target_bins + 1)[None, :] * clip) // target_bins)  # group g spans [edges[g], edges[g+1])
    mass = np.diff(mass_before[edges], axis=1)
    count = np.diff(count_before[edges], axis=1)
    kept = mass_before[clip[:, 0]]  # Q's mass before normalising
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.log(np.maximum(mass / (np.maximum(count, 1) * kept[:, None]), _KL_EPSILON))
        cross = np.where(count > 0, mass / total * log_q, 0.0).sum(axis=1)
        last = hist[clip[:, 0] - 1]
        outliers = total - kept
        # The last bin holds the outliers in P: its own term, and its share of the cross term at its group's Q
        # (or at the floor, where the bin is empty and Q has nothing there).
        saturated = (last + outliers) / total
        own = np.where(saturated > 0, saturated * np.log(saturated), 0.0)
        entropy = entropy_before[clip[:, 0] - 1] + own
        cross += outliers / total * np.where(last > 0, log_q[:, -1], math.log(_KL_EPSILON))
        divergences = entropy - cross
    return np.where(kept > 0, divergences, math.inf)


def _entropy_candidates(num_bins: int, target_bins: int) -> list[int]:
    """Clip points (in bins) for the entropy search: ``target_bins..num_bins``, strided, ending at the top."""
    if num_bins <= target_bins:
        return [num_bins]
    stride = max(1, math.ceil((num_bins - target_bins + 1) / _MAX_ENTROPY_CANDIDATES))
    candidates = list(range(target_bins, num_bins + 1, stride))
    if candidates[-1] != num_bins:
        candidates.append(num_bins)
    return candidates


def _entropy_amax(stats: TensorStats, target_bins: int) -> float:
    """TensorRT's KL-divergence calibration (IInt8EntropyCalibrator2, ``_compute_amax_entropy``).

    For each candidate clip bin ``i``: P is ``hist[:i]`` with ``hist[i:]`` added to its last bin; Q is
    ``hist[:i]`` merged into ``target_bins`` groups and spread back evenly over each group's nonzero bins.
    The ``i`` with the smallest KL(P || Q) wins (the largest such ``i`` on ties, i.e. the least clipping);
    the result is its upper edge ``i * bin_width``.
    """
    if stats.bin_width == 0.0 or len(stats.hist) <= target_bins:
        return _max_amax(stats)  # no more bins than levels: nothing is lost by not clipping
    hist = stats.hist.astype(np.float64)
    # Bin 0 holds every exact zero (ReLU outputs, padding). Zero is representable exactly, yet a big spike
    # there dominates the KL and drives the search to over-clip; pytorch-quantization flattens it too.
    hist[0] = hist[1]
    candidates = np.asarray(_entropy_candidates(len(hist), target_bins))
    divergences = _kl_divergences(hist, candidates, target_bins)
    # Ties within rounding go to the least clipping: the closed form rounds differently from bin-by-bin sums.
    best = int(np.flatnonzero(divergences <= divergences.min() + _KL_TIE)[-1])
    return float(candidates[best] * stats.bin_width)


def activation_range(
    stats: TensorStats,
    method: str,
    settings: CalibrationSettings = DEFAULT_SETTINGS,
) -> tuple[float, float]:
    """The ``(lo, hi)`` range to quantize a tensor with.

    The clip magnitude from :func:`amax` is intersected with the observed ``[min, max]`` (so a ReLU output
    keeps ``lo = 0`` and asymmetric uint8 spends no levels on values that never occur), then widened to
    contain 0, because zero must be exactly representable (padding, ReLU).

    Returns:
        ``(lo, hi)`` as floats with ``lo <= 0 <= hi``.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.
    """
    clip = amax(stats, method, settings)
    lo = min(max(stats.min, -clip), 0.0)
    hi = max(min(stats.max, clip), 0.0)
    return float(lo), float(hi)


@dataclass
class Calibration:
    """Statistics of every quantizable tensor; ranges for any method are derived, not re-collected.

    Attributes:
        stats: Statistics by tensor name.
        settings: The settings used to build the histograms and read ranges from them.
    """

    stats: dict[str, TensorStats]
    settings: CalibrationSettings
    _ranges: dict[str, dict[str, tuple[float, float]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def ranges(self, method: str) -> dict[str, tuple[float, float]]:
        """``(lo, hi)`` for every tensor by ``method``; computed once per method.

        Raises:
            ValueError: ``method`` is not one of :data:`METHODS`.
        """
        _check_method(method)
        if method not in self._ranges:
            self._ranges[method] = {
                name: activation_range(stats, method, self.settings) for name, stats in self.stats.items()
            }
        return dict(self._ranges[method])


def _graph_tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = {value.name for value in graph.input}
    names.update(init.name for init in graph.initializer)
    for node in graph.node:
        names.update(name for name in node.output if name)
    return names


def _elem_types(model: onnx.ModelProto, wanted: Iterable[str]) -> dict[str, int]:
    """ONNX element types of ``wanted``; shape inference fills in those the model doesn't declare."""
    graph = model.graph
    declared = {
        value.name: value.type.tensor_type.elem_type
        for value in [*graph.input, *graph.value_info, *graph.output]
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type
    }
    missing = [name for name in wanted if name not in declared]
    if missing:
        try:
            inferred = infer_shapes(model).graph  # types only: the weights' bytes stay out of it
        except Exception as error:  # noqa: BLE001 - inference failures only cost the FLOAT default below
            logger.debug("shape inference failed (%s); assuming FLOAT for %s", error, missing)
        else:
            for value in inferred.value_info:
                if value.name in missing and value.type.tensor_type.elem_type:
                    declared[value.name] = value.type.tensor_type.elem_type
    return {name: declared.get(name, onnx.TensorProto.FLOAT) for name in wanted}


def session_with_outputs(model: onnx.ModelProto, outputs: Sequence[str]) -> ort.InferenceSession:
    """A CPU session of a copy of ``model`` that also returns the intermediate tensors ``outputs``."""
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    existing = {value.name for value in extended.graph.output}
    types = _elem_types(extended, [name for name in outputs if name not in existing])
    for name, elem_type in types.items():
        # No shape: ORT only needs name and type, and a wrong guessed shape would fail the session.
        extended.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    options = ort.SessionOptions()
    # Fusions rename or remove intermediate tensors; the requested names must survive.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = usable_cores()
    options.log_severity_level = 3
    return ort.InferenceSession(extended.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS has one: a pinned trial process's own)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def collect_statistics(
    model: onnx.ModelProto,
    tensors: Sequence[str],
    batches: Iterable[Mapping[str, np.ndarray]],
    num_bins: int = 2048,
) -> dict[str, TensorStats]:
    """Runs the model once over the calibration data and gathers statistics of ``tensors``.

    The requested tensors become extra outputs of a copy of the model, run on ORT's CPU provider with graph
    optimizations off so intermediate names survive. Graph inputs are read from the batch and constant
    initializers from the model, without running anything for them. The copy is serialized in memory, so
    models over protobuf's 2 GB limit are not supported.

    Args:
        model: The FP32 model.
        tensors: Names of the tensors to calibrate.
        batches: Feeds by input name; consumed once, so a generator is fine. Keys that are not model
            inputs are ignored.
        num_bins: Histogram bins over the first batch's range.

    Returns:
        Statistics by tensor name, in the order of ``tensors``.

    Raises:
        ValueError: A tensor is not in the graph, a batch lacks a model input, a tensor has NaN or Inf
            values (the message names it and the 0-based batch index), or ``batches`` is empty.
    """
    names = list(dict.fromkeys(tensors))
    graph = model.graph
    known = _graph_tensor_names(graph)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"tensors not in the graph: {', '.join(map(repr, unknown))}")
    initializers = {init.name: init for init in graph.initializer}
    fed = {value.name for value in graph.input if value.name not in initializers}
    constants = {name: numpy_helper.to_array(initializers[name]) for name in names if name in initializers}
    fetch = [name for name in names if name not in fed and name not in constants]

    stats = {name: TensorStats.empty(num_bins) for name in names}
    session = session_with_outputs(model, fetch) if fetch else None
    required = [value.name for value in session.get_inputs()] if session else sorted(fed)
    seen = 0
    for index, batch in enumerate(batches):
        missing = [name for name in required if name not in batch]
        if missing:
            raise ValueError(f"calibration batch {index} lacks model inputs {missing}")
        values: dict[str, np.ndarray] = {name: np.asarray(batch[name]) for name in names if name in fed}
        values.update(constants)
        if session is not None:
            feed = {name: np.asarray(batch[name]) for name in required}
            values.update(zip(fetch, session.run(fetch, feed), strict=True))
        merge_batch(stats, values, index)
        seen += 1
    if seen == 0:
        raise ValueError("calibration data is empty")
    return stats


def merge_batch(stats: Mapping[str, TensorStats], values: Mapping[str, np.ndarray], index: int) -> None:
    """Merges one calibration batch's values into the statistics of every tensor, a thread per core.

    Raises:
        ValueError: A tensor has NaN or Inf values (the message names it and the 0-based batch ``index``).
    """
    names = list(stats)
    # One thread per core: numpy releases the GIL in the passes over each tensor, and a batch of the
    # BERT-large-shaped encoder took 26 s to merge one tensor after another on the H200 machine's CPU.
    with ThreadPoolExecutor(usable_cores()) as pool:
        nonfinite = pool.map(_merge, [stats[name] for name in names], [values[name] for name in names])
        failed = [name for name, bad in zip(names, nonfinite, strict=True) if bad]
    if failed:
        raise nonfinite_error(failed[0], index)


def nonfinite_error(tensor: str, index: int) -> ValueError:
    """The error of a calibration tensor with NaN or Inf values on batch ``index`` (0-based)."""
    return ValueError(f"tensor {tensor!r} has NaN/Inf values on calibration batch {index}; check the calibration data")


def _merge(stats: TensorStats, values: np.ndarray) -> bool:
    """Merges one batch of a tensor into its statistics; True where its values are not finite (nothing merged)."""
    try:
        stats.update(values)
    except ValueError:
        return True
    return False


def data_hash(batches: Sequence[Mapping[str, np.ndarray]]) -> str:
    """A content hash of the calibration data: names, dtypes, shapes and bytes, in batch order.

    Returns:
        16 hex characters.
    """
    digest = hashlib.sha256()
    digest.update(f"batches={len(batches)}".encode())
    for batch in batches:
        for name in sorted(batch):
            array = np.ascontiguousarray(batch[name])
            digest.update(f"|{name}|{array.dtype.str}|{array.shape}|".encode())
            digest.update(array.data if array.size else b"")
    return digest.hexdigest()[:16]


def _cache_path(
    cache_dir: Path,
    model_hash: str,
    data_key: str,
    tensors: Sequence[str],
    settings: CalibrationSettings,
    source: str | None = None,
) -> Path:
    # Only num_bins changes the histograms; percentile and entropy settings are applied when ranges are
    # read, so they stay out of the key and one cache serves every setting of them. ONNX Runtime's values have
    # no source in the key, so the caches written before collectors existed stay valid.
    fields: dict[str, Any] = {"format": _CACHE_FORMAT, "tensors": sorted(set(tensors)), "num_bins": settings.num_bins}
    key = json.dumps(fields if source is None else {**fields, "source": source})
    key_hash = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"calibration-{model_hash[:16]}-{data_key}-{key_hash}.json"


def read_cache(path: Path, version: int) -> dict[str, Any] | None:
    """A cache file's JSON object, or None when there is no file.

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not JSON, or not of format ``version``.
    """
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != version:
        raise ValueError(f"cache format {data.get('format') if isinstance(data, dict) else None!r}, expected {version}")
    return data


def _load_cache(path: Path, tensors: Sequence[str]) -> dict[str, TensorStats] | None:
    """The cached statistics, or None when the file is missing, corrupt or for other tensors."""
    try:
        data = read_cache(path, _CACHE_FORMAT)
        if data is None:
            return None
        stats = {name: TensorStats.from_dict(value) for name, value in data["stats"].items()}
        if set(stats) != set(tensors):
            raise ValueError("cached tensors differ from the requested ones")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("ignoring unreadable calibration cache %s (%s); recalibrating", path, error)
        return None
    return {name: stats[name] for name in dict.fromkeys(tensors)}


def _write_cache(path: Path, stats: Mapping[str, TensorStats]) -> None:
    atomic_write(path, json.dumps({"format": _CACHE_FORMAT, "stats": {name: s.to_dict() for name, s in stats.items()}}))


@dataclass(frozen=True)
class StatisticsCollector:
    """Where a backend gathers the activation statistics itself, instead of ONNX Runtime running the ONNX graph.

    Attributes:
        source: Names where the values come from (``torch:cuda``, say): a cache entry is kept per source, since
            another runtime's float32 arithmetic gives other last bits.
        collect: ``collect(batches, num_bins)``: statistics of every requested tensor, merged batch by batch
            (``merge_batch``); raises ValueError as :func:`collect_statistics` does.
    """

    source: str
    collect: Callable[[Sequence[Mapping[str, np.ndarray]], int], dict[str, TensorStats]]


def calibrate(
    model: onnx.ModelProto,
    tensors: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    cache_dir: Path | None,
    model_hash: str,
    settings: CalibrationSettings = DEFAULT_SETTINGS,
    collector: StatisticsCollector | None = None,
) -> Calibration:
    """Calibrates ``tensors``, reusing statistics cached on disk.

    The cache file is keyed by ``model_hash``, :func:`data_hash` of ``batches``, the sorted tensor list
    and ``settings.num_bins``. A hit skips ORT entirely; a corrupt file is logged, ignored and rewritten; a cache
    that cannot be written (read-only folder, full disk) is logged and skipped.

    Args:
        model: The FP32 model.
        tensors: Names of the tensors to calibrate.
        batches: Calibration feeds by input name.
        cache_dir: Directory for the cache, or None for no caching.
        model_hash: Content hash of ``model`` (``LoadedModel.hash``).
        settings: Histogram and range settings.
        collector: The backend's own collection of the same tensors' values; None: ONNX Runtime runs the model.

    Returns:
        Statistics of every tensor, ready for :meth:`Calibration.ranges`.

    Raises:
        ValueError: As :func:`collect_statistics`.
    """
    path = None
    if cache_dir is not None:
        source = None if collector is None else collector.source
        path = _cache_path(Path(cache_dir), model_hash, data_hash(batches), tensors, settings, source)
        cached = _load_cache(path, tensors)
        if cached is not None:
            logger.debug("calibration statistics from %s", path)
            return Calibration(stats=cached, settings=settings)
    if collector is not None:
        stats = collector.collect(batches, settings.num_bins)
    else:
        stats = collect_statistics(model, tensors, batches, num_bins=settings.num_bins)
    if path is not None:
        try:
            _write_cache(path, stats)
        except OSError as error:  # a cache that cannot be written (read-only, full disk) only costs time
            logger.warning(
                "cannot write the calibration cache %s (%s); set cache_dir to a writable folder", path, error
            )
    return Calibration(stats=stats, settings=settings)
