from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from autotune.backends import BuildError
from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.model import InputSpec, prepare_model
from autotune.plan import Plan
from autotune.quant.rewrite import rewrite
from autotune.testing import tiny_mlp


@pytest.fixture()
def tiny():
    return prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])


def _int8(model, layers, **knobs):
    ranges = {name: (-8.0, 8.0) for name in ("x", "a1", "a2", "a3", "h1b")}
    plan = Plan.make({layer.name: "int8" for layer in layers}, knobs)
    return rewrite(model.proto, model.layers, plan, ranges, OnnxRuntimeCPU.recipe)


def test_capabilities_offer_int8_not_fp16_on_x86():
    capabilities = OnnxRuntimeCPU().capabilities()
    assert capabilities.precisions_for("MatMul") == ("fp32", "int8")
    assert "fp16" not in capabilities.precisions_for("Conv")
    assert capabilities.precisions_for("Softmax") == ("fp32",)
    assert {k.name for k in capabilities.knobs} == {"graph_optimization_level", "allow_spinning"}


def test_int8_matmuls_fuse_into_integer_kernels(tiny):
    backend = OnnxRuntimeCPU()
    optimized = backend.optimized_model(_int8(tiny, tiny.layers), {"graph_optimization_level": "all"})
    ops = Counter(node.op_type for node in optimized.graph.node)
    # Every weight MatMul must run as an integer kernel; a float MatMul/Gemm fed by DequantizeLinear means
    # a fusion pass got in the way and INT8 would be slower than FP32.
    assert ops["MatMulIntegerToFloat"] + ops["QGemm"] == 4, ops
    assert ops["MatMul"] == 0 and ops["Gemm"] == 0, ops


def test_build_runs_and_rejects_bad_models(tiny):
    backend = OnnxRuntimeCPU()
    session = backend.build_graph(tiny.proto, {})
    out = backend.run_engine(session, {"x": np.zeros((16, 32), np.float32)})
    assert out[0].shape == (16, 10)
    broken = onnx.ModelProto()
    broken.CopyFrom(tiny.proto)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BuildError, match="could not create a session"):
        backend.build_graph(broken, {})
    with pytest.raises(BuildError, match="graph_optimization_level"):
        backend.build_graph(tiny.proto, {"graph_optimization_level": "ludicrous"})


def test_profile_gives_shares_of_fp32_runtime(tiny):
    shares = OnnxRuntimeCPU().profile(tiny, {"x": np.ones((16, 32), np.float32)})
    assert set(shares) == set(tiny.layer_names)
    assert all(0 < share < 1 for share in shares.values())
    assert sum(shares.values()) < 1
