"""The op-type registry: its partitions agree, the config takes exactly its op types, value-preserving ops are."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from autotune.config.schema import SearchSpaceConfig
from autotune.model.optypes import (
    CONV_OP_TYPES,
    INT8_OUTPUT_OP_TYPES,
    MATMUL_OP_TYPES,
    RECURRENT_OP_TYPES,
    TUNABLE_OP_TYPES,
    VALUE_PRESERVING_OP_TYPES,
    WEIGHTED_OP_TYPES,
    WEIGHTLESS_OP_TYPES,
)


def test_the_op_type_groups_partition_the_tunable_ops():
    assert set(WEIGHTED_OP_TYPES) | set(WEIGHTLESS_OP_TYPES) | set(RECURRENT_OP_TYPES) == set(TUNABLE_OP_TYPES)
    assert not set(WEIGHTED_OP_TYPES) & set(WEIGHTLESS_OP_TYPES)
    assert not set(RECURRENT_OP_TYPES) & (set(WEIGHTED_OP_TYPES) | set(WEIGHTLESS_OP_TYPES))
    assert set(MATMUL_OP_TYPES) | set(CONV_OP_TYPES) == set(WEIGHTED_OP_TYPES)
    # MatMul/Gemm return float; a dynamically quantized LSTM too
    assert set(INT8_OUTPUT_OP_TYPES) == set(TUNABLE_OP_TYPES) - set(MATMUL_OP_TYPES) - set(RECURRENT_OP_TYPES)
    assert not set(VALUE_PRESERVING_OP_TYPES) & set(TUNABLE_OP_TYPES)
    assert len(set(TUNABLE_OP_TYPES)) == len(TUNABLE_OP_TYPES)


def test_the_config_takes_every_tunable_op_type_and_no_other():
    assert SearchSpaceConfig(op_types=list(TUNABLE_OP_TYPES)).op_types == list(TUNABLE_OP_TYPES)
    for other in ("Relu", "Softmax", *VALUE_PRESERVING_OP_TYPES):
        with pytest.raises(ValueError, match="op_types"):
            SearchSpaceConfig(op_types=[other])


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


_PRESERVING = {
    "Reshape": ({}, [_ints("a", [1, 8, 8])]),
    "Flatten": ({"axis": 2}, []),
    "Transpose": ({"perm": [0, 2, 3, 1]}, []),
    "Squeeze": ({}, [_ints("a", [0])]),
    "Unsqueeze": ({}, [_ints("a", [1])]),
    "Identity": ({}, []),
    "MaxPool": ({"kernel_shape": [2, 2], "strides": [1, 1]}, []),
    "Slice": ({}, [_ints("a", [1]), _ints("b", [3]), _ints("c", [2])]),
    "DepthToSpace": ({"blocksize": 2}, []),
    "SpaceToDepth": ({"blocksize": 2}, []),
}


@pytest.mark.parametrize("op_type", VALUE_PRESERVING_OP_TYPES)
def test_a_value_preserving_op_outputs_only_values_of_its_input(op_type):
    attributes, extra = _PRESERVING.get(op_type, ({}, []))  # an op added without its inputs here: none
    node = helper.make_node(op_type, ["x", *(t.name for t in extra)], ["y"], **attributes)
    graph = helper.make_graph(
        [node],
        op_type,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        extra,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).permutation(64).astype(np.float32).reshape(1, 4, 4, 4) * 0.37 - 9.0
    (y,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert y.size > 0 and np.isin(y, x).all()
