"""Another CPU runtime's one-liners as references of a run: ``backend.options.reference_runtimes``.

A run that ``backend.name: auto`` put on OpenVINO still confirms its winner against ONNX Runtime's ``ort-static``
and ``ort-dynamic`` (and the other way round): those engines are built and run by their own runtime's backend,
on the same model and batches, and timed against the run's FP32 reference in the same rounds as the finalists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autotune.backends.base import Backend
from autotune.model.layers import LoadedModel
from autotune.plan import Plan


@dataclass
class OtherArtifact:
    """An engine of another runtime's one-liner, with the backend that built it (and runs and exports it)."""

    backend: Backend
    artifact: Any


class WithOtherReferences:
    """The run's backend, whose one-liners include those of ``others`` (their searching ones left out).

    Every other attribute and method is the run's backend's.

    Args:
        backend: The run's backend.
        others: Backends of other runtimes, not prepared yet.
    """

    def __init__(self, backend: Backend, others: Sequence[Backend]):
        self.backend = backend
        self.others = tuple(others)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def prepare(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Prepares the run's backend, and each other one with the same searched layers.

        The other's one-liners quantize the searched op types; one that cannot build a searched layer takes none,
        and its one-liners fail as references do.
        """
        self.backend.prepare(model, searched)
        for other in self.others:
            try:
                other.prepare(model, searched)
            except ValueError:
                other.prepare(model, ())

    def _owner(self, name: str) -> Backend | None:
        """The other backend that offers the one-liner ``name``, or None where the run's backend does."""
        if name in self.backend.references():
            return None
        return next((o for o in self.others if name in o.references() and name not in o.searching_references), None)

    def references(self) -> tuple[str, ...]:
        """The run's backend's one-liners, then each other runtime's (all but those that search)."""
        own = self.backend.references()
        return own + tuple(
            name
            for other in self.others
            for name in other.references()
            if name not in own and name not in other.searching_references
        )

    def build_reference(self, name: str, calibration: Sequence[Mapping[str, np.ndarray]], workdir: Path) -> Any:
        """The one-liner's engine, built by the runtime that offers it."""
        owner = self._owner(name)
        if owner is None:
            return self.backend.build_reference(name, calibration, workdir)
        return OtherArtifact(owner, owner.build_reference(name, calibration, workdir))

    def _of(self, artifact: Any) -> tuple[Backend, Any]:
        if isinstance(artifact, OtherArtifact):
            return artifact.backend, artifact.artifact
        return self.backend, artifact

    def run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch on the runtime that built the artifact."""
        backend, inner = self._of(artifact)
        return backend.run(inner, feeds)

    def time_run(self, artifact: Any, feeds: Mapping[str, np.ndarray]) -> float:
        """One run's milliseconds, timed as the runtime that built the artifact times it."""
        backend, inner = self._of(artifact)
        return backend.time_run(inner, feeds)

    def time_back_to_back(self, artifact: Any, feeds: Mapping[str, np.ndarray], launches: int) -> float | None:
        """Back-to-back milliseconds per launch where the runtime that built the artifact has such a timer."""
        backend, inner = self._of(artifact)
        return backend.time_back_to_back(inner, feeds, launches)

    def export(self, artifact: Any, plan: Plan, out_dir: Path) -> list[Path]:
        """The deployable files, written by the runtime that built the artifact."""
        backend, inner = self._of(artifact)
        return backend.export(inner, plan, out_dir)
