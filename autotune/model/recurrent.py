"""ONNX's recurrent ops (``LSTM``, ``GRU``) as layers: their weights, parameters and multiply-accumulates. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

_WEIGHT_SLOTS = (1, 2, 3, 7)  # W, R, B and (LSTM) the peepholes P; not the initial states, which are activations


@dataclass(frozen=True)
class RecurrentWeights:
    """What the layer table needs of one LSTM or GRU.

    Attributes:
        weight: ``W``, the input matrices ``[directions, gates * hidden, input]``.
        recurrence: ``R``, the recurrence matrices ``[directions, gates * hidden, hidden]``.
        bias: ``B`` where it is an initializer, else None.
        params: Elements of ``W``, ``R``, ``B`` and the peepholes.
        macs: Multiply-accumulates of one run (``recurrent_macs``).
    """

    weight: str
    recurrence: str
    bias: str | None
    params: int
    macs: int


def recurrent_macs(node: onnx.NodeProto, w_shape: tuple[int, ...], hidden: int, x_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of an LSTM or GRU: its gate products ``x @ W^T`` and ``h @ R^T`` at every step.

    As for a MatMul (output elements times the reduction): per step, direction and sample, ``gates * hidden``
    outputs over ``input + hidden`` values; the elementwise gate arithmetic is left out, as a MatMul's bias is.

    Args:
        node: The LSTM or GRU node (its ``layout`` says where the sequence and batch axes are).
        w_shape: The shape of ``W``, ``[directions, gates * hidden, input]``.
        hidden: The hidden size (``R``'s last axis).
        x_shape: The shape of its input ``X``; 0 MACs where it is not known.
    """
    if len(x_shape) != 3 or any(d <= 0 for d in x_shape) or len(w_shape) != 3:
        return 0
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    steps, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    directions, gate_rows, inputs = w_shape
    return steps * batch * directions * gate_rows * (inputs + hidden)


def recurrent_weights(
    node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto], x_shape: tuple[int, ...]
) -> RecurrentWeights | str:
    """The weights, parameters and MACs of an LSTM or GRU, or why it is no layer (weights that are not constant)."""
    weight, recurrence, bias = [*node.input, "", "", ""][1:4]
    if weight not in initializers or recurrence not in initializers:
        return f"its weights W and R are not constant initializers: the {node.op_type} stays FP32"
    slots = [node.input[i] for i in _WEIGHT_SLOTS if i < len(node.input) and node.input[i] in initializers]
    return RecurrentWeights(
        weight=weight,
        recurrence=recurrence,
        bias=bias if bias in initializers else None,
        params=sum(int(np.prod(initializers[name].dims)) for name in slots),
        macs=recurrent_macs(node, tuple(initializers[weight].dims), initializers[recurrence].dims[-1], x_shape),
    )
