"""``base_precision`` on TensorRT's typed graphs: FP16/BF16 throughout, the plan's layers as overrides.

Golden graphs on two tiny models (a conv net; a MatMul/attention block with a decomposed LayerNorm), base FP16
with one FP32 override and one INT8 layer: the full ONNX checker, TensorRT's Q/DQ rules, each tensor's type, and
(FP16) a run on ONNX Runtime's CPU close to FP32. ONNX Runtime 1.32 has no CPU kernels for bfloat16 Conv, MatMul
or Add (NOT_IMPLEMENTED), so BF16 graphs are proven structurally only (checker, rules, types). TensorRT itself is
not installed here: the engine tests in test_backend.py skip without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from autotune.backends.onnxruntime import int8_recipe
from autotune.backends.tensorrt.options import (
    REFERENCES,
    base_knobs,
    builder_knobs,
    reference_plan,
    supported_precisions,
)
from autotune.backends.tensorrt.rules import check_qdq, requested_precisions
from autotune.capabilities import Capabilities
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import LoadedModel, prepare_model
from autotune.plan import Plan
from autotune.quant.basetype import BASE_PRECISION_KNOB, range_float_ops
from autotune.quant.graphedit import RewriteError
from autotune.quant.recipe import ORT_X86, TENSORRT, QuantRecipe
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.search.space import build_space
from tests.backends.tensorrt.fakes import OPTIONS, fake_trt

HALF = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


# ---- models ----------------------------------------------------------------------------------------------


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> Conv -> GlobalAveragePool -> Flatten -> Gemm on [2, 3, 8, 8]."""
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
            helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
            helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], "conv3"),
            helper.make_node("GlobalAveragePool", ["c3"], ["p"], "pool"),
            helper.make_node("Flatten", ["p"], ["f"], "flatten"),
            helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], "head", transB=1),
        ],
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [
            _init(rng, "w1", (8, 3, 3, 3), 0.3),
            _init(rng, "b1", (8,), 0.1),
            _init(rng, "w2", (8, 8, 3, 3), 0.15),
            _init(rng, "b2", (8,), 0.1),
            _init(rng, "w3", (16, 8, 3, 3), 0.15),
            _init(rng, "b3", (16,), 0.1),
            _init(rng, "w4", (5, 16), 0.3),
            _init(rng, "b4", (5,), 0.1),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def attention_block(seed: int = 0, tokens: int = 8, width: int = 16) -> onnx.ModelProto:
    """One single-head attention block with a residual and a decomposed LayerNorm, on [2, tokens, width].

    The projections q, k, v, o are MatMul layers; QK^T and AV are activation MatMuls (no layers here).
    """
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], "q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], "k_proj"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], "v_proj"),
        helper.make_node("Transpose", ["k"], ["kt"], "k_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], "qk"),
        helper.make_node("Mul", ["scores", "inv_sqrt_d"], ["scaled"], "scale"),
        helper.make_node("Softmax", ["scaled"], ["attn"], "softmax", axis=-1),
        helper.make_node("MatMul", ["attn", "v"], ["ctx"], "av"),
        helper.make_node("MatMul", ["ctx", "wo"], ["o"], "o_proj"),
        helper.make_node("Add", ["o", "x"], ["res"], "residual"),
        helper.make_node("ReduceMean", ["res", "axes"], ["mean"], "ln_mean"),
        helper.make_node("Sub", ["res", "mean"], ["centered"], "ln_sub"),
        helper.make_node("Pow", ["centered", "two"], ["squared"], "ln_pow"),
        helper.make_node("ReduceMean", ["squared", "axes"], ["var"], "ln_var"),
        helper.make_node("Add", ["var", "eps"], ["var_eps"], "ln_eps"),
        helper.make_node("Sqrt", ["var_eps"], ["std"], "ln_sqrt"),
        helper.make_node("Div", ["centered", "std"], ["normed"], "ln_div"),
        helper.make_node("Mul", ["normed", "gamma"], ["scaled_normed"], "ln_gamma"),
        helper.make_node("Add", ["scaled_normed", "beta"], ["y"], "ln_beta"),
    ]
    initializers = [
        _init(rng, "wq", (width, width), width**-0.5),
        _init(rng, "wk", (width, width), width**-0.5),
        _init(rng, "wv", (width, width), width**-0.5),
        _init(rng, "wo", (width, width), width**-0.5),
        numpy_helper.from_array(np.array(width**-0.5, dtype=np.float32), "inv_sqrt_d"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"),
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
        numpy_helper.from_array(np.array(1e-5, dtype=np.float32), "eps"),
        numpy_helper.from_array(1.0 + 0.1 * rng.standard_normal(width).astype(np.float32), "gamma"),
        numpy_helper.from_array(0.1 * rng.standard_normal(width).astype(np.float32), "beta"),
    ]
    graph = helper.make_graph(
        nodes,
        "attention_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, tokens, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, tokens, width])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


MODELS = {"conv": conv_net, "attention": attention_block}

PLANS = {
    # one INT8 layer, one FP32 override, the rest in the base
    "conv": {"conv1": "int8", "conv2": "fp32", "conv3": "fp16", "head": "fp16"},
    "attention": {"q_proj": "int8", "o_proj": "fp32", "k_proj": "fp16", "v_proj": "fp16"},
}


def _prepared(kind: str) -> LoadedModel:
    return prepare_model(MODELS[kind](), Path(f"{kind}.onnx"), None)


def _feeds(model: LoadedModel, seed: int) -> dict[str, np.ndarray]:
    value = model.proto.graph.input[0]
    shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
    return {value.name: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], extra: tuple[str, ...] = ()) -> list[np.ndarray]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in extra)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ranges(model: LoadedModel) -> dict[str, tuple[float, float]]:
    tensors = tuple(required_ranges(model.layers, TENSORRT, model.proto))
    values = _run(model.proto, _feeds(model, seed=1), tensors)[1:]
    return {t: (min(float(v.min()), 0.0), max(float(v.max()), 0.0)) for t, v in zip(tensors, values, strict=True)}


def lowered(
    kind: str, base: str, precisions: dict[str, str] | None = None, recipe: QuantRecipe = TENSORRT
) -> tuple[LoadedModel, onnx.ModelProto]:
    model = _prepared(kind)
    chosen = {name: (base if p == "fp16" else p) for name, p in (precisions or PLANS[kind]).items()}
    plan = Plan.make(chosen, {BASE_PRECISION_KNOB: base})
    return model, rewrite(model.proto, model.layers, plan, _ranges(model), recipe)


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every tensor's element type, as ONNX's (strict) type inference sees it."""
    inferred = shape_inference.infer_shapes(model, strict_mode=True)
    types = {init.name: init.data_type for init in model.graph.initializer}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        types[value.name] = value.type.tensor_type.elem_type
    return types


def float_types(node: onnx.NodeProto, types: dict[str, int]) -> set[int]:
    return {types[name] for name in (*node.input, *node.output) if name and types.get(name) in FLOATS}


# ---- the golden graphs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["conv", "attention"])
@pytest.mark.parametrize("base", ["fp16", "bf16"])
def test_half_base_with_overrides_is_valid_and_fits_tensorrt(kind, base):
    model, typed = lowered(kind, base)
    onnx.checker.check_model(typed, full_check=True)
    check_qdq(typed)
    expected = {name: (base if p == "fp16" else p) for name, p in PLANS[kind].items()}
    assert requested_precisions(typed, expected) == expected
    # the engine's I/O stays as the model's
    assert [v.type.tensor_type.elem_type for v in (*typed.graph.input, *typed.graph.output)] == [TensorProto.FLOAT] * 2


@pytest.mark.parametrize("kind", ["conv", "attention"])
@pytest.mark.parametrize("base", ["fp16", "bf16"])
def test_every_tensor_has_the_type_the_plan_says(kind, base):
    model, typed = lowered(kind, base)
    types = tensor_types(typed)
    half = HALF[base]
    fp32_override = next(name for name, p in PLANS[kind].items() if p == "fp32")
    kept = {name for name in range_float_ops(model.proto.graph, base)}
    if kind == "attention" and base == "fp16":
        assert kept == {"ln_pow", "ln_var", "ln_eps", "ln_sqrt"}  # the variance; Div reads sqrt, back in range
    else:
        assert kept == set()
    nodes = {node.name: node for node in typed.graph.node}
    for node in typed.graph.node:
        found = float_types(node, types)
        if node.op_type == "Cast":
            continue
        if node.name == fp32_override or node.name in kept:
            assert found == {TensorProto.FLOAT}, node.name
            assert "FP32" in node.doc_string  # why, as the exported graph shows it
        else:
            assert found <= {half}, (node.name, found)
    int8_layer = next(name for name, p in PLANS[kind].items() if p == "int8")
    for dq in (nodes[name] for name in nodes if name.startswith(f"{int8_layer}__") and name.endswith("DQ")):
        assert types[dq.input[2]] == TensorProto.INT8 and types[dq.input[1]] == half and types[dq.output[0]] == half
    # Casts only where FP32 and the base meet: the input, the output, and around each FP32 island
    islands = 1 + (kind == "attention" and base == "fp16")
    assert sum(node.op_type == "Cast" for node in typed.graph.node) == 2 + 2 * islands


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["conv", "attention"])
def test_fp16_base_runs_on_onnxruntime_close_to_fp32(kind):
    # ORT CPU executes the TensorRT lowering here: with the weight range its INT8 kernels compute exactly (7-bit
    # where they saturate), or the FP32-base reference runs saturating integer kernels that the FP16 base does not.
    recipe = int8_recipe(base=TENSORRT)
    model, typed = lowered(kind, "fp16", recipe=recipe)
    _, same_plan_fp32 = lowered(
        kind, "fp32", {**PLANS[kind], **{n: "fp32" for n, p in PLANS[kind].items() if p == "fp16"}}, recipe
    )
    feeds = _feeds(model, seed=2)
    fp32 = _run(model.proto, feeds)[0]
    half = _run(typed, feeds)[0]
    reference = _run(same_plan_fp32, feeds)[0]  # the same INT8 layer, everything else FP32
    assert half.dtype == np.float32 and half.shape == fp32.shape
    scale = float(np.abs(fp32).max())
    # FP16 adds only FP16 rounding to the plan's INT8 error
    assert float(np.abs(half - reference).max()) < 5e-3 * scale
    cosine = float(np.dot(half.ravel(), fp32.ravel()) / np.linalg.norm(half) / np.linalg.norm(fp32))
    assert cosine > 0.99


def test_a_layer_in_the_base_precision_is_no_override():
    _, uniform = lowered("conv", "fp16", {"conv1": "fp16", "conv2": "fp16", "conv3": "fp16", "head": "fp16"})
    types = tensor_types(uniform)
    assert [node.op_type for node in uniform.graph.node].count("Cast") == 2  # the graph input and output only
    assert all(float_types(n, types) <= {TensorProto.FLOAT16} for n in uniform.graph.node if n.op_type != "Cast")


def test_a_bf16_layer_in_an_fp16_base_casts_between_the_two():
    _, typed = lowered("conv", "fp16", {"conv1": "fp16", "conv2": "bf16", "conv3": "fp16", "head": "fp16"})
    onnx.checker.check_model(typed, full_check=True)
    types = tensor_types(typed)
    conv2 = next(node for node in typed.graph.node if node.name == "conv2")
    assert float_types(conv2, types) == {TensorProto.BFLOAT16}
    casts = [node for node in typed.graph.node if node.op_type == "Cast"]
    targets = sorted(helper.get_attribute_value(c.attribute[0]) for c in casts)
    assert targets == sorted([TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT])


def test_an_fp32_override_keeps_fp32_weights_shared_with_a_base_layer():
    # Two MatMuls read one weight: ONNX Runtime's float16 converter would give both the FP16-rounded weight.
    weight = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) + 1e-3
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], "fc1"), helper.make_node("MatMul", ["h", "w"], ["y"], "fc2")],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = prepare_model(proto, Path("shared.onnx"), None)
    plan = Plan.make({"fc1": "fp16", "fc2": "fp32"}, {BASE_PRECISION_KNOB: "fp16"})
    typed = rewrite(model.proto, model.layers, plan, {}, TENSORRT)
    inits = {init.name: init for init in typed.graph.initializer}
    fc1, fc2 = (next(n for n in typed.graph.node if n.name == name) for name in ("fc1", "fc2"))
    assert inits[fc1.input[1]].data_type == TensorProto.FLOAT16
    assert inits[fc2.input[1]].data_type == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(inits[fc2.input[1]]), weight)


def test_half_scales_are_what_the_weights_were_quantized_with():
    _, typed = lowered("conv", "fp16")
    inits = {init.name: numpy_helper.to_array(init) for init in typed.graph.initializer}
    dq = next(node for node in typed.graph.node if node.name == "conv1__w__DQ")
    assert inits[dq.input[1]].dtype == np.float16
    q, scales = inits[dq.input[0]], inits[dq.input[1]].astype(np.float32)
    weight = numpy_helper.to_array(next(i for i in conv_net().graph.initializer if i.name == "w1"))
    expected = np.clip(np.rint(weight / scales.reshape(-1, 1, 1, 1)), -127, 127)
    np.testing.assert_array_equal(q, expected)
    assert np.all(scales >= np.finfo(np.float16).tiny)


def test_a_half_base_needs_tensorrts_recipe_and_a_known_base():
    model = _prepared("conv")
    with pytest.raises(RewriteError, match="base_precision=fp16 needs symmetric"):
        rewrite(model.proto, model.layers, Plan.make({}, {BASE_PRECISION_KNOB: "fp16"}), {}, ORT_X86)
    with pytest.raises(RewriteError, match="must be one of"):
        rewrite(model.proto, model.layers, Plan.make({}, {BASE_PRECISION_KNOB: "int8"}), {}, TENSORRT)


# ---- capabilities and the one-liner references ------------------------------------------------------------


@pytest.mark.parametrize(("cc", "bases"), [((7, 5), ("fp32", "fp16")), ((9, 0), ("fp32", "fp16", "bf16"))])
def test_base_knob_offers_what_the_device_has_and_follows_uniform_plans(cc, bases):
    trt = fake_trt("11.4.0.106")
    precisions = supported_precisions(trt, cc)
    (knob,) = base_knobs(precisions)
    assert knob.name == BASE_PRECISION_KNOB and knob.values == bases and knob.default == "fp32"
    model = _prepared("conv")
    space = build_space(
        model.layers, Capabilities(precisions, (*builder_knobs(trt, OPTIONS), knob)), SearchSpaceConfig()
    )
    assert space.uniform("int8").knob(BASE_PRECISION_KNOB) == "fp32"
    uniform = space.uniform("fp16")
    assert uniform.knob(BASE_PRECISION_KNOB) == "fp16" and space.violations(uniform) == []
    if "bf16" not in bases:
        assert space.violations(uniform.with_knobs(**{BASE_PRECISION_KNOB: "bf16"})) != []


def test_whole_model_fp16_reference_is_the_fp16_base_with_no_override():
    model = _prepared("conv")
    precisions = supported_precisions(fake_trt("11.4.0.106"), (8, 0))
    plan = reference_plan(model.layers, "trt-fp16", precisions)
    assert plan.knob(BASE_PRECISION_KNOB) == "fp16"
    weighted = {layer.name for layer in model.layers if "fp16" in precisions[layer.op_type]}
    assert {name for name, p in plan.precision_map.items() if p == "fp16"} == weighted
    typed = rewrite(model.proto, model.layers, plan, {}, TENSORRT)
    assert not any(node.doc_string for node in typed.graph.node)  # nothing left FP32
    assert [node.op_type for node in typed.graph.node].count("Cast") == 2
    assert set(REFERENCES) == {"trt-fp16", "trt-bf16"}
    with pytest.raises(ValueError, match="no bf16"):
        reference_plan(model.layers, "trt-bf16", supported_precisions(fake_trt("11.4.0.106"), (7, 5)))


@pytest.mark.parametrize("kind", ["conv", "attention"])
def test_an_fp8_layer_in_an_fp16_base_has_fp16_scales_and_runs(kind):
    precisions = {name: ("fp8" if p == "int8" else p) for name, p in PLANS[kind].items()}
    model, typed = lowered(kind, "fp16", precisions)
    onnx.checker.check_model(typed, full_check=True)
    check_qdq(typed)
    types = tensor_types(typed)
    fp8_layer = next(name for name, p in precisions.items() if p == "fp8")
    dqs = [n for n in typed.graph.node if n.op_type == "DequantizeLinear" and n.name.startswith(f"{fp8_layer}__")]
    assert len(dqs) == 2  # the activation and the weight
    for dq in dqs:
        assert types[dq.input[2]] == TensorProto.FLOAT8E4M3FN
        assert types[dq.input[1]] == types[dq.output[0]] == TensorProto.FLOAT16
    assert requested_precisions(typed)[fp8_layer] == "fp8"
    feeds = _feeds(model, seed=2)
    fp32, half = _run(model.proto, feeds)[0], _run(typed, feeds)[0]
    cosine = float(np.dot(half.ravel(), fp32.ravel()) / np.linalg.norm(half) / np.linalg.norm(fp32))
    assert cosine > 0.99


def test_inspect_lists_what_an_fp16_base_keeps_fp32_with_the_reason(tmp_path):
    from autotune.api import float_ops

    model = _prepared("attention")
    listed = {row["name"]: row["reason"] for row in float_ops(model, "tensorrt")}
    assert {"ln_pow", "ln_var", "ln_eps", "ln_sqrt"} <= set(listed)
    assert "FP32 in the fp16 base" in listed["ln_pow"]
    # ONNX Runtime has no typed graph: nothing of the kind
    assert not {"ln_pow", "ln_var"} & {row["name"] for row in float_ops(model, "onnxruntime")}
