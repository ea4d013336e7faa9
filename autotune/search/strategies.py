"""Search strategies as peers behind one interface: each proposes plans and is told their results (ask and tell).

A strategy only decides which plans to try next (:class:`Strategy`); the driver (:mod:`autotune.search.driver`)
owns the build budget, hands its plans to the harness (the real evaluator, a fake, the replay simulator), counts
the stalls and tells it what came back. A plan past the budget gets no result.

With several workers the driver asks for several plans at once, and the pool gives each to whichever worker comes
free. A strategy whose proposals depend on no result (``independent``) is asked for the plans of the whole
remaining budget, the uniform seeds at their head, so no worker waits for a round's slowest build.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from autotune.config.schema import RewardConfig
from autotune.extras import require
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.search.episode import decisions, plan_from_actions
from autotune.search.reward import meets_budget, reward
from autotune.search.space import SearchSpace


@runtime_checkable
class Strategy(Protocol):
    """What the driver asks of a search: plans to build, and what their builds gave.

    Attributes:
        independent: The proposals depend on no result: with several workers the driver asks for the plans of the
            whole remaining budget at once, behind the uniform seeds.
    """

    independent: bool

    def propose(self, n: int) -> list[Plan]:
        """About ``n`` plans to build next (a strategy in the middle of a step may give fewer); none: it is done."""
        ...

    def observe(self, results: list[TrialResult]) -> None:
        """The results of the plans last proposed, in completion order; a plan past the budget has none."""
        ...


@dataclass(frozen=True)
class Aim:
    """What a search aims at: the accuracy budget of its plans, the reward that ranks them, and its seed.

    Attributes:
        search_budget: The accuracy drop a searched plan may have (``TuneConfig.search_budget``).
        reward: How a result is scored.
        seed: Seeds the search's own randomness.
    """

    search_budget: float
    reward: RewardConfig
    seed: int = 0


Steps = Generator[list[Plan], list[TrialResult], None]
"""A strategy written as a sequence of rounds: it yields a round's plans and is sent back their results."""


class Stepwise:
    """A strategy from a generator of rounds (:data:`Steps`), for searches whose next round depends on the last.

    Each ``propose`` resumes the generator with the results observed since the last one; its end ends the search.
    """

    independent = False

    def __init__(self, steps: Steps):
        self._steps = steps
        self._results: list[TrialResult] | None = None  # None before the first round: a fresh generator is sent None

    def propose(self, n: int) -> list[Plan]:
        """See :meth:`Strategy.propose`."""
        try:
            plans = self._steps.send(self._results)  # type: ignore[arg-type]
        except StopIteration:
            return []
        self._results = []
        return plans

    def observe(self, results: list[TrialResult]) -> None:
        """See :meth:`Strategy.observe`."""
        self._results = list(results)


class Fixed:
    """One plan: every layer that allows ``precision`` takes it (the usual "build with INT8 enabled")."""

    independent = False

    def __init__(self, space: SearchSpace, precision: str):
        self._plan: Plan | None = space.uniform(precision)

    def propose(self, n: int) -> list[Plan]:
        """See :meth:`Strategy.propose`."""
        plans, self._plan = ([self._plan] if self._plan is not None else []), None
        return plans

    def observe(self, results: list[TrialResult]) -> None:
        """See :meth:`Strategy.observe`."""
        pass


class Random:
    """Uniformly random valid plans: each step picks uniformly among the options its mask allows.

    No proposal depends on a result, so with several workers the driver asks for a plan for every build left; a
    seed gives the same sequence of plans, and the same builds, with one worker as with several.
    """

    independent = True

    def __init__(self, space: SearchSpace, seed: int):
        self.space = space
        self._rng = np.random.default_rng(seed)
        self._steps = decisions(space)

    def propose(self, n: int) -> list[Plan]:
        """See :meth:`Strategy.propose`."""
        plans = []
        for _ in range(n):
            actions = [int(self._rng.integers(len(step.options))) for step in self._steps]
            plans.append(plan_from_actions(self.space, self._steps, actions))
        return plans

    def observe(self, results: list[TrialResult]) -> None:
        """See :meth:`Strategy.observe`."""
        pass


def _by_hash(results: list[TrialResult]) -> dict[str, TrialResult]:
    return {result.plan_hash: result for result in results}


def _sensitivities(space: SearchSpace, base: Plan, drop_all: float) -> Generator[list[Plan], list, list[list[str]]]:
    """Accuracy regained by reverting each decision group alone to FP32: the groups, most sensitive first."""
    names = [[space.layers[i].name for i in group] for group in space.groups]
    reverted = [Plan.make({**base.precision_map, **{n: "fp32" for n in group}}, base.knob_map) for group in names]
    results = _by_hash((yield reverted))
    scores = []
    for plan, group in zip(reverted, names, strict=True):
        result = results.get(plan.hash)
        if result is None:  # past the budget
            continue
        gain = drop_all - result.accuracy_drop if result.ok and result.accuracy_drop is not None else -math.inf
        scores.append((gain, group))
    scores.sort(key=lambda item: item[0], reverse=True)
    return [group for _, group in scores]


def _first_within_budget(
    base: Plan, order: list[list[str]], budget: float, workers: int
) -> Generator[list[Plan], list, tuple[Plan, TrialResult] | None]:
    """Reverts the groups in ``order`` one by one; the first plan that meets the budget, or None.

    Each plan adds one group to the previous one, so the next ``workers`` plans are known in advance and are
    built side by side; the first of them within the budget wins (the later ones are data for the store).
    """
    plans = []
    plan = base
    for names in order:
        plan = Plan.make({**plan.precision_map, **{n: "fp32" for n in names}}, plan.knob_map)
        plans.append(plan)
    for start in range(0, len(plans), workers):
        chunk = plans[start : start + workers]
        results = _by_hash((yield chunk))
        for candidate in chunk:
            result = results.get(candidate.hash)
            if result is not None and meets_budget(result, budget):
                return candidate, result
    return None


def greedy_steps(space: SearchSpace, aim: Aim, workers: int = 1) -> Steps:
    """The accuracy-first fallback of Polygraphy ``debug precision`` and Intel Neural Compressor, round by round.

    Start from all-INT8 (the narrowest precision each layer allows); measure each layer group's sensitivity as
    the accuracy regained when only it is reverted to FP32; revert the most sensitive groups one by one until the
    accuracy budget is met; then tune the knobs one at a time, keeping the value with the best reward. With
    several workers, each round's candidates (the sensitivities, the next reverts, a knob's values) are built
    side by side.
    """
    base = space.plan({layer.name: options[-1] for layer, options in zip(space.layers, space.choices, strict=True)})
    first = yield [base]
    if not first:
        return
    best_plan, best_result = base, first[0]
    if not meets_budget(best_result, aim.search_budget) and best_result.ok:
        order = yield from _sensitivities(space, base, best_result.accuracy_drop or 0.0)
        found = yield from _first_within_budget(base, order, aim.search_budget, workers)
        if found is not None:
            best_plan, best_result = found
    score = lambda result: reward(result, aim.reward, aim.search_budget)  # noqa: E731
    for knob in space.knobs:
        candidates = [best_plan.with_knobs(**{knob.name: value}) for value in knob.values]
        results = _by_hash((yield candidates))
        for candidate in candidates:  # in the knob's order, whatever order the builds ended in
            result = results.get(candidate.hash)
            if result is not None and score(result) > score(best_result):
                best_plan, best_result = candidate, result


class Greedy(Stepwise):
    """The greedy search (:func:`greedy_steps`) as a strategy."""

    def __init__(self, space: SearchSpace, aim: Aim, workers: int = 1):
        super().__init__(greedy_steps(space, aim, workers))


class Optuna:
    """Optuna's TPE through ask-and-tell: one categorical per decision, the accuracy budget as a constraint."""

    independent = False

    def __init__(self, space: SearchSpace, aim: Aim):
        optuna = require("optuna", "optuna", "the optuna strategy")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.aim = aim
        self._steps = decisions(space)
        self._study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=aim.seed))
        self._asked: dict[str, list] = {}  # plan hash -> the trials that proposed it (TPE may ask one plan twice)

    def propose(self, n: int) -> list[Plan]:
        """See :meth:`Strategy.propose`."""
        plans = []
        for _ in range(n):
            trial = self._study.ask()
            actions = []
            for index, step in enumerate(self._steps):
                labels = [str(option) for option in step.options]
                chosen = trial.suggest_categorical(f"{index:03d}_{step.kind}_{step.index}", labels)
                actions.append(labels.index(chosen))
            plan = plan_from_actions(self.space, self._steps, actions)
            self._asked.setdefault(plan.hash, []).append(trial)
            plans.append(plan)
        return plans

    def observe(self, results: list[TrialResult]) -> None:
        """See :meth:`Strategy.observe`."""
        for result in results:
            for trial in self._asked.pop(result.plan_hash, []):
                self._tell(trial, result)
        self._asked.clear()  # a plan past the budget is never told: its trial stays unfinished

    def _tell(self, trial: object, result: TrialResult) -> None:
        """Tells TPE a result; the accuracy budget is a constraint, feasible when <= 0."""
        if not result.ok:
            trial.set_constraint("accuracy_drop", 1.0)
            self._study.tell(trial, self.aim.reward.failure)
            return
        # Feasible when <= 0: TPE then prefers plans within the accuracy budget.
        trial.set_constraint("accuracy_drop", float(result.accuracy_drop - self.aim.search_budget))
        self._study.tell(trial, math.log(result.speedup))
