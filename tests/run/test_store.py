"""Tests for autotune.run.store: the SQLite trial store, including a writer killed mid-run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune.plan import Plan
from autotune.run.store import StoreError, TrialStore
from autotune.run.trial import FAILED, TrialResult

REPO_ROOT = Path(__file__).resolve().parents[1]


def _result(i: int, **fields) -> TrialResult:
    plan = Plan.make({"fc1": "int8" if i & 1 else "fp32", "fc2": "fp32"}, {"seq": i})
    defaults = dict(latency_ms=1.0 + i, reference_latency_ms=2.0, speedup=2.0 / (1.0 + i), accuracy_drop=0.001 * i)
    defaults.update(fields)
    return TrialResult(plan=plan, **defaults)


@pytest.fixture
def store(tmp_path):
    with TrialStore(tmp_path / "trials.db") as opened:
        yield opened


def test_put_get_len_contains(store):
    assert len(store) == 0
    first = _result(1, fidelity={"cosine": 0.99}, protocol={"warmup": 1, "repeats": 3, "rounds": 1})
    assert first.plan_hash not in store
    assert store.get(first.plan_hash) is None
    store.put(first)
    assert len(store) == 1
    assert first.plan_hash in store
    got = store.get(first.plan_hash)
    assert got is not None
    assert got.from_store is True
    assert got.plan == first.plan
    assert got.latency_ms == first.latency_ms
    assert got.fidelity == {"cosine": 0.99}
    assert got.protocol == {"warmup": 1, "repeats": 3, "rounds": 1}
    assert got.created_at == first.created_at
    got.from_store = False
    assert got == first


def test_failed_trial_round_trips(store):
    failed = TrialResult.failure(_result(3).plan, "BuildError: boom", build_s=0.5)
    store.put(failed)
    got = store.get(failed.plan_hash)
    assert got.status == FAILED and not got.ok
    assert got.error == "BuildError: boom"
    assert got.build_s == 0.5


def test_trials_in_first_measured_order(store):
    results = [_result(i) for i in (5, 2, 9, 0, 7)]
    for result in results:
        store.put(result)
    assert [t.plan_hash for t in store.trials()] == [r.plan_hash for r in results]
    assert all(not t.from_store for t in store.trials())


def test_replace_keeps_position(store):
    results = [_result(i) for i in range(4)]
    for result in results:
        store.put(result)
    remeasured = _result(1, latency_ms=123.0)
    assert remeasured.plan_hash == results[1].plan_hash
    store.put(remeasured)
    assert len(store) == 4
    trials = list(store.trials())
    assert [t.plan_hash for t in trials] == [r.plan_hash for r in results]
    assert trials[1].latency_ms == 123.0
    assert store.get(results[1].plan_hash).latency_ms == 123.0
    store.put(_result(10))
    assert [t.plan_hash for t in store.trials()][-1] == _result(10).plan_hash


def test_confirmations(store):
    assert store.confirmations() == {}
    a, b = _result(1, split="holdout"), _result(2, split="holdout")
    store.put_confirmation(a)
    store.put_confirmation(b)
    store.put_confirmation(_result(1, split="holdout", latency_ms=50.0))
    confirmations = store.confirmations()
    assert set(confirmations) == {a.plan_hash, b.plan_hash}
    assert confirmations[a.plan_hash].latency_ms == 50.0
    assert confirmations[b.plan_hash].split == "holdout"
    assert len(store) == 0  # confirmations are not trials


def test_meta(store):
    assert store.get_meta("missing") is None
    assert store.get_meta("missing", 5) == 5
    store.set_meta("best", {"hash": "abc", "values": [1, 2.5, True, None]})
    store.set_meta("count", 3)
    store.set_meta("count", 4)
    assert store.get_meta("best") == {"hash": "abc", "values": [1, 2.5, True, None]}
    assert store.get_meta("count") == 4


def test_persists_across_reopen(tmp_path):
    path = tmp_path / "sub" / "dir" / "trials.db"
    results = [_result(i) for i in range(3)]
    with TrialStore(path) as store:
        for result in results:
            store.put(result)
        store.set_meta("k", "v")
        store.put_confirmation(results[0])
    with TrialStore(path) as store:
        assert len(store) == 3
        assert [t.plan_hash for t in store.trials()] == [r.plan_hash for r in results]
        assert store.get_meta("k") == "v"
        assert list(store.confirmations()) == [results[0].plan_hash]


def test_wal_mode(tmp_path):
    path = tmp_path / "trials.db"
    with TrialStore(path) as store:
        store.put(_result(0))
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    connection = sqlite3.connect(str(path))
    try:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    finally:
        connection.close()


def test_two_connections_see_commits(tmp_path):
    path = tmp_path / "trials.db"
    with TrialStore(path) as writer, TrialStore(path) as reader:
        writer.put(_result(1))
        assert _result(1).plan_hash in reader
        assert len(reader) == 1


def test_unopenable_path_raises_store_error_with_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path = blocker / "trials.db"
    with pytest.raises(StoreError) as info:
        TrialStore(path)
    assert str(path) in str(info.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_raises_store_error_with_path(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(StoreError) as info:
            TrialStore(folder / "trials.db")
        assert str(folder / "trials.db") in str(info.value)
    finally:
        folder.chmod(0o700)


def test_not_a_database_raises_store_error(tmp_path):
    path = tmp_path / "trials.db"
    path.write_bytes(b"this is certainly not sqlite" * 100)
    with pytest.raises(StoreError) as info:
        TrialStore(path)
    assert str(path) in str(info.value)


def test_put_on_read_only_connection_raises_store_error(tmp_path):
    path = tmp_path / "trials.db"
    with TrialStore(path) as store:
        store.put(_result(0))
        store._db.execute("PRAGMA query_only = ON")
        with pytest.raises(StoreError) as info:
            store.put(_result(1))
        assert str(path) in str(info.value)
        assert _result(1).plan_hash in str(info.value)
        store._db.execute("PRAGMA query_only = OFF")
        assert len(store) == 1  # the failed put was rolled back, the store still works
        store.put(_result(1))
        assert len(store) == 2


_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from autotune.plan import Plan
    from autotune.run.store import TrialStore
    from autotune.run.trial import TrialResult

    store = TrialStore({path!r})
    i = 0
    while True:
        plan = Plan.make({{"fc1": "int8", "fc2": "fp32"}}, {{"i": i}})
        store.put(TrialResult(plan=plan, latency_ms=float(i), fidelity={{"cosine": 1.0}}, error="x" * 2000))
        print(plan.hash, flush=True)
        i += 1
    """
)


def test_survives_killed_writer(tmp_path):
    path = tmp_path / "trials.db"
    script = _WRITER.format(root=str(REPO_ROOT), path=str(path))
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    reported: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while len(reported) < 40:
            line = process.stdout.readline()
            if not line:
                pytest.fail(f"writer exited early: {process.wait()} {process.stderr.read()}")
            reported.append(line.strip())
            assert time.monotonic() < deadline, "writer too slow"
        process.send_signal(signal.SIGKILL)  # mid-loop: it keeps writing until the signal lands
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL

    connection = sqlite3.connect(str(path))
    try:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        connection.close()
    with TrialStore(path) as store:
        for plan_hash in reported:
            assert plan_hash in store
            assert store.get(plan_hash).error == "x" * 2000
        assert len(store) >= len(reported)
        hashes = [t.plan_hash for t in store.trials()]
        assert hashes[: len(reported)] == reported
        assert [t.latency_ms for t in store.trials()] == [float(i) for i in range(len(hashes))]
        store.put(_result(0))  # the reopened store is writable
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_imported_trials_are_stored_but_are_no_build_of_this_run(tmp_path):
    with TrialStore(tmp_path / "trials.sqlite") as store:
        own = TrialResult(plan=Plan.make({"a": "int8"}), speedup=1.5, accuracy_drop=0.01)
        store.put(own)
        earlier = TrialResult(plan=Plan.make({"a": "fp32"}), speedup=1.0, accuracy_drop=0.0)
        assert store.put_imported(earlier, "runs/earlier")
        assert not store.put_imported(TrialResult(plan=own.plan, speedup=9.0), "runs/earlier")  # ours is kept
        assert len(store) == 2 and store.builds() == 1
        assert store.imported() == {earlier.plan_hash: "runs/earlier"}
        assert store.get(own.plan_hash).speedup == 1.5
        assert [r.plan_hash for r in store.trials()] == [own.plan_hash, earlier.plan_hash]
