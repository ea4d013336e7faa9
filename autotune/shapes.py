"""ONNX shape inference for models whose weights weigh hundreds of MB.

``onnx.shape_inference.infer_shapes`` serializes the whole model, weights included, parses it in C++ and hands it
back serialized again: 3.1 s for the BERT-large-shaped encoder's 530 MB on the CPU VM, in both of a run's processes.
It reads only the type and dims of an initializer, and the values of the small ones a shape is computed from, so
here it runs on a copy whose large initializers are stubs with no bytes: 0.08 s for the encoder, the same result
(``bench/research/shape_inference.py``).
"""

from __future__ import annotations

import onnx
from onnx import shape_inference

STUB_ABOVE_BYTES = 64 * 1024
"""Initializers larger than this go to shape inference without their bytes: a shape tensor (what data propagation
reads) of 64 KiB would have 8192 dims."""


def _copy_fields(
    source: onnx.GraphProto | onnx.ModelProto, target: onnx.GraphProto | onnx.ModelProto, *, but: str
) -> None:
    """Copies every set field of ``source`` into the empty ``target``, except the field named ``but``."""
    for field, value in source.ListFields():
        if field.name == but:
            continue
        # By what the value is: protobuf's descriptors name a repeated field differently across its versions.
        if hasattr(value, "extend"):
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def without_weight_bytes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers above ``STUB_ABOVE_BYTES`` keep their name, type and dims only.

    The stubs are marked as external data, so no reader takes them for empty tensors.
    """
    light = onnx.ModelProto()
    _copy_fields(model, light, but="graph")
    _copy_fields(model.graph, light.graph, but="initializer")
    for initializer in model.graph.initializer:
        stub = light.graph.initializer.add()
        if initializer.ByteSize() <= STUB_ABOVE_BYTES:
            stub.CopyFrom(initializer)
            continue
        stub.name = initializer.name
        stub.data_type = initializer.data_type
        stub.dims.extend(initializer.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.external_data.add(key="location", value="left out for shape inference")
    return light


def infer_shapes(model: onnx.ModelProto, data_prop: bool = False) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` of ``model``, its large initializers stubbed (``without_weight_bytes``).

    The result is for reading types and shapes: its large initializers have no bytes. ``infer_shapes_in_place``
    writes the inference into the model itself.

    Raises:
        onnx.shape_inference.InferenceError: As ``onnx.shape_inference.infer_shapes`` (with ``strict_mode`` off,
            only for a graph it cannot read).
    """
    return shape_inference.infer_shapes(without_weight_bytes(model), data_prop=data_prop)


def infer_shapes_in_place(model: onnx.ModelProto, data_prop: bool = False) -> None:
    """Writes shape inference into ``model``: what ``onnx.shape_inference.infer_shapes`` would return, in place.

    Every graph field but the initializers (value_info, outputs, nodes with their subgraphs) is replaced by the
    inferred one; the initializers, with their bytes, stay.
    """
    inferred = infer_shapes(model, data_prop)
    for field, _ in inferred.graph.ListFields():
        if field.name != "initializer":
            model.graph.ClearField(field.name)
    _copy_fields(inferred.graph, model.graph, but="initializer")
