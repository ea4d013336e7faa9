"""The run's wall-time budget (``budget.minutes``): set-up, search, confirmation and export within it.

The search used to be the only part the budget bounded: a detector whose trials took 37 s confirmed six plans
and the one-liners for more than fifteen minutes after a four-minute search. Here the whole run shares one
deadline. Before every build the search leaves time for the confirmation it will need, estimated from what its
trials cost so far; after the search, the confirmation is sized to the time left (fewer finalists first, then
fewer rounds), and a run with no time left for any confirmation exports FP32 and says why.

Everything here is arithmetic on measured trials, so it is tested with made-up results and a fake clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.measure.timing import turn_ms
from autotune.run.trial import TrialResult

MIN_CONFIRM_ROUNDS = 3
"""The fewest rounds a confirmation sized to its time may keep: a median of fewer is one round's luck."""
ROUND_LIMIT_FACTOR = 4.0
"""Rounds a measurement may time per round it needs before it stops without quiet ones, where no protocol says
(``Protocol.round_limit`` with ``measure.max_rounds`` unset; a run passes its own): the most a confirmation is
costed at per round it needs, unless the search's trials timed more."""
INFLATION_FLOOR = 1.5
"""The fewest rounds a confirmation is costed at per round it needs."""
INFLATION_MARGIN = 1.5
"""A confirmation is costed at this many times the rounds the search's trials timed per round they kept (at least
``INFLATION_FLOOR``, at most the round limit): its plans count their rounds each (``autotune.measure.quiet_rounds``), so
several plans need about the rounds one does, and its timing stops at the run's end whatever the estimate."""
EXPORT_SHARE = 0.6
"""The export's cost as a share of one plan's build and scoring (it builds once and writes, scoring nothing)."""
UNKNOWN_RESERVE_SHARE = 0.25
"""The share of the budget kept for the confirmation before any trial has said what one costs."""
CONFIRMATION_SHARE = 0.4
"""The most of the budget the search keeps for the confirmation, unless one finalist in the fewest rounds needs
more: the confirmation is then cut to the time left. Kept whole, a 5-minute MiniLM run's confirmation (four plans
and FP32 at the round limit, 4.6 minutes) left its search one build, and it exported FP32."""
CONFIRMATION_SEARCH_SHARE = 1.0
"""Without ``budget.minutes``, the confirmation may take this many times the search's seconds (at least
``CONFIRMATION_MIN_S``): unbounded, a confirmation of five finalists and two one-liners of a slow model took longer
than its search, and then confirmed again (docs/measurement.md#the-bar-and-the-confirmations-time)."""
CONFIRMATION_MIN_S = 60.0
"""The least time a confirmation bounded by the search's share gets: a search of seconds still confirms."""
LAYERWISE_SHARE = 0.25
"""The share of the budget the layerwise calibration may take (``LayerwiseOptions.allowance_s``): the layers it has
not reached by then take the method chosen most often, and the next run on the same cache measures them."""


def layerwise_allowance_s(minutes: float | None) -> float | None:
    """Seconds the layerwise calibration may take in a run of ``budget.minutes``; None without a limit."""
    return None if minutes is None else LAYERWISE_SHARE * 60.0 * minutes


@dataclass(frozen=True)
class TrialCosts:
    """What one plan costs a confirmation, from the trials measured so far.

    Attributes:
        prepare_s: Seconds to build and score one plan (the median trial's total less its timing).
        run_ms: Milliseconds of one timed run of a plan (the median trial's latency), and of FP32.
        reference_ms: Milliseconds of one run of the FP32 reference.
        rounds_inflation: Rounds timed per round that counts: ``INFLATION_MARGIN`` times the trials' own median,
            within ``INFLATION_FLOOR`` and the round limit (``ROUND_LIMIT_FACTOR``), or the trials' median where a
            busy machine made them time more than the limit.
        patience_s: Seconds a measurement may wait out a busy machine past its limit (``measure.busy_patience_s``).
        trial_s: Seconds of the median trial, end to end (the last build of a search runs to its end, and the
            agent's work after it is paced to about as long: ``ppo.compute_share``).
        turn_s: The trials' ``measure.turn_s``: a slow plan's turn in a round is cut to it (``turn_ms``).
        overhead: A timed run's wall time over its measured latency, at least 1 (the trials' timing seconds over
            their runs' latencies, the upper quartile): where the pace moves, the runs a measurement times are slower
            than the latency it reports (a detector's confirmation took 1.4 times its latencies' worth).
    """

    prepare_s: float
    run_ms: float
    reference_ms: float
    rounds_inflation: float
    patience_s: float = 0.0
    overhead: float = 1.0
    trial_s: float = 0.0
    turn_s: float = 0.0

    @classmethod
    def of(
        cls, trials: Sequence[TrialResult], limit_factor: float = ROUND_LIMIT_FACTOR, patience_s: float = 0.0
    ) -> TrialCosts | None:
        """The costs read from the trials that were timed; None before any was.

        Args:
            trials: The run's trials.
            limit_factor: Rounds a measurement times at most per round it needs (``ROUND_LIMIT_FACTOR``).
            patience_s: ``measure.busy_patience_s``.
        """
        timed = [t for t in trials if not t.from_store and t.latency_ms and t.reference_latency_ms and t.total_s]
        if not timed:
            return None
        prepare, inflation, overhead = [], [], []
        for trial in timed:
            runs = trial.protocol.get("warmup", 0) + trial.protocol.get("repeats", 1)
            rounds = (trial.busy or {}).get("rounds") or trial.protocol.get("rounds", 1)
            turn_s = trial.protocol.get("turn_s", 0.0)
            turns_ms = turn_ms(runs, trial.latency_ms, turn_s) + turn_ms(runs, trial.reference_latency_ms, turn_s)
            timing_s = rounds * turns_ms / 1e3
            # A trial that says how long it built and scored (build_s, score_s) gives its timing's real cost too.
            scored_s = trial.build_s + trial.score_s if trial.build_s and trial.score_s else None
            prepare.append(max(0.0, trial.total_s - timing_s) if scored_s is None else scored_s)
            if scored_s is not None and timing_s > 0:
                overhead.append(max(1.0, (trial.total_s - scored_s) / timing_s))
            inflation.append(rounds / max(1, trial.protocol.get("rounds", 1)))
        return cls(
            statistics.median(prepare),
            statistics.median(t.latency_ms for t in timed),
            statistics.median(t.reference_latency_ms for t in timed),
            _inflation(statistics.median(inflation), limit_factor),
            patience_s,
            float(np.percentile(overhead, 75)) if overhead else 1.0,
            statistics.median(t.total_s for t in timed),
            timed[-1].protocol.get("turn_s", 0.0),
        )

    def confirmation_s(self, plans: int, rounds: int, runs_per_round: int) -> float:
        """Seconds to confirm ``plans`` plans (finalists and one-liners) beside FP32, and export the winner.

        Each plan is built and scored, then every plan, FP32's own plan (the self-check's row) and the FP32 reference
        run ``runs_per_round`` times in each of the rounds, up to the round limit, at the trials' ``overhead``, and
        the patience on top. One-liners are costed as a plan of the search: their speed is unknown until they are
        timed.
        """
        turns_ms = plans * turn_ms(runs_per_round, self.run_ms, self.turn_s)
        per_round_s = (turns_ms + 2 * turn_ms(runs_per_round, self.reference_ms, self.turn_s)) / 1e3
        timing_s = rounds * self.rounds_inflation * per_round_s * self.overhead + self.patience_s
        return (plans + 1 + EXPORT_SHARE) * self.prepare_s + timing_s


def _inflation(trials_median: float, limit_factor: float) -> float:
    """Rounds a confirmation is costed at per round it needs, from the trials' median (``TrialCosts``)."""
    return max(trials_median, min(limit_factor, max(INFLATION_FLOOR, INFLATION_MARGIN * trials_median)))


@dataclass(frozen=True)
class ConfirmationSize:
    """How many finalists, in how many rounds, the time left allows.

    Attributes:
        finalists: Finalists to confirm (0: none fits: FP32 is exported).
        references: One-liners confirmed beside them.
        rounds: Rounds of the confirmation.
        spare: Time is left for a second, wider confirmation where the self-check asks for one, and for more
            finalists where none met the budget.
        note: One line for the user when the confirmation was cut to fit, else None.
        stop_at: The wall time (the deadline's clock, ``time.time``) by which its timing stops, whatever the rounds
            (``Protocol.stop_at``): the run's end less the export. The costs are estimates from the trials; a
            detector's confirmation took a quarter longer than its estimate, past the run's end. None: no limit.
    """

    finalists: int
    references: int
    rounds: int
    spare: bool
    note: str | None = None
    stop_at: float | None = None


class RunDeadline:
    """The wall time a run may take, from its start.

    Args:
        minutes: ``budget.minutes``; None: no limit (every method answers as if time were endless).
        started: ``clock()`` at the run's start.
        clock: Seconds; injectable for tests.
    """

    def __init__(
        self, minutes: float | None, started: float, clock: Callable[[], float] = time.time, limit: str = ""
    ) -> None:
        self.total_s = None if minutes is None else 60.0 * minutes
        self.started = started
        self.clock = clock
        self.limit = limit or (f"budget.minutes={minutes:g}" if minutes is not None else "")

    @classmethod
    def for_confirmation(cls, search_s: float, clock: Callable[[], float] = time.time) -> RunDeadline:
        """The confirmation's own deadline in a run without ``budget.minutes``: a share of the search's seconds."""
        allowance = max(CONFIRMATION_MIN_S, CONFIRMATION_SEARCH_SHARE * search_s)
        limit = f"the confirmation's share ({CONFIRMATION_SEARCH_SHARE:g}x the search's {search_s:.0f} s)"
        return cls(allowance / 60.0, clock(), clock, limit)

    def left_s(self) -> float:
        """Seconds left (``inf`` without a limit; negative once it has passed)."""
        if self.total_s is None:
            return math.inf
        return self.total_s - (self.clock() - self.started)

    def search_left_s(self, costs: TrialCosts | None, plans: int, rounds: int, runs_per_round: int) -> float:
        """Seconds the search may still start builds in: the time left less what the confirmation will need."""
        left = self.left_s()
        if math.isinf(left):
            return left
        if costs is None:
            return left - UNKNOWN_RESERVE_SHARE * (self.total_s or 0.0)
        fewest = costs.confirmation_s(1, min(rounds, MIN_CONFIRM_ROUNDS), runs_per_round)
        reserve = min(
            costs.confirmation_s(plans, rounds, runs_per_round), max(fewest, CONFIRMATION_SHARE * self.total_s)
        )
        # The first build after the deadline check runs to its end, and the policy's work after it about as long
        # (a 5-minute MiniLM search overran its deadline by 70 s): both are part of what the search spends.
        return left - reserve - max(costs.prepare_s, 2.0 * costs.trial_s)

    def size_confirmation(
        self, costs: TrialCosts | None, top_k: int, references: int, rounds: int, runs_per_round: int
    ) -> ConfirmationSize:
        """The largest confirmation that fits the time left: fewer finalists first, then one-liners, then rounds.

        The finalists are what the user gets; the one-liners are what the summary compares them with, so they are
        given up before the last finalist, and rounds last (they decide how sure the ranking is).
        """
        left = self.left_s()
        if left <= 0:
            return ConfirmationSize(0, 0, 0, spare=False, note=_none_fits(self.limit, left, None))
        if costs is None or math.isinf(left):
            return ConfirmationSize(top_k, references, rounds, spare=True)
        spare = costs.confirmation_s(top_k + references, 2 * rounds, runs_per_round) <= left
        stop_at = self.started + self.total_s - EXPORT_SHARE * costs.prepare_s  # the run's end, less the export
        for finalists, kept, kept_rounds in _smaller(top_k, references, rounds):
            if costs.confirmation_s(finalists + kept, kept_rounds, runs_per_round) <= left:
                cut = (finalists, kept, kept_rounds) != (top_k, references, rounds)
                note = (
                    _cut_note(self.limit, left, (top_k, references, rounds), (finalists, kept, kept_rounds))
                    if cut
                    else None
                )
                return ConfirmationSize(finalists, kept, kept_rounds, spare and not cut, note, stop_at)
        return ConfirmationSize(
            0,
            0,
            0,
            spare=False,
            note=_none_fits(self.limit, left, costs.confirmation_s(1, MIN_CONFIRM_ROUNDS, runs_per_round)),
        )


def _smaller(top_k: int, references: int, rounds: int) -> list[tuple[int, int, int]]:
    """Confirmations from the configured one down to one finalist alone in the fewest rounds, in that order.

    The last one-liner stays while any rounds can be given up: the one-liners come first in the order the run
    measured them before its search (the fastest within the budget first), and the winner's margin over it is the
    figure a user reads.
    """
    fewest = min(rounds, MIN_CONFIRM_ROUNDS)
    sizes = [(finalists, references, rounds) for finalists in range(top_k, 0, -1)]
    sizes += [(1, kept, rounds) for kept in range(references - 1, 0, -1)]
    sizes += [(1, min(1, references), kept) for kept in range(rounds - 1, fewest - 1, -1)]
    return sizes + [(1, 0, kept) for kept in range(rounds, fewest - 1, -1)] if references else sizes


def _none_fits(limit: str, left_s: float, one_s: float | None) -> str:
    """One line: why the run exports FP32."""
    takes = "" if one_s is None else f", less than confirming one finalist takes (about {one_s:.0f} s)"
    return f"{limit} leaves {max(0.0, left_s):.0f} s{takes}: FP32 alone is confirmed and exported"


def _cut_note(limit: str, left_s: float, asked: tuple[int, int, int], kept: tuple[int, int, int]) -> str:
    """One line: what the confirmation gave up to fit the time left."""
    names = ("finalists", "one-liners", "rounds")
    parts = [f"{kept[i]} of {asked[i]} {name}" for i, name in enumerate(names) if kept[i] != asked[i]]
    return f"{limit} leaves {left_s:.0f} s: the confirmation is cut to {', '.join(parts)}"
