"""The agent: sb3-contrib MaskablePPO on the EngineBuild env, a search the driver ends like any other.

SB3's ``learn`` runs its own loop (it steps the env, whose last step builds a plan), so the agent is a
:class:`~autotune.search.driver.SelfDriven` search: every plan it builds goes through the run's driver, which alone
counts the builds, the stalls and the minutes, and the agent stops when the driver says it is exhausted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config.schema import PlanningRule
from autotune.config.views import SearchSettings
from autotune.interrupt import interrupts_held
from autotune.plan import Plan
from autotune.run.files import atomic_write
from autotune.run.trial import TrialResult
from autotune.search.design import model_best_plan
from autotune.search.driver import Driver
from autotune.search.estimate import RefittedEstimates, Surrogate
from autotune.search.planner import Planner
from autotune.search.prior import LayerPrior
from autotune.search.space import SearchSpace
from autotune.search.strategies import Stepwise

LATEST = "latest.zip"


@dataclass(frozen=True)
class AgentPaths:
    """Where the agent keeps its files.

    Attributes:
        tensorboard_dir: Where SB3 writes its losses, entropy and explained variance.
        checkpoints: Where checkpoints go; ``latest.zip`` is the one ``resume`` loads.
        resume: Continue from ``checkpoints/latest.zip`` when it exists.
    """

    tensorboard_dir: Path
    checkpoints: Path
    resume: bool = False


EnvMaker = Callable[..., Any]
"""The env's constructor, ``envs.engine_build.EngineBuildEnv(space, score, reward, search_budget, *, estimates,
shaping, measured)``. The run hands it in: the env is a thin shell above the search, so no search module imports it."""


@dataclass(frozen=True)
class TrialModels:
    """What the trials so far say, each refitted on every call.

    Attributes:
        surrogate: The additive model of the trials so far (None while too few), for imagined episodes.
        estimates: Per-layer estimates fitted from the trials so far, for the observations.
        measured: Hashes of the plans measured so far: the model's plan is the best one not among them.
        prior: The per-layer priors (None without): the model's best plan is built before the probes, which vary
            only the groups the prior leaves open.
    """

    surrogate: Callable[[], Surrogate | None] = lambda: None
    estimates: Callable[[], Any] | None = None
    measured: Callable[[], Collection[str]] | None = None
    prior: Callable[[], LayerPrior | None] | None = None

    @classmethod
    def refitted(cls, fitted: RefittedEstimates, with_prior: bool) -> TrialModels:
        """The models of ``fitted``; its prior only ``with_prior`` (``planner.priors``)."""
        return cls(fitted.surrogate, fitted.estimates, fitted.measured, fitted.prior if with_prior else None)

    def planner(self, rule: PlanningRule, space: SearchSpace, workers: int) -> Planner:
        """The surrogate planner on these models (``rule``: ``TuneConfig.planning``)."""
        return Planner(rule, space, self.surrogate, self.measured, self.prior, workers)


MAX_SKIPPED_ROLLOUTS = 8
"""The most cycles the policy's real rollouts pause after rollouts that built nothing (``_Agent.roll_out``)."""


class ComputePace:
    """Keeps the agent's own compute to ``share`` times the wall time of its builds so far.

    Unpaced, the rehearsals of imagined episodes after every update took most of a run's wall time on a model whose
    trials take under a second (docs/search.md#the-planner-and-the-policy). Timed here, each rehearsal gets the
    imagined episodes that the builds' time pays for, in whole rollouts: none while the agent is ahead of its
    builds, all of ``ppo.imagined_episodes`` when a build takes longer than a rehearsal.

    Args:
        share: The agent's compute allowed per second of building; 0: no limit.
        built_s: Wall seconds spent building so far (``Driver.build_s``); only what it adds from now on counts.
        clock: Seconds; injectable for tests.
    """

    def __init__(self, share: float, built_s: Callable[[], float], clock: Callable[[], float] = time.perf_counter):
        self.share = share
        self.clock = clock
        self.started = clock()
        self._built_s = built_s
        self._built_before = built_s()
        self.episode_s: float | None = None

    @property
    def build_s(self) -> float:
        """Wall seconds spent building since the start."""
        return self._built_s() - self._built_before

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

    def within_share(self) -> bool:
        """The agent's compute so far is within ``share`` times its builds' time (always with no limit)."""
        return self.share <= 0 or self.agent_s <= self.share * self.build_s

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


def _make_callback(driver: Driver, checkpoints: Path, every_builds: int, hparams: dict[str, Any]) -> Any:
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import HParam

    class BudgetCallback(BaseCallback):
        """Stops learning when the driver is exhausted, checkpoints every N builds, records the hyperparameters once."""

        def __init__(self) -> None:
            super().__init__()
            self.last_checkpoint = driver.builds
            self.hparams_logged = False

        def _on_training_start(self) -> None:
            if self.hparams_logged:  # training resumes after every rehearsal on the model of the trials
                return
            self.hparams_logged = True
            self.logger.record(
                "hparams",
                HParam(hparams, {"train/value_loss": 0.0, "train/entropy_loss": 0.0}),
                exclude=("stdout", "log", "json", "csv"),
            )

        def _on_step(self) -> bool:
            if not any(self.locals.get("dones", [])):
                return True
            if driver.builds - self.last_checkpoint >= every_builds:
                self.last_checkpoint = driver.builds
                save_checkpoint(self.model, checkpoints, driver.builds)
            return not driver.exhausted()

        def _on_training_end(self) -> None:
            save_checkpoint(self.model, checkpoints, driver.builds if driver.builds >= driver.budget else None)

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


def _real_envs(make_env: Callable[[Callable[[Plan], TrialResult]], Callable[[], Any]], driver: Driver) -> Any:
    """The vectorised env of the real rollouts: one env, or one per worker, whose final steps are built side by side.

    A plan past the budget gets a failure that is never built or stored; the callback ends training at that step.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    prefetched: dict[str, TrialResult] = {}

    def prefetch(plans: list[Plan]) -> None:
        prefetched.update((result.plan_hash, result) for result in driver.build(plans))
        for plan in plans:
            prefetched.setdefault(plan.hash, TrialResult.failure(plan, "not built: the build budget is spent"))

    def score(plan: Plan) -> TrialResult:
        if plan.hash not in prefetched:
            prefetch([plan])
        return prefetched.pop(plan.hash)

    if driver.workers == 1:
        return DummyVecEnv([make_env(score)])
    return _side_by_side([make_env(score) for _ in range(driver.workers)], prefetch)


def imitate(model: Any, env: Any, plan: Plan, target: float, max_steps: int = 500) -> float:
    """Behaviour cloning: trains the policy until its mean probability of ``plan``'s actions reaches ``target``.

    Why: a fresh policy samples each layer's precision at random, and nearly every such plan of a model with a
    few sensitive layers is over the accuracy budget, so the first updates teach it FP32 everywhere; cloned
    toward the model's best plan first, its plans hold many more INT8 layers from the start
    (docs/method.md#why-the-policy-is-cloned-toward-the-planners-plan-first). PPO then learns from plans near the
    best one, and the trials it builds sharpen the model where it matters.

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


class _Agent:
    """One training run's state: the policy, its real and imagined envs, the pace, the planner and the driver.

    Each method is one part of the loop :meth:`run` reads on one page.
    """

    def __init__(
        self,
        settings: SearchSettings,
        space: SearchSpace,
        driver: Driver,
        paths: AgentPaths,
        models: TrialModels,
        make_env: EnvMaker,
    ):
        from stable_baselines3.common.logger import configure
        from stable_baselines3.common.vec_env import DummyVecEnv

        self.settings, self.space, self.driver, self.checkpoints = settings, space, driver, paths.checkpoints
        self.planner = models.planner(settings.planning, space, driver.workers)
        # The builds' wall time, which the agent's compute is sized to.
        self.pace = ComputePace(settings.ppo.compute_share, lambda: driver.build_s)
        make_env = self._env_factory(make_env, models.estimates)
        # Real episodes end in plans not built yet where their choices allow one (novel_options); imagined
        # ones cost no build and are not masked so.
        self.real = _real_envs(lambda score: make_env(score, models.measured), driver)
        self.real.seed(settings.seed)
        self.current: Surrogate | None = None  # the model of the trials the imagined episodes are scored by
        envs = driver.workers
        self.imagined = DummyVecEnv([make_env(lambda plan: self.current.result(plan)) for _ in range(envs)])
        self.imagined.seed(settings.seed + 1)
        episode_length = len(self.real.envs[0].unwrapped.steps)
        n_steps = -(-settings.ppo.episodes_per_update // envs) * episode_length  # per env
        self.rollout = n_steps * envs
        self.rollout_episodes = self.rollout // episode_length
        self.model = self._policy(n_steps, paths.resume)
        self.model.set_logger(configure(str(paths.tensorboard_dir), ["csv", "tensorboard"]))
        self.fresh = not paths.resume
        # A policy that has learned (a resumed run's) is not cloned again: that would undo what it learned.
        self.cloned = self.model.num_timesteps > 0
        self.idle_rollouts = 0  # real rollouts in a row that built nothing
        self.skip_rollouts = 0  # cycles left in which the planner builds instead of a real rollout

    def _env_factory(self, make_env: EnvMaker, estimates: Callable[[], Any] | None) -> Callable[..., Any]:
        """``(score, measured=None)`` to an env constructor, as ``DummyVecEnv`` takes them."""
        settings, space = self.settings, self.space
        return lambda score, measured=None: (
            lambda: make_env(
                space,
                score,
                settings.reward,
                settings.search_budget,
                estimates=estimates,
                shaping=settings.ppo.reward_shaping,
                measured=measured,
            )
        )

    def _policy(self, n_steps: int, resume: bool) -> Any:
        """A fresh MaskablePPO on the real envs, or the checkpoint ``latest.zip`` of the run being resumed."""
        from sb3_contrib import MaskablePPO

        latest, ppo = self.checkpoints / LATEST, self.settings.ppo
        if resume and latest.exists():
            return MaskablePPO.load(latest, env=self.real, device="cpu")
        return MaskablePPO(
            "MlpPolicy",
            self.real,
            n_steps=n_steps,
            batch_size=max(2, self.rollout // ppo.minibatches),
            n_epochs=ppo.n_epochs,
            learning_rate=ppo.learning_rate,
            gamma=ppo.gamma,
            gae_lambda=ppo.gae_lambda,
            ent_coef=ppo.ent_coef,
            clip_range=ppo.clip_range,
            policy_kwargs={"net_arch": list(ppo.net_arch)},
            seed=self.settings.seed,
            device="cpu",
            verbose=0,
        )

    def _hparams(self) -> dict[str, Any]:
        """The run's hyperparameters, for TensorBoard."""
        settings = self.settings
        hparams = {k: v for k, v in settings.ppo.model_dump().items() if not isinstance(v, list)}
        return {
            **hparams,
            "seed": settings.seed,
            "budget": self.driver.budget,
            "accuracy_budget": settings.accuracy_budget,
        }

    def run(self) -> None:
        """The planner's opening and probes, then rehearsal, planning step and rollout, until the driver says stop."""
        settings, driver = self.settings, self.driver
        driver.run(Stepwise(self.planner.opening()))
        if settings.planner.probe_plans:
            driver.build(self.planner.probes())  # on a resumed run the store answers the probes already built
        driver.stalled = 0  # the opening and probes a resumed run finds in its store say nothing about the policy
        callback = _make_callback(driver, self.checkpoints, settings.ppo.checkpoint_every_builds, self._hparams())
        while not driver.exhausted():
            # Rehearse first: once the probes are built, even the first real plans come from an informed policy.
            self.current = self.planner.surrogate() if settings.ppo.imagined_episodes else None
            self.rehearse()
            if self.plan():  # a rollout would build at least one plan more
                break
            builds, rolled = driver.builds, self.rollout_due()
            if rolled:
                self.roll_out(callback)
            if driver.left and (driver.stalled >= driver.stall or self.idle_rollouts):
                # A converged policy repeats plans the store answers for free: the budget left goes to plans not
                # built yet (whose builds end the stall), and the run ends early only when there are none.
                driver.build(self.planner.unbuilt(self.current, driver.workers, settings.seed + driver.builds))
            if not rolled and driver.builds == builds:  # nothing else moved the search on: the policy does
                self.roll_out(callback)
        save_checkpoint(self.model, self.checkpoints, driver.builds if driver.builds >= driver.budget else None)

    def rollout_due(self) -> bool:
        """Whether the next real rollout runs.

        Not while the policy's compute is ahead of its share of the builds' time, nor in the cycles after a rollout
        that built nothing (twice as many after each such rollout): the planner builds then.
        """
        if self.skip_rollouts > 0:
            self.skip_rollouts -= 1
            return False
        return self.pace.within_share()

    def roll_out(self, callback: Any) -> None:
        """One real rollout: the policy's plans built (the store answers those built already) and learned from."""
        builds = self.driver.builds
        self.model.set_env(self.real)
        self.model.learn(self.rollout, callback=callback, reset_num_timesteps=self.fresh, log_interval=1)
        self.fresh = False
        if 2 * (self.driver.builds - builds) >= self.rollout_episodes:
            self.idle_rollouts = 0
            return
        # Most plans of the rollout were built already: the policy has converged on what the store holds, and its
        # next rollouts would be store hits too. The planner's unbuilt plans take their place for a while.
        self.idle_rollouts += 1
        self.skip_rollouts = min(MAX_SKIPPED_ROLLOUTS, 2 ** (self.idle_rollouts - 1))

    def rehearse(self) -> None:
        """Clones a fresh policy toward the model's best plan once, then learns from the episodes the pace allows."""
        settings = self.settings
        if self.current is None:
            return
        if not self.cloned and settings.planner.imitation > 0:
            best = model_best_plan(self.current, self.space, settings.search_budget, seed=settings.seed)
            imitate(self.model, self.imagined.envs[0], best, settings.planner.imitation)
            self.cloned = True
        episodes = self.pace.rehearsal_episodes(settings.ppo.imagined_episodes, self.rollout_episodes)
        if episodes > 0:
            self.model.set_env(self.imagined)
            started = time.perf_counter()
            steps = -(-episodes // self.rollout_episodes) * self.rollout
            self.model.learn(steps, reset_num_timesteps=self.fresh, log_interval=1)
            self.pace.rehearsed(episodes, time.perf_counter() - started)
            self.fresh = False

    def plan(self) -> bool:
        """The planner's step on the model the rehearsal used, built for real; True when it spent the budget."""
        if not self.settings.planner.build_model_plan or self.current is None or not self.driver.left:
            return False
        self.driver.build(self.planner.planning_step(self.current, self.settings.seed + self.driver.builds))
        return not self.driver.left


def train(
    settings: SearchSettings,
    space: SearchSpace,
    driver: Driver,
    paths: AgentPaths,
    models: TrialModels | None = None,
    *,
    make_env: EnvMaker,
) -> Any:
    """Trains MaskablePPO until the driver is exhausted; the planner's plans are built between its rollouts.

    With ``planner.probe_plans``, an orthogonal design of plans is built first (:mod:`autotune.search.design`). A
    fresh policy is then cloned toward the model's best plan (``planner.imitation``, :func:`imitate`). Then real
    updates (``ppo.episodes_per_update`` built plans each) alternate with ``ppo.imagined_episodes`` episodes scored
    by the additive model of the trials so far, which cost no build (Dyna), as many as the pace allows
    (:class:`ComputePace`): the agent learns which layers pay from a few dozen builds, and every plan it builds
    corrects the model. Each planning step builds the model's best plans within the search budget, and one bolder
    (``planner.bold_plan``). With several workers the rollouts run one env per worker, whose final steps are
    built together, and each planning step builds ``workers * planner.model_plans`` plans side by side.

    Args:
        settings: What the search reads of the config (``ppo``, ``planner``, ``seed``, ``reward``, the budgets).
        space: The search space.
        driver: Builds the plans and ends the search (:class:`~autotune.search.driver.Driver`).
        paths: Where the agent's logs and checkpoints go, and whether it resumes.
        models: What the trials so far say (none: no rehearsal, no planning step).
        make_env: The env's constructor (``envs.engine_build.EngineBuildEnv``), see :data:`EnvMaker`.

    Returns:
        The trained model.
    """
    agent = None
    try:
        with one_torch_thread():
            agent = _Agent(settings, space, driver, paths, models or TrialModels(), make_env)
            agent.run()
    except KeyboardInterrupt:
        # Ctrl-C: every measured trial is already committed; keep the agent too, so `autotune resume` goes on.
        # (The interrupt may come during the probes or a rehearsal, before the callback was attached to the model.)
        if agent is not None:
            save_checkpoint(agent.model, paths.checkpoints, driver.builds)
        raise
    return agent.model


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch's CPU work on one thread meanwhile (the thread count it had is restored after).

    The policy is a small MLP: on two threads its updates waited on each other's spin whenever a build or any other
    process held a core (a forward and backward pass of a 64-wide MLP took 58 ms on two threads beside one busy
    process, 1.2 ms on one, on a 2-core VM), and those threads took the cores the trial process builds and times on.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class PolicySearch:
    """The agent (the PPO policy with the surrogate planner) as a search the driver runs: see :func:`train`."""

    settings: SearchSettings
    space: SearchSpace
    paths: AgentPaths
    models: TrialModels
    make_env: EnvMaker

    def drive(self, driver: Driver) -> None:
        """Trains the policy on ``driver`` until it is exhausted."""
        train(self.settings, self.space, driver, self.paths, self.models, make_env=self.make_env)
