"""The trial process: it refuses to serve a run whose code differs from its own (an upgrade mid-run), and one
started with the run waits for the run's go-ahead before it reads the model."""

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


def test_a_trial_process_started_with_the_run_reads_the_model_only_once_the_run_lets_it_go(tmp_path):
    import time

    from autotune.api import analyze
    from autotune.harness import Evaluator

    config = tiny_config(tmp_path)
    model = tmp_path / "tiny.onnx"
    exported = model.rename(tmp_path / "later.onnx")  # the run is still exporting it
    assert Evaluator.one_trial_process(config.execution) and not Evaluator.one_trial_process(config.execution, False)
    child = ChildRunner(config)
    child.launch(gated=True)
    time.sleep(3)  # long enough for an ungated process to have failed on the missing model
    assert child.connection is not None and not child.connection.poll(0)  # it waits, having sent nothing
    exported.rename(model)
    child.await_ready()  # lets it go: it prepares the run now
    # It waited from the end of its own start (spawn, imports: 0.5 s of the 3 s on a loaded 2-core CI machine)
    # until the go-ahead; an ungated process would not wait at all.
    assert child.setup_stages_s["waiting_for_the_run"] >= 1.0 and child.setup_stages_s["model"] > 0
    _, space = analyze(config)
    status, result = child.request("trial", (space.uniform("int8").to_dict(), "evaluation", None), timeout_s=120)
    child.stop()
    assert status == "result" and result["status"] == "ok"


def test_a_trial_process_whose_backend_fails_before_the_go_ahead_stops_the_run_with_its_line(tmp_path):
    config = tiny_config(tmp_path)
    config = config.model_copy(update={"backend": config.backend.model_copy(update={"name": "torch"})})
    child = ChildRunner(config)  # the torch backend needs model.torch: it fails while loading
    child.launch(gated=True)
    child._process.join(120)  # it has answered, and ended
    child.release()  # the run's go-ahead to a process that has ended is no error of its own
    with pytest.raises(SetupError, match="model.torch"):
        child.await_ready()
