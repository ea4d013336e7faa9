"""Shared helpers of the reliability tests: the CLI in and out of process, run-directory checks, /proc sampling."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from autotune.api import analyze
from autotune.cli import main
from autotune.config.schema import TuneConfig, dump_config
from autotune.run.store import TrialStore
from autotune.search.episode import decisions, plan_from_actions
from autotune.testing import tiny_config

REPO = Path(__file__).resolve().parents[2]
# What the machine's other work does to a measurement is tests/measure/test_timing.py's; these runs' stderr is exact.
FAST_MEASURE = {
    "warmup": 1,
    "repeats": 1,
    "rounds": 1,
    "settle_s": 0,
    "quiet_band": None,
    "busy_wait": None,
    "busy_others": None,
}
FAST_CONFIRM = {"top_k": 2, "repeats": 1, "rounds": 1}
ONE_LINERS_BEFORE_SEARCH = 2
"""Counted trial calls before a tiny run's first build: its one-liners (``ort-static``, ``ort-dynamic``), scored
beside the self-check before the search (``autotune.measure.selfcheck.check_search_timing``)."""


def error_lines(stderr: str) -> list[str]:
    """The lines of a command's stderr that are not the ``autotune: note:`` lines a run says as it goes."""
    return [line for line in stderr.splitlines() if not line.startswith("autotune: note: ")]


def env(**extra: str) -> dict[str, str]:
    """The environment of an ``autotune`` subprocess: this checkout first on the path."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def write_config(root: Path, config: TuneConfig, name: str = "config.yaml") -> Path:
    """Writes a config as YAML, as a user would hand it to the CLI."""
    path = root / name
    path.write_text(dump_config(config))
    return path


def fast_config(root: Path, **overrides: Any) -> TuneConfig:
    """``tiny_config`` with the shortest measurement and confirmation protocols."""
    return tiny_config(root, **{"measure": FAST_MEASURE, "confirm": FAST_CONFIRM, **overrides})


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """Runs ``autotune ARGS`` in this process; returns the exit code and stderr."""
    capsys.readouterr()
    code = main([str(arg) for arg in args])
    return code, capsys.readouterr().err


def autotune(*args: str, cwd: Path, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """Runs ``python -m autotune ARGS`` in a subprocess to the end."""
    return subprocess.run(
        [sys.executable, "-m", "autotune", *[str(a) for a in args]],
        cwd=cwd,
        env=kwargs.pop("env", env()),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start(*args: str, cwd: Path, **kwargs: Any) -> subprocess.Popen:
    """Starts ``python -m autotune ARGS`` in its own session (so a signal to its group spares pytest)."""
    return subprocess.Popen(
        [sys.executable, "-m", "autotune", *[str(a) for a in args]],
        cwd=cwd,
        env=kwargs.pop("env", env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A shell's background job (`make test &`) ignores SIGINT, and an ignored signal is inherited: give the
        # run a terminal's default disposition, so the tests' Ctrl-C reaches it as it would in a terminal.
        preexec_fn=_default_sigint,
        **kwargs,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition: Any, process: subprocess.Popen | None = None, timeout: float = 120, what: str = "") -> None:
    """Polls ``condition()`` until it is true; fails if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the process ended (rc {process.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def trial_count(store_path: Path) -> int:
    """Committed trials, read without the package (0 while the store does not exist)."""
    if not store_path.exists():
        return 0
    connection = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True, timeout=30)
    try:
        return connection.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    except sqlite3.OperationalError:  # the schema is not written yet
        return 0
    finally:
        connection.close()


def snapshot(store_path: Path) -> dict[str, dict]:
    """Every committed trial by plan hash, as stored."""
    with TrialStore(store_path) as store:
        return {result.plan_hash: result.to_dict() for result in store.trials()}


def integrity(store_path: Path) -> list:
    """SQLite's own integrity check of the store file."""
    connection = sqlite3.connect(str(store_path))
    try:
        return connection.execute("PRAGMA integrity_check").fetchall()
    finally:
        connection.close()


def measure_counts(store: TrialStore) -> dict[str, int]:
    """How many times the store wrote each plan (its ``measured`` column): more than 1 means measured twice."""
    connection = sqlite3.connect(store.path)
    try:
        return dict(connection.execute("SELECT plan_hash, measured FROM trials").fetchall())
    finally:
        connection.close()


def assert_resumed_cleanly(store_path: Path, before: dict[str, dict], budget: int) -> None:
    """After a resume: the budget is spent, every trial committed before is unchanged, none measured twice."""
    after = snapshot(store_path)
    assert len(after) == budget
    for plan_hash, result in before.items():
        assert after[plan_hash] == result, f"committed trial {plan_hash} changed"
    with TrialStore(store_path) as store:
        counts = measure_counts(store)
    assert set(counts.values()) == {1}, {h: c for h, c in counts.items() if c != 1}
    assert integrity(store_path) == [("ok",)]


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def rss_kb(pid: int) -> int:
    """Resident memory of a process, in kB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fd_count(pid: int) -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def distinct_plans(config, count: int) -> list:
    """``count`` distinct valid plans of the tiny model."""
    _, space = analyze(config, profile=False)
    steps = decisions(space)
    plans, seen = [], set()
    action = 0
    while len(plans) < count:
        actions = [(action >> i) % len(step.options) for i, step in enumerate(steps)]
        plan = plan_from_actions(space, steps, actions)
        if plan.hash not in seen:
            seen.add(plan.hash)
            plans.append(plan)
        action += 1
    return plans
