"""Dynamic INT8 layers: a MatMul or Gemm whose activations are quantized at run time, as ORT's ``quantize_dynamic``.

The precision ``int8-dynamic`` (ONNX Runtime only) writes for one layer what ``quantize_dynamic`` writes for a
MatMul: ``DynamicQuantizeLinear`` (uint8, the range of each run's own input) -> ``MatMulInteger`` with int8
weights per output column -> ``Cast`` -> ``Mul`` by the input scale times the weight scales. ONNX Runtime fuses
that into ``DynamicQuantizeMatMul``. No calibrated range is needed, so a layer whose input outliers defeat a static
range can still run on the integer kernels.

The nodes come from ORT's own quantizer (``ONNXQuantizer`` in ``IntegerOps`` mode, the engine of
``quantize_dynamic``), run on a one-node model holding only the layer and its weight, as the recurrent layers'
(``autotune.quant.recurrent``). Run on the whole graph, ``quantize_dynamic`` also rewrites what the plan keeps
(every ``Gemm`` becomes ``MatMul`` + ``Add``, static Q/DQ layers included), so its graph cannot be combined with
the plan's other layers. A Gemm layer is handed to it as that same ``MatMul`` (its weight transposed where
``transB``, ``alpha`` folded into it) with the bias added after, in the layer's own nodes.

The weights are int8, symmetric, 8 bits (``[-127, 127]``) where this CPU's U8S8 kernels compute them exactly, 7
bits (``[-64, 64]``, ``reduce_range``) where they saturate (``QuantRecipe.dynamic_weight_max``, probed by
``autotune.backends.int8_kernels.dynamic_verdicts``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layer_units import attribute
from autotune.model.layers import Layer
from autotune.plan import DYNAMIC
from autotune.quant.graphedit import GraphEditor, RewriteError

DYNAMIC_OP_TYPES = ("MatMul", "Gemm")
"""The op types that take :data:`DYNAMIC`: ORT's dynamic kernels are matrix products."""

_OPSET = 17


def matmul_weight(editor: GraphEditor, layer: Layer) -> tuple[np.ndarray, np.ndarray | None]:
    """The layer's product as ``x @ w (+ bias)``: the ``[K, N]`` weight and the bias (None without).

    Raises:
        RewriteError: Not a MatMul/Gemm with a constant float weight (and, for a Gemm, ``transA=0``).
    """
    if layer.op_type not in DYNAMIC_OP_TYPES or layer.weight is None:
        raise RewriteError(
            f"layer {layer.name!r}: {DYNAMIC} needs a MatMul or Gemm with a constant weight, not a {layer.op_type}"
        )
    _, node = editor.node_of(layer)
    w = editor.float_init(layer.weight, layer)
    if layer.op_type == "MatMul":
        if w.ndim != 2 or node.input[1] != layer.weight:
            raise RewriteError(f"layer {layer.name!r}: {DYNAMIC} needs a MatMul by a constant 2-D weight")
        return w, None
    if attribute(node, "transA", 0):
        raise RewriteError(f"layer {layer.name!r}: {DYNAMIC} Gemm needs transA=0")
    w = (w.T if attribute(node, "transB", 0) else w) * np.float32(attribute(node, "alpha", 1.0))
    bias = None
    if layer.bias is not None:
        bias = editor.float_init(layer.bias, layer) * np.float32(attribute(node, "beta", 1.0))
    return np.ascontiguousarray(w, dtype=np.float32), bias


class _QuantizerChatter(logging.Filter):
    """Drops what ORT's quantizer says below warnings (a line per tensor): our user did not call it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "onnxruntime" not in record.pathname


@contextmanager
def _quiet() -> Iterator[None]:
    chatter = _QuantizerChatter()
    root = logging.getLogger()
    handlers = [root, *root.handlers]
    for target in handlers:
        target.addFilter(chatter)
    try:
        yield
    finally:
        for target in handlers:
            target.removeFilter(chatter)


def quantized_matmul(w: np.ndarray, per_channel: bool, weight_max: int) -> onnx.ModelProto:
    """ORT's dynamic quantizer on the one-node model ``Y = X @ W`` (what ``quantize_dynamic`` writes for it)."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, QuantType

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], "layer")],
        "dynamic",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    quantizer = ONNXQuantizer(
        model,
        per_channel,
        weight_max < 127,  # reduce_range: 7-bit weights, [-64, 64]
        QuantizationMode.IntegerOps,
        False,  # dynamic: the activations are quantized at run time
        QuantType.QInt8,
        QuantType.QUInt8,  # the only activation type dynamic quantization has
        None,
        ["layer"],
        [],
        ["MatMul"],
        {},
    )
    with _quiet():
        return quantizer.quantize_model()


def lower_dynamic(editor: GraphEditor, layer: Layer, per_channel: bool, weight_max: int) -> None:
    """Replaces ``layer``'s node by its dynamic INT8 form (the nodes of :func:`quantized_matmul`), in place.

    Every name the quantizer wrote is made fresh in the graph; the last node writes the layer's output, so its
    readers are unchanged; the float weight is dropped at ``finish`` where nothing else reads it.

    Raises:
        RewriteError: The layer has no dynamic form (see :func:`matmul_weight`), or the quantizer left it float.
    """
    index, node = editor.node_of(layer)
    w, bias = matmul_weight(editor, layer)
    quantized = quantized_matmul(w, per_channel, weight_max)
    if not any(n.op_type == "MatMulInteger" for n in quantized.graph.node):
        raise RewriteError(f"layer {layer.name!r}: ONNX Runtime's quantizer left this {layer.op_type} float")
    output = node.output[0]
    renamed = {"X": node.input[0], "Y": output if bias is None else editor.fresh(f"{output}__dyn")}
    for init in quantized.graph.initializer:
        renamed[init.name] = editor.add_init(f"{layer.weight}__dyn_{init.name}", numpy_helper.to_array(init))
    nodes = []
    for new in quantized.graph.node:
        for tensor in new.output:
            renamed.setdefault(tensor, editor.fresh(f"{layer.name}__{tensor}"))
        new.input[:] = [renamed.get(name, name) for name in new.input]
        new.output[:] = [renamed[name] for name in new.output]
        new.name = editor.fresh(f"{layer.name}__{new.name}")
        nodes.append(new)
    if bias is not None:
        bias_name = editor.add_init(f"{layer.bias}__dyn", bias.astype(np.float32))
        nodes.append(helper.make_node("Add", [renamed["Y"], bias_name], [output], editor.fresh(f"{layer.name}__bias")))
        editor.replaced.add(layer.bias)
    nodes[-1].name = layer.name  # profiles and reports name the layer, as the float node did
    editor.graph.node[index].CopyFrom(nodes[-1])
    editor.before[index].extend(nodes[:-1])
    editor.replaced.add(layer.weight)
