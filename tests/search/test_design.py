"""Tests for autotune.search.design: the orthogonal first plans of the agent."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autotune.backends.base import Capabilities
from autotune.model.layers import Layer
from autotune.search.design import design_order, hadamard, model_best_plan, probe_plans
from autotune.search.estimate import fit_additive
from autotune.search.space import SearchSpace
from autotune.testing import synthetic_evaluator, tiny_space


def _wide_space(layers: int, group_size: int = 1) -> SearchSpace:
    table = tuple(
        Layer(f"mm{i}", "MatMul", i, (f"x{i}",), f"w{i}", 1, None, f"y{i}", ((8, 8),), (8, 8), 512, 64, i)
        for i in range(layers)
    )
    choices = tuple(("fp32",) if i == 5 else ("fp32", "int8") for i in range(layers))
    return SearchSpace(table, choices, (), group_size)


def _quantized(plans, space):
    return np.array([[p.precision_map[name] != "fp32" for name in space.layer_names] for p in plans], dtype=float)


@pytest.mark.parametrize("order", [1, 2, 4, 8, 12, 20, 24, 40, 44, 64, 88])
def test_hadamard_is_orthogonal_and_normalised(order):
    matrix = hadamard(order)
    assert matrix is not None and matrix.shape == (order, order)
    assert np.array_equal(matrix @ matrix.T, order * np.eye(order, dtype=int))
    assert (matrix[0] == 1).all() and (matrix[:, 0] == 1).all()


@pytest.mark.parametrize("order", [3, 6, 28, 36, 52])
def test_orders_without_a_construction_give_none(order):
    assert hadamard(order) is None


def test_design_order_leaves_a_column_per_factor():
    assert design_order(3) == 4
    assert design_order(4) == 8  # the all-ones column is not a factor
    assert design_order(36) == 40  # 36 (no construction here) is skipped


def test_probes_quantize_every_layer_in_half_of_them_and_balance_every_pair():
    space = _wide_space(36)
    plans = probe_plans(space, max_plans=100)
    assert len(plans) == 40
    assert plans[0] == space.uniform("int8")
    signs = 2 * _quantized(plans, space) - 1
    searched = [i for i in range(36) if i != 5]
    assert (_quantized(plans, space)[:, 5] == 0).all()  # a layer that allows only FP32 stays FP32
    columns = signs[:, searched]
    assert np.array_equal(columns.sum(axis=0), np.zeros(len(searched)))
    assert np.array_equal(columns.T @ columns, 40 * np.eye(len(searched)))
    assert all(not space.violations(plan) for plan in plans)


def test_an_additive_fit_on_the_probes_recovers_every_layers_drop():
    space = _wide_space(36)
    evaluate = synthetic_evaluator(space, seed=3)
    results = [evaluate(plan) for plan in probe_plans(space, max_plans=100)]
    truth = np.array([evaluate(space.plan({name: "int8"})).accuracy_drop for name in space.layer_names])
    fitted = fit_additive(space.layer_names, results, ridge=1e-9)
    assert fitted is not None
    searched = [i for i in range(36) if i != 5]
    np.testing.assert_allclose(fitted.drop[searched], truth[searched], rtol=1e-6, atol=1e-9)


def test_probes_respect_the_cap_and_move_groups_together():
    space = _wide_space(12, group_size=3)
    plans = probe_plans(space, max_plans=3)
    assert len(plans) == 3
    quantized = _quantized(plans, space)
    for group in space.groups:
        assert (quantized[:, list(group)] == quantized[:, [group[0]]]).all()
    assert probe_plans(space, max_plans=0) == []


def test_probes_take_the_backends_lower_precision_where_int8_is_not_offered():
    space = tiny_space(Capabilities(precisions={"MatMul": ("fp32", "fp16"), "Gemm": ("fp32", "fp16")}))
    plans = probe_plans(space, max_plans=10)
    assert plans[0] == space.uniform("fp16")
    assert {p for plan in plans for _, p in plan.precisions} == {"fp32", "fp16"}


class _AdditiveModel:
    """A model of the trials with known per-layer savings and drops (what ``model_best_plan`` reads)."""

    def __init__(self, saving: dict[str, float], drop: dict[str, float]):
        self.saving, self.drop = saving, drop

    def predict(self, plan):
        chosen = [name for name, precision in plan.precisions if precision != "fp32"]
        return 1.0 / (1.0 - sum(self.saving[n] for n in chosen)), sum(self.drop[n] for n in chosen)


def test_the_model_plan_is_the_best_plan_within_the_budget():
    space = _wide_space(8)
    rng = np.random.default_rng(4)
    names = space.layer_names
    model = _AdditiveModel(
        {n: float(s) for n, s in zip(names, rng.uniform(0.01, 0.1, 8), strict=True)},
        {n: float(d) for n, d in zip(names, rng.uniform(0.1, 1.0, 8), strict=True)},
    )
    searchable = [names[i] for i in space.searchable]
    best = max(
        (
            model.predict(space.plan({n: "int8" for n, bit in zip(searchable, bits, strict=True) if bit}))
            for bits in itertools.product([0, 1], repeat=len(searchable))
        ),
        key=lambda predicted: predicted[0] if predicted[1] <= 1.5 else 0.0,
    )
    plan = model_best_plan(model, space, budget=1.5)
    assert model.predict(plan) == pytest.approx(best)
    assert plan.precision_map["mm5"] == "fp32"  # a layer the space keeps in FP32 stays there
    assert model_best_plan(model, space, budget=0.05) == space.uniform("fp32")  # nothing fits


def test_the_model_plan_skips_plans_already_measured():
    space = _wide_space(8)
    rng = np.random.default_rng(4)
    names = space.layer_names
    model = _AdditiveModel(
        {n: float(s) for n, s in zip(names, rng.uniform(0.01, 0.1, 8), strict=True)},
        {n: float(d) for n, d in zip(names, rng.uniform(0.1, 1.0, 8), strict=True)},
    )
    best = model_best_plan(model, space, budget=1.5)
    second = model_best_plan(model, space, budget=1.5, exclude={best.hash})
    assert second != best
    assert model.predict(second)[1] <= 1.5
    # nothing better than the excluded best, and nothing unmeasured rated above the one it returns
    assert model.predict(second)[0] <= model.predict(best)[0]
    searchable = [names[i] for i in space.searchable]
    others = [
        space.plan({n: "int8" for n, bit in zip(searchable, bits, strict=True) if bit})
        for bits in itertools.product([0, 1], repeat=len(searchable))
    ]
    runner_up = max(
        (model.predict(p)[0] for p in others if p.hash != best.hash and model.predict(p)[1] <= 1.5),
    )
    assert model.predict(second)[0] == pytest.approx(runner_up)


class _BaseAndOverrides:
    """An additive model of a GPU-like space: a whole-model base, per-layer overrides, an attention knob.

    Savings (fractions of FP32 time) per whole-module base and per layer override over that base, like the
    BERT-large-shaped encoder on an H200: BF16 is the fastest base, INT8 overrides are slower than BF16 there,
    FP8 overrides faster but each costs accuracy, and SDPA saves more than any precision.
    """

    base_saving = {"fp32": 0.0, "fp16": 0.80, "bf16": 0.82}
    override_saving = {"int8": -0.01, "fp8": 0.01, "fp16": 0.0, "bf16": 0.0, "fp32": -0.1}
    fp8_drop = {f"mm{i}": 0.1 * (i + 1) for i in range(8)}

    def predict(self, plan):
        base = plan.knob("base_precision")
        saving = self.base_saving[base] + (0.05 if plan.knob("attention") == "sdpa" else 0.0)
        drop = 0.0
        for name, precision in plan.precisions:
            if precision != base:
                saving += self.override_saving[precision]
            if precision == "fp8":
                drop += self.fp8_drop[name]
            elif precision == "int8":
                drop += 0.01
        return 1.0 / (1.0 - saving), drop


def _gpu_space() -> SearchSpace:
    from autotune.capabilities import Knob

    table = _wide_space(8).layers
    floats = ("fp32", "fp16", "bf16")
    knobs = (
        Knob("base_precision", floats, "dtype of the whole module", follows_precision=True),
        Knob("attention", ("eager", "sdpa"), "attention implementation"),
    )
    return SearchSpace(table, tuple((*floats, "int8", "fp8") for _ in table), knobs)


def test_the_model_plan_chooses_the_base_the_override_precision_and_the_knobs_where_a_knob_follows_precision():
    space, model = _gpu_space(), _BaseAndOverrides()
    plan = model_best_plan(model, space, budget=1.05)
    assert plan.knob_map == {"base_precision": "bf16", "attention": "sdpa"}
    # FP8 on the least sensitive layers while their drops fit (0.1 + 0.2 + 0.3 + 0.4 = 1.0), BF16 elsewhere
    assert plan.precision_map == {f"mm{i}": "fp8" if i < 4 else "bf16" for i in range(8)}
    assert model.predict(plan)[1] <= 1.05
    # nothing fits but the floats: the fastest whole-model float plan, its knobs included
    assert model_best_plan(model, space, budget=0.05) == space.uniform("bf16", {"attention": "sdpa"})


class _Schemes:
    """An additive model of ONNX Runtime on an AVX2 CPU: per layer, INT8 in the plan's scheme or dynamic INT8.

    ``u8s7`` (7-bit weights on the fast kernels) saves more than ``u8u8`` and costs more per layer; the dynamic
    form saves the most and costs the most on the sensitive layers.
    """

    saving = {("int8", "u8u8"): 0.02, ("int8", "u8s7"): 0.05, ("int8-dynamic", None): 0.07}

    def __init__(self, s7_drop: float, dynamic_drop: dict[str, float]):
        self.s7_drop, self.dynamic_drop = s7_drop, dynamic_drop

    def predict(self, plan):
        scheme = plan.knob("int8_scheme")
        saving = drop = 0.0
        for name, precision in plan.precisions:
            if precision == "int8":
                saving += self.saving[("int8", scheme)]
                drop += 0.01 if scheme == "u8u8" else self.s7_drop
            elif precision == "int8-dynamic":
                saving += self.saving[("int8-dynamic", None)]
                drop += self.dynamic_drop[name]
        return 1.0 / (1.0 - saving), drop


def _scheme_space(layers: int = 8, dynamic: bool = False) -> SearchSpace:
    from autotune.capabilities import Knob

    table = _wide_space(layers).layers
    choices = ("fp32", "int8", "int8-dynamic") if dynamic else ("fp32", "int8")
    knobs = (Knob("int8_scheme", ("u8u8", "u8s7"), "INT8 scheme", seeded=True),)
    return SearchSpace(table, tuple(choices for _ in table), knobs)


def test_the_model_plan_keeps_the_faster_scheme_within_the_budget():
    space = _scheme_space()
    # 7-bit weights cost little more here: all eight layers fit in either scheme, and u8s7 saves more.
    plan = model_best_plan(_Schemes(s7_drop=0.012, dynamic_drop={}), space, budget=0.1)
    assert plan.knob("int8_scheme") == "u8s7" and set(plan.precision_map.values()) == {"int8"}
    # 7-bit weights cost too much: two u8s7 layers (0.10) save less than all eight u8u8 ones (0.16).
    plan = model_best_plan(_Schemes(s7_drop=0.05, dynamic_drop={}), space, budget=0.1)
    assert plan.knob("int8_scheme") == "u8u8" and set(plan.precision_map.values()) == {"int8"}


def test_the_model_plan_mixes_dynamic_and_static_layers_per_layer():
    space = _scheme_space(dynamic=True)
    sensitive = {"mm0", "mm1"}
    model = _Schemes(s7_drop=0.012, dynamic_drop={f"mm{i}": 1.0 if f"mm{i}" in sensitive else 0.001 for i in range(8)})
    plan = model_best_plan(model, space, budget=0.05)
    assert {name for name, p in plan.precisions if p == "int8-dynamic"} == {f"mm{i}" for i in range(2, 8)}
    assert {name for name, p in plan.precisions if p == "int8"} == sensitive  # the static form where dynamic errs
    assert plan.knob("int8_scheme") == "u8s7"
