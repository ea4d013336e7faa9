"""The surrogate planner: the plans the additive model of the trials proposes, a strategy of its own.

Its rounds: the opening (with priors), the probes (:mod:`autotune.search.design`), then planning steps (the model's
best unmeasured plans and one bold plan), then the neighbours of the model's best plan. The agent
(:mod:`autotune.search.agent`) builds its planning steps between the PPO policy's rollouts; alone, it is the ``planner``
strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from autotune.config.schema import PlanningRule
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, Plan
from autotune.run.trial import TrialResult
from autotune.search.design import model_best_plan, probe_plans
from autotune.search.episode import neighbours
from autotune.search.estimate import Surrogate
from autotune.search.prior import LayerPrior, unsure_groups
from autotune.search.reward import meets_budget
from autotune.search.space import SearchSpace
from autotune.search.strategies import Steps, Stepwise

OPENING_MODEL_PLANS = 3
"""With priors, the model's best plan is built first, again after each miss of the search budget, up to this many."""


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


class Planner:
    """The surrogate planner: the plans the additive model of the trials proposes (``planner:`` in the config).

    Its rounds, each built by the driver: the opening (the model's best plan from the priors, again after each miss
    of the search budget), the probes (an orthogonal design), then planning steps (the model's best unmeasured
    plans and one bold plan); once the model offers no plan not built yet, the neighbours of its best plan. As a
    :class:`~autotune.search.strategies.Strategy` it is the planner alone; the agent interleaves its planning
    steps with the PPO policy's rollouts.

    Args:
        rule: The planner's settings, seed and budgets (``TuneConfig.planning``).
        space: The search space.
        surrogate: The additive model of the trials so far (None while too few).
        measured: Hashes of the plans measured so far.
        prior: The per-layer priors (None without).
        workers: Builds that run at once: each planning step builds ``workers * planner.model_plans`` plans.
    """

    independent = False

    def __init__(
        self,
        rule: PlanningRule,
        space: SearchSpace,
        surrogate: Callable[[], Surrogate | None],
        measured: Callable[[], Collection[str]] | None,
        prior: Callable[[], LayerPrior | None] | None = None,
        workers: int = 1,
    ):
        self.rule = rule
        self.space = space
        self.surrogate = surrogate
        self.measured: Callable[[], Collection[str]] = measured or (lambda: ())
        self._knows_measured = measured is not None
        self.prior = prior
        self.workers = workers
        self._rounds = Stepwise(self._all_rounds())

    def propose(self, n: int) -> list[Plan]:
        """See :meth:`Strategy.propose`."""
        return self._rounds.propose(n)

    def observe(self, results: list[TrialResult]) -> None:
        """See :meth:`Strategy.observe`."""
        self._rounds.observe(results)

    def _all_rounds(self) -> Steps:
        yield from self.opening()
        if self.rule.planner.probe_plans:
            yield self.probes()
        while True:
            model, seed = self.surrogate(), self.rule.seed + len(self.measured())
            known = set(self.measured())
            plans = self.planning_step(model, seed) if model is not None else []
            plans = [p for p in plans if p.hash not in known] or self.unbuilt(model, self.workers, seed)
            if not plans:
                return
            yield plans

    def opening(self) -> Steps:
        """The model's best plan from the priors, again after each miss of the search budget (with priors only).

        Each build corrects the model (the drop scale and the terms of the plan's layers), so a miss by a layer's
        worth is usually fixed by the next plan; at most :data:`OPENING_MODEL_PLANS` builds.
        """
        if self.prior is None or self.prior() is None or not self.rule.planner.build_model_plan:
            return
        for opening in range(OPENING_MODEL_PLANS):
            model = self.surrogate()
            if model is None:
                return
            plan = model_best_plan(
                model, self.space, self.rule.search_budget, seed=self.rule.seed + opening, exclude=self.measured()
            )
            results = yield [plan]
            if not results or (results[0].ok and meets_budget(results[0], self.rule.search_budget)):
                return

    def probes(self) -> list[Plan]:
        """The probe plans: the whole design without a prior; with one, only over the groups it leaves open.

        With a prior, a store that already holds as many plans as the design has rows (an earlier run's imported
        trials) needs no probe: the model of those trials is what the probes would give.
        """
        rule, space = self.rule, self.space
        prior = self.prior() if self.prior is not None else None
        if prior is None:
            return probe_plans(space, rule.builds // 3)
        drop = prior.drop(*_default_setting(space))
        open_groups = unsure_groups(space.groups, drop, rule.search_budget)
        cheap = (
            []
            if drop is None
            else [g for g, group in enumerate(space.groups) if drop[list(group)].sum() <= rule.search_budget]
        )
        plans = probe_plans(space, rule.builds // 6, varied=open_groups, lowered_always=cheap)
        known = self.measured()
        if len(known) > len(plans) + 1:  # the all-INT8 plan and more: an earlier run's trials stand in for probes
            return [plan for plan in plans if plan.hash in known]
        return plans

    def planning_step(self, model: Surrogate, seed: int) -> list[Plan]:
        """Dyna's planning step: the model's best unmeasured plans within the search budget, and one bold plan.

        A wrong model is corrected by its own results, and the store answers a repeat for free. The bold plan is a
        bet for the confirmation: greedy's winners sit past the search budget, where held-out data may still find
        a plan within the accuracy budget; the plans aimed below it never go there.
        """
        rule = self.rule
        known = self.measured()
        count = self.workers * rule.planner.model_plans
        plans = _model_plans(model, self.space, rule.search_budget, count, seed, known)
        if rule.bold_budget > rule.search_budget:
            taken = {*known, *(plan.hash for plan in plans)}
            bold = model_best_plan(model, self.space, rule.bold_budget, seed=seed, exclude=taken)
            plans += [] if bold.hash in taken else [bold]
        return plans

    def unbuilt(self, model: Surrogate | None, count: int, seed: int) -> list[Plan]:
        """Up to ``count`` plans not measured yet: the model's best, else the neighbours of its best plan.

        Without a model of the trials (or the hashes measured) there is nothing to go on: none.
        """
        if model is None or not self._knows_measured:
            return []
        known = set(self.measured())
        budget = self.rule.search_budget
        plans = [p for p in _model_plans(model, self.space, budget, count, seed, known) if p.hash not in known]
        if plans:
            return plans
        best = model_best_plan(model, self.space, budget, seed=seed)
        return neighbours(self.space, best, known, seed=seed)[:count]


def _default_setting(space: SearchSpace) -> tuple[object, object]:
    """The default calibration method and weight granularity of the space (None where it has no such knob)."""
    defaults = {knob.name: knob.default for knob in space.knobs}
    return defaults.get(CALIBRATION_KNOB), defaults.get(GRANULARITY_KNOB)
