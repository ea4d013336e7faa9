"""The agent: sb3-contrib MaskablePPO on the EngineBuild env, with a budget counted in builds."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from autotune.config import TuneConfig
from autotune.files import atomic_write
from autotune.interrupt import interrupts_held
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, Plan
from autotune.search.design import model_best_plan, probe_plans
from autotune.search.episode import neighbours
from autotune.search.estimate import Surrogate
from autotune.search.prior import LayerPrior, unsure_groups
from autotune.search.space import SearchSpace
from autotune.trial import TrialResult

LATEST = "latest.zip"

OPENING_MODEL_PLANS = 3
"""With priors, the model's best plan is built first, again after each miss of the search budget, up to this many."""


class ComputePace:
    """Keeps the agent's own compute to ``share`` times the wall time of its builds so far.

    A run of the 3 ms demo CNN spent 97 % of its wall time in the agent (rehearsals of 128 imagined episodes after
    every update, most of whose real plans the store answered), 32.6 s a build for trials of 0.7 s. Timed here,
    each rehearsal gets the imagined episodes that the builds' time pays for, in whole rollouts: none while the
    agent is ahead of its builds, all of ``ppo.imagined_episodes`` when a build takes longer than a rehearsal.

    Args:
        share: The agent's compute allowed per second of building; 0: no limit.
        clock: Seconds; injectable for tests.
    """

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter):
        self.share = share
        self.clock = clock
        self.started = clock()
        self.build_s = 0.0
        self.episode_s: float | None = None

    def evaluate(self, evaluate: Callable[[Plan], TrialResult]) -> Callable[[Plan], TrialResult]:
        """``evaluate``, its wall time counted as building."""

        def timed(plan: Plan) -> TrialResult:
            start = self.clock()
            try:
                return evaluate(plan)
            finally:
                self.build_s += self.clock() - start

        return timed

    def evaluate_many(
        self, evaluate_many: Callable[[list[Plan], int], Iterable[TrialResult]]
    ) -> Callable[[list[Plan], int], Iterable[TrialResult]]:
        """``evaluate_many``, the wall time of its results counted as building."""

        def timed(plans: list[Plan], limit: int) -> Iterable[TrialResult]:
            start = self.clock()
            try:
                yield from evaluate_many(plans, limit)
            finally:
                self.build_s += self.clock() - start

        return timed

    @property
    def agent_s(self) -> float:
        """Wall seconds since the start that were not spent building."""
        return self.clock() - self.started - self.build_s

    def rehearsal_episodes(self, most: int, rollout_episodes: int) -> int:
        """The imagined episodes the next rehearsal may run: a multiple of ``rollout_episodes``, at most ``most``.

        The first rehearsal runs one rollout, to time an episode.
        """
        if self.share <= 0 or most <= 0:
            return most
        if self.episode_s is None:
            return min(most, rollout_episodes)
        allowed = self.share * self.build_s - self.agent_s
        fits = int(allowed / self.episode_s) if allowed > 0 and self.episode_s > 0 else 0
        return min(most, fits // rollout_episodes * rollout_episodes)

    def rehearsed(self, episodes: int, seconds: float) -> None:
        """Records a rehearsal's episodes and wall time, which price the next one."""
        if episodes > 0:
            self.episode_s = seconds / episodes


def save_checkpoint(model: Any, checkpoints: Path, builds: int | None = None) -> None:
    """Saves ``latest.zip`` atomically, and a numbered copy when given ``builds``; an interrupt waits for the save.

    A crash mid-save leaves the previous ``latest.zip`` in place.
    """
    checkpoints.mkdir(parents=True, exist_ok=True)
    with interrupts_held():
        if builds is not None:
            model.save(checkpoints / f"ppo_{builds}_builds.zip")
        atomic_write(checkpoints / LATEST, model.save)


def _make_callback(config: TuneConfig, builds: Callable[[], int], checkpoints: Path, monitor_builds_start: int) -> Any:
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import HParam

    class BudgetCallback(BaseCallback):
        """Stops at the build budget, checkpoints every N builds, records the hyperparameters once."""

        def __init__(self) -> None:
            super().__init__()
            self.last_checkpoint = monitor_builds_start
            self.stalled = 0
            self.last_builds = builds()
            self.hparams_logged = False

        def _on_training_start(self) -> None:
            if self.hparams_logged:  # training resumes after every rehearsal on the model of the trials
                return
            self.hparams_logged = True
            hparams = {k: v for k, v in config.ppo.model_dump().items() if not isinstance(v, list)}
            hparams.update(seed=config.seed, budget=config.budget.builds, accuracy_budget=config.accuracy_budget)
            self.logger.record(
                "hparams",
                HParam(hparams, {"train/value_loss": 0.0, "train/entropy_loss": 0.0}),
                exclude=("stdout", "log", "json", "csv"),
            )

        def _save(self, numbered: bool = True) -> None:
            save_checkpoint(self.model, checkpoints, builds() if numbered else None)

        def _on_step(self) -> bool:
            if not any(self.locals.get("dones", [])):
                return True
            done = builds()
            self.stalled = self.stalled + 1 if done == self.last_builds else 0
            self.last_builds = done
            if done - self.last_checkpoint >= config.ppo.checkpoint_every_builds:
                self.last_checkpoint = done
                self._save()
            return done < config.budget.builds and self.stalled < config.budget.stall_episodes

        def _on_training_end(self) -> None:
            self._save(numbered=builds() >= config.budget.builds)

    return BudgetCallback()


def _side_by_side(factories: list[Callable[[], Any]], prefetch: Callable[[list[Plan]], None]) -> Any:
    """A ``DummyVecEnv`` whose envs' final steps are built side by side.

    Every env has the same episode length, so all of them reach their last decision at the same step: before
    stepping, the plans those actions complete go to ``prefetch`` as one batch (for the workers to build at
    once), and each env's own evaluation then finds its result waiting.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    class SideBySide(DummyVecEnv):
        def step_wait(self) -> Any:
            plans = [env.unwrapped.plan_after(int(a)) for env, a in zip(self.envs, self.actions, strict=True)]
            if any(plan is not None for plan in plans):
                prefetch([plan for plan in plans if plan is not None])
            return super().step_wait()

    return SideBySide(factories)


def _real_envs(
    make_env: Callable[[Callable[[Plan], TrialResult]], Callable[[], Any]],
    evaluate: Callable[[Plan], TrialResult],
    evaluate_many: Callable[[list[Plan], int], Iterable[TrialResult]] | None,
    envs: int,
    builds: Callable[[], int],
    budget: int,
) -> Any:
    """The vectorised env of the real rollouts: one env, or ``envs`` whose final steps are built side by side."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    if envs == 1 or evaluate_many is None:
        return DummyVecEnv([make_env(evaluate)])
    prefetched: dict[str, TrialResult] = {}

    def prefetch(plans: list[Plan]) -> None:
        for result in evaluate_many(plans, max(0, budget - builds())):
            prefetched[result.plan_hash] = result
        for plan in plans:  # past the budget: never built or stored, and the callback ends training at this step
            prefetched.setdefault(plan.hash, TrialResult.failure(plan, "not built: the build budget is spent"))

    def score(plan: Plan) -> TrialResult:
        return prefetched.pop(plan.hash) if plan.hash in prefetched else evaluate(plan)

    return _side_by_side([make_env(score) for _ in range(envs)], prefetch)


def _model_plans(
    surrogate: Surrogate, space: SearchSpace, budget: float, count: int, seed: int, known: Collection[str]
) -> list[Plan]:
    """The model's best plan, and up to ``count - 1`` more of its best distinct plans not measured yet."""
    exclude = set(known)
    plans: list[Plan] = []
    for index in range(count):
        plan = model_best_plan(surrogate, space, budget, seed=seed + index, exclude=exclude)
        if plans and plan.hash in exclude:  # the search met no other unmeasured plan
            break
        exclude.add(plan.hash)
        plans.append(plan)
    return plans


def _unbuilt_plans(
    config: TuneConfig,
    space: SearchSpace,
    surrogate: Surrogate | None,
    measured: Callable[[], Collection[str]] | None,
    count: int,
    seed: int,
) -> list[Plan]:
    """Up to ``count`` plans not measured yet: the model's best, else the neighbours of its best plan.

    Without a model of the trials (or the hashes measured) there is nothing to go on: none.
    """
    if surrogate is None or measured is None:
        return []
    known = set(measured())
    plans = [p for p in _model_plans(surrogate, space, config.search_budget, count, seed, known) if p.hash not in known]
    if plans:
        return plans
    best = model_best_plan(surrogate, space, config.search_budget, seed=seed)
    return neighbours(space, best, known, seed=seed)[:count]


def _build_all(
    plans: list[Plan],
    evaluate: Callable[[Plan], TrialResult],
    evaluate_many: Callable[[list[Plan], int], Iterable[TrialResult]] | None,
    builds: Callable[[], int],
    budget: int,
) -> None:
    """Builds plans while the budget lasts: side by side through ``evaluate_many``, else one by one."""
    if evaluate_many is not None:
        list(evaluate_many(plans, max(0, budget - builds())))
        return
    for plan in plans:
        if builds() >= budget:
            break
        evaluate(plan)


def _probes(
    config: TuneConfig,
    space: SearchSpace,
    prior: LayerPrior | None,
    measured: Callable[[], Collection[str]] | None,
) -> list[Plan]:
    """The probe plans: the whole design without a prior; with one, only over the groups it leaves open.

    With a prior, a store that already holds as many plans as the design has rows (an earlier run's imported
    trials) needs no probe: the model of those trials is what the probes would give.
    """
    if prior is None:
        return probe_plans(space, config.budget.builds // 3)
    drop = prior.drop(*_default_setting(space))
    open_groups = unsure_groups(space.groups, drop, config.search_budget)
    cheap = (
        []
        if drop is None
        else [g for g, group in enumerate(space.groups) if drop[list(group)].sum() <= config.search_budget]
    )
    plans = probe_plans(space, config.budget.builds // 6, varied=open_groups, lowered_always=cheap)
    known = measured() if measured is not None else ()
    if len(known) > len(plans) + 1:  # the all-INT8 plan and more: an earlier run's trials stand in for probes
        return [plan for plan in plans if plan.hash in known]
    return plans


def _opening(
    config: TuneConfig,
    space: SearchSpace,
    evaluate: Callable[[Plan], TrialResult],
    builds: Callable[[], int],
    surrogate: Callable[[], Surrogate | None],
    measured: Callable[[], Collection[str]] | None,
) -> None:
    """Builds the best plan of a model that starts from the priors, again after each miss of the search budget.

    Each build corrects the model (the drop scale and the terms of the plan's layers), so a miss by a layer's
    worth is usually fixed by the next plan; at most :data:`OPENING_MODEL_PLANS` builds.
    """
    for opening in range(OPENING_MODEL_PLANS):
        model = surrogate()
        if model is None or builds() >= config.budget.builds:
            return
        known = measured() if measured is not None else ()
        plan = model_best_plan(model, space, config.search_budget, seed=config.seed + opening, exclude=known)
        result = evaluate(plan)
        if result.ok and result.accuracy_drop is not None and result.accuracy_drop <= config.search_budget:
            return


def imitate(model: Any, env: Any, plan: Plan, target: float, max_steps: int = 500) -> float:
    """Behaviour cloning: trains the policy until its mean probability of ``plan``'s actions reaches ``target``.

    Why: a fresh policy samples each layer's precision at random, and nearly every such plan of a model with a
    few sensitive layers is over the accuracy budget, so the first updates teach it FP32 everywhere. In the
    MiniLM replay at budget 0.0005, its real plans after the opening averaged 3-11 INT8 layers of 36 per ten
    builds (the model's best plans: 24-27), and in 3 of 10 seeds no plan within the search budget came within
    2 % of greedy's in 48 builds; cloned toward the model's best plan first, they averaged 19-27 and every seed
    got there (docs/benchmarks.md). PPO then learns from plans near the best one, and the trials it builds
    sharpen the model where it matters.

    Args:
        model: The MaskablePPO model; its policy's own optimizer takes the steps.
        env: An ``EngineBuildEnv`` whose episode replays the plan for the observations (its last step calls its
            evaluator: pass one that costs no build, such as the rehearsal's).
        plan: The plan to imitate.
        target: Mean probability of the plan's actions at which training stops (below 1: the policy still varies
            the plan).
        max_steps: Gradient steps at most.

    Returns:
        The mean probability reached.
    """
    import numpy as np
    import torch

    from autotune.search.episode import actions_from_plan

    actions = actions_from_plan(env.space, env.steps, plan)
    observation, _ = env.reset()
    observations, masks = [], []
    for action in actions:
        observations.append(observation)
        masks.append(env.action_masks())
        observation, *_ = env.step(action)
    obs, chosen, allowed = torch.as_tensor(np.array(observations)), torch.as_tensor(actions), np.array(masks)
    policy = model.policy
    reached = 0.0
    policy.set_training_mode(True)
    try:
        for _ in range(max_steps):
            _, log_prob, _ = policy.evaluate_actions(obs, chosen, action_masks=allowed)
            reached = float(log_prob.detach().exp().mean())
            if reached >= target:
                break
            policy.optimizer.zero_grad()
            (-log_prob.mean()).backward()
            policy.optimizer.step()
    finally:
        policy.set_training_mode(False)
    return reached


def _default_setting(space: SearchSpace) -> tuple[object, object]:
    """The default calibration method and weight granularity of the space (None where it has no such knob)."""
    defaults = {knob.name: knob.default for knob in space.knobs}
    return defaults.get(CALIBRATION_KNOB), defaults.get(GRANULARITY_KNOB)


def train(
    config: TuneConfig,
    space: SearchSpace,
    evaluate: Callable[[Plan], TrialResult],
    builds: Callable[[], int],
    tensorboard_dir: Path,
    checkpoints: Path,
    resume: bool = False,
    estimates: Callable[[], Any] | None = None,
    surrogate: Callable[[], Surrogate | None] | None = None,
    measured: Callable[[], Collection[str]] | None = None,
    evaluate_many: Callable[[list[Plan], int], Iterable[TrialResult]] | None = None,
    workers: int = 1,
    prior: Callable[[], LayerPrior | None] | None = None,
) -> Any:
    """Trains MaskablePPO until the build budget is spent.

    With ``planner.probe_plans``, an orthogonal design of plans is built first (:mod:`autotune.search.design`). A fresh
    policy is then cloned toward the model's best plan (``planner.imitation``, :func:`imitate`). Then
    real updates (``ppo.episodes_per_update`` built plans each) alternate with ``ppo.imagined_episodes`` episodes
    scored by the additive model of the trials so far, which cost no build (Dyna): the agent learns which layers
    pay from a few dozen builds, and every plan it builds corrects the model. Each planning step builds the
    model's best plans within the search budget, and one bolder (``planner.bold_plan``).

    Args:
        config: The run's config (``ppo``, ``seed``, ``budget``, ``reward``).
        space: The search space.
        evaluate: Plan to result; called once per episode.
        builds: Builds spent so far (store hits excluded).
        tensorboard_dir: Where SB3 writes its losses, entropy and explained variance.
        checkpoints: Where checkpoints go; ``latest.zip`` is the one ``resume`` loads.
        resume: Continue from ``checkpoints/latest.zip`` when it exists.
        estimates: Per-layer estimates fitted from the trials so far, for the observations.
        surrogate: The additive model of the trials so far (None while too few), for imagined episodes.
        measured: Hashes of the plans measured so far: the model's plan is the best one not among them.
        evaluate_many: Plans and a build limit to results, built side by side by ``workers`` workers. Then the
            probes are built side by side, each planning step builds the ``workers`` best unmeasured plans of the
            model, and the rollouts run ``workers`` envs whose final steps are built together.
        workers: Builds that run at once (with ``evaluate_many``).
        prior: The per-layer priors (None without): the model's best plan is built before the probes, which vary
            only the groups the prior leaves open.

    Returns:
        The trained model.
    """
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.logger import configure
    from stable_baselines3.common.vec_env import DummyVecEnv

    from envs.engine_build import EngineBuildEnv  # the env is a shell over autotune.search; only the agent uses it

    def make_env(score: Callable[[Plan], TrialResult]) -> Callable[[], EngineBuildEnv]:
        return lambda: EngineBuildEnv(
            space, score, config.reward, config.search_budget, estimates=estimates, shaping=config.ppo.reward_shaping
        )

    pace = ComputePace(config.ppo.compute_share)
    evaluate = pace.evaluate(evaluate)
    evaluate_many = pace.evaluate_many(evaluate_many) if evaluate_many is not None else None
    envs = workers if evaluate_many is not None else 1
    real = _real_envs(make_env, evaluate, evaluate_many, envs, builds, config.budget.builds)
    real.seed(config.seed)
    current: list[Surrogate | None] = [None]

    def imagine(plan: Plan) -> TrialResult:
        model_of_trials = current[0]
        assert model_of_trials is not None  # imagined episodes run only once a model is fitted
        return model_of_trials.result(plan)

    imagined = DummyVecEnv([make_env(imagine) for _ in range(envs)])
    imagined.seed(config.seed + 1)
    episode_length = len(real.envs[0].unwrapped.steps)
    n_steps = -(-config.ppo.episodes_per_update // envs) * episode_length  # per env
    rollout = n_steps * envs
    latest = checkpoints / LATEST
    if resume and latest.exists():
        model = MaskablePPO.load(latest, env=real, device="cpu")
    else:
        model = MaskablePPO(
            "MlpPolicy",
            real,
            n_steps=n_steps,
            batch_size=max(2, rollout // config.ppo.minibatches),
            n_epochs=config.ppo.n_epochs,
            learning_rate=config.ppo.learning_rate,
            gamma=config.ppo.gamma,
            gae_lambda=config.ppo.gae_lambda,
            ent_coef=config.ppo.ent_coef,
            clip_range=config.ppo.clip_range,
            policy_kwargs={"net_arch": list(config.ppo.net_arch)},
            seed=config.seed,
            device="cpu",
            verbose=0,
        )
    model.set_logger(configure(str(tensorboard_dir), ["csv", "tensorboard"]))
    # The budget counts builds, not steps: the callback stops training; this bound only guards a runaway loop.
    max_updates = (config.budget.builds + config.budget.stall_episodes) * 50
    rollout_episodes = rollout // episode_length
    fresh = not resume
    # A policy that has learned (a resumed run's) is not cloned again: that would undo what it learned.
    cloned = model.num_timesteps > 0
    try:
        known_prior = prior() if prior is not None else None
        if known_prior is not None and surrogate is not None and config.planner.build_model_plan:
            _opening(config, space, evaluate, builds, surrogate, measured)
        if config.planner.probe_plans:
            # On a resumed run the store answers the probes already built, at no cost.
            _build_all(
                _probes(config, space, known_prior, measured), evaluate, evaluate_many, builds, config.budget.builds
            )
        callback = _make_callback(config, builds, checkpoints, builds())
        for _ in range(max_updates):
            # Rehearse first: once the probes are built, even the first real plans come from an informed policy.
            current[0] = surrogate() if surrogate is not None and config.ppo.imagined_episodes else None
            if current[0] is not None and not cloned and config.planner.imitation > 0:
                best = model_best_plan(current[0], space, config.search_budget, seed=config.seed)
                imitate(model, imagined.envs[0], best, config.planner.imitation)
                cloned = True
            episodes = pace.rehearsal_episodes(config.ppo.imagined_episodes, rollout_episodes)
            if current[0] is not None and episodes > 0:
                model.set_env(imagined)
                started = time.perf_counter()
                model.learn(-(-episodes // rollout_episodes) * rollout, reset_num_timesteps=fresh, log_interval=1)
                pace.rehearsed(episodes, time.perf_counter() - started)
                fresh = False
            if config.planner.build_model_plan and current[0] is not None and builds() < config.budget.builds:
                # Dyna's planning step: the plan the model of the trials rates best, built for real; a
                # wrong model is corrected by its own result, and the store answers a repeat for free.
                known = measured() if measured is not None else ()
                plans = _model_plans(
                    current[0],
                    space,
                    config.search_budget,
                    envs * config.planner.model_plans,
                    config.seed + builds(),
                    known,
                )
                if config.bold_budget > config.search_budget:
                    # A bold bet for the confirmation: greedy's winners sit past the search budget, where held-out
                    # data may still find a plan within the accuracy budget; the plans aimed below it never go there.
                    taken = {*known, *(plan.hash for plan in plans)}
                    bold = model_best_plan(
                        current[0], space, config.bold_budget, seed=config.seed + builds(), exclude=taken
                    )
                    plans += [] if bold.hash in taken else [bold]
                _build_all(plans, evaluate, evaluate_many, builds, config.budget.builds)
                if builds() >= config.budget.builds:  # a rollout would build at least one plan more
                    save_checkpoint(model, checkpoints, builds())
                    break
            model.set_env(real)
            model.learn(rollout, callback=callback, reset_num_timesteps=fresh, log_interval=1)
            fresh = False
            if builds() < config.budget.builds and callback.stalled >= config.budget.stall_episodes:
                # A converged policy repeats plans the store answers for free: the budget left goes to plans not
                # built yet, and the run ends early only when there are none.
                unbuilt = _unbuilt_plans(config, space, current[0], measured, envs, builds())
                _build_all(unbuilt, evaluate, evaluate_many, builds, config.budget.builds)
                callback.stalled = 0 if unbuilt else callback.stalled
            if builds() >= config.budget.builds or callback.stalled >= config.budget.stall_episodes:
                break
    except KeyboardInterrupt:
        # Ctrl-C: every measured trial is already committed; keep the agent too, so `autotune resume` goes on.
        # (The interrupt may come during the probes or a rehearsal, before the callback was attached to the model.)
        save_checkpoint(model, checkpoints, builds())
        raise
    return model
