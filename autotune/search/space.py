"""The search space: which precisions each layer may take and which knob values a plan may set. Pure."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from autotune.capabilities import Capabilities, Knob
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import Layer
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, KnobValue, Plan

__all__ = ["CALIBRATION_KNOB", "GRANULARITY_KNOB", "SearchSpace", "build_space"]


@dataclass(frozen=True)
class SearchSpace:
    """Everything a strategy may choose.

    Attributes:
        layers: Every tunable layer of the model, in table order.
        choices: Per layer, the precisions allowed (``fp32`` first); a layer left out of the search has ``("fp32",)``.
        knobs: Recipe knobs (calibration method, weight granularity) then the backend's knobs, restricted by the config.
        group_size: Consecutive searchable layers decided together.
    """

    layers: tuple[Layer, ...]
    choices: tuple[tuple[str, ...], ...]
    knobs: tuple[Knob, ...]
    group_size: int = 1

    @property
    def layer_names(self) -> list[str]:
        """Every tunable layer name."""
        return [layer.name for layer in self.layers]

    @property
    def searchable(self) -> list[int]:
        """Indexes of layers with more than one allowed precision."""
        return [i for i, options in enumerate(self.choices) if len(options) > 1]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Searchable layer indexes cut into decision groups of ``group_size``, in graph order."""
        searchable = self.searchable
        return [tuple(searchable[i : i + self.group_size]) for i in range(0, len(searchable), self.group_size)]

    @property
    def size(self) -> int:
        """Distinct plans the space holds: the precisions of every decision group times every knob's values."""
        groups = math.prod(len(self.group_choices(group)) for group in self.groups)
        return groups * math.prod(len(knob.values) for knob in self.knobs)

    def group_choices(self, group: Sequence[int]) -> tuple[str, ...]:
        """Precisions every layer of a group allows, in the order of the first layer's choices."""
        allowed = set.intersection(*(set(self.choices[i]) for i in group))
        return tuple(p for p in self.choices[group[0]] if p in allowed)

    def plan(self, precisions: Mapping[str, str] | None = None, knobs: Mapping[str, KnobValue] | None = None) -> Plan:
        """A complete plan: unset layers FP32, unset knobs at their defaults."""
        precisions = precisions or {}
        knobs = knobs or {}
        return Plan.make(
            {name: precisions.get(name, "fp32") for name in self.layer_names},
            {knob.name: knobs.get(knob.name, knob.default) for knob in self.knobs},
        )

    def uniform(self, precision: str, knobs: Mapping[str, KnobValue] | None = None) -> Plan:
        """Every layer that allows ``precision`` takes it; the rest stay FP32.

        A knob that ``follows_precision`` and offers ``precision`` takes it as well, unless ``knobs`` sets it.
        """
        following = {k.name: precision for k in self.knobs if k.follows_precision and precision in k.values}
        return self.plan(
            {
                layer.name: precision
                for layer, options in zip(self.layers, self.choices, strict=True)
                if precision in options
            },
            {**following, **(knobs or {})},
        )

    def with_fixed_knobs(self, fixed: Mapping[str, KnobValue]) -> SearchSpace:
        """This space with each knob of ``fixed`` narrowed to its one value (then a strategy no longer asks it).

        Raises:
            ValueError: A knob the space lacks, or a value it does not allow.
        """
        knobs = {knob.name: knob for knob in self.knobs}
        for name, value in fixed.items():
            if name not in knobs or value not in knobs[name].values:
                allowed = list(knobs[name].values) if name in knobs else sorted(knobs)
                raise ValueError(f"cannot fix knob {name}={value!r}: allowed {allowed}")
        narrowed = tuple(
            dataclasses.replace(knob, values=(fixed[knob.name],)) if knob.name in fixed else knob for knob in self.knobs
        )
        return dataclasses.replace(self, knobs=narrowed)

    @property
    def free_knobs(self) -> list[Knob]:
        """The knobs marked ``free`` (numerically neutral) that still offer more than one value."""
        return [knob for knob in self.knobs if knob.free and len(knob.values) > 1]

    def violations(self, plan: Plan) -> list[str]:
        """Why a plan is outside this space; empty when it is inside."""
        problems = []
        precisions = plan.precision_map
        unknown = set(precisions) - set(self.layer_names)
        if unknown:
            problems.append(f"unknown layers {sorted(unknown)}")
        for layer, options in zip(self.layers, self.choices, strict=True):
            chosen = precisions.get(layer.name, "fp32")
            if chosen not in options:
                problems.append(f"{layer.name} ({layer.op_type}): {chosen} not allowed; allowed {list(options)}")
        knob_values = plan.knob_map
        allowed_knobs = {knob.name: knob for knob in self.knobs}
        for name, value in knob_values.items():
            if name not in allowed_knobs:
                problems.append(f"unknown knob {name!r}; knobs: {sorted(allowed_knobs)}")
            elif value not in allowed_knobs[name].values:
                problems.append(f"knob {name}={value!r} not allowed; allowed {list(allowed_knobs[name].values)}")
        return problems


def _restrict_knob(knob: Knob, allowed: Sequence[KnobValue] | None) -> Knob:
    if allowed is None:
        return knob
    refused = [f"{value!r} ({why})" for value, why in knob.unavailable if value in allowed]
    if refused:
        raise ValueError(
            f"search.knobs.{knob.name}: {', '.join(refused)} not offered on this machine; offered {list(knob.values)}"
        )
    values = tuple(v for v in knob.values if v in allowed)
    if not values:
        raise ValueError(f"search.knobs.{knob.name}: none of {list(allowed)} is offered; allowed {list(knob.values)}")
    return dataclasses.replace(knob, values=values)


def _idle_for_model(knob: Knob, op_types: Collection[str] | None) -> bool:
    """The model holds none of the ops the knob needs (``Knob.needs_ops``), so no build of it would differ."""
    return bool(knob.needs_ops) and op_types is not None and not set(knob.needs_ops) & set(op_types)


def build_space(
    layers: Sequence[Layer],
    capabilities: Capabilities,
    config: SearchSpaceConfig,
    op_types: Collection[str] | None = None,
) -> SearchSpace:
    """Intersects the backend's capabilities with the config's restrictions.

    ``op_types``: every op type of the model; a knob that needs one it lacks (``Knob.needs_ops``) is left out unless
    the config names it. None: no knob is left out for the model.

    Raises:
        ValueError: The config restricts a knob that does not exist or to values the backend does not offer.
    """
    include = re.compile(config.include_layers) if config.include_layers else None
    exclude = re.compile(config.exclude_layers) if config.exclude_layers else None
    choices = []
    for layer in layers:
        options = capabilities.precisions_for(layer.op_type)
        searched = (
            (config.op_types is None or layer.op_type in config.op_types)
            and (include is None or include.search(layer.name))
            and not (exclude and exclude.search(layer.name))
        )
        if config.precisions is not None:
            options = tuple(p for p in options if p == "fp32" or p in config.precisions)
        choices.append(options if searched else ("fp32",))
    recipe_knobs = (
        Knob(CALIBRATION_KNOB, tuple(config.calibration_methods), "activation range method of our calibration"),
        Knob(GRANULARITY_KNOB, tuple(config.weight_granularity), "INT8 weight scales per output channel or per tensor"),
    )
    backend_knobs = {
        knob.name: knob
        for knob in capabilities.knobs
        if knob.name in config.knobs or not (knob.opt_in or _idle_for_model(knob, op_types))
    }
    offered = {knob.name for knob in capabilities.knobs}
    unknown = set(config.knobs) - offered - {k.name for k in recipe_knobs}
    if unknown:
        raise ValueError(f"search.knobs names unknown knobs {sorted(unknown)}; this backend has {sorted(offered)}")
    knobs = tuple(_restrict_knob(k, config.knobs.get(k.name)) for k in (*recipe_knobs, *backend_knobs.values()))
    return SearchSpace(tuple(layers), tuple(choices), knobs, config.group_size)
