"""Layer units: which nodes one precision decision covers, and which tensors can stay INT8 between layers.

The layer table (``autotune.model.layers``) and the lowering (``autotune.quant.rewrite``) both read the graph through
:class:`GraphIndex`, so what ``autotune inspect`` shows as one layer is exactly what a plan quantizes as one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autotune.model.optypes import ACTIVATION_GATES, FOLDED_ACTIVATIONS, VALUE_PRESERVING_OP_TYPES

_DEFAULT_DOMAINS = ("", "ai.onnx")

_PAD_READERS = ("Conv", "AveragePool")
"""Readers a zero Pad folds into (ONNX Runtime's PadFusion; a Pad before a MatMul would block its integer kernel)."""


def attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    """A node attribute's value (strings as ``str``), or ``default``."""
    for item in node.attribute:
        if item.name == name:
            value = helper.get_attribute_value(item)
            return value.decode() if isinstance(value, bytes) else value
    return default


class GraphIndex:
    """Producers, readers and constant values of one graph (built once; the graph must not change after).

    Args:
        graph: The graph, in topological order as ONNX requires.
    """

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = defaultdict(list)
        for index, node in enumerate(graph.node):
            for name in node.output:
                if name:
                    self.producer[name] = index
            for name in dict.fromkeys(node.input):  # a node reading a tensor twice counts once
                if name:
                    self.readers[name].append(index)
        self.outputs = {value.name for value in graph.output}
        self.initializers = {init.name: init for init in graph.initializer}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or of a Constant node's output; None for anything computed."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        index = self.producer.get(name)
        if index is not None and self.graph.node[index].op_type == "Constant":
            value = attribute(self.graph.node[index], "value")
            return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else None
        return None

    def sole_reader(self, tensor: str) -> int | None:
        """The only node reading ``tensor``, or None (also for a graph output: its value is the model's)."""
        readers = self.readers.get(tensor, [])
        return readers[0] if len(readers) == 1 and tensor not in self.outputs else None

    def output_tail(self, tensor: str) -> tuple[int, ...]:
        """The activation that alone reads ``tensor``, as its nodes in graph order: it joins the layer writing it.

        A Relu, Clip or HardSwish that is the only reader of ``tensor``, or a gated activation: ``Mul(x, gate(x))``
        with a Sigmoid (SiLU) or HardSigmoid (HardSwish) gate, where the gate and the Mul are the only readers of
        ``tensor`` and the Mul the only reader of the gate (in either input order). Empty where there is none.

        Runtimes run such an activation with its producer (fused into its kernel, or between its Q/DQ pairs), so
        it is part of that layer's choice rather than a layer of its own; where the layer's quantized output goes
        then is the lowering's (``autotune.quant.placement.output_pairs``). For a Relu or Clip, quantizing after it
        costs nothing (a saturating range does what it does), while quantizing before it would spend the levels on
        values it throws away (a ReLU6's input spans [-30, 25] where its output spans [0, 6]).
        """
        reader = self.sole_reader(tensor)
        if reader is not None:
            node = self.graph.node[reader]
            return (reader,) if node.op_type in FOLDED_ACTIVATIONS and node.domain in _DEFAULT_DOMAINS else ()
        readers = self.readers.get(tensor, [])
        if len(readers) != 2 or tensor in self.outputs:
            return ()
        gate, mul = (self.graph.node[i] for i in readers)  # graph order: the Mul reads the gate, so comes after it
        gated = gate.op_type in ACTIVATION_GATES and list(gate.input) == [tensor] and len(gate.output) == 1
        gated &= mul.op_type == "Mul" and sorted(mul.input) == sorted([tensor, gate.output[0]])
        gated &= gate.domain in _DEFAULT_DOMAINS and mul.domain in _DEFAULT_DOMAINS
        return tuple(readers) if gated and self.sole_reader(gate.output[0]) == readers[1] else ()

    def unit_output(self, index: int) -> str:
        """The tensor a layer at node ``index`` writes: its output tail's output, or its own."""
        output = self.graph.node[index].output[0]
        tail = self.output_tail(output)
        return self.graph.node[tail[-1]].output[0] if tail else output

    def zero_pad(self, index: int) -> bool:
        """Whether node ``index`` pads with zeros only (mode ``constant``, value 0 or absent)."""
        node = self.graph.node[index]
        if node.op_type != "Pad" or node.domain not in _DEFAULT_DOMAINS:
            return False
        if attribute(node, "mode", "constant") != "constant":
            return False
        if len(node.input) > 2 and node.input[2]:
            value = self.constant(node.input[2])
            return value is not None and not np.any(value)
        return not attribute(node, "value", 0.0)  # opsets before 11 hold the value as an attribute

    def exclusive_pad(self, tensor: str, reader: int) -> int | None:
        """The zero ``Pad`` that writes ``tensor`` when node ``reader`` alone reads it: part of that reader's unit.

        Zero is exact in every quantized grid, so quantizing before the Pad is the same as after it, and the
        backend then folds the Pad into the convolution (ONNX Runtime's PadFusion needs Pad -> Conv adjacent).
        """
        index = self.producer.get(tensor)
        if index is None or self.sole_reader(tensor) != reader or self.graph.node[reader].op_type not in _PAD_READERS:
            return None
        return index if self.zero_pad(index) else None

    def value_preserving(self, index: int) -> bool:
        """Whether node ``index`` only moves, selects or zero-pads its first input's values (a grid stays exact)."""
        node = self.graph.node[index]
        if node.domain not in _DEFAULT_DOMAINS or not node.input or not node.input[0]:
            return False
        if node.op_type == "Resize":
            return attribute(node, "mode", "nearest") == "nearest"
        return node.op_type in VALUE_PRESERVING_OP_TYPES or self.zero_pad(index)

    def int8_source(self, tensor: str, int8_tensors: Collection[str]) -> str | None:
        """The tensor of ``int8_tensors`` whose values ``tensor`` carries unchanged, or None.

        ``tensor`` itself, or one it is computed from by value-preserving ops only (reshapes, max pooling,
        nearest resizing, zero padding).
        """
        while tensor not in int8_tensors:
            index = self.producer.get(tensor)
            if index is None or not self.value_preserving(index):
                return None
            tensor = self.graph.node[index].input[0]
        return tensor
