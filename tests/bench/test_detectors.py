"""bench/detectors.py: the input fixing, the YOLO-like export's SiLU pairs, and a written model directory's config."""

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.config.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import detectors  # noqa: E402


def _dynamic_detector() -> onnx.ModelProto:
    """Conv 3 -> 1 then Sigmoid, on an input whose batch, height and width are all dynamic, as PP-OCR's is."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((1, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["logits"], pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", ["logits"], ["map"]),
        ],
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("map", TensorProto.FLOAT, ["batch", 1, "height", "width"])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [dim.dim_param or dim.dim_value for dim in value_info.type.tensor_type.shape.dim]


def test_fix_input_shape_fixes_the_input_and_the_outputs_onnxruntime_computes():
    fixed = detectors.fix_input_shape(_dynamic_detector(), (2, 3, 8, 12))
    assert _dims(fixed.graph.input[0]) == [2, 3, 8, 12]
    assert _dims(fixed.graph.output[0]) == [2, 1, 8, 12]
    session = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [dim for dim in session.get_inputs()[0].shape] == [2, 3, 8, 12]
    with pytest.raises(ValueError, match="4 dimensions, not the 3"):
        detectors.fix_input_shape(_dynamic_detector(), (2, 3, 8))


def test_the_yolo_like_export_writes_every_silu_as_sigmoid_and_mul_with_batchnorm_folded(tmp_path):
    pytest.importorskip("torch", reason="the YOLO-like detector is built in PyTorch")
    path = tmp_path / "yolo.onnx"
    detectors.export_yolo(path, (1, 3, 64, 64), settle_views=2)
    model = onnx.load(str(path))
    nodes = model.graph.node
    sigmoids = [node for node in nodes if node.op_type == "Sigmoid"]
    consumers = {name: [node for node in nodes if name in node.input] for node in nodes for name in node.output}
    assert len(sigmoids) == 57 and sum(node.op_type == "Mul" for node in nodes) == 57
    for sigmoid in sigmoids:  # x * sigmoid(x): the Mul reads the Sigmoid's input and its output
        (mul,) = consumers[sigmoid.output[0]]
        assert mul.op_type == "Mul" and set(mul.input) == {sigmoid.input[0], sigmoid.output[0]}
    assert sum(node.op_type == "Conv" for node in nodes) == 63
    assert not any(node.op_type == "BatchNormalization" for node in nodes)
    assert _dims(model.graph.output[0]) == [1, 144, 64 + 16 + 4]  # anchors at strides 8, 16 and 32


def test_settle_batchnorm_sets_every_batchnorm_from_the_images():
    torch = pytest.importorskip("torch", reason="the YOLO-like detector is built in PyTorch")
    module = detectors.settle_batchnorm(
        detectors.build_yolo(), np.random.default_rng(0).random((2, 3, 64, 64), np.float32), 1
    )
    norms = [layer for layer in module.modules() if isinstance(layer, torch.nn.BatchNorm2d)]
    assert len(norms) == 57 and not module.training
    assert all(
        int(norm.num_batches_tracked) == 2 and not torch.allclose(norm.running_var, torch.ones(1)) for norm in norms
    )


def test_a_written_model_directory_runs_as_a_config(tmp_path):
    pytest.importorskip("torch", reason="the LSTM encoder is exported from PyTorch")
    detectors.write_lstm(tmp_path, frames=5, hidden=8, batch=2)
    config = load_config(tmp_path / "config.yaml")
    assert config.model.onnx == (tmp_path / "model.onnx").resolve()
    assert config.backend.intra_op_threads == 2 and config.confirm.references == ["ort-dynamic"]
    splits = [config.data.calibration, config.data.evaluation, config.data.holdout]
    assert [(split.start, split.stop) for split in splits] == [(0, 8), (8, 24), (24, 40)]
    assert np.load(tmp_path / "data.npz")["x"].shape == (40, 5, detectors.lstm_encoder.FEATURES)
