"""The latency protocol: warm-up after every switch, repeats, rounds, and the reference interleaved.

One candidate against the reference, the reference first in every round (``interleaved``), or any number of
candidates in the same rounds, the order rotating (``side_by_side``: every trial, with its one plan; a run's
finalists; the plans ``autotune evaluate`` compares).

Only quiet rounds count. On a shared 2-vCPU VM the host takes a core for spells of 0.1 s to 9 s; in such a spell a
two-thread ONNX Runtime session of the 3 ms CNN runs INT8 slower than FP32, so the ratio itself moves (1.82x
quiet, 1.65-1.81x in the spells: ``bench/research/timing_trace.py``) and no interleaving cancels it. The reference's
pace tells the spells apart: a round counts when its reference ran within ``quiet_band`` of the fastest reference
round this process has timed (``ReferencePace``), the measurement goes on until ``rounds`` such rounds are in, and the
process first times for ``settle_s`` seconds, long enough to have seen the machine quiet.
"""

from __future__ import annotations

import math
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
        rounds: Quiet rounds (reference, candidate) per measurement; with ``quiet_band`` None, rounds.
        quiet_band: A round counts when its reference median is within this fraction of the fastest reference
            round of the process (``ReferencePace``); None: every round counts.
        settle_s: Wall seconds the process times before its fastest reference round is trusted as the machine's
            quiet pace: the first measurement of a process times at least this long.
        max_rounds: Rounds after which a measurement that has settled stops with fewer quiet rounds than
            ``rounds`` (then the rounds of the fastest reference count); None: four times ``rounds``.
    """

    warmup: int = 2
    repeats: int = 5
    rounds: int = 4
    quiet_band: float | None = 0.05
    settle_s: float = 5.0
    max_rounds: int | None = None

    def to_dict(self) -> dict[str, int | float | None]:
        """A JSON-ready dict."""
        return asdict(self)

    @property
    def round_limit(self) -> int:
        """The rounds after which a settled measurement stops, quiet or not."""
        return max(self.rounds, self.max_rounds if self.max_rounds is not None else 4 * self.rounds)


SETTLE_ROUNDS = 1000
"""Rounds after which a process has settled however short they were: a model that runs in microseconds would take
hundreds of thousands of rounds to fill ``settle_s``."""


class ReferencePace:
    """How fast the reference has run in this process: its fastest round, and how long the process has timed.

    One per process (``TrialRunner``), shared by its measurements, so a trial timed during a slow spell of the
    machine knows that the spell is one: its reference rounds are slower than the fastest this process has seen.

    Args:
        clock: Seconds of wall time; injectable for tests.

    Attributes:
        fastest_ms: The fastest reference round median so far.
        timed_s: Wall seconds of rounds timed so far.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.fastest_ms = math.inf
        self.timed_s = 0.0
        self.rounds = 0

    def add(self, reference_round_ms: float, round_s: float) -> None:
        """Records one round: its reference median and the wall seconds it took."""
        self.fastest_ms = min(self.fastest_ms, reference_round_ms)
        self.timed_s += round_s
        self.rounds += 1

    def settled(self, settle_s: float) -> bool:
        """The process has timed ``settle_s`` seconds, or ``SETTLE_ROUNDS`` rounds of a model of microseconds."""
        return self.timed_s >= settle_s or self.rounds >= SETTLE_ROUNDS

    def quiet(self, reference_rounds_ms: Sequence[float], band: float | None) -> list[int]:
        """The indices of the rounds whose reference ran within ``band`` of the fastest (all with None)."""
        if band is None:
            return list(range(len(reference_rounds_ms)))
        return [i for i, ms in enumerate(reference_rounds_ms) if ms <= self.fastest_ms * (1.0 + band)]


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
    pace: ReferencePace | None = None,
) -> Latency:
    """Times the candidate and the reference alternately, so machine drift hits both alike.

    Args:
        candidate: Runs the candidate once.
        reference: Runs the reference once.
        protocol: Warm-up, repeats and rounds.
        clock: Seconds; injectable for tests.
        self_timed: The runners return their own elapsed milliseconds (e.g. GPU events) and ``clock`` is unused.
        pace: The process's reference pace; None: a fresh one (the measurement settles on its own).

    Returns:
        Medians and IQRs of both sides, over the quiet rounds.
    """
    return _rounds([reference, candidate], lambda _: [0, 1], protocol, clock, self_timed, pace)[0]


def side_by_side(
    candidates: Sequence[Callable[[], object]],
    reference: Callable[[], object],
    protocol: Protocol,
    clock: Callable[[], float] = time.perf_counter,
    self_timed: bool = False,
    pace: ReferencePace | None = None,
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
        pace: The process's reference pace; None: a fresh one (the measurement settles on its own).

    Returns:
        One ``Latency`` per candidate, in order, each against the reference of the same (quiet) rounds.
    """
    runners = [reference, *candidates]
    count = len(runners)

    def rotated(index: int) -> list[int]:
        return [(index + k) % count for k in range(count)]

    return _rounds(runners, rotated, protocol, clock, self_timed, pace)


def _rounds(
    runners: Sequence[Callable[[], object]],
    order: Callable[[int], list[int]],
    protocol: Protocol,
    clock: Callable[[], float],
    self_timed: bool,
    pace: ReferencePace | None,
) -> list[Latency]:
    """Times ``runners`` (the reference first) round by round in ``order(round)`` until enough rounds are quiet.

    Returns:
        A Latency per candidate, over the rounds that count (``_counted``), in the order they were timed.
    """
    pace = pace if pace is not None else ReferencePace()
    blocks: list[list[list[float]]] = [[] for _ in runners]  # per runner, per round: the timed runs
    reference_rounds: list[float] = []  # per round, the reference's median
    while True:
        started = pace.clock()
        for runner in order(len(reference_rounds)):
            blocks[runner].append(_timed(runners[runner], protocol, clock, self_timed))
        reference_rounds.append(float(np.median(blocks[0][-1])))
        pace.add(reference_rounds[-1], pace.clock() - started)
        counted = _counted(reference_rounds, protocol, pace)
        if counted is not None:
            break
    reference = [blocks[0][i] for i in counted]
    reference_median, reference_iqr = _stats([ms for block in reference for ms in block])
    latencies = []
    for runner in range(1, len(runners)):
        candidate = [blocks[runner][i] for i in counted]
        median, iqr = _stats([ms for block in candidate for ms in block])
        ratios = tuple(float(np.median(r) / np.median(c)) for r, c in zip(reference, candidate, strict=True))
        latencies.append(Latency(median, iqr, reference_median, reference_iqr, ratios))
    return latencies


def _counted(reference_rounds_ms: list[float], protocol: Protocol, pace: ReferencePace) -> list[int] | None:
    """The rounds that count once the measurement may stop, or None while it goes on.

    It stops once ``protocol.rounds`` rounds are quiet and the process has settled; at ``round_limit`` (settled)
    with fewer, the ``protocol.rounds`` rounds of the fastest reference count: the machine was in a long spell.
    """
    timed = len(reference_rounds_ms)
    if timed < protocol.rounds or not pace.settled(protocol.settle_s):
        return None
    quiet = pace.quiet(reference_rounds_ms, protocol.quiet_band)
    if len(quiet) >= protocol.rounds:
        return quiet
    if timed < protocol.round_limit:
        return None
    fastest = sorted(range(timed), key=lambda i: reference_rounds_ms[i])[: protocol.rounds]
    return sorted(fastest)


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
