"""Soak: a long random search on the tiny model, with the resident memory and open file descriptors of the run and
of its trial process sampled from /proc. After warm-up neither may grow beyond a fixed bound.

The trial process samples itself after every trial (``faults.samples``), so its growth is read over exactly the
trials of the search on a busy machine as on a quiet one; the run is sampled by a poll, once per new trial count.

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

from autotune.run.store import TrialStore
from tests.reliability import faults
from tests.reliability.helpers import (
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
    """Samples of one run: polled ``(trials, run RSS kB, run fds)``; the trial process's, one per trial,
    ``(trial, trial pid, trial RSS kB, trial fds)``."""

    trials: int
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    trial_samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""

    def growth(self) -> dict[str, float]:
        """Growth from the first sample after warm-up (a fifth of the trials, at least 10) to the largest after."""
        warm = max(10, self.trials // 5)
        after = [s for s in self.samples if s[0] >= warm]
        assert len(after) >= 3, f"too few samples after warm-up: {self.samples}"
        trial_after = [s for s in self.trial_samples if s[0] >= warm]
        assert [s[0] for s in trial_after] == list(range(warm, self.trials + 1)), "a trial's sample is missing"
        base, trial_base = after[0], trial_after[0]
        return {
            "run_rss_mb": (max(s[1] for s in after) - base[1]) / 1024,
            "run_fds": max(s[2] for s in after) - base[2],
            "trial_rss_mb": (max(s[2] for s in trial_after) - trial_base[2]) / 1024,
            "trial_fds": max(s[3] for s in trial_after) - trial_base[3],
        }

    @property
    def trial_pids(self) -> set[int]:
        """Every trial process that ran a trial (one, unless it was restarted)."""
        return {s[1] for s in self.trial_samples}


def soak(root: Path, trials: int, faults_folder: Path, interval_s: float = 0.02) -> Soak:
    """Runs ``autotune baseline --strategy random`` for ``trials`` builds and samples it until the search ends.

    Args:
        root: Where the run's config and folder go.
        trials: The builds of the search.
        faults_folder: A fault plan (``faults.write_plan``; ``{"*": "ok"}`` for none): its metric samples the trial
            process after every trial.
        interval_s: The run's poll.
    """
    config = fast_config(
        root,
        name="soak",
        metric={"name": "custom", "function": faults.METRIC},
        budget={"builds": trials, "stall_episodes": 10_000},
        confirm={"top_k": 1, "repeats": 1, "rounds": 1},
    )
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
        env=env(**{faults.ENV: str(faults_folder)}),
    )
    result = Soak(trials)
    try:
        while process.poll() is None:
            done = trial_count(store)
            seen = result.samples[-1][0] if result.samples else -1
            # One sample per new trial count, the last one (all trials in) while the run confirms: a busy machine
            # that lets the poll miss trials in between still samples the growth the whole search left.
            if seen < done <= trials:
                try:
                    result.samples.append((done, rss_kb(process.pid), fd_count(process.pid)))
                except (OSError, AssertionError):  # the run ended between the calls
                    continue
            time.sleep(interval_s)
        _, result.stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    result.returncode = process.returncode
    result.trial_samples = [s for s in faults.samples(faults_folder) if s[0] <= trials]  # not the confirmation's
    assert result.returncode == 0, result.stderr
    with TrialStore(store) as opened:
        assert len(opened) == trials and set(measure_counts(opened).values()) == {1}
    return result


def test_soak_memory_and_file_descriptors_stay_flat(tmp_path):
    result = soak(tmp_path, SOAK_TRIALS, faults.write_plan(tmp_path / "faults", {"*": "ok"}))
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
