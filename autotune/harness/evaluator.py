"""The one evaluation harness every strategy uses: the trial store first, then a real build."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.backends import BuildError
from autotune.config.schema import ExecutionConfig, TuneConfig
from autotune.harness.executor import Pool, make_pool
from autotune.harness.process import ChildRunner, forms_of
from autotune.harness.runner import TrialRunner, confirmation_protocol
from autotune.measure.timing import Protocol
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import FAILED, TIMEOUT, TrialResult


class Evaluator:
    """The one evaluation harness every strategy uses: store first, then a real build.

    Args:
        config: The run's config: the whole of it travels to the trial process or to each worker of the pool, which
            prepares the run from it; here it reads ``execution``, ``backend.timeout_s``, ``measure``, ``confirm``
            and the accuracy budget.
        store: The run's trial store.
        isolate: Run trials in a child process with a timeout (default). In-process runs are for tests.
        on_result: Called with every new result (not with store hits).
        started: A trial process already launched for this config (``one_trial_process``), taken over here.

    With ``execution.workers`` above 1 (or ``execution.backend: ray``) trials run on a pool of workers
    (:mod:`autotune.harness.executor`): ``evaluate_many`` keeps them all busy; everything else runs on one worker.

    Use an evaluator from the thread that created it: on Linux its trial process ends when that thread ends.
    """

    def __init__(  # takes the whole config: it ships it to the trial process or the pool's workers it starts
        self,
        config: TuneConfig,
        store: TrialStore,
        isolate: bool = True,
        on_result: Callable[[TrialResult], None] | None = None,
        started: ChildRunner | None = None,
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
        self._pool: Pool | None = None
        if isolate and not self.one_trial_process(config.execution):
            self._pool = make_pool(config)
            try:
                self._pool.start()
            except BaseException:
                self._pool.close()
                raise
        elif isolate:
            self._child = started or ChildRunner(config)
            try:
                if started is None:
                    self._child.launch()
                self._child.await_ready()
            except BaseException:
                self._child.stop()
                raise
        else:
            self._inline = TrialRunner(config)

    @staticmethod
    def one_trial_process(execution: ExecutionConfig, isolate: bool = True) -> bool:
        """An ``Evaluator`` with these settings runs its trials in one trial process (not in-process, not a pool).

        Such a process may be started before the run needs it (``ChildRunner.launch(gated=True)``) and handed to the
        evaluator (``started``): it loads the backend while the run analyses and exports the model.
        """
        return isolate and execution.workers == 1 and execution.backend == "local"

    @property
    def setup_stages_s(self) -> dict[str, float]:
        """Where the trial process's set-up went (``TrialRunner.setup_stages_s``); empty for a pool of workers."""
        if self._inline is not None:
            return dict(self._inline.setup_stages_s)
        if self._child is not None:
            return dict(self._child.setup_stages_s)
        return {}

    def close(self) -> None:
        """Stops the child process."""
        if self._child is not None:
            self._child.stop()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, kind: str, payload: Any) -> tuple[str, Any]:
        if self._pool is not None:
            return self._pool.call(kind, payload)
        return self._child.request(kind, payload, self.config.backend.timeout_s)

    def _run(self, plan: Plan, split: str, protocol: Protocol | None, sequential: bool = False) -> TrialResult:
        if self._inline is not None:
            return self._inline.run(plan, split, protocol, sequential)
        payload = (plan.to_dict(), split, protocol.to_dict() if protocol else None, sequential)
        status, data = self._request("trial", payload)
        return _result(plan, split, status, data)

    def _stored(self, plan: Plan) -> TrialResult | None:
        """The store's result of a plan, unless its scoring stopped early at a budget below this run's.

        A trial stopped early (``TrialResult.early_stop``) is over the budget it was tested against: a run with a
        larger budget (an earlier run's trials imported, a run resumed with another budget) scores the plan afresh,
        lest a plan that may be a finalist rest on part of the split.
        """
        stored = self.store.get(plan.hash)
        if stored is not None and stored.stopped_early:
            if stored.early_stop.get("drop_lower_bound", -float("inf")) <= self.config.accuracy_budget:
                return None
        return stored

    def _commit(self, result: TrialResult) -> None:
        self.store.put(result)
        self.builds = self.store.builds()
        if self.on_result is not None:
            self.on_result(result)

    def evaluate(self, plan: Plan) -> TrialResult:
        """The plan's result on the evaluation data: from the store, or built, measured and committed.

        Its scoring stops early where it is surely over the budget (``metric.early_stop_alpha``,
        :mod:`autotune.harness.sequential`).
        """
        stored = self._stored(plan)
        if stored is not None:
            self.cache_hits += 1
            return stored
        result = self._run(plan, "evaluation", None, sequential=True)
        self._commit(result)
        return result

    @property
    def workers(self) -> int:
        """Trials that can run at once."""
        return self._pool.size if self._pool is not None else 1

    def evaluate_many(self, plans: Sequence[Plan], limit: int | None = None) -> Iterator[TrialResult]:
        """Results of several plans: store hits first, then the builds, on every worker, in the order they end.

        Each is scored as ``evaluate`` scores it (stopping early where it is surely over the budget).

        Each new result is committed to the store as it lands. Consume the iterator to its end: a build whose
        result is not read is abandoned.

        Args:
            plans: The plans; a plan given twice is evaluated once and yielded once.
            limit: At most this many new builds; the plans past it are left out (not yielded).
        """
        fresh: list[Plan] = []
        for plan in dict((plan.hash, plan) for plan in plans).values():
            stored = self._stored(plan)
            if stored is not None:
                self.cache_hits += 1
                yield stored
            elif limit is None or len(fresh) < limit:
                fresh.append(plan)
        if self._pool is None:
            for plan in fresh:
                yield self.evaluate(plan)
            return
        requests = [("trial", (plan.to_dict(), "evaluation", None, True)) for plan in fresh]
        for index, (status, data) in self._pool.map(requests):
            result = _result(fresh[index], "evaluation", status, data)
            self._commit(result)
            yield result

    def measure(self, plan: Plan, split: str = "evaluation", protocol: Protocol | None = None) -> TrialResult:
        """Builds and measures a plan afresh, bypassing the store."""
        return self._run(plan, split, protocol)

    def measure_side_by_side(
        self, plans: Sequence[Plan], split: str = "evaluation", protocol: Protocol | None = None
    ) -> list[TrialResult]:
        """Builds several plans afresh in one trial process and times them against FP32 in the same rounds.

        Bypasses the store. When the trial process fails as a whole (a crash, a timeout), each plan is measured
        alone, so one plan that takes the process down costs the others nothing.

        Returns:
            One result per plan, in order.
        """
        if len(plans) < 2:
            return [self._run(plan, split, protocol) for plan in plans]
        if self._inline is not None:
            return self._inline.run_side_by_side(plans, split, protocol)
        payload = ([plan.to_dict() for plan in plans], split, protocol.to_dict() if protocol else None)
        timeout_s = self.config.backend.timeout_s * len(plans)  # the work of one trial per plan
        if self._pool is not None:
            status, data = self._pool.call("side_by_side", payload, timeout_s)
        else:
            status, data = self._child.request("side_by_side", payload, timeout_s)
        if status == "result":
            return [TrialResult.from_dict(item) for item in data]
        return [self._run(plan, split, protocol) for plan in plans]

    def confirm(self, plan: Plan) -> TrialResult:
        """Re-measures a finalist on held-out data with the longer confirmation protocol, and stores it."""
        return self.confirm_side_by_side([plan])[0]

    def confirm_side_by_side(
        self, plans: Sequence[Plan], rounds: int | None = None, stop_at: float | None = None
    ) -> list[TrialResult]:
        """Re-measures finalists on held-out data with the confirmation protocol, all in the same rounds; stores them.

        Confirmed one after another, the same plan moves between passes minutes apart by more than finalists
        differ (docs/measurement.md#ranking-and-confirming-the-finalists); in the same rounds, machine drift falls
        on all of them alike. A reference plan (one
        of the backend's one-liners) is measured among them and stored apart from the finalists
        (``TrialStore.put_reference``): never a build of the search, never a candidate for export.

        Args:
            plans: The plans to confirm.
            rounds: Rounds instead of ``confirm.rounds`` (more where the run's timing self-check read noise).
            stop_at: The wall time by which the timing stops, whatever the rounds (``Protocol.stop_at``).
        """
        protocol = replace(confirmation_protocol(self.config.measure, self.config.confirm, rounds), stop_at=stop_at)
        results = self.measure_side_by_side(plans, "holdout", protocol)
        for plan, result in zip(plans, results, strict=True):
            if plan.reference is not None:
                self.store.put_reference(result)
            else:
                self.store.put_confirmation(result)
        return results

    def fp32_plan(self) -> Plan:
        """The plan the trial process built its FP32 reference from (``TrialRunner.fp32_plan``).

        The timing self-checks and the confirmation's FP32 row time this plan, which is the reference itself where
        the backend ``reuses_fp32_build``.

        Raises:
            BuildError: The trial process cannot answer.
        """
        if self._inline is not None:
            return self._inline.fp32_plan
        status, data = self._request("fp32_plan", None)
        if status != "result":
            raise BuildError(f"cannot read the FP32 reference's plan: {data}")
        return Plan.from_dict(data)

    def references(self) -> tuple[str, ...]:
        """The backend's one-liners (``Backend.references``), as the trial process's backend offers them."""
        if self._inline is not None:
            return self._inline.backend.references()
        status, data = self._request("references", None)
        if status != "result":
            raise BuildError(f"cannot list the backend's references: {data}")
        return tuple(data)

    def int8_arithmetic(self) -> dict[str, Any] | None:
        """The INT8 scheme the trial process's backend lowers to and why (``Backend.int8_arithmetic``).

        None where the backend does not say or the trial process cannot answer.
        """
        if self._inline is not None:
            return self._inline.backend.int8_arithmetic()
        status, data = self._request("int8_arithmetic", None)
        return data if status == "result" else None

    def layerwise_errors(self) -> dict | None:
        """The layerwise calibration's choices and single-layer output errors (``methods``, ``errors``), or None.

        None when the run does not offer ``layerwise`` calibration, or the trial process cannot answer.
        """
        if self._inline is not None:
            choices = self._inline.layerwise
            if choices is None:
                return None
            return {"methods": choices.methods, "errors": choices.errors, "forms": forms_of(self._inline)}
        status, data = self._request("layerwise", None)
        return data if status == "result" else None

    def export(self, plan: Plan, out_dir: Path) -> list[str]:
        """Writes a plan's deployable files."""
        out_dir.mkdir(parents=True, exist_ok=True)
        if self._inline is not None:
            return self._inline.export(plan, out_dir)
        # a worker of a pool may run in another folder: it gets the absolute path
        target = str(out_dir.resolve()) if self._pool is not None else str(out_dir)
        status, data = self._request("export", (plan.to_dict(), target))
        if status != "result":
            raise BuildError(f"export failed: {data}")
        return data


def _result(plan: Plan, split: str, status: str, data: Any) -> TrialResult:
    """A worker's answer as a trial result: a crash, a timeout or an error is a failed trial with its message."""
    if status == "result":
        return TrialResult.from_dict(data)
    return TrialResult.failure(plan, data, status=TIMEOUT if status == "timeout" else FAILED, split=split)
