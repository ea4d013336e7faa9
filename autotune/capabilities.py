"""What a backend can build on this machine: precisions per op type and build knobs. Pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autotune.plan import KnobValue


@dataclass(frozen=True)
class Knob:
    """One build knob and the values a backend allows for it.

    Attributes:
        name: The key in ``Plan.knobs``.
        values: Allowed values; the first is the default.
        description: What it changes, for people.
        follows_precision: The knob's values are precision names, and a uniform plan of one of them
            (``SearchSpace.uniform``) sets the knob to it too: the torch backend's ``base_precision``, so that
            "all FP16" means the whole module in FP16, not only its tunable layers.
        free: The knob's values change the outputs at rounding level only (an attention kernel, CUDA graph
            capture, cuDNN's algorithm search): it costs no accuracy, so a run measures its values once on the
            fastest uniform seed and fixes the fastest for every later plan (``autotune.search.driver.fix_free_knobs``)
            instead of searching it. A knob that changes the numbers (TF32, a base precision) or whose effect
            depends on the rest of the plan is not free.
        unavailable: Values the backend knows but cannot offer on this machine, each with why (an INT8 scheme
            whose kernels saturate here): a config that asks for one is refused with the reason, not narrowed.
        opt_in: The search space has the knob only where the config's ``search.knobs`` names it; elsewhere every
            plan leaves it unset and builds with its default (so the plans, and their hashes, of a run that does
            not search it stay what they were before the knob existed).
        seeded: The knob changes how a plan's INT8 layers compute (ONNX Runtime's ``int8_scheme``): a run times
            each of its values on the fastest uniform INT8 seed right after the seeds
            (``autotune.search.driver.time_seeded_knobs``), and the planner weighs a plan frame per value
            (``autotune.search.design.model_frames``), so the fastest value within the budget is kept. Unlike a
            free knob it stays searched: its values differ in accuracy too.
        needs_ops: ONNX op types of which the model must hold one for the knob to change anything (ONNX Runtime's
            SkipLayerNormalization fusion: ``LayerNormalization``, or the ``Sqrt`` of one spelt out in primitive
            ops); the search space of another model leaves the knob out, unless the config's ``search.knobs`` names
            it. Empty: every model.
    """

    name: str
    values: tuple[KnobValue, ...]
    description: str = ""
    follows_precision: bool = False
    free: bool = False
    unavailable: tuple[tuple[KnobValue, str], ...] = ()
    opt_in: bool = False
    seeded: bool = False
    needs_ops: tuple[str, ...] = ()

    @property
    def default(self) -> KnobValue:
        """The value used when a plan does not set the knob."""
        return self.values[0]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can build on this machine.

    Attributes:
        precisions: Op type to the precisions it may take, ``fp32`` first.
        knobs: The backend's own build knobs.
        smoothing: The backend lowers SmoothQuant (a Mul on a layer's input, scaled weights); backends that
            rewrite modules instead of graphs take calibrated ranges only.
    """

    precisions: Mapping[str, tuple[str, ...]]
    knobs: tuple[Knob, ...] = field(default_factory=tuple)
    smoothing: bool = True

    def precisions_for(self, op_type: str) -> tuple[str, ...]:
        """Precisions for one op type; FP32 only when the backend has nothing else for it."""
        return self.precisions.get(op_type, ("fp32",))
