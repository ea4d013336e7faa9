"""How far a measured speedup can be trusted: the protocol's own noise, ties within it, plans compared by round.

``autotune.measure.timing`` times plans; this reads what it timed. FP32 timed against itself by the run's own protocol
(``SelfCheck``) says how large a difference the protocol reads between equal plans; speedups closer than that are
ties (``ties_within``); two plans timed in the same rounds compare round by round (``compare_rounds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


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
