"""The latency protocol: warm-up after every switch, repeats, rounds, and the reference interleaved."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Protocol:
    """How a latency was measured; stored with every result.

    Attributes:
        warmup: Untimed runs after every switch between candidate and reference.
        repeats: Timed runs per round and side.
        rounds: Alternations (reference, candidate) per measurement.
    """

    warmup: int = 3
    repeats: int = 10
    rounds: int = 2

    def to_dict(self) -> dict[str, int]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class Latency:
    """A candidate's latency against the reference timed in the same process.

    Attributes:
        median_ms: Median of the candidate's timed runs.
        iqr_ms: Interquartile range of the candidate's runs.
        reference_median_ms: Median of the reference's runs, interleaved with the candidate's.
        reference_iqr_ms: Interquartile range of the reference's runs.
        round_speedups: Per round, the reference's median over the candidate's median.
    """

    median_ms: float
    iqr_ms: float
    reference_median_ms: float
    reference_iqr_ms: float
    round_speedups: tuple[float, ...] = ()

    @property
    def speedup(self) -> float:
        """How many times faster than the reference: the median of the per-round ratios.

        Each round's ratio compares runs seconds apart, so a slow spell of the machine (another process, a
        frequency change) that lasts a round cancels inside it instead of skewing the pooled medians.
        """
        if self.round_speedups:
            return float(np.median(self.round_speedups))
        return self.reference_median_ms / self.median_ms


def _stats(samples: list[float]) -> tuple[float, float]:
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return float(median), float(q3 - q1)


def _timed(
    run: Callable[[], object], protocol: Protocol, clock: Callable[[], float], self_timed: bool = False
) -> list[float]:
    for _ in range(protocol.warmup):
        run()
    times = []
    for _ in range(protocol.repeats):
        if self_timed:
            times.append(float(run()))  # type: ignore[arg-type]
            continue
        start = clock()
        run()
        times.append((clock() - start) * 1e3)
    return times


def interleaved(
    candidate: Callable[[], object],
    reference: Callable[[], object],
    protocol: Protocol,
    clock: Callable[[], float] = time.perf_counter,
    self_timed: bool = False,
) -> Latency:
    """Times the candidate and the reference alternately, so machine drift hits both alike.

    Args:
        candidate: Runs the candidate once.
        reference: Runs the reference once.
        protocol: Warm-up, repeats and rounds.
        clock: Seconds; injectable for tests.
        self_timed: The runners return their own elapsed milliseconds (e.g. GPU events) and ``clock`` is unused.

    Returns:
        Medians and IQRs of both sides.
    """
    candidate_ms: list[float] = []
    reference_ms: list[float] = []
    ratios = []
    for _ in range(protocol.rounds):
        reference_round = _timed(reference, protocol, clock, self_timed)
        candidate_round = _timed(candidate, protocol, clock, self_timed)
        ratios.append(float(np.median(reference_round) / np.median(candidate_round)))
        reference_ms += reference_round
        candidate_ms += candidate_round
    median, iqr = _stats(candidate_ms)
    reference_median, reference_iqr = _stats(reference_ms)
    return Latency(median, iqr, reference_median, reference_iqr, tuple(ratios))
