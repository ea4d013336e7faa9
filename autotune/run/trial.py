"""The result of one trial: a value, whether the build worked or not."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.plan import Plan

OK = "ok"
FAILED = "failed"
TIMEOUT = "timeout"
ONE_LAUNCH = "one launch"
BACK_TO_BACK = "back to back"
TIMINGS = (ONE_LAUNCH, BACK_TO_BACK)
"""The two timings of a confirmed result: one launch at a time (``speedup``, ``latency_ms``), and launches back to
back (``back_to_back_ms``)."""


@dataclass
class TrialResult:
    """Everything measured for one plan.

    Attributes:
        plan: The plan.
        status: ``ok``, ``failed`` (build, run or metric error; crash) or ``timeout``.
        error: What went wrong, for failed trials.
        latency_ms: Median latency of the plan.
        latency_iqr_ms: Its interquartile range.
        reference_latency_ms: Median latency of the FP32 reference timed interleaved in the same process.
        reference_latency_iqr_ms: Its interquartile range.
        speedup: How many times faster than FP32: the median of ``round_speedups``.
        round_speedups: Per round of the protocol, FP32's median latency over the plan's. Plans measured side by
            side share their rounds, so their lists line up: the ratio at one index compares two plans directly.
        accuracy: The configured metric on the plan's outputs.
        reference_accuracy: The same metric for the FP32 reference.
        accuracy_drop: ``reference_accuracy - accuracy``, in the metric's units.
        fidelity: Cosine, top-1 agreement and SNR against the FP32 outputs.
        early_stop: Where the sequential test (:mod:`autotune.harness.sequential`, ``metric.early_stop_alpha``)
            stopped scoring the plan: ``batches`` scored, ``of`` the split's, the drop's lower confidence bound
            ``drop_lower_bound`` there, above the accuracy budget ``budget`` at the level ``alpha``. ``accuracy``,
            ``reference_accuracy``, ``accuracy_drop`` and ``fidelity`` are then those of the scored batches. None
            where every batch was scored.
        score_s: Seconds the plan's outputs took to compute and score (part of ``total_s``).
        build_s: Seconds to rewrite and build.
        build_stages_s: Where ``build_s`` went, stage to seconds, where the backend says (the torch backend's
            ``TorchArtifact.build_stages_s``); empty otherwise.
        total_s: Seconds for the whole trial.
        protocol: The latency protocol used.
        back_to_back_ms: Per launch, timed back to back (``Backend.time_back_to_back``: the median of
            ``BACK_TO_BACK_ROUNDS`` timings of ``BACK_TO_BACK_LAUNCHES`` launches); confirmations only, where the
            backend has such a timer, else None. ``latency_ms`` times one launch at a time.
        reference_back_to_back_ms: FP32's, timed the same way in the same call.
        split: The data the accuracy was measured on.
        busy: How much other work got in the way of the timing (``autotune.measure.interference.Busy.to_dict``); None
            where nothing was timed or read.
        artifact: Path of the built model, when it was kept.
        created_at: Unix time of the measurement.
        from_store: True when the store answered and nothing was built (not persisted).
    """

    plan: Plan
    status: str = OK
    error: str | None = None
    latency_ms: float | None = None
    latency_iqr_ms: float | None = None
    reference_latency_ms: float | None = None
    reference_latency_iqr_ms: float | None = None
    speedup: float | None = None
    round_speedups: list[float] = field(default_factory=list)
    accuracy: float | None = None
    reference_accuracy: float | None = None
    accuracy_drop: float | None = None
    fidelity: dict[str, float] = field(default_factory=dict)
    early_stop: dict[str, Any] | None = None
    score_s: float = 0.0
    build_s: float = 0.0
    build_stages_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    protocol: dict[str, int] = field(default_factory=dict)
    back_to_back_ms: float | None = None
    reference_back_to_back_ms: float | None = None
    split: str = "evaluation"
    busy: dict[str, Any] | None = None
    artifact: str | None = None
    created_at: float = field(default_factory=time.time)
    from_store: bool = False

    @property
    def ok(self) -> bool:
        """The plan built, ran and was scored."""
        return self.status == OK

    @property
    def stopped_early(self) -> bool:
        """Scoring stopped before the split's end, the plan being surely over the budget (``early_stop``)."""
        return self.early_stop is not None

    @property
    def shared(self) -> bool:
        """Other work got in the way of this result's timing (its rounds were extended, or it never went quiet)."""
        return bool(self.busy) and (self.busy.get("contended", 0) > 0 or not self.busy.get("quiet", True))

    @property
    def too_busy(self) -> bool:
        """The machine was too busy for this result's ratio to be trusted (``Busy.quiet`` False)."""
        return bool(self.busy) and not self.busy.get("quiet", True)

    @property
    def plan_hash(self) -> str:
        """The store key."""
        return self.plan.hash

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (without ``from_store``)."""
        data = asdict(self)
        data["plan"] = self.plan.to_dict()
        data["plan_hash"] = self.plan_hash
        data.pop("from_store")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        """Reads ``to_dict`` output."""
        fields = {k: v for k, v in data.items() if k not in ("plan_hash", "from_store")}
        fields["plan"] = Plan.from_dict(data["plan"])
        return cls(**fields)

    @classmethod
    def failure(cls, plan: Plan, error: str, status: str = FAILED, **extra: Any) -> TrialResult:
        """A failed trial: the search records it and goes on."""
        return cls(plan=plan, status=status, error=error, **extra)


def ratio(baseline: TrialResult, ours: TrialResult, timing: str = ONE_LAUNCH) -> float | None:
    """How many times faster ``ours`` runs than ``baseline`` in one timing: the baseline's latency over ours.

    The one definition every report and bench uses. One launch: the quotient of the two speedups over the FP32
    reference, which both were timed against in the same process (``ours.speedup / baseline.speedup`` is
    ``baseline ms / ours ms`` with the machine's drift between their measurements cancelled by FP32). Back to
    back: the quotient of their per-launch medians (``back_to_back_ms``), timed in the same call.

    Args:
        baseline: What a user runs without us (a one-liner), or any other result to compare with.
        ours: The result compared.
        timing: ``ONE_LAUNCH`` or ``BACK_TO_BACK``.

    Returns:
        Above 1 when ours is faster; None where either lacks the timing (a failed trial, a backend without a
        back-to-back timer).

    Raises:
        ValueError: An unknown timing.
    """
    if timing == ONE_LAUNCH:
        if not baseline.speedup or not ours.speedup:
            return None
        return ours.speedup / baseline.speedup
    if timing == BACK_TO_BACK:
        if not baseline.back_to_back_ms or not ours.back_to_back_ms:
            return None
        return baseline.back_to_back_ms / ours.back_to_back_ms
    raise ValueError(f"unknown timing {timing!r}; timings: {', '.join(TIMINGS)}")
