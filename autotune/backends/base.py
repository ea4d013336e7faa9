"""What every backend offers: capabilities, build, run, profile."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx

from autotune.plan import KnobValue, Plan
from autotune.quant.recipe import QuantRecipe

if TYPE_CHECKING:
    from autotune.model import Layer, LoadedModel


class BackendUnavailable(RuntimeError):
    """The backend's runtime is not installed here; the message says how to install it."""


class BuildError(RuntimeError):
    """A build failed; the trial records the message and the search goes on."""


@dataclass(frozen=True)
class Knob:
    """One build knob and the values a backend allows for it.

    Attributes:
        name: The key in ``Plan.knobs``.
        values: Allowed values; the first is the default.
        description: What it changes, for people.
    """

    name: str
    values: tuple[KnobValue, ...]
    description: str = ""

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
    """

    precisions: Mapping[str, tuple[str, ...]]
    knobs: tuple[Knob, ...] = field(default_factory=tuple)

    def precisions_for(self, op_type: str) -> tuple[str, ...]:
        """Precisions for one op type; FP32 only when the backend has nothing else for it."""
        return self.precisions.get(op_type, ("fp32",))


class Backend(ABC):
    """Builds an artifact from a typed ONNX model and runs it.

    Subclasses import their runtime lazily, so ``import autotune`` works without it.

    A backend whose ``builds_from_plan`` is True builds a plan itself (``bind``, ``build_plan``, ``export_plan``)
    instead of the typed ONNX model: the ONNX model then only supplies the layer table and the calibration.
    """

    name: ClassVar[str]
    recipe: QuantRecipe
    builds_from_plan: ClassVar[bool] = False

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """Precisions per op type and knobs, read from the installed runtime and device."""

    @abstractmethod
    def build(self, model: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path) -> Any:
        """Builds a runnable artifact.

        Raises:
            BuildError: The runtime rejected the model or the knobs.
        """

    @abstractmethod
    def run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch and returns the outputs in graph order."""

    def time_run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> float:
        """Milliseconds of one run, as the latency protocol times it.

        The default times ``run`` with the wall clock; a GPU backend overrides it with device events.
        """
        start = time.perf_counter()
        self.run(artifact, feeds)
        return (time.perf_counter() - start) * 1e3

    def profile(
        self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], node_names: Sequence[str]
    ) -> dict[str, float] | None:
        """Each named node's share of FP32 runtime, or None when the backend cannot profile per node."""
        return None

    def bind(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Plan-native backends: maps the model's layer table onto what they build, once per run.

        Args:
            model: The loaded ONNX model (layer table, weights, inputs and outputs).
            searched: Names of the layers the search may change; each must be mappable.

        Raises:
            ValueError: A searched layer cannot be mapped; the message says how to keep it in FP32.
        """
        return None

    def build_plan(
        self,
        plan: Plan,
        layers: Sequence[Layer],
        ranges: Mapping[str, tuple[float, float]],
        workdir: Path,
        layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
    ) -> Any:
        """Plan-native backends: builds a runnable artifact straight from a plan.

        Args:
            plan: Precision per layer and the knobs.
            layers: The layer table (``bind`` saw the same).
            ranges: Calibrated ``(lo, hi)`` per ONNX tensor name, by the plan's calibration method.
            workdir: Where the build may keep files.
            layer_ranges: Per layer, ranges that replace ``ranges`` for it (``layerwise`` calibration).

        Raises:
            BuildError: The plan cannot be built.
        """
        raise NotImplementedError(f"the {self.name} backend builds typed ONNX models: call build")

    def export_plan(self, artifact: Any, plan: Plan, out_dir: Path) -> list[Path]:
        """Plan-native backends: writes the deployable files of an artifact; the loadable one comes first."""
        raise NotImplementedError(f"the {self.name} backend exports typed ONNX models: call export")

    def export(self, artifact: Any, model: onnx.ModelProto, out_dir: Path) -> list[Path]:
        """Writes the deployable files of an artifact into ``out_dir`` and returns their paths."""
        path = out_dir / "model.onnx"
        tmp = out_dir / ".model.onnx.tmp"
        onnx.save(model, str(tmp))
        tmp.replace(path)  # readers see the old model or the new one, never a torn file
        return [path]
