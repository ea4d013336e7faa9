"""Search strategies on one harness: each only decides which plan to try next.

Every strategy gets the same ``SearchContext`` (the evaluator behind ``evaluate``: same store, same measurement
protocol, same budget counted in builds). Store hits are free, so loops also stop after ``stall`` episodes in a
row that built nothing.

With several workers a strategy hands the pool several plans at once (``SearchContext.try_batch``), and the pool
gives each to whichever worker comes free. A search whose proposals depend on no result (``INDEPENDENT_SEARCHES``)
hands it the plans for the whole remaining budget, the uniform seeds at their head, so no worker waits for a
round's slowest build.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from autotune.config import TuneConfig
from autotune.extras import require
from autotune.plan import Plan
from autotune.search.episode import decisions, plan_from_actions
from autotune.search.reward import meets_budget, reward
from autotune.search.space import SearchSpace
from autotune.trial import TrialResult


@dataclass
class SearchContext:
    """What a strategy may use.

    Attributes:
        config: The run's config.
        space: The search space.
        evaluate: Plan to result (store first, then a build).
        builds: Builds spent so far.
        seed: Seed of the strategy's own randomness.
        stall: Episodes in a row without a new build after which a strategy gives up.
        evaluate_many: Plans and a build limit to results in completion order, built side by side (None: one
            at a time through ``evaluate``).
        workers: Builds that run at once; strategies propose at least this many plans per round.
        ahead: Plans to build before the strategy's own, in the same stream as its first plans (the uniform seeds
            of a run with several workers). Only the searches of ``INDEPENDENT_SEARCHES`` take them.
    """

    config: TuneConfig
    space: SearchSpace
    evaluate: Callable[[Plan], TrialResult]
    builds: Callable[[], int]
    seed: int = 0
    stall: int = 400
    evaluate_many: Callable[[list[Plan], int], Iterable[TrialResult]] | None = None
    workers: int = 1
    ahead: list[Plan] = field(default_factory=list)
    _stalled: int = field(default=0, init=False)

    @property
    def budget(self) -> int:
        """Builds allowed."""
        return self.config.budget.builds

    def exhausted(self) -> bool:
        """The budget is spent, or the strategy keeps proposing plans that were already measured."""
        return self.builds() >= self.budget or self._stalled >= self.stall

    @property
    def parallel(self) -> bool:
        """Plans handed over together are built side by side (several workers, and ``evaluate_many`` to use them)."""
        return self.evaluate_many is not None and self.workers > 1

    def try_plan(self, plan: Plan) -> TrialResult:
        """Evaluates a plan and keeps the stall count."""
        before = self.builds()
        result = self.evaluate(plan)
        self._stalled = self._stalled + 1 if self.builds() == before else 0
        return result

    def try_batch(self, plans: list[Plan]) -> list[TrialResult]:
        """Evaluates plans side by side, at most as many new builds as the budget has left, and keeps the stall count.

        With one worker, the plans are tried one by one while the budget lasts. Returns the results in the order
        they completed (store hits first); a plan past the budget has none. For the stall count, a plan given twice
        counts as a store hit the second time, as it would with one worker.
        """
        if not self.parallel:
            results = []
            for plan in plans:
                if self.exhausted():
                    break
                results.append(self.try_plan(plan))
            return results
        results = list(self.evaluate_many(plans, max(0, self.budget - self.builds())))
        evaluated = {result.plan_hash for result in results}
        self._stalled += sum(plan.hash in evaluated for plan in plans) - len(evaluated)  # the repeats, yielded once
        for result in results:
            self._stalled = self._stalled + 1 if result.from_store else 0
        return results

    def reward(self, result: TrialResult) -> float:
        """The configured reward of a result."""
        return reward(result, self.config.reward, self.config.search_budget)


def search_fixed(context: SearchContext, precision: str) -> None:
    """One plan: every layer that allows ``precision`` takes it (the usual "build with INT8 enabled")."""
    context.try_plan(context.space.uniform(precision))


def search_random(context: SearchContext) -> None:
    """Uniformly random valid plans: each step picks uniformly among the options its mask allows.

    With one worker the plans are tried one at a time. With several, no proposal depends on a result, so the plans
    for every build the budget has left go to the pool at once, behind ``context.ahead``, and each worker takes the
    next one as it comes free; only store hits and repeats, which spend no build, bring another batch. A batch
    holds no more plans than the builds left, so none is cut off by the build limit: a seed gives the same sequence
    of plans, and the same builds, with one worker as with several.
    """
    rng = np.random.default_rng(context.seed)
    steps = decisions(context.space)
    ahead = list(context.ahead)
    while not context.exhausted():
        count = max(0, context.budget - context.builds() - len(ahead)) if context.parallel else 1
        batch = ahead
        for _ in range(count):
            actions = [int(rng.integers(len(step.options))) for step in steps]
            batch.append(plan_from_actions(context.space, steps, actions))
        ahead = []
        context.try_batch(batch)


def _sensitivities(context: SearchContext, base: Plan, drop_all: float) -> list[tuple[float, list[str]]]:
    """Accuracy regained by reverting each decision group alone to FP32, most sensitive first."""
    space = context.space
    names = [[space.layers[i].name for i in group] for group in space.groups]
    reverted = [Plan.make({**base.precision_map, **{n: "fp32" for n in group}}, base.knob_map) for group in names]
    results = {result.plan_hash: result for result in context.try_batch(reverted)}
    scores = []
    for plan, group in zip(reverted, names, strict=True):
        result = results.get(plan.hash)
        if result is None:  # past the budget
            continue
        gain = drop_all - result.accuracy_drop if result.ok and result.accuracy_drop is not None else -math.inf
        scores.append((gain, group))
    scores.sort(key=lambda item: item[0], reverse=True)
    return scores


def _first_within_budget(context: SearchContext, base: Plan, order: list[list[str]]) -> tuple[Plan, TrialResult] | None:
    """Reverts the groups in ``order`` one by one; the first plan that meets the budget, or None.

    Each plan adds one group to the previous one, so the next ``workers`` plans are known in advance and are
    built side by side; the first of them within the budget wins (the later ones are data for the store).
    """
    plans = []
    plan = base
    for names in order:
        plan = Plan.make({**plan.precision_map, **{n: "fp32" for n in names}}, plan.knob_map)
        plans.append(plan)
    budget = context.config.search_budget
    for start in range(0, len(plans), context.workers):
        if context.exhausted():
            return None
        chunk = plans[start : start + context.workers]
        results = {result.plan_hash: result for result in context.try_batch(chunk)}
        for candidate in chunk:
            result = results.get(candidate.hash)
            if result is not None and meets_budget(result, budget):
                return candidate, result
    return None


def search_greedy(context: SearchContext) -> None:
    """The accuracy-first fallback of Polygraphy ``debug precision`` and Intel Neural Compressor.

    Start from all-INT8 (the narrowest precision each layer allows); measure each layer group's sensitivity as
    the accuracy regained when only it is reverted to FP32; revert the most sensitive groups one by one until the
    accuracy budget is met; then tune the knobs one at a time, keeping the value with the best reward. With
    several workers, each round's candidates (the sensitivities, the next reverts, a knob's values) are built
    side by side.
    """
    space = context.space
    base = space.plan({layer.name: options[-1] for layer, options in zip(space.layers, space.choices, strict=True)})
    best_result = context.try_plan(base)
    best_plan = base
    if not meets_budget(best_result, context.config.search_budget) and best_result.ok:
        order = [names for _, names in _sensitivities(context, base, best_result.accuracy_drop or 0.0)]
        if context.exhausted():
            return
        found = _first_within_budget(context, base, order)
        if context.exhausted():
            return
        if found is not None:
            best_plan, best_result = found
    for knob in space.knobs:
        if context.exhausted():
            return
        candidates = [best_plan.with_knobs(**{knob.name: value}) for value in knob.values]
        results = {result.plan_hash: result for result in context.try_batch(candidates)}
        for candidate in candidates:  # in the knob's order, whatever order the builds ended in
            result = results.get(candidate.hash)
            if result is not None and context.reward(result) > context.reward(best_result):
                best_plan, best_result = candidate, result


def search_optuna(context: SearchContext) -> None:
    """Optuna's TPE through ask-and-tell: one categorical per decision, the accuracy budget as a constraint."""
    optuna = require("optuna", "optuna", "the optuna strategy")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = context.space
    steps = decisions(space)
    sampler = optuna.samplers.TPESampler(seed=context.seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    while not context.exhausted():
        asked: dict[str, list] = {}  # plan hash -> the trials that proposed it (TPE may ask one plan twice)
        plans = []
        for _ in range(context.workers):
            trial = study.ask()
            actions = []
            for index, step in enumerate(steps):
                labels = [str(option) for option in step.options]
                chosen = trial.suggest_categorical(f"{index:03d}_{step.kind}_{step.index}", labels)
                actions.append(labels.index(chosen))
            plan = plan_from_actions(space, steps, actions)
            asked.setdefault(plan.hash, []).append(trial)
            plans.append(plan)
        for result in context.try_batch(plans):
            for trial in asked.pop(result.plan_hash, []):
                _tell(study, trial, result, context)


def _tell(study: object, trial: object, result: TrialResult, context: SearchContext) -> None:
    """Tells TPE a result; the accuracy budget is a constraint, feasible when <= 0."""
    if not result.ok:
        trial.set_constraint("accuracy_drop", 1.0)
        study.tell(trial, context.config.reward.failure)
        return
    # Feasible when <= 0: TPE then prefers plans within the accuracy budget.
    trial.set_constraint("accuracy_drop", float(result.accuracy_drop - context.config.search_budget))
    study.tell(trial, math.log(result.speedup))


INDEPENDENT_SEARCHES: frozenset[str] = frozenset({"random"})
"""The searches whose proposals depend on no result: with several workers they take the uniform seeds in their
first batch (``SearchContext.ahead``) instead of after a round of their own. The others use the seeds' results."""

SEARCHES: dict[str, Callable[[SearchContext], None]] = {
    "random": search_random,
    "greedy": search_greedy,
    "optuna": search_optuna,
}
"""The search strategies by name; each precision is a strategy too (``search_fixed``), and the agent lives above
them (``autotune.agent``): ``autotune.tune.STRATEGIES`` lists them all."""
