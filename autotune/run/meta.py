"""A run's own metadata, typed: what ``tune`` records in the store beside the trials, read and written here only.

Each field is one key of the store's ``meta`` table (the names older stores and the bench scripts read); the
comparability key, the prior inputs and the self-checks have owners of their own (``autotune.harness``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autotune.run.store import TrialStore


@dataclass(frozen=True)
class RunMeta:
    """The run's metadata.

    Attributes:
        strategy: The strategy the run searches with (a resumed run keeps it).
        imported_from: Earlier run directory to the trials imported from it (``--from``).
        wall_s: Wall seconds of the run so far (set-up, search, confirmation and export), summed over resumes.
        cache_hits: Plans the store answered without a build.
        free_knobs: The free knobs the uniform seeds fixed, name to value.
        fp32_plan_hash: The FP32 reference's plan (``Evaluator.fp32_plan``), confirmed as the FP32 row.
        setup_s: Wall seconds from the command's start to the first build of the search (the latest start of a
            resumed run): the model's analysis and export, the trial process's preparation (calibration, the FP32
            reference) and the timing self-check.
        setup_stages_s: Where ``setup_s`` went, stage to seconds. The trial process's own stages are prefixed
            ``trial_process.``: it starts with the run, loads its backend (``trial_process.backend``, then
            ``trial_process.load_ahead``) while the run analyses the model, and waits for the run
            (``trial_process.waiting_for_the_run``) until the run has the model (``analyze.model``, the part of
            ``analyze`` until then: its ONNX file, or the model loaded and profiled where the backend profiles);
            ``trial_process`` is the run's wait for it after the analysis. ``trial_process.calibration`` is what
            the calibration took beyond ``trial_process.fp32_build`` where ONNX Runtime calibrates beside the
            build, and all of it where the backend gathers the statistics on its device after the build.
        time_s: Where the last session's wall time went: ``setup``, ``search``, ``confirmation``, ``export``.
        confirmation_cut: What the last session's confirmation gave up to fit ``budget.minutes``, or None.
        confirmation_allowance_s: The seconds the last session's confirmation was sized to: what ``budget.minutes``
            left it, or without it a share of the search's seconds (``autotune.harness.deadline``).
        search_split_s: Where the last session's search time went: ``trials`` (building, scoring and timing
            plans) and ``strategy`` (the rest: the policy's rollouts, rehearsals and updates, the planner's model).
        backend_choice: Where the config said ``backend.name: auto``, the runtime chosen and the timings that chose
            it (``autotune.harness.runtime_choice.RuntimeChoice``); None where the config named one.
    """

    strategy: str | None = None
    imported_from: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    cache_hits: int = 0
    free_knobs: dict[str, Any] = field(default_factory=dict)
    fp32_plan_hash: str | None = None
    setup_s: float | None = None
    setup_stages_s: dict[str, float] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)
    confirmation_cut: str | None = None
    confirmation_allowance_s: float | None = None
    search_split_s: dict[str, float] = field(default_factory=dict)
    backend_choice: dict[str, Any] | None = None

    @classmethod
    def read(cls, store: TrialStore) -> RunMeta:
        """The metadata in ``store`` (a field never written has its default)."""
        defaults = cls()
        return cls(**{f.name: store.get_meta(f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)})

    @staticmethod
    def write(store: TrialStore, **values: Any) -> None:
        """Writes the given fields to ``store``.

        Raises:
            TypeError: A name is not a field of :class:`RunMeta`.
        """
        names = {f.name for f in dataclasses.fields(RunMeta)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"not run metadata: {unknown}; fields: {sorted(names)}")
        for name, value in values.items():
            store.set_meta(name, value)

    @staticmethod
    def count_cache_hit(store: TrialStore) -> None:
        """One more plan answered by the store."""
        store.set_meta("cache_hits", int(store.get_meta("cache_hits", 0)) + 1)
