"""The ``int8-dynamic`` layer: ORT's dynamic MatMul pattern per layer, its numbers against numpy arithmetic.

The ``int8_numeric`` tests run the weight range the real probe picks (7-bit where the CPU's U8S8 kernels saturate);
``make test-haswell`` runs them under qemu's Haswell, whose AVX2 kernels saturate with 8-bit weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.int8_kernels import dynamic_verdicts, dynamic_weight_max
from autotune.backends.onnxruntime import OnnxRuntimeCPU, _probe_session
from autotune.model.layers import build_layer_table
from autotune.plan import Plan
from autotune.quant.dynamic import DYNAMIC
from autotune.quant.graphedit import RewriteError
from autotune.quant.recipe import ORT_X86
from autotune.quant.rewrite import rewrite
from tests.quant.reference import model_cnn, model_mlp

RNG = 7
K, N, M = 64, 24, 8


def _model(op_type: str, rng: np.random.Generator) -> onnx.ModelProto:
    """X [M, K] -> MatMul(W) -> Relu -> (MatMul or Gemm with transB, alpha, beta, bias) -> Y."""
    w1 = rng.normal(size=(K, N)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["h"], "first"), helper.make_node("Relu", ["h"], ["r"], "relu")]
    inits = [numpy_helper.from_array(w1, "W1")]
    if op_type == "Gemm":
        nodes.append(helper.make_node("Gemm", ["r", "W2", "C"], ["Y"], "second", transB=1, alpha=0.5, beta=2.0))
        inits += [
            numpy_helper.from_array(rng.normal(size=(N, N)).astype(np.float32), "W2"),
            numpy_helper.from_array(rng.normal(size=(N,)).astype(np.float32), "C"),
        ]
    else:
        nodes.append(helper.make_node("MatMul", ["r", "W2"], ["Y"], "second"))
        inits.append(numpy_helper.from_array(rng.normal(size=(N, N)).astype(np.float32), "W2"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _dynamic_reference(x: np.ndarray, w: np.ndarray, weight_max: int) -> np.ndarray:
    """``x @ w`` as DynamicQuantizeLinear + MatMulInteger + scales compute it, in exact integer arithmetic.

    uint8 activations over ``[min(x, 0), max(x, 0)]`` (ONNX's DynamicQuantizeLinear, round half to even), int8
    weights symmetric per output column in ``[-weight_max, weight_max]`` (ORT's ``quantize_dynamic``).
    """
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    x_scale = np.float32((hi - lo) / 255.0)
    zero = int(np.clip(np.rint(-lo / x_scale), 0, 255))
    xq = np.clip(np.rint(x / x_scale) + zero, 0, 255).astype(np.int64)
    w_scale = (np.abs(w).max(axis=0) / np.float32(weight_max)).astype(np.float32)
    wq = np.clip(np.rint(w / w_scale), -weight_max, weight_max).astype(np.int64)
    return ((xq - zero) @ wq).astype(np.float64) * (np.float64(x_scale) * w_scale.astype(np.float64))


def _gemm_as_matmul(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray]:
    inits = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    return (inits["W2"].T * np.float32(0.5)).astype(np.float32), inits["C"] * np.float32(2.0)


def _weight_max() -> int:
    found = dynamic_weight_max(dynamic_verdicts(_probe_session, cache_key="test-dynamic"))
    assert found is not None, "7-bit dynamic weights are exact on every x86 CPU"
    return found


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.int8_numeric
@pytest.mark.parametrize("op_type", ["MatMul", "Gemm"])
def test_dynamic_layers_compute_the_integer_reference(op_type):
    rng = np.random.default_rng(RNG)
    model = _model(op_type, rng)
    layers = build_layer_table(model)
    weight_max = _weight_max()
    recipe = ORT_X86.__class__(dynamic_weight_max=weight_max)
    lowered = rewrite(model, layers, Plan.make({"first": DYNAMIC, "second": DYNAMIC}), {}, recipe)
    x = rng.uniform(-0.2, 1.0, size=(M, K)).astype(np.float32)  # mostly large positive: U8S8 pairs overflow int16
    got = _session(lowered).run(None, {"X": x})[0].astype(np.float64)
    inits = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    hidden = np.maximum(_dynamic_reference(x, inits["W1"], weight_max), 0.0).astype(np.float32)
    if op_type == "Gemm":
        w2, bias = _gemm_as_matmul(model)
        expected = _dynamic_reference(hidden, w2, weight_max) + bias
    else:
        expected = _dynamic_reference(hidden, inits["W2"], weight_max)
    magnitude = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * magnitude)
    # A lowering with the other weight range computes something else: the check above can tell them apart.
    other = 64 if weight_max == 127 else 127
    assert np.abs(_dynamic_reference(x, inits["W1"], other) - _dynamic_reference(x, inits["W1"], weight_max)).max() > (
        1e-3 * np.abs(_dynamic_reference(x, inits["W1"], weight_max)).max()
    )


def test_a_dynamic_matmul_is_what_quantize_dynamic_writes_for_it(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = _model("MatMul", np.random.default_rng(RNG))
    onnx.save(model, tmp_path / "model.onnx")
    quantize_dynamic(
        tmp_path / "model.onnx",
        tmp_path / "ort.onnx",
        nodes_to_quantize=["second"],
        per_channel=True,
        reduce_range=True,
        weight_type=QuantType.QInt8,
    )
    theirs = onnx.load(tmp_path / "ort.onnx")
    ours = rewrite(
        model, build_layer_table(model), Plan.make({"second": DYNAMIC}), {}, ORT_X86.__class__(dynamic_weight_max=64)
    )
    assert sorted(n.op_type for n in ours.graph.node) == sorted(n.op_type for n in theirs.graph.node)

    def integers(graph):
        return sorted(
            (numpy_helper.to_array(i).dtype.str, numpy_helper.to_array(i).tobytes())
            for i in graph.initializer
            if i.data_type != TensorProto.FLOAT
        )

    assert integers(ours.graph) == integers(theirs.graph)  # the same int8 weights and zero points
    x = np.random.default_rng(0).normal(size=(M, K)).astype(np.float32)
    np.testing.assert_array_equal(_session(ours).run(None, {"X": x})[0], _session(theirs).run(None, {"X": x})[0])


def test_static_and_dynamic_layers_combine_and_each_gets_its_fused_kernel():
    model = _model("MatMul", np.random.default_rng(RNG))
    plan = Plan.make({"first": DYNAMIC, "second": "int8"})
    ranges = {"X": (-1.0, 1.0), "h": (-8.0, 8.0), "r": (0.0, 8.0)}
    lowered = rewrite(model, build_layer_table(model), plan, ranges, ORT_X86.__class__(dynamic_weight_max=64))
    onnx.checker.check_model(lowered)
    fused = [node.op_type for node in OnnxRuntimeCPU(1).optimized_model(lowered, {}).graph.node]
    assert "DynamicQuantizeMatMul" in fused and "MatMulIntegerToFloat" in fused, fused
    assert "MatMul" not in fused


def test_a_dynamic_layer_keeps_its_name_and_its_readers():
    model = model_mlp(np.random.default_rng(RNG))
    lowered = rewrite(model, build_layer_table(model), Plan.make({"mm1": DYNAMIC}), {}, ORT_X86)
    names = {node.name: node for node in lowered.graph.node}
    assert names["mm1"].output[:] == ["h"] and names["relu"].input[:] == ["h"]
    assert "W1" not in {init.name for init in lowered.graph.initializer}  # the float weight is dropped


def test_dynamic_is_only_for_matmul_and_gemm():
    model = model_cnn(np.random.default_rng(RNG))
    layers = build_layer_table(model)
    conv = next(layer for layer in layers if layer.op_type == "Conv")
    with pytest.raises(RewriteError, match=f"{DYNAMIC} is for MatMul/Gemm, not Conv"):
        rewrite(model, layers, Plan.make({conv.name: DYNAMIC}), {}, ORT_X86)
