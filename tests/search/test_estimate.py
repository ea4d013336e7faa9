import numpy as np
import pytest

from autotune.config.views import SearchSettings
from autotune.plan import INT8_SCHEME_KNOB, Plan
from autotune.run.trial import TrialResult
from autotune.search.episode import decisions, observe
from autotune.search.estimate import ACCURACY_KNOBS, MIN_TRIALS, RefittedEstimates, fit_additive, fit_surrogate
from autotune.testing import tiny_space

NAMES = ["a", "b", "c", "d"]
SAVING = {"a": 0.05, "b": 0.30, "c": 0.10, "d": 0.0}
DROP = {"a": 0.0001, "b": 0.004, "c": 0.0, "d": 0.002}


def _trial(quantized, names=NAMES, saving=SAVING, drop=DROP):
    plan = Plan.make({n: ("int8" if n in quantized else "fp32") for n in names})
    saved = sum(saving[n] for n in quantized)
    return TrialResult(plan=plan, speedup=1 / (1 - saved), accuracy_drop=sum(drop[n] for n in quantized))


def test_fit_recovers_additive_savings_and_drops():
    rng = np.random.default_rng(0)
    trials = [_trial({n for n in NAMES if rng.random() < 0.5}) for _ in range(40)]
    estimates = fit_additive(NAMES, trials, ridge=1e-6)
    assert estimates.trials == 40
    np.testing.assert_allclose(estimates.saving, [SAVING[n] for n in NAMES], atol=1e-4)
    np.testing.assert_allclose(estimates.drop, [DROP[n] for n in NAMES], atol=1e-6)


def test_too_few_or_failed_trials_give_no_estimate():
    trials = [_trial({"a"})] * (MIN_TRIALS - 1) + [TrialResult.failure(Plan.make(dict.fromkeys(NAMES, "int8")), "x")]
    assert fit_additive(NAMES, trials) is None


def test_observation_carries_the_estimates():
    space = tiny_space()
    steps = decisions(space)
    names = space.layer_names
    saving = {names[0]: 0.1, names[1]: 0.4, names[2]: 0.2, names[3]: 0.0}
    drop = {names[0]: 0.001, names[1]: 0.02, names[2]: 0.0, names[3]: 0.004}
    rng = np.random.default_rng(1)
    trials = [_trial({n for n in names if rng.random() < 0.5}, names, saving, drop) for _ in range(30)]
    estimates = fit_additive(names, trials, ridge=1e-6)
    plain = observe(space, steps, [1])
    informed = observe(space, steps, [1], estimates, accuracy_budget=0.01)
    assert plain.shape == informed.shape and np.all(plain[-4:] == 0)
    # second layer: the largest saving (1.0 relative) and a drop of 2 budgets (capped at 1)
    assert informed[-4] == pytest.approx(1.0, abs=1e-3)
    assert informed[-3] == pytest.approx(1.0)
    # so far: the first layer quantized, 0.001 drop = 0.1 budgets / 2, saving 0.1
    assert informed[-2] == pytest.approx(0.05, abs=1e-3)
    assert informed[-1] == pytest.approx(0.1, abs=1e-3)
    assert np.array_equal(plain[:-4], informed[:-4])


def _mixed_trial(precisions, knob, saving, drop):
    plan = Plan.make(precisions, {"calibration": knob})
    keys = [(n, p) for n, p in precisions.items() if p != "fp32"]
    saved = sum(saving[k] for k in keys) + (0.05 if knob == "entropy" else 0.0)
    # a calibration method scales every quantized layer's error: not an additive knob term
    lost = sum(drop[k] for k in keys) * (1.5 if knob == "entropy" else 1.0)
    return TrialResult(plan=plan, speedup=1 / (1 - saved), accuracy_drop=lost)


def test_surrogate_recovers_terms_per_layer_precision_and_knob_value():
    rng = np.random.default_rng(1)
    saving = {(n, p): rng.uniform(0.01, 0.2) for n in NAMES for p in ("fp16", "int8")}
    drop = {(n, p): rng.uniform(0, 0.003) * (p == "int8") for n in NAMES for p in ("fp16", "int8")}
    trials = [
        _mixed_trial(
            {n: rng.choice(["fp32", "fp16", "int8"]) for n in NAMES}, rng.choice(["max", "entropy"]), saving, drop
        )
        for _ in range(80)
    ]
    model = fit_surrogate(trials, {"calibration": "max"}, accuracy_knobs=("calibration",), ridge=1e-6)
    assert model.trials == 80 and ("knob", "calibration", "max") not in model.saving.columns  # default: no term
    assert set(model.drops) == {("max",), ("entropy",)}  # one set of drop terms per calibration method
    for trial in trials[:10]:
        speedup, lost = model.predict(trial.plan)
        assert speedup == pytest.approx(trial.speedup, rel=1e-4)
        assert lost == pytest.approx(trial.accuracy_drop, abs=1e-6)
    imagined = model.result(trials[0].plan)
    assert imagined.ok and imagined.split == "surrogate" and imagined.from_store
    unseen = Plan.make({n: "fp8" for n in NAMES}, {"calibration": "max"})
    assert model.predict(unseen) == (1.0, 0.0)  # terms it never saw count 0
    assert fit_surrogate(trials[: MIN_TRIALS - 1], {"calibration": "max"}) is None


def test_surrogate_falls_back_to_the_pooled_drop_for_a_rare_setting():
    rng = np.random.default_rng(2)
    saving = {(n, "int8"): 0.05 for n in NAMES}
    drop = {(n, "int8"): 0.001 for n in NAMES}
    trials = [_mixed_trial({n: rng.choice(["fp32", "int8"]) for n in NAMES}, "max", saving, drop) for _ in range(20)]
    trials += [_mixed_trial({n: "int8" for n in NAMES}, "entropy", saving, drop) for _ in range(2)]
    model = fit_surrogate(trials, {"calibration": "max"}, accuracy_knobs=("calibration",), ridge=1e-6)
    assert set(model.drops) == {("max",)}
    assert (
        model.predict(trials[-1].plan)[1]
        > model.predict(Plan.make({n: "int8" for n in NAMES}, {"calibration": "max"}))[1]
    )


def test_ppo_rehearses_on_the_surrogate_without_spending_builds(tmp_path):
    from autotune.search.agent import AgentPaths, TrialModels, train
    from autotune.search.driver import Driver, OneByOne
    from envs.engine_build import EngineBuildEnv

    def _driver(config, evaluate, builds):
        return Driver.for_budget(OneByOne(evaluate, builds), config.budget)

    from autotune.testing import synthetic_evaluator, tiny_config

    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    seen: list[TrialResult] = []

    def real(plan):
        seen.append(evaluate(plan))
        return seen[-1]

    defaults = {knob.name: knob.default for knob in space.knobs}
    config = tiny_config(tmp_path, budget={"builds": 24}, ppo={"episodes_per_update": 4, "imagined_episodes": 16})
    fits = []

    def surrogate():
        fits.append(fit_surrogate(seen, defaults))
        return fits[-1]

    paths = AgentPaths(tmp_path / "tb", tmp_path / "ckpt")
    model = train(
        SearchSettings.of(config),
        space,
        _driver(config, real, lambda: len(seen)),
        paths,
        TrialModels(surrogate=surrogate),
        make_env=EngineBuildEnv,
    )
    episode_length = len(decisions(space))
    assert len(seen) == 24  # real builds: exactly the budget
    assert any(fit is not None for fit in fits)
    rehearsed = model.num_timesteps - 24 * episode_length
    assert rehearsed >= 16 * episode_length  # at least one rehearsal ran, and it built nothing


def test_each_int8_scheme_gets_its_own_drop_terms_as_it_changes_the_numbers():
    """u8s7 halves the weight resolution: pooled with u8s8, its drops would be read as u8s8's and the other's."""
    rng = np.random.default_rng(3)
    drop = {"u8s8": 0.001, "u8s7": 0.004}
    trials = []
    for _ in range(60):
        scheme = str(rng.choice(list(drop)))
        quantized = [n for n in NAMES if rng.random() < 0.5]
        plan = Plan.make({n: "int8" if n in quantized else "fp32" for n in NAMES}, {INT8_SCHEME_KNOB: scheme})
        trials.append(
            TrialResult(plan=plan, speedup=1.0 + 0.1 * len(quantized), accuracy_drop=drop[scheme] * len(quantized))
        )
    model = fit_surrogate(trials, {INT8_SCHEME_KNOB: "u8s8"}, accuracy_knobs=ACCURACY_KNOBS, ridge=1e-6)
    assert {setting[ACCURACY_KNOBS.index(INT8_SCHEME_KNOB)] for setting in model.drops} == {"u8s8", "u8s7"}
    every = {n: "int8" for n in NAMES}
    for scheme, per_layer in drop.items():
        lost = model.predict(Plan.make(every, {INT8_SCHEME_KNOB: scheme}))[1]
        assert lost == pytest.approx(per_layer * len(NAMES), rel=1e-3)


def test_the_measured_hashes_are_read_once_per_trial_count_and_follow_new_trials():
    trials, reads = [_trial({"a"})], []
    fitted = RefittedEstimates(lambda: reads.append(1) or trials, NAMES, {}, count=lambda: len(trials))
    assert fitted.measured() == {trials[0].plan_hash}
    assert fitted.measured() == {trials[0].plan_hash} and len(reads) == 1  # every env step asks: no new read
    trials.append(_trial({"b"}))
    assert fitted.measured() == {t.plan_hash for t in trials} and len(reads) == 2
