"""Editing one copied ONNX graph: fresh names, new initializers, nodes spliced in order, opset upgrades.

The lowering (``autotune.quant.rewrite``) decides what to write; this module only writes it, so every edit keeps
the graph valid: names never collide, new nodes land before or after the node they belong to (the graph stays in
topological order), and initializers nothing reads any more are dropped at the end.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, defs, helper, numpy_helper, version_converter

from autotune.model.layer_units import GraphIndex
from autotune.model.layers import Layer

_DEFAULT_DOMAINS = ("", "ai.onnx")


class RewriteError(ValueError):
    """The plan cannot be written into the model; the message names the layer or tensor and the fix."""


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (0 when it imports none)."""
    return next((op.version for op in model.opset_import if op.domain in _DEFAULT_DOMAINS), 0)


def ensure_opset(model: onnx.ModelProto, needed: int) -> onnx.ModelProto:
    """Raises the default-domain opset to ``needed``, converting ops whose definition changed in between.

    Bumping the number alone is only safe when no op in the graph got a new version (e.g. Squeeze moved
    ``axes`` to an input in 13), so such graphs go through ONNX's version converter.
    """
    current = default_opset(model)
    if current >= needed:
        return model
    changed = set()
    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        try:
            if defs.get_schema(node.op_type, needed, "").since_version > current:
                changed.add(node.op_type)
        except defs.SchemaError:
            changed.add(node.op_type)
    if changed:
        try:
            model = version_converter.convert_version(model, needed)
        except Exception as error:  # noqa: BLE001 - the converter raises several types
            raise RewriteError(
                f"the plan needs opset {needed} but the model has opset {current} and ops {sorted(changed)} "
                f"could not be converted ({error}); re-export the model at opset >= {needed}"
            ) from error
    else:
        entry = next((op for op in model.opset_import if op.domain in _DEFAULT_DOMAINS), None)
        if entry is None:
            entry = model.opset_import.add()
            entry.domain = ""
        entry.version = needed
    model.ir_version = max(
        model.ir_version, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    )
    return model


class GraphEditor:
    """Edits one (copied) model in place; new nodes are collected per position and spliced in by ``finish``.

    Args:
        model: The model to edit (a copy the caller owns).
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.index = GraphIndex(self.graph)  # of the graph as it came: the edits below keep every original name
        self.inits = {init.name: init for init in self.graph.initializer}
        self.node_index = {node.name: i for i, node in enumerate(self.graph.node) if node.name}
        self.taken = {name for node in self.graph.node for name in (*node.input, *node.output, node.name)}
        self.taken |= {v.name for v in (*self.graph.input, *self.graph.output, *self.graph.value_info)}
        self.taken |= set(self.inits)
        self.prologue: list[onnx.NodeProto] = []
        self.before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.after: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.replaced: set[str] = set()

    def fresh(self, base: str) -> str:
        """A tensor or node name not used anywhere in the graph yet."""
        name, suffix = base, 1
        while name in self.taken:
            name, suffix = f"{base}_{suffix}", suffix + 1
        self.taken.add(name)
        return name

    def add_init(self, base: str, array: np.ndarray) -> str:
        """Adds ``array`` as a new initializer and returns its (unique) name."""
        name = self.fresh(base)
        tensor = numpy_helper.from_array(np.asarray(array), name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def float_init(self, name: str, layer: Layer) -> np.ndarray:
        """The float32 initializer ``name`` as an array, or RewriteError."""
        init = self.inits.get(name)
        if init is None or init.data_type != TensorProto.FLOAT:
            raise RewriteError(f"layer {layer.name!r}: {name!r} is not a float32 initializer in the model")
        return numpy_helper.to_array(init)

    def node_of(self, layer: Layer) -> tuple[int, onnx.NodeProto]:
        """The node of ``layer`` and its index, checked against the layer table."""
        index = self.node_index.get(layer.name)
        if index is None:
            raise RewriteError(f"layer {layer.name!r} is not a node of the model; rebuild the layer table")
        node = self.graph.node[index]
        if node.op_type != layer.op_type:
            raise RewriteError(f"layer {layer.name!r} is a {node.op_type} in the model, not a {layer.op_type}")
        return index, node

    def qdq(self, out: list[onnx.NodeProto], src: str, dst: str, scale: str, zero: str, tag: str) -> None:
        """Appends ``QuantizeLinear(src) -> DequantizeLinear -> dst`` to ``out``."""
        quantized = self.fresh(f"{src}__q__{tag}")
        out.append(helper.make_node("QuantizeLinear", [src, scale, zero], [quantized], self.fresh(f"{tag}__{src}__Q")))
        out.append(
            helper.make_node("DequantizeLinear", [quantized, scale, zero], [dst], self.fresh(f"{tag}__{src}__DQ"))
        )

    def rename_output(self, index: int, tensor: str, suffix: str) -> str:
        """Makes node ``index`` write a new tensor instead of ``tensor``; the caller then writes ``tensor``.

        Downstream nodes and graph outputs keep their names this way, so nothing else needs rewiring.
        """
        node = self.graph.node[index]
        new = self.fresh(f"{tensor}__{suffix}")
        for slot, name in enumerate(node.output):
            if name == tensor:
                node.output[slot] = new
        return new

    @staticmethod
    def redirect(node: onnx.NodeProto, old: str, new: str) -> None:
        """Points only this node's inputs named ``old`` at ``new``."""
        for slot, name in enumerate(node.input):
            if name == old:
                node.input[slot] = new

    def finish(self) -> None:
        """Splices the new nodes in topological order and drops float initializers nothing reads any more."""
        ordered = list(self.prologue)
        for index, node in enumerate(self.graph.node):
            ordered.extend(self.before.get(index, []))
            ordered.append(copy.deepcopy(node))
            ordered.extend(self.after.get(index, []))
        self.graph.ClearField("node")
        self.graph.node.extend(ordered)
        used = _used_names(self.graph)
        unused = {name for name in self.replaced if name not in used}
        if unused:
            kept = [init for init in self.graph.initializer if init.name not in unused]
            self.graph.ClearField("initializer")
            self.graph.initializer.extend(kept)
            # Old IR versions list initializers as graph inputs too; drop the input with the initializer.
            inputs = [value for value in self.graph.input if value.name not in unused]
            self.graph.ClearField("input")
            self.graph.input.extend(inputs)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name read by a node or a graph output (subgraphs too: they may capture outer tensors)."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            subgraphs = [*attribute.graphs, attribute.g] if attribute.HasField("g") else list(attribute.graphs)
            for subgraph in subgraphs:
                used |= _used_names(subgraph)
    return used
