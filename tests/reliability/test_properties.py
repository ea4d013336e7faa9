"""Property-based tests: the rewriter on random graphs and plans, and action masks on random search spaces.
Plan serialization round trips are tested in tests/test_plan.py (test_round_trip_property and neighbours)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.base import Capabilities, Knob
from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.config import SearchSpaceConfig
from autotune.model import TUNABLE_OP_TYPES, Layer, prepare_model
from autotune.plan import PRECISIONS, Plan
from autotune.quant.recipe import ORT_X86, TENSORRT
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.search.space import CALIBRATION_KNOB, GRANULARITY_KNOB, build_space
from autotune.testing import synthetic_evaluator
from envs.engine_build import EngineBuildEnv

RECIPES = {"ORT_X86": ORT_X86, "TENSORRT": TENSORRT}
_SETTINGS = settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- random graphs ---------------------------------------------------------------------------------------


class _Builder:
    """Grows a random DAG of MatMul / Gemm / Conv / ConvTranspose / Relu / Add (Flatten joins conv and dense)."""

    def __init__(self, draw, rng: np.random.Generator):
        self.draw, self.rng = draw, rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.shapes: dict[str, list[int]] = {}

    def weight(self, shape: list[int], scale: float = 1.0) -> str:
        same = [name for name, init in self.inits.items() if list(init.dims) == shape and name.startswith("w")]
        if same and self.draw(st.integers(0, 4)) == 0:  # now and then, one weight read by two layers
            return same[0]
        name = f"w{len(self.inits)}"
        values = self.rng.standard_normal(shape) * scale / np.sqrt(max(1, int(np.prod(shape[1:]))))
        self.inits[name] = numpy_helper.from_array(values.astype(np.float32), name)
        return name

    def bias(self, size: int) -> str:
        name = f"b{len(self.inits)}"
        self.inits[name] = numpy_helper.from_array((self.rng.standard_normal(size) * 0.1).astype(np.float32), name)
        return name

    def add(self, op_type: str, inputs: list[str], shape: list[int], **attributes) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{len(self.nodes)}", **attributes))
        self.shapes[out] = shape
        return out

    def step(self, x: str) -> str:
        shape = self.shapes[x]
        draw = self.draw
        if len(shape) == 4:
            op = draw(st.sampled_from(["Conv", "Conv", "ConvTranspose", "Relu", "Add", "Flatten"]))
            n, c, h, w = shape
            if op == "Conv":
                out, k = draw(st.integers(1, 6)), draw(st.sampled_from([1, 3]))
                group = c if (out == c and c > 1 and draw(st.booleans())) else 1
                inputs = [x, self.weight([out, c // group, k, k])]
                if draw(st.booleans()):
                    inputs.append(self.bias(out))
                return self.add("Conv", inputs, [n, out, h, w], pads=[k // 2] * 4, group=group)
            if op == "ConvTranspose":
                if h + 2 > 8 or w + 2 > 8:
                    return self.add("Relu", [x], shape)
                out = draw(st.integers(1, 4))
                inputs = [x, self.weight([c, out, 3, 3])]
                if draw(st.booleans()):
                    inputs.append(self.bias(out))
                return self.add("ConvTranspose", inputs, [n, out, h + 2, w + 2])
            if op == "Flatten":
                return self.add("Flatten", [x], [n, c * h * w], axis=1)
        else:
            op = draw(st.sampled_from(["MatMul", "MatMul", "Gemm", "WeightFirstMatMul", "Relu", "Add"]))
            if op == "MatMul":
                out = draw(st.integers(1, 12))
                return self.add("MatMul", [x, self.weight([shape[-1], out])], [*shape[:-1], out])
            if op == "Gemm" and len(shape) == 2:
                out, trans_b = draw(st.integers(1, 12)), draw(st.booleans())
                inputs = [x, self.weight([out, shape[1]] if trans_b else [shape[1], out])]
                if draw(st.booleans()):
                    inputs.append(self.bias(out))
                return self.add("Gemm", inputs, [shape[0], out], transB=int(trans_b))
            if op == "WeightFirstMatMul" and len(shape) == 2:
                rows = draw(st.integers(1, 6))
                return self.add("MatMul", [self.weight([rows, shape[0]]), x], [rows, shape[1]])
        if op == "Add":
            partners = [name for name, s in self.shapes.items() if s == shape and name != x]
            other = draw(st.sampled_from(partners)) if partners else self.bias(shape[-1])
            return self.add("Add", [x, other], shape)
        return self.add("Relu", [x], shape)


@st.composite
def random_models(draw) -> onnx.ModelProto:
    builder = _Builder(draw, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    kind = draw(st.sampled_from(["image", "features", "sequence"]))
    if kind == "image":
        shape = [draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(2, 5)), draw(st.integers(2, 5))]
    else:
        shape = [draw(st.integers(1, 4)), draw(st.integers(1, 12))]
        if kind == "sequence":
            shape.insert(1, draw(st.integers(1, 3)))  # [batch, sequence, features]
    builder.shapes["x"] = shape
    current = "x"
    for _ in range(draw(st.integers(1, 12))):
        current = builder.step(current)
    if not any(node.op_type in TUNABLE_OP_TYPES for node in builder.nodes):  # at least one layer to tune
        last = builder.shapes[current]
        weight = builder.weight([last[1], last[1], 1, 1] if len(last) == 4 else [last[-1], 3])
        out_shape = last if len(last) == 4 else [*last[:-1], 3]
        current = builder.add("Conv" if len(last) == 4 else "MatMul", [current, weight], out_shape)
    extra = [name for name in builder.shapes if name not in ("x", current) and draw(st.integers(0, 3)) == 0]
    outputs = [current, *extra]  # a tensor that is both a graph output and read by a layer, now and then
    graph = helper.make_graph(
        builder.nodes,
        "random",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, builder.shapes[name]) for name in outputs],
        list(builder.inits.values()),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", draw(st.sampled_from([13, 17, 21])))])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)  # the generator itself only makes valid float models
    return model


_range_ends = st.one_of(st.just(0.0), st.floats(1e-6, 1e4), st.floats(1e-30, 1e-6))


@given(model=random_models(), data=st.data())
@_SETTINGS
def test_rewriter_output_passes_the_full_checker_and_runs_in_ort(model, data):
    loaded = prepare_model(model, Path("random.onnx"), None)
    assume(loaded.layers)
    recipe_name = data.draw(st.sampled_from(list(RECIPES)), label="recipe")
    recipe = RECIPES[recipe_name]
    precisions = {layer.name: data.draw(st.sampled_from(["fp32", "int8", "fp16"])) for layer in loaded.layers}
    granularity = data.draw(st.sampled_from(["per_channel", "per_tensor"]), label="granularity")
    plan = Plan.make(precisions, {GRANULARITY_KNOB: granularity})
    ranges = {
        name: (-data.draw(_range_ends, label=f"lo {name}"), data.draw(_range_ends, label=f"hi {name}"))
        for name in required_ranges(loaded.layers, recipe, loaded.proto)
    }
    before = loaded.proto.SerializeToString()

    for layer in loaded.layers:
        event(f"{precisions[layer.name]} {layer.op_type}")
    typed = rewrite(loaded.proto, loaded.layers, plan, ranges, recipe)

    assert loaded.proto.SerializeToString() == before, "the rewriter changed its input"
    onnx.checker.check_model(typed, full_check=True)
    assert [o.name for o in typed.graph.output] == [o.name for o in loaded.proto.graph.output]
    backend = OnnxRuntimeCPU(intra_op_threads=1)
    level = data.draw(st.sampled_from(["all", "extended", "basic"]), label="graph_optimization_level")
    session = backend.build(typed, {"graph_optimization_level": level})
    feeds = {"x": np.random.default_rng(0).standard_normal(loaded.inputs[0].shape).astype(np.float32)}
    got = backend.run(session, feeds)
    want = backend.run(backend.build(loaded.proto, {}), feeds)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(g.dtype == np.float32 for g in got)
    if "int8" not in precisions.values():  # fp16 layers compute the same function, to fp16 rounding
        exact = set(precisions.values()) == {"fp32"}
        for g, w in zip(got, want, strict=True):
            scale = max(1.0, float(np.abs(w).max()))
            np.testing.assert_allclose(g, w, rtol=0, atol=(1e-5 if exact else 3e-2) * scale)


# ---- random search spaces and action masks ---------------------------------------------------------------


@st.composite
def random_capabilities(draw) -> Capabilities:
    if draw(st.booleans()):
        return OnnxRuntimeCPU().capabilities()
    others = [p for p in PRECISIONS if p != "fp32"]
    precisions = {
        op: ("fp32", *[p for p in others if draw(st.booleans())])
        for op in TUNABLE_OP_TYPES
        if draw(st.integers(0, 4))  # now and then an op type the backend has nothing for
    }
    knobs = tuple(
        Knob(f"knob{i}", tuple(draw(st.lists(st.sampled_from(["a", "b", "c", 1, 2, True]), min_size=1, unique=True))))
        for i in range(draw(st.integers(0, 3)))
    )
    return Capabilities(precisions, knobs)


def _layers(draw) -> list[Layer]:
    count = draw(st.integers(1, 8))
    return [
        Layer(f"l{i}_{op.lower()}", op, i, ("x",), "w", 0, None, "y", ((4, 4),), (4, 4), 16, 16, i + 1)
        for i, op in enumerate(draw(st.sampled_from(TUNABLE_OP_TYPES)) for _ in range(count))
    ]


def _subset(draw, values, allow_none: bool = True):
    if allow_none and draw(st.booleans()):
        return None
    return [v for v in values if draw(st.booleans())] or [values[0]]


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_masks_never_allow_a_choice_the_backend_or_the_config_rejects(data):
    draw = data.draw
    layers = _layers(draw)
    capabilities = draw(random_capabilities())
    knob_restrictions = {}
    for knob in capabilities.knobs:
        if draw(st.booleans()):
            knob_restrictions[knob.name] = _subset(draw, [*knob.values, "not-offered"], allow_none=False)
    names = [layer.name for layer in layers]
    config = SearchSpaceConfig(
        precisions=_subset(draw, list(PRECISIONS)),
        include_layers=draw(st.one_of(st.none(), st.sampled_from(names).map(re.escape), st.just("matmul|gemm"))),
        exclude_layers=draw(st.one_of(st.none(), st.sampled_from(names).map(re.escape), st.just("conv"))),
        op_types=_subset(draw, ["Conv", "ConvTranspose", "Gemm", "MatMul"]),
        calibration_methods=_subset(draw, ["max", "percentile", "entropy"], allow_none=False),
        weight_granularity=_subset(draw, ["per_channel", "per_tensor"], allow_none=False),
        knobs=knob_restrictions,
        group_size=draw(st.integers(1, 4)),
    )
    offered = {knob.name: set(knob.values) for knob in capabilities.knobs}
    if any(not set(values) & offered[name] for name, values in knob_restrictions.items()):
        try:
            build_space(layers, capabilities, config)
        except ValueError as error:
            assert "is offered" in str(error)
            return
        raise AssertionError("a knob restriction the backend cannot meet was accepted")
    space = build_space(layers, capabilities, config)

    def check(plan: Plan):
        assert space.violations(plan) == []
        for layer in layers:
            precision = plan.precision_map[layer.name]
            assert precision in capabilities.precisions_for(layer.op_type)
            if precision != "fp32":
                assert config.precisions is None or precision in config.precisions
                assert config.op_types is None or layer.op_type in config.op_types
                assert not config.include_layers or re.search(config.include_layers, layer.name)
                assert not config.exclude_layers or not re.search(config.exclude_layers, layer.name)
        knobs = plan.knob_map
        assert knobs[CALIBRATION_KNOB] in config.calibration_methods
        assert knobs[GRANULARITY_KNOB] in config.weight_granularity
        for name, values in offered.items():
            assert knobs[name] in values and knobs[name] in knob_restrictions.get(name, values)
        return evaluate(plan)

    evaluate = synthetic_evaluator(space)
    try:
        env = EngineBuildEnv(space, check)
    except ValueError as error:  # every layer fixed and every knob single-valued: nothing to decide
        assert "nothing to decide" in str(error)
        assert not space.searchable and all(len(k.values) == 1 for k in space.knobs)
        return
    for _ in range(3):
        env.reset()
        done = False
        while not done:
            mask = env.action_masks()
            assert mask.any(), "a step with no allowed action"
            action = draw(st.sampled_from(np.flatnonzero(mask).tolist()))
            _, _, done, _, info = env.step(action)
        assert not env.action_masks().any()
        assert info["status"] == "ok"
