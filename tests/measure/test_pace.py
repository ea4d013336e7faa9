"""autotune.measure.pace: the reference's pace, kept in the cache from one process to the next."""

from __future__ import annotations

import json

import pytest

from autotune.measure.pace import KEEP_PROCESSES, MAX_AGE_S, PACE_FILE, REFRESH_S, RememberedPace


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_later_process_reads_the_pace_an_earlier_one_kept_and_not_its_own(tmp_path):
    first = RememberedPace(tmp_path, "key")
    assert first.typical_ms() is None
    first.record(2.5)
    first.record(2.4)
    assert first.typical_ms() is None  # its own pace is in its ReferencePace already
    later = RememberedPace(tmp_path, "key")
    assert later.typical_ms() == pytest.approx(2.4)
    assert RememberedPace(tmp_path, "another key").typical_ms() is None
    (entry,) = json.loads((tmp_path / PACE_FILE).read_text())["paces"]["key"]
    assert entry["fastest_ms"] == 2.4  # one entry per process, rewritten as its pace changed


def test_a_process_keeps_its_pace_now_and_its_entry_fresh_while_it_times(tmp_path):
    clock = Clock()
    process = RememberedPace(tmp_path, "key", clock)
    process.record(2.0)
    clock.now += 60
    process.record(2.3)  # its last minute's fastest: the machine drifted, and the entry says so
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(2.3)

    def entry_at() -> float:
        return json.loads((tmp_path / PACE_FILE).read_text())["paces"]["key"][0]["at"]

    written = entry_at()
    clock.now += REFRESH_S / 2
    process.record(2.3)  # the same pace soon after: no write
    assert entry_at() == written
    for _ in range(int(MAX_AGE_S // REFRESH_S) + 2):  # the same pace for longer than an entry lives
        clock.now += REFRESH_S
        process.record(2.3)
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(2.3)


def test_only_the_last_processes_within_the_age_count_so_a_machine_slower_for_good_is_taken_at_its_new_pace(tmp_path):
    clock = Clock()
    for _ in range(KEEP_PROCESSES):  # a quieter time
        clock.now += 5
        RememberedPace(tmp_path, "key", clock).record(2.0)
    for _ in range(KEEP_PROCESSES // 2):
        clock.now += 5
        RememberedPace(tmp_path, "key", clock).record(2.4)
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(2.0)
    clock.now += 5
    RememberedPace(tmp_path, "key", clock).record(2.4)
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(2.4)  # most of the last 8 at 2.4
    clock.now += MAX_AGE_S + 1
    assert RememberedPace(tmp_path, "key", clock).typical_ms() is None


def test_a_pace_of_ten_minutes_ago_is_no_pace_now_since_an_idle_machine_drifts_over_minutes(tmp_path):
    clock = Clock()
    RememberedPace(tmp_path, "key", clock).record(118.0)
    clock.now += 60
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(118.0)
    clock.now += 9 * 60  # an idle VM ran FP32 at 133 ms by then: the old pace would call that a slow spell
    assert RememberedPace(tmp_path, "key", clock).typical_ms() is None


@pytest.mark.parametrize("text", ["{not json", '{"format": 0, "paces": {}}', '{"format": 1, "paces": []}', "[1]"])
def test_a_file_that_cannot_be_read_is_started_afresh(tmp_path, text):
    (tmp_path / PACE_FILE).write_text(text)
    pace = RememberedPace(tmp_path, "key")
    assert pace.typical_ms() is None
    pace.record(3.0)
    assert RememberedPace(tmp_path, "key").typical_ms() == pytest.approx(3.0)


def test_entries_of_another_shape_are_left_out(tmp_path):
    entries = [{"process": "a", "at": 1e12, "fastest_ms": -1.0}, {"process": "b", "at": 1e12}, "c", {"at": 1e12}]
    (tmp_path / PACE_FILE).write_text(json.dumps({"format": 1, "paces": {"key": entries}}))
    assert RememberedPace(tmp_path, "key", lambda: 1e12).typical_ms() is None


def test_a_cache_that_cannot_be_written_leaves_the_measurement_as_it_is(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder should be
    pace = RememberedPace(blocked, "key")
    pace.record(2.0)
    assert pace.typical_ms() is None and not list(tmp_path.glob(".pace-*"))


def test_the_typical_pace_is_the_median_process_so_one_lucky_or_slow_process_moves_it_not(tmp_path):
    clock = Clock()
    for fastest in (2.0, 1.6, 2.1, 2.05, 3.0):  # one process met the machine at its fastest, one lay in a spell
        clock.now += 10
        RememberedPace(tmp_path, "key", clock).record(fastest)
    assert RememberedPace(tmp_path, "key", clock).typical_ms() == pytest.approx(2.05)
