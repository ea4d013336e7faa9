"""The modules a rewritten layer becomes (``CastLayer``, ``Int8Linear``, ``Fp8Linear``), and ``PrecisionBoundary``.

``PrecisionBoundary`` wraps a module converted to a lower base precision. Per layer:

- fp32 / fp16 / bf16: the layer's weights in that dtype, the input cast in and the output cast back to the dtype
  around it (the ONNX Casts); fp32 is an override inside a module whose base precision is fp16 or bf16.
- int8 (Linear): symmetric int8 activations with a static scale from our calibration, int8 weights with per-channel
  (or per-tensor) scales, ``torch._int_mm`` with an int32 accumulator, rescaled to float32.
- fp8 (Linear): e4m3 activations with a static scale, per-channel e4m3 weights, ``torch._scaled_mm``.

Static scales matter: dynamic activation quantization (amax per call) made INT8 and FP8 slower than FP16 on an H200.

The classes subclass ``nn.Module``, so they are defined on first use (``wrappers()``, or this module's
``__getattr__``): importing this file does not import torch.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np

from autotune.quant.qparams import FP8_MAX, quantize_weight, quantize_weight_fp8

INT8_PAD_ROWS = 32
"""``torch._int_mm`` on CUDA needs more than 16 rows: 16 rows or fewer are padded with zero rows to this many."""

FP8_ROW_MULTIPLE = 16
"""``torch._scaled_mm`` on CUDA needs a multiple of 16 rows."""

WRAPPER_NAMES = ("CastLayer", "Int8Linear", "Fp8Linear", "PrecisionBoundary")


def _define_cast_layer() -> Any:
    """The fp16/bf16 wrapper class."""
    import torch
    from torch import nn

    class CastLayer(nn.Module):
        """A Linear or Conv with weights in ``dtype``; the input is cast in and the output back to its dtype."""

        def __init__(self, layer: nn.Module, dtype: torch.dtype):
            super().__init__()
            self.layer = copy.deepcopy(layer).to(dtype)
            self.compute_dtype = dtype

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x.to(self.compute_dtype)).to(x.dtype)

        def extra_repr(self) -> str:
            return f"compute_dtype={self.compute_dtype}"

    return CastLayer


def _round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def _define_int8_linear() -> Any:
    """The int8 Linear wrapper class."""
    import torch
    from torch import nn

    class Int8Linear(nn.Module):
        """``y = int_mm(q(x), q(W)^T) * act_scale * w_scale + b`` with a static activation scale.

        Buffers: ``weight_q`` [out, in] int8, ``act_scale`` (0-d), ``weight_scale`` [out] (per-tensor scales are
        repeated), ``out_scale`` = act_scale * weight_scale, ``bias`` [out] float32 or None.
        """

        def __init__(self, in_features: int, out_features: int, bias: bool):
            super().__init__()
            self.in_features = in_features
            self.out_features = out_features
            # cuBLASLt's int8 GEMM wants both feature counts in multiples of 8: zero rows and columns pad the
            # weight (they add nothing to the sums), so every Linear can run in int8.
            self.in_padded, self.out_padded = _round_up(in_features, 8), _round_up(out_features, 8)
            self.register_buffer("weight_q", torch.zeros(self.out_padded, self.in_padded, dtype=torch.int8))
            self.register_buffer("act_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("weight_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("out_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)

        @classmethod
        def from_linear(cls, linear: nn.Linear, act_scale: float, per_channel: bool) -> Int8Linear:
            """Quantizes an ``nn.Linear`` with ``autotune.quant.qparams.quantize_weight`` (axis 0: output channels)."""
            module = cls(linear.in_features, linear.out_features, linear.bias is not None)
            q, scales = quantize_weight(linear.weight.detach().float().cpu().numpy(), 0, per_channel)
            scales = np.broadcast_to(scales, (linear.out_features,)).astype(np.float32)
            out, inp = linear.out_features, linear.in_features
            with torch.no_grad():
                module.weight_q[:out, :inp].copy_(torch.from_numpy(q))
                module.act_scale.fill_(float(np.float32(act_scale)))
                module.weight_scale[:out].copy_(torch.from_numpy(scales))
                module.out_scale[:out].copy_(torch.from_numpy(np.float32(act_scale) * scales))
                if linear.bias is not None:
                    module.bias.copy_(linear.bias.detach().float().cpu())
            return module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features).float()
            rows = flat.shape[0]
            pad_rows = INT8_PAD_ROWS - rows if flat.is_cuda and rows <= 16 else 0
            if pad_rows or self.in_padded != self.in_features:
                flat = torch.nn.functional.pad(flat, (0, self.in_padded - self.in_features, 0, pad_rows))
            # x / scale in float32 and round-half-to-even, as ONNX QuantizeLinear and our fake_quant do
            q = torch.clamp(torch.round(flat / self.act_scale), -128, 127).to(torch.int8)
            y = torch._int_mm(q, self.weight_q.t())[:rows, : self.out_features].float()
            y = y * self.out_scale[: self.out_features]
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, self.out_features).to(x.dtype)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}"

    return Int8Linear


def _define_fp8_linear() -> Any:
    """The fp8 Linear wrapper class."""
    import torch
    from torch import nn

    class Fp8Linear(nn.Module):
        """``y = scaled_mm(q(x), q(W)^T)`` in e4m3 with a static activation scale and per-channel weight scales.

        ``scaling`` is ``rowwise`` (scales inside the GEMM, bfloat16 output as rowwise kernels require) or
        ``tensorwise`` (the activation scale inside, the weight scales on the float32 output).
        """

        def __init__(self, in_features: int, out_features: int, bias: bool, scaling: str = "rowwise"):
            super().__init__()
            if scaling not in ("rowwise", "tensorwise"):
                raise ValueError(f"fp8 scaling must be 'rowwise' or 'tensorwise', not {scaling!r}")
            self.in_features = in_features
            self.out_features = out_features
            self.scaling = scaling
            # _scaled_mm wants feature counts in multiples of 16: zero-padded weights, as in Int8Linear
            self.in_padded, self.out_padded = _round_up(in_features, 16), _round_up(out_features, 16)
            weight = torch.zeros(self.out_padded, self.in_padded, dtype=torch.uint8).view(torch.float8_e4m3fn)
            self.register_buffer("weight_q", weight)
            self.register_buffer("act_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("weight_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)
            self.register_buffer("one", torch.ones((), dtype=torch.float32), persistent=False)

        @classmethod
        def from_linear(cls, linear: nn.Linear, act_scale: float, per_channel: bool, scaling: str) -> Fp8Linear:
            """Quantizes an ``nn.Linear`` with ``autotune.quant.qparams.quantize_weight_fp8`` (axis 0)."""
            module = cls(linear.in_features, linear.out_features, linear.bias is not None, scaling)
            _load_fp8_weights(module, linear, act_scale, per_channel)
            return module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features).float()
            rows = flat.shape[0]
            pad_rows = -rows % FP8_ROW_MULTIPLE if flat.is_cuda else 0
            if pad_rows or self.in_padded != self.in_features:
                flat = torch.nn.functional.pad(flat, (0, self.in_padded - self.in_features, 0, pad_rows))
            q = torch.clamp(flat / self.act_scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            y = _fp8_matmul(self, q, rows)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, self.out_features).to(x.dtype)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}"

    return Fp8Linear


def _load_fp8_weights(module: Any, linear: Any, act_scale: float, per_channel: bool) -> None:
    """Fills an ``Fp8Linear``'s buffers from ``linear``: e4m3 weights and their scales, the activation scale, bias."""
    import torch

    q, scales = quantize_weight_fp8(linear.weight.detach().float().cpu().numpy(), 0, per_channel)
    scales = np.broadcast_to(scales, (linear.out_features,)).astype(np.float32)
    out, inp = linear.out_features, linear.in_features
    with torch.no_grad():
        # ml_dtypes and torch share the e4m3fn bit layout
        module.weight_q[:out, :inp].copy_(
            torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
        )
        module.act_scale.fill_(float(np.float32(act_scale)))
        module.weight_scale[:out].copy_(torch.from_numpy(scales))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float().cpu())


def _fp8_matmul(module: Any, q: Any, rows: int) -> Any:
    """The float32 product of an ``Fp8Linear``'s e4m3 input ``q`` and its weights, its first ``rows`` rows.

    ``rowwise`` applies both scales inside the GEMM, whose rowwise kernels write bfloat16; ``tensorwise`` applies
    the activation scale inside and the per-channel weight scales to the float32 output.
    """
    import torch

    if module.scaling == "rowwise":
        scale_a = module.act_scale.expand(q.shape[0], 1).contiguous()
        y = torch._scaled_mm(
            q,
            module.weight_q.t(),
            scale_a=scale_a,
            scale_b=module.weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )
        return y[:rows, : module.out_features].float()
    y = torch._scaled_mm(q, module.weight_q.t(), scale_a=module.act_scale, scale_b=module.one, out_dtype=torch.float32)
    return y[:rows, : module.out_features] * module.weight_scale[: module.out_features]


def _define_precision_boundary() -> Any:
    """The wrapper class of a module converted to a lower base precision."""
    import torch
    from torch import nn
    from torch.utils import _pytree as pytree

    class PrecisionBoundary(nn.Module):
        """A module converted to ``dtype`` (``module.to(dtype)``), called like the FP32 one.

        Floating inputs are cast to ``dtype`` (integer ones, token ids and masks, pass as they are); floating
        outputs come back as float32, so scores, exports and callers see the FP32 module's interface.
        """

        def __init__(self, model: nn.Module, dtype: torch.dtype):
            super().__init__()
            self.model = model
            self.compute_dtype = dtype

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            def cast_in(t: torch.Tensor) -> torch.Tensor:
                return t.to(self.compute_dtype) if t.is_floating_point() else t

            def cast_out(t: torch.Tensor) -> torch.Tensor:
                return t.float() if t.is_floating_point() else t

            args, kwargs = pytree.tree_map_only(torch.Tensor, cast_in, (args, kwargs))
            return pytree.tree_map_only(torch.Tensor, cast_out, self.model(*args, **kwargs))

        def extra_repr(self) -> str:
            return f"compute_dtype={self.compute_dtype}"

    return PrecisionBoundary


@functools.cache
def wrappers() -> Any:
    """The wrapper classes (``.CastLayer``, ``.Int8Linear``, ``.Fp8Linear``, ``.PrecisionBoundary``), on first use."""
    import types

    namespace = types.SimpleNamespace(
        CastLayer=_define_cast_layer(),
        Int8Linear=_define_int8_linear(),
        Fp8Linear=_define_fp8_linear(),
        PrecisionBoundary=_define_precision_boundary(),
    )
    for name in WRAPPER_NAMES:  # importable by name (pickle, torch.save of whole modules, people)
        cls = getattr(namespace, name)
        cls.__module__, cls.__qualname__ = __name__, name
        globals()[name] = cls
    return namespace


def __getattr__(name: str) -> Any:
    """The classes of ``WRAPPER_NAMES`` are defined on first access (they need torch)."""
    if name in WRAPPER_NAMES:
        return getattr(wrappers(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
