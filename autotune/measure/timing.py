"""The latency protocol: warm-up after every switch, repeats, rounds, and the reference interleaved.

One candidate against the reference, the reference first in every round (``interleaved``), or any number of
candidates in the same rounds, the order rotating (``side_by_side``: every trial, with its one plan; a run's
finalists; the plans ``autotune evaluate`` compares).

Which rounds count is judged in ``autotune.measure.quiet_rounds``, by one rule for every runner. Two things slow a
round: another process on the cores (the timed threads wait for a core while it runs: ``autotune.measure.interference``
reads that wait from the scheduler, and the other work's core time beside it) and a slow spell of a shared VM's host
(the runs are slower though nothing here waited). A round counts for a candidate when other work did not keep this
process's threads from a core, when the reference ran within the machine's own band of its fastest round of the
measurement, and when that candidate ran near its own lower quartile of rounds; a measurement whose fastest reference
round lies far above the machine's quiet pace (``ReferencePace``) lies in a spell. A rule that looked at the reference
alone kept rounds in which the reference happened to be fast and a candidate did not, and misread FP32 against itself
beside a busy process (docs/method.md#measurements-behind-the-codes-choices). The assumption is that interference only
adds time, so each runner's fastest rounds are its quiet ones; the measurement goes on until every candidate has
``rounds`` rounds. At its limit, where another process got in the way or the measurement lies in a spell, it steps off
the cores for a random while and times on; when its patience is spent it times each runner by its own fastest runs over
all its rounds, and says that the machine was too busy, or ran slow (``Busy.quiet`` False).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple, TypedDict, Unpack

import numpy as np

from autotune.measure.interference import Busy, Reading, Sampler, Snapshot, describe_cpus
from autotune.measure.quiet_rounds import SETTLE_ROUNDS, ReferencePace, quiet_rows, shared_rows, spell_fastest_ms

__all__ = ["SETTLE_ROUNDS", "Latency", "Protocol", "ReferencePace", "Timing", "interleaved", "side_by_side"]


@dataclass(frozen=True)
class Protocol:
    """How a latency was measured; stored with every result.

    Attributes:
        warmup: Untimed runs after every switch between candidate and reference.
        repeats: Timed runs per round and side.
        rounds: Quiet rounds (reference, candidate) per measurement; with ``quiet_band`` None, rounds.
        quiet_band: A round counts when its reference median is within this fraction of the fastest reference
            round of the process (``ReferencePace``) and no plan ran more than ``OUTLIER_BAND`` above its own lower
            quartile of rounds; None: no pace is checked.
        settle_s: Wall seconds the process times before its fastest reference round is trusted as the machine's
            quiet pace: the first measurement of a process times at least this long.
        max_rounds: Rounds after which a measurement that has settled backs off, or stops, with fewer quiet rounds
            than ``rounds`` (``busy_patience_s``); None: four times ``rounds``.
        busy_wait: A round counts only when this process's threads waited for a core (run-queue wait, from the
            scheduler) at most this fraction of its wall time; None: the wait is not checked.
        busy_patience_s: Wall seconds a measurement that reached its round limit without enough quiet rounds, and
            saw its threads wait for a core, may spend past that limit: off the cores (a random back-off of up to
            ``BACK_OFF_S`` at a time, so two runs that time at once fall out of step) and timing up to
            ``round_limit`` rounds more after each, stopping at the round in which the patience runs out; then it
            times each runner by its fastest runs and says the machine was too busy. The rounds count against it
            too: a model whose rounds take seconds on a busy machine would otherwise time six times its limit.
        min_sample_ms: A timed sample lasts at least this long: a runner faster than that runs several times back
            to back per sample, the count set from its fastest runs (as ``timeit`` autoranges), and the sample is
            their mean; its warm-up runs are whole samples. A sub-millisecond model's single runs are mostly the
            timer's and the scheduler's jitter and the cold runs after a switch; 0: one run per sample.
        busy_others: Rounds count only while other processes took at most this share of the cores the timed
            threads may use (``/proc/stat``, read over at least ``SHARE_MIN_S``): beside any other busy process,
            even at ``nice 19`` and with no run-queue wait, a two-thread INT8 session slowed more than FP32, so the
            ratio read low in rounds that looked clear (docs/method.md#measurements-behind-the-codes-choices). None: not
            checked.
        stop_at: The wall time (``time.time()``) after which no more rounds are timed: a run's time limit
            (``budget.minutes``). Reached with fewer quiet rounds than ``rounds``, the quiet ones count, or, with
            none, each runner's fastest runs, as when the patience runs out. None: no limit.
        spell_patience_s: As ``busy_patience_s``, for a measurement whose process has not yet run the reference
            within ``quiet_band`` of the pace earlier processes timed it at on this machine (``ReferencePace``) and
            saw no other process: a slow spell of the machine itself, which may end though nothing here can be
            waited out.
        turn_s: Seconds a runner's turn in a round (its warm-up and timed samples) lasts at most, as near as whole
            samples allow: a runner whose samples take longer gets one warm-up and fewer timed samples (at least
            ``MIN_REPEATS``), sized from its fastest sample so far. 0: the counts as set.
    """

    warmup: int = 2
    repeats: int = 5
    rounds: int = 4
    quiet_band: float | None = 0.05
    settle_s: float = 5.0
    max_rounds: int | None = None
    busy_wait: float | None = 0.1
    busy_patience_s: float = 5.0
    min_sample_ms: float = 0.0
    busy_others: float | None = None
    stop_at: float | None = None
    spell_patience_s: float = 15.0
    turn_s: float = 0.0

    def to_dict(self) -> dict[str, int | float | None]:
        """A JSON-ready dict."""
        return asdict(self)

    @property
    def round_limit(self) -> int:
        """The rounds after which a settled measurement stops, quiet or not."""
        return max(self.rounds, self.max_rounds if self.max_rounds is not None else 4 * self.rounds)


MIN_REPEATS = 2
"""The fewest timed samples a runner's turn takes however slow the runner (``Protocol.turn_s``): the median of two
is their mean, and a turn of one sample is its warm-up's mercy."""

FEWEST_QUIET_ROUNDS = 3
"""At its round limit, a measurement whose every plan has this many quiet rounds (fewer than ``Protocol.rounds``)
counts them rather than timing each plan by its fastest runs: on a VM whose pace drifts by tens of per cent over
seconds, a confirmation of ten plans found no 16 quiet rounds each in 64 (docs/measurement.md#quiet-rounds)."""

FLOOR_POOL = 2
"""A measurement on a machine nothing else used (every round clear of other work) whose pace scatters too much for
``Protocol.rounds`` rounds to sit within the quiet band times each runner by its fastest rounds (``_from_floors``)
once it has this many times ``Protocol.rounds`` clear rounds (or its limit): the fastest half of them. Interference
only adds time, and every runner ran in every round, so each runner's fastest rounds fall in the machine's fast
moments alike (docs/measurement.md#quiet-rounds has what an idle VM's rounds did)."""

BACK_OFF_S = 2.0
"""The longest single back-off of a measurement the machine kept too busy (``Protocol.busy_patience_s``)."""

MAX_RUNS_PER_SAMPLE = 1000
"""The most runs one sample takes, however fast the runner (``Protocol.min_sample_ms``)."""


@dataclass(frozen=True)
class Latency:
    """A candidate's latency against the reference timed in the same process.

    Attributes:
        median_ms: Median of the candidate's timed runs.
        iqr_ms: Interquartile range of the candidate's runs.
        reference_median_ms: Median of the reference's runs, interleaved with the candidate's.
        reference_iqr_ms: Interquartile range of the reference's runs.
        round_speedups: Per round, the reference's median over the candidate's median.
        busy: How much other work got in the way, and whether the rounds could be trusted; None where nothing
            was read (a latency made by hand).
    """

    median_ms: float
    iqr_ms: float
    reference_median_ms: float
    reference_iqr_ms: float
    round_speedups: tuple[float, ...] = ()
    busy: Busy | None = None

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


@dataclass
class _Turn:
    """What one runner's turns in a measurement's rounds have learned of it.

    Attributes:
        runs_per_sample: Runs back to back per sample (``Protocol.min_sample_ms``); None until its first turn.
        fastest_ms: Its fastest sample so far, per run: how long its turn takes (``Protocol.turn_s``).
    """

    runs_per_sample: int | None = None
    fastest_ms: float = math.inf


def _turn_counts(protocol: Protocol, sample_ms: float) -> tuple[int, int]:
    """Warm-up samples and timed samples of a turn whose samples take ``sample_ms``, within ``Protocol.turn_s``.

    The protocol's counts where they fit; else one warm-up and as many timed samples as fit, at least ``MIN_REPEATS``
    (never more than the protocol's).
    """
    counts = protocol.warmup, protocol.repeats
    if protocol.turn_s <= 0 or not math.isfinite(sample_ms) or sample_ms * sum(counts) <= protocol.turn_s * 1e3:
        return counts
    fit = int(protocol.turn_s * 1e3 / max(sample_ms, 1e-9)) - 1
    return min(protocol.warmup, 1), min(protocol.repeats, max(MIN_REPEATS, fit))


def turn_ms(runs: int, run_ms: float, turn_s: float) -> float:
    """Milliseconds of a turn of ``runs`` runs (one warm-up, the rest timed) of ``run_ms`` each, as ``_timed`` cuts it.

    For the costs a time limit plans with (``autotune.harness.deadline``), which know a turn's runs, not its split.
    """
    warmup, repeats = _turn_counts(Protocol(warmup=1, repeats=max(1, runs - 1), turn_s=turn_s), run_ms)
    return (warmup + repeats) * run_ms


def _timed(
    run: Callable[[], object], protocol: Protocol, clock: Callable[[], float], self_timed: bool, turn: _Turn
) -> list[float]:
    """The warm-up, then ``repeats`` samples of ``turn.runs_per_sample`` runs each.

    With ``min_sample_ms`` the warm-up is whole samples too (a small model's first runs after another's are cold
    for more than one run), and the runs per sample grow from the fastest run seen: the first warm-up sizes them,
    every round's samples may add to them. With ``turn_s`` a slow runner's turn is shortened from its fastest
    sample so far (``_turn_counts``).
    """
    warmup, repeats = _turn_counts(protocol, turn.fastest_ms * (turn.runs_per_sample or 1))
    if protocol.min_sample_ms <= 0:
        for _ in range(warmup):
            run()
        samples = [_elapsed_ms(run, 1, clock, self_timed) for _ in range(repeats)]
        turn.fastest_ms = min(turn.fastest_ms, *samples)
        return samples
    count = turn.runs_per_sample or 1
    warm = [_elapsed_ms(run, count, clock, self_timed) for _ in range(max(1, warmup))]
    if turn.runs_per_sample is None:
        turn.runs_per_sample = _runs_per_sample(min(warm), protocol.min_sample_ms)
    samples = [_elapsed_ms(run, turn.runs_per_sample, clock, self_timed) for _ in range(repeats)]
    turn.fastest_ms = min(turn.fastest_ms, *warm, *samples)
    turn.runs_per_sample = max(turn.runs_per_sample, _runs_per_sample(min(samples), protocol.min_sample_ms))
    return samples


def _elapsed_ms(run: Callable[[], object], count: int, clock: Callable[[], float], self_timed: bool) -> float:
    """The mean milliseconds of ``count`` runs back to back."""
    if self_timed:
        return sum(float(run()) for _ in range(count)) / count  # type: ignore[arg-type]
    start = clock()
    for _ in range(count):
        run()
    return (clock() - start) * 1e3 / count


def _runs_per_sample(one_run_ms: float, min_sample_ms: float) -> int:
    """Runs per sample so that a sample lasts ``min_sample_ms`` (``Protocol.min_sample_ms``)."""
    if min_sample_ms <= 0 or one_run_ms >= min_sample_ms:
        return 1
    return min(MAX_RUNS_PER_SAMPLE, math.ceil(min_sample_ms / max(one_run_ms, 1e-6) - 1e-9))


class Timing(TypedDict, total=False):
    """How a measurement reads time and the machine: what :func:`interleaved` and :func:`side_by_side` take.

    Attributes:
        clock: Seconds (default ``time.perf_counter``); injectable for tests.
        self_timed: The runners return their own elapsed milliseconds (e.g. GPU events) and ``clock`` is unused.
        pace: The process's reference pace; absent or None: a fresh one (the measurement settles on its own).
        sampler: Reads how busy the machine is; absent or None: one of this process on its usable cores.
    """

    clock: Callable[[], float]
    self_timed: bool
    pace: ReferencePace | None
    sampler: Sampler | None


def interleaved(
    candidate: Callable[[], object], reference: Callable[[], object], protocol: Protocol, **timing: Unpack[Timing]
) -> Latency:
    """Times the candidate and the reference alternately, so machine drift hits both alike.

    Args:
        candidate: Runs the candidate once.
        reference: Runs the reference once.
        protocol: Warm-up, repeats and rounds.
        **timing: The clock, whether the runners time themselves, the pace and the sampler (:class:`Timing`).

    Returns:
        Medians and IQRs of both sides, over the quiet rounds.
    """
    return _rounds([reference, candidate], lambda _: [0, 1], protocol, timing)[0]


def side_by_side(
    candidates: Sequence[Callable[[], object]],
    reference: Callable[[], object],
    protocol: Protocol,
    **timing: Unpack[Timing],
) -> list[Latency]:
    """Times several candidates and the reference in turn within every round, the order rotating each round.

    Plans measured one after another, each against its own reference, are compared across minutes of machine
    drift, more than finalists differ (docs/method.md#measurements-behind-the-codes-choices). Inside one round the
    runners are timed seconds apart, and every candidate's ratio of a round has the same reference median, so the
    ratio of two candidates' ``round_speedups`` at the same index compares them directly. Rotating the order
    (round r starts at runner r) keeps a place in the round (first after the reference, last before it) from
    favouring one runner.

    Args:
        candidates: Each runs one candidate once.
        reference: Runs the reference once.
        protocol: Warm-up (after every switch), repeats and rounds.
        **timing: The clock, whether the runners time themselves, the pace and the sampler (:class:`Timing`).

    Returns:
        One ``Latency`` per candidate, in order, each against the reference of the same (quiet) rounds.
    """
    runners = [reference, *candidates]
    count = len(runners)

    def rotated(index: int) -> list[int]:
        return [(index + k) % count for k in range(count)]

    return _rounds(runners, rotated, protocol, timing)


def _rounds(
    runners: Sequence[Callable[[], object]],
    order: Callable[[int], list[int]],
    protocol: Protocol,
    timing: Timing,
) -> list[Latency]:
    """Times ``runners`` (the reference first) round by round in ``order(round)`` until enough rounds count.

    Returns:
        A Latency per candidate, over the rounds that count for it (``_counted``), in the order they were timed.
    """
    clock, self_timed = timing.get("clock", time.perf_counter), timing.get("self_timed", False)
    pace, sampler = timing.get("pace"), timing.get("sampler")
    pace, sampler = pace if pace is not None else ReferencePace(), sampler if sampler is not None else Sampler()
    pace.begin()
    blocks: list[list[list[float]]] = [[] for _ in runners]  # per runner, per round: the timed samples
    turns = [_Turn() for _ in runners]  # per runner: its runs per sample and its pace, from its first turn on
    round_medians: list[list[float]] = [[] for _ in runners]
    readings: list[Reading | None] = []  # per round: what the other processes did meanwhile
    first = last = sampler.snapshot()
    shares, cores = _SharedSpans(sampler, protocol.busy_others, first), len(sampler.cpus)
    limit, waited_out_s, patience_s = protocol.round_limit, 0.0, 0.0  # patience spent: back-offs, rounds after them
    while True:
        started = pace.clock()
        for runner in order(len(readings)):
            blocks[runner].append(_timed(runners[runner], protocol, clock, self_timed, turns[runner]))
            round_medians[runner].append(float(np.median(blocks[runner][-1])))
        now = sampler.snapshot()
        readings.append(sampler.reading(last, now))
        last = now
        round_s = pace.clock() - started
        pace.add(round_medians[0][-1], round_s)
        waited_out_s += round_s if len(readings) > protocol.round_limit else 0.0
        clear, medians = _clear(readings, protocol, shares.shared, cores), np.array(round_medians)
        patience_s = max(patience_s, _patience_s(protocol, clear, pace, medians))  # a spell that ended leaves it
        counted = _counted(medians, clear, protocol, pace, limit)
        own = shares.settled(now, len(readings)) if counted is not None and counted.quiet else True
        if not own:  # enough rounds, but in a span the others shared (time them again, up to the limit) or unread
            counted = None if own is None or len(readings) < limit else _Counted(_none(medians), False)
        out_of_time = protocol.stop_at is not None and time.time() >= protocol.stop_at
        if counted is None and out_of_time:
            counted = _quiet_so_far(medians, clear, protocol, pace)
        if counted is None and limit > protocol.round_limit and waited_out_s >= patience_s:
            counted = _Counted(_none(medians), False)  # the patience ran out in the rounds after a back-off: stop there
        if counted is None:
            continue
        if counted.quiet or out_of_time or waited_out_s >= patience_s:
            break  # quiet; out of time or patience (none: no process or spell to wait out; a noisy pace is no reason)
        waited_out_s += sampler.back_off(BACK_OFF_S)
        limit += protocol.round_limit
        last = sampler.snapshot()  # the back-off is no round of its own
        shares.restart(last, len(readings), unread_shared=not all(clear))  # a slow spell's rounds: no one else's
    clear = _clear(readings, protocol, shares.shared, cores)
    busy = _busy(sampler, sampler.reading(first, last), counted, clear, protocol, pace, np.array(round_medians))
    if not counted.quiet:
        return _from_floors(blocks, protocol.rounds, busy)
    if counted.floors:  # an idle machine whose pace scattered: the fastest half of its clear rounds
        pool = counted.rows[0]
        return _from_floors([[runner[i] for i in pool] for runner in blocks], busy.counted, busy)
    return _paired(blocks, counted.rows, busy)


def _busy(
    sampler: Sampler,
    whole: Reading | None,
    counted: _Counted,
    clear: list[bool],
    protocol: Protocol,
    pace: ReferencePace,
    medians: np.ndarray,
) -> Busy:
    """What the machine's other work did to a measurement that ended with ``counted`` rounds."""
    rows, quiet = counted.rows, counted.quiet
    others, waited = (None, None) if whole is None else (whole.others, whole.waited)
    counted_rounds = (
        _floor_count(len(rows[0]), protocol) if counted.floors else min(map(len, rows)) if quiet else protocol.rounds
    )
    counts = (len(clear), counted_rounds, sum(not ok for ok in clear))
    spell = spell_fastest_ms(medians, clear, protocol.quiet_band, pace)
    slower_by = None if quiet or spell is None else pace.slower_by(spell)
    return Busy(*counts, others, waited, describe_cpus(sampler.cpus), quiet, slower_by)


class _SharedSpans:
    """Spans of rounds in which other processes took more than ``busy_others`` of the timed threads' cores.

    The scheduler's run-queue wait misses them (the timed threads run as soon as they wake), so the share of the
    cores is read over a span of rounds, long enough for Linux's tick accounting (``SHARE_MIN_S``), and a span over
    the share leaves all of its rounds out.

    Args:
        sampler: The measurement's sampler.
        busy_others: The most the others may take (``Protocol.busy_others``); None: never a shared span.
        start: The sampler's snapshot at the measurement's start.
    """

    def __init__(self, sampler: Sampler, busy_others: float | None, start: Snapshot | None) -> None:
        self.sampler = sampler
        self.busy_others = busy_others
        self.shared: set[int] = set()  # rounds in spans the others shared
        self.restart(start, 0)

    def restart(self, snapshot: Snapshot | None, round_index: int, unread_shared: bool = False) -> None:
        """A new span from ``snapshot``, whose first round is ``round_index``.

        ``unread_shared``: the rounds of the span so far, not read yet (a back-off ends it), count as shared.
        """
        if unread_shared and self.busy_others is not None:
            self.shared.update(range(self._first_round, round_index))
        self._start, self._first_round = snapshot, round_index

    def settled(self, now: Snapshot | None, rounds: int) -> bool | None:
        """The span up to ``now`` (``rounds`` rounds timed) was the timed threads' own; False leaves it out.

        None while the span is too short to read: the rounds go on until it can be read.
        """
        if self.busy_others is None or self._start is None or now is None:
            return True
        reading = self.sampler.reading(self._start, now)
        if reading is None:
            return True
        if reading.others is None:
            return None
        if reading.others <= self.busy_others:
            return True
        self.shared.update(range(self._first_round, rounds))
        self.restart(now, rounds)
        return False


def _paired(blocks: list[list[list[float]]], rows: list[list[int]], busy: Busy) -> list[Latency]:
    """Each candidate against the reference over its rounds (``rows``): pooled medians, and a ratio per round."""
    latencies = []
    for runner_blocks, plan_rows in zip(blocks[1:], rows, strict=True):
        reference = [blocks[0][i] for i in plan_rows]
        reference_median, reference_iqr = _stats([ms for block in reference for ms in block])
        candidate = [runner_blocks[i] for i in plan_rows]
        median, iqr = _stats([ms for block in candidate for ms in block])
        ratios = tuple(float(np.median(r) / np.median(c)) for r, c in zip(reference, candidate, strict=True))
        latencies.append(Latency(median, iqr, reference_median, reference_iqr, ratios, busy))
    return latencies


def _from_floors(blocks: list[list[list[float]]], count: int, busy: Busy) -> list[Latency]:
    """Each runner by its own ``count`` fastest rounds' fastest runs, where no round was quiet for all at once.

    Interference only adds time, so a runner's fastest runs over many rounds are its unhindered ones whichever
    rounds they fell in; on a 2-core VM beside a busy loop at nice 0 this read FP32 against itself at 0.995-1.007
    over 32 rounds and more, where no round was quiet. The k-th fastest of the reference over the k-th fastest of a
    candidate is its k-th "round" ratio, so plans timed together still compare index by index.
    """
    floors = [sorted(min(block) for block in runner_blocks)[:count] for runner_blocks in blocks]
    reference_median, reference_iqr = _stats(floors[0])
    latencies = []
    for floor in floors[1:]:
        median, iqr = _stats(floor)
        ratios = tuple(float(r / c) for r, c in zip(floors[0], floor, strict=True))
        latencies.append(Latency(median, iqr, reference_median, reference_iqr, ratios, busy))
    return latencies


def _patience_s(protocol: Protocol, clear: Sequence[bool], pace: ReferencePace, medians: np.ndarray) -> float:
    """Seconds the measurement may wait past its limit.

    For another process that got in the way of a round, else for a slow spell of the machine; 0 with neither (a plan
    whose pace moves from round to round does not settle).
    """
    if not all(clear):
        return protocol.busy_patience_s
    return protocol.spell_patience_s if spell_fastest_ms(medians, clear, protocol.quiet_band, pace) is not None else 0.0


def _waits(readings: Sequence[Reading | None]) -> list[float | None]:
    return [None if reading is None else reading.waited for reading in readings]


def _clear(readings: Sequence[Reading | None], protocol: Protocol, shared: set[int], cores: int) -> list[bool]:
    """Per round: other work kept this process's threads from a core no more than allowed, nor shared a busy span."""
    return [not _contended(reading, protocol, cores) and i not in shared for i, reading in enumerate(readings)]


def _contended(reading: Reading | None, protocol: Protocol, cores: int) -> bool:
    """Other work kept this process's threads from a core beyond the protocol's allowance in a round."""
    return (
        reading is not None and protocol.busy_wait is not None and reading.waited_for_others(protocol.busy_wait, cores)
    )


class _Counted(NamedTuple):
    """Which rounds count for each candidate, and how.

    Attributes:
        rows: Per candidate, the rounds that count (the same for all where ``floors``).
        quiet: Enough rounds counted; False: each runner is timed by its fastest runs over every round.
        floors: The rows are an idle machine's clear rounds, and each runner is timed by its fastest of them
            (``FLOOR_POOL``) rather than round by round.
    """

    rows: list[list[int]]
    quiet: bool
    floors: bool = False


def _floor_count(clear_rounds: int, protocol: Protocol) -> int:
    """How many of its fastest clear rounds time each runner: the fastest half, at most ``Protocol.rounds``."""
    return max(1, min(protocol.rounds, clear_rounds // 2))


def _none(medians: np.ndarray) -> list[list[int]]:
    """No round, for each candidate."""
    return [[] for _ in range(medians.shape[0] - 1)]


def _counted(
    medians: np.ndarray, clear: Sequence[bool], protocol: Protocol, pace: ReferencePace, limit: int
) -> _Counted | None:
    """Each candidate's counted rounds once the measurement may stop, and whether they were quiet; None until then.

    Args:
        medians: Per runner (the reference first), per round, the median of its timed runs.
        clear: Per round, whether no other process got in its way (``_clear``).
        protocol: The protocol.
        pace: The process's reference pace.
        limit: The rounds after which it stops, quiet or not (``Protocol.round_limit``, more after a back-off).

    It stops once every candidate has ``protocol.rounds`` quiet rounds (``quiet_rows``) and the process has
    settled, or, where the machine was idle but its pace scattered, once it has ``FLOOR_POOL`` times as many clear
    rounds (``_floor_rounds``: each runner by its fastest of them). At ``limit`` (settled) it counts the quiet
    rounds it has where every candidate has ``FEWEST_QUIET_ROUNDS``; with fewer, it returns no rounds and not
    quiet: the caller backs off and times on, or times each runner by its fastest runs (``_from_floors``).
    """
    timed = medians.shape[1]
    if timed < protocol.rounds or not pace.settled(protocol.settle_s):
        return None
    rows = _quiet(medians, clear, protocol, pace)
    if min(map(len, rows)) >= protocol.rounds:
        return _Counted(shared_rows(rows, protocol.rounds), True)
    floors = _floor_rounds(medians, clear, protocol, pace, limit)
    if floors is not None:
        return _Counted([floors] * len(rows), True, floors=True)
    if timed < limit:
        return None
    if min(map(len, rows)) >= min(protocol.rounds, FEWEST_QUIET_ROUNDS):  # fewer than asked, but quiet ones
        return _Counted(shared_rows(rows, min(map(len, rows))), True)
    return _Counted(_none(medians), False)


def _floor_rounds(
    medians: np.ndarray, clear: Sequence[bool], protocol: Protocol, pace: ReferencePace, limit: int
) -> list[int] | None:
    """The clear rounds whose floors time the runners, where the machine was idle but its pace scattered; else None.

    ``FLOOR_POOL`` times ``Protocol.rounds`` clear rounds (or ``limit``, if fewer), none in a slow spell of the
    machine (``spell_fastest_ms``: a spell slows INT8 more than FP32, and waiting it out is the remedy), and no
    back-off yet (``limit`` above ``Protocol.round_limit``): the rounds before a back-off lay in a spell or beside
    another process, and a pool with them would take a spell's rounds for floors where the spell ended a round ago.
    Without a pace band (``Protocol.quiet_band`` None) every clear round already counts: nothing to do.
    """
    rounds = [i for i, ok in enumerate(clear) if ok]
    if protocol.quiet_band is None or limit > protocol.round_limit:
        return None
    if len(rounds) < min(FLOOR_POOL * protocol.rounds, limit):
        return None
    if spell_fastest_ms(medians, clear, protocol.quiet_band, pace) is not None:
        return None
    return rounds


def _quiet_so_far(medians: np.ndarray, clear: Sequence[bool], protocol: Protocol, pace: ReferencePace) -> _Counted:
    """Where time ran out (``Protocol.stop_at``): the quiet rounds so far, or none (each runner's fastest runs)."""
    rows = _quiet(medians, clear, protocol, pace)
    if all(rows):
        return _Counted(shared_rows(rows, protocol.rounds), True)
    return _Counted(_none(medians), False)


def _quiet(medians: np.ndarray, clear: Sequence[bool], protocol: Protocol, pace: ReferencePace) -> list[list[int]]:
    """Each candidate's quiet rounds timed so far (``_quiet_rows`` over the clear ones, against the quiet pace)."""
    return quiet_rows(medians, [i for i, ok in enumerate(clear) if ok], protocol.quiet_band, pace)
