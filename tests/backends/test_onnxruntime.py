import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from autotune.backends import BuildError
from autotune.backends.onnxruntime import OnnxRuntimeCPU, int8_recipe
from autotune.model.layers import InputSpec, prepare_model
from autotune.plan import Plan
from autotune.quant.rewrite import rewrite
from autotune.testing import tiny_mlp


@pytest.fixture()
def tiny():
    return prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])


def _int8(model, layers, **knobs):
    ranges = {name: (-8.0, 8.0) for name in ("x", "a1", "a2", "a3", "h1b")}
    plan = Plan.make({layer.name: "int8" for layer in layers}, knobs)
    return rewrite(model.proto, model.layers, plan, ranges, int8_recipe())


def test_capabilities_offer_int8_not_fp16_on_x86():
    capabilities = OnnxRuntimeCPU().capabilities()
    assert capabilities.precisions_for("MatMul")[:2] == ("fp32", "int8")  # and int8-dynamic where it is exact
    assert "fp16" not in capabilities.precisions_for("Conv")
    assert capabilities.precisions_for("Softmax") == ("fp32",)
    assert {k.name for k in capabilities.knobs} == {
        "graph_optimization_level",
        "allow_spinning",
        "int8_scheme",
        "skip_layer_norm_fusion",
    }
    (fusion,) = (k for k in capabilities.knobs if k.name == "skip_layer_norm_fusion")
    assert fusion.free and fusion.default is True and fusion.needs_ops == ("LayerNormalization", "Sqrt")


def test_int8_matmuls_fuse_into_integer_kernels(tiny):
    backend = OnnxRuntimeCPU()
    optimized = backend.optimized_model(_int8(tiny, tiny.layers), {"graph_optimization_level": "all"})
    ops = Counter(node.op_type for node in optimized.graph.node)
    # Every weight MatMul must run as an integer kernel; a float MatMul/Gemm fed by DequantizeLinear means
    # a fusion pass got in the way and INT8 would be slower than FP32.
    assert ops["MatMulIntegerToFloat"] + ops["QGemm"] == 4, ops
    assert ops["MatMul"] == 0 and ops["Gemm"] == 0, ops


def _residual_layer_norm(quantized: bool) -> onnx.ModelProto:
    """x @ w + x, then LayerNormalization: what ORT fuses into SkipLayerNormalization (with Q/DQ on the MatMul)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.1, (32, 32)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(32, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(32, np.float32), "beta"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Add", ["y", "x"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["out"], axis=-1),
    ]
    if quantized:
        weights += [
            numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
            numpy_helper.from_array(np.array(128, np.uint8), "zero"),
        ]
        nodes[:0] = [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xdq"]),
        ]
        nodes[2].input[0] = "xdq"
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 32])],  # 3-D: what the fusion takes
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8, 32])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("quantized", [False, True])
def test_skip_layer_norm_fusion_off_keeps_the_add_and_layer_norm_and_the_export_says_so(quantized, tmp_path):
    from autotune.backends.base import GraphArtifact
    from autotune.backends.onnxruntime import DISABLED_FOR_QDQ

    backend = OnnxRuntimeCPU()
    model = _residual_layer_norm(quantized)
    fused = Counter(n.op_type for n in backend.optimized_model(model, {}).graph.node)
    apart = Counter(n.op_type for n in backend.optimized_model(model, {"skip_layer_norm_fusion": False}).graph.node)
    assert fused["SkipLayerNormalization"] == 1 and fused["LayerNormalization"] == 0, fused
    assert apart["SkipLayerNormalization"] == 0 and apart["LayerNormalization"] == 1, apart
    feeds = {"x": np.random.default_rng(1).normal(size=(2, 8, 32)).astype(np.float32)}
    outputs = [
        backend.run_engine(backend.build_graph(model, knobs), feeds)[0]
        for knobs in ({}, {"skip_layer_norm_fusion": False})
    ]
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-5)  # the same sums, apart: a free knob
    plan = Plan.make({}, {"skip_layer_norm_fusion": False})
    backend.export(GraphArtifact(model, backend.build_graph(model, plan.knob_map)), plan, tmp_path)
    disabled = json.loads((tmp_path / "session.json").read_text())["disabled_optimizers"]
    assert disabled == [*(DISABLED_FOR_QDQ if quantized else ()), "SkipLayerNormFusion"]


def test_a_layer_norm_spelt_out_in_primitive_ops_is_fused_too_and_the_knob_keeps_it_apart():
    from onnx import TensorProto, helper, numpy_helper

    constants = {
        "w": np.eye(32, dtype=np.float32),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-6, np.float32),
        "gamma": np.ones(32, np.float32),
        "beta": np.zeros(32, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Add", ["y", "x"], ["sum"]),
        helper.make_node("ReduceMean", ["sum"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["sum", "mean"], ["centred"]),
        helper.make_node("Pow", ["centred", "two"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[-1]),
        helper.make_node("Add", ["variance", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["deviation"]),
        helper.make_node("Div", ["centred", "deviation"], ["normalized"]),
        helper.make_node("Mul", ["normalized", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["out"]),
    ]
    shape = [2, 8, 32]
    graph = helper.make_graph(
        nodes,
        "spelt_out",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])  # before LayerNormalization
    backend = OnnxRuntimeCPU()
    fused = Counter(n.op_type for n in backend.optimized_model(model, {}).graph.node)
    apart = Counter(n.op_type for n in backend.optimized_model(model, {"skip_layer_norm_fusion": False}).graph.node)
    assert fused["SkipLayerNormalization"] == 1 and apart["SkipLayerNormalization"] == 0, (fused, apart)


def test_build_runs_and_rejects_bad_models(tiny):
    backend = OnnxRuntimeCPU()
    session = backend.build_graph(tiny.proto, {})
    out = backend.run_engine(session, {"x": np.zeros((16, 32), np.float32)})
    assert out[0].shape == (16, 10)
    broken = onnx.ModelProto()
    broken.CopyFrom(tiny.proto)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BuildError, match="could not create a session"):
        backend.build_graph(broken, {})
    with pytest.raises(BuildError, match="graph_optimization_level"):
        backend.build_graph(tiny.proto, {"graph_optimization_level": "ludicrous"})


def test_profile_gives_shares_of_fp32_runtime(tiny):
    shares = OnnxRuntimeCPU().profile(tiny, {"x": np.ones((16, 32), np.float32)})
    assert set(shares) == set(tiny.layer_names)
    assert all(0 < share < 1 for share in shares.values())
    assert sum(shares.values()) < 1


def _calibration(batches: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((16, 32)).astype(np.float32)} for _ in range(batches)]


def _initializer(graph: onnx.GraphProto, name: str) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(i) for i in graph.initializer if i.name == name)


def test_ort_static_one_liner_is_uint8_activations_and_per_channel_int8_weights(tiny, tmp_path):
    backend = OnnxRuntimeCPU()
    backend.prepare(tiny, tiny.layer_names)
    assert backend.references() == ("ort-static", "ort-dynamic")
    artifact = backend.build_reference("ort-static", _calibration(), tmp_path)
    graph = artifact.graph.graph
    quantize = [node for node in graph.node if node.op_type == "QuantizeLinear"]
    assert quantize, "quantize_static wrote no QDQ"
    # Activations: uint8 with zero points (the only fast x86 recipe); weights: int8, one scale per output channel.
    assert {_initializer(graph, node.input[2]).dtype for node in quantize} == {np.dtype(np.uint8)}
    constants = {i.name for i in graph.initializer}
    dequantized = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants]
    weights = [n for n in dequantized if _initializer(graph, n.input[0]).dtype != np.int32]  # int32: biases
    assert len(weights) == 4, [node.input[0] for node in weights]
    for node in weights:
        assert _initializer(graph, node.input[0]).dtype == np.int8
        assert _initializer(graph, node.input[1]).size > 1, f"{node.name}: per-tensor weight scale"
    # It runs, close to FP32, and exports the quantized graph.
    x = _calibration(1)[0]
    fp32 = backend.run_engine(backend.build_graph(tiny.proto, {}), x)[0]
    out = backend.run(artifact, x)[0]
    assert out.shape == (16, 10)
    assert np.corrcoef(out.ravel(), fp32.ravel())[0, 1] > 0.98
    path, session_file = backend.export(artifact, Plan.reference_plan(tiny.layer_names, "ort-static"), tmp_path / "out")
    assert any(node.op_type == "QuantizeLinear" for node in onnx.load(str(path)).graph.node)
    # session.json: the options the plan was measured with, enough to run the model as measured
    import json

    import onnxruntime as ort

    session = json.loads(session_file.read_text())
    assert session["disabled_optimizers"] == ["MatMulAddFusion", "WeightBiasQuantization"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = session["intra_op_num_threads"]
    exported = ort.InferenceSession(
        str(path), options, providers=session["providers"], disabled_optimizers=session["disabled_optimizers"]
    )
    np.testing.assert_allclose(exported.run(None, x)[0], out, rtol=1e-5, atol=1e-5)


def test_ort_dynamic_one_liner_quantizes_weights_and_activations_at_run_time(tiny, tmp_path):
    backend = OnnxRuntimeCPU()
    # Only the Gemm head is searched: quantize_dynamic sees every Gemm as a MatMul, so it must be asked for MatMul.
    backend.prepare(tiny, ["head"])
    graph = backend.build_reference("ort-dynamic", [], tmp_path).graph.graph
    ops = Counter(node.op_type for node in graph.node)
    assert ops["DynamicQuantizeLinear"] == 4 and ops["MatMulInteger"] == 4, ops
    assert ops["QuantizeLinear"] == ops["DequantizeLinear"] == 0, ops  # no static ranges


def test_one_liners_fail_as_build_errors(tiny, tmp_path, monkeypatch):
    backend = OnnxRuntimeCPU()
    backend.prepare(tiny, [])
    with pytest.raises(BuildError, match="no layer is searched"):
        backend.build_reference("ort-static", _calibration(), tmp_path)
    backend.prepare(tiny, tiny.layer_names)
    with pytest.raises(BuildError, match="has no reference 'tflite'; its references: ort-static, ort-dynamic"):
        backend.build_reference("tflite", _calibration(), tmp_path)
    import onnxruntime.quantization

    def broken(*args, **kwargs):
        raise RuntimeError("calibration exploded")

    monkeypatch.setattr(onnxruntime.quantization, "quantize_static", broken)
    with pytest.raises(BuildError, match="ort-static: ONNX Runtime's quantize_static failed: RuntimeError: calibra"):
        backend.build_reference("ort-static", _calibration(), tmp_path)


@pytest.mark.parametrize("knobs", [{}, {"allow_spinning": True}, {"allow_spinning": False}])
def test_a_session_holds_no_core_once_its_run_returns(tiny, knobs):
    # The interleaved timing loop keeps the FP32 reference and the candidate in one process: a session whose
    # threads spin on after its run took a core from the other one (ORT's plain spinning burns ~45 ms of CPU in
    # the 200 ms after a run of this model; the demo's FP32 then read 0.69x-2.07x of itself).
    import time

    session = OnnxRuntimeCPU(intra_op_threads=2).build_graph(tiny.proto, knobs)
    feeds = {"x": np.ones((16, 32), np.float32)}
    for _ in range(20):
        session.run(None, feeds)
    before = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - before < 0.01


def test_spinning_stops_when_the_run_returns_and_the_export_says_so(tiny, tmp_path):
    from autotune.backends.base import GraphArtifact
    from autotune.backends.onnxruntime import spinning_entries

    assert spinning_entries({}) == {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
    assert spinning_entries({"allow_spinning": False}) == {"session.intra_op.allow_spinning": "0"}
    backend = OnnxRuntimeCPU()
    backend.prepare(tiny, [layer.name for layer in tiny.layers])
    plan = Plan.make({layer.name: "fp32" for layer in tiny.layers})
    backend.export(GraphArtifact(tiny.proto, backend.build_graph(tiny.proto, {})), plan, tmp_path)
    session = json.loads((tmp_path / "session.json").read_text())
    assert session["session.force_spinning_stop"] == "1" and session["session.intra_op.allow_spinning"] == "1"


def test_one_liners_and_the_int8_plan_of_a_model_with_lstm_and_gru_run(tmp_path):
    from autotune.quant.lowering import Quantization
    from autotune.testing import tiny_recurrent_model

    model = prepare_model(tiny_recurrent_model(), Path("recurrent.onnx"), None)
    backend = OnnxRuntimeCPU()
    backend.prepare(model, ["lstm", "head"])  # what the space searches: ORT has no INT8 GRU
    feeds = {"x": np.random.default_rng(5).standard_normal((8, 12, 16)).astype(np.float32)}
    dynamic = backend.build_reference("ort-dynamic", [], tmp_path).graph.graph
    assert Counter(node.op_type for node in dynamic.node)["DynamicQuantizeLSTM"] == 1
    static = backend.build_reference("ort-static", [feeds], tmp_path)
    plan = Plan.make({"lstm": "int8", "head": "int8"}, {})
    built = backend.build(plan, Quantization(ranges={"state": (-1.0, 1.0)}), tmp_path)
    for artifact in (static, built):
        assert backend.run(artifact, feeds)[0].shape == (8, 10)
