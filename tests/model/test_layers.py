"""Tests for autotune.model.layers: the layer table, input resolution and ONNX loading."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layers import (
    InputSpec,
    ModelError,
    build_layer_table,
    graph_inputs,
    load_onnx,
    name_nodes,
    prepare_model,
    weight_array,
)
from autotune.testing import tiny_mlp

X16 = [InputSpec("x", (16, 32), "float32")]
F = TensorProto.FLOAT


def _prepare(model, inputs=X16, **kwargs):
    return prepare_model(model, Path("m.onnx"), inputs, **kwargs)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _w(name, shape, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


# ---------------------------------------------------------------------------------------------
# layer table
# ---------------------------------------------------------------------------------------------


def test_tiny_mlp_layer_table():
    loaded = _prepare(tiny_mlp())
    assert loaded.layer_names == ["fc1", "fc2", "fc3", "head"]
    fc1, fc2, fc3, head = loaded.layers
    assert [layer.op_type for layer in loaded.layers] == ["MatMul", "MatMul", "MatMul", "Gemm"]
    assert [layer.index for layer in loaded.layers] == [0, 1, 2, 3]
    assert [layer.weight for layer in loaded.layers] == ["w1", "w2", "w3", "w4"]
    # MatMul x @ W: output channels on W's last axis; Gemm transB=1: W is [out, in], axis 0
    assert [layer.weight_axis for layer in loaded.layers] == [-1, -1, -1, 0]
    assert [layer.bias for layer in loaded.layers] == [None, None, None, "b4"]
    assert fc1.activation_inputs == ("x",)
    assert fc2.activation_inputs == ("a1",)
    assert head.activation_inputs == ("a3",)
    assert [layer.output for layer in loaded.layers] == ["h1", "h2", "h3", "logits"]
    assert fc1.input_shapes == ((16, 32),)
    assert fc1.output_shape == (16, 64)
    assert head.output_shape == (16, 10)
    assert fc1.macs == 16 * 64 * 32
    assert fc2.macs == 16 * 64 * 64
    assert fc3.macs == 16 * 64 * 64
    assert head.macs == 16 * 10 * 64
    assert fc1.params == 32 * 64
    assert fc2.params == fc3.params == 64 * 64
    assert head.params == 10 * 64 + 10  # weight and bias
    depths = [layer.depth for layer in loaded.layers]
    assert depths == sorted(depths) and len(set(depths)) == 4
    assert depths == [1, 4, 6, 9]
    assert all(layer.runtime_share is None for layer in loaded.layers)


def test_loaded_model_metadata():
    loaded = _prepare(tiny_mlp())
    assert loaded.inputs == X16
    assert loaded.output_names == ["logits"]
    assert loaded.path == Path("m.onnx")
    assert len(loaded.hash) == 16
    assert loaded.hash == _prepare(tiny_mlp()).hash
    assert loaded.hash != _prepare(tiny_mlp(seed=1)).hash
    assert loaded.layer("fc2").name == "fc2"
    with pytest.raises(KeyError, match="nope"):
        loaded.layer("nope")
    np.testing.assert_array_equal(weight_array(loaded.proto, "b4"), np.zeros(10, np.float32))
    assert loaded.layers[0].to_dict()["macs"] == 16 * 64 * 32


def test_macs_follow_configured_batch():
    loaded = _prepare(tiny_mlp(), [InputSpec("x", (4, 32), "float32")])
    assert loaded.layers[0].macs == 4 * 64 * 32
    assert loaded.layers[0].input_shapes == ((4, 32),)


def test_gemm_without_trans_b_axis_one():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="g")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 5])],
        [_w("w", (3, 5)), _w("b", (5,))],
    )
    (layer,) = _prepare(model, None).layers
    assert layer.weight_axis == 1
    assert layer.macs == 2 * 5 * 3
    assert layer.params == 15 + 5


def test_matmul_weight_first_axis_minus_two():
    nodes = [helper.make_node("MatMul", ["w", "x"], ["y"], name="mm")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [3, 4])],
        [helper.make_tensor_value_info("y", F, [6, 4])],
        [_w("w", (6, 3))],
    )
    (layer,) = _prepare(model, None).layers
    assert layer.weight == "w"
    assert layer.weight_axis == -2
    assert layer.activation_inputs == ("x",)


def _conv_model(group=1, cin=3, cout=4):
    nodes = [
        helper.make_node("Conv", ["img", "k", "kb"], ["c"], name="conv", pads=[1, 1, 1, 1], group=group),
        helper.make_node("Relu", ["c"], ["out"], name="relu"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("img", F, [2, cin, 8, 8])],
        [helper.make_tensor_value_info("out", F, [2, cout, 8, 8])],
        [_w("k", (cout, cin // group, 3, 3)), _w("kb", (cout,))],
    )


def test_conv_layer():
    (layer,) = _prepare(_conv_model(), None).layers
    assert layer.op_type == "Conv"
    assert layer.weight == "k" and layer.bias == "kb"
    assert layer.weight_axis == 0
    assert layer.output_shape == (2, 4, 8, 8)
    out_elements = 2 * 4 * 8 * 8
    assert layer.macs == out_elements * 3 * 3 * 3  # out elems x Cin/g x kh x kw
    assert layer.params == 4 * 3 * 3 * 3 + 4
    assert layer.input_shapes == ((2, 3, 8, 8),)


def test_a_layer_lists_the_nodes_its_choice_covers():
    """A Conv's layer takes the zero Pad only it reads and a sole ReLU6 after it; a MatMul's Relu stays apart."""
    pads = numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")
    bounds = [numpy_helper.from_array(np.float32(v), n) for n, v in (("lo", 0.0), ("hi", 6.0))]
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"], "pad"),
        helper.make_node("Conv", ["p", "k"], ["c"], "conv"),
        helper.make_node("Clip", ["c", "lo", "hi"], ["r"], "relu6"),
        helper.make_node("Flatten", ["r"], ["f"], "flatten"),
        helper.make_node("MatMul", ["f", "w"], ["m"], "fc"),
        helper.make_node("Relu", ["m"], ["y"], "relu"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [2, 5])],
        [pads, *bounds, _w("k", (4, 3, 3, 3)), _w("w", (256, 5))],
    )
    conv, fc = _prepare(model, None).layers
    assert conv.nodes == ("pad", "conv", "relu6") and conv.activation_inputs == ("p",)
    assert fc.nodes == ("fc",)  # a MatMul's output is float on ONNX Runtime: nothing folds into it


def test_an_activation_matmul_left_out_is_listed_with_its_reason():
    loaded = _prepare(_attention_like(), None)
    assert any("both inputs are activations" in why for why in loaded.float_ops.values())


def test_grouped_conv_macs():
    (layer,) = _prepare(_conv_model(group=4, cin=4, cout=8), None).layers
    assert layer.output_shape == (2, 8, 8, 8)
    assert layer.macs == (2 * 8 * 8 * 8) * (4 // 4) * 3 * 3
    assert layer.weight_axis == 0


def _attention_like():
    nodes = [
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
        helper.make_node("MatMul", ["s", "wo"], ["o"], name="proj"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("q", F, [2, 4, 8]), helper.make_tensor_value_info("kt", F, [2, 8, 5])],
        [helper.make_tensor_value_info("o", F, [2, 4, 6])],
        [_w("wo", (5, 6))],
    )


def test_activation_matmul_excluded_by_default():
    loaded = _prepare(_attention_like(), None)
    assert loaded.layer_names == ["proj"]


def test_activation_matmul_included_when_asked():
    loaded = _prepare(_attention_like(), None, include_activation_matmuls=True)
    assert loaded.layer_names == ["qk", "proj"]
    qk = loaded.layers[0]
    assert qk.weight is None and qk.weight_axis is None and qk.bias is None
    assert qk.activation_inputs == ("q", "kt")
    assert qk.input_shapes == ((2, 4, 8), (2, 8, 5))
    assert qk.output_shape == (2, 4, 5)
    assert qk.macs == 2 * 4 * 5 * 8
    assert qk.params == 0
    assert loaded.layers[1].index == 1
    assert loaded.layers[1].macs == 2 * 4 * 6 * 5


def test_only_activation_matmul_is_no_tunable_layer():
    nodes = [helper.make_node("MatMul", ["a", "b"], ["c"], name="mm")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("a", F, [2, 3]), helper.make_tensor_value_info("b", F, [3, 4])],
        [helper.make_tensor_value_info("c", F, [2, 4])],
    )
    with pytest.raises(ModelError, match="no tunable layer"):
        _prepare(copy.deepcopy(model), None)
    assert _prepare(model, None, include_activation_matmuls=True).layer_names == ["mm"]


def test_no_tunable_layer():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 3])],
    )
    with pytest.raises(ModelError, match="no tunable layer") as info:
        prepare_model(model, Path("relu_only.onnx"), None)
    assert "relu_only.onnx" in str(info.value)


def test_a_constant_node_weight_is_folded_into_an_initializer():
    nodes = [
        helper.make_node("Constant", [], ["w"], name="const", value=_w("wv", (3, 4))),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm_const"),
        helper.make_node("MatMul", ["y", "w2"], ["z"], name="mm_init"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("z", F, [2, 5])],
        [_w("w2", (4, 5))],
    )
    loaded = _prepare(model, None)
    assert loaded.layer_names == ["mm_const", "mm_init"]
    assert [layer.weight_source for layer in loaded.layers] == ["Constant", "initializer"]
    assert loaded.layers[0].weight == "w" and "const" not in [node.name for node in loaded.proto.graph.node]


def test_unnamed_and_duplicate_nodes_get_unique_names():
    model = tiny_mlp()
    model.graph.node[0].name = ""
    model.graph.node[3].name = "head"  # duplicate of the Gemm's name
    name_nodes(model)
    names = [node.name for node in model.graph.node]
    assert len(set(names)) == len(names)
    assert names[0] == "MatMul_0"
    loaded = _prepare(model)
    assert len(loaded.layers) == 4
    assert len(set(loaded.layer_names)) == 4


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def test_graph_inputs_symbolic_dims():
    assert graph_inputs(tiny_mlp()) == [InputSpec("x", (-1, 32), "float32")]


def test_dynamic_input_without_config_shape():
    with pytest.raises(ModelError) as info:
        prepare_model(tiny_mlp(), Path("dyn.onnx"), None)
    message = str(info.value)
    assert "'x'" in message and "dynamic" in message and "dyn.onnx" in message
    assert "[-1, 32]" in message


def test_config_names_unknown_input():
    with pytest.raises(ModelError) as info:
        _prepare(tiny_mlp(), [*X16, InputSpec("tokens", (16, 8), "int64")])
    message = str(info.value)
    assert "['tokens']" in message and "'x'" in message


def test_config_shape_conflicts_with_fixed_dim():
    with pytest.raises(ModelError, match="fixes a dimension to 32"):
        _prepare(tiny_mlp(), [InputSpec("x", (16, 30), "float32")])


def test_config_rank_mismatch():
    with pytest.raises(ModelError, match="rank 2"):
        _prepare(tiny_mlp(), [InputSpec("x", (16, 32, 1), "float32")])


# ---------------------------------------------------------------------------------------------
# load_onnx
# ---------------------------------------------------------------------------------------------


def test_load_onnx_round_trip(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(tiny_mlp(), str(path))
    model = load_onnx(path)
    assert [n.name for n in model.graph.node] == [n.name for n in tiny_mlp().graph.node]
    np.testing.assert_array_equal(weight_array(model, "w2"), weight_array(tiny_mlp(), "w2"))


def test_load_onnx_missing_file(tmp_path):
    path = tmp_path / "missing.onnx"
    with pytest.raises(ModelError, match="does not exist") as info:
        load_onnx(path)
    assert str(path) in str(info.value)


def test_load_onnx_garbage(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"this is not an onnx model \x00\xff\x07" * 10)
    with pytest.raises(ModelError, match="not a readable ONNX model") as info:
        load_onnx(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.01])
def test_load_onnx_truncated(tmp_path, fraction):
    full = tiny_mlp().SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(full[: int(len(full) * fraction)])
    with pytest.raises(ModelError) as info:
        load_onnx(path)
    assert str(path) in str(info.value)


def _save_external(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(
        tiny_mlp(),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.data",
        size_threshold=0,
    )
    return path


def test_load_onnx_external_data(tmp_path):
    path = _save_external(tmp_path / "ext")
    assert (tmp_path / "ext" / "w.data").is_file()
    assert path.stat().st_size < 2000  # the weights really are outside
    model = load_onnx(path)
    reference = tiny_mlp()
    for name in ("w1", "w2", "w3", "w4", "b1", "b4"):
        np.testing.assert_array_equal(weight_array(model, name), weight_array(reference, name))
    loaded = prepare_model(model, path, X16)
    assert loaded.layers[3].params == 650


def test_load_onnx_external_data_missing(tmp_path):
    path = _save_external(tmp_path / "ext")
    (tmp_path / "ext" / "w.data").unlink()
    with pytest.raises(ModelError, match="external weights") as info:
        load_onnx(path)
    assert str(path) in str(info.value)


def test_load_onnx_external_data_truncated(tmp_path):
    path = _save_external(tmp_path / "ext")
    data = tmp_path / "ext" / "w.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ModelError) as info:
        load_onnx(path)
    assert str(path) in str(info.value)


def _conv_after_computed_pads() -> onnx.ModelProto:
    """A conv after a Pad whose pads are graph arithmetic, as torch.onnx.export writes "same" padding."""

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))

    nodes = [
        const("half", [0, 1, 0, 1]),
        helper.make_node("Concat", ["half", "half"], ["pairs"], axis=0),
        const("grid", [2, 4]),
        helper.make_node("Reshape", ["pairs", "grid"], ["grid_pads"]),
        helper.make_node("Transpose", ["grid_pads"], ["swapped"], perm=[1, 0]),
        const("flat", [-1]),
        helper.make_node("Reshape", ["swapped", "flat"], ["pads"]),
        helper.make_node("Pad", ["x", "pads"], ["padded"]),
        helper.make_node("Conv", ["padded", "w"], ["y"], name="conv"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [1, 4, "height", "width"])],
        [_w("w", (4, 3, 3, 3))],
    )


def test_macs_of_a_conv_after_pads_that_onnx_shape_inference_cannot_follow():
    import onnxruntime as ort

    model = _conv_after_computed_pads()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.zeros((1, 3, 8, 8), np.float32)})
    (layer,) = _prepare(model, None).layers
    assert layer.output_shape == y.shape  # ONNX's inference leaves it (1, 4, -1, -1); ORT's symbolic one fills it
    assert layer.macs == y.size * 3 * 3 * 3


def test_shape_inference_that_stops_early_leaves_no_file_in_the_working_directory(tmp_path, monkeypatch):
    # An operator only a custom runtime knows stops ONNX Runtime's symbolic shape inference, which then saves its
    # partial model into the working directory before it gives up.
    model = tiny_mlp()
    relu = next(n for n in model.graph.node if n.name == "relu1")
    relu.op_type, relu.domain = "FancyActivation", "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    monkeypatch.chdir(tmp_path)
    layers = build_layer_table(model)
    assert [layer.name for layer in layers] and list(tmp_path.iterdir()) == []


FACTORY_CALLS: list[int] = []


def counted_mlp():
    """``autotune.testing.tiny_torch_mlp``, counting its calls."""
    from autotune.testing import tiny_torch_mlp

    FACTORY_CALLS.append(1)
    return tiny_torch_mlp()


def test_an_analysis_calls_the_factory_once_for_the_export_and_the_binding_and_the_next_calls_it_again(tmp_path):
    from autotune.api import analyze
    from autotune.model.layers import factory_module
    from autotune.testing import tiny_torch_config

    config = tiny_torch_config(tmp_path)
    config = config.model_copy(update={"model": config.model.model_copy(update={"torch": f"{__name__}:counted_mlp"})})
    FACTORY_CALLS.clear()
    analyze(config)  # exports the module, then binds the layers to it
    assert len(FACTORY_CALLS) == 1 and not factory_module(f"{__name__}:counted_mlp").training
    analyze(config)  # the export is cached; the binding's module is made afresh for this analysis
    assert len(FACTORY_CALLS) == 2
