"""What a person watches: every episode's scalars in TensorBoard, the best so far against builds, the bar."""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from autotune.monitor import CUSTOM_SCALARS, PlainProgress, RunMonitor
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.search.reward import reward
from autotune.testing import tiny_config


def _trial(precision: str, speedup: float, drop: float) -> TrialResult:
    return TrialResult(
        Plan.make({"fc1": precision}),
        latency_ms=10 / speedup,
        speedup=speedup,
        accuracy=0.9 - drop,
        accuracy_drop=drop,
        build_s=0.25,
    )


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_episode_is_logged_and_the_best_is_drawn_against_builds(tmp_path):
    config = tiny_config(tmp_path)
    good, better, broken = (
        _trial("int8", 2.0, 0.0),
        _trial("fp16", 3.0, 0.001),
        TrialResult.failure(Plan.make({"fc1": "bf16"}), "BuildError"),
    )
    cached = dataclasses.replace(good, from_store=True)
    monitor = RunMonitor(
        config.reward, config.search_budget, tmp_path / "tb", config.budget.builds, builds_done=5, progress=False
    )
    values = [monitor.record(result) for result in (good, broken, cached, better)]
    monitor.close()
    assert values == [reward(r, config.reward, config.search_budget) for r in (good, broken, cached, better)]
    assert monitor.episodes == 4 and monitor.builds == 8  # five earlier builds, three new, one store hit
    assert monitor.best is better and monitor.best_reward == values[3]
    scalars = _scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["trial/reward"]] == [1, 2, 3, 4]
    assert [value for _, value in scalars["trial/failed"]] == [0, 1, 0, 0]
    assert [value for _, value in scalars["trial/cache_hit"]] == [0, 0, 1, 0]
    assert [step for step, _ in scalars["trial/speedup"]] == [1, 3, 4]  # a failure has no speedup
    assert [step for step, _ in scalars["trial/build_s"]] == [1, 2, 4]  # a store hit built nothing
    assert scalars["trial/latency_ratio"][-1][1] == pytest.approx(1 / 3)
    assert [(step, round(value, 6)) for step, value in scalars["best/speedup"]] == [(6, 2.0), (7, 2.0), (8, 3.0)]
    tags = {tag for group in CUSTOM_SCALARS.values() for _, (_, chart) in group.items() for tag in chart}
    assert {"trial/reward", "best/reward", "trial/speedup"} <= tags


def test_a_resumed_run_starts_from_the_best_in_the_store_and_its_bar_from_its_builds(tmp_path):
    config = tiny_config(tmp_path)
    monitor = RunMonitor(
        config.reward, config.search_budget, tmp_path / "tb", config.budget.builds, builds_done=2, progress=True
    )
    monitor.seed([TrialResult.failure(Plan.make({"fc1": "int8"}), "BuildError")])
    assert monitor.best is None  # a failure is never the best, whatever its reward
    best = _trial("int8", 4.0, 0.0)
    monitor.seed([_trial("fp16", 1.5, 0.0), best, TrialResult.failure(Plan.make({"fc1": "bf16"}), "x")])
    assert monitor.best is best and monitor._bar.n == 2 and monitor._bar.total == config.budget.builds
    monitor.record(_trial("fp16", 1.2, 0.0))  # worse: the best stays
    assert monitor.best is best and monitor._bar.n == 3
    assert "best reward" in monitor._bar.postfix and "4.00x" in monitor._bar.postfix
    monitor.text("plan", "**int8**")
    monitor.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_builds(progress: PlainProgress, clock: _Clock, builds: int, seconds_each: float) -> None:
    for _ in range(builds):
        clock.now += seconds_each
        progress.update(1)
    progress.close()


def test_plain_progress_writes_a_line_a_minute_when_a_tenth_of_the_builds_is_quicker():
    clock, stream = _Clock(), io.StringIO()
    progress = PlainProgress(40, stream=stream, clock=clock)
    progress.set_postfix_str("best reward +0.500 (1.65x, drop 0.002)")
    _run_builds(progress, clock, 40, seconds_each=5.0)  # a tenth (4 builds) in 20 s: a line a minute
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"autotune: builds {n}/40" for n in (12, 24, 36, 40)]
    assert lines[0] == "autotune: builds 12/40 (30 %) at 1:00; best reward +0.500 (1.65x, drop 0.002)"


def test_plain_progress_writes_a_line_a_tenth_when_a_tenth_takes_longer_than_a_minute():
    clock, stream = _Clock(), io.StringIO()
    progress = PlainProgress(20, initial=4, stream=stream, clock=clock)
    _run_builds(progress, clock, 16, seconds_each=90.0)
    counts = [int(line.split()[2].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert counts == [6, 8, 10, 12, 14, 16, 18, 20]  # resumed at 4 builds; the last line is the last tenth's
    progress.close()
    assert len(stream.getvalue().splitlines()) == 8  # nothing new to say


def test_a_terminal_gets_the_bar_and_a_pipe_the_plain_lines(monkeypatch):
    from tqdm import tqdm

    from autotune.monitor import progress_display

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = progress_display(10, 2)
    assert isinstance(bar, tqdm) and bar.n == 2
    bar.close()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert isinstance(progress_display(10, 2), PlainProgress)
