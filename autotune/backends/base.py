"""What every backend offers: capabilities, build, run, profile."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx

from autotune.plan import KnobValue
from autotune.quant.recipe import QuantRecipe


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
    """

    name: ClassVar[str]
    recipe: QuantRecipe

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

    def export(self, artifact: Any, model: onnx.ModelProto, out_dir: Path) -> list[Path]:
        """Writes the deployable files of an artifact into ``out_dir`` and returns their paths."""
        path = out_dir / "model.onnx"
        tmp = out_dir / ".model.onnx.tmp"
        onnx.save(model, str(tmp))
        tmp.replace(path)  # readers see the old model or the new one, never a torn file
        return [path]
