"""INT8 recurrent layers: an ONNX ``LSTM`` lowered to ONNX Runtime's ``com.microsoft.DynamicQuantizeLSTM``.

What ``onnxruntime.quantization.quantize_dynamic`` writes for an LSTM: int8 input and recurrence weights (per
gate row where the plan's granularity is per channel, symmetric, zero point 0) with their scales, transposed to
``[directions, input, 4 * hidden]``; the activations are quantized by the kernel at run time, so no calibrated
range is needed. The node is written by ORT's own quantizer (``ONNXQuantizer``, whose ``LSTMQuant`` does the
work), run on a one-node model that holds only this LSTM and its weights: run on the whole graph, the quantizer
also rewrites nodes the plan keeps as they are (every ``Gemm`` becomes ``MatMul`` + ``Add``).

A ``GRU`` has no quantized kernel in ONNX Runtime (no ``DynamicQuantizeGRU`` contrib op); its only INT8 form
would unroll the time loop into per-step ``DynamicQuantizeLinear`` + ``MatMulInteger`` nodes. Not built: even the
fused ``DynamicQuantizeLSTM`` runs no faster than FP32 (docs/method.md#measurements-behind-the-codes-choices), and an
unrolled graph adds a kernel launch and a quantize per step and gate product. So a GRU layer is FP32 only
(``autotune.backends.onnxruntime.FP32_ONLY_OP_TYPES``).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from autotune.model.layers import Layer
from autotune.quant.graphedit import GraphEditor, RewriteError
from autotune.quant.recipe import QuantRecipe

MS_DOMAIN = "com.microsoft"
QUANTIZED_LSTM = "DynamicQuantizeLSTM"


def reduce_range(recipe: QuantRecipe) -> bool:
    """Whether the LSTM's int8 weights take 7 bits (ORT's ``reduce_range``), as the recipe's other weights do.

    ``DynamicQuantizeLSTM`` multiplies uint8 activations by int8 weights: on a CPU whose u8 x s8 kernels saturate,
    the probe chose 7-bit or uint8 weights for the other layers (``autotune.backends.int8_kernels``); 7-bit int8
    weights are exact there too.
    """
    return recipe.weight_max < 127 or recipe.weight_dtype != "int8"


def _one_node_model(node: onnx.NodeProto, inits: dict[str, TensorProto], opset: int) -> onnx.ModelProto:
    """A model with ``node`` alone: its initializer inputs as initializers, the rest as float graph inputs."""
    names = [name for name in dict.fromkeys(node.input) if name]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names if name not in inits]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output if name]
    graph = helper.make_graph([node], "recurrent", inputs, outputs, [inits[name] for name in names if name in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort_quantized_lstm(
    node: onnx.NodeProto, inits: dict[str, TensorProto], opset: int, per_channel: bool, reduced: bool
) -> onnx.ModelProto:
    """ORT's dynamic quantizer on the one-node model of ``node`` (what ``quantize_dynamic`` does to it)."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, QuantType

    quantizer = ONNXQuantizer(
        _one_node_model(node, inits, opset),
        per_channel,
        reduced,
        QuantizationMode.IntegerOps,
        False,  # dynamic: activations are quantized by the kernel at run time
        QuantType.QInt8,
        QuantType.QUInt8,  # the only activation type dynamic quantization has
        None,
        [node.name],
        [],
        ["LSTM"],
        {},
    )
    return quantizer.quantize_model()


def lower_int8_lstm(editor: GraphEditor, layer: Layer, per_channel: bool, recipe: QuantRecipe) -> None:
    """Replaces ``layer``'s LSTM node by ORT's ``DynamicQuantizeLSTM``, in place in the editor's graph.

    The node keeps the layer's name and outputs; the new initializers get fresh names in the graph; the float
    weights are dropped at ``finish`` where nothing else reads them.

    Raises:
        RewriteError: The layer is not an LSTM with constant 3-D weights (ORT's quantizer would leave it float).
    """
    index, node = editor.node_of(layer)
    if layer.op_type != "LSTM":
        raise RewriteError(
            f"layer {layer.name!r}: {layer.op_type} has no INT8 form on ONNX Runtime (no quantized kernel): FP32 only"
        )
    opset = next((op.version for op in editor.model.opset_import if op.domain in ("", "ai.onnx")), 17)
    quantized = _ort_quantized_lstm(node, editor.inits, opset, per_channel, reduce_range(recipe))
    written = [n for n in quantized.graph.node if n.op_type == QUANTIZED_LSTM]
    if len(written) != 1 or len(quantized.graph.node) != 1:
        raise RewriteError(
            f"layer {layer.name!r}: ONNX Runtime's quantizer left this LSTM float (its weights must be constant "
            f"3-D float tensors): keep it FP32"
        )
    float_weights = [name for name in node.input[1:3] if name]
    new_node = written[0]
    renamed = {}
    for init in quantized.graph.initializer:
        if init.name not in editor.inits:
            renamed[init.name] = editor.fresh(init.name)
            init.name = renamed[init.name]
            editor.graph.initializer.append(init)
            editor.inits[init.name] = init
    new_node.input[:] = [renamed.get(name, name) for name in new_node.input]
    new_node.name = layer.name  # profiles and reports name the layer, not ORT's ``_quant`` copy
    editor.graph.node[index].CopyFrom(new_node)
    editor.replaced.update(float_weights)
    _import_domain(editor.model, MS_DOMAIN, 1)


def _import_domain(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Adds ``domain`` to the model's opset imports where it is missing."""
    if not any(op.domain == domain for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))
