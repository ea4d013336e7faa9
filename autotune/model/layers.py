"""The model's ONNX graph and its table of tunable layers: load or export ONNX, infer shapes, read the layers."""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from autotune.extras import MissingExtra
from autotune.model.intake import INITIALIZER, Rejection, fold_weight_constants, no_layer_message, weight_slot
from autotune.model.layer_units import GraphIndex
from autotune.model.optypes import (
    FOLDED_ACTIVATIONS,
    INT8_OUTPUT_OP_TYPES,
    RECURRENT_OP_TYPES,
    WEIGHTED_OP_TYPES,
    WEIGHTLESS_OP_TYPES,
)
from autotune.model.recurrent import recurrent_weights
from autotune.model.shapes import infer_shapes_in_place, known_shapes


class ModelError(ValueError):
    """The model cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class InputSpec:
    """One model input as it is fed at run time."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Layer:
    """One tunable layer and the features an agent can use to choose its precision.

    A layer is one decision of the search, and may cover several nodes (``nodes``): the op, a zero ``Pad`` that
    only it reads (before a Conv or AveragePool) and, for a layer whose INT8 output can stay INT8 (a conv or a
    weightless layer), the activation that alone reads its output (``GraphIndex.output_tail``: a ``Relu``,
    ``Clip`` or ``HardSwish``, or a SiLU's ``Sigmoid`` and ``Mul``). Its INT8 output is then the activation's
    output, so the activation runs with the integer kernels instead of being a layer of its own.

    Attributes:
        name: The ONNX node name (unique; unnamed nodes get one on load).
        op_type: A tunable op type (``autotune.model.optypes``): Conv, ConvTranspose, Gemm, MatMul, or a weightless op
            such as an Add that joins two INT8 branches.
        index: Position in the layer table (graph order).
        activation_inputs: Tensors quantized as activations when the layer runs in INT8.
        weight: The constant weight initializer, or None for an activation x activation MatMul.
        weight_axis: The output-channel axis of the weight, for per-channel scales.
        bias: The bias initializer (Conv, ConvTranspose, Gemm), if any.
        output: The layer's output tensor.
        input_shapes: Shapes of the activation inputs (-1 where unknown).
        output_shape: Shape of the output (-1 where unknown).
        macs: Multiply-accumulates for one run at the configured input shapes.
        params: Number of weight and bias elements.
        depth: Longest path from a graph input, in nodes.
        runtime_share: This layer's share of FP32 runtime, where the backend could profile it.
        nodes: Every node the layer's choice covers, in graph order; empty for the op alone.
        weight_source: Where the weight came from: ``initializer`` when the file had it so, else the chain intake
            folded into one (``autotune.model.intake``), e.g. ``Constant`` or ``Constant+Transpose``; None without a
            weight.
    """

    name: str
    op_type: str
    index: int
    activation_inputs: tuple[str, ...]
    weight: str | None
    weight_axis: int | None
    bias: str | None
    output: str
    input_shapes: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    macs: int
    params: int
    depth: int
    runtime_share: float | None = None
    nodes: tuple[str, ...] = ()
    weight_source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class LoadedModel:
    """An ONNX model ready for tuning.

    Attributes:
        proto: The model with unique node names and inferred shapes (weights in memory).
        path: Where it was loaded from.
        inputs: Input specs at the configured shapes.
        layers: The tunable layers, in graph order.
        hash: Content hash of the model (graph and weights).
        output_names: The graph outputs, in order.
        float_ops: Node name to why it stays FP32 although it is tunable or sits on an INT8 layer's output.
    """

    proto: onnx.ModelProto
    path: Path
    inputs: list[InputSpec]
    layers: list[Layer]
    hash: str
    output_names: list[str] = field(default_factory=list)
    float_ops: dict[str, str] = field(default_factory=dict)

    @property
    def layer_names(self) -> list[str]:
        """The tunable layer names in table order."""
        return [layer.name for layer in self.layers]

    def layer(self, name: str) -> Layer:
        """The layer called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no tunable layer named {name!r}; see `autotune inspect CONFIG` for the names")


def load_onnx(path: str | Path) -> onnx.ModelProto:
    """Loads an ONNX file with its external data.

    Raises:
        ModelError: The file is missing, not ONNX, or its external weights are missing.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist: fix model.onnx in the config")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # noqa: BLE001 - protobuf raises several types for a corrupt file
        raise ModelError(f"{path} is not a readable ONNX model ({error}); re-export it") from error
    if not model.HasField("graph"):  # an empty file (a copy cut short) parses as an empty model
        raise ModelError(f"{path} is not a readable ONNX model (it has no graph: empty or cut short); re-export it")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as error:  # missing, or shorter than recorded
        raise ModelError(
            f"{path}: external weights are missing ({error}); keep the .data file next to the model"
        ) from error
    return model


@functools.cache
def factory_module(factory: str) -> Any:
    """The module a ``model.torch`` factory returns, in eval mode, made once per analysis; callers must not change it.

    The run's process exports it for the layer table and binds the layers to it; calling the factory twice loaded
    or initialised every weight twice (6-9 s of the BERT-large-shaped encoder's set-up). ``analyze`` and
    ``TrialRunner`` clear the cache when they start, so each analysis calls the factory afresh (its code or its
    checkpoint may have changed in a long-lived process), and a factory whose weights differ between calls is still
    caught by the trial process's binding.
    """
    return resolve_callable(factory)().eval()


def resolve_callable(spec: str) -> Any:
    """Imports ``"package.module:function"`` and returns the function.

    Raises:
        ValueError: The spec is malformed or the name does not exist.
        MissingExtra: The module needs an extra of autotune that is not installed (passed on unchanged).
    """
    if ":" not in spec:
        raise ValueError(f"{spec!r} must look like 'package.module:function'")
    module_name, attribute = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except MissingExtra:  # its one-line message says what to install; wrapped, it would name the module instead
        raise
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for {spec!r}: {error}") from error
    try:
        return getattr(module, attribute)
    except AttributeError as error:
        raise ValueError(f"{module_name!r} has no {attribute!r} (from {spec!r})") from error


def model_hash(model: onnx.ModelProto) -> str:
    """A content hash of the graph and its weights."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]


def name_nodes(model: onnx.ModelProto) -> None:
    """Gives every unnamed or duplicate-named node a unique name, in place."""
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        node.name = name
        seen.add(name)


def fix_input_shapes(model: onnx.ModelProto, inputs: Sequence[InputSpec]) -> None:
    """Writes the configured shapes into the graph inputs, in place, so shape inference resolves every dim."""
    by_name = {spec.name: spec for spec in inputs}
    for value in model.graph.input:
        spec = by_name.get(value.name)
        if spec is None:
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(spec.shape):
            raise ModelError(
                f"input {value.name!r} has rank {len(dims)} in the model but shape {list(spec.shape)} in the config"
            )
        for dim, size in zip(dims, spec.shape, strict=True):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise ModelError(
                    f"input {value.name!r}: the model fixes a dimension to {dim.dim_value}, "
                    f"the config asks for {size}; fix inputs[].shape in the config"
                )
            dim.Clear()
            dim.dim_value = size


_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The non-initializer graph inputs with their declared shapes (-1 for a symbolic dim)."""
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
        specs.append(InputSpec(value.name, shape, _ONNX_TO_NUMPY.get(tensor_type.elem_type, "float32")))
    return specs


def resolve_inputs(model: onnx.ModelProto, configured: Sequence[InputSpec] | None, path: Path) -> list[InputSpec]:
    """Merges the config's input specs with the model's declared inputs.

    Raises:
        ModelError: An input has dynamic dims and no shape in the config, or the config names an unknown input.
    """
    declared = graph_inputs(model)
    by_name = {spec.name: spec for spec in configured or []}
    unknown = set(by_name) - {spec.name for spec in declared}
    if unknown:
        raise ModelError(
            f"{path}: the config names inputs {sorted(unknown)} that the model does not have; "
            f"model inputs: {[s.name for s in declared]}"
        )
    resolved = []
    for spec in declared:
        if spec.name in by_name:
            resolved.append(by_name[spec.name])
        elif any(d < 0 for d in spec.shape):
            raise ModelError(
                f"{path}: input {spec.name!r} has dynamic dimensions {list(spec.shape)}; "
                f"give its shape under inputs: in the config"
            )
        else:
            resolved.append(spec)
    return resolved


def _shape_of(value_info: dict[str, tuple[int, ...]], name: str) -> tuple[int, ...]:
    return value_info.get(name, ())


def _depths(graph: onnx.GraphProto) -> dict[str, int]:
    producer_depth: dict[str, int] = {}
    node_depth: dict[str, int] = {}
    for node in graph.node:  # ONNX requires topological order
        depth = 1 + max((producer_depth.get(name, 0) for name in node.input if name), default=0)
        node_depth[node.name] = depth
        for output in node.output:
            producer_depth[output] = depth
    return node_depth


def _weight_axis(op_type: str, node: onnx.NodeProto, weight_index: int) -> int:
    if op_type == "Conv":
        return 0
    if op_type == "ConvTranspose":
        return 1
    if op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    # MatMul: x @ W has output channels on W's last axis; W @ x on W's first (row) axis.
    return -1 if weight_index == 1 else -2


def _macs(op_type: str, weight_shape: tuple[int, ...], out_shape: tuple[int, ...], in_shapes: list) -> int:
    if not out_shape or any(d < 0 for d in out_shape):
        return 0
    out_elements = int(np.prod(out_shape))
    if op_type in ("Conv",):
        # each output element sums over in_channels/group x kernel
        return out_elements * int(np.prod(weight_shape[1:])) if weight_shape else 0
    if op_type == "ConvTranspose":
        in_elements = int(np.prod(in_shapes[0])) if in_shapes and all(d > 0 for d in in_shapes[0]) else 0
        return in_elements * int(np.prod(weight_shape[1:])) if weight_shape else 0
    # MatMul / Gemm: the reduction dimension is the activation's last dim
    if in_shapes and in_shapes[0] and in_shapes[0][-1] > 0:
        return out_elements * in_shapes[0][-1]
    if weight_shape:
        return out_elements * weight_shape[0]
    return 0


def _weightless_reason(node: onnx.NodeProto, index: GraphIndex, int8_tensors: set[str]) -> str | None:
    """Why a weightless op cannot be an INT8 layer (an input that is not an INT8 layer's output), or None.

    An op that reads no INT8 layer's output at all (shape arithmetic, a float branch) is no candidate: its reason
    is the empty string, which is not listed.
    """
    names = list(dict.fromkeys(name for name in node.input if name))
    if not any(index.int8_source(name, int8_tensors) for name in names):
        return ""
    for name in names:
        if index.int8_source(name, int8_tensors) is not None:
            continue
        producer = index.producer.get(name)
        if index.constant(name) is not None:
            source = "a constant"
        elif producer is None:
            source = "a graph input"
        else:
            source = f"{index.graph.node[producer].op_type} {index.graph.node[producer].name!r}"
        return f"input {name!r} comes from {source}, not from a layer whose output can stay INT8"
    return None


def _float_reason(node: onnx.NodeProto, position: int, index: GraphIndex, int8_tensors: set[str]) -> str | None:
    """Why an op that reads an INT8 layer's output runs in FP32 between INT8 layers, or None if it does not."""
    if node.op_type in ("Shape", "Size") or index.value_preserving(position):
        return None
    if not any(index.int8_source(name, int8_tensors) for name in node.input if name):
        return None
    if node.op_type in FOLDED_ACTIVATIONS:
        return f"the {node.op_type} is not the only reader of a layer's output, so it cannot fold into it: FP32"
    return f"no INT8 kernel for {node.op_type}: runs in FP32 between INT8 layers (dequantized before it)"


def build_layer_table(
    model: onnx.ModelProto,
    include_activation_matmuls: bool = False,
    float_ops: dict[str, str] | None = None,
    weight_sources: Mapping[str, str] | None = None,
) -> list[Layer]:
    """Finds the tunable layers of a shape-inferred model and computes their features.

    A weighted op (Conv, ConvTranspose, Gemm, MatMul with a constant weight) is a layer. A weightless op of
    ``autotune.model.optypes.WEIGHTLESS_OP_TYPES`` is one where every input comes, unchanged, from a layer whose
    output can stay INT8 (a convolution or another such op): an Add joining two INT8 branches, pooling after a
    convolution. Each layer covers the zero Pad only it reads and the activation that alone reads its output
    (a Relu, Clip, HardSwish, or a SiLU's Sigmoid and Mul).

    Args:
        model: A model with unique node names and inferred shapes.
        include_activation_matmuls: Also list MatMuls whose both inputs are activations (QK^T, AV).
        float_ops: Filled with node name to why it stays FP32 (a tunable op type that is no layer, or an op
            without an INT8 kernel that reads an INT8 layer's output), when given.
        weight_sources: The chains intake folded into initializers, by tensor (``autotune.model.intake``); any other
            weight's source is ``initializer``.

    Returns:
        The layers in graph order.
    """
    walk = _TableWalk(model, weight_sources or {})
    reasons: dict[str, str] = {}
    layers: list[Layer] = []
    for position, node in enumerate(model.graph.node):
        if node.op_type in RECURRENT_OP_TYPES:
            _add_recurrent_layer(node, layers, reasons, walk.index.initializers, walk.shapes, walk.depths[node.name])
            continue
        slot = _slot_or_reason(node, position, walk, include_activation_matmuls)
        if isinstance(slot, str):
            if slot:
                reasons[node.name] = slot
            continue
        layers.append(walk.layer(node, position, slot, len(layers)))
    if float_ops is not None:
        float_ops.update(reasons)
    return layers


def _slot_or_reason(
    node: onnx.NodeProto, position: int, walk: _TableWalk, include_activation_matmuls: bool
) -> int | None | str:
    """A layer's weight input slot (None: it has no weight), or why the node is no layer ("": nothing to list)."""
    if node.op_type in WEIGHTED_OP_TYPES:
        slot = weight_slot(node, walk.index, include_activation_matmuls)
        return slot.detail if isinstance(slot, Rejection) else slot
    if node.op_type in WEIGHTLESS_OP_TYPES:
        return _weightless_reason(node, walk.index, walk.int8_tensors)
    return _float_reason(node, position, walk.index, walk.int8_tensors) or ""


class _TableWalk:
    """What the walk over a graph in node order knows while it builds the layer table.

    Attributes:
        graph: The model's graph.
        index: Producers, readers and initializers of the graph.
        int8_tensors: Outputs of the layers met so far that a backend can keep INT8 for their readers.
    """

    def __init__(self, model: onnx.ModelProto, weight_sources: Mapping[str, str]):
        self.graph = model.graph
        self.index = GraphIndex(model.graph)
        self.int8_tensors: set[str] = set()
        self.shapes = known_shapes(model, WEIGHTED_OP_TYPES)
        self.depths = _depths(model.graph)
        self._weight_sources = weight_sources

    def layer(self, node: onnx.NodeProto, position: int, weight_index: int | None, number: int) -> Layer:
        """The layer of ``node`` (the ``number``-th), with its features; marks its output INT8 where it can be."""
        initializers = self.index.initializers
        weighted = node.op_type in WEIGHTED_OP_TYPES
        if weighted:
            data_inputs = list(node.input[:2])
        else:  # a weightless layer reads each distinct input once
            data_inputs, weight_index = list(dict.fromkeys(name for name in node.input if name)), None
        weight = data_inputs[weight_index] if weight_index is not None else None
        activations = tuple(name for i, name in enumerate(data_inputs) if i != weight_index)
        has_bias = weighted and len(node.input) > 2 and node.input[2] in initializers
        bias = node.input[2] if has_bias else None
        weight_shape = tuple(initializers[weight].dims) if weight else ()
        in_shapes = [_shape_of(self.shapes, name) for name in activations]
        out_shape = _shape_of(self.shapes, node.output[0])
        params = int(np.prod(weight_shape)) if weight else 0
        if bias:
            params += int(np.prod(initializers[bias].dims))
        if not weighted:
            macs = 0
        elif node.op_type == "MatMul" and weight is None:
            macs = _macs("MatMul", (), out_shape, in_shapes)
        else:
            macs = _macs(node.op_type, weight_shape, out_shape, in_shapes)
        return Layer(
            name=node.name,
            op_type=node.op_type,
            index=number,
            activation_inputs=activations,
            weight=weight,
            weight_axis=_weight_axis(node.op_type, node, weight_index) if weight else None,
            bias=bias,
            output=node.output[0],
            input_shapes=tuple(in_shapes),
            output_shape=out_shape,
            macs=macs,
            params=params,
            depth=self.depths[node.name],
            nodes=self._covered(node, position, activations),
            weight_source=self._weight_sources.get(weight, INITIALIZER) if weight else None,
        )

    def _covered(self, node: onnx.NodeProto, position: int, activations: Sequence[str]) -> tuple[str, ...]:
        """The nodes a layer covers: the zero Pads only it reads, itself, and the activation folded into it."""
        pads = [self.index.exclusive_pad(name, position) for name in activations]
        covered = [self.graph.node[i].name for i in pads if i is not None] + [node.name]
        if node.op_type in INT8_OUTPUT_OP_TYPES:
            self.int8_tensors.add(self.index.unit_output(position))
            covered += [self.graph.node[i].name for i in self.index.output_tail(node.output[0])]
        return tuple(covered)


def prepare_model(
    model: onnx.ModelProto,
    path: Path,
    configured_inputs: Sequence[InputSpec] | None,
    include_activation_matmuls: bool = False,
) -> LoadedModel:
    """Folds constant weights into initializers, names nodes, fixes input shapes, infers shapes, builds the layer table.

    Raises:
        ModelError: The model fails the checker, has unresolved inputs, or has no tunable layer.
    """
    # Before the nodes are named: unnamed nodes are named by position, as in the same model written with initializers.
    weight_sources = fold_weight_constants(model)
    name_nodes(model)
    inputs = resolve_inputs(model, configured_inputs, path)
    try:
        fix_input_shapes(model, inputs)
    except ModelError as error:
        raise ModelError(f"{path}: {error}") from error
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as error:
        raise ModelError(f"{path} fails the ONNX checker: {error}") from error
    infer_shapes_in_place(model, data_prop=True)
    float_ops: dict[str, str] = {}
    layers = build_layer_table(model, include_activation_matmuls, float_ops, weight_sources)
    if not layers:
        raise ModelError(no_layer_message(model, path, include_activation_matmuls))
    return LoadedModel(
        proto=model,
        path=path,
        inputs=inputs,
        layers=layers,
        hash=model_hash(model),
        output_names=[o.name for o in model.graph.output],
        float_ops=float_ops,
    )


def weight_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The initializer ``name`` as a numpy array."""
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    raise KeyError(name)


def _add_recurrent_layer(
    node: onnx.NodeProto,
    layers: list[Layer],
    reasons: dict[str, str],
    initializers: Mapping[str, onnx.TensorProto],
    shapes: dict[str, tuple[int, ...]],
    depth: int,
) -> None:
    """Appends an LSTM or GRU with constant weights to ``layers`` (``autotune.model.recurrent``), else the reason."""
    x_shape = _shape_of(shapes, node.input[0])
    found = recurrent_weights(node, initializers, x_shape)
    if isinstance(found, str):
        reasons[node.name] = found
        return
    output = next(name for name in node.output if name)
    layers.append(
        Layer(
            name=node.name,
            op_type=node.op_type,
            index=len(layers),
            activation_inputs=(),  # its INT8 form quantizes them at run time
            weight=found.weight,
            weight_axis=1,  # the gate rows of [directions, gates * hidden, input]
            bias=found.bias,
            output=output,
            input_shapes=(x_shape,),
            output_shape=_shape_of(shapes, output),
            macs=found.macs,
            params=found.params,
            depth=depth,
            nodes=(node.name,),
            weight_source=INITIALIZER,
        )
    )
