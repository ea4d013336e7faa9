"""Each backend's recipe, seen in the graph it lowers to: activation and weight types, the ranges, the bias."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from autotune.model.layers import InputSpec, prepare_model
from autotune.plan import Plan
from autotune.quant.recipe import (
    ORT_X86,
    ORT_X86_7BIT_WEIGHTS,
    ORT_X86_UINT8_WEIGHTS,
    TENSORRT,
    TORCH,
    QuantRecipe,
)
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.testing import tiny_mlp


@pytest.fixture(scope="module")
def model():
    return prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])


def _lowered(model, recipe: QuantRecipe):
    ranges = {tensor: (-2.0, 6.0) for tensor in required_ranges(model.layers, recipe, model.proto)}
    graph = rewrite(
        model.proto, model.layers, Plan.make({layer.name: "int8" for layer in model.layers}), ranges, recipe
    ).graph
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}

    def quantized_input(node_name: str, slot: int):
        """The QuantizeLinear behind input ``slot`` of a node (through its DequantizeLinear)."""
        node = next(n for n in graph.node if n.name == node_name)
        dq = producers[node.input[slot]]
        assert dq.op_type == "DequantizeLinear"
        return dq, producers.get(dq.input[0])

    return graph, inits, producers, quantized_input


@pytest.mark.parametrize(
    ("recipe", "activation", "activation_zero", "weight", "weight_zero", "weight_max"),
    [
        (ORT_X86, TensorProto.UINT8, 64, TensorProto.INT8, 0, 127),
        (ORT_X86_UINT8_WEIGHTS, TensorProto.UINT8, 64, TensorProto.UINT8, 128, 127),
        (ORT_X86_7BIT_WEIGHTS, TensorProto.UINT8, 64, TensorProto.INT8, 0, 64),
        (TENSORRT, TensorProto.INT8, 0, TensorProto.INT8, 0, 127),
        (TORCH, TensorProto.INT8, 0, TensorProto.INT8, 0, 127),
    ],
    ids=["ort", "ort-uint8-weights", "ort-7bit-weights", "tensorrt", "torch"],
)
def test_each_recipe_writes_its_activation_and_weight_integers(
    model, recipe, activation, activation_zero, weight, weight_zero, weight_max
):
    _, inits, _, quantized_input = _lowered(model, recipe)
    assert recipe.activation_symmetric == (activation == TensorProto.INT8)
    _, q = quantized_input("fc2", 0)
    zero = inits[q.input[2]]
    assert zero.data_type == activation and int(numpy_helper.to_array(zero)) == activation_zero  # [-2, 6]
    dq, _ = quantized_input("fc2", 1)  # the weight: an integer initializer and its zero point
    integers = numpy_helper.to_array(inits[dq.input[0]]).astype(np.int32)
    assert inits[dq.input[0]].data_type == weight and inits[dq.input[2]].data_type == weight
    assert np.all(numpy_helper.to_array(inits[dq.input[2]]) == weight_zero)
    assert np.abs(integers - weight_zero).max() == weight_max  # per channel, the largest weight takes the top


@pytest.mark.parametrize(
    ("recipe", "int32_bias"), [(ORT_X86, True), (TENSORRT, False), (TORCH, False)], ids=["ort", "tensorrt", "torch"]
)
def test_only_ort_quantizes_the_gemm_bias_and_no_recipe_quantizes_matmul_outputs(model, recipe, int32_bias):
    graph, inits, producers, _ = _lowered(model, recipe)
    head = next(n for n in graph.node if n.name == "head")
    bias = producers.get(head.input[2])
    if int32_bias:
        assert bias.op_type == "DequantizeLinear" and inits[bias.input[0]].data_type == TensorProto.INT32
    else:
        assert bias is None and inits[head.input[2]].data_type == TensorProto.FLOAT
    readers = [n for n in graph.node if "h2" in n.input]  # fc2's output: read as it is, no Q/DQ
    assert [n.op_type for n in readers] == ["Relu"]
