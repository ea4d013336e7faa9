"""Another CPU runtime's one-liners as references (``backend.options.reference_runtimes``), built and run there."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino")

from autotune.api import evaluate_side_by_side  # noqa: E402
from autotune.backends import get_backend  # noqa: E402
from autotune.backends.onnxruntime import OnnxRuntimeCPU  # noqa: E402
from autotune.backends.openvino import OpenVINOCPU  # noqa: E402
from autotune.backends.other_references import OtherArtifact, WithOtherReferences  # noqa: E402
from autotune.config.schema import BackendConfig  # noqa: E402
from autotune.model.layers import InputSpec, prepare_model  # noqa: E402
from autotune.testing import tiny_config, tiny_mlp  # noqa: E402


def _openvino_with_ort_references(tmp_path):
    config = BackendConfig(name="openvino", options={"reference_runtimes": ["onnxruntime"]})
    backend = get_backend(config)
    model = prepare_model(tiny_mlp(), tmp_path / "tiny.onnx", [InputSpec("x", (16, 32), "float32")])
    backend.prepare(model, model.layer_names)
    return backend, model


def test_the_other_runtimes_one_liners_are_offered_but_its_searching_ones(tmp_path):
    backend, _ = _openvino_with_ort_references(tmp_path)
    assert isinstance(backend, WithOtherReferences) and backend.name == "openvino"
    assert isinstance(backend.backend, OpenVINOCPU) and isinstance(backend.others[0], OnnxRuntimeCPU)
    own = OpenVINOCPU().references()
    assert backend.references() == own + OnnxRuntimeCPU().references()  # ov-default ..., then ort-static ...
    assert "nncf-accuracy-control" not in OnnxRuntimeCPU().references()
    ort_backend = get_backend(BackendConfig(name="onnxruntime", options={"reference_runtimes": ["openvino"]}))
    assert "ov-default" in ort_backend.references() and "nncf-accuracy-control" not in ort_backend.references()


def test_an_other_runtimes_one_liner_is_built_and_run_by_that_runtime(tmp_path):
    backend, model = _openvino_with_ort_references(tmp_path)
    feeds = {"x": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)}
    calibration = [feeds]
    artifact = backend.build_reference("ort-dynamic", calibration, tmp_path)
    assert isinstance(artifact, OtherArtifact) and artifact.backend is backend.others[0]
    fp32 = OnnxRuntimeCPU()
    fp32.prepare(model, model.layer_names)
    expected = fp32.run_engine(fp32.build_graph(model.proto, {}), feeds)[0]
    got = backend.run(artifact, feeds)[0]
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()  # dynamic INT8 of the same model
    assert backend.time_run(artifact, feeds) > 0
    files = backend.export(artifact, None, tmp_path / "out")
    assert files[0].name == "model.onnx"  # ONNX Runtime's export, not OpenVINO's IR
    own = backend.build_reference("ov-default", calibration, tmp_path)
    assert not isinstance(own, OtherArtifact) and backend.run(own, feeds)[0].shape == expected.shape


def test_evaluate_times_the_other_runtimes_one_liner_beside_the_runs_fp32(tmp_path):
    config = tiny_config(tmp_path, backend={"name": "openvino", "options": {"reference_runtimes": ["onnxruntime"]}})
    result = evaluate_side_by_side(config, ["ort-static"], "holdout", isolate=False)[0]
    assert result["status"] == "ok" and result["plan"]["knobs"] == {"reference": "ort-static"}
    assert result["speedup"] > 0 and result["accuracy_drop"] < 0.5
