"""ONNX shape inference for models whose weights weigh hundreds of MB.

``onnx.shape_inference.infer_shapes`` serializes the whole model, weights included, parses it in C++ and hands it
back serialized again: seconds for a model of hundreds of MB, in both of a run's processes. It reads only the type
and dims of an initializer, and the values of the small ones a shape is computed from, so here it runs on a copy
whose large initializers are stubs with no bytes: the same result in a fraction of the time
(``bench/research/shape_inference.py``; docs/method.md#measurements-behind-the-codes-choices). ``known_shapes`` reads
every tensor's shape that inference resolved, with ONNX Runtime's symbolic inference where ONNX's stops.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Collection, Iterator

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


def _value_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def known_shapes(model: onnx.ModelProto, weighted_op_types: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape that shape inference resolved (-1 for an unknown dim).

    ONNX's own inference stops at pads computed in the graph (``torch.onnx.export`` writes TensorFlow-style "same"
    padding as Shape/Slice/Concat arithmetic), which leaves every later conv without a shape and so without MACs.
    ONNX Runtime's symbolic shape inference propagates through that arithmetic, so it fills what ONNX left open,
    where an output of a node of ``weighted_op_types`` is still unknown.
    """
    shapes = _value_shapes(model.graph)
    weighted_outputs = [n.output[0] for n in model.graph.node if n.op_type in weighted_op_types and n.output]
    if all(_resolved(shapes.get(name, ())) for name in weighted_outputs):
        return shapes
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # When it cannot infer every shape, ORT saves its partial model (sym_shape_infer_temp.onnx and a .data file
        # per tensor) into the working directory before raising: run it in a scratch directory, not the user's.
        with tempfile.TemporaryDirectory(prefix="autotune-shapes-") as scratch, _working_directory(scratch):
            symbolic = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception:  # a best effort for MACs: unknown shapes stay unknown, as before
        return shapes
    for name, shape in _value_shapes(symbolic.graph).items():
        if _resolved(shape) and not _resolved(shapes.get(name, ())):
            shapes[name] = shape
    return shapes


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    """``contextlib.chdir`` (Python 3.11+) for 3.10."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _resolved(shape: tuple[int, ...]) -> bool:
    return bool(shape) and all(d > 0 for d in shape)
