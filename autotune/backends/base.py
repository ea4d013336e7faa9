"""The one backend contract: capabilities, prepare, build, run, profile, export, and the platform's one-liners.

Every backend turns a plan into an engine through the same methods, whether it builds the typed ONNX graph the
plan lowers to (ONNX Runtime, TensorRT: ``GraphBackend``) or rewrites a PyTorch module (torch). Nothing outside
``autotune.backends`` asks which kind it has.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx

from autotune.capabilities import Capabilities, Knob
from autotune.plan import KnobValue, Plan
from autotune.quant.lowering import Quantization, lower
from autotune.quant.recipe import QuantRecipe
from autotune.run.files import atomic_write

if TYPE_CHECKING:
    from autotune.model.layers import LoadedModel
    from autotune.quant.calibrate import StatisticsCollector
    from autotune.quant.layerwise import LayerProbe


DEVICE_OWNER_ENV = "AUTOTUNE_OWNS_DEVICES"
"""Set to ``1`` in the processes that build and time (trial processes, Ray workers): they may initialise a device
(CUDA) themselves. Elsewhere a backend probes its device in a child process, so the run's own process never holds
one (``autotune.backends.torch.device.probe_device``)."""


def owns_devices() -> bool:
    """True in a process that builds and times trials (``DEVICE_OWNER_ENV``)."""
    return os.environ.get(DEVICE_OWNER_ENV) == "1"


class BackendUnavailable(RuntimeError):
    """The backend's runtime is not installed here; the message says how to install it."""


class BuildError(RuntimeError):
    """A build failed; the trial records the message and the search goes on."""


def _cuda_device_name() -> str | None:
    """The first CUDA device's name, or None without one (torch is imported only here)."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


class Backend(ABC):
    """Turns plans into engines and runs them.

    The harness calls ``prepare`` once per run, then ``build`` per plan (the FP32 reference is the all-FP32
    plan with ``fp32_reference_knobs``), ``run``/``time_run`` on what it returns, and ``export`` for the winner.
    ``references`` names the platform's own one-liners (ONNX Runtime's ``quantize_static``, say), and
    ``build_reference`` builds one into an artifact that ``run``, ``time_run`` and ``export`` take like any other:
    the harness measures them beside FP32, so a user sees whether tuning beat what the platform gives in one line.
    Subclasses import their runtime lazily, so ``import autotune`` works without it.
    """

    name: ClassVar[str]
    recipe: QuantRecipe
    reuses_fp32_build: ClassVar[bool] = False
    """True where a build of the FP32 plan is the FP32 reference again, kernel for kernel, and costs seconds: the
    trial process then answers the FP32 plan (the timing self-checks, the confirmation's FP32) with the reference
    it built at set-up. False where two builds differ in what timing shows (two ONNX Runtime sessions have a
    thread pool each, and the self-check is there to see them share the cores)."""

    profiles: ClassVar[bool] = False
    """True where ``profile`` times each layer; False spares the run's analysis loading data for it."""

    searching_references: ClassVar[tuple[str, ...]] = ()
    """One-liners whose build is a search of its own (NNCF's accuracy control quantizes, scores and reverts layer
    groups until the drop fits): minutes where a trial's build takes seconds. A run bounded by ``budget.minutes``
    leaves them out unless ``confirm.references`` names them."""

    exports_batch_free: ClassVar[bool] = False
    """True where a PyTorch model is exported for it without its batch size (the torch backend runs the module and
    reads only its layers from the graph: a trace at two rows will do)."""

    runs_on_gpu: ClassVar[bool] = False
    """True where its engines run on a GPU: the GPU's name is then part of the machine's identity."""

    fp16_base_range_checked: ClassVar[bool] = False
    """True where its typed graph keeps FP32 the ops whose values leave FP16's range in an FP16 base (TensorRT)."""

    @classmethod
    def device_identity(cls) -> dict[str, Any]:
        """What identifies the device its engines run on beyond the CPU: the GPU's name (None on the CPU)."""
        return {"gpu": _cuda_device_name() if cls.runs_on_gpu else None}

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """Precisions per op type and knobs, read from the installed runtime and device."""

    def fp32_reference_knobs(self) -> dict[str, KnobValue]:
        """Knob values the FP32 reference is built with where they differ from the knobs' defaults (none here).

        The reference is the model in FP32, the clock every plan is timed against and the outputs every plan is
        scored against; what it is built with must exist on the device (``capabilities``), not in the search's
        space: a config may search compiled builds only, while the reference is built in seconds.
        """
        return {}

    def load_ahead(self) -> None:
        """Loads what needs neither the model's ONNX file nor the run (nothing by default).

        A trial process started with the run calls it before it waits for the run's model: whatever it loads here
        is off the set-up's critical path, done while the run exports the model.
        """
        return None

    def prepare(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Takes the run's model once, before any build.

        Args:
            model: The loaded ONNX model (layer table, weights, inputs and outputs).
            searched: Names of the layers the search may change.

        Raises:
            ValueError: A searched layer cannot be built by this backend; the message says how to keep it FP32.
        """
        self.model = model
        self.searched = tuple(searched)

    def statistics_collector(self, tensors: Sequence[str]) -> StatisticsCollector | None:
        """Where this backend gathers the calibration's activation statistics on its own device; None by default.

        None: ONNX Runtime runs the ONNX graph on the CPU, beside the FP32 reference's build.
        """
        return None

    def references(self) -> tuple[str, ...]:
        """The names of the platform's one-liner engines this backend builds (none by default)."""
        return ()

    def build_reference(self, name: str, calibration: Sequence[Mapping[str, np.ndarray]], workdir: Path) -> Any:
        """Builds the engine a user gets from the platform's one-liner ``name``, on the prepared model.

        Args:
            name: One of ``references()``.
            calibration: The run's calibration batches, for one-liners that calibrate.
            workdir: Where the build may keep files.

        Raises:
            BuildError: ``name`` is not a reference of this backend, or the one-liner failed.
        """
        offered = ", ".join(self.references()) or "none"
        raise BuildError(f"{self.name} has no reference {name!r}; its references: {offered}")

    @abstractmethod
    def build(self, plan: Plan, quantization: Quantization, workdir: Path) -> Any:
        """Builds a runnable engine of a plan.

        Args:
            plan: Precision per layer and the knobs.
            quantization: Calibrated ranges (and SmoothQuant factors, where offered) for the plan's method.
            workdir: Where the build may keep files (caches live across builds there).

        Raises:
            BuildError: The runtime rejected the plan or its knobs.
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

    def time_back_to_back(self, artifact: Any, feeds: Mapping[str, np.ndarray], launches: int) -> float | None:
        """Milliseconds per launch of ``launches`` launches back to back, or None where the backend has no such timer.

        One launch timed alone includes what a launch pays before the device starts (Python, guards, the graph
        launch); back to back, a launch's host work overlaps the previous one's device work, as in a serving loop.
        The default (None) leaves the second timing out of the results.
        """
        return None

    def recipe_for(self, plan: Plan) -> QuantRecipe:
        """The Q/DQ recipe a plan's INT8 layers are lowered with: ``recipe`` unless a knob of the plan picks another.

        Raises:
            BuildError: The plan's knobs name a recipe this machine cannot run.
        """
        return self.recipe

    def layer_probe(self) -> LayerProbe | None:
        """What runs the layerwise calibration's single-layer evaluations on this backend's device, or None.

        None (the default) runs them on ONNX Runtime's CPU (``autotune.quant.layerwise``). Called after
        ``prepare``.
        """
        return None

    def int8_arithmetic(self) -> dict[str, Any] | None:
        """The INT8 scheme this backend lowers to on this machine and why, or None where the CPU does not decide it.

        A dict with ``scheme``, ``weight_range``, ``isa`` and ``verdicts`` (what ``summary.json`` records).
        """
        return None

    def profile(self, model: LoadedModel, feeds: Mapping[str, np.ndarray]) -> dict[str, float] | None:
        """Each layer's share of FP32 runtime, or None when the backend cannot profile per layer (``profiles``)."""
        return None

    @abstractmethod
    def export(self, artifact: Any, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes the deployable files of an engine into ``out_dir``; the loadable one comes first."""


@dataclass
class GraphArtifact:
    """An engine built from a typed ONNX graph, with that graph (what ``export`` writes beside it)."""

    graph: onnx.ModelProto
    engine: Any


class GraphBackend(Backend):
    """A backend that builds the typed ONNX graph a plan lowers to (``autotune.quant.lowering``).

    Subclasses say how a graph becomes an engine (``build_graph``) and how an engine runs (``run_engine``).
    """

    @abstractmethod
    def build_graph(self, graph: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path | None = None) -> Any:
        """Builds an engine from a typed ONNX graph.

        Raises:
            BuildError: The runtime rejected the graph or the knobs.
        """

    @abstractmethod
    def run_engine(self, engine: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch on an engine of ``build_graph``."""

    def build(self, plan: Plan, quantization: Quantization, workdir: Path) -> GraphArtifact:
        """Lowers the plan to a typed graph and builds it."""
        graph = lower(self.model, plan, quantization, self.recipe_for(plan))
        return GraphArtifact(graph, self.build_graph(graph, plan.knob_map, workdir))

    def run(self, artifact: GraphArtifact, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch."""
        return self.run_engine(artifact.engine, feeds)

    def export(self, artifact: GraphArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes the typed graph as ``model.onnx``."""
        return [atomic_write(out_dir / "model.onnx", lambda tmp: onnx.save(artifact.graph, str(tmp)))]


__all__ = [
    "Backend",
    "BackendUnavailable",
    "BuildError",
    "Capabilities",
    "GraphArtifact",
    "GraphBackend",
    "Knob",
]
