"""Tests for autotune.measure.timing.interleaved with a fake clock and fake runners."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from autotune.measure.timing import Latency, Protocol, interleaved, side_by_side

EVERY_ROUND = {"quiet_band": None, "settle_s": 0.0, "busy_wait": None, "busy_patience_s": 0.0}
"""The protocol without quiet rounds: every round counts, the process needs no settling."""
UNWAITED = {"busy_wait": None, "busy_patience_s": 0.0}
"""Scripted runners on a real machine: the machine's own run-queue wait must not add rounds to the script."""

WARMUP_S = 1000.0  # warm-up runs take so long that timing one would wreck every statistic


class FakeTime:
    """A clock that only moves when a fake runner runs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.clock_calls = 0

    def clock(self) -> float:
        self.clock_calls += 1
        return self.now


def _runner(name: str, time: FakeTime, log: list[str], durations_s: list[float]):
    queue = list(durations_s)

    def run() -> None:
        log.append(name)
        time.now += queue.pop(0)

    run.queue = queue
    return run


def _durations(protocol: Protocol, timed_ms: list[float]) -> list[float]:
    """Per call: warm-up durations, then the timed ones, round by round."""
    out: list[float] = []
    per_round = protocol.repeats
    for r in range(protocol.rounds):
        out += [WARMUP_S] * protocol.warmup
        out += [ms / 1e3 for ms in timed_ms[r * per_round : (r + 1) * per_round]]
    return out


def _measure(protocol: Protocol, reference_ms: list[float], candidate_ms: list[float]):
    time, log = FakeTime(), []
    reference = _runner("ref", time, log, _durations(protocol, reference_ms))
    candidate = _runner("cand", time, log, _durations(protocol, candidate_ms))
    latency = interleaved(candidate, reference, protocol, clock=time.clock)
    assert reference.queue == [] and candidate.queue == []  # every planned run happened, no more
    return latency, log, time


def test_call_order_reference_then_candidate_each_round():
    protocol = Protocol(warmup=2, repeats=3, rounds=3, **EVERY_ROUND)
    _, log, _ = _measure(protocol, [1.0] * 9, [1.0] * 9)
    block = protocol.warmup + protocol.repeats
    assert log == (["ref"] * block + ["cand"] * block) * protocol.rounds


def test_warmup_not_timed_and_clock_calls():
    protocol = Protocol(warmup=3, repeats=4, rounds=2, **EVERY_ROUND)
    latency, _, time = _measure(protocol, [2.0] * 8, [1.0] * 8)
    assert latency.median_ms == pytest.approx(1.0)
    assert latency.reference_median_ms == pytest.approx(2.0)
    assert latency.iqr_ms == pytest.approx(0.0, abs=1e-6)
    assert latency.reference_iqr_ms == pytest.approx(0.0, abs=1e-6)
    assert time.clock_calls == 2 * protocol.repeats * protocol.rounds * 2


def test_medians_and_iqr_from_known_durations():
    protocol = Protocol(warmup=1, repeats=3, rounds=2, **EVERY_ROUND)
    # reference samples 10..60: median 35, q1 22.5, q3 47.5 (linear interpolation) -> IQR 25
    # candidate samples 1,2,3 | 4,5,100: median 3.5, q1 2.25, q3 4.75 -> IQR 2.5
    latency, _, _ = _measure(protocol, [10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 100])
    assert latency.reference_median_ms == pytest.approx(35.0)
    assert latency.reference_iqr_ms == pytest.approx(25.0)
    assert latency.median_ms == pytest.approx(3.5)
    assert latency.iqr_ms == pytest.approx(2.5)
    assert latency.speedup == pytest.approx(10.0)


def test_unsorted_odd_samples():
    protocol = Protocol(warmup=2, repeats=5, rounds=1, **EVERY_ROUND)
    # candidate 9,1,5,3,7 -> sorted 1,3,5,7,9: median 5, q1 3, q3 7 -> IQR 4
    latency, _, _ = _measure(protocol, [8, 8, 8, 8, 8], [9, 1, 5, 3, 7])
    assert latency.median_ms == pytest.approx(5.0)
    assert latency.iqr_ms == pytest.approx(4.0)
    assert latency.reference_median_ms == pytest.approx(8.0)
    assert latency.speedup == pytest.approx(8.0 / 5.0)


def test_results_in_milliseconds():
    protocol = Protocol(warmup=1, repeats=1, rounds=1, **EVERY_ROUND)
    latency, _, _ = _measure(protocol, [250.0], [125.0])
    assert latency.reference_median_ms == pytest.approx(250.0)
    assert latency.median_ms == pytest.approx(125.0)
    assert latency.speedup == pytest.approx(2.0)


def test_slower_candidate_speedup_below_one():
    protocol = Protocol(warmup=1, repeats=2, rounds=1, **EVERY_ROUND)
    latency, _, _ = _measure(protocol, [4.0, 4.0], [8.0, 8.0])
    assert latency.speedup == pytest.approx(0.5)


def test_speedup_property():
    assert Latency(median_ms=2.0, iqr_ms=0.1, reference_median_ms=5.0, reference_iqr_ms=0.2).speedup == 2.5


def test_protocol_to_dict_and_defaults():
    defaults = {"quiet_band": 0.05, "settle_s": 5.0, "max_rounds": None, "busy_wait": 0.1, "busy_patience_s": 5.0}
    defaults.update(min_sample_ms=0.0, busy_others=None, stop_at=None, spell_patience_s=15.0, turn_s=0.0)
    assert Protocol().to_dict() == {"warmup": 2, "repeats": 5, "rounds": 4, **defaults}
    assert Protocol(1, 2, 3).to_dict() == {"warmup": 1, "repeats": 2, "rounds": 3, **defaults}


def test_real_clock_default():
    calls = []
    latency = interleaved(lambda: calls.append("c"), lambda: calls.append("r"), Protocol(1, 2, 1, **EVERY_ROUND))
    assert calls == ["r"] * 3 + ["c"] * 3
    assert latency.median_ms >= 0 and latency.reference_median_ms >= 0


def test_speedup_is_the_median_of_per_round_ratios_so_a_slow_spell_cancels():
    # blocks in call order: ref1, cand1, ref2, cand2, ref3, cand3; the machine turns 3x slower from cand2 on.
    # The candidate is always 2x faster: round ratios are 2, 2/3, 2. Pooled medians would say 0.67x.
    slowdown = iter([1, 1, 1, 3, 3, 3])

    def runner(base_ms):
        return lambda: base_ms * next(slowdown)

    latency = interleaved(
        runner(1.0), runner(2.0), Protocol(warmup=0, repeats=1, rounds=3, **EVERY_ROUND), self_timed=True
    )
    assert latency.round_speedups == pytest.approx((2.0, 2 / 3, 2.0))
    assert latency.speedup == pytest.approx(2.0)
    assert latency.reference_median_ms / latency.median_ms == pytest.approx(2 / 3)


def test_side_by_side_rotates_the_order_so_every_runner_takes_every_place():
    from autotune.measure.timing import side_by_side

    log: list[str] = []

    def runner(name: str):
        return lambda: log.append(name) or 1.0

    protocol = Protocol(warmup=1, repeats=2, rounds=3, **EVERY_ROUND)
    side_by_side([runner("a"), runner("b")], runner("ref"), protocol, self_timed=True)
    block = protocol.warmup + protocol.repeats
    rounds = [log[i : i + 3 * block : block] for i in range(0, len(log), 3 * block)]
    assert rounds == [["ref", "a", "b"], ["a", "b", "ref"], ["b", "ref", "a"]]
    assert len(log) == 3 * 3 * block


def test_side_by_side_compares_candidates_within_each_round_so_drift_between_rounds_cancels():
    from autotune.measure.timing import side_by_side

    # The machine turns 3x slower for round 2 only; "fast" always takes half the time of "slow".
    calls = {"count": 0}
    per_round = 3 * 1  # three runners, one timed run each (no warm-up)

    def runner(base_ms: float):
        def run() -> float:
            round_index = calls["count"] // per_round
            calls["count"] += 1
            return base_ms * (3.0 if round_index == 1 else 1.0)

        return run

    fast, slow = side_by_side(
        [runner(1.0), runner(2.0)], runner(4.0), Protocol(warmup=0, repeats=1, rounds=3, **EVERY_ROUND), self_timed=True
    )
    assert fast.round_speedups == pytest.approx((4.0, 4.0, 4.0))
    assert slow.round_speedups == pytest.approx((2.0, 2.0, 2.0))
    assert [f / s for f, s in zip(fast.round_speedups, slow.round_speedups, strict=True)] == pytest.approx([2.0] * 3)
    assert fast.reference_median_ms == slow.reference_median_ms == pytest.approx(4.0)


def test_side_by_side_of_one_candidate_measures_what_interleaved_measures():
    from autotune.measure.timing import side_by_side

    protocol = Protocol(warmup=0, repeats=3, rounds=4, **EVERY_ROUND)

    def runner(ms: float):
        return lambda: ms

    (alone,) = side_by_side([runner(2.0)], runner(5.0), protocol, self_timed=True)
    pair = interleaved(runner(2.0), runner(5.0), protocol, self_timed=True)
    assert replace(alone, busy=None) == replace(pair, busy=None)  # the machine's readings differ between calls
    assert alone.speedup == pytest.approx(2.5)


def _spell_runner(quiet_ms: float, spell_ms: float, in_spell):
    """A self-timed runner: ``spell_ms`` while ``in_spell()`` says the machine is in a slow spell."""
    return lambda: spell_ms if in_spell() else quiet_ms


def test_rounds_in_a_slow_spell_do_not_count_and_the_measurement_goes_on_until_enough_are_quiet():
    from autotune.measure.timing import ReferencePace

    # Rounds 1-3 fall in a spell: FP32 1.2x slower, INT8 1.5x slower (the ratio itself moves: 2.0 -> 1.6).
    rounds_timed = {"n": 0}

    def in_spell() -> bool:
        return 1 <= rounds_timed["n"] // 2 <= 3  # two blocks (reference, candidate) per round

    def counting(runner):
        def run() -> float:
            ms = runner()
            rounds_timed["n"] += 1
            return ms

        return run

    reference = counting(_spell_runner(2.0, 2.4, in_spell))
    candidate = counting(_spell_runner(1.0, 1.5, in_spell))
    pace = ReferencePace()
    latency = interleaved(
        candidate,
        reference,
        Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, **UNWAITED),
        self_timed=True,
        pace=pace,
    )
    assert latency.round_speedups == pytest.approx((2.0, 2.0, 2.0))  # rounds 0, 4, 5: the spell left out
    assert rounds_timed["n"] == 2 * 6  # three quiet rounds needed six
    assert latency.reference_median_ms == pytest.approx(2.0)
    assert pace.fastest_ms == pytest.approx(2.0)


def test_every_round_counts_without_a_band():
    spell = iter([False, True, True])
    flags = {"now": False}

    def advance() -> bool:
        return flags["now"]

    def reference() -> float:
        flags["now"] = next(spell)
        return 2.4 if flags["now"] else 2.0

    candidate = _spell_runner(1.0, 1.5, advance)
    protocol = Protocol(warmup=0, repeats=1, rounds=3, **EVERY_ROUND)
    latency = interleaved(candidate, reference, protocol, self_timed=True)
    assert latency.round_speedups == pytest.approx((2.0, 1.6, 1.6))  # the old protocol: the spell's rounds count


def test_a_fresh_process_times_until_it_has_settled_then_trusts_its_fastest_round():
    from autotune.measure.timing import ReferencePace

    calls = {"reference": 0}
    wall = FakeTime()

    def reference() -> float:
        calls["reference"] += 1
        wall.now += 0.010
        return 10.0

    def candidate() -> float:
        wall.now += 0.005
        return 5.0

    pace = ReferencePace(clock=wall.clock)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.2, **UNWAITED)
    interleaved(candidate, reference, protocol, self_timed=True, pace=pace)
    assert calls["reference"] == 14  # 15 ms a round: 0.2 s takes 14 rounds, not 2
    assert pace.timed_s == pytest.approx(0.21)
    interleaved(candidate, reference, protocol, self_timed=True, pace=pace)
    assert calls["reference"] == 16  # settled: the next measurement times its 2 rounds


def test_a_measurement_all_in_a_spell_stops_at_its_round_limit_on_each_runners_fastest_rounds():
    from autotune.measure.timing import ReferencePace

    pace = ReferencePace()
    pace.add(2.0, 10.0)  # the process saw the machine quiet, and has settled
    reference_ms = iter([3.0, 2.6, 2.9, 2.5, 3.1, 2.8, 9.9])
    calls = {"count": 0}

    def reference() -> float:
        calls["count"] += 1
        return next(reference_ms)

    protocol = Protocol(warmup=0, repeats=1, rounds=2, max_rounds=6, spell_patience_s=0.0, **UNWAITED)
    latency = interleaved(lambda: 1.0, reference, protocol, self_timed=True, pace=pace)
    assert calls["count"] == 6  # no round within 10 % of 2.0 ms, the pace a moment ago: stopped at max_rounds
    assert latency.round_speedups == pytest.approx((2.5, 2.6))  # each runner by its own two fastest rounds
    assert not latency.busy.quiet and latency.busy.slower_by == pytest.approx(0.25)  # a spell, no process
    assert latency.busy.describe().startswith("the machine ran slow: FP32 ran at best 25% slower")
    assert Protocol(rounds=3).round_limit == 12


def test_a_model_of_microseconds_settles_after_a_bounded_number_of_rounds():
    from autotune.measure.timing import SETTLE_ROUNDS, ReferencePace

    pace = ReferencePace()
    latency = interleaved(
        lambda: 0.001, lambda: 0.002, Protocol(warmup=0, repeats=1, settle_s=3600.0, **UNWAITED), pace=pace
    )
    assert pace.rounds == SETTLE_ROUNDS and pace.timed_s < 3600
    assert latency.speedup > 0


class ScriptedSampler:
    """A ``Sampler`` whose readings are scripted: round ``k`` waited ``waits(k)`` of its time for a core."""

    cpus = [0, 1]

    def __init__(self, waits) -> None:
        self.waits = waits
        self.taken = 0
        self.backed_off: list[float] = []

    def snapshot(self) -> int:
        self.taken += 1
        return self.taken - 1

    def back_off(self, longest_s: float) -> float:
        self.backed_off.append(longest_s)
        return longest_s

    def reading(self, start, end):
        from autotune.measure.interference import Reading

        if start is None or end is None:
            return None
        rounds = range(start, end)
        return Reading(float(len(rounds)), 0.5, sum(self.waits(k) for k in rounds) / max(1, len(rounds)))


def _asymmetric_spells(candidate_ms: float, seed: int, sampler_waits: bool = False):
    """Self-timed FP32 and a candidate on a machine whose slow spells hit one of them at a time.

    Each round is quiet, or the candidate runs 1.5-3x slower while the reference does not, or the reference does
    while the candidate does not (what one busy process does to two sessions whose threads it shares cores with).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    states = rng.choice(["quiet", "candidate", "reference"], size=400, p=[0.3, 0.45, 0.25])
    slow = rng.uniform(1.5, 3.0, size=400)
    calls = {"reference": 0}

    def jitter() -> float:
        return float(rng.normal(1.0, 0.005))

    def reference() -> float:
        calls["reference"] += 1
        k = (calls["reference"] - 1) // 3  # three timed runs a round
        return 2.0 * jitter() * (slow[k] if states[k] == "reference" else 1.0)

    def candidate() -> float:
        k = (calls["reference"] - 1) // 3
        return candidate_ms * jitter() * (slow[k] if states[k] == "candidate" else 1.0)

    waits = ScriptedSampler(lambda k: 0.5 if states[k] != "quiet" and sampler_waits else 0.0)
    return candidate, reference, waits


@pytest.mark.parametrize("seed", range(5))
def test_fp32_against_itself_reads_1_when_spells_slow_one_runner_at_a_time(seed):
    # The old rule (rounds chosen by the reference's pace alone) kept the rounds in which only the candidate was slow
    # and read this at 0.4-0.7x; every runner's own pace must count alike.
    protocol = Protocol(warmup=0, repeats=3, rounds=4, settle_s=0.0, max_rounds=60, busy_wait=None)
    candidate, reference, sampler = _asymmetric_spells(2.0, seed)
    latency = interleaved(candidate, reference, protocol, self_timed=True, sampler=sampler)
    assert latency.speedup == pytest.approx(1.0, abs=0.03)
    assert latency.busy.quiet and latency.busy.counted == 4
    faster, reference, sampler = _asymmetric_spells(2.0 / 1.4, seed)
    assert interleaved(faster, reference, protocol, self_timed=True, sampler=sampler).speedup == pytest.approx(
        1.4, rel=0.03
    )


def _slowed_by_round(reference_ms: Callable[[int], float], candidate_ms: Callable[[int], float]):
    """Self-timed reference and candidate runners whose milliseconds depend on the round (the reference runs first)."""
    rounds = {"n": 0}

    def reference() -> float:
        rounds["n"] += 1
        return reference_ms(rounds["n"])

    def candidate() -> float:
        return candidate_ms(rounds["n"])

    return reference, candidate


def test_rounds_in_which_the_process_waited_for_a_core_do_not_count():
    from autotune.measure.timing import side_by_side

    # The first six rounds: another process holds a core and slows both runners alike, the candidate a little more
    # (its two threads wait on each other); the per-runner pace alone would accept them, the wait does not.
    reference, candidate = _slowed_by_round(lambda n: 2.0 * (3.0 if n <= 6 else 1.0), lambda n: 3.3 if n <= 6 else 1.0)

    sampler = ScriptedSampler(lambda k: 0.4 if k < 6 else 0.0)
    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=20)
    (latency,) = side_by_side([candidate], reference, protocol, self_timed=True, sampler=sampler)
    assert latency.round_speedups == pytest.approx((2.0, 2.0, 2.0))
    assert latency.busy.contended == 6 and latency.busy.counted == 3 and latency.busy.rounds == 9
    assert latency.busy.quiet and latency.busy.shared
    assert latency.busy.describe().startswith("the machine was busy (other processes took 50% of cores 0-1")


def test_a_machine_busy_in_every_round_is_said_to_be_too_busy():
    sampler = ScriptedSampler(lambda k: 0.6)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, max_rounds=5, busy_patience_s=5.0)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=sampler)
    # It stepped off the cores until its 5 s of patience were spent, each time timing 5 rounds more, in vain, and
    # one round after the back-off that spent the patience (not 5: the limit would make a slow model overrun).
    assert sampler.backed_off == [2.0, 2.0, 2.0]
    assert latency.busy.rounds == 16 and latency.busy.contended == 16 and not latency.busy.quiet
    assert "too busy to measure" in latency.busy.describe()


def test_without_the_schedulers_accounting_the_wait_is_not_checked_and_nobody_says_busy():
    class Blind(ScriptedSampler):
        def snapshot(self):
            return None

    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=Blind(lambda k: 0.9))
    assert latency.busy.rounds == 2 and latency.busy.others is None and latency.busy.quiet
    assert not latency.busy.shared


def test_busy_figures_of_several_measurements_merge_weighted_by_rounds():
    from autotune.measure.interference import Busy

    merged = Busy.merged([Busy(4, 4, 0, 0.1, 0.0, "0-1", True), None, Busy(12, 4, 8, 0.5, 0.3, "0-1", False)])
    assert (merged.rounds, merged.counted, merged.contended, merged.quiet) == (16, 8, 8, False)
    assert merged.others == pytest.approx((0.1 * 4 + 0.5 * 12) / 16)
    assert Busy.merged([None]) is None


def test_rounds_that_take_seconds_spend_the_patience_as_the_back_offs_do():
    from autotune.measure.timing import ReferencePace

    # A model whose rounds take 3 s on a busy machine: past the limit of 2 rounds it backs off once (2 s), times
    # one round more (3 s), and its 5 s of patience are spent: it stops there, not at the next limit (4 rounds);
    # counting the back-offs alone, it timed 8 rounds.
    now = [0.0]

    def reference() -> float:
        now[0] += 3.0
        return 2.0

    sampler = ScriptedSampler(lambda k: 0.6)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, max_rounds=2, busy_patience_s=5.0)
    pace = ReferencePace(clock=lambda: now[0])
    latency = interleaved(lambda: 1.0, reference, protocol, self_timed=True, pace=pace, sampler=sampler)
    assert sampler.backed_off == [2.0] and latency.busy.rounds == 3 and not latency.busy.quiet


def test_a_measurement_that_backed_off_counts_the_quiet_rounds_after_it():
    # The other process holds the cores for the first eight rounds, then leaves while this one waits off the cores.
    sampler = ScriptedSampler(lambda k: 0.6 if k < 8 else 0.0)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, max_rounds=4)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=sampler)
    # Four busy rounds (the sampler's spans 0-3), a back-off, four more of which one is quiet (spans 5-8), a second
    # back-off, and one more quiet round (span 10): two quiet rounds count.
    assert sampler.backed_off == [2.0, 2.0]
    assert latency.busy.quiet and latency.busy.counted == 2
    assert (latency.busy.rounds, latency.busy.contended) == (9, 7)


def test_where_no_round_is_quiet_each_runner_is_timed_by_its_own_fastest_runs():
    # Every round contended; a busy process shares a core with the reference's threads for the first ten rounds and
    # with the candidate's after that (the scheduler keeps a thread where it put it). No round has both fast. Its
    # 6 s of patience end one round after the third back-off: 16 rounds.
    reference, candidate = _slowed_by_round(
        lambda n: 2.0 * (3.0 if n <= 10 else 1.0), lambda n: 2.0 * (3.0 if n > 10 else 1.0)
    )

    sampler = ScriptedSampler(lambda k: 0.6)
    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=5, busy_patience_s=6.0)
    latency = interleaved(candidate, reference, protocol, self_timed=True, sampler=sampler)
    assert latency.busy.rounds == 16 and not latency.busy.quiet
    assert latency.speedup == pytest.approx(1.0) and latency.round_speedups == pytest.approx((1.0, 1.0, 1.0))
    assert latency.median_ms == pytest.approx(2.0) and latency.reference_median_ms == pytest.approx(2.0)


def test_a_measurement_without_quiet_rounds_and_without_other_processes_blames_the_pace_not_the_machine():
    from autotune.measure.interference import Busy

    unsteady = Busy(rounds=96, counted=4, contended=2, others=0.0, waited=0.0, cpus="0-1", quiet=False)
    assert unsteady.describe().startswith("no quiet rounds: the plans' pace moved from round to round")
    busy = Busy(rounds=96, counted=4, contended=90, others=0.4, waited=0.8, cpus="0-1", quiet=False)
    assert busy.describe().startswith("the machine was too busy to measure")


def _switch_sensitive(base_ms: float, cold_ms: float, time: FakeTime, switches: list[str], name: str):
    """A self-timed sub-millisecond runner whose first runs after another runner ran cost ``cold_ms`` more.

    Its caches were the other runner's: the penalty halves with every run back to back (as a small model's
    weights come back into cache), so a protocol of two runs a side times mostly the cold ones.
    """
    state = {"since_switch": 0}

    def run() -> float:
        if switches and switches[-1] != name:
            state["since_switch"] = 0
        switches.append(name)
        ms = base_ms + cold_ms * 0.5 ** state["since_switch"]
        state["since_switch"] += 1
        time.now += ms / 1e3
        return ms

    return run


def _sub_ms_speedup(protocol: Protocol) -> float:
    time, switches = FakeTime(), []
    reference = _switch_sensitive(0.20, 0.05, time, switches, "ref")
    candidate = _switch_sensitive(0.08, 0.30, time, switches, "cand")  # smaller engine, colder after a switch
    return interleaved(candidate, reference, protocol, clock=time.clock, self_timed=True).speedup


def test_runs_per_sample_make_a_sample_last_min_sample_ms():
    time, log = FakeTime(), []
    run = _runner("fast", time, log, [0.0001] * 1000)  # 0.1 ms a run
    protocol = Protocol(warmup=1, repeats=3, rounds=1, min_sample_ms=1.0, **EVERY_ROUND)
    interleaved(run, _runner("ref", time, [], [0.002] * 100), protocol, clock=time.clock)
    assert len(log) == 1 + 3 * 10  # the warm-up run sized the samples: 3 samples of 10 runs


def test_a_sub_millisecond_models_search_and_confirmation_agree_once_samples_are_autoranged():
    search = Protocol(warmup=1, repeats=2, rounds=4, **EVERY_ROUND)  # configs/minilm-cpu.yaml's search protocol
    confirmation = Protocol(warmup=2, repeats=10, rounds=8, **EVERY_ROUND)  # the confirmation's
    apart = _sub_ms_speedup(search) / _sub_ms_speedup(confirmation)
    assert abs(apart - 1) > 0.2  # one run a sample: the short protocol times the cold runs after a switch
    sized = [replace(protocol, min_sample_ms=1.0) for protocol in (search, confirmation)]
    assert _sub_ms_speedup(sized[0]) == pytest.approx(_sub_ms_speedup(sized[1]), rel=0.05)


class _SharedSampler(ScriptedSampler):
    """Never a run-queue wait; other processes took ``others(k)`` of the cores in span ``k`` (snapshots apart)."""

    def __init__(self, others) -> None:
        super().__init__(lambda k: 0.0)
        self.others = others

    def reading(self, start, end):
        from autotune.measure.interference import Reading

        if start is None or end is None:
            return None
        spans = range(start, end)
        share = max((self.others(k) for k in spans), default=0.0)
        return Reading(float(len(spans)), share, 0.0)


def test_rounds_in_a_span_where_others_took_the_cores_do_not_count_though_nothing_waited():
    # Another process takes half the cores while the first three rounds are timed; the timed threads never wait
    # (it runs in their idle moments), yet all-INT8 ran 1.5x slower there: those rounds are timed again.
    sampler = _SharedSampler(lambda k: 0.5 if k < 3 else 0.0)

    def reference() -> float:
        return 2.0 * (1.2 if sampler.taken <= 3 else 1.0)  # rounds 0-2 end at snapshots 1-3

    def candidate() -> float:
        return 1.0 * (1.5 if sampler.taken <= 3 else 1.0)

    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=20, quiet_band=None, busy_others=0.1)
    (latency,) = side_by_side([candidate], reference, protocol, self_timed=True, sampler=sampler)
    assert latency.round_speedups == pytest.approx((2.0, 2.0, 2.0))
    assert latency.busy.quiet and latency.busy.contended == 3 and latency.busy.rounds == 6
    assert latency.busy.describe().startswith("the machine was busy")
    sampler = _SharedSampler(lambda k: 0.5 if k < 3 else 0.0)
    without = Protocol(**{**protocol.to_dict(), "busy_others": None})
    (unchecked,) = side_by_side([candidate], reference, without, self_timed=True, sampler=sampler)
    assert unchecked.round_speedups == pytest.approx((1.6, 1.6, 1.6))  # what the rounds beside it read


def test_a_machine_shared_in_every_span_is_said_to_be_too_busy():
    sampler = _SharedSampler(lambda k: 0.5)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, max_rounds=4, busy_others=0.1, busy_patience_s=4)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=sampler)
    assert sampler.backed_off == [2.0, 2.0] and not latency.busy.quiet
    assert "too busy to measure" in latency.busy.describe()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc accounting")
def test_a_real_process_at_nice_19_on_our_cores_makes_the_measurement_say_the_machine_was_shared():
    import os
    import subprocess

    cpus = sorted(os.sched_getaffinity(0))
    loop = (
        f"import os, time; os.sched_setaffinity(0, {set(cpus)}); end = time.time() + 4; print('spinning', flush=True)"
        "\nwhile time.time() < end: pass"
    )
    competitors = [
        subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", loop], stdout=subprocess.PIPE, text=True)
        for _ in cpus
    ]
    try:
        # Each spins before the measurement starts: on a loaded machine an interpreter takes longer than any sleep.
        assert all(competitor.stdout.readline().strip() == "spinning" for competitor in competitors)

        def run() -> None:
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            time.sleep(0.001)  # idle moments, in which the nice process runs without keeping us waiting

        protocol = Protocol(warmup=0, repeats=5, rounds=3, settle_s=0.0, max_rounds=6, busy_others=0.1)
        latency = interleaved(run, run, replace(protocol, busy_patience_s=0.0))
    finally:
        for competitor in competitors:
            competitor.kill()
            competitor.wait()
    assert latency.busy.others is not None and latency.busy.others > 0.1
    assert latency.busy.shared


def test_a_measurement_past_its_stop_time_ends_with_the_quiet_rounds_it_has():
    protocol = Protocol(warmup=0, repeats=1, rounds=4, settle_s=0.0, max_rounds=50, busy_patience_s=5.0)
    reference, candidate = _slowed_by_round(lambda n: 2.0, lambda n: 1.0)
    timed = interleaved(candidate, reference, replace(protocol, stop_at=time.time() - 1.0), self_timed=True)
    assert timed.busy.rounds == 1 and timed.busy.quiet and timed.round_speedups == pytest.approx((2.0,))
    # Without a stop time the same measurement times its four rounds.
    assert interleaved(candidate, reference, protocol, self_timed=True).busy.rounds == 4


def test_a_measurement_past_its_stop_time_without_a_quiet_round_times_each_runner_by_its_fastest_runs():
    # Every round waited for a core: none counts, and the stop ends the measurement before any back-off.
    sampler = ScriptedSampler(lambda k: 0.6)
    protocol = Protocol(warmup=0, repeats=1, rounds=4, settle_s=0.0, max_rounds=50, stop_at=time.time() - 1.0)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=sampler)
    assert latency.busy.rounds == 1 and not latency.busy.quiet and sampler.backed_off == []
    assert latency.speedup == pytest.approx(2.0)


def _host_spell(spell_back_offs: int, reference_quiet_ms: float = 2.0):
    """FP32 and all-INT8 on a VM whose host slows FP32 13 % and all-INT8 43 % until ``spell_back_offs`` back-offs.

    What a process that starts inside such a spell sees: nothing waits for a core, every round is alike, and the
    ratio reads 2.0 * 1.13 / 1.43 = 1.58 where it is 2.0.
    """
    sampler = ScriptedSampler(lambda k: 0.0)

    def in_spell() -> bool:
        return len(sampler.backed_off) < spell_back_offs

    reference = _spell_runner(reference_quiet_ms, reference_quiet_ms * 1.13, in_spell)
    candidate = _spell_runner(1.0, 1.43, in_spell)
    return reference, candidate, sampler


def test_a_process_that_starts_inside_a_slow_spell_waits_it_out_from_the_pace_earlier_processes_saw():
    from autotune.measure.timing import ReferencePace

    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=6, **UNWAITED)
    reference, candidate, sampler = _host_spell(spell_back_offs=2)
    fresh = interleaved(candidate, reference, protocol, self_timed=True, pace=ReferencePace(), sampler=sampler)
    assert fresh.speedup == pytest.approx(1.58, abs=0.01) and fresh.busy.quiet  # no memory: the spell is the pace

    reference, candidate, sampler = _host_spell(spell_back_offs=2)
    pace = ReferencePace(remembered_ms=2.0)  # an earlier process timed FP32 at 2.0 ms on this machine
    latency = interleaved(candidate, reference, protocol, self_timed=True, pace=pace, sampler=sampler)
    assert latency.speedup == pytest.approx(2.0, rel=0.03) and latency.busy.quiet
    assert sampler.backed_off == [2.0, 2.0]  # no other process, yet it stepped off until the spell ended


class _IdleSampler(ScriptedSampler):
    """No wait and no other work; a span of fewer than 3 rounds is too short to read the others' share."""

    def reading(self, start, end):
        from autotune.measure.interference import Reading

        if start is None or end is None:
            return None
        rounds = end - start
        return Reading(float(rounds), 0.0 if rounds >= 3 else None, 0.0, 0.0)


def test_a_slow_spell_on_an_idle_machine_is_said_to_be_one_not_other_work():
    from autotune.measure.timing import ReferencePace

    # The 36 %-slow process of a quiet 2-core VM had said "too busy ... in 80 of 81 rounds" at others 0 %: the rounds
    # its back-offs cut short were counted as other work's.
    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=4, spell_patience_s=5.0)
    protocol = replace(protocol, busy_wait=None, busy_others=0.1)
    reference, candidate, _ = _host_spell(spell_back_offs=100)
    sampler = _IdleSampler(lambda k: 0.0)
    latency = interleaved(
        candidate, reference, protocol, self_timed=True, pace=ReferencePace(remembered_ms=2.0), sampler=sampler
    )
    assert sampler.backed_off and not latency.busy.quiet and latency.busy.contended == 0
    assert latency.busy.describe().startswith("the machine ran slow")


def test_a_spell_that_outlasts_the_patience_is_said_to_be_one_and_timed_by_the_fastest_runs():
    from autotune.measure.timing import ReferencePace

    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, max_rounds=6, spell_patience_s=5.0, **UNWAITED)
    reference, candidate, sampler = _host_spell(spell_back_offs=100)
    pace = ReferencePace(remembered_ms=2.0)
    latency = interleaved(candidate, reference, protocol, self_timed=True, pace=pace, sampler=sampler)
    assert sampler.backed_off == [2.0, 2.0, 2.0]  # 5 s of patience, in back-offs of 2 s
    assert not latency.busy.quiet and latency.busy.slower_by == pytest.approx(0.13)
    assert latency.busy.describe().startswith("the machine ran slow: FP32 ran at best 13% slower than its quiet pace")


def test_a_process_faster_than_the_remembered_pace_goes_by_its_own():
    from autotune.measure.timing import ReferencePace

    pace = ReferencePace(remembered_ms=2.05)
    sampler = ScriptedSampler(lambda k: 0.0)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, **UNWAITED)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, pace=pace, sampler=sampler)
    assert latency.busy.quiet and latency.busy.rounds == 2 and sampler.backed_off == []
    assert pace.quiet_ms == 2.0 and not pace.behind(2.0) and pace.slower_by(2.0) == pytest.approx(0.0)
    assert ReferencePace(remembered_ms=2.05).slower_by(2.0) == pytest.approx(2.0 / 2.05 - 1)


def test_another_process_in_the_way_is_waited_for_as_long_as_busy_patience_not_the_spells():
    from autotune.measure.timing import ReferencePace

    sampler = ScriptedSampler(lambda k: 0.6)
    protocol = Protocol(warmup=0, repeats=1, rounds=2, settle_s=0.0, max_rounds=5, spell_patience_s=60.0)
    pace = ReferencePace(remembered_ms=1.0)  # behind the memory too, but the wait is the other process's
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, pace=pace, sampler=sampler)
    assert sampler.backed_off == [2.0, 2.0, 2.0] and "too busy to measure" in latency.busy.describe()


class _IdleSampler(ScriptedSampler):
    """An idle VM: the timed threads wait ``waits(k)`` of round ``k`` for a core (waking their own halted virtual
    cores), and nothing else takes any core time."""

    def reading(self, start, end):
        from autotune.measure.interference import Reading

        if start is None or end is None:
            return None
        rounds = range(start, end)
        waited = sum(self.waits(k) for k in rounds) / max(1, len(rounds))
        return Reading(float(len(rounds)), 0.0, waited, 0.0)


def test_the_process_waiting_on_its_own_threads_with_no_other_work_leaves_every_round_counting():
    protocol = Protocol(warmup=0, repeats=1, rounds=4, settle_s=0.0, max_rounds=8, busy_patience_s=5.0)
    sampler = _IdleSampler(lambda k: 0.6)
    latency = interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=sampler)
    assert latency.busy.quiet and latency.busy.contended == 0 and latency.busy.rounds == 4
    assert sampler.backed_off == [] and not latency.busy.shared
    # The same waits beside another process's core time are its doing: those rounds do not count.
    busy = ScriptedSampler(lambda k: 0.6)
    assert interleaved(lambda: 1.0, lambda: 2.0, protocol, self_timed=True, sampler=busy).busy.contended > 0


def test_a_hiccup_of_one_plan_costs_that_plan_its_round_and_no_other_plan():
    # Three plans side by side; plan k runs twice as slow in its own rounds n with n % 3 == k (its hiccups), so no
    # round has all three at their pace. Each plan still counts the rounds it ran at its own pace.
    calls = {"n": 0}

    def reference() -> float:
        calls["n"] += 1
        return 4.0

    def plan(k: int, ms: float):
        runs = {"n": 0}

        def run() -> float:
            runs["n"] += 1
            return ms * (2.0 if (runs["n"] - 1) % 3 == k else 1.0)

        return run

    protocol = Protocol(warmup=0, repeats=1, rounds=4, settle_s=0.0, max_rounds=8, busy_wait=None)
    latencies = side_by_side([plan(0, 1.0), plan(1, 2.0), plan(2, 4.0)], reference, protocol, self_timed=True)
    assert [latency.speedup for latency in latencies] == pytest.approx([4.0, 2.0, 1.0])
    assert all(latency.busy.quiet and len(latency.round_speedups) >= 4 for latency in latencies)
    assert calls["n"] <= 7  # four rounds of its own for each plan within six rounds, not the limit


def test_an_idle_machine_whose_rounds_scatter_past_the_quiet_band_still_counts_them():
    # FP32 and the plan scatter together by up to 9.5 % from round to round (a VM's host, turbo clocks): the 5 %
    # band alone would count 3 rounds in 10; the measured spread widens it, and the ratio stays exact.
    scatter = [1.0, 1.07, 1.03, 1.09, 1.06, 1.08, 1.02, 1.095, 1.065, 1.085]
    calls = {"n": 0}

    def reference() -> float:
        calls["n"] += 1
        return 2.0 * scatter[(calls["n"] - 1) % len(scatter)]

    def candidate() -> float:
        return 1.0 * scatter[(calls["n"] - 1) % len(scatter)]

    protocol = Protocol(warmup=0, repeats=1, rounds=8, settle_s=0.0, max_rounds=12, busy_wait=None)
    latency = interleaved(candidate, reference, protocol, self_timed=True)
    assert latency.busy.quiet and latency.speedup == pytest.approx(2.0) and latency.busy.rounds <= 12
    narrow = Protocol(**{**protocol.to_dict(), "quiet_band": 0.05})
    calls["n"] = 0
    assert interleaved(candidate, reference, narrow, self_timed=True).busy.quiet  # the band is the floor, not the cap


def test_a_pace_from_minutes_ago_does_not_make_a_steadily_slower_machine_a_spell():
    from autotune.measure.quiet_rounds import PACE_WINDOW_S, ReferencePace

    now = [0.0]
    pace = ReferencePace(clock=lambda: now[0])
    pace.add(2.0, 10.0)  # FP32's fastest round, at the start of a long run
    protocol = Protocol(warmup=0, repeats=1, rounds=3, settle_s=0.0, spell_patience_s=0.0, **UNWAITED)
    now[0] = PACE_WINDOW_S + 1.0  # the machine now runs FP32 15 % slower, and has for minutes
    later = interleaved(lambda: 1.15, lambda: 2.3, protocol, self_timed=True, pace=pace)
    assert later.busy.quiet and later.busy.slower_by is None and later.speedup == pytest.approx(2.0)
    recent = ReferencePace(clock=lambda: now[0])
    recent.add(2.0, 10.0)  # the same step within the last minute is a spell
    spell = interleaved(lambda: 1.15, lambda: 2.3, protocol, self_timed=True, pace=recent)
    assert not spell.busy.quiet and spell.busy.slower_by == pytest.approx(0.15)


def test_at_its_limit_an_idle_machine_whose_pace_drifts_times_each_runner_by_its_fastest_half_of_rounds():
    # A machine whose pace drifts, nothing else on it: only 2 of 8 rounds ran at the reference's pace; the plan is 2x.
    drift = [1.0] * 2 + [1.3] * 6
    reference, candidate = _slowed_by_round(lambda n: 2.0 * drift[n - 1], lambda n: 1.0 * drift[n - 1])
    protocol = Protocol(warmup=0, repeats=1, rounds=8, settle_s=0.0, max_rounds=8, spell_patience_s=0.0, **UNWAITED)
    latency = interleaved(candidate, reference, protocol, self_timed=True)
    assert latency.busy.quiet and not latency.busy.shared and latency.busy.rounds == 8
    assert latency.busy.counted == 4 and latency.round_speedups == pytest.approx((2.0,) * 4)


@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_an_idle_machine_whose_runs_scatter_a_fifth_above_their_fastest_is_timed_in_twice_its_rounds(ratio):
    import random

    # What an idle 2-core VM did to a 200 ms model: each run 0-40 % above its fastest, run by run, at random. No
    # band short of that counts 6 rounds in 24; each runner's fastest half of 12 rounds reads the ratio within 2 %.
    noise = random.Random(7)

    def reference() -> float:
        return 200.0 * (1 + 0.4 * noise.random())

    def candidate() -> float:
        return 200.0 / ratio * (1 + 0.4 * noise.random())

    protocol = Protocol(warmup=0, repeats=2, rounds=6, settle_s=0.0, **UNWAITED)
    latency = interleaved(candidate, reference, protocol, self_timed=True)
    assert latency.busy.quiet and not latency.busy.shared and latency.busy.rounds == 12
    assert latency.speedup == pytest.approx(ratio, rel=0.02)


def test_a_slow_runners_turn_is_cut_to_one_warm_up_and_the_samples_that_fit_its_turn_seconds():
    calls = {"slow": 0, "fast": 0}

    def runner(name: str, ms: float) -> Callable[[], float]:
        def run() -> float:
            calls[name] += 1
            return ms

        return run

    protocol = Protocol(warmup=2, repeats=10, rounds=3, settle_s=0.0, turn_s=0.6, **UNWAITED)
    latency = interleaved(runner("slow", 200.0), runner("fast", 2.0), protocol, self_timed=True)
    # The first turn takes the counts as set (nothing timed yet), each later one 1 warm-up + 2 samples of 200 ms;
    # the 2 ms reference's 12 runs fit its 0.6 s.
    assert calls["slow"] == 12 + 2 * 3 and calls["fast"] == 3 * 12
    assert latency.speedup == pytest.approx(0.01)
    uncut = Protocol(**{**protocol.to_dict(), "turn_s": 0.0})
    calls.update(slow=0, fast=0)
    interleaved(runner("slow", 200.0), runner("fast", 2.0), uncut, self_timed=True)
    assert calls["slow"] == 3 * 12
