"""The shipped CNN as a PyTorch module (for the torch backend) is the network of cnn.onnx, weights included."""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from autotune.examples import cnn
from autotune.model.layers import InputSpec, load_onnx, prepare_model
from autotune.model.torch_export import export_torch

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def module():
    return cnn.build_module()


@pytest.fixture(scope="module")
def session():
    return ort.InferenceSession(str(cnn.MODEL_PATH), providers=["CPUExecutionProvider"])


def _logits(module, images):
    with torch.no_grad():
        return module(torch.from_numpy(images)).numpy()


def test_module_logits_match_onnx_runtime(module, session):
    batch = cnn.batches("evaluation")[0]
    expected = session.run(None, {"image": batch["image"]})[0]
    got = _logits(module, batch["image"])
    assert got.shape == expected.shape == (32, 10)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_module_top1_matches_onnx_runtime_on_the_evaluation_split(module, session):
    batches = cnn.batches("evaluation", batch_size=256)
    labels = np.concatenate([b["labels"] for b in batches])
    mine = np.concatenate([_logits(module, b["image"]).argmax(1) for b in batches])
    theirs = np.concatenate([session.run(None, {"image": b["image"]})[0].argmax(1) for b in batches])
    assert (mine == labels).mean() == (theirs == labels).mean()
    assert (mine == theirs).mean() > 0.999  # a near-tie may flip between two FP32 kernels, not more


def test_export_names_the_layers_like_the_shipped_onnx(tmp_path):
    inputs = [InputSpec("image", (1, 1, 16, 16), "float32")]
    path = export_torch("autotune.examples.cnn:build_module", inputs, tmp_path / "m.onnx")
    exported = prepare_model(load_onnx(path), path, inputs)
    shipped = prepare_model(load_onnx(cnn.MODEL_PATH), cnn.MODEL_PATH, inputs)
    assert exported.layer_names == shipped.layer_names
    assert exported.layer_names[0] == "/stem/conv/Conv" and exported.layer_names[-1] == "/fc2/Gemm"


def _edited(tmp_path, edit):
    model = onnx.load(str(cnn.MODEL_PATH))
    edit(model.graph)
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    return path


def test_a_weight_of_the_wrong_shape_fails_naming_the_layer(tmp_path):
    def shrink_fc2(graph):
        index = next(i for i, init in enumerate(graph.initializer) if init.name == "fc2.weight")
        smaller = numpy_helper.from_array(numpy_helper.to_array(graph.initializer[index])[:5], "fc2.weight")
        graph.initializer[index].CopyFrom(smaller)

    with pytest.raises(cnn.OnnxWeightError, match=r"layer fc2.*\(5, 64\)"):
        cnn.build_module(_edited(tmp_path, shrink_fc2))


def test_a_missing_layer_fails_with_the_count(tmp_path):
    def drop_fc2(graph):
        index = next(i for i, node in enumerate(graph.node) if node.name == "/fc2/Gemm")
        del graph.node[index]

    with pytest.raises(cnn.OnnxWeightError, match="10 Conv/Gemm nodes"):
        cnn.build_module(_edited(tmp_path, drop_fc2))


def test_a_changed_stride_fails_naming_the_attribute(tmp_path):
    def stride_block1(graph):
        node = next(node for node in graph.node if node.name == "/block1/conv/Conv")
        next(a for a in node.attribute if a.name == "strides").ints[:] = [2, 2]

    with pytest.raises(cnn.OnnxWeightError, match="block1.*strides"):
        cnn.build_module(_edited(tmp_path, stride_block1))


def test_importing_the_example_loads_no_torch():
    code = "import sys, autotune.examples.cnn; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
