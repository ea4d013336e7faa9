"""Property-based tests: the rewriter on random graphs and plans, and action masks on random search spaces.
Plan serialization round trips are tested in tests/test_plan.py (test_round_trip_property and neighbours)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.base import Capabilities, Knob
from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.backends.tensorrt.rules import SUPPORTED_DQ_CONSUMERS, qdq_problems
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import Layer, prepare_model
from autotune.model.optypes import TUNABLE_OP_TYPES, WEIGHTED_OP_TYPES, WEIGHTLESS_OP_TYPES
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, PRECISIONS, Plan
from autotune.quant.recipe import ORT_X86, TENSORRT
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.search.space import build_space
from autotune.testing import synthetic_evaluator
from envs.engine_build import EngineBuildEnv

RECIPES = {"ORT_X86": ORT_X86, "TENSORRT": TENSORRT}
_IMAGE_OPS = (
    "Clip",
    "Clip",
    "Pad",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Sigmoid",
    "LeakyRelu",
    "Mul",
    "Concat",
)
_MIXED = ["fp32", "int8", "fp16"]
_TRT_INT8 = {*WEIGHTED_OP_TYPES, *(op for op in WEIGHTLESS_OP_TYPES if op in SUPPORTED_DQ_CONSUMERS)}
_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- random graphs ---------------------------------------------------------------------------------------


class _Builder:
    """Grows a random DAG of MatMul / Gemm / Conv / ConvTranspose / Relu / Add (Flatten joins conv and dense), and
    between convolutions the ops an INT8 CNN keeps INT8: ReLU6 (Clip), zero Pad, pooling, Sigmoid, Mul, Concat."""

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

    def constant(self, value: np.ndarray) -> str:
        name = f"k{len(self.inits)}"
        self.inits[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def partner(self, x: str) -> str | None:
        """Another tensor of the same shape, to join with ``x`` (a residual Add, a Mul, a Concat)."""
        partners = [name for name, s in self.shapes.items() if s == self.shapes[x] and name != x]
        return self.draw(st.sampled_from(partners)) if partners else None

    def conv(self, x: str, group: int = 1) -> str:
        n, c, h, w = self.shapes[x]
        return self.add(
            "Conv", [x, self.weight([c, c // group, 3, 3]), self.bias(c)], [n, c, h, w], pads=[1] * 4, group=group
        )

    def image_op(self, op: str, x: str) -> str | None:
        """The CNN ops between convolutions that an INT8 plan keeps INT8 (ReLU6, pads, pooling, joins)."""
        n, c, h, w = shape = self.shapes[x]
        if op == "Residual":  # conv -> ReLU6 -> depthwise conv, added to the first conv's output
            first = self.conv(x)
            return self.add("Add", [self.conv(self.image_op("Clip", first), group=c), first], shape)
        if op == "Swish":  # SiLU or Mul(HardSigmoid(x), x), part of the conv's layer (the HardSwish op needs opset 14)
            first = self.conv(x)
            form = self.draw(st.sampled_from(["Sigmoid", "HardSigmoid"]))
            gate = self.add(form, [first], shape)
            return self.add("Mul", [gate, first] if form == "HardSigmoid" else [first, gate], shape)
        if op == "Branches":
            return self.add("Concat", [self.conv(x), self.conv(x)], [n, 2 * c, h, w], axis=1)
        if op == "Clip":
            return self.add("Clip", [x, self.constant(np.float32(0)), self.constant(np.float32(6))], shape)
        if op == "Pad" and h + 2 <= 8 and w + 2 <= 8:
            pads = self.constant(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
            return self.add("Pad", [x, pads, self.constant(np.float32(0))], [n, c, h + 2, w + 2])
        if op == "MaxPool":
            return self.add("MaxPool", [x], shape, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        if op == "AveragePool" and h > 1 and w > 1:
            return self.add("AveragePool", [x], [n, c, h - 1, w - 1], kernel_shape=[2, 2])
        if op == "GlobalAveragePool":
            return self.add("GlobalAveragePool", [x], [n, c, 1, 1])
        if op in ("Sigmoid", "LeakyRelu"):
            return self.add(op, [x], shape)
        other = self.partner(x) if op in ("Mul", "Concat") else None
        if other is not None:
            return self.add(
                op, [x, other], [n, 2 * c, h, w] if op == "Concat" else shape, **({"axis": 1} if op == "Concat" else {})
            )
        return None

    def step(self, x: str) -> str:
        shape = self.shapes[x]
        draw = self.draw
        if len(shape) == 4:
            op = draw(st.sampled_from(["Conv", "Conv", "Conv", "ConvTranspose", "Relu", "Add", "Flatten", *_IMAGE_OPS]))
            if op in _IMAGE_OPS:
                return self.image_op(op, x) or self.add("Relu", [x], shape)
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
    kind = draw(st.sampled_from(["image", "image", "features", "sequence"]))
    if kind == "image":
        shape = [draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(2, 5)), draw(st.integers(2, 5))]
    else:
        shape = [draw(st.integers(1, 4)), draw(st.integers(1, 12))]
        if kind == "sequence":
            shape.insert(1, draw(st.integers(1, 3)))  # [batch, sequence, features]
    builder.shapes["x"] = shape
    current = "x"
    if kind == "image":  # a CNN block first, so that most image graphs have INT8 joins and pools to lower
        current = builder.image_op(draw(st.sampled_from(["Residual", "Swish", "Branches", "Clip"])), current)
    for _ in range(draw(st.integers(1, 7))):
        current = builder.step(current)
    if not any(node.op_type in WEIGHTED_OP_TYPES for node in builder.nodes):  # at least one layer to tune
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
    precisions = {
        layer.name: data.draw(st.sampled_from(["fp32", "int8"] if layer.op_type in WEIGHTLESS_OP_TYPES else _MIXED))
        for layer in loaded.layers
    }
    if recipe is TENSORRT:  # what TensorRT's capabilities offer: no INT8 Sigmoid/LeakyRelu (no fused kernel)
        precisions = {
            layer.name: "fp32" if layer.op_type not in _TRT_INT8 and precisions[layer.name] == "int8" else p
            for layer, p in zip(loaded.layers, precisions.values(), strict=True)
        }
    granularity = data.draw(st.sampled_from(["per_channel", "per_tensor"]), label="granularity")
    plan = Plan.make(precisions, {GRANULARITY_KNOB: granularity})
    ranges = {
        name: (-data.draw(_range_ends, label=f"lo {name}"), data.draw(_range_ends, label=f"hi {name}"))
        for name in required_ranges(loaded.layers, recipe, loaded.proto)
    }
    before = loaded.proto.SerializeToString()

    for layer in loaded.layers:
        event(f"{precisions[layer.name]} {layer.op_type}")
    if any(layer.op_type in WEIGHTLESS_OP_TYPES and precisions[layer.name] == "int8" for layer in loaded.layers):
        event("an INT8 weightless layer (Add, Mul, Concat, pooling, Sigmoid, LeakyRelu)")
    typed = rewrite(loaded.proto, loaded.layers, plan, ranges, recipe)

    assert loaded.proto.SerializeToString() == before, "the rewriter changed its input"
    onnx.checker.check_model(typed, full_check=True)
    assert [o.name for o in typed.graph.output] == [o.name for o in loaded.proto.graph.output]
    if recipe is TENSORRT:
        assert qdq_problems(typed) == [], "TensorRT's Q/DQ rules reject the lowering"
    backend = OnnxRuntimeCPU(intra_op_threads=1)
    level = data.draw(st.sampled_from(["all", "extended", "basic"]), label="graph_optimization_level")
    session = backend.build_graph(typed, {"graph_optimization_level": level})
    feeds = {"x": np.random.default_rng(0).standard_normal(loaded.inputs[0].shape).astype(np.float32)}
    try:
        got = backend.run_engine(session, feeds)
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types
        # ORT fuses DQ -> GlobalAveragePool -> Q (a float pool between two pairs) and refuses grids that would
        # make the output constant. Drawn ranges can be that far apart; calibrated ones cannot (an average lies
        # within what it averages), and an INT8 pooling layer clamps its own output grid (test_placement.py).
        assume("QLinearGlobalAveragePool parameter out of computation range" not in str(error))
        raise
    want = backend.run_engine(backend.build_graph(loaded.proto, {}), feeds)
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
    if draw(st.integers(0, 2)) == 0:
        return OnnxRuntimeCPU().capabilities()
    others = [p for p in PRECISIONS if p != "fp32"]
    precisions = {}
    for op in TUNABLE_OP_TYPES:
        if draw(st.sampled_from([True, True, True, False])):  # now and then an op type the backend lacks
            chosen = draw(st.lists(st.sampled_from(others), min_size=1, unique=True))
            precisions[op] = ("fp32", *[p for p in others if p in chosen])
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
    """A non-empty subset of ``values``; with ``allow_none``, usually None (no restriction)."""
    if allow_none and draw(st.integers(0, 2)):
        return None
    return [v for v in values if draw(st.booleans())] or [values[0]]


class _Rules:
    """What the backend and the config allow, written independently of ``build_space``."""

    def __init__(self, capabilities: Capabilities, config: SearchSpaceConfig, restrictions: dict):
        self.capabilities, self.config = capabilities, config
        # An opt-in knob (ORT's int8_scheme) is in the space only where the config names it.
        offered = {
            knob.name: set(knob.values) for knob in capabilities.knobs if not knob.opt_in or knob.name in restrictions
        }
        self.knobs = {name: values & set(restrictions.get(name, values)) for name, values in offered.items()}
        self.knobs[CALIBRATION_KNOB] = set(config.calibration_methods)
        self.knobs[GRANULARITY_KNOB] = set(config.weight_granularity)

    def allows(self, layer: Layer, precision: str) -> bool:
        config = self.config
        if precision not in self.capabilities.precisions_for(layer.op_type):
            return False
        return precision == "fp32" or (
            (config.precisions is None or precision in config.precisions)
            and (config.op_types is None or layer.op_type in config.op_types)
            and (not config.include_layers or re.search(config.include_layers, layer.name) is not None)
            and not (config.exclude_layers and re.search(config.exclude_layers, layer.name))
        )

    def check_plan(self, space, plan: Plan) -> None:
        assert space.violations(plan) == []
        for layer in space.layers:
            assert self.allows(layer, plan.precision_map[layer.name]), (layer.name, plan.precision_map[layer.name])
        assert {name: plan.knob_map[name] in values for name, values in self.knobs.items()} == dict.fromkeys(
            self.knobs, True
        )

    def check_step(self, space, step) -> None:
        """Every choice the mask allows at this step, not only the one an episode takes."""
        for option in step.options:
            if step.kind == "layers":
                for i in space.groups[step.index]:
                    assert self.allows(space.layers[i], option), (space.layers[i].name, option)
            else:
                assert option in self.knobs[space.knobs[step.index].name], (step, option)


def _random_config(draw, layers: list[Layer], capabilities: Capabilities) -> tuple[SearchSpaceConfig, dict]:
    restrictions = {}
    for knob in capabilities.knobs:
        if draw(st.booleans()):
            restrictions[knob.name] = _subset(draw, [*knob.values, "not-offered"], allow_none=False)
    names = [layer.name for layer in layers]
    config = SearchSpaceConfig(
        precisions=_subset(draw, list(PRECISIONS)),
        include_layers=draw(st.sampled_from([None, None, None, "matmul|gemm", re.escape(names[-1])])),
        exclude_layers=draw(st.sampled_from([None, None, None, "conv", re.escape(names[0])])),
        op_types=_subset(draw, ["Conv", "ConvTranspose", "Gemm", "MatMul"]),
        calibration_methods=_subset(draw, ["max", "percentile", "entropy"], allow_none=False),
        weight_granularity=_subset(draw, ["per_channel", "per_tensor"], allow_none=False),
        knobs=restrictions,
        group_size=draw(st.integers(1, 4)),
    )
    return config, restrictions


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_masks_never_allow_a_choice_the_backend_or_the_config_rejects(data):
    layers = _layers(data.draw)
    capabilities = data.draw(random_capabilities())
    config, restrictions = _random_config(data.draw, layers, capabilities)
    rules = _Rules(capabilities, config, restrictions)
    if not all(rules.knobs.values()):  # a knob restricted to values the backend does not offer
        with pytest.raises(ValueError, match="is offered"):
            build_space(layers, capabilities, config)
        event("knob restriction refused")
        return
    space = build_space(layers, capabilities, config)
    evaluate = synthetic_evaluator(space)

    def checked(plan: Plan):
        rules.check_plan(space, plan)
        return evaluate(plan)

    try:
        env = EngineBuildEnv(space, checked)
    except ValueError as error:  # every layer fixed and every knob single-valued: nothing to decide
        assert "nothing to decide" in str(error)
        assert not space.searchable and all(len(k.values) == 1 for k in space.knobs)
        event("nothing to decide")
        return
    event(f"{len(space.searchable)} searchable layers, group size {space.group_size}")
    if any(len({space.choices[i] for i in group}) > 1 for group in space.groups):
        event("a group whose layers allow different precisions")
    for _ in range(3):
        env.reset()
        done = False
        while not done:
            mask = env.action_masks()
            step = env.steps[len(env._chosen)]
            assert np.flatnonzero(mask).tolist() == list(range(len(step.options))), "the mask and the options differ"
            rules.check_step(space, step)
            _, _, done, _, info = env.step(data.draw(st.sampled_from(np.flatnonzero(mask).tolist())))
        assert not env.action_masks().any()
        assert info["status"] == "ok"
