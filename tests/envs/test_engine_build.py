import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs
from autotune.config.schema import RewardConfig
from autotune.search.episode import plan_from_actions
from autotune.testing import synthetic_evaluator, tiny_space
from envs.engine_build import EngineBuildEnv


@pytest.fixture()
def space():
    return tiny_space()


def test_registered_as_nondeterministic():
    spec = gym.spec(envs.ENGINE_BUILD_ID)
    assert spec.nondeterministic is True
    assert spec.entry_point == "envs.engine_build:EngineBuildEnv"


def test_gymnasium_env_checker_passes(space):
    env = gym.make(envs.ENGINE_BUILD_ID, space=space, evaluate=synthetic_evaluator(space))
    gym_check_env(env.unwrapped)


def test_sb3_env_checker_passes(space):
    sb3_check_env(EngineBuildEnv(space, synthetic_evaluator(space)), warn=True)


def test_episode_builds_once_at_the_end_with_the_chosen_plan(space):
    evaluate = synthetic_evaluator(space)
    env = EngineBuildEnv(space, evaluate, RewardConfig(accuracy_penalty=0.0), accuracy_budget=1.0)
    obs, info = env.reset(seed=0)
    assert info["action_mask"].dtype == np.int8
    actions, rewards = [], []
    terminated = False
    while not terminated:
        mask = env.action_masks()
        action = int(np.flatnonzero(mask)[-1])  # the last allowed option: int8 for layers
        actions.append(action)
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        assert not truncated
        assert env.observation_space.contains(obs)
    assert evaluate.calls == 1
    assert all(r == 0.0 for r in rewards[:-1])
    plan = plan_from_actions(space, env.steps, actions)
    assert info["plan_hash"] == plan.hash
    assert set(plan.precision_map.values()) == {"int8"}
    assert rewards[-1] == pytest.approx(np.log(info["speedup"]))
    with pytest.raises(RuntimeError):
        env.step(0)


def test_masks_follow_the_step_options(space):
    env = EngineBuildEnv(space, synthetic_evaluator(space))
    env.reset(seed=0)
    for step in env.steps:
        mask = env.action_masks()
        assert mask.sum() == len(step.options)
        env.step(0)
    assert env.action_masks().sum() == 0


def test_the_last_step_masks_the_endings_already_measured_unless_all_are(space):
    measured: set[str] = set()
    env = EngineBuildEnv(space, synthetic_evaluator(space), measured=lambda: measured)
    env.reset(seed=0)
    for _ in env.steps[:-1]:
        env.step(0)
    last = env.steps[-1]
    endings = [
        plan_from_actions(space, env.steps, [0] * (len(env.steps) - 1) + [i]).hash for i in range(len(last.options))
    ]
    assert env.action_masks().sum() == len(last.options)  # nothing measured: every ending allowed
    measured.update(endings[:-1])
    assert list(np.flatnonzero(env.action_masks())) == [len(last.options) - 1]  # only the one not built yet
    measured.add(endings[-1])
    assert env.action_masks().sum() == len(last.options)  # all built: the store answers whichever it takes
    _, _, terminated, _, info = env.step(len(last.options) - 1)
    assert terminated and info["plan_hash"] == endings[-1]


def test_an_earlier_step_masks_an_option_whose_every_completion_is_measured(space):
    import itertools

    measured: set[str] = set()
    env = EngineBuildEnv(space, synthetic_evaluator(space), measured=lambda: measured)
    env.reset(seed=0)
    steps = env.steps
    head = [0] * (len(steps) - 3)  # three knob steps are left: the fourth-last chooses among their completions
    for action in head:
        env.step(action)
    later = [range(len(step.options)) for step in steps[len(head) + 1 :]]

    def completions(option):
        return {plan_from_actions(space, steps, [*head, option, *tail]).hash for tail in itertools.product(*later)}

    every = completions(0)
    measured.update(list(every)[:-1])
    assert env.action_masks()[0]  # one completion below option 0 is not built yet
    measured.update(every)
    mask = env.action_masks()
    assert not mask[0] and mask[1 : len(steps[len(head)].options)].all()
    for option in range(1, len(steps[len(head)].options)):
        measured.update(completions(option))
    assert env.action_masks().sum() == len(steps[len(head)].options)  # all built: nothing is masked


def test_failed_build_gets_the_failure_reward_and_is_reported(space):
    evaluate = synthetic_evaluator(space, fail_knob=("graph_optimization_level", "basic"))
    env = EngineBuildEnv(space, evaluate, RewardConfig(failure=-3.0))
    env.reset(seed=0)
    basic = None
    for step in env.steps:
        if step.kind == "knob" and "basic" in step.options:
            basic = step.options.index("basic")
        info = env.step(basic if basic is not None and step.kind == "knob" and "basic" in step.options else 0)[4]
    assert info["status"] == "failed"
    assert "synthetic failure" in info["error"]
    # the final reward of that episode
    env.reset()
    rewards = []
    for step in env.steps:
        action = step.options.index("basic") if "basic" in step.options else 0
        rewards.append(env.step(action)[1])
    assert rewards[-1] == -3.0


def test_masked_ppo_trains_on_the_synthetic_evaluator(space):
    from sb3_contrib import MaskablePPO

    env = EngineBuildEnv(space, synthetic_evaluator(space), RewardConfig(accuracy_penalty=10.0), accuracy_budget=0.01)
    model = MaskablePPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=2, seed=0, device="cpu")
    model.learn(256)
    obs, _ = env.reset()
    action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
    assert env.action_masks()[int(action)]


def _estimates_of(space, evaluate):
    """Exact per-layer estimates of the synthetic evaluator (its latency is additive up to a 0.2 floor)."""
    from autotune.search.estimate import LayerEstimates

    saving, drop = [], []
    for name in space.layer_names:
        result = evaluate(space.plan({name: "int8"}))
        saving.append(1.0 - 1.0 / result.speedup)
        drop.append(result.accuracy_drop)
    return LayerEstimates(np.array(saving), np.array(drop), trials=len(saving))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shaping_credits_each_layer_and_keeps_the_episode_return(space, seed):
    evaluate = synthetic_evaluator(space, seed=seed)
    estimates = _estimates_of(space, evaluate)
    config = RewardConfig(accuracy_penalty=5.0)
    shaped = EngineBuildEnv(space, evaluate, config, accuracy_budget=0.004, estimates=lambda: estimates, shaping=True)
    plain = EngineBuildEnv(space, evaluate, config, accuracy_budget=0.004, estimates=lambda: estimates)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        actions = [int(rng.integers(len(step.options))) for step in shaped.steps]
        returns = []
        for env in (shaped, plain):
            env.reset(seed=seed)
            step_rewards = [env.step(action)[1] for action in actions]
            returns.append(step_rewards)
        # the same plan, the same return: shaping only moves reward to earlier steps
        assert sum(returns[0]) == pytest.approx(sum(returns[1]))
        assert all(r == 0.0 for r in returns[1][:-1])
        used = 0.0  # estimated drop of the layers quantized so far
        for step, action, step_reward in zip(shaped.steps[:-1], actions, returns[0], strict=False):
            if step.kind == "knob" or step.options[action] == "fp32":
                assert step_reward == 0.0  # the estimates predict no change
                continue
            used += sum(estimates.drop[i] for i in space.groups[step.index])
            if used <= 0.004:  # still within the budget: the layer's estimated saving, nothing else
                assert step_reward > 0.0


def test_shaping_rewards_a_cheap_layer_and_charges_the_one_that_breaks_the_budget(space):
    from autotune.search.episode import potential
    from autotune.search.estimate import LayerEstimates

    n = len(space.layer_names)
    saving = np.full(n, 0.1)
    drop = np.zeros(n)
    drop[1] = 0.02  # the second layer alone is five budgets over
    estimates = LayerEstimates(saving, drop, trials=10)
    env = EngineBuildEnv(
        space,
        synthetic_evaluator(space),
        RewardConfig(),
        accuracy_budget=0.004,
        estimates=lambda: estimates,
        shaping=True,
    )
    env.reset(seed=0)
    int8 = [step.options.index("int8") for step in env.steps[:2]]
    first = env.step(int8[0])[1]
    second = env.step(int8[1])[1]
    assert first == pytest.approx(-np.log(0.9))
    assert second == pytest.approx(-np.log(0.8) + np.log(0.9) - 5.0 * 4.0)
    assert potential(space, env.steps, [], estimates, RewardConfig(), 0.004) == 0.0
    assert potential(space, env.steps, int8, None, RewardConfig(), 0.004) == 0.0
