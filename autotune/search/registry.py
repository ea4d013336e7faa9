"""Every strategy a run may search with, by name: the agent, the planner, the searches and one plan per precision.

The one registry: ``autotune.tune`` runs a strategy by its name here, and ``autotune baseline --strategy`` offers
these names. Each entry makes its search on the space the uniform seeds leave (the free knobs fixed), from what
:class:`SearchInputs` holds, and the driver runs it (:func:`autotune.search.driver.search_with_seeds`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autotune.config.schema import ConfigError
from autotune.config.views import SearchSettings
from autotune.plan import PRECISIONS, KnobValue
from autotune.search.agent import AgentPaths, EnvMaker, PolicySearch, TrialModels
from autotune.search.driver import Driver, SelfDriven, search_with_seeds
from autotune.search.planner import Planner
from autotune.search.space import SearchSpace
from autotune.search.strategies import Aim, Fixed, Greedy, Optuna, Random, Strategy


@dataclass(frozen=True)
class SearchInputs:
    """What a strategy is made from.

    Attributes:
        settings: What the searches read of the run's config (``SearchSettings.of``).
        workers: Builds that run at once.
        models: The models of the trials on the space the seeds leave (the agent and the planner only; made once
            the seeds are built, so priors are computed only for a search that runs).
        paths: Where the agent keeps its logs and checkpoints (the agent only).
        make_env: The env's constructor the agent runs its policy in (the agent only; the run hands it in).
    """

    settings: SearchSettings
    workers: int = 1
    models: Callable[[SearchSpace], TrialModels] = lambda space: TrialModels()
    paths: AgentPaths | None = None
    make_env: EnvMaker | None = None

    @property
    def aim(self) -> Aim:
        """What the searches aim at: the search budget, the reward and the seed."""
        return Aim(self.settings.search_budget, self.settings.reward, self.settings.seed)


def _policy(space: SearchSpace, inputs: SearchInputs) -> PolicySearch:
    if inputs.paths is None or inputs.make_env is None:
        raise ValueError("the ppo strategy needs the agent's paths and the env's constructor")
    return PolicySearch(inputs.settings, space, inputs.paths, inputs.models(space), inputs.make_env)


def _planner(space: SearchSpace, inputs: SearchInputs) -> Planner:
    return inputs.models(space).planner(inputs.settings.planning, space, inputs.workers)


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy of the registry.

    Attributes:
        make: The search, on the space the seeds leave.
        independent: Its proposals depend on no result (``Strategy.independent``).
        seeded: The uniform seeds are built first (False for a precision: it is one uniform plan itself).
    """

    make: Callable[[SearchSpace, SearchInputs], Strategy | SelfDriven]
    independent: bool = False
    seeded: bool = True


def _fixed(precision: str) -> StrategyEntry:
    return StrategyEntry(lambda space, _: Fixed(space, precision), seeded=False)


STRATEGIES: dict[str, StrategyEntry] = {
    "ppo": StrategyEntry(_policy),
    "planner": StrategyEntry(_planner),
    "random": StrategyEntry(lambda space, inputs: Random(space, inputs.settings.seed), independent=True),
    "greedy": StrategyEntry(lambda space, inputs: Greedy(space, inputs.aim, inputs.workers)),
    "optuna": StrategyEntry(lambda space, inputs: Optuna(space, inputs.aim)),
    **{precision: _fixed(precision) for precision in PRECISIONS},
}
"""Every strategy by name: the agent (the PPO policy with the surrogate planner), the planner alone, the searches,
and one uniform plan per precision (the usual "build with INT8 enabled")."""


def run_strategy(name: str, driver: Driver, space: SearchSpace, inputs: SearchInputs) -> dict[str, KnobValue]:
    """The uniform seeds, then the named strategy, through ``driver`` until it is exhausted.

    Returns:
        The free knobs the seeds fixed, name to value.

    Raises:
        ConfigError: The strategy is unknown.
    """
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; strategies: {', '.join(STRATEGIES)}")
    entry = STRATEGIES[name]
    return search_with_seeds(driver, space, lambda seeded: entry.make(seeded, inputs), entry.independent, entry.seeded)
