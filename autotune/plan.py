"""Plans: the precision of every tunable layer plus the build knobs, as one hashable value."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DYNAMIC = "int8-dynamic"
"""INT8 whose activations are quantized at run time (ONNX Runtime's MatMul/Gemm, ``autotune.quant.dynamic``)."""

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", DYNAMIC, "fp8")
"""Every precision a layer can take, from widest to narrowest; backends offer a subset. ``int8-dynamic``: INT8
whose activations are quantized at run time (ONNX Runtime's MatMul/Gemm, ``autotune.quant.dynamic``)."""

KnobValue = str | int | float | bool

CALIBRATION_KNOB = "calibration"
"""The recipe knob that picks the calibration method a plan's quantized layers are built with."""
GRANULARITY_KNOB = "weight_granularity"
"""The recipe knob that picks per-channel or per-tensor weight scales."""
INT8_SCHEME_KNOB = "int8_scheme"
"""The knob that picks a plan's INT8 kernel scheme on ONNX Runtime CPU (``autotune.backends.onnxruntime``); u8s7
halves the weight resolution, so the scheme changes a plan's numbers as the calibration does."""
REFERENCE_KNOB = "reference"
"""Marks a reference plan: the engine the backend's own one-liner builds (``Backend.references``), measured by the
same harness as every plan. No search space offers this knob, so no strategy ever proposes such a plan."""


@dataclass(frozen=True)
class Plan:
    """The precision of each tunable layer and the value of each knob.

    Layers keep the order of the layer table; knobs are sorted by name, so equal plans have equal hashes.

    Attributes:
        precisions: ``(layer name, precision)`` pairs in layer-table order.
        knobs: ``(knob name, value)`` pairs sorted by name.
    """

    precisions: tuple[tuple[str, str], ...]
    knobs: tuple[tuple[str, KnobValue], ...] = ()

    @classmethod
    def make(cls, precisions: Mapping[str, str], knobs: Mapping[str, KnobValue] | None = None) -> Plan:
        """Builds a plan from mappings, validating the precision names.

        Args:
            precisions: Layer name to precision, in layer-table order.
            knobs: Knob name to value.

        Returns:
            The plan.

        Raises:
            ValueError: A precision is not one of ``PRECISIONS``.
        """
        for layer, precision in precisions.items():
            if precision not in PRECISIONS:
                raise ValueError(f"layer {layer!r}: unknown precision {precision!r}; allowed: {PRECISIONS}")
        return cls(tuple(precisions.items()), tuple(sorted((knobs or {}).items())))

    @classmethod
    def uniform(cls, layers: list[str], precision: str, knobs: Mapping[str, KnobValue] | None = None) -> Plan:
        """A plan that gives every layer the same precision."""
        return cls.make({name: precision for name in layers}, knobs)

    @classmethod
    def reference_plan(cls, layers: list[str], name: str) -> Plan:
        """The plan of the backend's one-liner ``name``.

        Every layer is FP32 (the one-liner decides what it quantizes) and ``reference`` is its only knob, so its
        hash differs from every searched plan's.
        """
        return cls.uniform(layers, "fp32", {REFERENCE_KNOB: name})

    @property
    def reference(self) -> str | None:
        """The one-liner this plan stands for, or None for a plan of the search."""
        value = self.knob_map.get(REFERENCE_KNOB)
        return None if value is None else str(value)

    @property
    def precision_map(self) -> dict[str, str]:
        """Layer name to precision."""
        return dict(self.precisions)

    @property
    def knob_map(self) -> dict[str, KnobValue]:
        """Knob name to value."""
        return dict(self.knobs)

    def knob(self, name: str, default: KnobValue | None = None) -> Any:
        """The value of one knob, or ``default`` when the plan does not set it."""
        return self.knob_map.get(name, default)

    def layers_in(self, precision: str) -> list[str]:
        """The layers that run in ``precision``, in layer-table order."""
        return [name for name, p in self.precisions if p == precision]

    def with_knobs(self, **knobs: KnobValue) -> Plan:
        """A copy with some knobs set."""
        return Plan.make(self.precision_map, {**self.knob_map, **knobs})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_dict`` reverses it."""
        return {"precisions": dict(self.precisions), "knobs": dict(self.knobs)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Reads a plan written by ``to_dict``.

        Raises:
            ValueError: The dict is not a plan.
        """
        if not isinstance(data, Mapping) or "precisions" not in data:
            raise ValueError("a plan is a JSON object with 'precisions' (layer -> precision) and optional 'knobs'")
        unknown = set(data) - {"precisions", "knobs"}
        if unknown:
            raise ValueError(f"unknown plan keys {sorted(unknown)}; allowed: 'precisions', 'knobs'")
        return cls.make(dict(data["precisions"]), dict(data.get("knobs") or {}))

    def to_json(self, indent: int | None = None) -> str:
        """Canonical JSON: the same plan always gives the same text."""
        return json.dumps(self.to_dict(), indent=indent)  # knobs are sorted already; layers keep table order

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Reads ``to_json`` output."""
        return cls.from_dict(json.loads(text))

    @property
    def hash(self) -> str:
        """A short stable content hash; the key of the trial store."""
        canonical = json.dumps({"p": list(map(list, self.precisions)), "k": list(map(list, self.knobs))})
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line a person can read: how many layers take each precision, the exceptions, the knobs."""
        if self.reference is not None:
            return f"reference {self.reference} (the backend's one-liner)"
        counts: dict[str, list[str]] = {}
        for name, precision in self.precisions:
            counts.setdefault(precision, []).append(name)
        majority = max(counts, key=lambda p: len(counts[p])) if counts else "fp32"
        parts = [f"{majority} x{len(counts.get(majority, []))}"]
        for precision, names in counts.items():
            if precision != majority:
                parts.append(f"{precision}: {', '.join(names)}")
        if self.knobs:
            parts.append(", ".join(f"{k}={v}" for k, v in self.knobs))
        return "; ".join(parts)

    def diff(self, other: Plan) -> list[str]:
        """What changes from this plan to ``other``, one ``name: old -> new`` line each."""
        lines = []
        mine, theirs = self.precision_map, other.precision_map
        for name in dict.fromkeys([*mine, *theirs]):
            if mine.get(name) != theirs.get(name):
                lines.append(f"{name}: {mine.get(name)} -> {theirs.get(name)}")
        my_knobs, their_knobs = self.knob_map, other.knob_map
        for name in sorted(set(my_knobs) | set(their_knobs)):
            if my_knobs.get(name) != their_knobs.get(name):
                lines.append(f"{name}: {my_knobs.get(name)} -> {their_knobs.get(name)}")
        return lines
