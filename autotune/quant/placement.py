"""Where the Q/DQ pairs of INT8 layers go, so that INT8 stays INT8 from one layer to the next.

A layer's choice decides only its own tensors: the Q/DQ on its output (with the activation it folds,
``output_pairs``; read by every reader of that output, as any layer's output is), and the Q/DQ on the inputs it
reads. An input is read

- as it is, when it already is an INT8 layer's quantized output: quantizing it again on another grid would round
  it twice and put a DequantizeLinear/QuantizeLinear pair between two integer kernels;
- through a pair dedicated to the layer on the *same grid*, when it carries such an output unchanged (a Reshape,
  a MaxPool or a nearest Resize in between): the backend then runs the ops between on the integers;
- through a pair dedicated to the layer with its own calibrated range otherwise (an FP32 producer), which no
  other reader of the tensor sees (ONNX Runtime's ``quantize_static`` would point every reader at it).

A zero ``Pad`` that only the layer reads belongs to the layer: its input pair goes before the Pad, which the
backend then folds into the convolution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from autotune.model.layer_units import GraphIndex
from autotune.model.layers import Layer
from autotune.model.optypes import INT8_OUTPUT_OP_TYPES, SATURATING_ACTIVATIONS
from autotune.quant.recipe import QuantRecipe


@dataclass(frozen=True)
class Grid:
    """The scale and zero point one quantized tensor was written with.

    Attributes:
        scale: The scale's value (an INT8 layer reading the tensor derives its int32 bias scale from it).
        scale_name: The scale initializer.
        zero_name: The zero-point initializer.
    """

    scale: np.float32
    scale_name: str
    zero_name: str


@dataclass(frozen=True)
class InputPlacement:
    """How an INT8 layer reads one activation input.

    Attributes:
        at: The tensor to quantize: the input itself, or the input of a zero Pad only this layer reads.
        reader: The node whose input ``at`` is: the layer's node, or that Pad.
        source: The quantized tensor ``at`` carries unchanged, whose grid a dedicated pair takes; None when the
            pair takes the layer's own range.
        reuse: ``at`` is itself a quantized layer output: read it as it is, with no pair.
    """

    at: str
    reader: int
    source: str | None = None
    reuse: bool = False


def place_input(
    index: GraphIndex,
    quantized: Mapping[str, Grid],
    tensor: str,
    layer_index: int,
    own_range: bool,
    before_pad: bool = True,
) -> InputPlacement:
    """Where the Q/DQ pair of one activation input of the INT8 layer at node ``layer_index`` goes. Pure.

    Args:
        index: The graph as it came (names as in the layer table).
        quantized: INT8 layer outputs quantized so far in this plan, by tensor name.
        tensor: The activation input.
        layer_index: The layer's node.
        own_range: The layer must quantize the input itself (SmoothQuant divides it first; FP8 has its own grid).
        before_pad: Quantize before a zero Pad only this layer reads (``QuantRecipe.quantize_before_zero_pad``).
    """
    pad = index.exclusive_pad(tensor, layer_index) if before_pad else None
    at, reader = (index.graph.node[pad].input[0], pad) if pad is not None else (tensor, layer_index)
    if own_range:
        return InputPlacement(at, reader)
    if at in quantized:
        return InputPlacement(at, reader, at, reuse=True)
    return InputPlacement(at, reader, index.int8_source(at, quantized))


def quantizes_output(op_type: str, recipe: QuantRecipe) -> bool:
    """Whether an INT8 layer of ``op_type`` gets a Q/DQ pair on its output under ``recipe``."""
    if op_type in INT8_OUTPUT_OP_TYPES:
        return recipe.quantize_conv_output
    return recipe.quantize_matmul_output


GATE_RANGE: tuple[float, float] = (0.0, 1.0)
"""The quantized range of a gate's output (``autotune.model.optypes.ACTIVATION_GATES``): a Sigmoid's or HardSigmoid's
output lies in it whatever the input, so it needs no calibration and no range method can clip it."""


@dataclass(frozen=True)
class OutputPair:
    """One Q/DQ pair an INT8 layer writes on its output side.

    Attributes:
        producer: The node that writes ``tensor``: the layer's node or a node of its output tail.
        tensor: The tensor quantized; every reader of it reads the pair's output.
        fixed_range: The range the pair takes regardless of calibration (a gate's output), or None: calibrated.
    """

    producer: int
    tensor: str
    fixed_range: tuple[float, float] | None = None


def output_tail(index: GraphIndex, output: str, recipe: QuantRecipe) -> tuple[int, ...]:
    """The nodes of the activation a layer's output Q/DQ folds under ``recipe`` (``GraphIndex.output_tail``)."""
    return index.output_tail(output) if recipe.fold_activation_into_output else ()


def output_pairs(index: GraphIndex, output: str, recipe: QuantRecipe) -> tuple[OutputPair, ...]:
    """Where a layer's output Q/DQ pairs go, in graph order; the last is the quantized output its readers take.

    - No folded activation: on the output.
    - A Relu or Clip: after it only (its saturation is the quantized range's; ONNX Runtime drops it).
    - A HardSwish: on the output and after the HardSwish: ONNX Runtime fuses a QLinearConv only with its output
      quantized, and has no integer HardSwish, which then runs in float between a DequantizeLinear and a
      QuantizeLinear.
    - A gated activation (SiLU ``Mul(x, Sigmoid(x))``, ``Mul(x, HardSigmoid(x))``): on the output, on the gate's
      output (over ``GATE_RANGE``) and after the Mul, so ONNX Runtime runs QLinearConv, QLinearSigmoid and
      QLinearMul back to back: on a Conv-SiLU stack faster than a float SiLU between the conv's pair and the
      Mul's, at the same accuracy (``bench/research/fused_activations.py``,
      docs/method.md#an-activation-the-runtime-fuses-is-part-of-its-producers-layer).
    """
    tail = output_tail(index, output, recipe)
    if not tail:
        return (OutputPair(index.producer[output], output),)
    nodes = index.graph.node
    end = OutputPair(tail[-1], nodes[tail[-1]].output[0])
    if nodes[tail[0]].op_type in SATURATING_ACTIVATIONS:
        return (end,)
    own = OutputPair(index.producer[output], output)
    if len(tail) == 1:
        return own, end
    return own, OutputPair(tail[0], nodes[tail[0]].output[0], GATE_RANGE), end


def output_target(index: GraphIndex, output: str, recipe: QuantRecipe) -> str:
    """The quantized tensor a layer writing ``output`` hands its readers: after its folded activation, if any."""
    return output_pairs(index, output, recipe)[-1].tensor


def required_ranges(layers: Sequence[Layer], recipe: QuantRecipe, model: onnx.ModelProto) -> list[str]:
    """Every tensor whose calibrated range ``rewrite`` may need when the layers run in int8 (or fp8).

    Args:
        layers: The tunable layers.
        recipe: The backend's recipe (decides which outputs are quantized and whether activations are folded).
        model: The model the layers come from.

    Returns:
        Tensor names, each once, in layer order: activation inputs, then the tensors of the layer's output pairs
        (``output_pairs``: its output, or the Relu/Clip output it folds into, and a folded activation's output)
        but a gate's, whose range is fixed.
    """
    index = GraphIndex(model.graph)
    names: list[str] = []
    for layer in layers:
        names.extend(layer.activation_inputs)
        if quantizes_output(layer.op_type, recipe):
            pairs = output_pairs(index, layer.output, recipe)
            names.extend(pair.tensor for pair in pairs if pair.fixed_range is None)
    return list(dict.fromkeys(names))
