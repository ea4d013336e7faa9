"""The trial process refuses to serve a run whose autotune code differs from its own (an upgrade mid-run)."""

from __future__ import annotations

import pytest

from autotune.harness import SetupError
from autotune.harness.process import CODE_CHANGED, ChildRunner, fingerprint, prepare_runner, source_fingerprint
from autotune.testing import tiny_config


def test_the_fingerprint_follows_file_contents_and_names_not_the_folder(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder / "sub").mkdir(parents=True)
        (tmp_path / folder / "sub" / "m.py").write_text("x = 1\n")
        (tmp_path / folder / "notes.txt").write_text(folder)  # not Python: not part of it
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "b")
    (tmp_path / "b" / "sub" / "m.py").write_text("x = 2\n")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")
    (tmp_path / "b" / "sub" / "m.py").write_text("x = 1\n")
    (tmp_path / "b" / "sub" / "m.py").rename(tmp_path / "b" / "sub" / "n.py")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")


def test_a_runner_with_another_fingerprint_is_refused_before_preparing(tmp_path):
    config = tiny_config(tmp_path).model_dump(mode="json")
    config["model"]["onnx"] = str(tmp_path / "missing.onnx")  # preparing would fail otherwise: the check comes first
    assert prepare_runner(config, "0" * 64) == (None, ("setup_error", CODE_CHANGED))
    runner, reply = prepare_runner(tiny_config(tmp_path).model_dump(mode="json"), source_fingerprint())
    assert runner is not None and reply == ("ready", runner.setup_stages_s)


def test_a_trial_process_started_after_the_code_changed_stops_the_run_with_a_line_that_says_resume(tmp_path):
    runner = ChildRunner(tiny_config(tmp_path), setup_timeout_s=120)
    runner.source = "0" * 64  # the run started with code other than what a new process now imports
    with pytest.raises(SetupError, match=r"changed on disk .*`autotune resume RUN_DIR`"):
        runner.start()
    runner.stop()
