"""An activation the runtime fuses into its producer (SiLU, HardSwish) is part of that layer's choice.

One small CNN built with onnx.helper holds each case: a conv followed by a SiLU (``Mul(x, Sigmoid(x))``), by an
ONNX ``HardSwish``, by ``Mul(HardSigmoid(x), x)`` (gate first), and by a SiLU whose ``x`` another node reads too,
which must not fold. The tests read its layer table, the ranges calibration must give, the Q/DQ an all-INT8 plan
writes (``autotune.quant.placement.output_pairs``), what ONNX Runtime runs and computes from it, and an FP32 plan.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.onnxruntime import OnnxRuntimeCPU, int8_recipe
from autotune.model.layers import LoadedModel, prepare_model
from autotune.plan import Plan
from autotune.quant.calibrate import DEFAULT_SETTINGS, Calibration, collect_statistics
from autotune.quant.placement import GATE_RANGE
from autotune.quant.probe import find_cut
from autotune.quant.rewrite import required_ranges, rewrite

ORT = int8_recipe()
"""The ORT backend's recipe on this CPU (its weight type follows what the CPU's INT8 kernels do exactly)."""

C = 8
SHAPE = [2, C, 8, 8]


def _tails_model() -> onnx.ModelProto:
    """conv1+SiLU, conv2+HardSwish, conv3+Mul(HardSigmoid, x), conv4 with a SiLU that cannot fold, conv5."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def conv(x: str, name: str) -> str:
        w = (rng.standard_normal((C, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
        bias = np.full(C, 0.1, np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(bias, f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [name], name, pads=[1, 1, 1, 1]))
        return name

    def op(op_type: str, inputs: list[str], name: str) -> str:
        nodes.append(helper.make_node(op_type, inputs, [name], name))
        return name

    c1 = conv("x", "conv1")
    m1 = op("Mul", [c1, op("Sigmoid", [c1], "sig1")], "silu1")
    h2 = op("HardSwish", [conv(m1, "conv2")], "hswish2")
    c3 = conv(h2, "conv3")
    m3 = op("Mul", [op("HardSigmoid", [c3], "hsig3"), c3], "hswish3")
    c4 = conv(m3, "conv4")
    m4 = op("Mul", [c4, op("Sigmoid", [c4], "sig4")], "silu4")
    joined = op("Add", [m4, c4], "add4")  # a third reader of conv4's output: its SiLU stays apart
    conv(joined, "conv5")
    graph = helper.make_graph(
        nodes,
        "tails",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("conv5", TensorProto.FLOAT, SHAPE)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return prepare_model(_tails_model(), Path("tails.onnx"), None)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)}


def _lowered(loaded: LoadedModel, precisions: dict[str, str]) -> onnx.ModelProto:
    tensors = required_ranges(loaded.layers, ORT, loaded.proto)
    ranges = Calibration(collect_statistics(loaded.proto, tensors, [_feeds(s) for s in range(3)]), DEFAULT_SETTINGS)
    typed = rewrite(loaded.proto, loaded.layers, Plan.make(precisions), ranges.ranges("max"), ORT)
    onnx.checker.check_model(typed, full_check=True)
    return typed


def _producers(typed: onnx.ModelProto) -> dict[str, str]:
    return {name: node.op_type for node in typed.graph.node for name in node.output}


def _snr_db(want: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(want.astype(np.float64) ** 2) / np.mean((want - got) ** 2.0)))


def _run(model: onnx.ModelProto) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, _feeds(7))[0]


def test_silu_and_hardswish_tails_join_their_conv_and_a_shared_input_keeps_the_silu_apart(loaded):
    assert [(layer.name, layer.nodes) for layer in loaded.layers] == [
        ("conv1", ("conv1", "sig1", "silu1")),
        ("conv2", ("conv2", "hswish2")),
        ("conv3", ("conv3", "hsig3", "hswish3")),
        ("conv4", ("conv4",)),
        ("sig4", ("sig4",)),  # conv4's output has three readers: the Sigmoid and the Mul are layers of their own
        ("silu4", ("silu4",)),
        ("add4", ("add4",)),
        ("conv5", ("conv5",)),
    ]
    assert loaded.layer("conv1").output == "conv1", "the layer's own output; its unit ends at the Mul"
    assert not loaded.float_ops, "nothing between the layers runs in float"


def test_calibration_covers_each_tails_input_and_output_but_no_gate(loaded):
    tensors = required_ranges(loaded.layers, ORT, loaded.proto)
    assert {"conv1", "silu1", "conv2", "hswish2", "conv3", "hswish3"} <= set(tensors)
    assert not {"sig1", "hsig3"} & set(tensors), "a gate's output range is fixed"


def test_an_int8_layer_quantizes_its_conv_its_gate_and_its_tails_output(loaded):
    typed = _lowered(loaded, dict.fromkeys(loaded.layer_names, "int8"))
    written_by = _producers(typed)
    for tensor in ("conv1", "sig1", "silu1", "conv2", "hswish2", "conv3", "hsig3", "hswish3"):
        assert written_by[tensor] == "DequantizeLinear", tensor
    gate_dq = next(node for node in typed.graph.node if node.output[0] == "sig1")
    scale = numpy_helper.to_array(next(i for i in typed.graph.initializer if i.name == gate_dq.input[1]))
    assert scale == np.float32((GATE_RANGE[1] - GATE_RANGE[0]) / 255.0)
    kernels = Counter(node.op_type for node in OnnxRuntimeCPU(1).optimized_model(typed, {}).graph.node)
    assert kernels["QLinearConv"] == 5
    assert kernels["QLinearSigmoid"] == 2 and kernels["QLinearMul"] == 3  # silu1, hswish3, and conv4's SiLU apart
    assert _snr_db(_run(loaded.proto), _run(typed)) > 25


def test_an_fp32_layer_leaves_its_tail_untouched(loaded):
    precisions = dict.fromkeys(loaded.layer_names, "int8") | {"conv1": "fp32", "conv2": "fp32"}
    typed = _lowered(loaded, precisions)
    written_by = _producers(typed)
    assert [written_by[t] for t in ("conv1", "sig1", "silu1", "conv2", "hswish2")] == [
        "Conv",
        "Sigmoid",
        "Mul",
        "Conv",
        "HardSwish",
    ]
    conv3 = next(node for node in typed.graph.node if node.name == "conv3")
    assert written_by[conv3.input[0]] == "DequantizeLinear", "the next INT8 layer quantizes what it reads itself"
    assert _snr_db(_run(loaded.proto), _run(typed)) > 25


def test_a_layers_probe_runs_its_whole_tail(loaded):
    cut = find_cut(loaded.proto, loaded.layer("conv1"), ORT, "conv5")
    assert [node.name for node in cut.nodes] == ["conv1", "sig1", "silu1"]
    assert cut.target == "silu1" and cut.inputs == ("x",)
