"""The agent: sb3-contrib MaskablePPO on the EngineBuild env, with a budget counted in builds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.config import TuneConfig
from autotune.plan import Plan
from autotune.search.space import SearchSpace
from autotune.trial import TrialResult

LATEST = "latest.zip"


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

        def _on_training_start(self) -> None:
            hparams = {k: v for k, v in config.ppo.model_dump().items() if not isinstance(v, list)}
            hparams.update(seed=config.seed, budget=config.budget.builds, accuracy_budget=config.accuracy_budget)
            self.logger.record(
                "hparams",
                HParam(hparams, {"train/value_loss": 0.0, "train/entropy_loss": 0.0}),
                exclude=("stdout", "log", "json", "csv"),
            )

        def _save(self) -> None:
            checkpoints.mkdir(parents=True, exist_ok=True)
            self.model.save(checkpoints / f"ppo_{builds()}_builds.zip")
            tmp = checkpoints / ".latest.tmp.zip"
            self.model.save(tmp)
            tmp.replace(checkpoints / LATEST)

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
            self._save()

    return BudgetCallback()


def train(
    config: TuneConfig,
    space: SearchSpace,
    evaluate: Callable[[Plan], TrialResult],
    builds: Callable[[], int],
    tensorboard_dir: Path,
    checkpoints: Path,
    resume: bool = False,
    estimates: Callable[[], Any] | None = None,
) -> Any:
    """Trains MaskablePPO until the build budget is spent.

    Args:
        config: The run's config (``ppo``, ``seed``, ``budget``, ``reward``).
        space: The search space.
        evaluate: Plan to result; called once per episode.
        builds: Builds spent so far (store hits excluded).
        tensorboard_dir: Where SB3 writes its losses, entropy and explained variance.
        checkpoints: Where checkpoints go; ``latest.zip`` is the one ``resume`` loads.
        resume: Continue from ``checkpoints/latest.zip`` when it exists.
        estimates: Per-layer estimates fitted from the trials so far, for the observations.

    Returns:
        The trained model.
    """
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.logger import configure
    from stable_baselines3.common.vec_env import DummyVecEnv

    from envs.engine_build import EngineBuildEnv

    def make_env() -> EngineBuildEnv:
        return EngineBuildEnv(space, evaluate, config.reward, config.search_budget, estimates=estimates)

    venv = DummyVecEnv([make_env])
    venv.seed(config.seed)
    episode_length = len(venv.envs[0].unwrapped.steps)
    n_steps = config.ppo.episodes_per_update * episode_length
    latest = checkpoints / LATEST
    if resume and latest.exists():
        model = MaskablePPO.load(latest, env=venv, device="cpu")
    else:
        model = MaskablePPO(
            "MlpPolicy",
            venv,
            n_steps=n_steps,
            batch_size=max(2, n_steps // config.ppo.minibatches),
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
    total_steps = episode_length * (config.budget.builds + config.budget.stall_episodes) * 50
    callback = _make_callback(config, builds, checkpoints, builds())
    try:
        model.learn(total_timesteps=total_steps, callback=callback, reset_num_timesteps=not resume, log_interval=1)
    except KeyboardInterrupt:
        # Ctrl-C: every measured trial is already committed; keep the agent too, so `autotune resume` goes on.
        callback._save()
        raise
    return model
