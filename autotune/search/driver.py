"""The one budget loop: strategies propose, the harness builds, the driver counts builds and stalls.

Below the driver is one harness protocol (:class:`Harness`): the real ``autotune.harness.Evaluator``, the fake of
``autotune.testing`` and the replay simulator of ``bench/research/replay.py`` all satisfy it, so a run can be driven
by any of them. Above it are the strategies (:mod:`autotune.search.strategies`, the agent's planner and policy), which
only decide which plans come next.

Store hits are free, so the loop also stops after ``budget.stall_episodes`` plans in a row that built nothing (fewer
in a space of few plans: :data:`STALLS_PER_PLAN`), and after ``budget.minutes`` of wall time where the config sets it.
The agent's policy runs its own loop (SB3's ``learn`` steps the env, whose last step builds) as a
:class:`SelfDriven` search: it builds through the same driver and stops when the driver says so.

Whoever watches the run (its monitor, the deadline that leaves the confirmation its time) is a
:class:`DriverCallback` the driver tells of every result as it lands, as SB3 tells its callbacks of every step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from autotune.config.schema import BudgetConfig
from autotune.plan import KnobValue, Plan
from autotune.run.trial import TrialResult
from autotune.search.space import SearchSpace
from autotune.search.strategies import Strategy


class Harness(Protocol):
    """What the driver builds on: the store first, then a build; ``builds`` counts the builds (store hits free)."""

    @property
    def builds(self) -> int:
        """Builds spent so far (store hits excluded)."""
        ...

    @property
    def workers(self) -> int:
        """Builds that run at once."""
        ...

    def evaluate_many(self, plans: Sequence[Plan], limit: int | None = None) -> Iterable[TrialResult]:
        """Results of the plans (a plan given twice once), store hits first, at most ``limit`` new builds."""
        ...


class DriverCallback(Protocol):
    """Told of every result the driver's builds bring, as it lands (store hits too), before the driver counts it."""

    def on_result(self, result: TrialResult, driver: Driver) -> None:
        """One result of ``driver``'s current :meth:`Driver.build`."""
        ...


@runtime_checkable
class SelfDriven(Protocol):
    """A search that runs its own loop (the agent: SB3's ``learn`` steps the env, whose last step builds a plan).

    Every plan it builds goes through :meth:`Driver.build`, and it stops when :meth:`Driver.exhausted` says so: the
    driver alone counts the builds, the stalls and the minutes.
    """

    def drive(self, driver: Driver) -> None:
        """Searches until ``driver`` is exhausted (or the search has nothing more to propose)."""
        ...


STALLS_PER_PLAN = 4
"""Store hits in a row, per distinct plan of the space, after which a search of a small space ends: nothing is left
to measure there (a model with one tunable layer drew 3,491 store hits in 22 builds before its budget ran out)."""


class OneByOne:
    """A :class:`Harness` over a plain ``evaluate(plan)`` and a build count: one build at a time.

    For the simulator and tests, whose ``evaluate`` answers repeats itself; a plan is evaluated only while the
    builds it started with plus ``limit`` are not reached, and a result that spent no build is a store hit.
    """

    workers = 1

    def __init__(self, evaluate: Callable[[Plan], TrialResult], builds: Callable[[], int]):
        self._evaluate = evaluate
        self._builds = builds

    @property
    def builds(self) -> int:
        """Builds spent so far (store hits excluded)."""
        return self._builds()

    def evaluate_many(self, plans: Sequence[Plan], limit: int | None = None) -> Iterable[TrialResult]:
        """See :meth:`Harness.evaluate_many`."""
        stop = None if limit is None else self._builds() + limit
        for plan in dict((plan.hash, plan) for plan in plans).values():
            before = self._builds()
            if stop is not None and before >= stop:
                return
            result = self._evaluate(plan)
            # An answer that cost no build is a store hit, whatever ``evaluate`` says: the stall rule counts it.
            yield (
                result if self._builds() > before or result.from_store else dataclasses.replace(result, from_store=True)
            )


class Driver:
    """Owns the build budget and the stall rule; every plan of a run is built through :meth:`build`.

    Args:
        harness: Where plans are built.
        budget: Builds allowed (``budget.builds``).
        stall: Plans in a row answered from the store after which the loop gives up (``budget.stall_episodes``).
        seconds: Wall time from the driver's creation after which no build starts (``budget.minutes``); None: none.
        clock: Where the time comes from (``time.monotonic``; a test passes its own).
        plans: Distinct plans of the search space, where known: the stall rule gives up after
            ``STALLS_PER_PLAN`` store hits in a row per plan when that is sooner.
        callbacks: Told of every result as it lands (:class:`DriverCallback`), in this order.

    Attributes:
        build_s: Wall seconds spent in builds so far (store hits included), which the agent's compute is paced by.
    """

    def __init__(
        self,
        harness: Harness,
        budget: int,
        stall: int,
        seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        plans: int | None = None,
        callbacks: Sequence[DriverCallback] = (),
    ):
        self.harness = harness
        self.callbacks = list(callbacks)
        self.budget = budget
        self.stall = stall if plans is None else max(1, min(stall, STALLS_PER_PLAN * plans))
        self.stalled = 0
        self.clock = clock
        self.deadline = None if seconds is None else clock() + seconds
        self.build_s = 0.0

    @classmethod
    def for_budget(
        cls,
        harness: Harness,
        budget: BudgetConfig,
        space: SearchSpace | None = None,
        clock: Callable[[], float] = time.monotonic,
        callbacks: Sequence[DriverCallback] = (),
    ) -> Driver:
        """A driver with the builds, stall rule and time limit of ``budget``, its stalls sized to ``space``."""
        seconds = None if budget.minutes is None else 60 * budget.minutes
        plans = None if space is None else space.size
        return cls(harness, budget.builds, budget.stall_episodes, seconds, clock, plans, callbacks)

    @property
    def out_of_time(self) -> bool:
        """The wall time of ``budget.minutes`` has passed."""
        return self.deadline is not None and self.clock() >= self.deadline

    @property
    def builds(self) -> int:
        """Builds spent so far (store hits excluded)."""
        return self.harness.builds

    @property
    def workers(self) -> int:
        """Builds that run at once."""
        return self.harness.workers

    @property
    def left(self) -> int:
        """Builds the budget has left: none once the time limit has passed."""
        return 0 if self.out_of_time else max(0, self.budget - self.harness.builds)

    def exhausted(self) -> bool:
        """The budget or its time is spent, or the plans of the last ``stall`` tries were all measured already."""
        return self.left == 0 or self.stalled >= self.stall

    def build(self, plans: list[Plan]) -> list[TrialResult]:
        """Builds plans side by side, at most as many new builds as the budget has left, and keeps the stall count.

        Returns the results in the order they completed (store hits first); a plan past the budget has none. A plan
        given twice counts as a store hit the second time, as it would one at a time. Each result is handed to the
        callbacks as it lands, while the other builds still run. Once the time limit has passed (a callback may
        move it: the confirmation's time), the batch's other plans are not built.
        """
        if not plans or self.left == 0:
            return []
        started = self.clock()
        results: list[TrialResult] = []
        landing = iter(self.harness.evaluate_many(plans, self.left))
        try:
            for result in landing:
                for callback in self.callbacks:
                    callback.on_result(result, self)
                results.append(result)
                if self.out_of_time:
                    break
        finally:
            close = getattr(landing, "close", None)
            if close is not None:  # the builds not read yet are abandoned (Evaluator.evaluate_many)
                close()
            self.build_s += self.clock() - started
        evaluated = {result.plan_hash for result in results}
        self.stalled += sum(plan.hash in evaluated for plan in plans) - len(evaluated)  # the repeats, yielded once
        for result in results:
            self.stalled = self.stalled + 1 if result.from_store else 0
        return results

    def run(self, strategy: Strategy | SelfDriven, ahead: Sequence[Plan] = ()) -> None:
        """The budget loop: the strategy's proposals built and told back, until the budget or the stalls end it.

        Args:
            strategy: What proposes the plans; the loop ends early when it proposes none. A :class:`SelfDriven`
                search runs its own loop on this driver.
            ahead: Plans built at the head of the first batch (the uniform seeds of an independent strategy).
        """
        if isinstance(strategy, SelfDriven):
            self.build(list(ahead))
            strategy.drive(self)
            return
        ahead = list(ahead)
        while not self.exhausted():
            wanted = max(0, self.left - len(ahead)) if strategy.independent and self.workers > 1 else self.workers
            plans = [*ahead, *strategy.propose(wanted)] if wanted else list(ahead)
            ahead = []
            if not plans:
                return
            strategy.observe(self.build(plans))


SEED_PRECISIONS = ("int8", "int8-dynamic", "fp8", "fp16", "bf16")
"""The lower precisions a uniform seed is built in, in this order, where some layer of the space offers them."""


def uniform_seeds(space: SearchSpace) -> list[str]:
    """The lower precisions some layer of the space offers, INT8 first: each becomes one all-that-precision trial."""
    return [p for p in SEED_PRECISIONS if any(p in choices for choices in space.choices)]


def uniform_seed_rounds(space: SearchSpace) -> tuple[list[Plan], list[str]]:
    """The whole-model float seeds to build first, and the quantized precisions to seed on the faster one's base.

    Where a knob follows the precision (the torch and TensorRT backends' ``base_precision``), the all-FP16 and
    all-BF16 seeds run the whole model in that type, and an all-INT8 or all-FP8 seed on the default FP32 base
    measures its GEMMs where the FP32 rest of the model sets the latency: on a GPU all-FP8 on an FP32 base can run
    slower than all-FP16 while on a BF16 base it is the faster
    (docs/benchmarks.md#what-pays-on-the-h200-gemms-and-attention). So the quantized seeds are built on the faster
    float seed's base, the base a user would deploy them on. Without such a knob every seed is built in one round.
    """
    precisions = uniform_seeds(space)
    bases = [knob for knob in space.knobs if knob.follows_precision]
    floats = [p for p in precisions if p in ("fp16", "bf16") and any(p in knob.values for knob in bases)]
    if not floats:
        return [space.uniform(p) for p in precisions], []
    return [space.uniform(p) for p in floats], [p for p in precisions if p not in floats]


FREE_KNOB_MARGIN = 0.01
"""How much faster (relative speedup) another value of a free knob must measure than the seed's to replace it:
within it the two are a tie, and the seed's value (the users' default) stays."""


def fix_free_knobs(
    space: SearchSpace, seed: TrialResult, build: Callable[[list[Plan]], list[TrialResult]]
) -> dict[str, KnobValue]:
    """Measures each free knob's other values on ``seed`` and returns the fastest value of each knob measured.

    Free knobs (``Knob.free``) change the outputs at rounding level only, so one measurement on one plan says which
    value is fastest for every plan: one knob at a time, each other value is built on the best plan so far and
    replaces the current one only when it is faster by more than ``FREE_KNOB_MARGIN``. A knob whose builds did not
    all fit the build budget is left out (it stays searched); a value whose build failed is not chosen.

    Args:
        space: The search space.
        seed: The fastest uniform seed's result.
        build: Plans to their results (fewer when the budget runs out): ``Driver.build``.

    Returns:
        Knob name to its fixed value, for ``SearchSpace.with_fixed_knobs``.
    """
    best, fixed = seed, {}
    for knob in space.free_knobs:
        current = best.plan.knob(knob.name, knob.default)
        others = [best.plan.with_knobs(**{knob.name: value}) for value in knob.values if value != current]
        results = build(others)
        if len(results) < len(others):
            break  # the budget ran out: this knob and the rest stay in the search
        for result in results:
            if result.ok and result.speedup and result.speedup > (best.speedup or 0.0) * (1 + FREE_KNOB_MARGIN):
                best = result
        fixed[knob.name] = best.plan.knob(knob.name, knob.default)
    return fixed


def time_seeded_knobs(
    space: SearchSpace, seeds: Sequence[TrialResult], build: Callable[[list[Plan]], list[TrialResult]]
) -> list[TrialResult]:
    """Builds the fastest seed with INT8 layers once with each other value of every seeded knob (``Knob.seeded``).

    ONNX Runtime's ``int8_scheme`` (where more than one scheme is exact on this CPU): each scheme's all-INT8 speed
    and drop measured side by side early, so the model of the trials knows what each scheme saves and costs
    before it weighs a frame per scheme (``autotune.search.design.model_frames``). The knob stays searched.

    Args:
        space: The search space.
        seeds: The uniform seeds' results.
        build: Plans to their results (fewer when the budget runs out): ``Driver.build``.

    Returns:
        The results of the plans built (none without a seeded knob or a successful INT8 seed).
    """
    int8 = [r for r in seeds if r.ok and r.speedup and any(p == "int8" for _, p in r.plan.precisions)]
    seeded = [knob for knob in space.knobs if knob.seeded and len(knob.values) > 1]
    if not int8 or not seeded:
        return []
    fastest = max(int8, key=lambda r: r.speedup or 0.0).plan
    plans = [
        fastest.with_knobs(**{knob.name: value})
        for knob in seeded
        for value in knob.values
        if value != fastest.knob(knob.name, knob.default)
    ]
    return build(plans)


def build_uniform_seeds(driver: Driver, space: SearchSpace) -> dict[str, KnobValue]:
    """Builds the uniform plans of ``uniform_seeds`` within the budget, side by side with several workers.

    Between the float seeds and the quantized ones, the free knobs are measured on the fastest float seed and
    fixed (``fix_free_knobs``); the quantized seeds are built with the fixed values. Then the fastest INT8 seed
    is built with each value of the seeded knobs (``time_seeded_knobs``).

    Returns:
        The free knobs fixed, name to value (empty when the space has none or the budget ran out first).
    """
    first, quantized = uniform_seed_rounds(space)
    built = driver.build(first)
    measured = [r for r in built if r.ok and r.speedup]
    fastest = max(measured, key=lambda r: r.speedup) if measured else None
    fixed = fix_free_knobs(space, fastest, driver.build) if fastest is not None else {}
    following = {
        knob.name: fastest.plan.knob(knob.name)
        for knob in space.knobs
        if fastest is not None and knob.follows_precision and fastest.plan.knob(knob.name) is not None
    }
    built += driver.build([space.uniform(precision, {**following, **fixed}) for precision in quantized])
    time_seeded_knobs(space, built, driver.build)
    return fixed


def seeded_space(driver: Driver, space: SearchSpace) -> tuple[SearchSpace, dict[str, KnobValue]]:
    """Builds the uniform seeds in rounds of their own; the space with the free knobs they fixed, and those knobs."""
    fixed = build_uniform_seeds(driver, space)
    driver.stalled = 0  # seeds a resumed run finds in its store say nothing about the search
    return space.with_fixed_knobs(fixed), fixed


def seeds_ahead(space: SearchSpace, independent: bool, workers: int) -> list[Plan]:
    """The uniform seeds that head the search's first batch instead of being built in rounds of their own.

    Only with several workers and an independent strategy (its proposals depend on no result): the workers then
    take the seeds and the first searched plans in one stream, where a round of seeds alone would leave all but a
    few of them idle (one all-INT8 plan on the ONNX Runtime CPU backend). None with one worker (the seeds are built
    first, then the search, as always), for the strategies that use the seeds' results, or where the quantized
    seeds wait for the float seeds' results (``uniform_seed_rounds``), nor where free knobs wait for them
    (``fix_free_knobs``).
    """
    if workers <= 1 or not independent or space.free_knobs or any(k.seeded and len(k.values) > 1 for k in space.knobs):
        return []
    first, quantized = uniform_seed_rounds(space)
    return first if not quantized else []


def search_with_seeds(
    driver: Driver,
    space: SearchSpace,
    make_strategy: Callable[[SearchSpace], Strategy | SelfDriven],
    independent: bool = False,
    seeded: bool = True,
) -> dict[str, KnobValue]:
    """The uniform seeds (``uniform_seeds``), then the strategy's plans, until the build budget is spent.

    The usual "build with INT8 enabled" (and, where the backend has them, all-FP8/FP16/BF16) are the first trials
    of every search: the references a user compares against, and data points for the per-layer estimates. They are
    built in rounds of their own before the search, or, where ``seeds_ahead`` says so, at the head of its first
    batch. The free knobs the seeds fixed (``fix_free_knobs``) are fixed for the search: the strategy is made on a
    space where they have their one value.

    Args:
        driver: The run's driver.
        space: The search space.
        make_strategy: The strategy, made on the space the seeds leave.
        independent: The strategy's proposals depend on no result (``Strategy.independent``).
        seeded: False for a strategy that is one uniform plan itself (a precision): no seed.

    Returns:
        The free knobs fixed, name to value.
    """
    fixed: dict[str, KnobValue] = {}
    ahead = seeds_ahead(space, independent, driver.workers) if seeded else []
    if seeded and not ahead:
        space, fixed = seeded_space(driver, space)
    if not driver.exhausted():
        driver.run(make_strategy(space), ahead)
    return fixed
