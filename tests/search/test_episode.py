"""Tests for autotune.search.episode: decisions, masks, observations, plans from actions and back."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.backends.base import Capabilities, Knob
from autotune.plan import Plan
from autotune.search.episode import (
    _CONTEXT_FEATURES,
    _ESTIMATE_FEATURES,
    _LAYER_FEATURES,
    OP_TYPES,
    Decision,
    action_count,
    action_mask,
    actions_from_plan,
    decisions,
    neighbours,
    observation_size,
    observe,
    plan_from_actions,
)
from autotune.testing import tiny_space

MACS = {"fc1": 16 * 64 * 32, "fc2": 16 * 64 * 64, "fc3": 16 * 64 * 64, "head": 16 * 10 * 64}


def _space(capabilities: Capabilities | None = None, **config):
    return tiny_space(capabilities, **config)


def _wide_capabilities() -> Capabilities:
    return Capabilities(
        precisions={"MatMul": ("fp32", "fp16", "int8"), "Gemm": ("fp32", "int8", "fp8")},
        knobs=(Knob("level", ("a", "b", "c", "d")), Knob("fixed", (7,)), Knob("flag", (True, False))),
    )


SPACES = {
    "default": lambda: _space(),
    "groups2": lambda: _space(group_size=2),
    "excluded": lambda: _space(exclude_layers="fc2", calibration_methods=["max"]),
    "wide_groups3": lambda: _space(_wide_capabilities(), group_size=3),
    "wide": lambda: _space(_wide_capabilities(), include_layers="fc1|fc3|head"),
    "no_layers": lambda: _space(precisions=["fp16"]),
}


# ---------------------------------------------------------------------------------------------
# decisions and masks
# ---------------------------------------------------------------------------------------------


def test_decisions_default_order():
    space = _space()
    steps = decisions(space)
    assert steps == [
        Decision("layers", 0, ("fp32", "int8")),
        Decision("layers", 1, ("fp32", "int8")),
        Decision("layers", 2, ("fp32", "int8")),
        Decision("layers", 3, ("fp32", "int8")),
        Decision("knob", 0, ("layerwise", "max", "percentile", "entropy")),
        Decision("knob", 1, ("per_channel", "per_tensor")),
        Decision("knob", 2, ("all", "extended", "basic")),
        Decision("knob", 3, (True, False)),
    ]
    assert action_count(steps) == 4


def test_single_valued_knobs_skipped():
    space = _space(calibration_methods=["entropy"], knobs={"allow_spinning": [False]})
    steps = decisions(space)
    knob_steps = [s for s in steps if s.kind == "knob"]
    assert [s.index for s in knob_steps] == [1, 2]  # index into space.knobs, skipping 0 and 3
    assert [space.knobs[s.index].name for s in knob_steps] == [
        "weight_granularity",
        "graph_optimization_level",
    ]
    assert [s.kind for s in steps] == ["layers"] * 4 + ["knob"] * 2


def test_decisions_with_groups():
    steps = decisions(_space(group_size=2))
    assert [(s.kind, s.index) for s in steps[:2]] == [("layers", 0), ("layers", 1)]
    assert len(steps) == 2 + 4
    wide = decisions(_space(_wide_capabilities(), group_size=3))
    assert wide[0] == Decision("layers", 0, ("fp32", "fp16", "int8"))
    assert wide[1] == Decision("layers", 1, ("fp32", "int8", "fp8"))
    assert [s.options for s in wide if s.kind == "knob"] == [
        ("layerwise", "max", "percentile", "entropy"),
        ("per_channel", "per_tensor"),
        ("a", "b", "c", "d"),
        (True, False),
    ]
    assert action_count(wide) == 4


def test_action_count_empty():
    assert action_count([]) == 1


def test_action_mask():
    steps = decisions(_space())
    n = action_count(steps)
    assert action_mask(steps, 0, n).tolist() == [True, True, False, False]
    assert action_mask(steps, 4, n).tolist() == [True, True, True, True]
    assert action_mask(steps, 5, n).tolist() == [True, True, False, False]
    assert action_mask(steps, len(steps), n).tolist() == [False, False, False, False]
    assert action_mask(steps, len(steps) + 3, n).dtype == bool


# ---------------------------------------------------------------------------------------------
# observations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPACES))
def test_observation_shape_and_range_along_episode(name):
    space = SPACES[name]()
    steps = decisions(space)
    size = observation_size(space, steps)
    knob_steps = sum(s.kind == "knob" for s in steps)
    assert size == 2 + _LAYER_FEATURES + knob_steps + _CONTEXT_FEATURES + len(steps) + _ESTIMATE_FEATURES
    rng = np.random.default_rng(0)
    for _ in range(5):
        chosen: list[int] = []
        for position in range(len(steps) + 1):
            obs = observe(space, steps, chosen)
            assert obs.shape == (size,)
            assert obs.dtype == np.float32
            assert np.all(obs >= 0.0) and np.all(obs <= 1.0)
            if position < len(steps):
                kind = steps[position].kind
                assert (obs[0], obs[1]) == ((1.0, 0.0) if kind == "layers" else (0.0, 1.0))
                chosen.append(int(rng.integers(len(steps[position].options))))
            else:
                assert obs[0] == obs[1] == 0.0


def test_observation_layer_features_first_step():
    space = _space()
    steps = decisions(space)
    obs = observe(space, steps, [])
    features = obs[2 : 2 + _LAYER_FEATURES]
    n = len(OP_TYPES)
    assert features[:n].tolist() == [0, 0, 0, 1]  # fc1 is a MatMul
    max_macs = math.log1p(MACS["fc2"])
    assert features[n] == pytest.approx(math.log1p(MACS["fc1"]) / max_macs)
    assert features[n + 1] == pytest.approx(math.log1p(32 * 64) / math.log1p(64 * 64))
    assert features[n + 2] == pytest.approx(1 / 9)  # depth 1 of 9
    assert features[n + 3] == 0.0  # no runtime share profiled
    assert features[n + 4] == 1.0
    head = observe(space, steps, [0, 0, 0])[2 : 2 + _LAYER_FEATURES]
    assert head[:n].tolist() == [0, 0, 1, 0]
    assert head[n + 2] == pytest.approx(1.0)


def test_observation_changes_with_choices():
    space = _space()
    steps = decisions(space)
    offset = 2 + _LAYER_FEATURES + 4  # 4 knob steps
    fp32, int8 = observe(space, steps, [0]), observe(space, steps, [1])
    assert not np.array_equal(fp32, int8)
    # context: progress, fraction of layers quantized, fraction of MACs quantized, last choice
    assert fp32[offset : offset + 4].tolist() == pytest.approx([1 / 8, 0.0, 0.0, 0.5])
    total = sum(MACS.values())
    assert int8[offset : offset + 4].tolist() == pytest.approx([1 / 8, 0.25, MACS["fc1"] / total, 1.0])
    # history of choices: (action + 1) / options
    assert fp32[offset + 4] == pytest.approx(0.5) and int8[offset + 4] == pytest.approx(1.0)
    assert np.all(fp32[offset + 5 :] == 0)
    later = observe(space, steps, [1, 0, 1, 1, 2])
    assert later[offset + 1] == pytest.approx(0.75)
    assert later[offset + 2] == pytest.approx((total - MACS["fc2"]) / total)
    assert later[offset + 3] == pytest.approx(0.75)  # third option of four
    assert later[2 + _LAYER_FEATURES + 1] == 1.0  # second knob step is current
    assert observe(space, steps, [0, 1, 1, 0, 1]).tolist() != later.tolist()


def test_observation_group_features():
    space = _space(group_size=3)
    steps = decisions(space)
    first = observe(space, steps, [])
    n = len(OP_TYPES)
    assert first[2 + n + 4] == 1.0  # full group
    second = observe(space, steps, [1])
    assert second[2 + n + 4] == pytest.approx(1 / 3)  # head alone
    assert second[2 + 2] == 1.0  # Gemm one-hot
    offset = 2 + _LAYER_FEATURES + 4
    assert second[offset + 1] == pytest.approx(0.75)  # three layers quantized by one action


# ---------------------------------------------------------------------------------------------
# plans from actions and back
# ---------------------------------------------------------------------------------------------


def test_plan_from_actions_default():
    space = _space()
    steps = decisions(space)
    plan = plan_from_actions(space, steps, [1, 0, 1, 0, 3, 1, 1, 1])
    assert plan.precision_map == {"fc1": "int8", "fc2": "fp32", "fc3": "int8", "head": "fp32"}
    assert plan.knob_map == {
        "calibration": "entropy",
        "weight_granularity": "per_tensor",
        "graph_optimization_level": "extended",
        "allow_spinning": False,
    }
    assert space.violations(plan) == []
    assert plan_from_actions(space, steps, [0] * 8) == space.plan()


def test_plan_from_actions_groups_and_fixed_knobs():
    space = _space(group_size=2, calibration_methods=["percentile"])
    steps = decisions(space)
    plan = plan_from_actions(space, steps, [0, 1, 0, 0, 0])
    assert plan.precision_map == {"fc1": "fp32", "fc2": "fp32", "fc3": "int8", "head": "int8"}
    assert plan.knob("calibration") == "percentile"
    assert actions_from_plan(space, steps, plan) == [0, 1, 0, 0, 0]


def test_plan_from_actions_errors():
    space = _space()
    steps = decisions(space)
    with pytest.raises(ValueError, match="8 steps, got 7"):
        plan_from_actions(space, steps, [0] * 7)
    with pytest.raises(ValueError, match="outside"):
        plan_from_actions(space, steps, [2, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="outside"):
        plan_from_actions(space, steps, [0, 0, 0, 0, 0, 0, 0, -1])


def test_actions_from_plan_unreachable():
    space = _space(exclude_layers="head")
    steps = decisions(space)
    with pytest.raises(ValueError, match="'fp16'"):
        actions_from_plan(space, steps, space.plan({"fc1": "fp16"}))
    with pytest.raises(ValueError, match="'turbo'"):
        actions_from_plan(space, steps, space.plan().with_knobs(graph_optimization_level="turbo"))


def test_actions_from_partial_plan_uses_defaults():
    space = _space()
    steps = decisions(space)
    assert actions_from_plan(space, steps, Plan.make({"fc2": "int8"})) == [0, 1, 0, 0, 0, 0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SPACES)), st.data())
def test_round_trip_property(name, data):
    space = SPACES[name]()
    steps = decisions(space)
    n = action_count(steps)
    actions = []
    for position in range(len(steps)):
        mask = action_mask(steps, position, n)
        allowed = np.flatnonzero(mask).tolist()
        assert allowed == list(range(len(steps[position].options)))
        actions.append(data.draw(st.sampled_from(allowed)))
    assert not action_mask(steps, len(steps), n).any()
    plan = plan_from_actions(space, steps, actions)
    assert space.violations(plan) == []
    assert actions_from_plan(space, steps, plan) == actions
    assert plan_from_actions(space, steps, actions_from_plan(space, steps, plan)) == plan
    # every group member takes the group's choice; layers outside the search stay FP32
    precisions = plan.precision_map
    for step, action in zip(steps, actions, strict=False):
        if step.kind == "layers":
            assert {precisions[space.layers[i].name] for i in space.groups[step.index]} == {step.options[action]}
    searched = {i for group in space.groups for i in group}
    for i, layer in enumerate(space.layers):
        if i not in searched:
            assert precisions[layer.name] == "fp32"


def test_neighbours_differ_in_exactly_one_decision_and_leave_out_the_excluded():
    space = tiny_space()
    steps = decisions(space)
    plan = space.uniform("int8")
    start = actions_from_plan(space, steps, plan)
    found = neighbours(space, plan, exclude=())
    assert len(found) == sum(len(step.options) - 1 for step in steps)
    for neighbour in found:
        changed = [a != b for a, b in zip(actions_from_plan(space, steps, neighbour), start, strict=True)]
        assert sum(changed) == 1
    left = neighbours(space, plan, exclude={found[0].hash, plan.hash})
    assert {p.hash for p in left} == {p.hash for p in found[1:]}
