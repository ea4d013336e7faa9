"""Tests for autotune.config.auto: a model file and its samples drafted into a config, and one line for bad input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from autotune.config.auto import (
    DEFAULT_ACCURACY_BUDGET,
    DEFAULT_BATCH,
    commented_yaml,
    draft_config,
    parse_shapes,
)
from autotune.config.schema import ConfigError, parse_config
from autotune.data import load_dataset
from autotune.model.layers import InputSpec
from autotune.testing import tiny_mlp, tiny_sequence_model, write_sequence_samples


@pytest.fixture()
def sequence_model(tmp_path):
    path = tmp_path / "seq model.onnx"
    onnx.save(tiny_sequence_model(), str(path))
    return path, write_sequence_samples(tmp_path / "samples.npz", samples=40, seq=12)


def test_dynamic_dimensions_take_the_datas_and_the_file_splits_in_quarters_half_quarter(sequence_model):
    model, samples = sequence_model
    draft = draft_config(model, samples)
    config = parse_config(draft.data, "draft")
    assert [(i.name, i.shape, i.dtype) for i in config.inputs] == [
        ("x", [DEFAULT_BATCH, 12, 16], "float32"),
        ("mask", [DEFAULT_BATCH, 12], "int64"),
    ]
    # 40 samples are 5 batches of 8: one calibrates, three evaluate, one is held out
    spans = {split: (source.start, source.stop) for split, source in config.data}
    assert spans == {"calibration": (0, 8), "evaluation": (8, 32), "holdout": (32, 40)}
    assert config.name == "seq-model" and config.model.onnx == model.resolve()
    assert config.metric.name == "cosine" and config.metric.output is None  # the first output
    assert config.accuracy_budget == DEFAULT_ACCURACY_BUDGET and config.backend.name == "auto"
    assert draft_config(model, samples).data == draft.data  # deterministic
    specs = [InputSpec(i.name, tuple(i.shape), i.dtype) for i in config.inputs]
    counts = {split: len(load_dataset(source, specs, split).batches) for split, source in config.data}
    assert counts == {"calibration": 1, "evaluation": 3, "holdout": 1}
    assert "calibration 0:8, evaluation 8:32, holdout 32:40" in draft.summary


def test_a_short_file_gets_a_smaller_batch_and_a_shape_sets_every_inputs_batch(sequence_model, tmp_path):
    model, _ = sequence_model
    short = write_sequence_samples(tmp_path / "short.npz", samples=12, seq=5)
    assert [i["shape"] for i in draft_config(model, short).data["inputs"]] == [[4, 5, 16], [4, 5]]
    shaped = draft_config(model, short, parse_shapes(["x=2x5x16"]))
    assert [i["shape"] for i in shaped.data["inputs"]] == [[2, 5, 16], [2, 5]]
    assert shaped.data["data"]["holdout"] == {"npz": str(short.resolve()), "start": 10, "stop": 12}


def test_a_graph_with_a_fixed_batch_keeps_it(tmp_path):
    model = tiny_mlp()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 16
    onnx.save(model, str(tmp_path / "fixed.onnx"))
    np.savez(tmp_path / "s.npz", x=np.zeros((64, 32), np.float32), labels=np.zeros(64, np.int64))
    draft = draft_config(tmp_path / "fixed.onnx", tmp_path / "s.npz", metric="top1")
    assert draft.data["inputs"][0]["shape"] == [16, 32] and draft.data["metric"] == {"name": "top1"}


def _tokens(x_shape=(40, 12, 16), x_dtype=np.float32, mask_samples=40) -> dict[str, np.ndarray]:
    """Sequence data for ``sequence_model`` (inputs ``x`` and ``mask``), with one thing changed."""
    return {"x": np.zeros(x_shape, x_dtype), "mask": np.ones((mask_samples, 12), np.int64)}


@pytest.mark.parametrize(
    ("arrays", "shapes", "metric", "fragment"),
    [
        ({"x": np.zeros((40, 12, 16), np.float32)}, [], None, "but no ['mask']: save one array per model input"),
        (_tokens(x_shape=(40, 12, 15)), [], None, "resize the data to dimension 2 = 16"),
        (_tokens(x_dtype=np.float64), [], None, "is float64, the model takes float32: save it with .astype('float32')"),
        (_tokens(), ["x=8x12x17"], None, "does not fit the model's [?, ?, 16]"),
        (_tokens(), ["x=8x10x16"], None, "resize the data or change --shape"),
        (_tokens(), ["x=16x12x16"], None, "48 or more are needed for three splits of a batch of 16"),
        (_tokens(), [], "top1", "add a 'labels' array"),
        (_tokens(mask_samples=30), [], None, "different sample counts"),
    ],
    ids=["missing-input", "wrong-dim", "wrong-dtype", "shape-vs-graph", "shape-vs-data", "too-few", "no-labels",
         "counts"],
)  # fmt: skip
def test_data_that_does_not_fit_gets_one_line_naming_the_fix(
    sequence_model, tmp_path, arrays, shapes, metric, fragment
):
    model, _ = sequence_model
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConfigError) as error:
        draft_config(model, tmp_path / "bad.npz", parse_shapes(shapes), metric)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_model_onnx_runtime_cannot_load_and_a_file_that_is_no_model_get_one_line(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"])],
        "unknown_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "unknown.onnx"))
    np.savez(tmp_path / "s.npz", x=np.zeros((8, 4), np.float32))
    with pytest.raises(ConfigError, match="ONNX Runtime .* cannot load this model .*NoSuchOp.*re-export it"):
        draft_config(tmp_path / "unknown.onnx", tmp_path / "s.npz")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="is not a readable ONNX model"):
        draft_config(tmp_path / "junk.onnx", tmp_path / "s.npz")
    with pytest.raises(ConfigError, match="does not exist: check the path"):
        draft_config(tmp_path / "absent.onnx", tmp_path / "s.npz")


@pytest.mark.parametrize("item", ["x", "x=", "x=8by2", "x=0x4", "=8x4"])
def test_a_shape_is_name_equals_dims(item):
    with pytest.raises(ConfigError, match="write it as INPUT=DIMxDIM"):
        parse_shapes([item])
    assert parse_shapes(["input_ids=8x128"]) == {"input_ids": (8, 128)}


def test_the_commented_yaml_reads_back_as_the_same_config(sequence_model):
    model, samples = sequence_model
    draft = draft_config(model, samples)
    text = commented_yaml(draft.data, draft.notes, "first line\nsecond line")
    assert text.startswith("# first line\n# second line\n")
    assert "# Read from the graph; the dynamic dimensions of ['x', 'mask'] from the data" in text
    assert "\nname: seq-model\n" in text and "\naccuracy_budget: 0.01\n" in text
    assert yaml.safe_load(text) == draft.data
