"""What one part of a run reads of its config, as a small typed value built from the config.

A part that reads a few sections takes them, not the whole ``TuneConfig``; where it reads several, it takes one of
these views, made here where the config is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config.schema import TuneConfig
from autotune.config.search import PlannerConfig, PlanningRule, PPOConfig, RewardConfig


@dataclass(frozen=True)
class SearchSettings:
    """What a search reads of the config (the strategies, the planner, the agent): its sections, seed and budgets."""

    seed: int
    """The run's seed."""
    reward: RewardConfig
    """How a trial is rewarded (``reward``, its ``tie_within`` the measured noise where unset)."""
    search_budget: float
    """The drop the search aims at (``TuneConfig.search_budget``)."""
    accuracy_budget: float
    """The largest accuracy drop allowed (``accuracy_budget``)."""
    planning: PlanningRule
    """What the surrogate planner reads (``TuneConfig.planning``)."""
    planner: PlannerConfig
    """The ``planner`` section."""
    ppo: PPOConfig
    """The ``ppo`` section."""

    @classmethod
    def of(cls, config: TuneConfig) -> SearchSettings:
        """The search's part of ``config``."""
        return cls(
            config.seed,
            config.reward,
            config.search_budget,
            config.accuracy_budget,
            config.planning,
            config.planner,
            config.ppo,
        )
