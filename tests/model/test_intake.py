"""Tests for autotune.model.intake: Constant weight chains folded into initializers, and why a model has no layer."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.model.intake import fold_weight_constants
from autotune.model.layers import ModelError, model_hash, prepare_model
from autotune.plan import Plan
from autotune.quant.placement import required_ranges
from autotune.quant.recipe import ORT_X86
from autotune.quant.rewrite import rewrite
from autotune.testing import constant_weight_twins, tiny_mlp

F = TensorProto.FLOAT
X = np.random.default_rng(7).standard_normal((2, 3, 8, 8)).astype(np.float32)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _prepare(model: onnx.ModelProto):
    return prepare_model(model, Path("m.onnx"), None)


# ---------------------------------------------------------------------------------------------
# a model whose weights are Constant chains tunes as its initializer twin
# ---------------------------------------------------------------------------------------------


def test_a_constant_weight_model_has_the_layer_table_of_its_initializer_twin():
    with_constants, with_initializers = constant_weight_twins()
    assert not with_constants.graph.initializer  # as the exporters in question write it
    folded, twin = _prepare(with_constants), _prepare(with_initializers)
    assert folded.layer_names == ["conv", "fc", "head"]
    assert [dataclasses.replace(layer, weight_source=None) for layer in folded.layers] == [
        dataclasses.replace(layer, weight_source=None) for layer in twin.layers
    ]
    assert [layer.weight_source for layer in folded.layers] == [
        "Constant",
        "Constant+Transpose",
        "Constant+Cast+Reshape",
    ]
    assert [layer.weight_source for layer in twin.layers] == ["initializer"] * 3
    assert [layer.bias for layer in folded.layers] == ["conv.b", None, "head.b"]
    assert folded.float_ops == twin.float_ops
    for name in ("conv.w", "conv.b", "fc.wt", "head.w", "head.b"):
        np.testing.assert_array_equal(_initializer(folded.proto, name), _initializer(twin.proto, name))


def test_the_folded_model_runs_as_the_file_did_and_keeps_the_constants_that_feed_no_weight():
    with_constants, _ = constant_weight_twins()
    expected = _run(with_constants, {"x": X})
    folded = _prepare(copy.deepcopy(with_constants))
    np.testing.assert_array_equal(_run(folded.proto, {"x": X}), expected)
    assert [node.op_type for node in folded.proto.graph.node] == [
        "Constant",  # the Reshape's shape
        "Constant",  # the Add's bias (no weighted op reads it)
        "Conv",
        "Relu",
        "Reshape",
        "MatMul",
        "Add",
        "Gemm",
    ]
    assert folded.hash == model_hash(folded.proto)  # the hash is that of the graph the run calibrates and exports


def _int8_output(model: onnx.ModelProto) -> np.ndarray:
    loaded = _prepare(model)
    ranges = {name: (-4.0, 4.0) for name in required_ranges(loaded.layers, ORT_X86, loaded.proto)}
    plan = Plan.make({name: "int8" for name in loaded.layer_names})
    lowered = rewrite(loaded.proto, loaded.layers, plan, ranges, ORT_X86)
    assert sum(node.op_type == "QuantizeLinear" for node in lowered.graph.node) >= 3
    return _run(lowered, {"x": X})


def test_constant_weight_twins_lower_to_the_same_int8_numbers():
    with_constants, with_initializers = constant_weight_twins()
    int8 = _int8_output(with_constants)
    np.testing.assert_array_equal(int8, _int8_output(with_initializers))
    assert not np.array_equal(int8, _run(with_initializers, {"x": X}))  # quantized indeed, not the FP32 model


# ---------------------------------------------------------------------------------------------
# what is folded, and what is left alone
# ---------------------------------------------------------------------------------------------


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(init for init in model.graph.initializer if init.name == name))


def _gemm_with_bias(**bias_value) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    nodes = [
        helper.make_node("Constant", [], ["w"], name="w.const", value=weight),
        helper.make_node("Constant", [], ["b"], name="b.const", **bias_value),
        helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1),
    ]
    return _model(
        nodes, [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_tensor_value_info("y", F, [2, 4])]
    )


@pytest.mark.parametrize(
    ("bias_value", "expected"),
    [
        ({"value": numpy_helper.from_array(np.ones(4, np.float32))}, np.ones(4)),
        ({"value_floats": [0.5, 1.5, 2.5, 3.5]}, [0.5, 1.5, 2.5, 3.5]),
        ({"value_float": 0.25}, 0.25),
    ],
)
def test_each_attribute_form_of_a_constant_folds_to_its_value(bias_value, expected):
    model = _gemm_with_bias(**bias_value)
    expected_output = _run(model, {"x": np.ones((2, 3), np.float32)})
    assert fold_weight_constants(model) == {"w": "Constant", "b": "Constant"}
    assert [node.name for node in model.graph.node] == ["gemm"]
    np.testing.assert_array_equal(_initializer(model, "b"), np.asarray(expected, np.float32))
    np.testing.assert_array_equal(_initializer(model, "w"), np.arange(12, dtype=np.float32).reshape(4, 3))
    np.testing.assert_array_equal(_run(model, {"x": np.ones((2, 3), np.float32)}), expected_output)


def test_a_model_with_initializers_is_left_byte_identical():
    """Models that need no folding keep their bytes, so the hashes of earlier runs (and their caches) stay valid."""
    clip_bounds = [
        helper.make_node("Constant", [], ["lo"], name="lo", value=numpy_helper.from_array(np.float32(0))),
        helper.make_node("Constant", [], ["hi"], name="hi", value=numpy_helper.from_array(np.float32(6))),
        helper.make_node("Clip", ["logits", "lo", "hi"], ["clipped"], name="clip"),
    ]
    with_constant_bounds = tiny_mlp()
    with_constant_bounds.graph.node.extend(clip_bounds)
    with_constant_bounds.graph.output[0].name = "clipped"
    for model in (tiny_mlp(), with_constant_bounds):
        before = model.SerializeToString(deterministic=True)
        assert fold_weight_constants(model) == {}
        assert model.SerializeToString(deterministic=True) == before


def test_a_chain_that_reads_a_graph_input_is_not_folded():
    nodes = [
        helper.make_node("Transpose", ["w_in"], ["w"], name="transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3]), helper.make_tensor_value_info("w_in", F, [4, 3])],
        [helper.make_tensor_value_info("y", F, [2, 4])],
    )
    before = model.SerializeToString(deterministic=True)
    assert fold_weight_constants(model) == {}
    assert model.SerializeToString(deterministic=True) == before


def test_a_constant_that_feeds_another_op_too_stays_for_it():
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    nodes = [
        helper.make_node("Constant", [], ["w"], name="w.const", value=weight),
        helper.make_node("Transpose", ["w"], ["wt"], name="transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
        helper.make_node("ReduceSum", ["w"], ["s"], name="sum", keepdims=0),
        helper.make_node("Add", ["h", "s"], ["y"], name="add"),
    ]
    model = _model(
        nodes, [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_tensor_value_info("y", F, [2, 4])]
    )
    expected = _run(model, {"x": np.ones((2, 3), np.float32)})
    assert fold_weight_constants(model) == {"wt": "Constant+Transpose"}
    assert [node.name for node in model.graph.node] == ["w.const", "mm", "sum", "add"]
    np.testing.assert_array_equal(_run(model, {"x": np.ones((2, 3), np.float32)}), expected)


def test_a_weight_from_an_initializer_through_a_cast_folds_too():
    """A model stored in FP16 with Casts to float before each op: the weight is a float32 initializer after intake."""
    weight = numpy_helper.from_array(np.full((3, 4), 0.5, np.float16), "w16")
    nodes = [
        helper.make_node("Cast", ["w16"], ["w"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 4])],
        [weight],
    )
    loaded = prepare_model(model, Path("m.onnx"), None)
    assert loaded.layer_names == ["mm"] and loaded.layers[0].weight_source == "initializer+Cast"
    assert _initializer(loaded.proto, "w").dtype == np.float32


# ---------------------------------------------------------------------------------------------
# nothing to tune: one line that counts the candidates and says why
# ---------------------------------------------------------------------------------------------


def _nothing_tunable() -> onnx.ModelProto:
    """Two Gemms whose weight is a graph input, a Conv whose weight is computed, an activation MatMul, an FP16 one."""
    half = numpy_helper.from_array(np.ones((8, 4), np.float16), "w16")
    scale = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "scale")
    nodes = [
        helper.make_node("Gemm", ["x", "w"], ["g1"], name="g1"),
        helper.make_node("Gemm", ["x", "w"], ["g2"], name="g2"),
        helper.make_node("Constant", [], ["scale"], name="scale", value=scale),
        helper.make_node("Mul", ["scale", "kernel"], ["conv.w"], name="scaled"),
        helper.make_node("Conv", ["img", "conv.w"], ["c"], name="conv"),
        helper.make_node("Relu", ["w"], ["rw"], name="relu"),
        helper.make_node("MatMul", ["x", "rw"], ["m1"], name="m_act"),
        helper.make_node("Cast", ["x"], ["xh"], name="half", to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["xh", "w16"], ["m2"], name="m_half"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", F, [2, 8]),
        helper.make_tensor_value_info("w", F, [8, 4]),
        helper.make_tensor_value_info("img", F, [1, 3, 4, 4]),
        helper.make_tensor_value_info("kernel", F, [2, 3, 3, 3]),
    ]
    outputs = [
        helper.make_tensor_value_info("g1", F, [2, 4]),
        helper.make_tensor_value_info("g2", F, [2, 4]),
        helper.make_tensor_value_info("c", F, [1, 2, 2, 2]),
        helper.make_tensor_value_info("m1", F, [2, 4]),
        helper.make_tensor_value_info("m2", TensorProto.FLOAT16, [2, 4]),
    ]
    return _model(nodes, inputs, outputs, [half])


def test_no_tunable_layer_counts_the_candidates_per_op_type_and_cause_in_one_line():
    with pytest.raises(ModelError) as info:
        prepare_model(_nothing_tunable(), Path("exported.onnx"), None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "exported.onnx has no tunable layer, there is nothing to tune: found 1 Conv, 2 Gemm, 2 MatMul"
    )
    assert "2 Gemm: weight from a graph input;" in message
    assert "1 Conv: weight computed by a node, not a constant (Mul);" in message
    assert "1 MatMul: both inputs are activations;" in message
    assert "1 MatMul: weight of an unsupported dtype (float16)" in message
    for fix in ("store the weights in the model", "fold the graph's constants", "export the model in float32"):
        assert fix in message
    assert "model.include_activation_matmuls: true" in message


def test_a_model_without_candidates_says_so():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 3])],
    )
    with pytest.raises(ModelError, match="has no Conv, ConvTranspose, Gemm or MatMul node; there is nothing to tune"):
        prepare_model(model, Path("relu.onnx"), None)
