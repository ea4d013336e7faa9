"""Tests for autotune.search.agent beyond the end-to-end runs: the probe plans, interrupts at awkward moments."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.config.views import SearchSettings
from autotune.search.agent import LATEST, AgentPaths, TrialModels, imitate, train
from autotune.search.design import model_best_plan, probe_plans
from autotune.search.driver import Driver, OneByOne
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space
from envs.engine_build import EngineBuildEnv


def _recording_evaluator(space):
    """The synthetic evaluator, keeping every plan it was asked to build, in order."""
    evaluate = synthetic_evaluator(space)
    built = []

    def real(plan):
        built.append(plan)
        return evaluate(plan)

    return real, built


def _paths(tmp_path, resume=False):
    return AgentPaths(tmp_path / "tb", tmp_path / "ckpt", resume)


def _driver(config, evaluate, builds):
    """The driver of ``config``'s budget over a plain ``evaluate`` and its build count."""
    return Driver.for_budget(OneByOne(evaluate, builds), config.budget)


@pytest.mark.parametrize("probes", [True, False])
def test_the_agent_builds_the_probes_first_and_stays_within_the_budget(tmp_path, probes):
    space = tiny_space()
    real, built = _recording_evaluator(space)
    config = tiny_config(
        tmp_path,
        budget={"builds": 18},
        ppo={"episodes_per_update": 2, "imagined_episodes": 0},
        planner={"probe_plans": probes},
    )
    train(
        SearchSettings.of(config),
        space,
        _driver(config, real, lambda: len(built)),
        _paths(tmp_path),
        make_env=EngineBuildEnv,
    )
    expected = probe_plans(space, max_plans=18 // 3)
    assert len(expected) == 6  # 4 layers: an 8-run design, capped at a third of the budget
    assert (built[: len(expected)] == expected) is probes
    assert len(built) == 18


class _InterruptedRehearsal:
    """A model of the trials whose first imagined build is interrupted, as a Ctrl-C would."""

    def predict(self, plan):
        return 1.0, 0.0

    def result(self, plan):
        raise KeyboardInterrupt


def test_ctrl_c_during_the_first_rehearsal_still_saves_the_agent(tmp_path):
    # With probe plans the agent rehearses before its first real update, when no callback has seen the model yet.
    space = tiny_space()
    real, built = _recording_evaluator(space)
    config = tiny_config(tmp_path, budget={"builds": 24}, ppo={"episodes_per_update": 2, "imagined_episodes": 4})
    with pytest.raises(KeyboardInterrupt):
        train(
            SearchSettings.of(config),
            space,
            _driver(config, real, lambda: len(built)),
            _paths(tmp_path),
            TrialModels(surrogate=lambda: _InterruptedRehearsal()),
            make_env=EngineBuildEnv,
        )
    assert len(built) == 8  # the probes (an 8-run design for 4 layers), then the interrupted rehearsal
    assert (tmp_path / "ckpt" / LATEST).exists()


def test_ctrl_c_during_the_probes_still_saves_the_agent(tmp_path):
    space = tiny_space()
    real, built = _recording_evaluator(space)

    def interrupted_at_the_third_probe(plan):
        if len(built) == 2:
            raise KeyboardInterrupt
        return real(plan)

    config = tiny_config(tmp_path, budget={"builds": 24}, ppo={"episodes_per_update": 2})
    with pytest.raises(KeyboardInterrupt):
        train(
            SearchSettings.of(config),
            space,
            _driver(config, interrupted_at_the_third_probe, lambda: len(built)),
            _paths(tmp_path),
            make_env=EngineBuildEnv,
        )
    assert len(built) == 2 and (tmp_path / "ckpt" / LATEST).exists()


class _FixedModel:
    """A model of the trials that rates every layer alike: each INT8 layer saves 10 % and costs 0.006."""

    def predict(self, plan):
        quantized = sum(precision != "fp32" for _, precision in plan.precisions)
        return 1.0 / (1.0 - 0.1 * quantized), 0.006 * quantized

    def result(self, plan):
        from autotune.run.trial import TrialResult

        speedup, drop = self.predict(plan)
        return TrialResult(plan=plan, speedup=speedup, accuracy_drop=drop, split="surrogate", from_store=True)


def _planning_run(tmp_path, builds: int, headroom: float = 0.0, **planner):
    """An agent trained on ``_FixedModel`` with the planning step, no probes: config, model, space, built plans."""
    space = tiny_space()
    real, built = _recording_evaluator(space)
    config = tiny_config(
        tmp_path,
        budget={"builds": builds},
        search={"budget_headroom": headroom},
        ppo={"episodes_per_update": 2, "imagined_episodes": 2},
        planner={"probe_plans": False, "build_model_plan": True, **planner},
    )
    model = _FixedModel()
    train(
        SearchSettings.of(config),
        space,
        _driver(config, real, lambda: len(built)),
        _paths(tmp_path),
        TrialModels(surrogate=lambda: model),
        make_env=EngineBuildEnv,
    )
    return config, model, space, built


def test_the_agent_builds_its_models_best_plan_after_each_rehearsal(tmp_path):
    config, model, space, built = _planning_run(tmp_path, builds=6)
    planned = model_best_plan(model, space, config.search_budget, seed=config.seed)
    assert built[0] == planned  # built before the first sampled episode
    assert model.predict(planned)[1] <= config.search_budget
    assert sum(p != "fp32" for _, p in planned.precisions) == int(config.search_budget / 0.006)


def test_each_planning_step_builds_as_many_distinct_model_plans_as_configured(tmp_path):
    config, model, space, built = _planning_run(tmp_path, builds=8, model_plans=3)
    first_step = built[:3]
    assert first_step[0] == model_best_plan(model, space, config.search_budget, seed=config.seed)
    assert len({plan.hash for plan in first_step}) == 3  # the model's best three, none built twice
    assert all(model.predict(plan)[1] <= config.search_budget for plan in first_step)
    # the two sampled episodes follow, then the next planning step's three
    assert len(built) == 8


def test_with_headroom_each_planning_step_also_builds_the_models_best_plan_past_the_search_budget(tmp_path):
    # budget 0.02, headroom 0.5: the search aims at 0.01 (one layer of 0.006), the bold plan at 0.016 (two)
    config, model, space, built = _planning_run(tmp_path, builds=6, headroom=0.5)
    assert config.search_budget < config.bold_budget < config.accuracy_budget
    assert built[0] == model_best_plan(model, space, config.search_budget, seed=config.seed)
    bold = built[1]
    assert config.search_budget < model.predict(bold)[1] <= config.bold_budget
    assert sum(p != "fp32" for _, p in bold.precisions) == int(config.bold_budget / 0.006)


def test_imitation_makes_the_policys_likeliest_plan_the_given_one():
    from sb3_contrib import MaskablePPO

    from envs.engine_build import EngineBuildEnv

    space = tiny_space()
    env = EngineBuildEnv(space, _FixedModel().result, accuracy_budget=0.02)
    model = MaskablePPO("MlpPolicy", env, n_steps=16, batch_size=16, seed=0, device="cpu")
    names = space.layer_names
    plan = space.plan({names[0]: "int8", names[2]: "int8"})

    assert imitate(model, env, plan, target=0.95) >= 0.95  # a fresh policy gives each of 2 options about 1/2
    observation, _ = env.reset()
    done = False
    while not done:
        action, _ = model.predict(observation, action_masks=env.action_masks(), deterministic=True)
        observation, _, done, _, _ = env.step(int(action))
    assert env.last_result.plan == plan


@pytest.mark.parametrize("target", [0.9, 0.0])
def test_a_fresh_agent_imitates_the_models_best_plan_once_before_its_first_rehearsal(tmp_path, monkeypatch, target):
    from autotune.search import agent

    calls = []

    def recording(model, env, plan, target, max_steps=500):
        calls.append((plan, target))
        return imitate(model, env, plan, target, max_steps)

    monkeypatch.setattr(agent, "imitate", recording)
    config, model, space, built = _planning_run(tmp_path, builds=8, imitation=target)
    if target:
        assert calls == [(model_best_plan(model, space, config.search_budget, seed=config.seed), target)]
    else:
        assert calls == []
    calls.clear()
    real, built = _recording_evaluator(space)  # resumed: the policy is a trained one, imitation would undo it
    resumed = config.model_copy(update={"budget": config.budget.model_copy(update={"builds": 4})})
    train(
        SearchSettings.of(resumed),
        space,
        _driver(resumed, real, lambda: len(built)),
        _paths(tmp_path, resume=True),
        TrialModels(surrogate=lambda: model),
        make_env=EngineBuildEnv,
    )
    assert calls == [] and len(built) == 4


def test_with_priors_the_models_plan_comes_first_and_the_probes_vary_only_open_layers(tmp_path):
    from autotune.search.estimate import RefittedEstimates
    from autotune.search.prior import PriorInputs, unsure_groups

    space = tiny_space()
    names = space.layer_names
    evaluate = synthetic_evaluator(space)
    built, results = [], []

    def real(plan):
        built.append(plan)
        results.append(evaluate(plan))
        return results[-1]

    config = tiny_config(
        tmp_path, accuracy_budget=0.003, budget={"builds": 24}, ppo={"episodes_per_update": 2, "imagined_episodes": 2}
    )
    # prior drops (half the errors): fc2 breaks the budget alone, head is negligible, fc1 and fc3 are open
    errors = dict(zip(names, (4e-3, 4e-2, 3e-3, 1e-7), strict=True))
    inputs = PriorInputs(
        tuple(names),
        (0.3, 0.3, 0.2, 0.2),
        {n: {"max": e} for n, e in errors.items()},
        dict.fromkeys(names, "max"),
        "cosine",
    )
    defaults = {knob.name: knob.default for knob in space.knobs}
    fitted = RefittedEstimates(lambda: results, names, defaults, prior_inputs=inputs)
    train(
        SearchSettings.of(config),
        space,
        _driver(config, real, lambda: len(built)),
        _paths(tmp_path),
        TrialModels(fitted.surrogate, fitted.estimates, fitted.measured, fitted.prior),
        make_env=EngineBuildEnv,
    )
    first = {n for n, p in built[0].precisions if p != "fp32"}
    assert first == {names[0], names[3]}  # fc1 and fc3 together (0.0035) exceed the budget (0.003); fc1 saves more
    drop = 0.5 * np.array([errors[n] for n in names])
    assert unsure_groups(space.groups, drop, config.search_budget) == [0, 2]
    # the model's plans come first, until one meets the budget (at most three); then the probes
    opening = next((i + 1 for i, r in enumerate(results[:3]) if r.accuracy_drop <= config.search_budget), 3)
    probes = built[opening : opening + 4]
    assert {(p.precision_map[names[0]], p.precision_map[names[2]]) for p in probes} == {
        ("int8", "int8"),
        ("int8", "fp32"),
        ("fp32", "int8"),
        ("fp32", "fp32"),
    }
    assert all(p.precision_map[names[1]] == "fp32" and p.precision_map[names[3]] == "int8" for p in probes)
    assert len(built) == 24


def test_ctrl_c_during_a_checkpoint_save_waits_for_the_save_then_interrupts(tmp_path):
    import os
    import signal

    from autotune.search import agent

    class Model:
        def save(self, path):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the write
            with open(path, "wb") as file:
                file.write(b"checkpoint")

    # Python's own handler, as in an interactive run (a shell that starts a job in the background hands it SIGINT
    # ignored, which is no Ctrl-C to test).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            agent.save_checkpoint(Model(), tmp_path)
        assert (tmp_path / agent.LATEST).read_bytes() == b"checkpoint"  # the save finished first
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # and Ctrl-C is back to normal
    finally:
        signal.signal(signal.SIGINT, before)


class _TimedHarness:
    """A harness whose every build takes ``seconds`` of the fake clock ``now``."""

    def __init__(self, now, seconds, workers=1):
        self.now, self.seconds, self.workers, self.builds = now, seconds, workers, 0

    def evaluate_many(self, plans, limit=None):
        from autotune.run.trial import TrialResult

        for plan in plans:
            self.now[0] += self.seconds
            self.builds += 1
            yield TrialResult.failure(plan, "timed only")


def test_the_pace_gives_rehearsals_only_the_episodes_the_builds_time_pays_for():
    from autotune.search.agent import ComputePace

    now = [0.0]
    driver = Driver(_TimedHarness(now, 2.0), budget=100, stall=100, clock=lambda: now[0])  # every build takes 2 s
    pace = ComputePace(1.0, lambda: driver.build_s, clock=lambda: now[0])
    space = tiny_space()
    names = space.layer_names

    def evaluate(index):
        return driver.build([space.plan({names[index % 4]: "int8", names[(index // 4) % 4]: "int8"})])

    assert pace.rehearsal_episodes(128, 8) == 8  # the first rehearsal: one rollout, to time an episode
    evaluate(0)
    now[0] += 0.8  # a rehearsal of 8 episodes took 0.8 s: 0.1 s an episode
    pace.rehearsed(8, 0.8)
    assert pace.build_s == pytest.approx(2.0) and pace.agent_s == pytest.approx(0.8)
    assert pace.rehearsal_episodes(128, 8) == 8  # 1.2 s left: 12 episodes fit, in whole rollouts of 8
    assert pace.within_share()  # a real rollout may run too
    now[0] += 1.2
    assert pace.rehearsal_episodes(128, 8) == 0  # the agent has caught up with its builds
    now[0] += 0.1
    assert not pace.within_share()  # ahead of its builds: the planner builds instead of a rollout
    for index in range(20):
        evaluate(index)
    assert pace.rehearsal_episodes(128, 8) == 128  # builds of 40 s pay for the whole rehearsal
    assert ComputePace(0.0, lambda: 0.0, clock=lambda: now[0]).rehearsal_episodes(128, 8) == 128  # no limit


def test_the_pace_counts_the_time_of_builds_side_by_side():
    from autotune.search.agent import ComputePace

    now = [0.0]
    driver = Driver(_TimedHarness(now, 1.5, workers=2), budget=100, stall=100, clock=lambda: now[0])
    driver.build_s = 5.0  # the seeds' builds, before the agent started, are not the agent's to spend
    pace = ComputePace(1.0, lambda: driver.build_s, clock=lambda: now[0])
    space = tiny_space()
    names = space.layer_names
    assert len(driver.build([space.plan({names[0]: "int8"}), space.plan({names[1]: "int8"})])) == 2
    assert pace.build_s == pytest.approx(3.0) and pace.agent_s == pytest.approx(0.0)


def _train_on_a_store(tmp_path, budget: dict, ppo: dict) -> tuple[dict, int]:
    """The agent trained with the planner on ``_FixedModel`` over a store that answers repeated plans without a build.

    Returns:
        The plans measured (hash to result), and how many plans the agent asked for, repeats included.
    """
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    measured: dict[str, object] = {}
    calls = {"n": 0}

    def stored(plan):
        calls["n"] += 1
        if plan.hash not in measured:
            measured[plan.hash] = evaluate(plan)
        return measured[plan.hash]

    config = tiny_config(tmp_path, budget=budget, ppo=ppo, planner={"probe_plans": False, "build_model_plan": True})
    model = _FixedModel()
    train(
        SearchSettings.of(config),
        space,
        _driver(config, stored, lambda: len(measured)),
        _paths(tmp_path),
        TrialModels(surrogate=lambda: model, measured=lambda: set(measured)),
        make_env=EngineBuildEnv,
    )
    return measured, calls["n"]


def test_a_stalled_policy_hands_the_budget_left_to_the_models_plans_not_built_yet(tmp_path):
    # The store answers a repeated plan without a build: a converged policy stalls, and the run must still spend
    # its budget on plans the model of the trials rates best, ending early only when those run out too.
    measured, _ = _train_on_a_store(
        tmp_path, {"builds": 12, "stall_episodes": 1}, {"episodes_per_update": 2, "imagined_episodes": 2}
    )
    assert len(measured) == 12


def test_a_converged_policy_pauses_its_rollouts_so_store_hits_stay_few_per_build(tmp_path):
    # The demo's run answered 2,298 plans from the store in 40 builds: a policy that proposes what is built already
    # must hand its turns to the planner's plans not built yet, not roll out store hits until the stall rule ends it.
    measured, asked = _train_on_a_store(
        tmp_path, {"builds": 14, "stall_episodes": 400}, {"episodes_per_update": 4, "imagined_episodes": 4}
    )
    hits = asked - len(measured)
    assert len(measured) == 14 and hits <= 14, hits  # a rollout of store hits pauses the next ones (23 without)
