"""Quantization parameters against the ONNX reference implementation and exact arithmetic.

``tests/quant/test_rewrite.py`` checks the rewritten graphs against these functions; here the functions
themselves are checked against ONNX's own ``QuantizeLinear``/``DequantizeLinear`` (``onnx.reference``, pure numpy:
no runtime kernel, so the results hold on every CPU) and against the arithmetic their docstrings state.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from autotune.quant.qparams import (
    FP8_MAX,
    activation_qparams,
    fake_quant,
    fp8_activation_scale,
    pooling_scale_bounds,
    quantize_bias_int32,
    quantize_weight,
    quantize_weight_fp8,
)

_ONNX_TYPES = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8, "int32": TensorProto.INT32}


def _onnx_qdq(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: str, axis: int = 1) -> np.ndarray:
    """QuantizeLinear then DequantizeLinear as the ONNX reference evaluator computes them (opset 21)."""
    zero = numpy_helper.from_array(np.asarray(zero_point).astype(np.dtype(dtype)), "zero")
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], axis=axis),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], axis=axis),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [numpy_helper.from_array(np.asarray(scale, np.float32), "scale"), zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_fake_quant_is_onnx_quantize_then_dequantize(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4, 5)) * 4).astype(np.float32)
    x[0, 0, :3] = [0.5, 1.5, 2.5]  # exact halves: round half to even
    x[1, 1, :2] = [1e4, -1e4]  # saturates
    scale, zero = activation_qparams(-3.0, 5.0, dtype)
    np.testing.assert_array_equal(fake_quant(x, scale, zero, dtype), _onnx_qdq(x, scale, zero, dtype))
    scales = np.array([0.5, 1.0, 0.03, 2.0], np.float32)
    zeros = np.array([0, 3, 7, 1]) if dtype == "uint8" else np.zeros(4, int)
    np.testing.assert_array_equal(fake_quant(x, scales, zeros, dtype, axis=1), _onnx_qdq(x, scales, zeros, dtype, 1))
    np.testing.assert_array_equal(fake_quant(x, scales, zeros, dtype, axis=-2), _onnx_qdq(x, scales, zeros, dtype, 1))


def test_fake_quant_of_int32_keeps_large_zero_points_exact_and_refuses_unknown_types():
    x = np.array([1.0, -2.0, 3.0e9], np.float32)
    np.testing.assert_array_equal(fake_quant(x, 1.0, 2**30, "int32"), np.float32([1.0, -2.0, 2**31 - 1 - 2**30]))
    with pytest.raises(ValueError, match="unknown quantized dtype 'int4'"):
        fake_quant(x, 1.0, 0, "int4")


def test_activation_qparams_map_the_range_onto_the_integers_and_clamp_into_bounds():
    scale, zero = activation_qparams(-1.0, 3.0, "uint8")
    assert scale == np.float32(4.0 / 255) and zero == np.uint8(64)  # round(1 / (4 / 255)) = round(63.75)
    assert fake_quant(np.float32(-1.0), scale, zero, "uint8") == pytest.approx(-1.0, abs=float(scale) / 2)
    clamped, clamped_zero = activation_qparams(-1.0, 3.0, "uint8", scale_bounds=(0.1, 1.0))
    assert clamped == np.float32(0.1) and clamped_zero == np.uint8(10)  # the zero point follows the scale
    assert activation_qparams(-1.0, 3.0, "int8", scale_bounds=(0.0, 0.01))[0] == np.float32(0.01)
    for bad in (np.inf, np.nan):
        with pytest.raises(ValueError, match="is not finite"):
            activation_qparams(0.0, bad, "uint8")
        with pytest.raises(ValueError, match="is not finite"):
            fp8_activation_scale(bad, 1.0)
    assert activation_qparams(0.0, 1e-45, "uint8")[0] == np.float32(1.0)  # a denormal scale falls back to 1


def test_pooling_scale_bounds_keep_the_integer_pool_ratio_inside_what_ort_accepts():
    smallest, largest = pooling_scale_bounds(0.02, 49)
    for output_scale in (smallest, largest):
        ratio = 0.02 / (output_scale * 49)
        assert 2.0**-32 <= ratio < 256
    assert 0.02 / (smallest * 49) == pytest.approx(255.0)
    assert pooling_scale_bounds(0.02, 0) == pooling_scale_bounds(0.02, 1)  # nothing pooled counts as one


def test_seven_bit_weights_use_the_grid_up_to_64_and_qmax_is_checked():
    w = np.array([[1.0, -0.5], [0.25, 2.0]], np.float32)
    q, scales = quantize_weight(w, 1, per_channel=True, qmax=64)
    np.testing.assert_array_equal(scales, np.float32([1.0, 2.0]) / np.float32(64))
    np.testing.assert_array_equal(q, [[64, -16], [16, 64]])
    assert q.dtype == np.int8 and np.abs(q).max() == 64
    for qmax in (0, 128):
        with pytest.raises(ValueError, match=r"qmax must be in \[1, 127\]"):
            quantize_weight(w, 1, True, qmax=qmax)
    with pytest.raises(ValueError, match="needs the weight's channel axis"):
        quantize_weight(w, None, per_channel=True)


def test_fp8_weights_per_tensor_put_the_largest_magnitude_on_448():
    w = np.array([[896.0, -1.0], [2.0, 0.0]], np.float32)
    q, scale = quantize_weight_fp8(w, None, per_channel=False)
    assert scale.shape == () and scale == np.float32(2.0)
    np.testing.assert_array_equal(q.astype(np.float32) * scale, [[896.0, -1.0], [2.0, 0.0]])
    assert float(q.astype(np.float32).max()) == FP8_MAX


def test_an_int32_bias_saturates_instead_of_wrapping():
    q = quantize_bias_int32(np.array([1.0, -1.0, 0.5, 2.5]), np.array([1e-12, 1e-12, 1.0, 1.0]))
    np.testing.assert_array_equal(q, [2**31 - 1, -(2**31), 0, 2])
    assert q.dtype == np.int32


def test_a_least_zero_point_shifts_a_range_that_starts_at_zero_and_leaves_the_others():
    assert activation_qparams(0.0, 5.1, "uint8") == (np.float32(0.02), np.uint8(0))
    scale, zero = activation_qparams(0.0, 5.1, "uint8", min_zero_point=1)
    assert zero == np.uint8(1) and scale == np.float32(5.1 / 254)  # 0 and 5.1 stay on the grid's ends
    assert fake_quant(np.float32(5.1), scale, zero, "uint8") == pytest.approx(5.1, rel=1e-6)
    assert activation_qparams(-1e-4, 5.1, "uint8", min_zero_point=1)[1] == np.uint8(1)  # would round to 0
    assert activation_qparams(-1.0, 3.0, "uint8", min_zero_point=1) == activation_qparams(-1.0, 3.0, "uint8")
    assert activation_qparams(0.0, 5.1, "int8", min_zero_point=1)[1] == np.int8(0)  # symmetric: no zero point
