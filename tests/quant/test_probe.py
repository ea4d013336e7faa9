"""Single-layer probes: a layer's own model, the rest of the model downstream of it, candidates side by side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layers import InputSpec, prepare_model
from autotune.quant.probe import (
    _reads,
    _value_info,
    downstream_model,
    find_cut,
    race,
    session,
    side_by_side,
    single_layer_model,
)
from autotune.quant.recipe import ORT_X86
from autotune.testing import tiny_mlp


@pytest.fixture(scope="module")
def mlp():
    return prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])


def _layer(loaded, name):
    return next(layer for layer in loaded.layers if layer.name == name)


def _with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """The model with intermediate tensors as extra outputs (what the cached FP32 run fetches)."""
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    extended.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    return extended


def _batches(rows=(16, 16, 16)):
    rng = np.random.default_rng(3)
    return [{"x": rng.standard_normal((n, 32)).astype(np.float32)} for n in rows]


def test_the_layer_and_its_downstream_model_compose_to_the_whole_model(mlp):
    cut = find_cut(mlp.proto, _layer(mlp, "fc3"), ORT_X86, "logits")
    fetched = [*cut.fetched, cut.target, "logits"]
    full = session(_with_outputs(mlp.proto, [*cut.fetched, cut.target]))
    runs = [dict(zip(fetched, full.run(fetched, feeds), strict=True)) for feeds in _batches()]
    examples = {name: [run[name] for run in runs] for name in fetched}
    layer = session(single_layer_model(mlp.proto, cut, examples))
    rest = session(downstream_model(mlp.proto, cut, "logits", examples))
    for run in runs:
        (target,) = layer.run(None, {name: run[name] for name in cut.inputs})
        np.testing.assert_array_equal(target, run[cut.target])
        feeds = {cut.target: target, **{name: run[name] for name in cut.downstream_inputs}}
        np.testing.assert_array_equal(rest.run(None, feeds)[0], run["logits"])


def test_a_layer_whose_output_is_scored_has_no_downstream_model(mlp):
    cut = find_cut(mlp.proto, _layer(mlp, "head"), ORT_X86, "logits")
    assert cut.target == "logits" and cut.reaches_output and not cut.downstream
    assert downstream_model(mlp.proto, cut, "logits", {}) is None


def test_side_by_side_runs_each_version_on_the_same_inputs_under_its_own_names(mlp):
    cut = find_cut(mlp.proto, _layer(mlp, "fc2"), ORT_X86, "logits")
    a1 = np.abs(np.random.default_rng(1).standard_normal((16, 64))).astype(np.float32)
    single = single_layer_model(mlp.proto, cut, {"a1": [a1]})
    doubled = onnx.ModelProto()
    doubled.CopyFrom(single)
    (w2,) = doubled.graph.initializer
    w2.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w2) * 2, w2.name))
    merged = side_by_side([single, doubled], cut)
    assert [o.name for o in merged.graph.output] == [f"c0/{cut.target}", f"c1/{cut.target}"]
    first, second = session(merged).run(None, {"a1": a1})
    np.testing.assert_array_equal(first, session(single).run(None, {"a1": a1})[0])
    np.testing.assert_array_equal(second, session(doubled).run(None, {"a1": a1})[0])
    assert not np.array_equal(first, second)


def test_constants_computed_by_nodes_are_recomputed_downstream_not_fed():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Constant", [], ["shape"], name="shape.const", value_ints=[2, 8]),
        helper.make_node("Shape", ["shape"], ["rank"], name="rank"),  # static too: it reads a static tensor
        helper.make_node("Reshape", ["h", "shape"], ["flat"], name="flatten"),
        helper.make_node("Cast", ["rank"], ["rank_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["flat", "rank_f"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "static",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    loaded = prepare_model(model, Path("static.onnx"), None)
    cut = find_cut(loaded.proto, _layer(loaded, "mm"), ORT_X86, "y")
    assert cut.target == "h" and cut.inputs == ("x",)
    assert {"shape.const", "rank", "cast", "flatten", "scale"} <= {node.name for node in cut.downstream}
    assert cut.downstream_inputs == ()  # only the layer's output is fed
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    rest = downstream_model(loaded.proto, cut, "y", {"h": [x], "y": [np.zeros((2, 8), np.float32)]})
    np.testing.assert_array_equal(
        session(rest).run(None, {"h": x})[0], x.reshape(2, 8) * 2.0
    )  # times the length of the shape [2, 8]


def test_a_node_reads_what_its_subgraphs_capture_from_the_outer_graph():
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["outer", "local"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones(1, np.float32), "local")],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["other"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)]
    )
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)
    reads = _reads(node)
    assert reads[0] == "cond" and sorted(reads[1:]) == ["other", "outer"]  # not the branch's own "local"


def test_value_info_keeps_the_dims_the_examples_agree_on():
    info = _value_info("t", [np.zeros((2, 3), np.float32), np.zeros((5, 3), np.float32)])
    assert info.type.tensor_type.elem_type == TensorProto.FLOAT
    dims = info.type.tensor_type.shape.dim
    assert [d.HasField("dim_value") for d in dims] == [False, True] and dims[1].dim_value == 3
    ranks = _value_info("t", [np.zeros((2, 3), np.int64), np.zeros((2,), np.int64)])
    assert ranks.type.tensor_type.elem_type == TensorProto.INT64 and not ranks.type.tensor_type.HasField("shape")


def test_probe_sessions_run_the_nodes_as_written():
    options = session(tiny_mlp(), threads=1).get_session_options()
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert options.intra_op_num_threads == 1


def test_downstream_sessions_run_optimized_and_agree_with_the_nodes_as_written(mlp):
    optimized = session(mlp.proto, optimize=True)
    assert optimized.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    feed = {"x": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)}
    as_written = session(mlp.proto).run(None, feed)[0]
    np.testing.assert_allclose(optimized.run(None, feed)[0], as_written, rtol=1e-5, atol=1e-6)


def _scripted(noise: list[list[float]]):
    """A ``noise_of`` that reads a table and records which (candidate, batch) it was asked for."""
    asked = []

    def noise_of(candidate: int, batch: int) -> float:
        asked.append((candidate, batch))
        return noise[candidate][batch]

    return noise_of, asked


def test_the_race_keeps_the_candidate_best_over_all_batches_when_a_light_batch_ranks_them_otherwise():
    # Batch 0 weighs 1 % of the others. On it, candidate 1 looks 10x better than candidate 0 (0.001 against 0.01
    # per weight), on every other batch 5x worse: in total candidate 0 is 5x better.
    weights = [1.0, 100.0, 100.0, 100.0]
    noise = [[0.01, 0.1, 0.1, 0.1], [0.001, 0.5, 0.5, 0.5]]
    noise_of, asked = _scripted(noise)
    totals = race(2, noise_of, weights, exhaustive=False)
    assert totals[0] == pytest.approx(sum(noise[0]))  # the winner's total is exact
    assert totals[1] > totals[0]
    assert len(asked) < 8  # the loser stopped early


def test_the_race_runs_the_batches_that_weigh_most_first():
    noise_of, asked = _scripted([[1.0, 1.0, 1.0], [9.0, 9.0, 9.0]])
    race(2, noise_of, [1.0, 5.0, 3.0], exhaustive=False)
    assert [batch for candidate, batch in asked if candidate == 0] == [1, 2, 0]
    assert asked[0][1] == asked[1][1] == 1  # every candidate starts on the strongest batch


def test_an_exhaustive_race_gives_every_total_exactly():
    noise = [[0.01, 0.1, 0.1, 0.1], [0.001, 0.5, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]]
    noise_of, asked = _scripted(noise)
    assert race(3, noise_of, [1.0, 100.0, 100.0, 100.0], exhaustive=True) == pytest.approx([sum(n) for n in noise])
    assert len(asked) == 12
