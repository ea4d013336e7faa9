"""The latency protocol: warm-up after every switch, repeats, rounds, and the reference interleaved.

One candidate against the reference, the reference first in every round (``interleaved``), or any number of
candidates in the same rounds, the order rotating (``side_by_side``: every trial, with its one plan; a run's
finalists; the plans ``autotune evaluate`` compares).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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

    warmup: int = 2
    repeats: int = 5
    rounds: int = 4

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
    return _rounds([reference, candidate], lambda _: [0, 1], protocol, clock, self_timed)[0]


def side_by_side(
    candidates: Sequence[Callable[[], object]],
    reference: Callable[[], object],
    protocol: Protocol,
    clock: Callable[[], float] = time.perf_counter,
    self_timed: bool = False,
) -> list[Latency]:
    """Times several candidates and the reference in turn within every round, the order rotating each round.

    Plans measured one after another, each against its own reference, are compared across minutes of machine
    drift: on a 2-vCPU VM the same MiniLM plan moved by up to 20 % between such passes. Inside one round the
    runners are timed seconds apart, and every candidate's ratio of a round has the same reference median, so the
    ratio of two candidates' ``round_speedups`` at the same index compares them directly. Rotating the order
    (round r starts at runner r) keeps a place in the round (first after the reference, last before it) from
    favouring one runner.

    Args:
        candidates: Each runs one candidate once.
        reference: Runs the reference once.
        protocol: Warm-up (after every switch), repeats and rounds.
        clock: Seconds; injectable for tests.
        self_timed: The runners return their own elapsed milliseconds and ``clock`` is unused.

    Returns:
        One ``Latency`` per candidate, in order, each against the reference of the same rounds.
    """
    runners = [reference, *candidates]
    count = len(runners)
    return _rounds(runners, lambda r: [(r + k) % count for k in range(count)], protocol, clock, self_timed)


def _rounds(
    runners: Sequence[Callable[[], object]],
    order: Callable[[int], list[int]],
    protocol: Protocol,
    clock: Callable[[], float],
    self_timed: bool,
) -> list[Latency]:
    """Times ``runners`` (the reference first) round by round in ``order(round)``; a Latency per candidate."""
    samples: list[list[float]] = [[] for _ in runners]
    round_medians: list[list[float]] = [[] for _ in runners]
    for index in range(protocol.rounds):
        for runner in order(index):
            timed = _timed(runners[runner], protocol, clock, self_timed)
            samples[runner] += timed
            round_medians[runner].append(float(np.median(timed)))
    reference_median, reference_iqr = _stats(samples[0])
    latencies = []
    for runner in range(1, len(runners)):
        median, iqr = _stats(samples[runner])
        ratios = tuple(r / c for r, c in zip(round_medians[0], round_medians[runner], strict=True))
        latencies.append(Latency(median, iqr, reference_median, reference_iqr, ratios))
    return latencies


def compare_rounds(candidate: Sequence[float], baseline: Sequence[float]) -> tuple[float, int] | None:
    """How much faster ``candidate`` ran than ``baseline`` when the two were timed side by side.

    Args:
        candidate: A plan's per-round speedups over FP32 (``Latency.round_speedups``).
        baseline: Another plan's, from the same rounds.

    Returns:
        The median over the rounds of candidate over baseline, and in how many rounds the candidate was the
        faster; None when the two do not share their rounds (different lengths, or none).
    """
    if not candidate or len(candidate) != len(baseline):
        return None
    ratios = [c / b for c, b in zip(candidate, baseline, strict=True)]
    return float(np.median(ratios)), sum(ratio > 1 for ratio in ratios)


SELF_CHECK_BAND = (0.97, 1.03)
"""Where FP32 timed against itself must read for a run's ratios to be trusted as they are."""


@dataclass(frozen=True)
class SelfCheck:
    """FP32 timed against FP32 by the run's own protocol: what the protocol reads for no difference at all.

    A second FP32 session is timed as a candidate against the reference, so every cause of a false ratio (another
    session's threads on the cores, a slow spell, the order in a round) shows up as a ratio away from 1.

    Attributes:
        ratio: The self-ratio: the median of the per-round ratios (1 when the protocol is true).
        low: The smallest per-round ratio.
        high: The largest per-round ratio.
        rounds: How many rounds it was timed in.
        spread: Half the interquartile range of the per-round ratios.
    """

    ratio: float
    low: float
    high: float
    rounds: int
    spread: float

    @classmethod
    def of(cls, speedup: float, round_speedups: Sequence[float]) -> SelfCheck:
        """The self-check of an FP32 plan's measurement against the FP32 reference."""
        rounds = list(round_speedups) or [speedup]
        q1, q3 = np.percentile(rounds, [25, 75])
        return cls(float(speedup), float(min(rounds)), float(max(rounds)), len(rounds), float(q3 - q1) / 2)

    @property
    def noise(self) -> float:
        """The relative difference the protocol reads between equal plans: a larger one is a measured difference.

        The larger of the self-ratio's distance from 1 and half the interquartile range of its rounds: the
        speedup is a median over rounds, so one round spoilt by a slow spell moves it little, and moves this
        little too (the full range would make one such round the run's noise).
        """
        return max(abs(1.0 - self.ratio), self.spread)

    @property
    def within_band(self) -> bool:
        """The self-ratio lies in ``SELF_CHECK_BAND``."""
        low, high = SELF_CHECK_BAND
        return low <= self.ratio <= high

    def describe(self) -> str:
        """One line: the self-ratio, its rounds' range, and whether it is within the band."""
        low, high = SELF_CHECK_BAND
        verdict = "within" if self.within_band else "outside"
        return (
            f"FP32 against itself {self.ratio:.3f}x (rounds {self.low:.3f}-{self.high:.3f}, {self.rounds} rounds), "
            f"{verdict} [{low}, {high}]"
        )

    def to_dict(self) -> dict[str, float | int]:
        """A JSON-ready dict, with the noise."""
        return {**asdict(self), "noise": self.noise, "within_band": self.within_band}

    @classmethod
    def from_dict(cls, data: dict) -> SelfCheck:
        """The inverse of ``to_dict``."""
        return cls(
            float(data["ratio"]), float(data["low"]), float(data["high"]), int(data["rounds"]), float(data["spread"])
        )


def ties_within(speedups: Sequence[float], noise: float) -> list[int]:
    """The indices of the speedups a protocol of this relative noise cannot tell from the fastest.

    Args:
        speedups: Speedups over FP32 of the same rounds or protocol.
        noise: Relative noise (``SelfCheck.noise``); 0 ties only equal speedups.

    Returns:
        Indices in the given order, the fastest among them.
    """
    if not speedups:
        return []
    fastest = max(speedups)
    return [index for index, speedup in enumerate(speedups) if speedup * (1.0 + noise) >= fastest]
