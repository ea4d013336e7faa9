"""Tests for autotune.search.space on the tiny MLP with the ORT CPU capabilities."""

from __future__ import annotations

import pytest

from autotune.backends.base import Capabilities, Knob
from autotune.plan import Plan
from autotune.search.space import CALIBRATION_KNOB, GRANULARITY_KNOB
from autotune.testing import tiny_space

NAMES = ["fc1", "fc2", "fc3", "head"]
ORT_KNOBS = ["graph_optimization_level", "allow_spinning"]


def _space(capabilities: Capabilities | None = None, **config):
    return tiny_space(capabilities, **config)


def _wide_capabilities() -> Capabilities:
    return Capabilities(
        precisions={"MatMul": ("fp32", "fp16", "int8"), "Gemm": ("fp32", "int8", "fp8")},
        knobs=(Knob("level", ("a", "b")),),
    )


def test_default_space():
    space = _space()
    assert space.layer_names == NAMES
    assert space.choices == (("fp32", "int8"),) * 4
    assert space.searchable == [0, 1, 2, 3]
    assert [k.name for k in space.knobs] == [CALIBRATION_KNOB, GRANULARITY_KNOB, *ORT_KNOBS]
    assert space.knobs[0].values == ("layerwise", "max", "percentile", "entropy")
    assert space.knobs[1].values == ("per_channel", "per_tensor")
    assert space.knobs[2].values == ("all", "extended", "basic")
    assert space.knobs[3].values == (True, False)
    assert space.group_size == 1
    assert space.groups == [(0,), (1,), (2,), (3,)]


def test_op_types_restriction():
    space = _space(op_types=["Gemm"])
    assert space.choices == (("fp32",), ("fp32",), ("fp32",), ("fp32", "int8"))
    assert space.searchable == [3]
    assert _space(op_types=["MatMul"]).searchable == [0, 1, 2]
    assert _space(op_types=["Conv"]).searchable == []


def test_include_regex():
    assert _space(include_layers="fc[12]").searchable == [0, 1]
    assert _space(include_layers="^h").searchable == [3]
    assert _space(include_layers="3").searchable == [2]  # search, not fullmatch


def test_exclude_regex():
    assert _space(exclude_layers="^head$").searchable == [0, 1, 2]
    assert _space(exclude_layers="fc").searchable == [3]


def test_include_and_exclude_and_op_types_combine():
    assert _space(include_layers="fc", exclude_layers="fc2").searchable == [0, 2]
    assert _space(include_layers="fc1|head", op_types=["MatMul"]).searchable == [0]


def test_precisions_restriction():
    assert _space(precisions=["int8"]).choices == (("fp32", "int8"),) * 4
    assert _space(precisions=["fp16"]).choices == (("fp32",),) * 4  # ORT CPU has no fp16
    assert _space(precisions=["fp16"]).searchable == []
    wide = _space(_wide_capabilities(), precisions=["int8"])
    assert wide.choices == (("fp32", "int8"),) * 4
    wide = _space(_wide_capabilities(), precisions=["fp8", "fp16"])
    assert wide.choices == (("fp32", "fp16"),) * 3 + (("fp32", "fp8"),)


def test_unknown_op_type_precisions_fp32_only():
    caps = Capabilities(precisions={"Gemm": ("fp32", "int8")})
    space = _space(caps)
    assert space.choices == (("fp32",),) * 3 + (("fp32", "int8"),)
    assert [k.name for k in space.knobs] == [CALIBRATION_KNOB, GRANULARITY_KNOB]


def test_knob_restriction_keeps_backend_order():
    space = _space(knobs={"graph_optimization_level": ["basic", "all"], "allow_spinning": [False]})
    knobs = {k.name: k for k in space.knobs}
    assert knobs["graph_optimization_level"].values == ("all", "basic")
    assert knobs["graph_optimization_level"].default == "all"
    assert knobs["allow_spinning"].values == (False,)
    assert knobs["allow_spinning"].default is False
    assert knobs["graph_optimization_level"].description  # kept


def test_recipe_knobs_from_config():
    space = _space(calibration_methods=["entropy"], weight_granularity=["per_tensor", "per_channel"])
    assert space.knobs[0].values == ("entropy",)
    assert space.knobs[1].values == ("per_tensor", "per_channel")
    assert _space(knobs={"calibration": ["percentile"]}).knobs[0].values == ("percentile",)


def test_a_knob_that_needs_an_op_the_model_lacks_is_left_out_unless_the_config_names_it():
    from autotune.config.schema import SearchSpaceConfig
    from autotune.search.space import build_space

    capabilities = Capabilities(
        precisions={"MatMul": ("fp32", "int8")},
        knobs=(
            Knob("level", ("a", "b")),
            Knob("fuse_norm", (True, False), free=True, needs_ops=("LayerNormalization",)),
        ),
    )
    layers = _space().layers
    names = [CALIBRATION_KNOB, GRANULARITY_KNOB]

    def knobs(op_types, **config):
        space = build_space(layers, capabilities, SearchSpaceConfig(**config), op_types)
        return [knob.name for knob in space.knobs]

    assert knobs({"MatMul", "Relu"}) == [*names, "level"]  # no LayerNormalization: no build measures the knob
    assert knobs({"MatMul", "LayerNormalization"}) == [*names, "level", "fuse_norm"]
    assert knobs(None) == [*names, "level", "fuse_norm"]  # the model's ops not known: nothing left out
    assert knobs({"MatMul"}, knobs={"fuse_norm": [False]}) == [*names, "level", "fuse_norm"]


def test_unknown_knob_is_value_error():
    with pytest.raises(ValueError, match="unknown knobs \\['bogus'\\]") as info:
        _space(knobs={"bogus": [1]})
    assert "allow_spinning" in str(info.value)


def test_knob_values_not_offered():
    with pytest.raises(ValueError, match="search.knobs.graph_optimization_level") as info:
        _space(knobs={"graph_optimization_level": ["turbo"]})
    assert "'all'" in str(info.value)


def test_plan_defaults():
    space = _space(knobs={"graph_optimization_level": ["extended", "basic"]})
    plan = space.plan()
    assert plan.precision_map == {name: "fp32" for name in NAMES}
    assert plan.knob_map == {
        "allow_spinning": True,
        "calibration": "layerwise",
        "graph_optimization_level": "extended",
        "weight_granularity": "per_channel",
    }
    custom = space.plan({"fc2": "int8"}, {"allow_spinning": False, "not_a_knob": 1})
    assert custom.precision_map["fc2"] == "int8"
    assert custom.knob("allow_spinning") is False
    assert "not_a_knob" not in custom.knob_map
    assert list(custom.precision_map) == NAMES


def test_uniform():
    space = _space(exclude_layers="fc2")
    plan = space.uniform("int8")
    assert plan.precision_map == {"fc1": "int8", "fc2": "fp32", "fc3": "int8", "head": "int8"}
    assert space.violations(plan) == []
    assert space.uniform("fp32") == space.plan()
    assert space.uniform("fp16").layers_in("fp16") == []
    assert space.uniform("int8", {"allow_spinning": False}).knob("allow_spinning") is False


def test_violations():
    space = _space(exclude_layers="head", knobs={"graph_optimization_level": ["all", "basic"]})
    assert space.violations(space.plan()) == []
    bad = Plan.make(
        {"fc1": "int8", "head": "int8", "ghost": "fp32"},
        {"graph_optimization_level": "extended", "mystery": 1, "allow_spinning": True},
    )
    problems = space.violations(bad)
    assert len(problems) == 4
    assert problems[0] == "unknown layers ['ghost']"
    assert "head (Gemm): int8 not allowed; allowed ['fp32']" in problems
    assert any("knob graph_optimization_level='extended' not allowed" in p for p in problems)
    assert any("unknown knob 'mystery'" in p for p in problems)
    assert space.violations(Plan.make({"fc1": "fp16"})) == ["fc1 (MatMul): fp16 not allowed; allowed ['fp32', 'int8']"]


def test_groups_of_two():
    space = _space(group_size=2)
    assert space.groups == [(0, 1), (2, 3)]
    assert _space(group_size=3).groups == [(0, 1, 2), (3,)]
    assert _space(group_size=2, exclude_layers="fc2").groups == [(0, 2), (3,)]
    assert _space(group_size=8).groups == [(0, 1, 2, 3)]
    assert _space(group_size=2, precisions=["fp16"]).groups == []


def test_group_choices_intersection():
    space = _space(_wide_capabilities(), group_size=2)
    assert space.group_choices((0, 1)) == ("fp32", "fp16", "int8")
    assert space.group_choices((2, 3)) == ("fp32", "int8")
    assert space.group_choices((3, 2)) == ("fp32", "int8")
    assert space.group_choices((3,)) == ("fp32", "int8", "fp8")
