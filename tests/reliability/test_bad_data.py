"""Bad data: refused by `autotune tune` before anything is built and before the run directory exists, with the
expected and actual shapes (or values) in the message. Loader-level checks live in tests/test_data.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from autotune.harness import SetupError, TrialRunner
from autotune.testing import tiny_config, write_tiny_project
from tests.reliability.helpers import cli, write_config


def no_batches():
    """A generator source with nothing in it (referenced as tests.reliability.test_bad_data:no_batches)."""
    return iter(())


def _arrays(root: Path, split: str = "evaluation") -> dict[str, np.ndarray]:
    with np.load(root / f"{split}.npz", allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


def _npz(root: Path, name: str, **arrays: np.ndarray) -> Path:
    path = root / f"{name}.npz"
    np.savez(path, **arrays)
    return path


def _changed(split: str, change: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]):
    """A case that replaces one split's .npz with a changed copy of the tiny project's file."""

    def build(root: Path) -> dict:
        arrays = change(_arrays(root, split))
        return {split: {"npz": str(_npz(root, f"bad_{split}", **arrays))}}

    return build


def _with_value(value: float, row: int = 20):
    def change(arrays):
        x = arrays["x"].copy()
        x[row, 3] = value
        return {**arrays, "x": x}

    return change


def _labels(transform: Callable[[np.ndarray], np.ndarray]):
    return lambda arrays: {**arrays, "labels": transform(arrays["labels"].copy())}


def _set(labels: np.ndarray, index: int, value: int) -> np.ndarray:
    labels[index] = value
    return labels


CASES: dict[str, tuple[Callable[[Path], dict], list[str]]] = {
    "wrong shape": (
        _changed("evaluation", lambda a: {**a, "x": a["x"][:, :16]}),
        ["evaluation batch 0, input 'x': expected shape [16, 32], got [16, 16]"],
    ),
    "wrong dtype": (
        _changed("calibration", lambda a: {**a, "x": a["x"].astype(np.float64)}),
        ["calibration batch 0, input 'x': expected dtype float32, got float64"],
    ),
    "empty file": (
        _changed("evaluation", lambda a: {"x": a["x"][:0], "labels": a["labels"][:0]}),
        ["has 0 samples, fewer than one batch of 16"],
    ),
    "empty generator": (
        lambda root: {"evaluation": {"generator": "tests.reliability.test_bad_data:no_batches"}},
        ["evaluation data is empty: give at least one full batch"],
    ),
    "NaN in calibration data": (
        _changed("calibration", _with_value(np.nan)),
        ["calibration batch 1, input 'x' contains NaN or Inf"],
    ),
    "Inf in held-out data": (
        _changed("holdout", _with_value(np.inf, row=100)),
        ["holdout batch 6, input 'x' contains NaN or Inf"],
    ),
    "fewer samples than a batch": (
        _changed("calibration", lambda a: {"x": a["x"][:10], "labels": a["labels"][:10]}),
        ["has 10 samples, fewer than one batch of 16"],
    ),
    "arrays not named after the inputs": (
        _changed("evaluation", lambda a: {"pixels": a["x"], "labels": a["labels"]}),
        ["has arrays ['labels', 'pixels'] but the model needs inputs ['x']"],
    ),
    "labels and samples of different counts": (
        _changed("evaluation", lambda a: {**a, "labels": a["labels"][:-3]}),
        ["arrays have different sample counts", "'labels': 125", "'x': 128"],
    ),
    "pickled arrays": (
        _changed("evaluation", lambda a: {**a, "labels": np.array([{"a": 1}] * len(a["x"]), dtype=object)}),
        ["not a readable .npz without pickles"],
    ),
    "top1 label out of range": (
        _changed("evaluation", _labels(lambda labels: _set(labels, 40, 99))),
        ["evaluation batch 2: top1 labels must be in [0, 10) for the model's 10 outputs", "to 99"],
    ),
    "top1 negative label in held-out data": (
        _changed("holdout", _labels(lambda labels: _set(labels, 0, -1))),
        ["holdout batch 0: top1 labels must be in [0, 10)", "got labels from -1 to"],
    ),
    "top1 without labels": (
        _changed("evaluation", lambda a: {"x": a["x"]}),
        ["metric top1 needs labels", "to the evaluation data"],
    ),
    "top1 without labels in held-out data": (
        _changed("holdout", lambda a: {"x": a["x"]}),
        ["metric top1 needs labels", "to the holdout data"],
    ),
    "top1 with float labels": (
        _changed("evaluation", _labels(lambda labels: labels.astype(np.float32))),
        ["top1 labels must be integer class indexes, expected dtype int64, got float32"],
    ),
    "top1 with two labels per sample": (
        _changed("evaluation", _labels(lambda labels: np.stack([labels, labels], axis=1))),
        ["top1 needs one label per sample, expected shape [16], got [16, 2]"],
    ),
    "missing data file": (
        lambda root: {"holdout": {"npz": str(root / "nowhere.npz")}},
        ["holdout data file", "nowhere.npz does not exist: fix data.holdout.npz in the config"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_refused_before_the_first_build(tmp_path, capsys, nothing_built, case):
    build, fragments = CASES[case]
    write_tiny_project(tmp_path)
    data = {split: {"npz": str(tmp_path / f"{split}.npz")} for split in ("calibration", "evaluation", "holdout")}
    data.update(build(tmp_path))
    config = tiny_config(tmp_path, data=data)
    code, err = cli(capsys, "tune", write_config(tmp_path, config), "--no-progress")

    assert code == 2, err
    assert err.startswith("autotune: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    assert not config.run_dir.exists()


def test_metric_output_that_the_model_lacks_is_refused_before_the_first_build(tmp_path, capsys, nothing_built):
    config = tiny_config(tmp_path, metric={"name": "top1", "output": "probabilities"})
    code, err = cli(capsys, "tune", write_config(tmp_path, config), "--no-progress")
    assert code == 2
    assert "metric.output 'probabilities' is not a model output; outputs: ['logits']" in err
    assert not config.run_dir.exists()


def test_labels_that_do_not_fit_the_metric_are_a_setup_error_in_the_trial_process_too(tmp_path):
    """`autotune evaluate` skips the up-front check: the trial process must refuse with the same clear message."""
    write_tiny_project(tmp_path)
    arrays = _arrays(tmp_path)
    arrays["labels"][5] = 10
    config = tiny_config(
        tmp_path,
        data={
            "calibration": {"npz": str(tmp_path / "calibration.npz")},
            "evaluation": {"npz": str(_npz(tmp_path, "bad", **arrays))},
        },
    )
    with pytest.raises(SetupError, match=r"metric top1 cannot score the evaluation data: .*\[0, 10\)"):
        TrialRunner(config)


def test_cosine_needs_no_labels(tmp_path, capsys):
    """The label checks apply to top1 only: unlabelled data is fine for a fidelity metric."""
    write_tiny_project(tmp_path)
    unlabelled = {
        split: {"npz": str(_npz(tmp_path, f"x_{split}", x=_arrays(tmp_path, split)["x"]))}
        for split in ("calibration", "evaluation")
    }
    config = tiny_config(
        tmp_path,
        data=unlabelled,
        metric={"name": "cosine"},
        budget={"builds": 1},
        measure={"warmup": 1, "repeats": 1, "rounds": 1, "settle_s": 0, "busy_patience_s": 0, "busy_others": None},
        confirm={"top_k": 1, "repeats": 1, "rounds": 1},
    )
    code, err = cli(
        capsys, "baseline", write_config(tmp_path, config), "--strategy", "int8", "--no-progress", "--set", "name=tiny"
    )
    assert code == 0, err
