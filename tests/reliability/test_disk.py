"""The disk: an unwritable run directory, a full disk mid-run, an unwritable cache, and exports that are never torn.

Root ignores permission bits, so "unwritable" is a path below a regular file and "full" is RLIMIT_FSIZE in a
subprocess (with SIGXFSZ ignored, writes past the limit fail with EFBIG as they would with ENOSPC).
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap

import onnx
import pytest

from autotune.plan import Plan
from autotune.run.store import StoreError, TrialStore
from autotune.run.trial import TrialResult
from autotune.testing import tiny_mlp
from autotune.tune import tune
from tests.reliability.helpers import (
    REPO,
    assert_resumed_cleanly,
    autotune,
    cli,
    error_lines,
    fast_config,
    integrity,
    snapshot,
    write_config,
)


def test_unwritable_run_directory_is_a_clear_error(tmp_path, capsys, nothing_built):
    (tmp_path / "not_a_folder").write_text("a file where the runs folder should be")
    config = fast_config(tmp_path, runs_dir=str(tmp_path / "not_a_folder" / "runs"))
    code, err = cli(capsys, "tune", write_config(tmp_path, config), "--no-progress")
    assert code == 2
    assert err == (
        f"autotune: error: cannot write the run directory {config.run_dir}: "
        f"[Errno 20] Not a directory: '{config.run_dir}'\n"
    )


def test_unwritable_cache_only_costs_time(tmp_path, capfd):
    """The calibration cache is an optimization: a run whose cache_dir cannot be written still finishes."""
    (tmp_path / "not_a_folder").write_text("")
    config = fast_config(tmp_path, cache_dir=str(tmp_path / "not_a_folder" / "cache"), budget={"builds": 2})
    summary = tune(config, strategy="random", progress=False)
    assert summary["builds"] == 2
    err = capfd.readouterr().err
    assert "cannot write the calibration cache" in err and "set cache_dir to a writable folder" in err


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_full_disk_stops_the_run_with_a_clear_error_and_resume_loses_nothing(tmp_path):
    budget = 60
    config = fast_config(tmp_path, budget={"builds": budget})
    path = write_config(tmp_path, config)
    store_path = config.run_dir / "trials.sqlite"
    full = autotune(
        "baseline", path, "--strategy", "random", "--no-progress", "--set", "name=tiny",
        cwd=tmp_path, preexec_fn=_limit_file_size(300_000),
    )  # fmt: skip
    assert full.returncode == 2, full.stderr
    assert error_lines(full.stderr)[0].startswith("autotune: error: cannot write ")
    assert str(store_path) in full.stderr and "free disk space or make the folder writable" in full.stderr
    assert "Traceback" not in full.stderr
    assert integrity(store_path) == [("ok",)]
    before = snapshot(store_path)
    assert 0 < len(before) < budget

    resumed = autotune("resume", config.run_dir, "--no-progress", cwd=tmp_path)  # space freed
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_cleanly(store_path, before, budget)


# ---- exports: temporary file, then rename ------------------------------------------------------------------


def test_every_exported_file_is_renamed_into_place(tmp_path, monkeypatch):
    config = fast_config(tmp_path, budget={"builds": 3})
    renamed: dict[str, str] = {}
    opened_for_writing: list[str] = []
    real_replace, real_open = os.replace, builtins.open

    def spy_replace(src, dst, *args, **kwargs):
        renamed[os.fspath(dst)] = os.fspath(src)
        return real_replace(src, dst, *args, **kwargs)

    def spy_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            opened_for_writing.append(os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(builtins, "open", spy_open)
    tune(config, strategy="random", isolate=False, progress=False)
    monkeypatch.undo()

    run = config.run_dir
    for final in (
        run / "best" / "plan.json",
        run / "best" / "summary.json",
        run / "best" / "model.onnx",
        run / "summary.json",
    ):
        assert final.is_file()
        source = renamed.get(str(final))
        assert source is not None, f"{final} was not renamed into place"
        assert os.path.dirname(source) == str(final.parent) and source != str(final)
        assert str(final) not in opened_for_writing, f"{final} was written in place"
        assert not os.path.exists(source)  # no temporary file left behind


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import onnx
    from autotune.backends.onnxruntime import OnnxRuntimeCPU
    from autotune.backends import GraphArtifact
    from autotune.run.files import write_json
    from autotune.testing import tiny_mlp

    def pause(*args, **kwargs):
        print("paused", flush=True)
        time.sleep(3600)

    best = Path(sys.argv[1])
    if sys.argv[2] == "json":
        os.fsync = pause  # atomic_write has written every byte and is about to make them durable
        write_json(best / "summary.json", {"rank": 2, "padding": "x" * 1_000_000})
    else:
        def save_half(model, path, *args, **kwargs):
            data = model.SerializeToString()
            with open(path, "wb") as handle:
                handle.write(data[: len(data) // 2])
            pause()
        onnx.save = save_half  # the export is killed half-way through writing the model
        OnnxRuntimeCPU().export(GraphArtifact(tiny_mlp(batch=4), None), None, best)
    """
)


@pytest.mark.parametrize("kind", ["json", "model"])
def test_sigkill_in_the_middle_of_an_export_leaves_the_previous_file_whole(tmp_path, kind):
    best = tmp_path / "best"
    best.mkdir()
    target = best / ("summary.json" if kind == "json" else "model.onnx")
    if kind == "json":
        target.write_text(json.dumps({"rank": 1}))
    else:
        onnx.save(tiny_mlp(), str(target))
    old = target.read_bytes()
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(best), kind],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line == "paused\n", process.communicate()[1]
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()
    assert target.read_bytes() == old
    if kind == "json":
        assert json.loads(target.read_text()) == {"rank": 1}
    else:
        onnx.checker.check_model(onnx.load(str(target)))


def test_every_store_write_reports_a_store_error(tmp_path):
    """A failed write (here: a read-only connection) is a StoreError naming the file, for trials, confirmations
    and run metadata alike, and rolls back cleanly."""
    result = TrialResult(plan=Plan.make({"fc1": "int8"}), latency_ms=1.0)
    with TrialStore(tmp_path / "trials.sqlite") as store:
        store.put(result)
        store._db.execute("PRAGMA query_only = ON")
        for write in (
            lambda: store.put(result),
            lambda: store.put_confirmation(result),
            lambda: store.set_meta("cache_hits", 3),
        ):
            with pytest.raises(StoreError) as info:
                write()
            assert str(tmp_path / "trials.sqlite") in str(info.value)
            assert "free disk space or make the folder writable" in str(info.value)
        store._db.execute("PRAGMA query_only = OFF")
        assert len(store) == 1 and store.confirmations() == {} and store.get_meta("cache_hits") is None


def test_full_disk_in_the_tensorboard_writer_is_a_clear_error_and_resumable(tmp_path, capsys, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    budget = 8
    config = fast_config(tmp_path, budget={"builds": budget})
    path = write_config(tmp_path, config)
    real_add_scalar = SummaryWriter.add_scalar
    written = []

    def add_scalar(self, tag, *args, **kwargs):
        written.append(tag)
        if len(written) > 20:
            raise OSError(28, "No space left on device", str(config.run_dir / "tb" / "events.out.tfevents"))
        return real_add_scalar(self, tag, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    code, err = cli(capsys, "baseline", path, "--strategy", "random", "--no-progress", "--set", "name=tiny")
    assert code == 2
    assert error_lines(err) == [
        f"autotune: error: [Errno 28] No space left on device: '{config.run_dir / 'tb'}/events.out.tfevents'"
    ]
    store_path = config.run_dir / "trials.sqlite"
    assert integrity(store_path) == [("ok",)]
    before = snapshot(store_path)
    assert 0 < len(before) < budget

    monkeypatch.undo()
    code, err = cli(capsys, "resume", config.run_dir, "--no-progress")
    assert code == 0, err
    assert_resumed_cleanly(store_path, before, budget)
