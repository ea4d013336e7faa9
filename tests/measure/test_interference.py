"""Tests for autotune.measure.interference: Linux's accounting of the other processes, read beside a real one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from autotune.measure.interference import Reading, Sampler, Snapshot, describe_cpus

linux_only = pytest.mark.skipif(not Sampler().available, reason="needs Linux's /proc/stat and schedstat")


def _spin_on(cpu: int, seconds: float) -> Reading:
    """What the sampler of one core reads while one thread of this process keeps that core busy.

    The thread takes both snapshots itself: a thread's wait is read while it is alive.
    """
    sampler = Sampler(cpus=[cpu])
    readings = []

    def spin() -> None:
        os.sched_setaffinity(0, {cpu})  # 0: the calling thread, not the process
        start = sampler.snapshot()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        readings.append(sampler.reading(start, sampler.snapshot()))

    thread = threading.Thread(target=spin)
    thread.start()
    thread.join()
    return readings[0]


@linux_only
def test_a_process_busy_on_our_core_is_read_as_others_and_as_our_wait():
    cpu = sorted(os.sched_getaffinity(0))[0]
    busy_loop = (
        f"import os, time; os.sched_setaffinity(0, {{{cpu}}}); end = time.time() + 3\nwhile time.time() < end: pass"
    )
    competitor = subprocess.Popen([sys.executable, "-c", busy_loop])
    try:
        time.sleep(0.2)  # the competitor is on the core
        reading = _spin_on(cpu, 1.0)
    finally:
        competitor.kill()
        competitor.wait()
    # One core, two busy threads: each runs about half the time and waits the other half.
    assert reading.others is not None and reading.others > 0.25
    assert reading.waited > 0.25


@linux_only
def test_our_own_work_is_not_counted_as_others():
    cpu = sorted(os.sched_getaffinity(0))[0]
    reading = _spin_on(cpu, 0.8)
    assert reading.others is not None and reading.others < 0.5  # ours alone would read about 1.0 if counted


def test_shares_from_counters():
    start = Snapshot(0.0, 10.0, 1.0, {"1": 500_000_000, "2": 7})
    end = Snapshot(2.0, 13.0, 2.0, {"1": 900_000_000, "3": 10**9})  # thread 2 ended, thread 3 started
    reading = Reading.between(start, end, cores=2)
    assert reading.others == pytest.approx((3.0 - 1.0) / 4.0)
    assert reading.waited == pytest.approx(0.2)  # thread 1's 0.4 s over 2 s
    assert Reading.between(start, Snapshot(0.1, 10.1, 1.0, {}), cores=2).others is None  # a span under the ticks


def test_cores_are_described_as_a_user_reads_them():
    assert describe_cpus([0, 1]) == "0-1"
    assert describe_cpus([0, 2, 4]) == "0,2,4"
    assert describe_cpus([3]) == "3"


def test_a_wait_with_no_other_work_on_the_cores_is_the_process_waking_its_own_threads():
    from autotune.measure.interference import TICK_SLACK, Reading

    # An idle VM: waking a halted virtual core counts as run-queue wait though nothing else ran.
    idle = Reading(wall_s=0.2, others=None, waited=0.4, others_s=0.0)
    assert not idle.waited_for_others(0.1, cores=2)
    # Another process held a core meanwhile: its core time covers the wait.
    shared = Reading(wall_s=0.2, others=None, waited=0.4, others_s=0.06)
    assert shared.waited_for_others(0.1, cores=2)
    # Core time within the kernel's tick sampling of our own is no other work.
    within_ticks = Reading(wall_s=0.2, others=None, waited=0.4, others_s=TICK_SLACK * 2 / 100 * 0.9)
    assert not within_ticks.waited_for_others(0.1, cores=2)
    # A long round of an idle VM: its host and kernel threads took 2 % of the cores, less than any busy process.
    assert not Reading(wall_s=7.5, others=None, waited=0.2, others_s=0.02 * 2 * 7.5).waited_for_others(0.1, cores=2)
    assert Reading(wall_s=7.5, others=None, waited=0.2, others_s=0.3 * 2 * 7.5).waited_for_others(0.1, cores=2)
    # A wait within the allowance is no contention, whatever else ran; no reading of the others: the wait decides.
    assert not Reading(wall_s=0.2, others=None, waited=0.05, others_s=0.3).waited_for_others(0.1, cores=2)
    assert Reading(wall_s=0.2, others=None, waited=0.4).waited_for_others(0.1, cores=2)


def test_the_others_core_time_of_a_short_span_is_read_though_its_share_is_not():
    start = Snapshot(wall_s=0.0, busy_s=10.0, own_s=1.0, waited_ns={})
    end = Snapshot(wall_s=0.2, busy_s=10.4, own_s=1.3, waited_ns={})
    reading = Reading.between(start, end, cores=2)
    assert reading.others is None  # too short for a share
    assert reading.others_s == pytest.approx(0.1) and reading.others_cpu_s() == pytest.approx(0.1)
