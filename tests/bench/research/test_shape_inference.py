"""bench/research/shape_inference.py on a model with a weight it leaves out: both inferences timed, the same result."""

import sys
from pathlib import Path

import onnx

from autotune.testing import data_propagated_reshape_model

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "research"))

import shape_inference  # noqa: E402


def test_the_bench_times_both_and_finds_the_same_model(tmp_path, monkeypatch, capsys):
    path = tmp_path / "stubbed.onnx"
    onnx.save(data_propagated_reshape_model(), str(path))
    monkeypatch.setattr(sys, "argv", ["shape_inference.py", str(path), "--reps", "2"])
    shape_inference.main()
    out = capsys.readouterr().out
    assert "2 interleaved repetitions" in out and "same result: True" in out
    assert "\n  onnx " in out and "\n  autotune.model.shapes " in out
