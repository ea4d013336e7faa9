"""Quantization parameters: activation scales and zero points, weight quantization, a numpy Q/DQ reference.

Everything here follows ONNX ``QuantizeLinear``/``DequantizeLinear`` semantics:
``q = saturate(round(x / scale) + zero_point)`` with round-half-to-even, and
``x' = (q - zero_point) * scale``, all in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
"""Largest finite FLOAT8E4M3FN value; FP8 scales map the calibrated amax onto it."""

_INT_RANGES: dict[str, tuple[int, int]] = {
    "uint8": (0, 255),
    "int8": (-128, 127),
    "int32": (-(2**31), 2**31 - 1),
}

_FP8_DTYPES = {"float8e4m3fn": ml_dtypes.float8_e4m3fn}

_FALLBACK_SCALE = np.float32(1.0)
"""Scale used when the range is empty (a constant-zero tensor). Any positive scale is exact there;
1.0 (as ORT's quantizer does) keeps a derived int32 bias scale (act_scale * weight_scale) far from
int32 overflow."""


def _safe_scale(scale: np.ndarray | np.floating) -> np.ndarray:
    """Replaces zero, denormal or non-finite scales by ``_FALLBACK_SCALE``.

    TensorRT rejects scales that are not strictly positive, and a zero scale would divide by zero.
    """
    scale = np.asarray(scale, dtype=np.float32)
    bad = ~np.isfinite(scale) | (scale < np.finfo(np.float32).tiny)
    return np.where(bad, _FALLBACK_SCALE, scale).astype(np.float32)


def activation_qparams(
    lo: float, hi: float, dtype: str, scale_bounds: tuple[float, float] | None = None, min_zero_point: int = 0
) -> tuple[np.float32, np.uint8 | np.int8]:
    """Scale and zero point for an activation with calibrated range ``[lo, hi]``.

    Args:
        lo: Calibrated minimum (widened to include 0, so that 0 is exactly representable).
        hi: Calibrated maximum (widened to include 0).
        dtype: ``"uint8"`` (asymmetric) or ``"int8"`` (symmetric, zero point 0).
        scale_bounds: ``(smallest, largest)`` scale an integer kernel can requantize to (see
            :func:`pooling_scale_bounds`); the scale is clamped into it and the zero point follows.
        min_zero_point: The least uint8 zero point (``QuantRecipe.min_matmul_zero_point``): a range that starts at 0
            (after a Relu) would take 0; it takes this instead, its range widened below 0 by so many steps.

    Returns:
        ``(scale, zero_point)``: a strictly positive float32 scale and a zero point of ``dtype``.

    Raises:
        ValueError: ``dtype`` is not uint8 or int8, or the range is not finite.
    """
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(f"calibrated range [{lo}, {hi}] is not finite")
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if dtype == "uint8" and np.rint(-lo * 255.0 / max(hi - lo, 1e-30)) < min_zero_point:
        lo = -hi * min_zero_point / (255.0 - min_zero_point)  # the zero point lands on min_zero_point
    if dtype == "uint8":
        scale = _safe_scale(np.float32((hi - lo) / 255.0))
    elif dtype == "int8":
        scale = _safe_scale(np.float32(max(abs(lo), abs(hi)) / 127.0))
    else:
        raise ValueError(f"activation dtype must be 'uint8' or 'int8', not {dtype!r}")
    if scale_bounds is not None:
        scale = _safe_scale(np.clip(scale, np.float32(scale_bounds[0]), np.float32(scale_bounds[1])))
    if dtype == "int8":
        return np.float32(scale), np.int8(0)
    return np.float32(scale), np.uint8(np.clip(np.rint(-lo / float(scale)), 0, 255))


def pooling_scale_bounds(input_scale: float, pooled: int) -> tuple[float, float]:
    """The output scales an integer average pooling of ``pooled`` values can requantize ``input_scale`` to.

    ONNX Runtime's QLinearGlobalAveragePool refuses ``input_scale / (output_scale * pooled)`` outside
    ``[2^-32, 256)``: the output would be constant. Calibrated ranges never get there (an average lies within the
    range of what it averages), but ranges chosen apart for input and output (layerwise methods) might.
    """
    pooled = max(int(pooled), 1)
    smallest = float(input_scale) / (pooled * 255.0)  # a margin under 256 against float32 rounding
    largest = float(input_scale) * 2.0**31 / pooled
    return smallest, largest


def fp8_activation_scale(lo: float, hi: float) -> np.float32:
    """Symmetric FLOAT8E4M3FN scale ``amax / 448`` for an activation in ``[lo, hi]`` (zero point 0)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(f"calibrated range [{lo}, {hi}] is not finite")
    return np.float32(_safe_scale(np.float32(max(abs(float(lo)), abs(float(hi))) / FP8_MAX)))


def _channel_amax(w: np.ndarray, axis: int | None, per_channel: bool) -> tuple[np.ndarray, int | None]:
    """Absolute maximum per channel along ``axis`` (returned non-negative), or over the whole tensor."""
    w = np.asarray(w, dtype=np.float32)
    if not per_channel:
        return np.asarray(np.max(np.abs(w)) if w.size else 0.0, dtype=np.float32), None
    if axis is None:
        raise ValueError("per-channel quantization needs the weight's channel axis")
    axis = int(axis) % w.ndim
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    return np.max(np.abs(w), axis=reduce).astype(np.float32), axis


def _broadcast(values: np.ndarray, ndim: int, axis: int | None) -> np.ndarray:
    """Reshapes per-channel ``values`` so they broadcast along ``axis`` of an ``ndim``-D tensor."""
    values = np.asarray(values)
    if axis is None or values.ndim == 0:
        return values
    shape = [1] * ndim
    shape[int(axis) % ndim] = values.size
    return values.reshape(shape)


def in_scale_type(scales: np.ndarray | np.floating, scale_type: type | None) -> np.ndarray:
    """Scales rounded to the values ``scale_type`` (``np.float16``, ``ml_dtypes.bfloat16``) holds, as float32.

    A graph that computes in FP16/BF16 stores its Q/DQ scales in that type (TensorRT: a half scale must match the
    type it quantizes, and the DQ output, which is the scale's type, must match the consumer's). Quantizing
    against the rounded scale keeps Q and DQ exact; a scale under the type's smallest normal value is raised to
    it, so no scale underflows to zero or to an imprecise subnormal. None leaves float32 scales as they are.
    """
    values = np.asarray(scales, dtype=np.float32)
    if scale_type is None:
        return values
    info = ml_dtypes.finfo(scale_type)
    clipped = np.clip(values, np.float32(info.tiny), np.float32(info.max))
    return clipped.astype(scale_type).astype(np.float32)


def quantize_weight(
    w: np.ndarray,
    axis: int | None,
    per_channel: bool,
    floor: np.ndarray | None = None,
    scale_type: type | None = None,
    qmax: int = 127,
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weight quantization (zero point 0, range [-qmax, qmax]).

    Args:
        w: The float weight.
        axis: The output-channel axis (may be negative); used when ``per_channel``.
        per_channel: One scale per index of ``axis``; otherwise one scale for the whole tensor.
        floor: Smallest allowed scales (same shape as the scales), e.g. from :func:`int32_bias_floor`.
        scale_type: The type the scales are stored in (:func:`in_scale_type`); None: float32.
        qmax: The largest integer magnitude: 127, or 64 for 7-bit weights (``QuantRecipe.weight_max``).

    Returns:
        ``(q, scales)``: the int8 weight and float32 scales (1-D per channel, 0-d per tensor).
        All-zero channels get a scale of 1.0, so every scale is strictly positive.
    """
    w = np.asarray(w, dtype=np.float32)
    amax, norm_axis = _channel_amax(w, axis, per_channel)
    if not 0 < qmax <= 127:
        raise ValueError(f"qmax must be in [1, 127], not {qmax}")
    scales = _safe_scale(amax / np.float32(qmax))
    if floor is not None:
        scales = np.maximum(scales, np.asarray(floor, dtype=np.float32)).astype(np.float32)
    scales = in_scale_type(scales, scale_type)
    q = np.clip(np.rint(w / _broadcast(scales, w.ndim, norm_axis)), -qmax, qmax).astype(np.int8)
    return q, scales


def quantize_weight_fp8(
    w: np.ndarray, axis: int | None, per_channel: bool, scale_type: type | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric FLOAT8E4M3FN weight quantization with scale ``amax / 448``.

    Args:
        w: The float weight.
        axis: The output-channel axis (may be negative); used when ``per_channel``.
        per_channel: One scale per index of ``axis``; otherwise one scale for the whole tensor.
        scale_type: The type the scales are stored in (:func:`in_scale_type`); None: float32.

    Returns:
        ``(q, scales)``: the weight as an ``ml_dtypes.float8_e4m3fn`` array and float32 scales.
    """
    w = np.asarray(w, dtype=np.float32)
    amax, norm_axis = _channel_amax(w, axis, per_channel)
    scales = in_scale_type(_safe_scale(amax / np.float32(FP8_MAX)), scale_type)
    scaled = np.clip(w / _broadcast(scales, w.ndim, norm_axis), -FP8_MAX, FP8_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn), scales


def int32_bias_floor(bias: np.ndarray, act_scale: float, scale_shape: tuple[int, ...]) -> np.ndarray:
    """The smallest weight scales whose int32 bias (scale ``act_scale * weight_scale``) holds ``bias`` unclipped.

    A channel whose weights are all near zero (BatchNorm folded into a channel it switched off) gets a tiny
    weight scale, and its bias divided by ``act_scale * weight_scale`` overflows int32 by orders of magnitude:
    clipped, the channel's output is wrong by most of its bias. Raising that channel's weight scale costs only
    the resolution of weights that are near zero anyway (ONNX Runtime's quantizer does the same).

    Args:
        bias: The float bias, one value per output channel.
        act_scale: The scale of the layer's input.
        scale_shape: Shape of the weight scales: ``()`` per tensor, ``(C,)`` per channel (``C`` may divide the
            bias length: ConvTranspose groups repeat each weight channel).

    Returns:
        float32 floors in ``scale_shape``.
    """
    magnitude = np.abs(np.asarray(bias, dtype=np.float64)).ravel()
    if not scale_shape:
        magnitude = magnitude.max(initial=0.0)
    else:
        magnitude = magnitude.reshape(-1, scale_shape[0]).max(axis=0)
    limit = float(_INT_RANGES["int32"][1])
    # A relative margin keeps float32 rounding of the product from landing the bias one step past the limit.
    return (magnitude * 1.0001 / limit / max(float(act_scale), float(np.finfo(np.float32).tiny))).astype(np.float32)


def quantize_bias_int32(bias: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Quantizes a bias to int32 with ``scales`` (act_scale * weight_scales, zero point 0), saturating."""
    lo, hi = _INT_RANGES["int32"]
    scaled = np.asarray(bias, dtype=np.float64) / np.asarray(scales, dtype=np.float64)
    return np.clip(np.rint(scaled), lo, hi).astype(np.int32)


def fake_quant(
    x: np.ndarray,
    scale: np.ndarray | float,
    zero_point: np.ndarray | int | float,
    dtype: str,
    axis: int | None = None,
) -> np.ndarray:
    """Numpy reference of ``QuantizeLinear`` then ``DequantizeLinear``.

    Args:
        x: Float input.
        scale: Scalar or per-channel scale.
        zero_point: Scalar or per-channel zero point (0 for symmetric and FP8).
        dtype: ``"uint8"``, ``"int8"``, ``"int32"`` or ``"float8e4m3fn"``.
        axis: The channel axis for per-channel ``scale`` (may be negative).

    Returns:
        The float32 result of quantizing and dequantizing ``x``, with saturation and round-half-to-even.

    Raises:
        ValueError: ``dtype`` is unknown.
    """
    x = np.asarray(x, dtype=np.float32)
    scale = _broadcast(np.asarray(scale, dtype=np.float32), x.ndim, axis)
    if dtype in _FP8_DTYPES:
        # ONNX saturate=1: clamp to the largest finite value, then round to nearest even in float8.
        scaled = np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(_FP8_DTYPES[dtype])
        return (scaled.astype(np.float32) * scale).astype(np.float32)
    if dtype not in _INT_RANGES:
        raise ValueError(f"unknown quantized dtype {dtype!r}")
    lo, hi = _INT_RANGES[dtype]
    zp = _broadcast(np.asarray(zero_point, dtype=np.float64), x.ndim, axis)
    # Divide in float32 like the ONNX reference; add the zero point in float64 so int32 values stay exact.
    q = np.clip(np.rint(x / scale).astype(np.float64) + zp, lo, hi)
    return ((q - zp) * scale.astype(np.float64)).astype(np.float32)
