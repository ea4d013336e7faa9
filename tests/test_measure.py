"""Tests for autotune.measure.interleaved with a fake clock and fake runners."""

from __future__ import annotations

import pytest

from autotune.measure import Latency, Protocol, interleaved

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
    protocol = Protocol(warmup=2, repeats=3, rounds=3)
    _, log, _ = _measure(protocol, [1.0] * 9, [1.0] * 9)
    block = protocol.warmup + protocol.repeats
    assert log == (["ref"] * block + ["cand"] * block) * protocol.rounds


def test_warmup_not_timed_and_clock_calls():
    protocol = Protocol(warmup=3, repeats=4, rounds=2)
    latency, _, time = _measure(protocol, [2.0] * 8, [1.0] * 8)
    assert latency.median_ms == pytest.approx(1.0)
    assert latency.reference_median_ms == pytest.approx(2.0)
    assert latency.iqr_ms == pytest.approx(0.0, abs=1e-6)
    assert latency.reference_iqr_ms == pytest.approx(0.0, abs=1e-6)
    assert time.clock_calls == 2 * protocol.repeats * protocol.rounds * 2


def test_medians_and_iqr_from_known_durations():
    protocol = Protocol(warmup=1, repeats=3, rounds=2)
    # reference samples 10..60: median 35, q1 22.5, q3 47.5 (linear interpolation) -> IQR 25
    # candidate samples 1,2,3 | 4,5,100: median 3.5, q1 2.25, q3 4.75 -> IQR 2.5
    latency, _, _ = _measure(protocol, [10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 100])
    assert latency.reference_median_ms == pytest.approx(35.0)
    assert latency.reference_iqr_ms == pytest.approx(25.0)
    assert latency.median_ms == pytest.approx(3.5)
    assert latency.iqr_ms == pytest.approx(2.5)
    assert latency.speedup == pytest.approx(10.0)


def test_unsorted_odd_samples():
    protocol = Protocol(warmup=2, repeats=5, rounds=1)
    # candidate 9,1,5,3,7 -> sorted 1,3,5,7,9: median 5, q1 3, q3 7 -> IQR 4
    latency, _, _ = _measure(protocol, [8, 8, 8, 8, 8], [9, 1, 5, 3, 7])
    assert latency.median_ms == pytest.approx(5.0)
    assert latency.iqr_ms == pytest.approx(4.0)
    assert latency.reference_median_ms == pytest.approx(8.0)
    assert latency.speedup == pytest.approx(8.0 / 5.0)


def test_results_in_milliseconds():
    protocol = Protocol(warmup=1, repeats=1, rounds=1)
    latency, _, _ = _measure(protocol, [250.0], [125.0])
    assert latency.reference_median_ms == pytest.approx(250.0)
    assert latency.median_ms == pytest.approx(125.0)
    assert latency.speedup == pytest.approx(2.0)


def test_slower_candidate_speedup_below_one():
    protocol = Protocol(warmup=1, repeats=2, rounds=1)
    latency, _, _ = _measure(protocol, [4.0, 4.0], [8.0, 8.0])
    assert latency.speedup == pytest.approx(0.5)


def test_speedup_property():
    assert Latency(median_ms=2.0, iqr_ms=0.1, reference_median_ms=5.0, reference_iqr_ms=0.2).speedup == 2.5


def test_protocol_to_dict_and_defaults():
    assert Protocol().to_dict() == {"warmup": 2, "repeats": 5, "rounds": 4}
    assert Protocol(1, 2, 3).to_dict() == {"warmup": 1, "repeats": 2, "rounds": 3}


def test_real_clock_default():
    calls = []
    latency = interleaved(lambda: calls.append("c"), lambda: calls.append("r"), Protocol(1, 2, 1))
    assert calls == ["r"] * 3 + ["c"] * 3
    assert latency.median_ms >= 0 and latency.reference_median_ms >= 0


def test_speedup_is_the_median_of_per_round_ratios_so_a_slow_spell_cancels():
    from autotune.measure import Protocol, interleaved

    # blocks in call order: ref1, cand1, ref2, cand2, ref3, cand3; the machine turns 3x slower from cand2 on.
    # The candidate is always 2x faster: round ratios are 2, 2/3, 2. Pooled medians would say 0.67x.
    slowdown = iter([1, 1, 1, 3, 3, 3])

    def runner(base_ms):
        return lambda: base_ms * next(slowdown)

    latency = interleaved(runner(1.0), runner(2.0), Protocol(warmup=0, repeats=1, rounds=3), self_timed=True)
    assert latency.round_speedups == pytest.approx((2.0, 2 / 3, 2.0))
    assert latency.speedup == pytest.approx(2.0)
    assert latency.reference_median_ms / latency.median_ms == pytest.approx(2 / 3)


def test_side_by_side_rotates_the_order_so_every_runner_takes_every_place():
    from autotune.measure import side_by_side

    log: list[str] = []

    def runner(name: str):
        return lambda: log.append(name) or 1.0

    protocol = Protocol(warmup=1, repeats=2, rounds=3)
    side_by_side([runner("a"), runner("b")], runner("ref"), protocol, self_timed=True)
    block = protocol.warmup + protocol.repeats
    rounds = [log[i : i + 3 * block : block] for i in range(0, len(log), 3 * block)]
    assert rounds == [["ref", "a", "b"], ["a", "b", "ref"], ["b", "ref", "a"]]
    assert len(log) == 3 * 3 * block


def test_side_by_side_compares_candidates_within_each_round_so_drift_between_rounds_cancels():
    from autotune.measure import side_by_side

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
        [runner(1.0), runner(2.0)], runner(4.0), Protocol(warmup=0, repeats=1, rounds=3), self_timed=True
    )
    assert fast.round_speedups == pytest.approx((4.0, 4.0, 4.0))
    assert slow.round_speedups == pytest.approx((2.0, 2.0, 2.0))
    assert [f / s for f, s in zip(fast.round_speedups, slow.round_speedups, strict=True)] == pytest.approx([2.0] * 3)
    assert fast.reference_median_ms == slow.reference_median_ms == pytest.approx(4.0)


def test_side_by_side_of_one_candidate_measures_what_interleaved_measures():
    from autotune.measure import side_by_side

    protocol = Protocol(warmup=0, repeats=3, rounds=4)

    def runner(ms: float):
        return lambda: ms

    (alone,) = side_by_side([runner(2.0)], runner(5.0), protocol, self_timed=True)
    pair = interleaved(runner(2.0), runner(5.0), protocol, self_timed=True)
    assert alone == pair
    assert alone.speedup == pytest.approx(2.5)


def test_two_plans_timed_side_by_side_compare_round_by_round():
    from autotune.measure import compare_rounds

    # per round: 1.25x, 0.8x, 1.2x of the baseline
    assert compare_rounds([2.5, 1.6, 1.8], [2.0, 2.0, 1.5]) == (pytest.approx(1.2), 2)
    assert compare_rounds([2.0, 2.0], [2.0, 2.0]) == (1.0, 0)  # a tie is not faster
    assert compare_rounds([2.0], [2.0, 2.0]) is None  # not the same rounds
    assert compare_rounds([], []) is None


def test_self_check_reads_its_noise_and_band_from_the_rounds():
    from autotune.measure import SelfCheck

    true = SelfCheck.of(1.01, [0.99, 1.01, 1.02])
    assert true.within_band and true.rounds == 3
    assert true.noise == pytest.approx(0.01)  # its distance from 1 exceeds half the rounds' IQR (0.0075)
    assert SelfCheck.of(1.0, [0.98, 0.99, 1.01, 1.02]).noise == pytest.approx(0.0125)  # the IQR's half exceeds it
    assert SelfCheck.of(1.0, [0.99, 1.0, 1.0, 1.0, 1.01, 1.6]).noise == pytest.approx(0.00375)  # one spoilt round
    shared = SelfCheck.of(0.69, [0.69, 2.07])  # FP32 against itself with another session spinning on the cores
    assert not shared.within_band
    assert shared.noise == pytest.approx(0.345)
    assert SelfCheck.of(1.05, []).noise == pytest.approx(0.05)  # one figure: its distance from 1
    assert SelfCheck.from_dict(true.to_dict()) == true
    assert "outside [0.97, 1.03]" in shared.describe() and "within" in true.describe()


def test_speedups_closer_than_the_noise_tie_with_the_fastest():
    from autotune.measure import ties_within

    assert ties_within([1.50, 1.49, 1.40, 1.51], 0.02) == [0, 1, 3]
    assert ties_within([1.50, 1.49, 1.40, 1.51], 0.0) == [3]
    assert ties_within([], 0.1) == []
