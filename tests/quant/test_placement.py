"""The lowering keeps INT8 between quantized layers of a CNN, as ONNX Runtime's kernels allow (placement.py).

Each test builds a small CNN with onnx.helper, lowers an all-INT8 plan with the ORT recipe, and reads the graph
ONNX Runtime runs after its fusions (``OnnxRuntimeCPU.optimized_model``): integer kernels back to back, with no
DequantizeLinear between them, and the accuracy fixes measured on EfficientNet-Lite0 (a folded ReLU6, int32 biases
that fit) on tiny stand-ins.
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
from autotune.backends.tensorrt.rules import qdq_problems
from autotune.model.layers import LoadedModel, prepare_model
from autotune.plan import Plan
from autotune.quant.calibrate import DEFAULT_SETTINGS, Calibration, collect_statistics
from autotune.quant.layerwise import choose_layer_methods
from autotune.quant.recipe import TENSORRT
from autotune.quant.rewrite import required_ranges, rewrite

ORT = int8_recipe()
"""The ORT backend's recipe on this CPU: int8 weights where its INT8 kernels are exact, else uint8 (or 7-bit) ones."""

C = 8
SHAPE = [2, C, 8, 8]


class _Net:
    """A small CNN grown node by node; every weight is random, every bias small."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], name: str, **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name, **attributes))
        return name

    def conv(self, x: str, name: str, cin: int = C, cout: int = C, group: int = 1, pads: int = 1) -> str:
        w = (self.rng.standard_normal((cout, cin // group, 3, 3)) / np.sqrt(9 * cin / group)).astype(np.float32)
        b = (self.rng.standard_normal(cout) * 0.1).astype(np.float32)
        return self.op(
            "Conv", [x, self.const(f"{name}.w", w), self.const(f"{name}.b", b)], name, pads=[pads] * 4, group=group
        )

    def relu6(self, x: str, name: str, constant_nodes: bool = False) -> str:
        """A ReLU6 as PyTorch exports it: bounds in initializers, or (legacy exporter) in Constant nodes."""
        if constant_nodes:
            for bound, value in (("lo", 0.0), ("hi", 6.0)):
                tensor = numpy_helper.from_array(np.float32(value))
                self.nodes.append(
                    helper.make_node("Constant", [], [f"{name}.{bound}"], f"{name}.{bound}", value=tensor)
                )
            return self.op("Clip", [x, f"{name}.lo", f"{name}.hi"], name)
        if "lo" not in {init.name for init in self.inits}:
            self.const("lo", np.float32(0.0))
            self.const("hi", np.float32(6.0))
        return self.op("Clip", [x, "lo", "hi"], name)

    def model(self, output: str, shape=None) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "net",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape or ["n", "c", "h", "w"])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model


def conv_relu6_conv() -> onnx.ModelProto:
    net = _Net()
    return net.model(net.conv(net.relu6(net.conv("x", "conv1"), "relu6"), "conv2"))


def residual_block() -> onnx.ModelProto:
    """An inverted-residual block: expand + ReLU6, depthwise + ReLU6, project, Add of the block input."""
    net = _Net(1)
    block_in = net.relu6(net.conv("x", "stem"), "stem_relu6")
    expanded = net.relu6(net.conv(block_in, "expand"), "expand_relu6", constant_nodes=True)
    depthwise = net.relu6(net.conv(expanded, "depthwise", group=C), "depthwise_relu6", constant_nodes=True)
    added = net.op("Add", [net.conv(depthwise, "project"), block_in], "add")
    return net.model(net.conv(added, "head"))


def pooled_head() -> onnx.ModelProto:
    """conv + ReLU6 -> GlobalAveragePool -> Flatten -> Gemm, as a classifier ends."""
    net = _Net(2)
    pooled = net.op("GlobalAveragePool", [net.relu6(net.conv("x", "conv"), "relu6")], "gap")
    flat = net.op("Flatten", [pooled], "flatten", axis=1)
    weight = net.const("fc.w", net.rng.standard_normal((5, C)).astype(np.float32))
    return net.model(
        net.op("Gemm", [flat, weight, net.const("fc.b", np.zeros(5, np.float32))], "fc", transB=1), ["n", 5]
    )


def padded_depthwise() -> onnx.ModelProto:
    """A ReLU6 output zero-padded by a Pad node before a depthwise conv (PyTorch's static same-padding)."""
    net = _Net(3)
    act = net.relu6(net.conv("x", "conv"), "relu6")
    pads = net.const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    padded = net.op("Pad", [act, pads, net.const("zero", np.float32(0.0))], "pad")
    return net.model(net.conv(padded, "depthwise", group=C, pads=0))


def swish_concat_pool() -> onnx.ModelProto:
    """Swish (Sigmoid + Mul), a Concat of two branches, max and average pooling between convs."""
    net = _Net(4)
    a = net.conv("x", "conv_a")
    swish = net.op("Mul", [a, net.op("Sigmoid", [a], "sigmoid")], "swish")
    b = net.op("Relu", [net.conv("x", "conv_b")], "relu_b")
    joined = net.op("Concat", [swish, b], "concat", axis=1)
    pooled = net.op("MaxPool", [joined], "maxpool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    averaged = net.op("AveragePool", [net.conv(pooled, "conv_c", cin=2 * C)], "avgpool", kernel_shape=[2, 2])
    return net.model(net.conv(averaged, "conv_d"))


def _prepared(model: onnx.ModelProto) -> LoadedModel:
    return prepare_model(model, Path("net.onnx"), None)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)}


def _ranges(loaded: LoadedModel, recipe=ORT) -> dict[str, tuple[float, float]]:
    tensors = required_ranges(loaded.layers, recipe, loaded.proto)
    stats = collect_statistics(loaded.proto, tensors, [_feeds(seed) for seed in range(3)])
    return Calibration(stats, DEFAULT_SETTINGS).ranges("max")


def _lowered(model: onnx.ModelProto, recipe=ORT, precisions: dict[str, str] | None = None) -> onnx.ModelProto:
    loaded = _prepared(model)
    plan = Plan.make(precisions or dict.fromkeys(loaded.layer_names, "int8"))
    typed = rewrite(loaded.proto, loaded.layers, plan, _ranges(loaded, recipe), recipe)
    onnx.checker.check_model(typed, full_check=True)
    return typed


def _kernels(typed: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in OnnxRuntimeCPU(1).optimized_model(typed, {}).graph.node)


def _run(model: onnx.ModelProto, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- ONNX Runtime runs integer kernels back to back --------------------------------------------------------


def test_relu6_folds_into_the_conv_and_two_int8_convs_have_no_dequantize_between_them():
    loaded = _prepared(conv_relu6_conv())
    assert [layer.nodes for layer in loaded.layers] == [("conv1", "relu6"), ("conv2",)]
    kernels = _kernels(_lowered(conv_relu6_conv()))
    assert kernels["QLinearConv"] == 2
    assert kernels["Clip"] == 0, "the ReLU6 runs inside the integer kernel (its saturation is the output range)"
    assert kernels["DequantizeLinear"] == 1, "only the model output is dequantized"


def test_an_add_joining_two_int8_branches_is_one_layer_and_runs_as_qlinearadd():
    loaded = _prepared(residual_block())
    add = loaded.layer("add")
    assert add.op_type == "Add" and add.weight is None and set(add.activation_inputs) == {"project", "stem_relu6"}
    assert [layer.name for layer in loaded.layers].index("add") == 4  # graph order, between project and head
    kernels = _kernels(_lowered(residual_block()))
    assert kernels["QLinearConv"] == 5 and kernels["QLinearAdd"] == 1
    assert kernels["DequantizeLinear"] == 1 and kernels["QuantizeLinear"] == 1  # model input and output only


def test_an_fp32_add_between_int8_convs_adds_no_pair_of_its_own():
    loaded = _prepared(residual_block())
    precisions = {name: "int8" for name in loaded.layer_names if name != "add"}
    typed = _lowered(residual_block(), precisions=precisions)
    add = next(node for node in typed.graph.node if node.name == "add")
    producers = {name: next(n for n in typed.graph.node if name in n.output) for name in add.input}
    assert [node.op_type for node in producers.values()] == ["DequantizeLinear", "DequantizeLinear"]
    assert not [node for node in typed.graph.node if node.name.startswith("add__")], "the Add's choice added nothing"
    assert _kernels(typed)["QLinearConv"] == 5


def test_pooling_then_flatten_into_the_gemm_stays_int8():
    loaded = _prepared(pooled_head())
    assert [layer.op_type for layer in loaded.layers] == ["Conv", "GlobalAveragePool", "Gemm"]
    kernels = _kernels(_lowered(pooled_head()))
    assert kernels["QLinearGlobalAveragePool"] == 1 and kernels["QGemm"] == 1
    assert kernels["DequantizeLinear"] == 0, "the Flatten runs on the integers; QGemm writes float itself"


def test_a_zero_pad_before_a_depthwise_conv_belongs_to_it_and_folds_into_the_kernel():
    loaded = _prepared(padded_depthwise())
    assert loaded.layer("depthwise").nodes == ("pad", "depthwise")
    kernels = _kernels(_lowered(padded_depthwise()))
    assert kernels["QLinearConv"] == 2 and kernels["Pad"] == 0 and kernels["DequantizeLinear"] == 1
    # The same when the conv before it stays FP32: the depthwise conv's own pair goes before the Pad.
    kernels = _kernels(_lowered(padded_depthwise(), precisions={"depthwise": "int8"}))
    assert kernels["QLinearConv"] == 1 and kernels["Pad"] == 0


def test_swish_concat_and_pooling_run_their_integer_kernels():
    loaded = _prepared(swish_concat_pool())
    types = Counter(layer.op_type for layer in loaded.layers)
    assert types == Counter({"Conv": 4, "Concat": 1, "AveragePool": 1})
    assert loaded.layer("conv_a").nodes == ("conv_a", "sigmoid", "swish"), "the SiLU is part of its conv's choice"
    kernels = _kernels(_lowered(swish_concat_pool()))
    for kernel in ("QLinearSigmoid", "QLinearMul", "QLinearConcat", "QLinearAveragePool"):
        assert kernels[kernel] == 1, kernel
    assert kernels["QLinearConv"] == 4
    assert kernels["DequantizeLinear"] == 1, "the MaxPool runs on the integers too"


@pytest.mark.int8_numeric
@pytest.mark.parametrize("build", [residual_block, pooled_head, padded_depthwise, swish_concat_pool])
def test_int8_lowering_computes_the_model(build):
    model = build()
    typed = _lowered(model)
    feeds = _feeds(7)
    want = _run(model, feeds)
    fused = _run(typed, feeds)
    plain = _run(typed, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert _cosine(fused, want) > 0.995 and _cosine(plain, want) > 0.995
    np.testing.assert_allclose(fused, plain, atol=0.05 * float(np.abs(plain).max()))


# ---- a layer's choice decides only its own tensors ----------------------------------------------------------


def test_an_int8_consumer_of_an_fp32_tensor_gets_its_own_pair_and_float_readers_keep_the_float():
    loaded = _prepared(residual_block())
    typed = _lowered(residual_block(), precisions={"expand": "int8", "add": "fp32"})
    add = next(node for node in typed.graph.node if node.name == "add")
    assert "stem_relu6" in add.input, "the FP32 Add reads the float block input"
    expand = next(node for node in typed.graph.node if node.name == "expand")
    dq = next(node for node in typed.graph.node if expand.input[0] in node.output)
    assert dq.op_type == "DequantizeLinear"
    assert [node.name for node in typed.graph.node if expand.input[0] in node.input] == ["expand"]
    assert loaded.layer("expand").activation_inputs == ("stem_relu6",)


def test_int8_readers_of_an_int8_output_share_it_instead_of_rounding_it_again():
    typed = _lowered(residual_block())
    readers = [node.name for node in typed.graph.node if "stem_relu6" in node.input]
    assert sorted(readers) == ["add", "expand"], "both read the stem's quantized output as it is"
    assert sum(node.op_type == "QuantizeLinear" for node in typed.graph.node) == 7  # input + 6 layer outputs


# ---- accuracy: what cost all-INT8 ten times quantize_static's drop on EfficientNet-Lite0 -------------------


@pytest.mark.int8_numeric
def test_a_dead_channel_keeps_its_bias_when_the_int32_bias_would_overflow():
    """BatchNorm folding leaves channels with ~0 weights and a large bias; the int32 bias must not clip it."""
    net = _Net(5)
    w = net.rng.standard_normal((C, C, 3, 3)).astype(np.float32) * 0.1
    w[0] = 1e-9  # a switched-off channel
    b = np.full(C, 0.1, np.float32)
    b[0] = 4.0
    net.op("Conv", ["x", net.const("w", w), net.const("b", b)], "y", pads=[1, 1, 1, 1])
    model = net.model("y")
    got = _run(_lowered(model), _feeds(3))
    want = _run(model, _feeds(3))
    np.testing.assert_allclose(got[:, 0], want[:, 0], atol=0.05)  # today: clipped to ~0
    assert _cosine(got, want) > 0.99


def test_depthwise_weight_scales_are_per_output_channel_along_axis_0():
    typed = _lowered(padded_depthwise(), precisions={"depthwise": "int8"})
    dq = next(node for node in typed.graph.node if node.name.startswith("depthwise__w__DQ"))
    scales = numpy_helper.to_array(next(init for init in typed.graph.initializer if init.name == dq.input[1]))
    weight = numpy_helper.to_array(
        next(init for init in padded_depthwise().graph.initializer if init.name == "depthwise.w")
    )
    assert helper.get_attribute_value(dq.attribute[0]) == 0 and weight.shape == (C, 1, 3, 3)
    np.testing.assert_allclose(scales, np.abs(weight).reshape(C, -1).max(axis=1) / ORT.weight_max, rtol=1e-6)


def test_relu6_folding_keeps_the_output_range_to_the_clipped_values():
    loaded = _prepared(conv_relu6_conv())
    assert required_ranges(loaded.layers, ORT, loaded.proto) == ["x", "relu6", "conv2"]
    typed = _lowered(conv_relu6_conv())
    clip = next(node for node in typed.graph.node if node.name == "relu6")
    quantize = next(node for node in typed.graph.node if clip.output[0] in node.input)
    scale = numpy_helper.to_array(next(i for i in typed.graph.initializer if i.name == quantize.input[1]))
    assert quantize.op_type == "QuantizeLinear" and scale <= 6.0 / 255 + 1e-9


def test_an_int8_pooling_layer_keeps_its_output_grid_within_what_the_integer_kernel_computes():
    """ORT refuses QLinearGlobalAveragePool when input_scale / (output_scale * pooled) leaves [2^-32, 256)."""
    loaded = _prepared(pooled_head())
    ranges = _ranges(loaded)
    ranges["gap"] = (0.0, ranges["relu6"][1] / 1e5)  # far narrower than an average of its input can need
    plan = Plan.make({"conv": "int8", "gap": "int8"})
    typed = rewrite(loaded.proto, loaded.layers, plan, ranges, ORT)
    assert _kernels(typed)["QLinearGlobalAveragePool"] == 1
    got = _run(typed, _feeds(2))  # today's clamp-free grid: "parameter out of computation range"
    assert np.isfinite(got).all()


# ---- inputs the lowering cannot quantize stay float, with the reason ------------------------------------------


def test_ops_without_an_int8_kernel_or_with_a_float_input_stay_fp32_with_a_reason():
    net = _Net(6)
    a = net.conv("x", "conv_a")
    tanh = net.op("Tanh", [a], "tanh")
    mixed = net.op("Add", [net.conv(tanh, "conv_b"), "x"], "add_input")
    model = net.model(net.conv(mixed, "conv_c"))
    loaded = _prepared(model)
    assert [layer.op_type for layer in loaded.layers] == ["Conv", "Conv", "Conv"]
    assert "no INT8 kernel for Tanh" in loaded.float_ops["tanh"]
    assert "graph input" in loaded.float_ops["add_input"]
    typed = _lowered(model)
    assert _cosine(_run(typed, _feeds(1)), _run(model, _feeds(1))) > 0.99


# ---- TensorRT gets the same units, with its own recipe ------------------------------------------------------------


@pytest.mark.parametrize("build", [residual_block, pooled_head, padded_depthwise])
def test_tensorrt_recipe_quantizes_both_inputs_of_a_residual_add_and_passes_its_rules(build):
    model = build()
    loaded = _prepared(model)
    int8 = {layer.name: "int8" for layer in loaded.layers if layer.op_type not in ("Sigmoid", "LeakyRelu")}
    typed = _lowered(model, TENSORRT, int8)
    assert qdq_problems(typed) == []
    # TensorRT fuses Q/DQ next to the layer: a layer's pair is never put before a Pad, as it is for ORT.
    dequantized = {node.output[0] for node in typed.graph.node if node.op_type == "DequantizeLinear"}
    assert not [node for node in typed.graph.node if node.op_type == "Pad" and node.input[0] in dequantized]
    for node in typed.graph.node:
        if node.op_type == "Add":
            producers = [next(n for n in typed.graph.node if name in n.output).op_type for name in node.input]
            assert producers == ["DequantizeLinear", "DequantizeLinear"]


def test_layerwise_calibration_chooses_for_weightless_layers_and_folded_relu6_with_constant_bounds():
    loaded = _prepared(residual_block())
    tensors = required_ranges(loaded.layers, ORT, loaded.proto)
    batches = [_feeds(seed) for seed in range(2)]
    calibration = Calibration(collect_statistics(loaded.proto, tensors, batches), DEFAULT_SETTINGS)
    choices = choose_layer_methods(
        loaded.proto, loaded.layers, ORT, calibration, batches, methods=("max", "percentile"), progress=False
    )
    assert set(choices.methods) == set(loaded.layer_names) and "add" in choices.errors


@pytest.mark.int8_numeric
def test_an_fp32_conv_between_int8_convs_keeps_its_float_weights_in_the_backends_session():
    """ONNX Runtime's WeightBiasQuantization would give a float conv fed by a DequantizeLinear per-tensor INT8
    weights; a depthwise conv whose channels differ 1000x in scale then loses its small channels."""
    net = _Net(3)
    stem = net.relu6(net.conv("x", "stem"), "stem_relu6")
    depthwise = net.conv(stem, "depthwise", group=C)
    scaled = next(init for init in net.inits if init.name == "depthwise.w")
    weights = numpy_helper.to_array(scaled) * np.logspace(-3, 0, C, dtype=np.float32)[:, None, None, None]
    scaled.CopyFrom(numpy_helper.from_array(weights.astype(np.float32), "depthwise.w"))
    model = net.model(net.conv(net.relu6(depthwise, "depthwise_relu6"), "project"))
    typed = _lowered(model, precisions={"stem": "int8", "depthwise": "fp32", "project": "int8"})
    feeds = _feeds(0)
    as_written = _run(typed, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    backend = OnnxRuntimeCPU(1)
    (optimized,) = backend.run_engine(backend.build_graph(typed, {"graph_optimization_level": "all"}), feeds)
    np.testing.assert_allclose(optimized, as_written, rtol=0, atol=1e-3 * float(np.abs(as_written).max()))
