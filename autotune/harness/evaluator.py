"""The one evaluation harness every strategy uses: the trial store first, then a real build."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.backends import BuildError
from autotune.config import TuneConfig
from autotune.harness.process import ChildRunner
from autotune.harness.runner import TrialRunner
from autotune.measure import Protocol
from autotune.plan import Plan
from autotune.store import TrialStore
from autotune.trial import FAILED, TIMEOUT, TrialResult


class Evaluator:
    """The one evaluation harness every strategy uses: store first, then a real build.

    Args:
        config: The run's config.
        store: The run's trial store.
        isolate: Run trials in a child process with a timeout (default). In-process runs are for tests.
        on_result: Called with every new result (not with store hits).

    Use an evaluator from the thread that created it: on Linux its trial process ends when that thread ends.
    """

    def __init__(
        self,
        config: TuneConfig,
        store: TrialStore,
        isolate: bool = True,
        on_result: Callable[[TrialResult], None] | None = None,
    ):
        self.config = config
        self.store = store
        self.on_result = on_result
        # Every stored trial but an imported one is one build, so the count survives a kill between commit and
        # bookkeeping.
        self.builds = store.builds()
        self.cache_hits = 0
        self._inline: TrialRunner | None = None
        self._child: ChildRunner | None = None
        if isolate:
            self._child = ChildRunner(config, setup_timeout_s=max(600.0, 2 * config.backend.timeout_s))
            self._child.start()
        else:
            self._inline = TrialRunner(config)

    def close(self) -> None:
        """Stops the child process."""
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: Plan, split: str, protocol: Protocol | None) -> TrialResult:
        if self._inline is not None:
            return self._inline.run(plan, split, protocol)
        payload = (plan.to_dict(), split, protocol.to_dict() if protocol else None)
        status, data = self._child.request("trial", payload, self.config.backend.timeout_s)
        if status == "result":
            return TrialResult.from_dict(data)
        return TrialResult.failure(plan, data, status=TIMEOUT if status == "timeout" else FAILED, split=split)

    def evaluate(self, plan: Plan) -> TrialResult:
        """The plan's result on the evaluation data: from the store, or built, measured and committed."""
        stored = self.store.get(plan.hash)
        if stored is not None:
            self.cache_hits += 1
            return stored
        result = self._run(plan, "evaluation", None)
        self.store.put(result)
        self.builds = self.store.builds()
        if self.on_result is not None:
            self.on_result(result)
        return result

    def measure(self, plan: Plan, split: str = "evaluation", protocol: Protocol | None = None) -> TrialResult:
        """Builds and measures a plan afresh, bypassing the store."""
        return self._run(plan, split, protocol)

    def confirm(self, plan: Plan) -> TrialResult:
        """Re-measures a finalist on held-out data with the longer confirmation protocol, and stores it.

        A reference plan (one of the backend's one-liners) is measured the same way and stored apart from the
        finalists (``TrialStore.put_reference``): never a build of the search, never a candidate for export.
        """
        confirm = self.config.confirm
        protocol = Protocol(warmup=self.config.measure.warmup, repeats=confirm.repeats, rounds=confirm.rounds)
        result = self._run(plan, "holdout", protocol)
        if plan.reference is not None:
            self.store.put_reference(result)
        else:
            self.store.put_confirmation(result)
        return result

    def references(self) -> tuple[str, ...]:
        """The backend's one-liners (``Backend.references``), as the trial process's backend offers them."""
        if self._inline is not None:
            return self._inline.backend.references()
        status, data = self._child.request("references", None, self.config.backend.timeout_s)
        if status != "result":
            raise BuildError(f"cannot list the backend's references: {data}")
        return tuple(data)

    def layerwise_errors(self) -> dict | None:
        """The layerwise calibration's choices and single-layer output errors (``methods``, ``errors``), or None.

        None when the run does not offer ``layerwise`` calibration, or the trial process cannot answer.
        """
        if self._inline is not None:
            choices = self._inline.layerwise
            return None if choices is None else {"methods": choices.methods, "errors": choices.errors}
        status, data = self._child.request("layerwise", None, self.config.backend.timeout_s)
        return data if status == "result" else None

    def export(self, plan: Plan, out_dir: Path) -> list[str]:
        """Writes a plan's deployable files."""
        out_dir.mkdir(parents=True, exist_ok=True)
        if self._inline is not None:
            return self._inline.export(plan, out_dir)
        status, data = self._child.request("export", (plan.to_dict(), str(out_dir)), self.config.backend.timeout_s)
        if status != "result":
            raise BuildError(f"export failed: {data}")
        return data
