"""EngineBuild: each episode chooses a plan step by step and ends in a real build.

A thin shell: decisions, masks, observations and reward are the pure functions of ``autotune.search``;
this class only sequences them and calls the evaluator.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import gymnasium as gym
import numpy as np

from autotune.config.schema import RewardConfig
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.search.episode import (
    action_count,
    action_mask,
    decisions,
    novel_options,
    observation_size,
    observe,
    plan_from_actions,
    potential,
)
from autotune.search.estimate import LayerEstimates
from autotune.search.reward import reward
from autotune.search.space import SearchSpace


class EngineBuildEnv(gym.Env[np.ndarray, np.int64]):
    """Sequential plan construction with action masks and a sparse reward.

    Args:
        space: What may be chosen.
        evaluate: Plan to trial result (the ``Evaluator``: store first, then a real build).
        reward_config: Penalty weights.
        accuracy_budget: Drop allowed without penalty.
        render_mode: ``"ansi"`` or None.
        estimates: Returns per-layer estimates fitted from the trials so far (observation features), or None.
        shaping: Pay each step the change in the estimates' predicted reward (potential-based shaping, see
            :func:`autotune.search.episode.potential`); the episode's return is still the real reward.
        measured: Returns the hashes of the plans measured so far: each step masks the options whose every
            completion is one of them, where another option is left (:func:`autotune.search.episode.novel_options`).
            None: no such mask (an imagined env, whose plans cost no build).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        space: SearchSpace,
        evaluate: Callable[[Plan], TrialResult],
        reward_config: RewardConfig | None = None,
        accuracy_budget: float = 0.01,
        render_mode: str | None = None,
        estimates: Callable[[], LayerEstimates | None] | None = None,
        shaping: bool = False,
        measured: Callable[[], Collection[str]] | None = None,
    ):
        self.space = space
        self.evaluate = evaluate
        self.reward_config = reward_config or RewardConfig()
        self.accuracy_budget = accuracy_budget
        self.render_mode = render_mode
        self.estimates = estimates
        self.shaping = shaping
        self.measured = measured
        self._potential = 0.0
        self._episode_estimates: LayerEstimates | None = None
        self.steps = decisions(space)
        if not self.steps:
            raise ValueError(
                "the search space has nothing to decide: every layer is fixed and every knob has one value"
            )
        self.n_actions = action_count(self.steps)
        self.action_space = gym.spaces.Discrete(self.n_actions)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (observation_size(space, self.steps),), np.float32)
        self._chosen: list[int] = []
        self.last_result: TrialResult | None = None

    def action_masks(self) -> np.ndarray:
        """Allowed actions now (sb3-contrib's MaskablePPO calls this)."""
        mask = action_mask(self.steps, len(self._chosen), self.n_actions)
        if self.measured is None:
            return mask
        return novel_options(self.space, self.steps, self._chosen, mask, self.measured())

    def _info(self) -> dict[str, Any]:
        return {"action_mask": self.action_masks().astype(np.int8)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Starts a new plan."""
        super().reset(seed=seed)
        self._chosen = []
        # fixed for the episode, so the observations of one episode are consistent
        self._episode_estimates = self.estimates() if self.estimates is not None else None
        self._potential = 0.0
        return self._observe(), self._info()

    def _observe(self) -> np.ndarray:
        return observe(self.space, self.steps, self._chosen, self._episode_estimates, self.accuracy_budget)

    def plan_after(self, action: int) -> Plan | None:
        """The plan this action completes, when it is the episode's last decision; None before that.

        Lets a vectorised env build the plans of all its envs' final steps side by side before stepping them.
        """
        if len(self._chosen) != len(self.steps) - 1:
            return None
        last = int(action) % len(self.steps[-1].options)
        return plan_from_actions(self.space, self.steps, [*self._chosen, last])

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Takes one decision; the last one builds and measures the plan."""
        if len(self._chosen) >= len(self.steps):
            raise RuntimeError("the episode is over: call reset()")
        # MaskablePPO never sends a masked action; unmasked samplers (env checkers) may, so fold it into range.
        self._chosen.append(int(action) % len(self.steps[len(self._chosen)].options))
        if len(self._chosen) < len(self.steps):
            return self._observe(), self._shaped(0.0), False, False, self._info()
        plan = plan_from_actions(self.space, self.steps, self._chosen)
        result = self.evaluate(plan)
        self.last_result = result
        value = reward(result, self.reward_config, self.accuracy_budget)
        info = self._info()
        info.update(
            reward=value,
            plan_hash=plan.hash,
            status=result.status,
            error=result.error,
            speedup=result.speedup,
            latency_ms=result.latency_ms,
            accuracy=result.accuracy,
            accuracy_drop=result.accuracy_drop,
            build_s=result.build_s,
            from_store=result.from_store,
            is_success=bool(result.ok and (result.accuracy_drop or 0.0) <= self.accuracy_budget),
        )
        return self._observe(), float(value - self._potential), True, False, info

    def _shaped(self, reward_now: float) -> float:
        """The step's reward plus the change in potential (0 without shaping)."""
        if not self.shaping:
            return reward_now
        before, self._potential = (
            self._potential,
            potential(
                self.space, self.steps, self._chosen, self._episode_estimates, self.reward_config, self.accuracy_budget
            ),
        )
        return reward_now + self._potential - before

    def render(self) -> str | None:
        """The choices so far, as text."""
        if self.render_mode != "ansi":
            return None
        parts = [
            f"{step.kind}[{step.index}]={step.options[a]}" for step, a in zip(self.steps, self._chosen, strict=False)
        ]
        return " ".join(parts) or "(no decision yet)"
