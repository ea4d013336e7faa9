"""TensorRT's Q/DQ rules (autotune.backends.tensorrt.rules) on graphs the rewriter writes and on hand-broken ones.

The TENSORRT-recipe graphs also run on ONNX Runtime CPU and must match an independent numpy fake-quant
reference written from the plan (not from the graph), so what TensorRT is given computes what the plan means.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.tensorrt.rules import QDQError, check_qdq, qdq_problems, requested_precisions
from autotune.model.layers import InputSpec, LoadedModel, prepare_model
from autotune.plan import Plan
from autotune.quant.qparams import activation_qparams, fake_quant, quantize_weight
from autotune.quant.recipe import ORT_X86, TENSORRT
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.testing import tiny_mlp

# ---- models ----------------------------------------------------------------------------------------------


def small_cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv(bias, pad 1) -> Relu -> Conv(bias) on [2, 3, 8, 8]."""
    rng = np.random.default_rng(seed)

    def init(name, shape, scale):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
            helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], "conv2"),
        ],
        "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])],
        [init("w1", (8, 3, 3, 3), 0.4), init("b1", (8,), 0.1), init("w2", (4, 8, 3, 3), 0.2), init("b2", (4,), 0.1)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _prepared(kind: str) -> LoadedModel:
    if kind == "mlp":
        return prepare_model(tiny_mlp(), Path("mlp.onnx"), [InputSpec("x", (16, 32), "float32")])
    return prepare_model(small_cnn(), Path("cnn.onnx"), None)


# ---- a numpy forward, float or fake-quantized from the plan ---------------------------------------------------


def _conv(x, w, b, pads):
    top, left, bottom, right = pads
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    y = np.einsum("nchwij,ocij->nohw", sliding_window_view(x, w.shape[2:], axis=(2, 3)), w)
    return y + b.reshape(1, -1, 1, 1)


def _attr(node, name, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def forward(model: onnx.ModelProto, feeds: dict, quantized: dict | None = None) -> dict[str, np.ndarray]:
    """Runs MatMul/Add/Relu/Gemm/Conv in float64; ``quantized`` maps a node to a function of its input list."""
    env = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    env.update({k: v.astype(np.float64) for k, v in feeds.items()})
    for node in model.graph.node:
        ins = [env[name] for name in node.input]
        if quantized and node.name in quantized:
            ins = quantized[node.name](ins)
        if node.op_type == "MatMul":
            out = ins[0] @ ins[1]
        elif node.op_type == "Add":
            out = ins[0] + ins[1]
        elif node.op_type == "Relu":
            out = np.maximum(ins[0], 0)
        elif node.op_type == "Gemm":
            out = ins[0] @ (ins[1].T if _attr(node, "transB", 0) else ins[1]) + ins[2]
        elif node.op_type == "Conv":
            out = _conv(ins[0], ins[1], ins[2], _attr(node, "pads", [0, 0, 0, 0]))
        else:
            raise NotImplementedError(node.op_type)
        env[node.output[0]] = out
    return env


def fake_quant_reference(model: LoadedModel, plan: Plan, ranges, feeds) -> np.ndarray:
    """The plan's meaning under the TENSORRT recipe: symmetric int8 activations, int8 weights, float bias."""
    per_channel = plan.knob("weight_granularity", "per_channel") == "per_channel"
    hooks = {}
    for layer in model.layers:
        if plan.precision_map.get(layer.name) != "int8":
            continue
        acts = {x: activation_qparams(*ranges[x], "int8") for x in layer.activation_inputs}
        w = numpy_helper.to_array(next(i for i in model.proto.graph.initializer if i.name == layer.weight))
        q, scales = quantize_weight(w, layer.weight_axis, per_channel)
        shape = [1] * w.ndim
        if per_channel:
            shape[layer.weight_axis % w.ndim] = -1
        weight = q.astype(np.float64) * scales.reshape(shape)
        names = list(_node(model.proto, layer.name).input)

        def hook(ins, acts=acts, weight=weight, names=names, layer=layer):
            return [
                fake_quant(v, *acts[n], "int8").astype(np.float64)
                if n in acts
                else (weight if n == layer.weight else v)
                for n, v in zip(names, ins, strict=True)
            ]

        hooks[layer.name] = hook
    return forward(model.proto, feeds, hooks)[model.proto.graph.output[0].name]


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _ranges_and_feeds(model: LoadedModel, seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = [d.dim_value for d in model.proto.graph.input[0].type.tensor_type.shape.dim]
    name = model.proto.graph.input[0].name
    calib = forward(model.proto, {name: rng.standard_normal(shape)})
    tensors = required_ranges(model.layers, TENSORRT, model.proto)
    ranges = {t: (min(float(calib[t].min()), 0.0), max(float(calib[t].max()), 0.0)) for t in tensors}
    return ranges, {name: rng.standard_normal(shape).astype(np.float32)}


def typed(kind: str, precision: str = "int8", granularity: str = "per_channel", recipe=TENSORRT, **per_layer):
    model = _prepared(kind)
    ranges, feeds = _ranges_and_feeds(model)
    precisions = {layer.name: per_layer.get(layer.name, precision) for layer in model.layers}
    plan = Plan.make(precisions, {"weight_granularity": granularity})
    return model, plan, ranges, feeds, rewrite(model.proto, model.layers, plan, ranges, recipe)


def _set_init(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(np.asarray(array), name))


# ---- graphs the rewriter writes pass ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_tensorrt_recipe_graphs_fit_tensorrt(kind, granularity, precision):
    model, _, _, _, out = typed(kind, precision, granularity)
    assert qdq_problems(out) == []
    check_qdq(out)
    assert requested_precisions(out) == {layer.name: precision for layer in model.layers}


def test_mixed_plan_records_each_layers_precision():
    model, _, _, _, out = typed("mlp", "fp32", fc1="int8", fc2="fp16", fc3="bf16")
    assert qdq_problems(out) == []
    assert requested_precisions(out) == {"fc1": "int8", "fc2": "fp16", "fc3": "bf16", "head": "fp32"}
    assert requested_precisions(out, ["fc2"]) == {"fc2": "fp16"}


def test_fp16_scale_on_fp16_input_is_allowed():
    """Q on an FP16 activation may carry an FP16 scale (opset 19); FP32 scales stay legal too."""
    scale = numpy_helper.from_array(np.array(0.05, np.float16), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "z")
    w = numpy_helper.from_array(np.ones((4, 4), np.float16), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xh"], "cast_in", to=TensorProto.FLOAT16),
            helper.make_node("QuantizeLinear", ["xh", "s", "z"], ["xq"], "q"),
            helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], "dq"),
            helper.make_node("MatMul", ["xd", "w"], ["yh"], "mm"),
            helper.make_node("Cast", ["yh"], ["y"], "cast_out", to=TensorProto.FLOAT),
        ],
        "fp16_qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [scale, zero, w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    assert qdq_problems(model) == []
    assert requested_precisions(model) == {"mm": "int8"}


# ---- hand-broken variants fail with a clear message -------------------------------------------------------


def test_ort_recipe_is_rejected_uint8_and_int32_bias():
    _, _, _, _, out = typed("mlp", recipe=ORT_X86)
    problems = "\n".join(qdq_problems(out))
    assert "UINT8 (asymmetric uint8" in problems
    assert "is not all zeros" in problems
    assert "INT32 (an int32 quantized bias" in problems


def test_nonzero_zero_point_fails():
    _, _, _, _, out = typed("mlp")
    q = _node(out, "fc1__x__Q")
    _set_init(out, q.input[2], np.array(3, np.int8))
    with pytest.raises(QDQError, match=r"QuantizeLinear 'fc1__x__Q': zero point .* is not all zeros \(\[3\]\)"):
        check_qdq(out)


def test_per_channel_activation_scale_fails():
    _, _, _, _, out = typed("mlp")
    q = _node(out, "fc1__x__Q")
    _set_init(out, q.input[1], np.full(32, 0.05, np.float32))
    _set_init(out, q.input[2], np.zeros(32, np.int8))
    for node in (q, _node(out, "fc1__x__DQ")):
        node.attribute.append(helper.make_attribute("axis", 1))
    problems = qdq_problems(out)
    assert any("fc1__x__Q" in p and "per-channel) on activation 'x'" in p for p in problems), problems
    assert any("fc1__x__DQ" in p and "per-channel" in p for p in problems), problems


@pytest.mark.parametrize("value", [0.0, -0.05, np.inf])
def test_zero_negative_or_infinite_scale_fails(value):
    _, _, _, _, out = typed("cnn")
    q = _node(out, "conv2__r1__Q")
    _set_init(out, q.input[1], np.array(value, np.float32))
    with pytest.raises(QDQError, match="not finite and strictly positive"):
        check_qdq(out)


def test_negative_weight_channel_scale_fails():
    _, _, _, _, out = typed("cnn")
    dq = _node(out, "conv1__w__DQ")
    scales = numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == dq.input[1])).copy()
    scales[2] = -scales[2]
    _set_init(out, dq.input[1], scales)
    assert any("conv1__w__DQ" in p and "strictly positive" in p for p in qdq_problems(out))


def test_scale_dtype_must_match_a_half_input():
    _, _, _, _, out = typed("mlp")
    q = _node(out, "fc2__a1__Q")
    _set_init(out, q.input[1], np.array(0.05, np.float16))  # FP16 scale on an FP32 activation
    problems = qdq_problems(out)
    assert any("fc2__a1__Q" in p and "is FLOAT16 but the input 'a1' is FLOAT" in p for p in problems), problems


def test_bad_placements_fail():
    _, _, _, _, out = typed("mlp")
    # Q feeding something other than DQ, and DQ feeding an op TensorRT cannot fuse a dequantize into.
    q = _node(out, "fc1__x__Q")
    out.graph.node.append(helper.make_node("Identity", [q.output[0]], ["leak"], "leak"))
    dq = _node(out, "fc3__a2__DQ")
    out.graph.node.append(helper.make_node("Softmax", [dq.output[0]], ["soft"], "soft"))
    problems = qdq_problems(out)
    assert any("fc1__x__Q" in p and "must feed DequantizeLinear only" in p for p in problems), problems
    assert any("fc3__a2__DQ" in p and "feeds Softmax 'soft'" in p for p in problems), problems


def test_an_add_with_one_dequantized_input_fails():
    _, _, _, _, out = typed("mlp")
    dq = _node(out, "fc3__a2__DQ")
    out.graph.node.append(helper.make_node("Add", [dq.output[0], "x"], ["half"], "half_quantized"))
    problems = qdq_problems(out)
    assert any("Add 'half_quantized'" in p and "both inputs of a residual Add" in p for p in problems), problems
    # Both inputs dequantized, or a constant next to a dequantized one: no problem.
    out.graph.node[-1].input[1] = dq.output[0]
    assert qdq_problems(out) == []


def test_runtime_scale_fails():
    _, _, _, _, out = typed("mlp")
    q = _node(out, "fc1__x__Q")
    out.graph.input.append(helper.make_tensor_value_info("runtime_scale", TensorProto.FLOAT, []))
    q.input[1] = "runtime_scale"
    assert any("build-time constant" in p for p in qdq_problems(out))


# ---- the same graphs on ONNX Runtime match a numpy fake-quant reference ---------------------------------------


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_tensorrt_recipe_matches_numpy_fake_quant(kind, granularity):
    model, plan, ranges, feeds, out = typed(kind, "int8", granularity)
    options = ort.SessionOptions()
    # No ORT fusions: ORT would requantize float biases to int32 for its own kernels; TensorRT keeps them float.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(out.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    expected = fake_quant_reference(model, plan, ranges, feeds)
    float_out = forward(model.proto, feeds)[model.proto.graph.output[0].name]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=2e-5 * scale, rtol=1e-4)
    assert np.abs(got - float_out).max() > 1e-4 * scale, "the int8 graph should differ from float"
