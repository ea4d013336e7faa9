"""TensorRT's rules for explicitly quantized ONNX graphs, checked before a build. Pure: needs only ``onnx``.

TensorRT 11 is strongly typed and has no calibrators or precision flags: every quantized layer must arrive as
Q/DQ nodes it accepts. A graph that breaks a rule either fails deep inside the builder with a terse message or,
worse, builds with the layer silently left in float. Checking here turns both into a clear error that names the
node and the rule (sources: TensorRT ``IQuantizeLayer``/``IDequantizeLayer`` docs, onnx-tensorrt operators.md;
see the TensorRT developer guide, "Explicit Quantization"):

- zero points are all 0 (symmetric only) and of type INT8, FLOAT8E4M3FN or INT4 (no UINT8, no INT32 biases);
- scales are build-time constants, finite and strictly positive;
- a scale with more than one value (per-channel) is allowed on weights only, never on activations;
- in a strongly typed network a QuantizeLinear scale is FLOAT or the type of its input (FP16/BF16 must match);
- QuantizeLinear feeds only DequantizeLinear, and DequantizeLinear feeds an op TensorRT can fuse with or move
  the dequantization across;
- an op that joins tensors (Add, Mul, Concat) with one dequantized input has all of them dequantized: TensorRT
  fuses a residual Add into the convolution before it only with Q/DQ on both inputs, and otherwise runs it in
  float behind a standalone dequantize.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from autotune.model.optypes import WEIGHTED_OP_TYPES

FLOAT_TYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
"""Types a QuantizeLinear may read and a DequantizeLinear may write."""

QUANTIZED_TYPES = {TensorProto.INT8: "int8", TensorProto.FLOAT8E4M3FN: "fp8", TensorProto.INT4: "int4"}
"""Types TensorRT quantizes to (zero-point types), with the precision name each stands for."""

SUPPORTED_DQ_CONSUMERS = frozenset(
    {
        # Weighted ops: TensorRT fuses DQ(activation) + DQ(weight) into one quantized kernel.
        *WEIGHTED_OP_TYPES,
        # Ops with INT8 implementations or that fuse into a quantized kernel (residual Add, BN, clip).
        "Add",
        "Mul",
        "AveragePool",
        "GlobalAveragePool",
        "MaxPool",
        "GlobalMaxPool",
        "BatchNormalization",
        "Clip",
        "Relu",
        # Ops that commute with quantization: TensorRT moves the DQ across them toward the next weighted op.
        "Concat",
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Pad",
        "Resize",
        "Identity",
    }
)
"""Ops a DequantizeLinear may feed; anything else leaves a standalone dequantize that runs in float."""

_HALF_TYPES = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}


class QDQError(ValueError):
    """The graph's Q/DQ nodes break TensorRT's rules; the message lists every problem with its node."""


class _Graph:
    """Lookups over one graph: producers, consumers, constants and element types."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.initializers = {init.name: init for init in graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in dict.fromkeys(node.input):
                if name:
                    self.consumers[name].append(node)
        self.graph_outputs = {value.name for value in graph.output}
        self.graph_inputs = {value.name for value in graph.input} - set(self.initializers)
        self._types = _declared_types(model)
        self._inferred = False
        self._constant: dict[str, bool] = {}

    def array(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node output, or None when it is computed."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
        return None

    def is_constant(self, name: str) -> bool:
        """Whether a tensor is known at build time: an initializer, a Constant, or computed only from those."""
        if name in self._constant:
            return self._constant[name]
        self._constant[name] = False  # a cycle cannot be constant; also guards the recursion
        if name in self.initializers:
            result = True
        elif name in self.graph_inputs or name not in self.producer:
            result = False
        else:
            node = self.producer[name]
            inputs = [i for i in node.input if i]
            result = node.op_type == "Constant" or (bool(inputs) and all(self.is_constant(i) for i in inputs))
        self._constant[name] = result
        return result

    def elem_type(self, name: str) -> int | None:
        """The ONNX element type of a tensor, where known."""
        if name in self.initializers:
            return self.initializers[name].data_type
        if name not in self._types and not self._inferred:
            # Shape inference copies the whole model (weights too), so it runs only when a type is not declared.
            self._inferred = True
            try:
                self._types = {**_declared_types(shape_inference.infer_shapes(self.model)), **self._types}
            except Exception:  # noqa: BLE001 - inference is best effort; unknown types skip the type rules
                pass
        return self._types.get(name)


def _declared_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types the graph states: inputs, outputs, value_info, Cast outputs and Constant values."""
    types: dict[str, int] = {}
    for value in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output:
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to is not None:
                types[node.output[0]] = to
        elif node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                types[node.output[0]] = value.data_type
    return types


def _attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _type_name(elem_type: int | None) -> str:
    return TensorProto.DataType.Name(elem_type) if elem_type else "unknown"


def _quantized_type(graph: _Graph, node: onnx.NodeProto) -> int | None:
    """The low-precision type of a Q's output or a DQ's input: the zero point's type, else what is known."""
    if len(node.input) > 2 and node.input[2]:
        return graph.elem_type(node.input[2])
    if node.op_type == "QuantizeLinear":
        # Without a zero point, ONNX QuantizeLinear outputs uint8 unless opset 21's output_dtype says otherwise.
        return int(_attribute(node, "output_dtype", 0)) or TensorProto.UINT8
    return graph.elem_type(node.input[0])


def _scale_problems(graph: _Graph, node: onnx.NodeProto, quantized_type: int | None) -> list[str]:
    """Constant, finite, strictly positive, float, and per-channel only on weights."""
    problems = []
    scale_name = node.input[1] if len(node.input) > 1 else ""
    if not scale_name or not graph.is_constant(scale_name):
        return [f"scale {scale_name!r} is computed at run time; TensorRT needs a build-time constant scale"]
    scale_type = graph.elem_type(scale_name)
    if scale_type is not None and scale_type not in FLOAT_TYPES:
        problems.append(f"scale {scale_name!r} is {_type_name(scale_type)}; it must be FLOAT, FLOAT16 or BFLOAT16")
    scale = graph.array(scale_name)
    if scale is None:
        return problems  # computed from constants: TensorRT folds it; its values cannot be checked here
    values = scale.astype(np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)) or not np.all(values > 0):
        bad = values[~(np.isfinite(values) & (values > 0))] if values.size else values
        problems.append(
            f"scale {scale_name!r} has values that are not finite and strictly positive ({bad.ravel()[:4].tolist()}); "
            f"TensorRT rejects zero, negative and non-finite scales"
        )
    data = node.input[0]
    block = scale.ndim >= 2 or _attribute(node, "block_size", 0)
    if block and quantized_type == TensorProto.INT8:
        problems.append(
            f"scale {scale_name!r} has shape {list(scale.shape)} (block quantization); TensorRT allows blocks "
            f"only for FP8/INT4/FP4, INT8 scales are per-tensor or per-channel"
        )
    elif scale.size > 1 and not graph.is_constant(data):
        problems.append(
            f"scale {scale_name!r} has {scale.size} values (per-channel) on activation {data!r}; TensorRT allows "
            f"per-channel scales on weights only, activations need one per-tensor scale"
        )
    elif scale.ndim == 1 and scale.size > 1:
        weight = graph.array(data) if data in graph.initializers else None
        axis = int(_attribute(node, "axis", 1))
        if weight is not None and weight.ndim and weight.shape[axis % weight.ndim] != scale.size:
            problems.append(
                f"per-channel scale {scale_name!r} has {scale.size} values but weight {data!r} has "
                f"{weight.shape[axis % weight.ndim]} channels on axis {axis}"
            )
    return problems


def _zero_point_problems(graph: _Graph, node: onnx.NodeProto, quantized_type: int | None) -> list[str]:
    """Symmetric (all zeros) and of a type TensorRT quantizes to."""
    problems = []
    if quantized_type not in QUANTIZED_TYPES:
        hint = " (asymmetric uint8 is ONNX Runtime's CPU recipe)" if quantized_type == TensorProto.UINT8 else ""
        if quantized_type == TensorProto.INT32:
            hint = " (an int32 quantized bias: keep biases float for TensorRT)"
        problems.append(
            f"quantized type is {_type_name(quantized_type)}{hint}; TensorRT quantizes to INT8, FLOAT8E4M3FN or INT4 "
            f"with a zero point of that type"
        )
    if len(node.input) > 2 and node.input[2]:
        zero = graph.array(node.input[2])
        if zero is None:
            problems.append(f"zero point {node.input[2]!r} is not a constant; TensorRT needs constant zeros")
        elif np.any(zero.astype(np.float32) != 0):
            problems.append(
                f"zero point {node.input[2]!r} is not all zeros ({zero.ravel()[:4].tolist()}); TensorRT supports "
                f"symmetric quantization only (zero point 0)"
            )
    return problems


def _quantize_problems(graph: _Graph, node: onnx.NodeProto) -> list[str]:
    problems = []
    quantized_type = _quantized_type(graph, node)
    input_type = graph.elem_type(node.input[0])
    if input_type is not None and input_type not in FLOAT_TYPES:
        problems.append(f"input {node.input[0]!r} is {_type_name(input_type)}; TensorRT quantizes FP32/FP16/BF16 only")
    scale_type = graph.elem_type(node.input[1]) if len(node.input) > 1 else None
    if scale_type in _HALF_TYPES and input_type is not None and scale_type != input_type:
        problems.append(
            f"scale {node.input[1]!r} is {_type_name(scale_type)} but the input {node.input[0]!r} is "
            f"{_type_name(input_type)}; in a strongly typed network the scale is FLOAT or the input's type"
        )
    problems += _scale_problems(graph, node, quantized_type)
    problems += _zero_point_problems(graph, node, quantized_type)
    for output in node.output:
        if output in graph.graph_outputs:
            problems.append(f"its output {output!r} is a graph output; a quantized tensor must feed a DequantizeLinear")
        for consumer in graph.consumers.get(output, []):
            if consumer.op_type != "DequantizeLinear":
                problems.append(
                    f"feeds {consumer.op_type} {consumer.name!r}; a QuantizeLinear must feed DequantizeLinear only"
                )
    return problems


def _dequantize_problems(graph: _Graph, node: onnx.NodeProto) -> list[str]:
    problems = []
    quantized_type = _quantized_type(graph, node)
    problems += _scale_problems(graph, node, quantized_type)
    problems += _zero_point_problems(graph, node, quantized_type)
    for output in node.output:
        if output in graph.graph_outputs:
            problems.append(f"its output {output!r} is a graph output; nothing can fuse the dequantization")
        for consumer in graph.consumers.get(output, []):
            if consumer.op_type not in SUPPORTED_DQ_CONSUMERS:
                problems.append(
                    f"feeds {consumer.op_type} {consumer.name!r}, which TensorRT cannot fuse with or move a "
                    f"dequantization across; put Q/DQ only before Conv/ConvTranspose/Gemm/MatMul, Add, pooling "
                    f"or data-movement ops"
                )
    return problems


JOINING_OPS = ("Add", "Mul", "Concat")
"""Ops that join tensors: quantized on one input, they must be quantized on all (see the module docstring)."""


def _joining_problems(graph: _Graph, node: onnx.NodeProto) -> list[str]:
    """A joining op that reads a dequantized input next to a float, non-constant one."""
    inputs = [name for name in dict.fromkeys(node.input) if name and not graph.is_constant(name)]
    dequantized = [name for name in inputs if getattr(graph.producer.get(name), "op_type", "") == "DequantizeLinear"]
    floats = [name for name in inputs if name not in dequantized]
    if not dequantized or not floats:
        return []
    return [
        f"reads dequantized {dequantized[0]!r} and float {floats[0]!r}; TensorRT runs it in float behind a "
        f"standalone dequantize and cannot fuse it into the layer before it: put a Q/DQ pair on every input "
        f"(both inputs of a residual Add)"
    ]


def qdq_problems(model: onnx.ModelProto) -> list[str]:
    """Every way the model's Q/DQ nodes break TensorRT's rules, one line each naming the node.

    Args:
        model: An explicitly typed ONNX model (as ``autotune.quant.rewrite`` writes it).

    Returns:
        Problems such as ``"QuantizeLinear 'q1': zero point 'zp' is not all zeros ..."``; empty when the
        graph fits TensorRT.
    """
    if not any(node.op_type in ("QuantizeLinear", "DequantizeLinear") for node in model.graph.node):
        return []
    graph = _Graph(model)
    problems = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "QuantizeLinear":
            found = _quantize_problems(graph, node)
        elif node.op_type == "DequantizeLinear":
            found = _dequantize_problems(graph, node)
        elif node.op_type in JOINING_OPS:
            found = _joining_problems(graph, node)
        else:
            continue
        problems += [f"{node.op_type} {node.name!r}: {problem}" for problem in found]
    return problems


def check_qdq(model: onnx.ModelProto) -> None:
    """Raises when the model's Q/DQ nodes break TensorRT's rules.

    Raises:
        QDQError: With every problem, one per line.
    """
    problems = qdq_problems(model)
    if problems:
        raise QDQError("the Q/DQ graph does not fit TensorRT:\n  - " + "\n  - ".join(problems))


def _input_precision(graph: _Graph, name: str) -> str | None:
    """An input's precision: int8/fp8 behind a DQ, fp16/bf16 behind a Cast or a low-precision initializer."""
    producer = graph.producer.get(name)
    if producer is not None and producer.op_type == "DequantizeLinear":
        return QUANTIZED_TYPES.get(_quantized_type(graph, producer) or 0, "int8")
    elem_type = graph.elem_type(name)
    return _HALF_TYPES.get(elem_type or 0)


def requested_precisions(model: onnx.ModelProto, node_names: Iterable[str] | None = None) -> dict[str, str]:
    """The precision the typed graph asks for at each compute node (Conv, ConvTranspose, Gemm, MatMul).

    The typed model is the record of the plan: ``rewrite`` gives an int8/fp8 layer dedicated DQ inputs and an
    fp16/bf16 layer Cast inputs and low-precision weights; every other compute node is fp32.

    Args:
        model: The typed model.
        node_names: Only these nodes (default: every compute node).

    Returns:
        Node name to ``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp8`` or ``int4``.
    """
    graph = _Graph(model)
    wanted = set(node_names) if node_names is not None else None
    requested: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OP_TYPES or (wanted is not None and node.name not in wanted):
            continue
        found = [_input_precision(graph, name) for name in node.input[:2] if name]
        precisions = [p for p in found if p is not None]
        # A quantized input decides: the weighted kernel runs in int8/fp8 even if one side were float.
        requested[node.name] = next((p for p in precisions if p in ("int8", "fp8", "int4")), None) or (
            precisions[0] if precisions else "fp32"
        )
    return requested
