"""Soak: a long random search on the tiny model, with the resident memory and open file descriptors of the run and
of its trial process sampled from /proc. After warm-up neither may grow beyond a fixed bound.

CI runs ``AUTOTUNE_SOAK_TRIALS`` trials (default 60, well under a minute); the full soak is
``AUTOTUNE_SOAK_TRIALS=300 .venv/bin/pytest tests/reliability/test_soak.py -q``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from autotune.store import TrialStore
from tests.reliability import faults
from tests.reliability.helpers import (
    children,
    env,
    fast_config,
    fd_count,
    measure_counts,
    rss_kb,
    start,
    trial_count,
    write_config,
)

SOAK_TRIALS = int(os.environ.get("AUTOTUNE_SOAK_TRIALS", "60"))
RSS_GROWTH_MB = 50
FD_GROWTH = 10

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="samples /proc")


@dataclass
class Soak:
    """Samples of one run: ``(trials, run RSS kB, run fds, trial pid, trial RSS kB, trial fds)``."""

    trials: int
    samples: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""

    def growth(self) -> dict[str, float]:
        """Growth from the first sample after warm-up (a fifth of the trials, at least 10) to the largest after."""
        warm = max(10, self.trials // 5)
        after = [s for s in self.samples if s[0] >= warm]
        assert len(after) >= 3, f"too few samples after warm-up: {self.samples}"
        base = after[0]
        return {
            "run_rss_mb": (max(s[1] for s in after) - base[1]) / 1024,
            "run_fds": max(s[2] for s in after) - base[2],
            "trial_rss_mb": (max(s[4] for s in after) - base[4]) / 1024,
            "trial_fds": max(s[5] for s in after) - base[5],
        }

    @property
    def trial_pids(self) -> set[int]:
        """Every trial process seen (one, unless it was restarted)."""
        return {s[3] for s in self.samples}


def _trial_process(run_pid: int) -> int | None:
    for pid in children(run_pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def soak(root: Path, trials: int, faults_folder: Path | None = None, interval_s: float = 0.02) -> Soak:
    """Runs ``autotune baseline --strategy random`` for ``trials`` builds and samples it until the search ends."""
    metric = {"name": "custom", "function": faults.METRIC} if faults_folder is not None else {"name": "top1"}
    config = fast_config(
        root,
        name="soak",
        metric=metric,
        budget={"builds": trials, "stall_episodes": 10_000},
        confirm={"top_k": 1, "repeats": 1, "rounds": 1},
    )
    extra = {faults.ENV: str(faults_folder)} if faults_folder is not None else {}
    store = config.run_dir / "trials.sqlite"
    process = start(
        "baseline",
        write_config(root, config),
        "--strategy",
        "random",
        "--no-progress",
        "--set",
        "name=soak",
        cwd=root,
        env=env(**extra),
    )
    result = Soak(trials)
    try:
        while process.poll() is None:
            done = trial_count(store)
            child = _trial_process(process.pid)
            seen = result.samples[-1][0] if result.samples else -1
            # One sample per new trial count, the last one (all trials in) while the run confirms: a busy machine
            # that lets the poll miss trials in between still samples the growth the whole search left.
            if child is not None and seen < done <= trials:
                try:
                    sample = (done, rss_kb(process.pid), fd_count(process.pid), child, rss_kb(child), fd_count(child))
                except (OSError, AssertionError):  # a process ended between the calls
                    continue
                result.samples.append(sample)
            time.sleep(interval_s)
        _, result.stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    result.returncode = process.returncode
    assert result.returncode == 0, result.stderr
    with TrialStore(store) as opened:
        assert len(opened) == trials and set(measure_counts(opened).values()) == {1}
    return result


def test_soak_memory_and_file_descriptors_stay_flat(tmp_path):
    result = soak(tmp_path, SOAK_TRIALS)
    assert len(result.trial_pids) == 1, "the trial process was restarted during a clean run"
    growth = result.growth()
    print(f"soak of {SOAK_TRIALS} trials, {len(result.samples)} samples; growth after warm-up: {growth}")
    assert growth["run_rss_mb"] < RSS_GROWTH_MB, growth
    assert growth["trial_rss_mb"] < RSS_GROWTH_MB, growth
    assert growth["run_fds"] < FD_GROWTH, growth
    assert growth["trial_fds"] < FD_GROWTH, growth


def test_the_soak_bounds_catch_a_leak(tmp_path):
    """A trial process that leaks a file and 3 MB per trial must break both bounds: the soak can fail."""
    folder = faults.write_plan(tmp_path / "faults", {"*": "leak"})
    result = soak(tmp_path, 40, faults_folder=folder)
    growth = result.growth()
    assert growth["trial_fds"] >= FD_GROWTH, growth
    assert growth["trial_rss_mb"] >= RSS_GROWTH_MB, growth
