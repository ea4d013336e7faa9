"""The one registry of op types the search may tune; every module that needs the list reads it here."""

from __future__ import annotations

from typing import Literal, get_args

TunableOp = Literal[
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "Add",
    "Mul",
    "Concat",
    "AveragePool",
    "GlobalAveragePool",
    "Sigmoid",
    "LeakyRelu",
    "LSTM",
    "GRU",
]
"""An op type whose precision a plan chooses (the config's ``search.op_types`` takes these)."""

TUNABLE_OP_TYPES: tuple[str, ...] = get_args(TunableOp)
"""Every tunable op type, in a fixed order."""

WEIGHTED_OP_TYPES: tuple[str, ...] = ("Conv", "ConvTranspose", "Gemm", "MatMul")
"""Tunable ops with a weight (the observation's one-hot follows this order)."""

MATMUL_OP_TYPES: tuple[str, ...] = ("MatMul", "Gemm")
"""Tunable ops that are matrix products (``nn.Linear`` in PyTorch; SmoothQuant applies to them)."""

CONV_OP_TYPES: tuple[str, ...] = ("Conv", "ConvTranspose")
"""Tunable ops that are convolutions."""

RECURRENT_OP_TYPES: tuple[str, ...] = ("LSTM", "GRU")
"""Recurrent ops (ONNX ``LSTM``, ``GRU``): one layer each, whose weights are its input and recurrence matrices. Their
INT8 form is dynamic (the kernel quantizes the activations at run time), so they need no calibrated range and their
output stays float; which of them a backend can run in INT8 is its own (``autotune.quant.recurrent``)."""

WEIGHTLESS_OP_TYPES: tuple[str, ...] = tuple(
    op for op in TUNABLE_OP_TYPES if op not in WEIGHTED_OP_TYPES and op not in RECURRENT_OP_TYPES
)
"""Ops without a weight that keep INT8 between quantized layers: ONNX Runtime has integer kernels for them
(QLinearAdd, QLinearMul, QLinearConcat, QLinearAveragePool, QLinearGlobalAveragePool, QLinearSigmoid,
QLinearLeakyRelu), as its QDQ quantizer assumes. One is a layer only where every input it reads comes from a layer
whose output can be INT8 (``autotune.model.layers.build_layer_table``)."""

INT8_OUTPUT_OP_TYPES: tuple[str, ...] = (*CONV_OP_TYPES, *WEIGHTLESS_OP_TYPES)
"""Layers whose INT8 output a backend may keep INT8 for the next layer (a MatMul or Gemm returns float on ONNX
Runtime: MatMulIntegerToFloat, QGemm with a float output)."""

SATURATING_ACTIVATIONS: tuple[str, ...] = ("Relu", "Clip")
"""Activations whose saturation a quantized range does: folded into the layer before them, they get no Q/DQ of
their own, only the layer's output pair after them (ONNX Runtime's QDQ quantizer removes them; its optimizer fuses
them)."""

FOLDED_ACTIVATIONS: tuple[str, ...] = (*SATURATING_ACTIVATIONS, "HardSwish")
"""Activations that fold into the layer before them when they alone read its output: the layer's choice decides
how they run (``autotune.quant.placement`` writes where the Q/DQ pairs go)."""

ACTIVATION_GATES: tuple[str, ...] = ("Sigmoid", "HardSigmoid")
"""Gates of the gated activations ``Mul(x, Sigmoid(x))`` (SiLU, Swish) and ``Mul(x, HardSigmoid(x))``
(HardSwish): where ``x`` is a layer's output that only the gate and the Mul read, both fold into the layer."""

VALUE_PRESERVING_OP_TYPES: tuple[str, ...] = (
    "Reshape",
    "Flatten",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Identity",
    "MaxPool",
    "Slice",
    "DepthToSpace",
    "SpaceToDepth",
)
"""Ops whose every output value is one of their input's values: a quantized input stays exact on the same grid,
so a quantized reader takes the same scale and zero point and the backend runs the op on the integers (ONNX
Runtime drops the Q/DQ pair around it). ``Resize`` in ``nearest`` mode and a zero ``Pad`` are handled apart."""
