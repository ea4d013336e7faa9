"""The agent's first plans: an orthogonal design that tells every layer's saving and drop apart. Pure.

Per-layer latency savings and accuracy drops are close to additive, so the additive model the agent rehearses on
(:mod:`autotune.search.estimate`) is only as good as the plans it is fitted from. A handful of random plans leaves
it underdetermined: ridge spreads their drop over every layer, every layer looks equally risky, and the policy
backs away from INT8 everywhere before the real builds say which layers are to blame. The rows of a normalised
Hadamard matrix fix that at the cost of one build per row: every layer is quantized in exactly half of the plans
and every pair of layers is balanced against each other, so a least-squares fit separates every layer's term,
with the smallest variance any design of that many plans can give.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, KnobValue, Plan
from autotune.search.estimate import MAX_SAVING, Surrogate
from autotune.search.space import SearchSpace


def _is_prime(number: int) -> bool:
    return number >= 2 and all(number % d for d in range(2, int(number**0.5) + 1))


def _paley(prime: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order ``prime + 1`` for a prime congruent to 3 mod 4."""
    residues = {(k * k) % prime for k in range(1, prime)}
    character = np.array([0] + [1 if k in residues else -1 for k in range(1, prime)])
    jacobsthal = np.array([[character[(j - i) % prime] for j in range(prime)] for i in range(prime)])
    skew = np.zeros((prime + 1, prime + 1), dtype=int)
    skew[0, 1:] = 1
    skew[1:, 0] = -1
    skew[1:, 1:] = jacobsthal
    return np.eye(prime + 1, dtype=int) + skew


def hadamard(order: int) -> np.ndarray | None:
    """A normalised Hadamard matrix (first row and column all +1) of ``order``, or None if none is built here.

    Orders built: powers of two (Sylvester) and ``2**k * (p + 1)`` for primes ``p = 3 (mod 4)`` (Paley I,
    doubled): 1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 44, 48, 60, 64, ... (:func:`design_order` takes the next one up).
    """
    doublings = 0
    core_order = order
    while core_order % 2 == 0 and core_order > 1:
        if core_order % 4 == 0 and _is_prime(core_order - 1) and (core_order - 1) % 4 == 3:
            break
        core_order //= 2
        doublings += 1
    if core_order == 1:
        matrix = np.ones((1, 1), dtype=int)
    elif core_order > 2 and _is_prime(core_order - 1) and (core_order - 1) % 4 == 3:
        matrix = _paley(core_order - 1)
    else:
        return None
    for _ in range(doublings):
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix = matrix * matrix[:, :1]  # rows scaled so the first column is all +1
    return matrix * matrix[:1, :]  # and columns so the first row is too


def design_order(factors: int) -> int:
    """The smallest order of :func:`hadamard` with room for ``factors`` columns besides the all-ones one."""
    order = 1
    while order < factors + 1 or hadamard(order) is None:
        order += 1
    return order


def lowered_precisions(space: SearchSpace) -> list[str]:
    """Per decision group, the precision it takes when it leaves FP32.

    INT8 where all its layers allow it, otherwise its first precision other than FP32.
    """
    lowered = []
    for group in space.groups:
        options = [p for p in space.group_choices(group) if p != "fp32"]
        lowered.append("int8" if "int8" in options else options[0])
    return lowered


@dataclass(frozen=True)
class Frame:
    """What a model plan is made of: the precisions its groups keep, the ones each may be lowered to, its knobs.

    Attributes:
        kept: Per layer, the precision it keeps when its group is not lowered (absent: FP32).
        lowered: Per decision group, the precisions it may take when lowered (empty: never lowered).
        knobs: The plan's knob values (absent: the default).
    """

    kept: Mapping[str, str]
    lowered: Sequence[tuple[str, ...]]
    knobs: Mapping[str, KnobValue]

    def plan(self, space: SearchSpace, chosen: Mapping[int, str]) -> Plan:
        """The plan that lowers each group in ``chosen`` to its precision there and keeps the rest."""
        lowered = {space.layer_names[i]: precision for g, precision in chosen.items() for i in space.groups[g]}
        return space.plan({**self.kept, **lowered}, self.knobs)


def _seeded_settings(space: SearchSpace) -> list[dict[str, KnobValue]]:
    """Every combination of the values of the space's seeded knobs (``Knob.seeded``): one frame each."""
    settings: list[dict[str, KnobValue]] = [{}]
    for knob in space.knobs:
        if knob.seeded and len(knob.values) > 1:
            settings = [{**setting, knob.name: value} for setting in settings for value in knob.values]
    return settings


def model_frames(model: Surrogate, space: SearchSpace, budget: float) -> list[Frame]:
    """The frames a model plan is searched in.

    Without a knob that follows the precision (ONNX Runtime): FP32 kept, every group lowered to any precision
    it offers besides FP32 (``int8``, ``int8-dynamic``), one frame per value of the seeded knobs (the INT8
    scheme: each scheme's plans with that scheme's drops, so the fastest scheme within the budget wins), knobs
    at their defaults otherwise. With one (``base_precision`` of the torch and TensorRT
    backends) a plan is a base for the whole model with per-layer overrides, and the fastest plan is rarely FP32
    plus INT8: on a GPU all-INT8 can run slower than all-BF16 and all-FP8 faster, and SDPA attention faster than
    eager (docs/benchmarks.md#what-pays-on-the-h200-gemms-and-attention). So the model chooses the frame too: each
    knob that changes no numbers (not calibration or weight granularity) takes the value it rates fastest, the
    base the whole-model float plan it rates fastest within ``budget``, and there is one frame per precision the
    groups may be lowered to.

    Args:
        model: The model of the trials (``predict(plan) -> (speedup, drop)``).
        space: The search space.
        budget: The largest predicted accuracy drop allowed.
    """
    follows = [knob for knob in space.knobs if knob.follows_precision]
    if not follows:
        lowered = [tuple(p for p in space.group_choices(group) if p != "fp32") for group in space.groups]
        return [Frame({}, lowered, setting) for setting in _seeded_settings(space)]
    knobs: dict[str, KnobValue] = {}
    for knob in space.knobs:
        if knob.follows_precision or knob.name in (CALIBRATION_KNOB, GRANULARITY_KNOB) or len(knob.values) < 2:
            continue
        rated = [(model.predict(space.plan({}, {**knobs, knob.name: value})), value) for value in knob.values]
        knobs[knob.name] = max(rated, key=lambda item: item[0][0] if item[0][1] <= budget else 0.0)[1]
    floats = [value for value in follows[0].values if isinstance(value, str)]
    bases = [space.uniform(value, knobs) for value in floats]
    base = max(bases, key=lambda plan: _within(model.predict(plan), budget))
    kept = {name: precision for name, precision in base.precisions if precision != "fp32"}
    offered = {p for group in space.groups for p in space.group_choices(group)} - {"fp32", base.knob(follows[0].name)}
    frames = []
    for precision in [p for p in ("int8", "fp8", "fp16", "bf16") if p in offered]:
        lowered = [(precision,) if precision in space.group_choices(group) else () for group in space.groups]
        frames.append(Frame(kept, lowered, base.knob_map))
    return frames or [Frame(kept, [()] * len(space.groups), base.knob_map)]


def _within(predicted: tuple[float, float], budget: float) -> float:
    """The predicted speedup where the predicted drop fits ``budget``, else 0."""
    return predicted[0] if predicted[1] <= budget else 0.0


def model_best_plan(
    model: Surrogate,
    space: SearchSpace,
    budget: float,
    seed: int = 0,
    iterations: int = 300,
    exclude: Collection[str] = (),
) -> Plan:
    """The plan the model of the trials rates fastest within ``budget``.

    A randomised local search over the decision groups in each of :func:`model_frames`: every iteration takes
    the best plan so far, returns one to three of its lowered groups to the frame's kept precision, and lowers
    the others greedily in random order while the predicted drop stays within ``budget``.

    Args:
        model: The model of the trials so far (``predict(plan) -> (speedup, drop)``, as :class:`Surrogate`).
        space: The search space.
        budget: The largest predicted accuracy drop allowed.
        seed: Seeds the search.
        iterations: Search steps per frame.
        exclude: Hashes of plans already measured: the best plan not among them is returned, when the search
            meets one. Their results are known, so building the model's best guess among them teaches nothing;
            without this, a converged model proposes the same measured plan every time and builds stall.

    Returns:
        The best plan found outside ``exclude``, else the best plan found (a frame's plan with nothing lowered
        when nothing fits: FP32 without a base precision knob).
    """
    rng = np.random.default_rng(seed)
    best_overall: tuple[float, Plan] | None = None
    fresh: tuple[float, Plan] | None = None  # the best plan seen outside ``exclude``
    for frame in model_frames(model, space, budget):
        effects = _Effects.read(model, space, frame)
        best: dict[int, str] = {}
        best_speedup = effects.speedup
        for _ in range(iterations if effects.groups else 0):
            chosen = _neighbour(best, effects, budget, rng)
            speedup = effects.speedup_of(chosen)
            if speedup > best_speedup:
                best_speedup, best = speedup, chosen
            if fresh is None or speedup > fresh[0]:
                plan = frame.plan(space, chosen)
                if plan.hash not in exclude:
                    fresh = (speedup, plan)
        plan = frame.plan(space, best)
        if _within(model.predict(plan), budget) and (best_overall is None or best_speedup > best_overall[0]):
            best_overall = (best_speedup, plan)
    if fresh is not None:
        return fresh[1]
    return best_overall[1] if best_overall is not None else space.uniform("fp32")


@dataclass(frozen=True)
class _Effects:
    """What the model predicts for one frame: its plan with nothing lowered, and what lowering each group adds.

    The model is additive, so each group's effect is read once and the search adds them up: calling the model
    for every candidate took 30 s per plan on a 48-layer space with three frames.

    Attributes:
        speedup: The predicted speedup of the frame's plan with nothing lowered.
        saving: Its time saving, ``1 - 1 / speedup``.
        drop: Its predicted accuracy drop.
        groups: Per lowerable group, in group order, per precision it may take: the saving and the drop that
            lowering it to that precision adds.
    """

    speedup: float
    saving: float
    drop: float
    groups: dict[int, dict[str, tuple[float, float]]]

    @classmethod
    def read(cls, model: Surrogate, space: SearchSpace, frame: Frame) -> _Effects:
        """Asks ``model`` for the frame's plan and for it with each lowerable group lowered alone, per precision."""
        speedup, drop = model.predict(frame.plan(space, {}))
        saving = 1.0 - 1.0 / speedup
        groups: dict[int, dict[str, tuple[float, float]]] = {}
        for group, precisions in enumerate(frame.lowered):
            for precision in precisions:
                group_speedup, group_drop = model.predict(frame.plan(space, {group: precision}))
                groups.setdefault(group, {})[precision] = (1.0 - 1.0 / group_speedup - saving, group_drop - drop)
        return cls(speedup, saving, drop, groups)

    def speedup_of(self, chosen: Mapping[int, str]) -> float:
        """The predicted speedup with the groups in ``chosen`` lowered (the saving capped at ``MAX_SAVING``)."""
        saving = self.saving + sum(self.groups[g][p][0] for g, p in chosen.items())
        return 1.0 / (1.0 - min(saving, MAX_SAVING))


def _neighbour(best: Mapping[int, str], effects: _Effects, budget: float, rng: np.random.Generator) -> dict[int, str]:
    """One step of the local search: one to three of ``best``'s groups returned, then others lowered greedily.

    The groups not chosen are tried in random order, each lowered to the precision that saves the most among
    those whose drop still fits ``budget``.
    """
    chosen = dict(best)
    if chosen:
        dropped = rng.choice(sorted(chosen), size=min(len(chosen), int(rng.integers(1, 4))), replace=False)
        for group in dropped.tolist():
            del chosen[group]
    drop = effects.drop + sum(effects.groups[g][p][1] for g, p in chosen.items())
    for group in rng.permutation(list(effects.groups)).tolist():
        if group in chosen:
            continue
        fitting = [(saving, p) for p, (saving, d) in effects.groups[group].items() if drop + d <= budget]
        if fitting:
            precision = max(fitting)[1]
            chosen[group] = precision
            drop += effects.groups[group][precision][1]
    return chosen


def probe_plans(
    space: SearchSpace, max_plans: int, varied: Sequence[int] | None = None, lowered_always: Collection[int] = ()
) -> list[Plan]:
    """The first rows of an orthogonal design over the space's decision groups, as plans.

    Row ``r`` quantizes group ``g`` where the design says +1 (the first row quantizes every group: the all-INT8
    plan every search starts from anyway). A group takes INT8 where all its layers allow it, otherwise its first
    precision other than FP32. Knobs stay at their defaults, so every probe's drop is in one setting.

    Args:
        space: The search space; its groups are the design's factors.
        max_plans: At most this many plans (the design's first rows: orthogonality needs all of them).
        varied: The groups the design varies (default all): where a prior leaves the choice open.
        lowered_always: Groups outside ``varied`` that every plan lowers (those a prior says cost nearly
            nothing); the other groups outside ``varied`` stay FP32 in every plan.

    Returns:
        Distinct plans, in design order; empty when there is nothing to search.
    """
    groups = space.groups
    varied = list(range(len(groups))) if varied is None else list(varied)
    if not varied or max_plans <= 0:
        return []
    order = design_order(len(varied))
    matrix = hadamard(order)
    assert matrix is not None  # design_order returns only orders hadamard builds
    lowered = lowered_precisions(space)
    fixed = {space.layer_names[i]: lowered[g] for g in lowered_always if g not in varied for i in groups[g]}
    plans: list[Plan] = []
    for row in matrix[:max_plans]:
        precisions = {
            space.layer_names[index]: lowered[group]
            for column, group in enumerate(varied)
            if row[column + 1] > 0
            for index in groups[group]
        }
        plan = space.plan({**fixed, **precisions})
        if plan not in plans:
            plans.append(plan)
    return plans
