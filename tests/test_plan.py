"""Tests for autotune.plan: hashing, JSON round trips, validation, describe and diff."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.plan import PRECISIONS, Plan

LAYERS = ["fc1", "fc2", "fc3", "head"]


def _plan(**overrides: str) -> Plan:
    precisions = {name: "fp32" for name in LAYERS}
    precisions.update(overrides)
    return Plan.make(precisions, {"graph_optimization_level": "all", "allow_spinning": True})


def test_make_sorts_knobs_and_keeps_layer_order():
    plan = Plan.make({"b": "int8", "a": "fp32"}, {"z": 1, "a": "x"})
    assert plan.precisions == (("b", "int8"), ("a", "fp32"))
    assert plan.knobs == (("a", "x"), ("z", 1))


def test_hash_is_stable_and_known():
    plan = Plan.make({"fc1": "int8", "fc2": "fp32"}, {"k": 1})
    # the store is keyed by this value: it must not change between versions or processes
    assert plan.hash == Plan.make({"fc1": "int8", "fc2": "fp32"}, {"k": 1}).hash
    assert len(plan.hash) == 16
    assert all(c in "0123456789abcdef" for c in plan.hash)
    canonical = json.dumps({"p": [["fc1", "int8"], ["fc2", "fp32"]], "k": [["k", 1]]})
    assert plan.hash == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_equal_plans_equal_hashes():
    a, b = _plan(fc2="int8"), _plan(fc2="int8")
    assert a == b
    assert a.hash == b.hash
    assert hash(a) == hash(b)


def test_knob_order_irrelevant():
    a = Plan.make({"x": "int8"}, {"a": 1, "b": "two", "c": True})
    b = Plan.make({"x": "int8"}, {"c": True, "a": 1, "b": "two"})
    assert a == b
    assert a.hash == b.hash
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize("layer", LAYERS)
def test_hash_differs_on_any_precision_change(layer):
    base = _plan()
    changed = _plan(**{layer: "int8"})
    assert base.hash != changed.hash
    assert _plan(**{layer: "fp16"}).hash not in (base.hash, changed.hash)


@pytest.mark.parametrize(
    "knobs",
    [
        {"graph_optimization_level": "basic", "allow_spinning": True},
        {"graph_optimization_level": "all", "allow_spinning": False},
        {"graph_optimization_level": "all"},
        {"graph_optimization_level": "all", "allow_spinning": True, "extra": 1},
    ],
)
def test_hash_differs_on_any_knob_change(knobs):
    base = _plan()
    assert base.hash != Plan.make(base.precision_map, knobs).hash


def test_hash_distinguishes_knob_value_types():
    # True, 1 and 1.0 compare equal in Python but are different knob values for a backend
    hashes = {Plan.make({"a": "fp32"}, {"k": v}).hash for v in (True, 1, 1.0, "1")}
    assert len(hashes) == 4


def test_hash_depends_on_layer_order():
    assert Plan.make({"a": "fp32", "b": "int8"}).hash != Plan.make({"b": "int8", "a": "fp32"}).hash


def test_make_rejects_unknown_precision():
    with pytest.raises(ValueError, match="'fc1'.*'int4'"):
        Plan.make({"fc1": "int4"})


def test_uniform_and_accessors():
    plan = Plan.uniform(LAYERS, "int8", {"k": 2})
    assert plan.precision_map == {name: "int8" for name in LAYERS}
    assert plan.knob("k") == 2
    assert plan.knob("missing") is None
    assert plan.knob("missing", "dflt") == "dflt"
    assert plan.layers_in("int8") == LAYERS
    assert plan.layers_in("fp32") == []
    assert _plan(fc3="int8", fc1="int8").layers_in("int8") == ["fc1", "fc3"]


def test_with_knobs():
    plan = _plan()
    changed = plan.with_knobs(allow_spinning=False, new=3)
    assert changed.knob_map == {"graph_optimization_level": "all", "allow_spinning": False, "new": 3}
    assert changed.precisions == plan.precisions
    assert plan.knob("allow_spinning") is True  # frozen original untouched


def test_json_round_trip_typed_knobs():
    plan = Plan.make({"fc1": "int8", "fc2": "fp8", "head": "fp32"}, {"b": True, "i": 3, "f": 0.25, "s": "all"})
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.hash == plan.hash
    knobs = again.knob_map
    assert knobs["b"] is True
    assert type(knobs["i"]) is int and knobs["i"] == 3
    assert type(knobs["f"]) is float and knobs["f"] == 0.25
    assert knobs["s"] == "all"
    assert list(again.precision_map) == ["fc1", "fc2", "head"]


def test_json_is_canonical():
    plan = Plan.make({"b": "int8", "a": "fp32"}, {"y": 1, "x": 2})
    assert plan.to_json() == Plan.make({"b": "int8", "a": "fp32"}, {"x": 2, "y": 1}).to_json()
    assert json.loads(plan.to_json()) == {"precisions": {"b": "int8", "a": "fp32"}, "knobs": {"x": 2, "y": 1}}
    indented = plan.to_json(indent=2)
    assert "\n" in indented
    assert Plan.from_json(indented) == plan


def test_dict_round_trip():
    plan = Plan.make({"fc1": "int8"}, {"allow_spinning": False})
    data = plan.to_dict()
    assert data == {"precisions": {"fc1": "int8"}, "knobs": {"allow_spinning": False}}
    assert Plan.from_dict(data) == plan


def test_from_dict_knobs_optional():
    assert Plan.from_dict({"precisions": {"a": "fp16"}}) == Plan.make({"a": "fp16"})
    assert Plan.from_dict({"precisions": {"a": "fp16"}, "knobs": None}).knobs == ()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"precisions": {"a": "fp32"}, "extra": 1}, r"unknown plan keys \['extra'\]"),
        ({"knobs": {}}, "precisions"),
        ([["a", "fp32"]], "precisions"),
        ("text", "precisions"),
        ({"precisions": {"a": "int3"}}, "unknown precision 'int3'"),
    ],
)
def test_from_dict_rejects_bad_input(data, match):
    with pytest.raises(ValueError, match=match):
        Plan.from_dict(data)


def test_from_json_rejects_non_object():
    with pytest.raises(ValueError):
        Plan.from_json("[1, 2]")


def test_describe():
    plan = Plan.make({"a": "int8", "b": "int8", "c": "fp32", "d": "int8", "e": "fp16"}, {"lvl": "all", "spin": True})
    assert plan.describe() == "int8 x3; fp32: c; fp16: e; lvl=all, spin=True"
    assert Plan.uniform(["a", "b"], "fp32").describe() == "fp32 x2"
    assert Plan.make({}).describe() == "fp32 x0"


def test_diff():
    a = Plan.make({"fc1": "fp32", "fc2": "int8", "fc3": "fp32"}, {"lvl": "all", "spin": True})
    b = Plan.make({"fc1": "int8", "fc2": "int8", "head": "fp32"}, {"lvl": "basic", "spin": True, "new": 1})
    assert a.diff(b) == [
        "fc1: fp32 -> int8",
        "fc3: fp32 -> None",
        "head: None -> fp32",
        "lvl: all -> basic",
        "new: None -> 1",
    ]
    assert a.diff(a) == []
    assert b.diff(a)[0] == "fc1: int8 -> fp32"


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

_names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_knob_values = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
_precision_maps = st.dictionaries(_names, st.sampled_from(PRECISIONS), max_size=8)
_knob_maps = st.dictionaries(_names, _knob_values, max_size=5)


@settings(max_examples=200, deadline=None)
@given(_precision_maps, _knob_maps)
def test_round_trip_property(precisions, knobs):
    plan = Plan.make(precisions, knobs)
    for again in (
        Plan.from_json(plan.to_json()),
        Plan.from_dict(plan.to_dict()),
        Plan.from_json(plan.to_json(2)),
    ):
        assert again == plan
        assert again.hash == plan.hash
        assert again.to_json() == plan.to_json()
        for (name, value), (name2, value2) in zip(again.knobs, plan.knobs, strict=True):
            assert name == name2 and type(value) is type(value2)


@settings(max_examples=200, deadline=None)
@given(_precision_maps, _knob_maps, st.randoms(use_true_random=False))
def test_hash_independent_of_knob_insertion_order(precisions, knobs, rnd):
    items = list(knobs.items())
    rnd.shuffle(items)
    a = Plan.make(precisions, knobs)
    b = Plan.make(dict(precisions), dict(items))
    assert a == b
    assert a.hash == b.hash


@settings(max_examples=200, deadline=None)
@given(_precision_maps.filter(bool), st.data())
def test_hash_changes_with_one_precision(precisions, data):
    layer = data.draw(st.sampled_from(sorted(precisions)))
    new = data.draw(st.sampled_from([p for p in PRECISIONS if p != precisions[layer]]))
    plan = Plan.make(precisions)
    assert Plan.make({**precisions, layer: new}).hash != plan.hash


def test_a_reference_plan_is_told_apart_from_every_searched_plan():
    from autotune.plan import REFERENCE_KNOB
    from autotune.testing import tiny_space

    space = tiny_space()
    static = Plan.reference_plan(space.layer_names, "ort-static")
    assert static.reference == "ort-static" and space.uniform("fp32").reference is None
    assert static.precision_map == space.uniform("fp32").precision_map
    assert static.hash not in {space.uniform("fp32").hash, Plan.reference_plan(space.layer_names, "ort-dynamic").hash}
    assert static.describe() == "reference ort-static (the backend's one-liner)"
    assert Plan.from_json(static.to_json()) == static
    # No search space offers the knob, so no strategy proposes such a plan, and the space rejects one.
    assert REFERENCE_KNOB not in {knob.name for knob in space.knobs}
    assert any("unknown knob 'reference'" in problem for problem in space.violations(static))
