"""Shape inference without the weights' bytes gives what onnx's own gives, weights and all."""

from __future__ import annotations

from onnx import TensorProto, shape_inference

from autotune.model.layers import model_hash
from autotune.model.shapes import STUB_ABOVE_BYTES, infer_shapes, infer_shapes_in_place, without_weight_bytes
from autotune.testing import data_propagated_reshape_model


def test_the_stubbed_copy_keeps_small_initializers_and_only_type_and_dims_of_large_ones():
    model = data_propagated_reshape_model()
    assert model.graph.initializer[0].ByteSize() > STUB_ABOVE_BYTES
    light = without_weight_bytes(model)
    stub, *small = light.graph.initializer
    assert stub.name == "W" and list(stub.dims) == [256, 128] and stub.data_type == TensorProto.FLOAT
    assert not stub.raw_data and not stub.float_data and stub.data_location == TensorProto.EXTERNAL
    assert small == list(model.graph.initializer[1:]) and light.producer_name == "test"
    assert len(model.graph.initializer[0].raw_data) == 256 * 128 * 4  # the model itself keeps its bytes


def test_inference_in_place_is_onnxs_own_byte_for_byte_and_keeps_the_weights():
    model = data_propagated_reshape_model()
    expected = shape_inference.infer_shapes(model, data_prop=True)
    inferred = infer_shapes(model, data_prop=True)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    assert shapes["z"] == [4, 128]  # the reshape's target came from data propagation over x's shape
    infer_shapes_in_place(model, data_prop=True)
    assert model.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    assert model_hash(model) == model_hash(expected)  # caches keyed by the hash stay valid
