"""The one registry of op types the search may tune; every module that needs the list reads it here."""

from __future__ import annotations

from typing import Literal, get_args

TunableOp = Literal["Conv", "ConvTranspose", "Gemm", "MatMul"]
"""An op type with weights whose precision a plan chooses (the config's ``search.op_types`` takes these)."""

TUNABLE_OP_TYPES: tuple[str, ...] = get_args(TunableOp)
"""Every tunable op type, in a fixed order (the observation's one-hot follows it)."""

MATMUL_OP_TYPES: tuple[str, ...] = ("MatMul", "Gemm")
"""Tunable ops that are matrix products (``nn.Linear`` in PyTorch; SmoothQuant applies to them)."""

CONV_OP_TYPES: tuple[str, ...] = ("Conv", "ConvTranspose")
"""Tunable ops that are convolutions."""
