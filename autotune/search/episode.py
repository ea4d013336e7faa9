"""One episode of plan construction: decisions, action masks, observations. Pure functions of the choices so far.

An episode takes one step per decision: first each group of searchable layers picks a precision (graph order,
as in HAQ), then each knob with more than one value picks a value. The Gymnasium env only sequences these.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.config.schema import RewardConfig
from autotune.model.optypes import WEIGHTED_OP_TYPES
from autotune.plan import Plan
from autotune.search.estimate import MAX_SAVING, LayerEstimates
from autotune.search.reward import reward_of
from autotune.search.space import SearchSpace

# Weightless layers (Add, pooling, ...) get no one-hot bit: zero MACs and params already set them apart, and the
# observation keeps its size, so agents saved before they were tunable still load.
OP_TYPES = WEIGHTED_OP_TYPES
_LAYER_FEATURES = len(OP_TYPES) + 5  # op one-hot, log MACs, log params, depth, runtime share, group size
_CONTEXT_FEATURES = 4  # progress, fraction of layers quantized so far, fraction of MACs quantized so far, last choice
_ESTIMATE_FEATURES = 4  # estimated saving and drop of this decision; estimated drop and saving of the choices so far


@dataclass(frozen=True)
class Decision:
    """One step of an episode.

    Attributes:
        kind: ``layers`` (a group of layers) or ``knob``.
        index: Group index in ``SearchSpace.groups``, or knob index in ``SearchSpace.knobs``.
        options: Values the step may choose; the action is an index into this tuple.
    """

    kind: str
    index: int
    options: tuple


def decisions(space: SearchSpace) -> list[Decision]:
    """Every step of an episode, in order; knobs with a single value are not asked."""
    steps = [Decision("layers", i, space.group_choices(group)) for i, group in enumerate(space.groups)]
    steps += [Decision("knob", i, knob.values) for i, knob in enumerate(space.knobs) if len(knob.values) > 1]
    return steps


def action_count(steps: Sequence[Decision]) -> int:
    """Size of the Discrete action space: the largest choice set."""
    return max((len(step.options) for step in steps), default=1)


def action_mask(steps: Sequence[Decision], step: int, n_actions: int) -> np.ndarray:
    """Which actions are allowed at ``step``; all False once the episode is over."""
    mask = np.zeros(n_actions, dtype=bool)
    if step < len(steps):
        mask[: len(steps[step].options)] = True
    return mask


def novel_options(
    space: SearchSpace, steps: Sequence[Decision], chosen: Sequence[int], mask: np.ndarray, measured: Collection[str]
) -> np.ndarray:
    """``mask`` without the options all of whose completions are plans already measured, unless every option's are.

    A converged policy ends its real episodes in the plans it built already, each a store hit that teaches it
    nothing new. Masked so at every step, an episode leaves a branch only when every plan below it is measured, and
    ends in a plan not built yet wherever its earlier choices left one. A branch is looked into only where it has
    no more completions than plans were measured, and the look stops at its first plan not measured.
    """
    later = [range(len(step.options)) for step in steps[len(chosen) + 1 :]]
    if len(chosen) >= len(steps) or math.prod(len(options) for options in later) > len(measured):
        return mask
    novel = mask.copy()
    for option in np.flatnonzero(mask):
        head = [*chosen, int(option)]
        completions = (plan_from_actions(space, steps, [*head, *tail]) for tail in itertools.product(*later))
        if all(plan.hash in measured for plan in completions):
            novel[option] = False
    return novel if novel.any() else mask


def observation_size(space: SearchSpace, steps: Sequence[Decision]) -> int:
    """Length of the observation vector."""
    knob_steps = sum(step.kind == "knob" for step in steps)
    return 2 + _LAYER_FEATURES + knob_steps + _CONTEXT_FEATURES + len(steps) + _ESTIMATE_FEATURES


def _layer_features(space: SearchSpace, group: Sequence[int]) -> np.ndarray:
    layers = space.layers
    max_macs = max(math.log1p(layer.macs) for layer in layers) or 1.0
    max_params = max(math.log1p(layer.params) for layer in layers) or 1.0
    max_depth = max(layer.depth for layer in layers) or 1
    features = np.zeros(_LAYER_FEATURES, dtype=np.float32)
    members = [layers[i] for i in group]
    for layer in members:
        if layer.op_type in OP_TYPES:
            features[OP_TYPES.index(layer.op_type)] = 1.0
    n = len(OP_TYPES)
    features[n] = np.mean([math.log1p(layer.macs) for layer in members]) / max_macs
    features[n + 1] = np.mean([math.log1p(layer.params) for layer in members]) / max_params
    features[n + 2] = np.mean([layer.depth for layer in members]) / max_depth
    features[n + 3] = min(1.0, sum(layer.runtime_share or 0.0 for layer in members))
    features[n + 4] = len(members) / max(1, space.group_size)
    return features


def _quantized_fractions(space: SearchSpace, steps: Sequence[Decision], chosen: Sequence[int]) -> tuple[float, float]:
    layers_done = quantized = 0
    macs_total = sum(layer.macs for layer in space.layers) or 1
    macs_quantized = 0
    groups = space.groups
    for step, action in zip(steps, chosen, strict=False):
        if step.kind != "layers":
            continue
        for i in groups[step.index]:
            layers_done += 1
            if step.options[action] != "fp32":
                quantized += 1
                macs_quantized += space.layers[i].macs
    return quantized / max(1, len(space.layers)), macs_quantized / macs_total


def _estimate_features(
    space: SearchSpace, steps: Sequence[Decision], chosen: Sequence[int], estimates: LayerEstimates, budget: float
) -> np.ndarray:
    features = np.zeros(_ESTIMATE_FEATURES, dtype=np.float32)
    groups = space.groups
    drop_scale = budget if budget > 0 else max(float(estimates.drop.sum()), 1e-12)
    max_saving = max(float(estimates.saving.max()), 1e-12)
    position = len(chosen)
    if position < len(steps) and steps[position].kind == "layers":
        members = list(groups[steps[position].index])
        features[0] = min(1.0, float(estimates.saving[members].sum()) / max_saving)
        features[1] = min(1.0, float(estimates.drop[members].sum()) / drop_scale)
    quantized = [
        i
        for step, action in zip(steps, chosen, strict=False)
        if step.kind == "layers" and step.options[action] != "fp32"
        for i in groups[step.index]
    ]
    features[2] = min(1.0, float(estimates.drop[quantized].sum()) / drop_scale / 2)
    features[3] = min(1.0, float(estimates.saving[quantized].sum()))
    return features


def observe(
    space: SearchSpace,
    steps: Sequence[Decision],
    chosen: Sequence[int],
    estimates: LayerEstimates | None = None,
    accuracy_budget: float = 0.0,
) -> np.ndarray:
    """The observation before step ``len(chosen)``: the current decision's features plus the context.

    Every value lies in [0, 1]. The last values are the fitted per-layer estimates (zeros until there are some):
    this decision's estimated saving (relative to the largest) and drop (in budgets, capped at 1), and the
    estimated drop (in budgets / 2, capped) and saving (fraction of FP32 time) of the choices so far.

    Args:
        space: The search space.
        steps: ``decisions(space)``.
        chosen: Actions taken so far.
        estimates: Per-layer estimates fitted from the trials so far, if any.
        accuracy_budget: The budget, to express drops in budgets.

    Returns:
        A float32 vector of ``observation_size(space, steps)`` values.
    """
    position = len(chosen)
    knob_steps = [i for i, step in enumerate(steps) if step.kind == "knob"]
    obs = np.zeros(observation_size(space, steps), dtype=np.float32)
    offset = 2 + _LAYER_FEATURES
    if position < len(steps):
        current = steps[position]
        if current.kind == "layers":
            obs[0] = 1.0
            obs[2:offset] = _layer_features(space, space.groups[current.index])
        else:
            obs[1] = 1.0
            obs[offset + knob_steps.index(position)] = 1.0
    offset += len(knob_steps)
    fraction_layers, fraction_macs = _quantized_fractions(space, steps, chosen)
    obs[offset] = position / max(1, len(steps))
    obs[offset + 1] = fraction_layers
    obs[offset + 2] = fraction_macs
    if chosen:
        obs[offset + 3] = (chosen[-1] + 1) / len(steps[position - 1].options)
    offset += _CONTEXT_FEATURES
    for i, action in enumerate(chosen):
        obs[offset + i] = (action + 1) / len(steps[i].options)
    if estimates is not None:
        obs[-_ESTIMATE_FEATURES:] = _estimate_features(space, steps, chosen, estimates, accuracy_budget)
    return obs


def potential(
    space: SearchSpace,
    steps: Sequence[Decision],
    chosen: Sequence[int],
    estimates: LayerEstimates | None,
    reward_config: RewardConfig,
    accuracy_budget: float,
) -> float:
    """The reward the per-layer estimates predict for the choices so far, the layers not yet decided in FP32.

    Used for potential-based reward shaping (Ng, Harada and Russell, 1999): each step is paid the change in this
    potential, and the last step the real reward minus the potential before it. The episode's return stays the
    real reward (the potential of the empty plan, all FP32, is 0), so the best plan is unchanged, but each layer's
    choice is credited with its own estimated effect instead of sharing one sparse reward with 40 other steps.

    Args:
        space: The search space.
        steps: ``decisions(space)``.
        chosen: Actions taken so far.
        estimates: Per-layer estimates; None gives 0 (no shaping before there are estimates).
        reward_config: The reward's penalty weights.
        accuracy_budget: Drop allowed without penalty.

    Returns:
        The reward of a plan with the estimated speedup ``1 / (1 - sum of savings)`` and drop (sum of drops).
    """
    if estimates is None:
        return 0.0
    groups = space.groups
    quantized = [
        i
        for step, action in zip(steps, chosen, strict=False)
        if step.kind == "layers" and step.options[action] != "fp32"
        for i in groups[step.index]
    ]
    if not quantized:
        return 0.0
    saving = min(float(estimates.saving[quantized].sum()), MAX_SAVING)
    return reward_of(1.0 / (1.0 - saving), float(estimates.drop[quantized].sum()), reward_config, accuracy_budget)


def plan_from_actions(space: SearchSpace, steps: Sequence[Decision], actions: Sequence[int]) -> Plan:
    """The plan a complete episode chose.

    Raises:
        ValueError: Too few actions, or an action outside its step's options.
    """
    if len(actions) != len(steps):
        raise ValueError(f"an episode has {len(steps)} steps, got {len(actions)} actions")
    precisions: dict[str, str] = {}
    knobs = {}
    groups = space.groups
    for step, action in zip(steps, actions, strict=True):
        if not 0 <= action < len(step.options):
            raise ValueError(f"action {action} outside the {len(step.options)} options of {step}")
        value = step.options[action]
        if step.kind == "layers":
            for i in groups[step.index]:
                precisions[space.layers[i].name] = value
        else:
            knobs[space.knobs[step.index].name] = value
    return space.plan(precisions, knobs)


def actions_from_plan(space: SearchSpace, steps: Sequence[Decision], plan: Plan) -> list[int]:
    """The actions that produce ``plan`` (the first layer of each group decides the group).

    Raises:
        ValueError: The plan is not reachable in this space.
    """
    precisions, knobs = plan.precision_map, plan.knob_map
    groups = space.groups
    actions = []
    for step in steps:
        if step.kind == "layers":
            value = precisions.get(space.layers[groups[step.index][0]].name, "fp32")
        else:
            knob = space.knobs[step.index]
            value = knobs.get(knob.name, knob.default)
        if value not in step.options:
            raise ValueError(f"{value!r} is not an option of step {step}")
        actions.append(step.options.index(value))
    return actions


def neighbours(space: SearchSpace, plan: Plan, exclude: Collection[str], seed: int = 0) -> list[Plan]:
    """The plans one decision away from ``plan`` (a group's precision or a knob's value), none in ``exclude``.

    Args:
        space: The search space.
        plan: The plan to step away from; it must be reachable in ``space``.
        exclude: Hashes of plans to leave out (those measured already).
        seed: Seeds the order.

    Returns:
        The neighbours in random order: a caller that builds the first few spreads them over the decisions.
    """
    steps = decisions(space)
    actions = actions_from_plan(space, steps, plan)
    found: dict[str, Plan] = {}
    for index, step in enumerate(steps):
        for option in range(len(step.options)):
            if option == actions[index]:
                continue
            neighbour = plan_from_actions(space, steps, [*actions[:index], option, *actions[index + 1 :]])
            if neighbour.hash not in exclude:
                found.setdefault(neighbour.hash, neighbour)
    plans = list(found.values())
    order = np.random.default_rng(seed).permutation(len(plans))
    return [plans[i] for i in order]
