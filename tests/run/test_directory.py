"""The run directory: its paths, creating one with the resolved config, opening it again from anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config.schema import ConfigError, TuneConfig, dump_config
from autotune.run.directory import RunDir
from autotune.run.store import TrialStore
from autotune.testing import tiny_config, write_tiny_project


def _create(config: TuneConfig) -> RunDir:
    """The run directory ``tune`` creates for ``config``."""
    return RunDir.create(config.run_dir, dump_config(config.with_absolute_paths()))


def test_a_run_directory_names_every_file_a_run_keeps():
    run = RunDir(Path("runs/x"))
    assert (run.config, run.store, run.summary) == tuple(
        Path("runs/x") / name for name in ("config.yaml", "trials.sqlite", "summary.json")
    )
    assert (run.tensorboard, run.checkpoints, run.best) == tuple(
        Path("runs/x") / d for d in ("tb", "checkpoints", "best")
    )


def test_a_created_run_reopens_from_another_directory_with_its_folders_pinned(tmp_path, monkeypatch):
    write_tiny_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path, name="pinned", runs_dir="runs", cache_dir="cache")
    assert not config.runs_dir.is_absolute()
    run = _create(config)
    assert run.root == Path("runs/pinned") and run.config.is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    opened, loaded = RunDir.open(tmp_path / "runs" / "pinned")
    assert opened.root == tmp_path / "runs" / "pinned"
    assert loaded.runs_dir == tmp_path / "runs" and loaded.cache_dir == tmp_path / "cache"
    assert loaded.model_copy(update={"runs_dir": Path("runs"), "cache_dir": Path("cache")}) == config


def test_a_run_with_trials_is_not_created_again(tmp_path):
    config = tiny_config(tmp_path)
    run = _create(config)
    _create(config)  # no trials yet: an interrupted start may start again
    TrialStore(run.store).close()
    with pytest.raises(ConfigError, match=r"already holds a run: continue it with `autotune resume .*tiny`"):
        _create(config)


def test_a_directory_that_cannot_be_written_or_holds_no_run_is_one_clear_error(tmp_path):
    config = tiny_config(tmp_path)
    config.runs_dir.mkdir(parents=True)
    config.run_dir.write_text("a file where the run directory goes")
    with pytest.raises(ConfigError, match="cannot write the run directory"):
        _create(config)
    with pytest.raises(ConfigError, match=r"is not a run directory \(no config.yaml\)"):
        RunDir.open(tmp_path)
