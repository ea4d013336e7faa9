"""Tests for autotune.model.layer_units: which nodes one layer covers, which tensors carry INT8 output unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layer_units import GraphIndex


def _graph(nodes, inits=(), outputs=("y",)) -> onnx.GraphProto:
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in inits],
    )


def _index(nodes, inits=(), outputs=("y",)) -> GraphIndex:
    return GraphIndex(_graph(nodes, inits, outputs))


def _pads() -> tuple[str, np.ndarray]:
    return "pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)


def test_a_sole_relu_or_clip_folds_into_the_layer_before_it():
    index = _index(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], "conv"),
            helper.make_node("Clip", ["c", "lo", "hi"], ["y"], "relu6"),
        ],
        [("w", np.ones((2, 2, 1, 1), np.float32)), ("lo", np.float32(0)), ("hi", np.float32(6))],
    )
    assert index.output_tail("c") == (1,)
    assert index.unit_output(0) == "y"


@pytest.mark.parametrize("outputs", [("y", "c"), ("y",)])
def test_no_fold_when_the_output_has_other_readers_or_is_a_graph_output(outputs):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], "conv"), helper.make_node("Relu", ["c"], ["r"], "relu")]
    if outputs == ("y",):  # a second reader of c
        nodes.append(helper.make_node("Add", ["r", "c"], ["y"], "add"))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["y"], "id"))
    index = _index(nodes, [("w", np.ones((2, 2, 1, 1), np.float32))], outputs)
    assert index.output_tail("c") == ()
    assert index.unit_output(0) == "c"


@pytest.mark.parametrize("gate", ["Sigmoid", "HardSigmoid"])
@pytest.mark.parametrize("gate_first", [False, True])
def test_a_gated_activation_folds_in_either_input_order(gate, gate_first):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], "conv"),
        helper.make_node(gate, ["c"], ["g"], "gate"),
        helper.make_node("Mul", ["g", "c"] if gate_first else ["c", "g"], ["y"], "mul"),
    ]
    index = _index(nodes, [("w", np.ones((2, 2, 1, 1), np.float32))])
    assert index.output_tail("c") == (1, 2)
    assert index.unit_output(0) == "y"


@pytest.mark.parametrize("case", ["gate is a graph output", "mul reads another tensor", "the gate is no Sigmoid"])
def test_a_gated_activation_does_not_fold_when_it_is_not_exactly_x_times_gate_of_x(case):
    mul_inputs = ["c", "x"] if case == "mul reads another tensor" else ["c", "g"]
    gate = (
        helper.make_node("Mul", ["c", "w"], ["g"], "gate")
        if case == "the gate is no Sigmoid"
        else helper.make_node("Sigmoid", ["c"], ["g"], "gate")
    )
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], "conv"),
        gate,
        helper.make_node("Mul", mul_inputs, ["y"], "mul"),
    ]
    outputs = ("y", "g") if case == "gate is a graph output" else ("y",)
    index = _index(nodes, [("w", np.ones((2, 2, 1, 1), np.float32))], outputs)
    assert index.output_tail("c") == ()
    assert index.unit_output(0) == "c"


def test_zero_pad_read_by_one_conv_belongs_to_it_with_the_value_in_a_constant_node():
    zero = helper.make_node("Constant", [], ["zero"], "zero", value=numpy_helper.from_array(np.float32(0)))
    nodes = [
        zero,
        helper.make_node("Pad", ["x", "pads", "zero"], ["p"], "pad"),
        helper.make_node("Conv", ["p", "w"], ["y"], "conv"),
    ]
    index = _index(nodes, [_pads(), ("w", np.ones((2, 2, 3, 3), np.float32))])
    assert index.exclusive_pad("p", 2) == 1
    assert index.value_preserving(1)


@pytest.mark.parametrize(
    ("value", "mode", "reader"),
    [(1.0, "constant", "Conv"), (0.0, "reflect", "Conv"), (0.0, "constant", "MatMul")],
)
def test_other_pads_stay_out_of_the_unit(value, mode, reader):
    nodes = [
        helper.make_node("Pad", ["x", "pads", "v"], ["p"], "pad", mode=mode),
        helper.make_node(reader, ["p", "w"], ["y"], "layer"),
    ]
    index = _index(nodes, [_pads(), ("v", np.float32(value)), ("w", np.ones((2, 2, 3, 3), np.float32))])
    assert index.exclusive_pad("p", 1) is None


def test_int8_source_walks_value_preserving_ops_only():
    nodes = [
        helper.make_node("Relu", ["x"], ["q"], "producer"),
        helper.make_node("MaxPool", ["q"], ["m"], "pool", kernel_shape=[2, 2]),
        helper.make_node("Resize", ["m", "", "scales"], ["n"], "nearest", mode="nearest"),
        helper.make_node("Resize", ["m", "", "scales"], ["l"], "linear", mode="linear"),
        helper.make_node("Flatten", ["n"], ["f"], "flatten", axis=1),
        helper.make_node("Sigmoid", ["f"], ["y"], "sigmoid"),
    ]
    index = _index(nodes, [("scales", np.array([1, 1, 2, 2], np.float32))])
    assert index.int8_source("f", {"q"}) == "q"
    assert index.int8_source("l", {"q"}) is None  # linear resizing makes new values
    assert index.int8_source("y", {"q"}) is None
    assert index.int8_source("q", {"q"}) == "q"
    assert index.int8_source("x", {"q"}) is None
