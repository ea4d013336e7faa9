"""Tests for autotune.quant.rewrite and autotune.quant.qparams on tiny hand-built ONNX models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedInRuntime

from autotune.backends.onnxruntime import int8_recipe
from autotune.model.layers import Layer, prepare_model
from autotune.plan import Plan
from autotune.quant.qparams import (
    activation_qparams,
    fake_quant,
    fp8_activation_scale,
    int32_bias_floor,
    quantize_bias_int32,
    quantize_weight,
    quantize_weight_fp8,
)
from autotune.quant.recipe import ORT_X86, TENSORRT
from autotune.quant.rewrite import RewriteError, required_ranges, rewrite
from tests.quant.reference import (
    BUILDERS,
    RNG_SEED,
    forward,
    int8_reference,
    model_mlp,
    random_feeds,
)

# ----------------------------------------------------------------------------------------------------------
# fixtures and helpers
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    model: onnx.ModelProto
    layers: list[Layer]
    ranges: dict[str, tuple[float, float]]
    feeds: dict[str, np.ndarray]

    def layer(self, name: str) -> Layer:
        return next(layer for layer in self.layers if layer.name == name)


def make_case(kind: str) -> Case:
    rng = np.random.default_rng(RNG_SEED)
    raw = BUILDERS[kind](rng)
    loaded = prepare_model(raw, Path("x.onnx"), None, include_activation_matmuls=(kind == "attn"))
    # Calibrate on other inputs than the evaluation batch, so saturation is exercised too.
    calib = forward(loaded.proto, random_feeds(loaded.proto, rng))
    ranges = {name: (min(float(v.min()), 0.0), max(float(v.max()), 0.0)) for name, v in calib.items()}
    return Case(loaded.proto, loaded.layers, ranges, random_feeds(loaded.proto, rng))


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {kind: make_case(kind) for kind in BUILDERS}


def run_ort(model: onnx.ModelProto, feeds: dict, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> dict:
    """The graph's outputs under ONNX Runtime; skips only where this build has no kernel for one of its nodes.

    Any other error (an invalid graph, a type mismatch) fails the test: it is a rewrite that went wrong.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except NotImplementedInRuntime as error:
        if "NOT_IMPLEMENTED" not in str(error):
            raise
        pytest.skip(f"this ONNX Runtime build has no kernel for the graph: {error}")
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def check(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


def uniform(case: Case, precision: str, **knobs) -> Plan:
    return Plan.uniform([layer.name for layer in case.layers], precision, knobs)


def inits_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def node_named(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


# ----------------------------------------------------------------------------------------------------------
# qparams
# ----------------------------------------------------------------------------------------------------------


def test_activation_qparams_uint8_and_int8():
    scale, zp = activation_qparams(-1.0, 3.0, "uint8")
    assert scale.dtype == np.float32 and zp.dtype == np.uint8
    assert scale == np.float32(4.0 / 255) and zp == 64  # round(1 / (4/255)) = round(63.75)
    scale, zp = activation_qparams(-1.0, 3.0, "int8")
    assert scale == np.float32(3.0 / 127) and zp.dtype == np.int8 and zp == 0
    for dtype in ("uint8", "int8"):
        scale, _ = activation_qparams(0.0, 0.0, dtype)
        assert scale > 0 and scale.dtype == np.float32
    assert activation_qparams(0.5, 2.0, "uint8")[1] == 0  # the range is widened to include zero
    with pytest.raises(ValueError):
        activation_qparams(-1, 1, "int4")


def test_int32_bias_floor_raises_only_the_scales_whose_bias_would_overflow():
    bias = np.array([4.0, 0.1, -3.0, 0.0], dtype=np.float32)
    act_scale = 6.0 / 255
    floor = int32_bias_floor(bias, act_scale, (4,))
    scales = np.array([1e-12, 1e-3, 1e-3, 1e-12], dtype=np.float32)
    raised = np.maximum(scales, floor)
    assert raised[0] > scales[0] and (raised[1:] == scales[1:]).all()  # only the near-zero channel with a bias
    q = quantize_bias_int32(bias, act_scale * raised)
    assert np.abs(q).max() < 2**31 - 1
    np.testing.assert_allclose(q * (act_scale * raised.astype(np.float64)), bias, atol=1e-6)
    # Per tensor: one floor from the largest bias; ConvTranspose groups: the channels repeat along the bias.
    assert int32_bias_floor(bias, act_scale, ()).shape == ()
    assert int32_bias_floor(np.tile(bias, 2), act_scale, (4,)).tolist() == floor.tolist()
    q, w_scales = quantize_weight(np.full((4, 2), 1e-9, np.float32), 0, True, floor)
    assert (w_scales >= floor).all() and q.dtype == np.int8


def test_quantize_weight_per_channel_negative_axis_and_zero_channel():
    w = np.array([[1.0, 0.0, -2.0], [0.5, 0.0, 4.0]], dtype=np.float32)
    q, scales = quantize_weight(w, -1, per_channel=True)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (3,)
    np.testing.assert_allclose(scales, [1 / 127, 1.0, 4 / 127], rtol=1e-6)
    assert (scales > 0).all() and q[:, 1].tolist() == [0, 0]
    assert q[0, 0] == 127 and q[1, 2] == 127 and q[0, 2] == -64  # -2 / (4/127) = -63.5 -> -64 (half to even)
    q, scale = quantize_weight(w, None, per_channel=False)
    assert scale.shape == () and scale == np.float32(4 / 127) and q.min() >= -127


def test_fake_quant_rounds_half_to_even_and_saturates():
    x = np.array([0.5, 1.5, 2.5, -0.5, 1000.0, -1000.0], dtype=np.float32)
    np.testing.assert_array_equal(fake_quant(x, 1.0, 0, "int8"), [0, 2, 2, -0, 127, -128])
    np.testing.assert_array_equal(fake_quant(x, 1.0, 10, "uint8"), [0, 2, 2, -0, 245, -10])
    np.testing.assert_allclose(fake_quant(np.array([1000.0, 0.3], np.float32), 1.0, 0, "float8e4m3fn"), [448, 0.3125])
    per_axis = fake_quant(np.ones((2, 3), np.float32) * 0.26, np.array([0.5, 0.1]), np.zeros(2), "int8", axis=0)
    np.testing.assert_allclose(per_axis, [[0.5] * 3, [0.3] * 3], rtol=1e-6)


def test_fp8_params():
    assert fp8_activation_scale(-2.0, 448.0) == np.float32(1.0)
    q, scales = quantize_weight_fp8(np.array([[448.0, -1.0]], np.float32), 0, True)
    assert q.dtype == ml_dtypes.float8_e4m3fn and float(q[0, 0]) == 448.0 and scales.tolist() == [1.0]


# ----------------------------------------------------------------------------------------------------------
# rewrite: checker
# ----------------------------------------------------------------------------------------------------------

VARIANTS = [
    ("int8", ORT_X86, "per_channel"),
    ("int8", TENSORRT, "per_channel"),
    ("int8", ORT_X86, "per_tensor"),
    ("int8", TENSORRT, "per_tensor"),
    ("fp16", ORT_X86, "per_channel"),
    ("bf16", ORT_X86, "per_channel"),
    ("fp8", TENSORRT, "per_channel"),
    ("fp8", TENSORRT, "per_tensor"),
]


@pytest.mark.parametrize("kind", ["mlp", "qk", "cnn", "gemm", "deconv", "shared", "attn"])
@pytest.mark.parametrize(("precision", "recipe", "granularity"), VARIANTS)
def test_every_rewrite_passes_the_checker(cases, kind, precision, recipe, granularity):
    case = cases[kind]
    before = case.model.SerializeToString()
    out = rewrite(
        case.model, case.layers, uniform(case, precision, weight_granularity=granularity), case.ranges, recipe
    )
    check(out)
    assert case.model.SerializeToString() == before, "the input model was mutated"
    assert out is not case.model
    opset = next(o.version for o in out.opset_import if o.domain == "")
    if precision == "fp8":
        assert opset >= 19
    if precision == "bf16" and kind == "cnn":
        assert opset >= 22  # Conv takes bfloat16 only from opset 22
    # Graph outputs keep their names and stay float.
    assert [o.name for o in out.graph.output] == [o.name for o in case.model.graph.output]


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm", "qk"])
def test_mixed_plan_passes_checker_and_runs(cases, kind):
    case = cases[kind]
    choices = ["int8", "fp16", "fp32", "bf16", "fp8"]
    plan = Plan.make({layer.name: choices[i % len(choices)] for i, layer in enumerate(case.layers)})
    out = rewrite(case.model, case.layers, plan, case.ranges, ORT_X86)
    check(out)
    int8_only = Plan.make({layer.name: ("int8" if i % 2 == 0 else "fp16") for i, layer in enumerate(case.layers)})
    out = rewrite(case.model, case.layers, int8_only, case.ranges, ORT_EXACT)
    check(out)
    got = run_ort(out, case.feeds)  # a graph ORT cannot run is a rewrite that failed
    # fp16 layers are close to float, so the int8 fake-quant reference (fp16 layers in float) is close too.
    reference = int8_reference(case.model, case.layers, int8_only, case.ranges, ORT_EXACT, case.feeds, ort_bias=True)
    for name, value in got.items():
        scale = float(np.abs(reference[name]).max())
        np.testing.assert_allclose(value, reference[name], atol=0.02 * scale, err_msg=name)


# ----------------------------------------------------------------------------------------------------------
# rewrite: numerics under ORT
# ----------------------------------------------------------------------------------------------------------


LEVELS = {
    "no_opt": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "all_opt": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


ORT_EXACT = int8_recipe()
"""ORT_X86 as the ORT backend lowers it on this CPU: int8 weights where its kernels are exact, else uint8 or 7-bit."""

RECIPES = {
    "ort_x86": ORT_EXACT,
    # ORT CPU runs the TensorRT recipe here as a reference executor: with the weight range its kernels compute.
    "tensorrt": int8_recipe(base=TENSORRT),
    "ort_out_no_fold": dataclasses.replace(ORT_EXACT, quantize_matmul_output=True, fold_activation_into_output=False),
}


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "qk", "cnn", "gemm", "deconv", "attn"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("level", list(LEVELS))
def test_int8_matches_numpy_fake_quant(cases, kind, recipe_name, granularity, level):
    case, recipe = cases[kind], RECIPES[recipe_name]
    plan = uniform(case, "int8", weight_granularity=granularity)
    out = rewrite(case.model, case.layers, plan, case.ranges, recipe)
    got = run_ort(out, case.feeds, LEVELS[level])
    fused = level == "all_opt"
    expected = int8_reference(case.model, case.layers, plan, case.ranges, recipe, case.feeds, ort_bias=fused)
    float_ref = forward(case.model, case.feeds)
    for name, value in got.items():
        magnitude = float(np.abs(expected[name]).max())
        err = np.abs(value - expected[name])
        if fused and (kind in ("cnn", "deconv") or recipe.quantize_matmul_output):
            # Fused integer kernels (QLinearConv's fixed-point requantization, ORT's own int32 bias) can move
            # a value that sits on a rounding tie by one step, which the next layer then sees. Most values
            # still match tightly; a wrong scale or zero point would move nearly all of them.
            assert np.mean(err > 1e-4 * magnitude) < 0.1, (name, np.mean(err > 1e-4 * magnitude))
            assert err.max() < 0.02 * magnitude, (name, err.max())
        else:
            np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-4 * magnitude, err_msg=name)
        produced_by_layer = any(layer.output == name for layer in case.layers)
        if produced_by_layer:  # the reference really quantized something
            assert np.abs(expected[name] - float_ref[name]).max() > 1e-4 * magnitude, name


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm", "qk"])
def test_fp16_close_to_float(cases, kind):
    case = cases[kind]
    out = rewrite(case.model, case.layers, uniform(case, "fp16"), case.ranges, ORT_X86)
    got = run_ort(out, case.feeds)
    reference = forward(case.model, case.feeds)
    for name, value in got.items():
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, reference[name], atol=1e-2 * max(1.0, np.abs(reference[name]).max()))


def test_fp8_matches_numpy_fake_quant(cases):
    case = cases["mlp"]
    out = rewrite(case.model, case.layers, uniform(case, "fp8"), case.ranges, TENSORRT)
    weights = [i for i in out.graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN and len(i.dims) == 2]
    assert {w.name for w in weights} == {"W1__fp8", "W2__fp8"}
    # ORT >= EXTENDED drops a Relu in front of an FP8 QuantizeLinear with zero point 0 (ReluQuantFusion takes 0
    # for the lowest code, true only for uint8), so check the graph's semantics at BASIC.
    got = run_ort(out, case.feeds, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    inits = inits_of(case.model)
    x = fake_quant(case.feeds["X"], fp8_activation_scale(*case.ranges["X"]), 0, "float8e4m3fn")
    q1, s1 = quantize_weight_fp8(inits["W1"], -1, True)
    h = x @ (q1.astype(np.float32) * s1)
    r = fake_quant(np.maximum(h, 0), fp8_activation_scale(*case.ranges["r"]), 0, "float8e4m3fn")
    q2, s2 = quantize_weight_fp8(inits["W2"], -1, True)
    y = r @ (q2.astype(np.float32) * s2)
    np.testing.assert_allclose(got["Y"], y, atol=1e-4 * np.abs(y).max())
    np.testing.assert_array_equal(got["Z"], forward(case.model, case.feeds)["Z"])


# ----------------------------------------------------------------------------------------------------------
# rewrite: graph structure
# ----------------------------------------------------------------------------------------------------------


def test_isolation_only_the_quantized_layer_sees_fake_quant(cases):
    case = cases["qk"]
    plan = Plan.make({"q_proj": "int8", "k_proj": "fp32"})
    out = rewrite(case.model, case.layers, plan, case.ranges, ORT_X86)
    check(out)
    q_node, k_node, add = (node_named(out, n) for n in ("q_proj", "k_proj", "residual"))
    assert k_node.input[0] == "A" and add.input[0] == "A"
    assert q_node.input[0] != "A"
    producer = next(n for n in out.graph.node if q_node.input[0] in n.output)
    assert producer.op_type == "DequantizeLinear"
    quantize = next(n for n in out.graph.node if producer.input[0] in n.output)
    assert quantize.op_type == "QuantizeLinear" and quantize.input[0] == "A"
    # The DQ output feeds the q MatMul and nothing else.
    assert [n.name for n in out.graph.node if q_node.input[0] in n.input] == ["q_proj"]
    fp32 = run_ort(case.model, case.feeds)
    int8 = run_ort(out, case.feeds)
    np.testing.assert_array_equal(int8["K"], fp32["K"])
    np.testing.assert_array_equal(int8["S"], fp32["S"])
    assert not np.array_equal(int8["Q"], fp32["Q"])


def test_two_int8_consumers_get_dedicated_pairs(cases):
    case = cases["qk"]
    out = rewrite(case.model, case.layers, uniform(case, "int8"), case.ranges, ORT_X86)
    q_in, k_in = node_named(out, "q_proj").input[0], node_named(out, "k_proj").input[0]
    assert q_in != k_in and "A" not in (q_in, k_in)
    assert node_named(out, "residual").input[0] == "A"
    assert sum(n.op_type == "QuantizeLinear" for n in out.graph.node) == 2


def test_shared_weight_keeps_float_initializer_for_fp32_layer(cases):
    case = cases["shared"]
    out = rewrite(case.model, case.layers, Plan.make({"first": "int8", "second": "fp32"}), case.ranges, ORT_X86)
    check(out)
    inits = inits_of(out)
    assert "W" in inits and inits["W"].dtype == np.float32
    assert node_named(out, "second").input[1] == "W"
    assert node_named(out, "first").input[1] != "W"
    assert inits["W__int8"].dtype == np.int8
    # Both quantized: the float weight has no reader left and is dropped; the int8 copy is shared.
    out = rewrite(case.model, case.layers, uniform(case, "int8"), case.ranges, ORT_X86)
    check(out)
    assert "W" not in inits_of(out)
    assert sum(i.data_type == TensorProto.INT8 and len(i.dims) == 2 for i in out.graph.initializer) == 1
    # fp16 next to fp32: the float weight stays, the fp16 copy is added.
    out = rewrite(case.model, case.layers, Plan.make({"first": "fp16"}), case.ranges, ORT_X86)
    check(out)
    assert inits_of(out)["W"].dtype == np.float32 and inits_of(out)["W__fp16"].dtype == np.float16


def test_unused_float_weights_are_removed(cases):
    case = cases["mlp"]
    out = rewrite(case.model, case.layers, uniform(case, "int8"), case.ranges, ORT_X86)
    names = set(inits_of(out))
    assert "W1" not in names and "W2" not in names and "Res" in names


def _initializer_inputs(model: onnx.ModelProto, slot: int, op_types=("QuantizeLinear", "DequantizeLinear")):
    inits = inits_of(model)
    nodes = [n for n in model.graph.node if n.op_type in op_types and len(n.input) > slot]
    return [(n, inits[n.input[slot]]) for n in nodes if n.input[slot] in inits]


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm", "attn"])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_tensorrt_recipe_is_symmetric_int8_with_positive_scales(cases, kind, granularity):
    case = cases[kind]
    out = rewrite(case.model, case.layers, uniform(case, "int8", weight_granularity=granularity), case.ranges, TENSORRT)
    zero_points = _initializer_inputs(out, 2)
    assert zero_points and all((zp == 0).all() for _, zp in zero_points)
    scales = _initializer_inputs(out, 1)
    assert all(s.dtype == np.float32 and (s > 0).all() for _, s in scales)
    q_nodes = [(n, zp) for n, zp in zero_points if n.op_type == "QuantizeLinear"]
    assert q_nodes and all(zp.dtype == np.int8 for _, zp in q_nodes)
    # TensorRT fuses output Q/DQ itself and wants float bias: no int32 anywhere, no output pairs.
    assert not any(i.data_type == TensorProto.INT32 for i in out.graph.initializer)
    assert len(q_nodes) == sum(len(layer.activation_inputs) for layer in case.layers)


def test_ort_recipe_uses_uint8_activations_and_int32_conv_bias(cases):
    case = cases["cnn"]
    out = rewrite(case.model, case.layers, uniform(case, "int8"), case.ranges, ORT_X86)
    q_zero_points = [zp for n, zp in _initializer_inputs(out, 2) if n.op_type == "QuantizeLinear"]
    assert q_zero_points and all(zp.dtype == np.uint8 for zp in q_zero_points)
    int32_dq = [n for n, x in _initializer_inputs(out, 0, ("DequantizeLinear",)) if x.dtype == np.int32]
    assert [n.input[0] for n in int32_dq] == ["Bc1__int32__conv1", "Bc2__int32__conv2"]
    assert all(helper.get_attribute_value(n.attribute[0]) == 0 for n in int32_dq)
    # Conv1's output pair sits after the Relu (folded), conv2's on its own output.
    relu = node_named(out, "relu1")
    consumer = next(n for n in out.graph.node if relu.output[0] in n.input)
    assert consumer.op_type == "QuantizeLinear"
    assert node_named(out, "conv1").output[0] == "c1"
    conv2 = node_named(out, "conv2")
    assert conv2.output[0] != "Y" and next(n for n in out.graph.node if "Y" in n.output).op_type == "DequantizeLinear"
    # Per-channel weight DQs carry the channel axis.
    weight_dq = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("Wc")]
    assert [helper.get_attribute_value(n.attribute[0]) for n in weight_dq] == [0, 0]


def test_required_ranges(cases):
    cnn = cases["cnn"]
    assert required_ranges(cnn.layers, ORT_X86, cnn.model) == ["X", "r1", "Y"]
    assert required_ranges(cnn.layers, TENSORRT, cnn.model) == ["X", "r1"]
    no_fold = dataclasses.replace(ORT_X86, fold_activation_into_output=False)
    assert required_ranges(cnn.layers, no_fold, cnn.model) == ["X", "c1", "r1", "Y"]
    mlp = cases["mlp"]
    assert required_ranges(mlp.layers, ORT_X86, mlp.model) == ["X", "r"]
    with_out = dataclasses.replace(ORT_X86, quantize_matmul_output=True)
    assert required_ranges(mlp.layers, with_out, mlp.model) == ["X", "r", "Y"]
    # Exactly these ranges suffice.
    for recipe in (ORT_X86, TENSORRT, no_fold, with_out):
        for case in (cnn, mlp):
            ranges = {name: case.ranges[name] for name in required_ranges(case.layers, recipe, case.model)}
            check(rewrite(case.model, case.layers, uniform(case, "int8"), ranges, recipe))


def test_missing_range_names_the_tensor(cases):
    case = cases["cnn"]
    ranges = {k: v for k, v in case.ranges.items() if k != "r1"}
    before = case.model.SerializeToString()
    with pytest.raises(RewriteError, match=r"'r1'.*calibration must cover it"):
        rewrite(case.model, case.layers, uniform(case, "int8"), ranges, ORT_X86)
    assert case.model.SerializeToString() == before


def test_unsupported_requests_raise(cases):
    case = cases["gemm"]
    weightless = [dataclasses.replace(case.layers[0], weight=None, weight_axis=None)]
    with pytest.raises(RewriteError, match="needs a constant weight"):
        rewrite(case.model, weightless, uniform(case, "int8"), case.ranges, ORT_X86)
    with pytest.raises(RewriteError, match="weight_granularity"):
        rewrite(
            case.model,
            case.layers,
            uniform(case, "int8", weight_granularity="per_block"),
            case.ranges,
            ORT_X86,
        )
    stale = [dataclasses.replace(case.layers[0], name="gone")]
    with pytest.raises(RewriteError, match="'gone'"):
        rewrite(case.model, stale, Plan.make({"gone": "int8"}), case.ranges, ORT_X86)


def test_fp32_plan_is_a_copy_with_the_same_graph(cases):
    case = cases["mlp"]
    out = rewrite(case.model, case.layers, uniform(case, "fp32"), case.ranges, ORT_X86)
    assert out is not case.model
    assert out.SerializeToString() == case.model.SerializeToString()


def test_half_precision_casts_are_dedicated_and_output_name_is_kept(cases):
    case = cases["qk"]
    out = rewrite(case.model, case.layers, Plan.make({"q_proj": "bf16"}), case.ranges, ORT_X86)
    check(out)
    q_node = node_named(out, "q_proj")
    cast_in = next(n for n in out.graph.node if q_node.input[0] in n.output)
    assert cast_in.op_type == "Cast" and cast_in.input[0] == "A"
    assert helper.get_attribute_value(cast_in.attribute[0]) == TensorProto.BFLOAT16
    assert q_node.output[0] != "Q"
    cast_out = next(n for n in out.graph.node if "Q" in n.output)
    assert cast_out.op_type == "Cast" and helper.get_attribute_value(cast_out.attribute[0]) == TensorProto.FLOAT
    assert node_named(out, "k_proj").input[0] == "A" and node_named(out, "residual").input[0] == "A"
    assert inits_of(out)["Wq__bf16"].dtype == ml_dtypes.bfloat16


def test_opset_raised_for_int8_on_old_model():
    rng = np.random.default_rng(0)
    model = model_mlp(rng)
    model.opset_import[0].version = 11
    loaded = prepare_model(model, Path("x.onnx"), None)
    ranges = {name: (-3.0, 3.0) for name in ("X", "r")}
    out = rewrite(loaded.proto, loaded.layers, Plan.uniform(loaded.layer_names, "int8"), ranges, ORT_X86)
    check(out)
    assert next(o.version for o in out.opset_import if o.domain == "") == 13


def _one_node_model(op_type: str, dtype: int) -> onnx.ModelProto:
    value = [helper.make_tensor_value_info("x", dtype, [2, 2])]
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x"], ["y"])], "g", value, [helper.make_tensor_value_info("y", dtype, [2, 2])]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_run_ort_skips_only_a_missing_kernel_and_fails_an_invalid_graph():
    with pytest.raises(pytest.skip.Exception, match="NOT_IMPLEMENTED"):  # Floor has no bfloat16 kernel on CPU
        run_ort(_one_node_model("Floor", TensorProto.BFLOAT16), {})
    with pytest.raises(Exception, match="INVALID_GRAPH"):  # Sqrt takes no int32: a graph no runtime may run
        run_ort(_one_node_model("Sqrt", TensorProto.INT32), {})
