"""INT8 and FP8 Linear layers through torchao's static-activation configs, the other implementation of the backend.

``backend.options.quantized_gemm: torchao`` builds a plan's int8 and fp8 modules with torchao
(``Int8StaticActivationInt8WeightConfig``, ``Float8StaticActivationFloat8WeightConfig``) instead of this
backend's own wrappers (``wrappers.py``), applied per module with one ``quantize_`` call and ``FqnToConfig``.
The activation scales are ours: the same calibrated ranges (``modules.activation_scale``) the wrappers use, so the
two implementations differ only in their kernels and in what torchao lets vary:

- INT8: symmetric per-tensor activations, int8 weights per output channel (``PerRow``) or per tensor, as the
  plan's granularity says; torchao's ``int_scaled_matmul`` with an int32 accumulator.
- FP8: e4m3 activations and weights, both per tensor: torchao 0.18's static FP8 config takes one granularity for
  both and only ``PerTensor`` for static activations, so the granularity knob does not reach its weights.

torchao checks that a static scale has as many dimensions as the activation, so each quantized ``nn.Linear`` sits
in a ``TorchaoLinear`` that flattens its input to 2-D (a view) and gives it the layer's compute dtype, the base
precision. ``set_inductor_config`` stays off: torchao's recommended inductor settings are process-wide and would
change every later build in the process, the FP32 reference and the one-liners included.

torchao is the ``torchao`` extra, imported on first use (``autotune.extras.require``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from autotune.extras import require

TORCHAO = "torchao"
"""``quantized_gemm`` value: torchao's static configs."""

WRAPPERS = "autotune"
"""``quantized_gemm`` value: this backend's own wrappers (``Int8Linear``, ``Fp8Linear``)."""


TORCHAO_MODULE = ("torchao.quantization", "torchao", "backend.options.quantized_gemm: torchao")
"""What ``require`` imports for torchao's Linears: the module, the extra that installs it, the option that needs it."""


def torchao() -> Any:
    """The ``torchao.quantization`` module, or ``MissingExtra`` naming the pip command."""
    return require(*TORCHAO_MODULE)


@functools.cache
def _torchao_linear_class() -> Any:
    import torch
    from torch import nn

    class TorchaoLinear(nn.Module):
        """An ``nn.Linear`` that ``quantize_`` turns into torchao's static INT8 or FP8 Linear (its ``linear``).

        The input is flattened to 2-D and cast to ``compute_dtype``; the output is reshaped back and returned in
        the input's dtype.
        """

        def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype):
            super().__init__()
            self.linear = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
            self.linear.load_state_dict(linear.state_dict())
            self.linear.to(compute_dtype)
            self.compute_dtype = compute_dtype

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
            y = self.linear(flat)
            return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

        def extra_repr(self) -> str:
            return f"compute_dtype={self.compute_dtype}"

    TorchaoLinear.__module__, TorchaoLinear.__qualname__ = __name__, "TorchaoLinear"
    return TorchaoLinear


def __getattr__(name: str) -> Any:
    """``TorchaoLinear`` is defined on first access (it needs torch)."""
    if name == "TorchaoLinear":
        return _torchao_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wrap_for_torchao(linear: Any, compute_dtype: Any) -> Any:
    """A ``TorchaoLinear`` holding a copy of ``linear`` in ``compute_dtype``, not yet quantized.

    Raises:
        BuildError: ``linear`` is not an ``nn.Linear``.
    """
    from torch import nn

    from autotune.backends.base import BuildError

    if not isinstance(linear, nn.Linear):
        raise BuildError(f"torchao's int8 and fp8 configs are for nn.Linear only, not {type(linear).__name__}")
    return _torchao_linear_class()(linear, compute_dtype)


def static_config(precision: str, act_scale: float, per_channel: bool) -> Any:
    """The torchao static config of one module: its activation scale as a float32 ``[1, 1]`` tensor.

    Args:
        precision: ``int8`` or ``fp8``.
        act_scale: The static activation scale (``modules.activation_scale`` of the calibrated range).
        per_channel: INT8 weight scales per output channel (``PerRow``), else per tensor; FP8 weights are per
            tensor either way (torchao 0.18's static FP8 config).

    Raises:
        ValueError: Another precision.
    """
    import torch

    quantization = torchao()
    scale = torch.tensor([[act_scale]], dtype=torch.float32)
    if precision == "int8":
        weight = quantization.PerRow() if per_channel else quantization.PerTensor()
        return quantization.Int8StaticActivationInt8WeightConfig(
            act_quant_scale=scale, granularity=[quantization.PerTensor(), weight], set_inductor_config=False
        )
    if precision == "fp8":
        prototype = require("torchao.prototype.quantization.quant_api", "torchao", "torchao's static FP8 config")
        return prototype.Float8StaticActivationFloat8WeightConfig(
            act_quant_scale=scale, granularity=quantization.PerTensor(), set_inductor_config=False
        )
    raise ValueError(f"torchao's static configs are for int8 and fp8, not {precision!r}")


def quantize_modules(root: Any, configs: Mapping[str, Any]) -> None:
    """Quantizes the ``TorchaoLinear`` modules at ``configs``' paths of ``root`` in place, in one ``quantize_``.

    Args:
        root: The module that holds them.
        configs: Path of a ``TorchaoLinear`` in ``root`` -> its ``static_config``.
    """
    if not configs:
        return
    quantization = torchao()
    by_fqn = {(f"{path}.linear" if path else "linear"): config for path, config in configs.items()}
    quantization.quantize_(root, quantization.FqnToConfig(by_fqn), filter_fn=None)
