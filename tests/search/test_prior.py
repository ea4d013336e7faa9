import numpy as np
import pytest

from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.search.design import model_best_plan, probe_plans
from autotune.search.estimate import ACCURACY_KNOBS, fit_additive, fit_surrogate, ridge_least_squares
from autotune.search.prior import DEFAULT_DROP_PER_ERROR, DEFAULT_INT8_SAVING, PriorInputs, layer_prior, unsure_groups
from autotune.testing import tiny_space

NAMES = ("a", "b", "c", "d")
SHARES = (0.1, 0.4, 0.2, 0.3)
ERRORS = {"a": 1e-4, "b": 4e-3, "c": 1e-6, "d": 2e-3}
DEFAULTS = {"calibration": "layerwise", "weight_granularity": "per_channel"}


def _inputs(metric="cosine"):
    errors = {name: {"max": 2 * e, "percentile": e} for name, e in ERRORS.items()}
    chosen = dict.fromkeys(NAMES, "percentile")
    return PriorInputs(NAMES, SHARES, errors, chosen, metric)


def _trial(quantized, drop_per_error=0.3, saving_per_share=0.6, calibration="layerwise"):
    plan = Plan.make({n: ("int8" if n in quantized else "fp32") for n in NAMES}, {"calibration": calibration})
    saved = saving_per_share * sum(SHARES[NAMES.index(n)] for n in quantized)
    factor = 2 if calibration == "max" else 1
    drop = drop_per_error * factor * sum(ERRORS[n] for n in quantized)
    return TrialResult(plan=plan, speedup=1 / (1 - saved), accuracy_drop=drop)


def test_ridge_toward_a_prior_returns_the_prior_without_rows_and_the_data_fit_with_many():
    prior = np.array([0.1, -0.2, 0.3])
    assert np.allclose(ridge_least_squares(np.zeros((0, 3)), np.zeros(0), 2.0, prior), prior)
    rng = np.random.default_rng(0)
    design = rng.integers(0, 2, size=(4000, 3)).astype(float)
    truth = np.array([0.5, 0.05, -0.4])
    targets = design @ truth + rng.normal(0, 0.01, 4000)
    fitted = ridge_least_squares(design, targets, 2.0, prior)
    least_squares = np.linalg.lstsq(design, targets, rcond=None)[0]
    assert np.allclose(fitted, least_squares, atol=2e-3)
    assert not np.allclose(ridge_least_squares(design[:3], targets[:3], 2.0, prior), least_squares, atol=2e-3)


def test_fit_additive_with_a_prior_and_no_trial_is_the_prior():
    saving, drop = np.array([0.01, 0.2, 0.05, 0.1]), np.array([1e-5, 1e-3, 0.0, 5e-4])
    estimates = fit_additive(list(NAMES), [], prior=(saving, drop))
    assert estimates is not None and estimates.trials == 0
    assert np.allclose(estimates.saving, saving) and np.allclose(estimates.drop, drop)
    assert fit_additive(list(NAMES), []) is None  # without a prior, too few trials give nothing


def test_the_prior_maps_errors_and_shares_with_scales_every_trial_corrects():
    before = layer_prior(_inputs(), [], DEFAULTS)
    assert before.drop_per_error == DEFAULT_DROP_PER_ERROR["cosine"]
    assert np.allclose(before.saving, DEFAULT_INT8_SAVING * np.array(SHARES))
    assert np.allclose(before.drop("layerwise", "per_channel"), 0.5 * np.array([ERRORS[n] for n in NAMES]))
    assert np.allclose(before.drop("max", "per_channel"), 0.5 * 2 * np.array([ERRORS[n] for n in NAMES]))
    assert before.drop("layerwise", "per_tensor") is None  # the errors were measured per channel

    after = layer_prior(_inputs(), [_trial(NAMES), _trial({"b", "c"}), _trial({"a"}, calibration="max")], DEFAULTS)
    assert after.drop_per_error == pytest.approx(0.3)
    assert after.saving_per_share == pytest.approx(0.6)
    assert np.allclose(after.drop("layerwise", "per_channel"), 0.3 * np.array([ERRORS[n] for n in NAMES]))

    # a metric without a default scale has no drop prior until a trial gives one
    assert layer_prior(_inputs("top1"), [], DEFAULTS).drop("layerwise", "per_channel") is None
    assert layer_prior(_inputs("top1"), [_trial(NAMES)], DEFAULTS).drop_per_error == pytest.approx(0.3)


def test_the_surrogate_starts_from_the_prior_and_its_best_plan_spares_the_sensitive_layers():
    space = tiny_space()
    names = space.layer_names
    errors = dict(zip(names, (1e-4, 4e-3, 1e-6, 2e-3), strict=True))
    inputs = PriorInputs(
        tuple(names), SHARES, {n: {"max": e} for n, e in errors.items()}, dict.fromkeys(names, "max"), "cosine"
    )
    defaults = {knob.name: knob.default for knob in space.knobs}
    prior = layer_prior(inputs, [], defaults)
    model = fit_surrogate([], defaults, prior=prior, layer_names=names)
    assert model is not None
    plan = space.plan({names[0]: "int8", names[1]: "int8"})
    speedup, drop = model.predict(plan)
    assert speedup == pytest.approx(1 / (1 - prior.saving[0] - prior.saving[1]))
    assert drop == pytest.approx(0.5 * (errors[names[0]] + errors[names[1]]))
    best = model_best_plan(model, space, budget=0.5 * 1.2e-3)  # room for every layer but the two sensitive ones
    assert {n for n, p in best.precisions if p != "fp32"} == {names[0], names[2]}


def test_only_the_groups_the_prior_leaves_open_are_probed():
    space = tiny_space()
    drop = np.array([1e-6, 3e-3, 6e-4, 1e-1])  # negligible, unsure, unsure, breaks the budget alone
    open_groups = unsure_groups(space.groups, drop, budget=2e-3)
    assert open_groups == [1, 2]
    assert unsure_groups(space.groups, None, budget=2e-3) == [0, 1, 2, 3]
    plans = probe_plans(space, 8, varied=open_groups, lowered_always=[0])
    names = space.layer_names
    assert all(plan.precision_map[names[0]] != "fp32" for plan in plans)
    assert all(plan.precision_map[names[3]] == "fp32" for plan in plans)
    assert {(plan.precision_map[names[1]], plan.precision_map[names[2]]) for plan in plans} == {
        ("int8", "int8"),
        ("int8", "fp32"),
        ("fp32", "int8"),
        ("fp32", "fp32"),
    }


def test_the_int8_scales_ignore_fp16_plans_and_plans_slowed_by_a_knob():
    int8 = [_trial(NAMES, saving_per_share=0.2), _trial({"b", "d"}, saving_per_share=0.2)]
    # an FP16 plan that saves far more (as on a GPU), with a drop the INT8 errors do not explain
    fp16 = TrialResult(plan=Plan.make(dict.fromkeys(NAMES, "fp16")), speedup=4.0, accuracy_drop=1e-2)
    # an INT8 plan with a knob that costs time
    slowed = _trial(NAMES, saving_per_share=0.2)
    slowed = TrialResult(
        plan=slowed.plan.with_knobs(allow_spinning=False), speedup=0.7, accuracy_drop=slowed.accuracy_drop
    )
    prior = layer_prior(_inputs(), [*int8, fp16, slowed], {**DEFAULTS, "allow_spinning": True})
    assert prior.saving_per_share == pytest.approx(0.2)
    assert prior.drop_per_error == pytest.approx(0.3)
    # with no plan at the defaults, the slowed one still gives a scale, and INT8 that costs time is negative
    assert layer_prior(_inputs(), [slowed], {**DEFAULTS, "allow_spinning": True}).saving_per_share < 0


def test_the_share_map_keeps_only_the_layers_the_profile_timed():
    inputs = PriorInputs(("a", "b", "c"), (0.5, None, 0.2), {}, {}, "cosine")
    assert inputs.share_map() == {"a": 0.5, "c": 0.2}


def test_each_int8_form_starts_from_its_own_per_layer_errors():
    from autotune.capabilities import Knob
    from autotune.search.space import SearchSpace

    base = tiny_space()
    names = base.layer_names
    knobs = (*base.knobs, Knob("int8_scheme", ("u8u8", "u8s7"), seeded=True))
    space = SearchSpace(base.layers, tuple(("fp32", "int8", "int8-dynamic") for _ in names), knobs)
    errors = dict(zip(names, (1e-4, 4e-3, 1e-6, 2e-3), strict=True))
    s7 = dict(zip(names, (3e-4, 9e-3, 1e-5, 2e-3), strict=True))  # fc2's wide weights suffer most from 7 bits
    dynamic = dict(zip(names, (5e-5, 1e-2, 2e-6, 1e-3), strict=True))
    inputs = PriorInputs(
        tuple(names),
        SHARES,
        {n: {"layerwise": e} for n, e in errors.items()},
        dict.fromkeys(names, "layerwise"),
        "cosine",
        forms={"u8s7": s7, "int8-dynamic": dynamic},
    )
    assert PriorInputs.from_dict(inputs.to_dict()) == inputs
    defaults = {knob.name: knob.default for knob in space.knobs}
    defaults["calibration"] = "layerwise"
    prior = layer_prior(inputs, [], defaults)
    model = fit_surrogate([], defaults, ACCURACY_KNOBS, prior=prior, layer_names=names)
    layerwise = {"calibration": "layerwise"}
    for name in names:
        u8u8 = space.plan({name: "int8"}, layerwise)
        u8s7 = space.plan({name: "int8"}, {**layerwise, "int8_scheme": "u8s7"})
        dyn = space.plan({name: "int8-dynamic"}, layerwise)
        assert model.predict(u8u8)[1] == pytest.approx(0.5 * errors[name])
        assert model.predict(u8s7)[1] == pytest.approx(0.5 * s7[name])
        assert model.predict(dyn)[1] == pytest.approx(0.5 * dynamic[name])
    # a dynamic plan's drop point uses the dynamic errors: the fitted scale stays what these trials say
    trial = TrialResult(
        plan=space.plan(dict.fromkeys(names, "int8-dynamic"), layerwise), speedup=1.5, accuracy_drop=0.0264
    )
    assert layer_prior(inputs, [trial], defaults).drop_per_error == pytest.approx(0.0264 / sum(dynamic.values()))


def test_a_layer_the_forms_allowance_did_not_reach_takes_the_forms_ratio_to_its_layerwise_error():
    names = ("a", "b", "c")
    inputs = PriorInputs(
        names,
        (0.3, 0.3, 0.4),
        {n: {"layerwise": e} for n, e in zip(names, (1e-4, 2e-4, 4e-4), strict=True)},
        dict.fromkeys(names, "layerwise"),
        "cosine",
        forms={"u8s7": {"a": 3e-4, "b": 6e-4}},  # 3x the layerwise errors where measured
    )
    assert inputs.form_errors("u8s7") == pytest.approx([3e-4, 6e-4, 12e-4])
    assert inputs.form_errors("int8-dynamic") is None


def test_int8_dynamic_takes_static_int8s_saving_until_its_own_plans_measure_theirs():
    from autotune.plan import DYNAMIC

    static = [_trial({"a", "b"}), _trial({"c", "d"})]  # static INT8 saves 0.6 of a layer's share
    assert layer_prior(_inputs(), static, DEFAULTS).dynamic_saving is None
    # a mixed plan: b static, c and d dynamic, saving 0.9 of their share
    plan = Plan.make({"a": "fp32", "b": "int8", "c": DYNAMIC, "d": DYNAMIC}, {"calibration": "layerwise"})
    saved = 0.6 * SHARES[1] + 0.9 * (SHARES[2] + SHARES[3])
    mixed = TrialResult(plan=plan, speedup=1 / (1 - saved), accuracy_drop=0.001)
    prior = layer_prior(_inputs(), [*static, mixed], DEFAULTS)
    assert prior.saving_of("int8") == pytest.approx(0.6 * np.array(SHARES))
    assert prior.saving_of(DYNAMIC) == pytest.approx(0.9 * np.array(SHARES))
