"""The Python API's own functions: plan specs, data checks, the layer table and float ops, on the tiny MLP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.api import _scores_per_sample, analyze, check_data, float_ops, layer_table, references, resolve_plan
from autotune.harness import SetupError
from autotune.model.layers import prepare_model
from autotune.plan import Plan
from autotune.testing import tiny_config, tiny_mlp


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    config = tiny_config(root)
    model, space = analyze(config, profile=False)
    return config, model, space


def test_a_precision_spec_is_the_uniform_plan_and_a_one_liner_its_reference_plan(analyzed):
    config, _, space = analyzed
    assert resolve_plan("int8", space) == space.uniform("int8")
    assert set(resolve_plan("fp16", space).precision_map.values()) <= {"fp16", "fp32"}
    one_liners = references(config)
    assert "ort-static" in one_liners
    plan = resolve_plan("ort-static", space, one_liners)
    assert plan.reference == "ort-static" and set(plan.precision_map.values()) == {"fp32"}


def test_a_plan_file_is_completed_to_the_space_and_checked_against_it(analyzed, tmp_path):
    _, _, space = analyzed
    path = tmp_path / "plan.json"
    path.write_text(Plan.make({"fc2": "int8"}).to_json())
    plan = resolve_plan(str(path), space)
    assert plan.precision_map == {name: "int8" if name == "fc2" else "fp32" for name in space.layer_names}
    assert plan.knob_map == {knob.name: knob.default for knob in space.knobs}  # unset knobs at their defaults
    path.write_text(Plan.make({"fc2": "int8"}, {"no_such_knob": 1}).to_json())
    with pytest.raises(SetupError, match=r"sets knobs \['no_such_knob'\] that this run's search space lacks"):
        resolve_plan(str(path), space)


def test_an_exported_one_liner_file_reads_back_as_that_one_liner_only_on_its_backend(analyzed, tmp_path):
    config, _, space = analyzed
    path = tmp_path / "plan.json"
    path.write_text(Plan.reference_plan(["whatever"], "ort-dynamic").to_json())
    plan = resolve_plan(str(path), space, references(config))
    assert plan == Plan.reference_plan(space.layer_names, "ort-dynamic")
    path.write_text(Plan.reference_plan(["whatever"], "trt-best").to_json())
    with pytest.raises(SetupError, match="'trt-best' is not a one-liner of this backend"):
        resolve_plan(str(path), space, references(config))


def test_a_spec_that_is_neither_gets_one_line_naming_what_is_offered(analyzed, tmp_path):
    _, _, space = analyzed
    with pytest.raises(SetupError, match=r"--plan 'int4' is neither one of fp32/.*/ort-static/ort-dynamic"):
        resolve_plan("int4", space, ("ort-static", "ort-dynamic"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SetupError, match="broken.json is not a plan"):
        resolve_plan(str(broken), space)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"layers": {}}))
    with pytest.raises(SetupError, match="wrong.json is not a plan: a plan is a JSON object"):
        resolve_plan(str(wrong), space)


def test_the_layer_table_has_one_row_per_layer_with_its_nodes_and_choices(analyzed):
    _, model, space = analyzed
    rows = layer_table(model, space)
    assert [row["name"] for row in rows] == space.layer_names
    by_name = {row["name"]: row for row in rows}
    assert by_name["fc2"]["op_type"] == "MatMul" and by_name["fc2"]["weight"] == "w2"
    assert by_name["fc2"]["weight_source"] == "initializer"
    assert by_name["fc2"]["macs"] == 16 * 64 * 64 and by_name["fc2"]["params"] == 64 * 64
    assert by_name["head"]["unit"] == "Gemm" and by_name["head"]["nodes"] == ["head"]
    for row, choices in zip(rows, space.choices, strict=True):
        assert row["choices"] == list(choices) and row["choices"][0] == "fp32"
        assert len(row["unit"].split("+")) == len(row["nodes"])
    json.dumps(rows)  # JSON-ready


def test_float_ops_name_each_op_with_its_type_and_reason():
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
            helper.make_node("Transpose", ["h"], ["ht"], name="flip"),
            helper.make_node("MatMul", ["h", "ht"], ["y"], name="scores"),
        ],
        "attention_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [numpy_helper.from_array(np.ones((8, 8), np.float32), "w")],
    )
    model = prepare_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), Path("a.onnx"), None)
    (row,) = float_ops(model)
    assert row["name"] == "scores" and row["op_type"] == "MatMul" and "both inputs are activations" in row["reason"]
    assert [layer.name for layer in model.layers] == ["proj"]


def test_scores_per_sample_is_the_output_size_without_the_batch_or_none_when_unknown():
    assert _scores_per_sample(tiny_mlp(), "logits") == 10
    assert _scores_per_sample(tiny_mlp(), "missing") is None
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
    )
    assert _scores_per_sample(helper.make_model(graph), "y") == 12
    graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "n"]))
    assert _scores_per_sample(helper.make_model(graph), "y") is None
    graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [5]))
    assert _scores_per_sample(helper.make_model(graph), "y") is None  # no dim besides the batch


def test_check_data_passes_good_data_and_names_a_wrong_output_or_label(analyzed, tmp_path):
    config, model, _ = analyzed
    check_data(config, model)
    wrong_output = config.model_copy(update={"metric": config.metric.model_copy(update={"output": "h2"})})
    with pytest.raises(SetupError, match=r"metric.output 'h2' is not a model output; outputs: \['logits'\]"):
        check_data(wrong_output, model)
    data = np.load(config.data.holdout.npz)
    labels = data["labels"].copy()
    labels[0] = 10  # the classifier has 10 classes: 0..9
    np.savez(tmp_path / "holdout.npz", x=data["x"], labels=labels)
    holdout = config.data.holdout.model_copy(update={"npz": tmp_path / "holdout.npz"})
    bad = config.model_copy(update={"data": config.data.model_copy(update={"holdout": holdout})})
    with pytest.raises(SetupError, match="holdout"):
        check_data(bad, model)


def test_analyze_turns_a_missing_model_into_a_setup_error(tmp_path):
    config = tiny_config(tmp_path)
    Path(config.model.onnx).unlink()
    with pytest.raises(SetupError, match="tiny.onnx"):
        analyze(config, profile=False)


def test_a_plan_file_of_another_model_is_refused_not_run_as_fp32(analyzed, tmp_path):
    _, _, space = analyzed
    path = tmp_path / "other.json"
    path.write_text(Plan.make({"conv1": "int8", "fc2": "int8"}).to_json())
    with pytest.raises(SetupError, match=r"other.json: unknown layers \['conv1'\]"):
        resolve_plan(str(path), space)


def test_analyze_lets_the_trial_process_read_the_model_once_it_is_loaded_before_the_rest_fails(tmp_path):
    config = tiny_config(tmp_path)
    calls: list[bool] = []
    search = config.search.model_copy(update={"knobs": {"no_such_knob": [1]}})
    with pytest.raises(SetupError, match="no_such_knob"):  # the search space comes after the model is ready
        analyze(config.model_copy(update={"search": search}), model_ready=lambda: calls.append(True))
    assert calls == [True]
    (tmp_path / "tiny.onnx").write_bytes(b"not onnx")
    with pytest.raises(SetupError):
        analyze(config, model_ready=lambda: calls.append(True))
    assert calls == [True]  # a model that does not load is never handed on


def test_analyze_hands_the_model_on_at_its_file_unless_the_backend_profiles_it(tmp_path, monkeypatch):
    from autotune.harness import prepare
    from autotune.testing import tiny_torch_config

    events: list[str] = []
    real_prepare = prepare.prepare_model

    def recording_prepare(*args, **kwargs):
        events.append("layer table")
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(prepare, "prepare_model", recording_prepare)
    for config in (tiny_config(tmp_path / "ort"), tiny_torch_config(tmp_path / "torch")):
        events.clear()

        def ready(config=config):
            assert prepare.model_file(config.model, config.inputs, config.backend.name, config.cache_dir).exists()
            events.append("ready")

        analyze(config, model_ready=ready)
        # The torch backend times no layers: its trial process builds the layer table beside the run's.
        expected = ["layer table", "ready"] if config.backend.name == "onnxruntime" else ["ready", "layer table"]
        assert events == expected, config.backend.name


def test_analyze_reads_the_evaluation_data_only_for_a_backend_that_profiles(tmp_path):
    from autotune.testing import tiny_torch_config

    for config in (tiny_config(tmp_path / "ort"), tiny_torch_config(tmp_path / "torch")):
        evaluation = Path(config.data.evaluation.npz)
        evaluation.rename(evaluation.with_suffix(".away"))  # analyze fails where it loads the split
        backend_profiles = config.backend.name == "onnxruntime"
        if backend_profiles:
            with pytest.raises(SetupError, match="evaluation"):
                analyze(config)
        else:
            model, _ = analyze(config)  # the torch backend times no layers: the data waits for check_data
            with pytest.raises(SetupError, match="evaluation"):
                check_data(config, model)
