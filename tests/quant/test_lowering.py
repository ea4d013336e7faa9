"""The lowering: a plan and its calibration (ranges, per-layer ranges, SmoothQuant factors) to a typed graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from autotune.model.layers import InputSpec, prepare_model
from autotune.plan import Plan
from autotune.quant.lowering import NONE, Quantization, lower
from autotune.quant.qparams import activation_qparams
from autotune.quant.recipe import ORT_X86
from autotune.quant.rewrite import RewriteError, required_ranges, rewrite
from autotune.testing import tiny_mlp


@pytest.fixture(scope="module")
def model():
    return prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])


def _ranges(model) -> dict[str, tuple[float, float]]:
    return {tensor: (-3.0, 3.0) for tensor in required_ranges(model.layers, ORT_X86, model.proto)}


def _input_scale(graph, tensor: str) -> float:
    """The scale of the QuantizeLinear that reads ``tensor``."""
    inits = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    node = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    return float(inits[node.input[1]])


def test_lowering_is_the_rewrite_of_the_plan_with_every_part_of_its_calibration(model):
    plan = Plan.make({"fc2": "int8", "fc3": "int8"})
    factors = np.linspace(0.5, 2.0, 64).astype(np.float32)
    quantization = Quantization(_ranges(model), {"fc2": {"a1": (0.0, 2.0)}}, {"fc2": factors})
    lowered = lower(model, plan, quantization, ORT_X86)
    expected = rewrite(
        model.proto, model.layers, plan, quantization.ranges, ORT_X86, {"fc2": {"a1": (0.0, 2.0)}}, {"fc2": factors}
    )
    assert lowered.SerializeToString() == expected.SerializeToString()
    # The per-layer range is fc2's alone, and fc2's input is divided by its factors before it is quantized.
    smooth = next(n for n in lowered.graph.node if n.op_type == "Mul" and n.input[0] == "a1")
    inverse = next(numpy_helper.to_array(i) for i in lowered.graph.initializer if i.name == smooth.input[1])
    np.testing.assert_allclose(inverse, 1.0 / factors, rtol=1e-6)
    assert _input_scale(lowered.graph, smooth.output[0]) == pytest.approx(
        float(activation_qparams(0.0, 2.0, "uint8")[0])
    )
    assert _input_scale(lowered.graph, "a2") == pytest.approx(float(activation_qparams(-3.0, 3.0, "uint8")[0]))


def test_an_fp32_plan_needs_no_calibration_and_computes_what_the_model_does(model):
    lowered = lower(model, Plan.make({}), NONE, ORT_X86)
    assert not [n for n in lowered.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)

    def run(proto):
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    np.testing.assert_array_equal(run(lowered)[0], run(model.proto)[0])
    assert model.proto.graph.node[0].op_type == "MatMul"  # the loaded model is left as it is


def test_an_int8_plan_without_its_ranges_is_a_rewrite_error(model):
    with pytest.raises(RewriteError, match="range"):
        lower(model, Plan.make({"fc2": "int8"}), NONE, ORT_X86)
