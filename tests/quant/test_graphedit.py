"""Graph edits: fresh names, initializers, nodes spliced in order, dropped initializers, opset upgrades."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layers import Layer
from autotune.quant.graphedit import GraphEditor, RewriteError, default_opset, ensure_opset


def _model(opset: int = 13, squeeze: bool = False) -> onnx.ModelProto:
    """x -> MatMul(w) -> Relu -> y, or with a Squeeze of a [1, 4] input first (whose axes moved in opset 13)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    x_shape = [2, 4]
    if squeeze:
        x_shape = [1, 2, 4]
        nodes.insert(0, helper.make_node("Squeeze", ["x3"], ["x"], name="squeeze", axes=[0]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x3" if squeeze else "x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) - 6, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_an_opset_without_changed_ops_is_bumped_and_the_ir_version_follows():
    model = _model(14)  # MatMul 13 and Relu 14 are their latest definitions
    assert default_opset(model) == 14
    raised = ensure_opset(model, 19)
    assert raised is model  # no conversion: the number alone changed
    assert default_opset(raised) == 19 and raised.ir_version >= 9  # opset 19 needs IR 9
    assert ensure_opset(raised, 17) is raised and default_opset(raised) == 19  # never lowered
    bare = _model(13)
    bare.ClearField("opset_import")
    assert default_opset(bare) == 0


def test_an_op_whose_definition_changed_goes_through_the_converter_and_still_computes_the_same():
    model = _model(11, squeeze=True)
    x = np.random.default_rng(0).standard_normal((1, 2, 4)).astype(np.float32)
    converted = ensure_opset(model, 13)
    onnx.checker.check_model(converted)
    squeeze = next(node for node in converted.graph.node if node.op_type == "Squeeze")
    assert len(squeeze.input) == 2 and not squeeze.attribute  # axes became an input
    np.testing.assert_array_equal(_run(converted, x), _run(model, x))


def test_an_unconvertible_model_is_a_rewrite_error_that_names_the_ops_and_the_fix(monkeypatch):
    from autotune.quant import graphedit

    def fail(model, version):
        raise RuntimeError("no adapter")

    monkeypatch.setattr(graphedit.version_converter, "convert_version", fail)
    with pytest.raises(
        RewriteError, match=r"opset 13 but the model has opset 11 and ops \['MatMul', 'Relu', 'Squeeze'\].*re-export"
    ):
        ensure_opset(_model(11, squeeze=True), 13)


def test_fresh_names_never_collide_with_any_name_in_the_graph():
    editor = GraphEditor(_model())
    assert [editor.fresh(base) for base in ("h", "h", "mm", "new", "new")] == ["h_1", "h_2", "mm_1", "new", "new_1"]
    assert editor.add_init("w", np.ones(3, np.float32)) == "w_1"
    np.testing.assert_array_equal(numpy_helper.to_array(editor.inits["w_1"]), np.ones(3))


def test_layers_and_initializers_are_checked_against_the_model():
    model = _model()
    layer = Layer("mm", "MatMul", 0, ("x",), "w", 1, None, "h", ((2, 4),), (2, 3), 24, 12, 1)
    editor = GraphEditor(model)
    assert editor.node_of(layer)[0] == 0
    np.testing.assert_array_equal(editor.float_init("w", layer), numpy_helper.to_array(model.graph.initializer[0]))
    with pytest.raises(RewriteError, match="'x' is not a float32 initializer"):
        editor.float_init("x", layer)
    editor.add_init("steps", np.arange(3, dtype=np.int64))
    with pytest.raises(RewriteError, match="'steps' is not a float32 initializer"):
        editor.float_init("steps", layer)
    with pytest.raises(RewriteError, match="'gone' is not a node of the model; rebuild the layer table"):
        editor.node_of(dataclasses.replace(layer, name="gone"))
    with pytest.raises(RewriteError, match="'mm' is a MatMul in the model, not a Gemm"):
        editor.node_of(dataclasses.replace(layer, op_type="Gemm"))


def test_a_qdq_spliced_after_a_node_and_a_replaced_weight_keep_the_graph_valid_and_drop_the_old_weight():
    model = _model()
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3]))  # old IR: a graph input
    w = numpy_helper.to_array(model.graph.initializer[0])
    editor = GraphEditor(model)  # edits the model it is given
    index, mm = 0, editor.graph.node[0]
    # The MatMul's output goes through Q/DQ: the node writes a new tensor, the Q/DQ writes "h" for the Relu.
    written = editor.rename_output(index, "h", "float")
    scale = editor.add_init("scale", np.float32(0.5))
    zero = editor.add_init("zero", np.uint8(0))
    editor.qdq(editor.after[index], written, "h", scale, zero, "mm")
    # The weight is replaced by a doubled copy; only this node reads it.
    doubled = editor.add_init("w_doubled", 2 * numpy_helper.to_array(editor.inits["w"]))
    editor.redirect(mm, "w", doubled)
    editor.replaced.add("w")
    editor.finish()
    edited = editor.model
    onnx.checker.check_model(edited)
    assert [n.op_type for n in edited.graph.node] == ["MatMul", "QuantizeLinear", "DequantizeLinear", "Relu"]
    assert "w" not in {i.name for i in edited.graph.initializer} and [i.name for i in edited.graph.input] == ["x"]
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    expected = np.maximum(np.clip(np.rint(x @ (2 * w) / 0.5), 0, 255) * 0.5, 0)  # uint8: negatives clip to 0
    np.testing.assert_allclose(_run(edited, x), expected, rtol=1e-6)


def test_an_initializer_still_read_is_kept_even_when_marked_replaced():
    editor = GraphEditor(_model())
    editor.replaced.add("w")
    editor.before[1].append(helper.make_node("Identity", ["w"], ["w_copy"], name="copy"))
    editor.finish()
    assert [n.name for n in editor.graph.node] == ["mm", "copy", "relu"]
    assert "w" in {i.name for i in editor.graph.initializer}
