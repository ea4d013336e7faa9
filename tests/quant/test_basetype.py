"""The base-precision pieces: scales in a half type, ops kept FP32 for range."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

from autotune.quant.basetype import range_float_ops
from autotune.quant.qparams import in_scale_type, quantize_weight


def test_scales_in_a_half_type_are_exact_there_and_never_underflow():
    scales = np.array([1e-9, 3e-6, 0.0123456, 7.0], dtype=np.float32)
    half = in_scale_type(scales, np.float16)
    assert half.dtype == np.float32 and np.all(half >= np.finfo(np.float16).tiny)
    np.testing.assert_array_equal(half.astype(np.float16).astype(np.float32), half)  # representable
    assert abs(half[2] - scales[2]) / scales[2] < 2**-10
    brain = in_scale_type(scales, ml_dtypes.bfloat16)
    assert brain[0] > 0 and np.all(brain.astype(ml_dtypes.bfloat16).astype(np.float32) == brain)
    np.testing.assert_array_equal(in_scale_type(scales, None), scales)


def test_weights_are_quantized_against_the_rounded_scales():
    w = np.array([[1e-6, -2e-6], [0.5, -0.25]], dtype=np.float32)
    q, scales = quantize_weight(w, 0, True, scale_type=np.float16)
    assert scales[0] == np.float32(np.finfo(np.float16).tiny)  # the tiny channel's scale is floored
    np.testing.assert_array_equal(q, np.clip(np.rint(w / scales[:, None]), -127, 127))


def test_only_an_fp16_base_keeps_the_variance_fp32():
    nodes = [
        helper.make_node("Pow", ["c", "two"], ["sq"], "pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], "var"),
        helper.make_node("Add", ["var", "eps"], ["ve"], "eps_add"),
        helper.make_node("Sqrt", ["ve"], ["std"], "sqrt"),
        helper.make_node("Div", ["c", "std"], ["y"], "div"),
        helper.make_node("Add", ["y", "c"], ["z"], "after"),
    ]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 4])], [])
    kept = range_float_ops(graph, "fp16")
    assert set(kept) == {"pow", "var", "eps_add", "sqrt"} and "overflows FP16" in kept["pow"]
    assert range_float_ops(graph, "bf16") == {} and range_float_ops(graph, "fp32") == {}
