"""Model intake: weights that other exporters compute from constants become initializers, and why an op is no layer.

Several exporters and converters write every weight as the output of a ``Constant`` node (some with a
``Transpose``, ``Reshape``, ``Cast``, ``Squeeze`` or ``Identity`` after it) instead of an initializer. ONNX Runtime
folds these into initializers when it loads the model, so such a model runs everywhere; the layer table, the
calibration and the rewrite read weights as initializers, so intake folds them first, the way ONNX Runtime would.

Only chains that feed a weighted op (``autotune.model.optypes.WEIGHTED_OP_TYPES``) and whose every input is constant are
folded, and the rest of the graph is left as it is: ONNX Runtime's graph optimizers would fold these too, but they
also fuse Conv+BatchNorm and others, which would change the layer table of ordinary models. ONNX ships no pass that
folds constants alone (``onnx.optimizer`` left onnx in 1.9), so the selection is written here and the values are
computed by onnx's reference implementation (``onnx.reference.ReferenceEvaluator``), which knows every attribute form
of ``Constant`` and every op of the chain. A model that needs no folding is not touched at all: its bytes, and so its
hash, stay what they were.

What is still no layer after that gets a reason (``weight_slot``), and a model without any layer gets one line that
counts the candidates per op type and per cause and says what to do (``no_layer_message``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autotune.model.layer_units import GraphIndex
from autotune.model.optypes import CONV_OP_TYPES, WEIGHTED_OP_TYPES

FOLDABLE_OP_TYPES: tuple[str, ...] = ("Identity", "Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze")
"""Ops that intake folds when every input is constant: they move or retype a weight, never compute a new one."""

INITIALIZER = "initializer"
"""The weight source of a weight that was an initializer in the file."""

_DEFAULT_DOMAINS = ("", "ai.onnx")


def fold_weight_constants(model: onnx.ModelProto) -> dict[str, str]:
    """Turns every constant chain that feeds a weighted op's input into an initializer, in place.

    A chain is a ``Constant`` node or an initializer, then any number of ``FOLDABLE_OP_TYPES`` whose every input is
    itself constant. Its output becomes an initializer of the same name, and its nodes are removed where nothing else
    reads them. A chain whose evaluation fails is left as it is (the layer table then says why its op is no layer).

    Args:
        model: The model as loaded; it is changed only where a chain was folded.

    Returns:
        Each folded tensor's source: the op types of its chain along the data input, e.g. ``Constant+Transpose``
        (``initializer+Cast`` for a chain from an initializer). Empty where nothing was folded.
    """
    graph = model.graph
    producers = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    initializers = {init.name: init for init in graph.initializer}
    graph_outputs = {value.name for value in graph.output}
    folded: dict[str, str] = {}
    removable: set[int] = set()
    for name in _weight_inputs(graph):
        if name in initializers or name in folded or name in graph_outputs:
            continue
        chain = _constant_chain(name, graph, producers, initializers)
        # An initializer through Identities alone is how the torch exporter routes a module's second call to the
        # same weight: that call stays no layer of its own (one static scale calibrated on the first call would
        # clip the second's input; tests/backends/torch/test_binding.py).
        if not chain or all(graph.node[index].op_type == "Identity" for index in chain):
            continue
        tensor = _evaluate(model, chain, name, initializers)
        if tensor is None:
            continue
        graph.initializer.append(tensor)
        initializers[name] = tensor
        if model.ir_version < 4:  # before IR 4 every initializer must also be a graph input
            graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
        folded[name] = _source(name, graph, producers, initializers)
        removable.update(chain)
    if folded:
        _remove_unread(graph, removable, set(folded))
    return folded


def _weight_inputs(graph: onnx.GraphProto) -> Iterator[str]:
    """The data, weight and bias inputs of every weighted op (a MatMul's weight may come first)."""
    for node in graph.node:
        if node.op_type in WEIGHTED_OP_TYPES and node.domain in _DEFAULT_DOMAINS:
            yield from (name for name in node.input[:3] if name)


def _constant_chain(
    name: str, graph: onnx.GraphProto, producers: dict[str, int], initializers: dict[str, onnx.TensorProto]
) -> list[int] | None:
    """The indices of the nodes that compute ``name`` from constants alone, in graph order.

    None where anything else feeds it (a graph input, an op that is not foldable); empty for an initializer.
    """
    if name in initializers:
        return []
    index = producers.get(name)
    if index is None:
        return None
    node = graph.node[index]
    if node.domain not in _DEFAULT_DOMAINS:
        return None
    if node.op_type == "Constant":
        return [index]
    if node.op_type not in FOLDABLE_OP_TYPES:
        return None
    chain = {index}
    for source in node.input:
        if not source:
            continue
        upstream = _constant_chain(source, graph, producers, initializers)
        if upstream is None:
            return None
        chain.update(upstream)
    return sorted(chain)


def _evaluate(
    model: onnx.ModelProto, chain: list[int], name: str, initializers: dict[str, onnx.TensorProto]
) -> onnx.TensorProto | None:
    """The initializer ``name`` computed by onnx's reference implementation, or None where it cannot run the chain."""
    from onnx.reference import ReferenceEvaluator  # a second or so to import: only for a model that needs it

    nodes = [model.graph.node[index] for index in chain]
    read = {source for node in nodes for source in node.input}
    graph = helper.make_graph(
        nodes,
        "fold",
        [],
        [helper.make_empty_tensor_value_info(name)],
        [initializers[source] for source in sorted(read) if source in initializers],
    )
    fold = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        (value,) = ReferenceEvaluator(fold).run(None, {})
        return numpy_helper.from_array(np.asarray(value), name)
    except Exception:  # noqa: BLE001 - any failure leaves the chain unfolded; the layer table reports the op
        return None


def _source(
    name: str, graph: onnx.GraphProto, producers: dict[str, int], initializers: dict[str, onnx.TensorProto]
) -> str:
    """The op types from the chain's root to ``name`` along each node's first input, joined by ``+``."""
    op_types: list[str] = []
    index = producers.get(name)
    while index is not None:
        node = graph.node[index]
        op_types.append(node.op_type)
        if node.op_type == "Constant":
            break
        source = node.input[0]
        if source in initializers and source not in producers:
            op_types.append(INITIALIZER)
            break
        index = producers.get(source)
    return "+".join(reversed(op_types))


def _remove_unread(graph: onnx.GraphProto, removable: set[int], folded: set[str]) -> None:
    """Removes the chain nodes whose outputs nothing reads any more (a folded tensor's producer always goes)."""
    removed: set[int] = set()
    changed = True
    while changed:  # removing a node may leave its own inputs' producers unread
        changed = False
        read = _names_read(graph, removed)
        outputs = {value.name for value in graph.output}
        for index in sorted(removable - removed, reverse=True):
            node_outputs = [name for name in graph.node[index].output if name]
            if any(name in folded for name in node_outputs) or not any(
                name in read or name in outputs for name in node_outputs
            ):
                removed.add(index)
                changed = True
    kept = [node for index, node in enumerate(graph.node) if index not in removed]
    del graph.node[:]
    graph.node.extend(kept)


def _names_read(graph: onnx.GraphProto, removed: set[int]) -> set[str]:
    """Every tensor the graph's remaining nodes read, inside their subgraphs too (a subgraph may read outer names)."""
    read: set[str] = set()
    for index, node in enumerate(graph.node):
        if index not in removed:
            read.update(_node_reads(node))
    return read


def _node_reads(node: onnx.NodeProto) -> set[str]:
    read = {name for name in node.input if name}
    for attribute in node.attribute:
        subgraphs = [attribute.g] if attribute.HasField("g") else list(attribute.graphs)
        for subgraph in subgraphs:
            for inner in subgraph.node:
                read.update(_node_reads(inner))
    return read


@dataclass(frozen=True)
class Rejection:
    """Why a weighted op is no layer.

    Attributes:
        cause: One of ``_FIXES``; the no-layer message counts the ops per cause.
        kind: What it was where that helps (the op that computes the weight, the weight's dtype), or "".
        detail: The reason ``autotune inspect`` lists for the node.
    """

    cause: str
    kind: str
    detail: str


_FROM_INPUT = "weight from a graph input"
_FROM_NODE = "weight computed by a node, not a constant"
_DTYPE = "weight of an unsupported dtype"
_ACTIVATIONS = "both inputs are activations"
_WEIGHT_FIRST = "a Gemm with the weight first (W @ x)"
_FIXES = {
    _FROM_INPUT: "store the weights in the model (initializers or Constant nodes), not as graph inputs",
    _FROM_NODE: "make the weights constants (fold the graph's constants, e.g. with onnxsim) or tune the float model "
    "from before any quantization",
    _DTYPE: "autotune quantizes float32 weights: export the model in float32",
    _ACTIVATIONS: "model.include_activation_matmuls: true tunes MatMuls of two activations",
    _WEIGHT_FIRST: "",
}
"""Each cause of a rejection, with what the user can do about it (nothing, for a Gemm with the weight first)."""


def _not_constant(name: str, index: GraphIndex) -> Rejection:
    """The rejection of a weight that is no initializer (after intake folded what it could)."""
    producer = index.producer.get(name)
    if producer is None:
        return Rejection(_FROM_INPUT, "", f"its weight {name!r} is a graph input, not a constant")
    node = index.graph.node[producer]
    return Rejection(_FROM_NODE, node.op_type, f"its weight {name!r} comes from {node.op_type} {node.name!r}")


def weight_slot(node: onnx.NodeProto, index: GraphIndex, include_activation_matmuls: bool) -> int | None | Rejection:
    """The input slot of a weighted op's weight (None: activation x activation MatMul), or why it is no layer."""
    initializers = index.initializers
    data_inputs = list(node.input[:2])
    weight_index = next((i for i, name in enumerate(data_inputs) if name in initializers), None)
    if weight_index is None and node.op_type == "MatMul":
        if include_activation_matmuls:
            return None
        return Rejection(_ACTIVATIONS, "", "both inputs are activations (model.include_activation_matmuls tunes these)")
    if weight_index is None or (node.op_type in CONV_OP_TYPES and weight_index != 1):
        return _not_constant(data_inputs[1] if len(data_inputs) > 1 else "", index)
    if node.op_type == "Gemm" and weight_index == 0:
        return Rejection(_WEIGHT_FIRST, "", "a Gemm with the weight first (W @ x) stays FP32")
    weight = initializers[data_inputs[weight_index]]
    if weight.data_type != onnx.TensorProto.FLOAT:
        dtype = onnx.TensorProto.DataType.Name(weight.data_type).lower()
        return Rejection(_DTYPE, dtype, f"its weight {weight.name!r} is {dtype}; autotune quantizes float32 weights")
    return weight_index


def no_layer_message(model: onnx.ModelProto, path: Path, include_activation_matmuls: bool = False) -> str:
    """The one line that says why a model has no tunable layer: the candidates per op type, each cause, the fixes."""
    graph = model.graph
    candidates = [node for node in graph.node if node.op_type in WEIGHTED_OP_TYPES]
    if not candidates:
        return (
            f"{path} has no tunable layer: it has no {', '.join(WEIGHTED_OP_TYPES[:-1])} or {WEIGHTED_OP_TYPES[-1]} "
            f"node; there is nothing to tune"
        )
    index = GraphIndex(graph)
    counts: dict[str, Counter[str]] = {}
    kinds: dict[str, set[str]] = {}
    for node in candidates:
        rejection = weight_slot(node, index, include_activation_matmuls)
        if isinstance(rejection, Rejection):
            counts.setdefault(rejection.cause, Counter())[node.op_type] += 1
            kinds.setdefault(rejection.cause, set()).update([rejection.kind] if rejection.kind else [])
    found = _per_op_type(Counter(node.op_type for node in candidates))
    causes = "; ".join(
        f"{_per_op_type(counts[cause])}: {cause}" + (f" ({', '.join(sorted(kinds[cause]))})" if kinds[cause] else "")
        for cause in counts
    )
    fixes = "; ".join(_FIXES[cause] for cause in counts if _FIXES[cause])
    return (
        f"{path} has no tunable layer, there is nothing to tune: found {found}, none with a constant float32 weight "
        f"({causes})" + (f"; to tune them, {fixes}" if fixes else "")
    )


def _per_op_type(counts: Counter[str]) -> str:
    """``38 Conv, 13 MatMul``: the counts in the table's op type order."""
    return ", ".join(f"{counts[op_type]} {op_type}" for op_type in WEIGHTED_OP_TYPES if counts[op_type])
