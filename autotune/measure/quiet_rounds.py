"""Which rounds of a measurement count: the machine's quiet pace, and the bands a round must keep to.

``autotune.measure.timing`` times the rounds; this judges them. The reference's pace (``ReferencePace``) says whether a
measurement lies in a slow spell of the machine; within a measurement, a round counts for a plan when the reference
ran within the machine's own band of its fastest round and the plan near its own pace (``quiet_rows``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

OUTLIER_BAND = 0.25
"""How far above its own lower quartile of rounds a plan's round may run and still count for it (``quiet_rows``)."""

SPREAD_BANDS = 2.0
"""The reference's band is at least this many times the excess of its median round over its fastest
(``spread_band``)."""

SPREAD_MIN_ROUNDS = 8
"""Clear rounds a measurement needs before its own spread can widen the band: a few rounds half in a spell would
read the spell as the spread."""

SPELL_BAND = 0.10
"""How much slower than the machine's quiet pace (``ReferencePace.quiet_ms``) a measurement's fastest reference round
may run before the whole measurement is taken to lie in a slow spell: a VM's spells slowed FP32 by more than this, and
all-INT8 by more still, while an idle machine's pace drifts by a few per cent over minutes, which the measurement's own
band takes (docs/measurement.md#quiet-rounds)."""

PACE_WINDOW_S = 60.0
"""Seconds of wall time over which a process's fastest reference round sets its quiet pace: a machine's pace drifts
over minutes (clocks, the host's load), so a round from ten minutes ago is no measure of a spell now. The pace
remembered from earlier processes counts only within a process's first window."""

WINDOW_ROUNDS = 1000
"""The most rounds of the last ``PACE_WINDOW_S`` a pace keeps to read its scatter (``ReferencePace.spell_band``)."""

SETTLE_ROUNDS = 1000
"""Rounds after which a process has settled however short they were: a model that runs in microseconds would take
hundreds of thousands of rounds to fill ``settle_s``."""


class ReferencePace:
    """How fast the reference has run: its fastest round in this process, and in earlier processes on this machine.

    One per process (``TrialRunner``), shared by its measurements, so a trial timed during a slow spell of the
    machine knows that the spell is one: its reference rounds are slower than the fastest this process has seen.
    A spell can outlast a whole process: on a VM FP32 ran slower, and all-INT8 more, for seconds at a time, some as
    long as ``autotune evaluate`` times. A process that starts in one has no quiet round of its own to
    compare with, so it starts from ``remembered_ms``, the fastest earlier processes timed the same reference at
    on this machine (``autotune.measure.pace``).

    Args:
        clock: Seconds of wall time; injectable for tests.
        remembered_ms: The reference's quiet round median on this machine from earlier processes; None: none known.

    Attributes:
        fastest_ms: The fastest reference round median of this process so far.
        timed_s: Wall seconds of rounds timed so far.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, remembered_ms: float | None = None) -> None:
        self.clock = clock
        self.remembered_ms = remembered_ms
        self.fastest_ms = math.inf
        self.timed_s = 0.0
        self.rounds = 0
        self._recent: deque[tuple[float, float]] = deque()  # (clock at the round's end, its reference median)
        self._window: deque[tuple[float, float]] = deque(maxlen=WINDOW_ROUNDS)  # every round of the window
        self._first_at: float | None = None
        self._measuring_band: float | None = None  # the spell band as it stood when the measurement began

    def add(self, reference_round_ms: float, round_s: float) -> None:
        """Records one round: its reference median and the wall seconds it took."""
        now = self.clock()
        self._first_at = now if self._first_at is None else self._first_at
        self.fastest_ms = min(self.fastest_ms, reference_round_ms)
        self.timed_s += round_s
        self.rounds += 1
        while self._recent and self._recent[-1][1] >= reference_round_ms:  # a slower round is never the window's min
            self._recent.pop()
        self._recent.append((now, reference_round_ms))
        self._window.append((now, reference_round_ms))
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drops the rounds older than ``PACE_WINDOW_S``."""
        for rounds in (self._recent, self._window):
            while rounds and rounds[0][0] < now - PACE_WINDOW_S:
                rounds.popleft()

    @property
    def recent_ms(self) -> float:
        """This process's own pace now: its fastest reference round of the last ``PACE_WINDOW_S``; inf where none."""
        self._forget(self.clock())
        return self._recent[0][1] if self._recent else math.inf

    @property
    def quiet_ms(self) -> float:
        """The machine's quiet pace now: the fastest reference round of the last ``PACE_WINDOW_S``.

        Within the process's first window, the pace earlier processes timed counts too.
        """
        now = self.clock()
        recent = self.recent_ms
        young = self._first_at is None or now - self._first_at < PACE_WINDOW_S
        remembered = self.remembered_ms if self.remembered_ms is not None and young else math.inf
        return min(recent, remembered)

    def settled(self, settle_s: float) -> bool:
        """The process has timed ``settle_s`` seconds, or ``SETTLE_ROUNDS`` rounds of a model of microseconds.

        Earlier processes' pace does not settle a process: the first measurement's rounds over ``settle_s`` are
        what makes ``autotune evaluate`` precise (dozens of quiet rounds where ``rounds`` asks for four).
        """
        return self.timed_s >= settle_s or self.rounds >= SETTLE_ROUNDS

    def spell_band(self) -> float:
        """How much slower than the quiet pace a measurement's fastest round must run to lie in a spell.

        ``SPELL_BAND``, or the window's own scatter where it is wider (``SPREAD_BANDS`` times its median round's
        excess over its fastest): a model timed in microseconds scatters by more than a spell slows it, and its
        few rounds a measurement are no evidence of one.
        """
        rounds = [ms for _, ms in self._window]
        if len(rounds) < SPREAD_MIN_ROUNDS:
            return SPELL_BAND
        return max(SPELL_BAND, SPREAD_BANDS * (float(np.median(rounds)) / min(rounds) - 1.0))

    def begin(self) -> None:
        """A measurement begins: its spell band is read now, from the rounds before it, which it cannot move."""
        self._measuring_band = self.spell_band()

    def behind(self, fastest_ms: float, band: float | None = None) -> bool:
        """Whether a measurement whose fastest reference round is ``fastest_ms`` lies in a slow spell of the machine.

        It ran more than ``band`` slower than the quiet pace (default: the spell band read when the measurement
        began, else ``spell_band()`` now). False where there is no pace to compare with.
        """
        if band is None:
            band = self._measuring_band if self._measuring_band is not None else self.spell_band()
        quiet = self.quiet_ms
        return math.isfinite(quiet) and math.isfinite(fastest_ms) and fastest_ms > quiet * (1.0 + band)

    def slower_by(self, fastest_ms: float) -> float | None:
        """How much slower a measurement's fastest reference round ran than the quiet pace; None: no pace known."""
        quiet = self.quiet_ms
        if not math.isfinite(quiet) or not math.isfinite(fastest_ms):
            return None
        return fastest_ms / quiet - 1.0


def spell_fastest_ms(
    medians: np.ndarray, clear: Sequence[bool], band: float | None, pace: ReferencePace
) -> float | None:
    """The measurement's fastest clear reference round where it lies in a slow spell of the machine, else None.

    In a spell the reference ran more than ``SPELL_BAND`` slower than the machine's quiet pace in every clear round:
    a spell slows all-INT8 more than FP32, so the ratio itself is off, and pairing within the measurement cannot
    cancel it. None too where the protocol checks no pace (``band`` None).
    """
    rows = [i for i, ok in enumerate(clear) if ok]
    if band is None or not rows:
        return None
    fastest = float(medians[0, rows].min())
    return fastest if pace.behind(fastest) else None


def shared_rows(rows: list[list[int]], needed: int) -> list[list[int]]:
    """The rounds quiet for every candidate where there are ``needed`` of them, else each candidate's own.

    Plans timed in the same rounds compare index by index (``autotune.measure.confidence.compare_rounds``); a round
    one plan hiccupped in is lost to that plan alone only where the common rounds are too few.
    """
    common = sorted(set.intersection(*map(set, rows))) if rows else []
    return [common] * len(rows) if len(common) >= needed else rows


def quiet_rows(medians: np.ndarray, clear: list[int], band: float | None, pace: ReferencePace) -> list[list[int]]:
    """Per candidate, the ``clear`` rounds in which the reference ran at its quiet pace and the candidate near its own.

    The reference within a band of its fastest clear round of this measurement: a slow spell of a VM's host slows
    every plan of a round, and INT8 more than FP32, so the reference's pace tells the spell's rounds apart. The band
    is the machine's own: ``band`` (``Protocol.quiet_band``) or the spread of the reference's fastest rounds
    (``spread_band``), whichever is wider, so that an idle machine whose rounds scatter by more than ``band`` still
    counts most of them, while the rounds of a spell stay out. A measurement that lies whole in a spell (its fastest
    round more than ``SPELL_BAND`` above the machine's quiet pace, ``ReferencePace.quiet_ms``) is judged against that
    pace, and no round counts. Each candidate within ``OUTLIER_BAND`` of its own lower quartile over the clear rounds: a
    hiccup of one plan leaves that round out for that plan alone, so many plans in one round do not cost each other
    their rounds, and the rounds kept are not chosen by the reference's luck alone.
    """
    candidates = medians.shape[0] - 1
    if band is None or not clear:
        return [list(clear) for _ in range(candidates)]
    reference = medians[0, clear]
    fastest = float(reference.min())
    anchor = pace.quiet_ms if pace.behind(fastest) else fastest
    reference_ok = reference <= anchor * (1.0 + max(band, spread_band(reference)))
    quartiles = np.percentile(medians[1:, clear], 25, axis=1, keepdims=True)
    plans_ok = (medians[1:, clear] <= quartiles * (1.0 + OUTLIER_BAND)) & reference_ok
    return [[round_index for round_index, ok in zip(clear, plan_ok, strict=True) if ok] for plan_ok in plans_ok]


def spread_band(reference: np.ndarray) -> float:
    """The band the reference's own scatter needs; 0 with fewer than ``SPREAD_MIN_ROUNDS`` rounds.

    ``SPREAD_BANDS`` times the excess of its median round over its fastest. Interference only adds time, so the
    fastest rounds are the clean ones and an idle machine's rounds scatter above them: for a one-sided (half-normal)
    scatter of ``s`` the median lies ``0.67 s`` above the fastest, and twice that takes four rounds in five; for a
    scatter both ways the band is wider still. Only the rounds within ``SPELL_BAND`` of the fastest are read, and the
    band never passes it: a measurement that waited a spell out has more rounds in it than out of it.
    """
    fastest = float(reference.min())
    near = reference[reference <= fastest * (1.0 + SPELL_BAND)]  # a spell's rounds are no part of the scatter
    if len(near) < SPREAD_MIN_ROUNDS:
        return 0.0
    return min(SPELL_BAND, SPREAD_BANDS * (float(np.median(near)) / fastest - 1.0))
