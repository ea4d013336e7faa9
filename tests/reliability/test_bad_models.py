"""Bad models: each is refused by `autotune tune` with exit code 2, a message naming the file and the fix, and no
run directory (so nothing a resume would trust). Unit-level checks of the same errors live in
tests/model/test_layers.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.testing import tiny_config, tiny_mlp, write_tiny_project
from tests.reliability.helpers import cli, write_config


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def missing(root: Path) -> Path:
    return root / "missing.onnx"


def directory(root: Path) -> Path:
    (root / "folder.onnx").mkdir()
    return root / "folder.onnx"


def empty(root: Path) -> Path:
    (root / "empty.onnx").write_bytes(b"")
    return root / "empty.onnx"


def truncated(root: Path) -> Path:
    data = tiny_mlp().SerializeToString()
    (root / "truncated.onnx").write_bytes(data[: len(data) // 2])
    return root / "truncated.onnx"


def not_onnx(root: Path) -> Path:
    (root / "weights.onnx").write_text("name: this is a YAML file, not a model\n")
    return root / "weights.onnx"


def no_tunable_layer(root: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _save(model, root / "relu_only.onnx")


def _with_relu1(op_type: str, domain: str = "") -> onnx.ModelProto:
    model = tiny_mlp()
    node = next(n for n in model.graph.node if n.name == "relu1")
    node.op_type, node.domain = op_type, domain
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def backend_lacks_operator(root: Path) -> Path:
    return _save(_with_relu1("FancyActivation", "com.example"), root / "custom_op.onnx")


def unknown_onnx_operator(root: Path) -> Path:
    return _save(_with_relu1("NoSuchOp"), root / "unknown_op.onnx")


def incompatible_shapes(root: Path) -> Path:
    model = tiny_mlp()
    index = next(i for i, init in enumerate(model.graph.initializer) if init.name == "w2")
    model.graph.initializer[index].CopyFrom(numpy_helper.from_array(np.ones((10, 64), np.float32), "w2"))
    return _save(model, root / "bad_shapes.onnx")


def _external(root: Path) -> Path:
    path = root / "external.onnx"
    onnx.save(tiny_mlp(), str(path), save_as_external_data=True, location="external.data", size_threshold=0)
    return path


def external_weights_missing(root: Path) -> Path:
    path = _external(root)
    (root / "external.data").unlink()
    return path


def external_weights_cut_short(root: Path) -> Path:
    path = _external(root)
    data = root / "external.data"
    data.write_bytes(data.read_bytes()[:100])
    return path


# (model file builder, config overrides, fragments the message must contain besides the file's path)
CASES: dict[str, tuple[Callable[[Path], Path], dict, list[str]]] = {
    "missing file": (missing, {}, ["does not exist", "fix model.onnx in the config"]),
    "a folder, not a file": (directory, {}, ["does not exist", "fix model.onnx in the config"]),
    "empty file": (empty, {}, ["not a readable ONNX model", "no graph", "re-export it"]),
    "truncated file": (truncated, {}, ["not a readable ONNX model", "re-export it"]),
    "not an ONNX file": (not_onnx, {}, ["not a readable ONNX model", "re-export it"]),
    "no tunable layer": (no_tunable_layer, {}, ["has no tunable layer", "nothing to tune"]),
    "operator the backend cannot run": (
        backend_lacks_operator,
        {},
        ["does not run on onnxruntime", "com.example:FancyActivation", "replace the operator"],
    ),
    "operator unknown to ONNX": (unknown_onnx_operator, {}, ["fails the ONNX checker", "NoSuchOp"]),
    "weights of the wrong shape": (
        incompatible_shapes,
        {},
        ["does not run on onnxruntime", "Incompatible dimensions", "fc2"],
    ),
    "dynamic input without a shape in the config": (
        lambda root: _save(tiny_mlp(), root / "dynamic.onnx"),
        {"inputs": []},
        ["input 'x' has dynamic dimensions [-1, 32]", "give its shape under inputs:"],
    ),
    "config shape against a fixed dimension": (
        lambda root: _save(tiny_mlp(), root / "fixed.onnx"),
        {"inputs": [{"name": "x", "shape": [16, 16]}]},
        ["fixes a dimension to 32", "the config asks for 16", "fix inputs[].shape"],
    ),
    "config input the model does not have": (
        lambda root: _save(tiny_mlp(), root / "named.onnx"),
        {"inputs": [{"name": "pixels", "shape": [16, 32]}]},
        ["names inputs ['pixels']", "model inputs: ['x']"],
    ),
    "external weights missing": (
        external_weights_missing,
        {},
        ["external weights are missing", "keep the .data file next to the model"],
    ),
    "external weights cut short": (external_weights_cut_short, {}, ["external weights are missing"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_is_refused_before_the_run_directory_exists(tmp_path, capsys, nothing_built, case):
    build, overrides, fragments = CASES[case]
    write_tiny_project(tmp_path)
    model_path = build(tmp_path)
    config = tiny_config(tmp_path, model={"onnx": str(model_path)}, **overrides)
    code, err = cli(capsys, "tune", write_config(tmp_path, config), "--no-progress")

    assert code == 2, err
    assert err.startswith("autotune: error: ") and "Traceback" not in err
    assert str(model_path) in err
    for fragment in fragments:
        assert fragment in err
    assert not config.run_dir.exists()
    code, err = cli(capsys, "resume", config.run_dir, "--no-progress")
    assert code == 2 and "not a run directory" in err


def test_inspect_and_evaluate_refuse_a_bad_model_the_same_way(tmp_path, capsys):
    write_tiny_project(tmp_path)
    config = tiny_config(tmp_path, model={"onnx": str(backend_lacks_operator(tmp_path))})
    path = write_config(tmp_path, config)
    for command in (["inspect", path], ["evaluate", path, "--plan", "int8"]):
        code, err = cli(capsys, *command)
        assert code == 2, err
        assert str(config.model.onnx) in err and "com.example:FancyActivation" in err
        assert "Traceback" not in err
