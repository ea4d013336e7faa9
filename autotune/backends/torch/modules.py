"""What each module of a plan runs in, and the rewrite that puts its wrapper (``wrappers.py``) in its place.

A plan's layer precisions are absolute: the precision the layer's GEMM runs in. ``base_precision`` is what the
rest of the module runs in (attention, softmax, LayerNorm, activations, embeddings, and layers without a module).
A layer in the base precision needs no wrapper; any other one is wrapped: ``fp32`` inside an fp16/bf16 base is an
FP32 override, ``fp16``/``bf16`` a cast island, ``int8``/``fp8`` a static-scale GEMM: this backend's own wrapper,
or torchao's static config (``quantized_gemm="torchao"``, ``torchao_linear.py``), with the same scales.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.backends.base import BuildError
from autotune.backends.torch.attention import set_attention
from autotune.backends.torch.smoothing import FoldFinder, smooth_module, smoothed_input
from autotune.backends.torch.torchao_linear import TORCHAO, WRAPPERS, quantize_modules, static_config, wrap_for_torchao
from autotune.backends.torch.wrappers import wrappers
from autotune.extras import MissingExtra
from autotune.plan import Plan
from autotune.quant.qparams import activation_qparams, fp8_activation_scale

if TYPE_CHECKING:
    from autotune.model.layers import Layer


@dataclass(frozen=True)
class ModuleChoice:
    """What one module runs in.

    Attributes:
        precision: ``fp32`` (an override inside a lower base), ``fp16``, ``bf16``, ``int8`` or ``fp8``.
        activation_range: Calibrated ``(lo, hi)`` of the module's input (int8 and fp8).
    """

    precision: str
    activation_range: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModuleSmoothing:
    """SmoothQuant factors by module path, and what finds where their ``1 / s`` folds (``smoothing.py``).

    Attributes:
        factors: Module path of an ``nn.Linear`` -> its factors, one per input feature.
        finder: The fold finder of the module's architecture; None: every smoothed input gets ``SmoothedInput``.
    """

    factors: Mapping[str, Any] = field(default_factory=dict)
    finder: FoldFinder | None = None


def activation_scale(lo: float, hi: float, precision: str) -> float:
    """The static activation scale of a calibrated range: symmetric int8 (``amax / 127``) or e4m3 (``amax / 448``)."""
    if precision == "int8":
        return float(activation_qparams(lo, hi, "int8")[0])
    if precision == "fp8":
        return float(fp8_activation_scale(lo, hi))
    raise ValueError(f"{precision} has no activation scale")


def module_choices(
    plan: Plan,
    layers: Sequence[Layer],
    bindings: Mapping[str, str],
    ranges: Mapping[str, tuple[float, float]],
    layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
    base: str = "fp32",
) -> dict[str, ModuleChoice]:
    """Module path -> what it runs in, for the modules whose plan precision differs from the base. Pure.

    A module called from several places (several ONNX layers) needs one precision; its activation range is the
    union of the calls' ranges. ``layer_ranges`` replaces ``ranges`` for the layers it names. A layer without a
    module runs in the base precision, so its plan precision must be ``fp32`` (what the search gives a layer it
    does not decide).

    Raises:
        BuildError: A non-FP32 layer has no module, a shared module gets two precisions, or a range is missing.
    """
    precisions = plan.precision_map
    calls: dict[str, list[Layer]] = {}
    for layer in layers:
        precision = precisions.get(layer.name, "fp32")
        if layer.name not in bindings:
            if precision != "fp32":
                raise BuildError(f"layer {layer.name} has no module to run in {precision}")
            continue
        calls.setdefault(bindings[layer.name], []).append(layer)
    choices = {}
    for path, group in calls.items():
        chosen = {precisions.get(layer.name, "fp32") for layer in group}
        if len(chosen) > 1:
            names = ", ".join(f"{layer.name}={precisions.get(layer.name, 'fp32')}" for layer in group)
            raise BuildError(f"module {path!r} runs several layers that need one precision: {names}")
        precision = chosen.pop()
        if precision == base:
            continue
        span = None
        if precision in ("int8", "fp8"):
            found = []
            for layer in group:
                tensor = layer.activation_inputs[0]
                own = (layer_ranges or {}).get(layer.name, ranges)
                if tensor not in own:
                    raise BuildError(f"no calibrated range for {tensor!r}, the input of {layer.name}")
                found.append(own[tensor])
            span = (min(float(lo) for lo, _ in found), max(float(hi) for _, hi in found))
        choices[path] = ModuleChoice(precision, span)
    return choices


def _smooth(module: Any, smoothing: ModuleSmoothing) -> dict[str, Any]:
    """Smooths ``module``'s Linears in place (``smooth_module``); returns the factors of the unfolded paths."""
    try:
        _, unfolded = smooth_module(module, smoothing.factors, smoothing.finder)
    except (ValueError, AttributeError) as error:
        raise BuildError(f"smoothing: {error}") from error
    return unfolded


def _wrap_path(root: Any, path: str, choice: ModuleChoice, how: tuple[bool, str | None, str, str]) -> tuple[Any, Any]:
    """``_wrap`` of the module at ``path`` with ``how`` = (per_channel, fp8_scaling, quantized_gemm, base).

    Raises:
        BuildError: No module there, or its wrapper failed to build (the message names the path).
    """
    try:
        target = root.get_submodule(path) if path else root
    except AttributeError as error:
        raise BuildError(f"no module {path!r} to rewrite: {error}") from error
    try:
        return _wrap(target, choice, *how)
    except (BuildError, MissingExtra):
        raise
    except Exception as error:  # noqa: BLE001 - a wrapper that fails to build is a failed build
        raise BuildError(f"{path}: {type(error).__name__}: {error}") from error


def _replace(root: Any, path: str, new: Any) -> Any:
    """Puts ``new`` at ``path`` in ``root``; returns the (possibly new) root."""
    if not path:
        return new
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
    return root


def float_dtype(precision: str) -> Any:
    """The torch dtype of ``fp32``, ``fp16`` or ``bf16``.

    Raises:
        BuildError: Another precision.
    """
    import torch

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise BuildError(f"{precision!r} is no float precision; use one of {sorted(dtypes)}")
    return dtypes[precision]


def _wrap(
    module: Any,
    choice: ModuleChoice,
    per_channel: bool,
    fp8_scaling: str | None,
    quantized_gemm: str = WRAPPERS,
    base: str = "fp32",
) -> tuple[Any, Any]:
    """The module that replaces ``module``, and its torchao config (None unless torchao quantizes it later)."""
    from torch import nn

    modules = wrappers()
    if choice.precision in ("fp32", "fp16", "bf16"):
        return modules.CastLayer(module, float_dtype(choice.precision)), None
    if not isinstance(module, nn.Linear):
        raise BuildError(f"{choice.precision} is for nn.Linear only, not {type(module).__name__}")
    lo, hi = choice.activation_range if choice.activation_range is not None else (0.0, 0.0)
    scale = activation_scale(lo, hi, choice.precision)
    if quantized_gemm == TORCHAO and choice.precision in ("int8", "fp8"):
        config = static_config(choice.precision, scale, per_channel)
        return wrap_for_torchao(module, float_dtype(base)), config
    return _own_wrapper(module, choice.precision, scale, per_channel, fp8_scaling), None


def _own_wrapper(module: Any, precision: str, scale: float, per_channel: bool, fp8_scaling: str | None) -> Any:
    modules = wrappers()
    if precision == "int8":
        return modules.Int8Linear.from_linear(module, scale, per_channel)
    if precision == "fp8":
        if fp8_scaling is None:
            raise BuildError("fp8 needs torch._scaled_mm and torch.float8_e4m3fn, which this torch lacks")
        return modules.Fp8Linear.from_linear(module, scale, per_channel, fp8_scaling)
    raise BuildError(f"the torch backend has no precision {precision!r}")


def rewrite_module(
    module: Any,
    choices: Mapping[str, ModuleChoice],
    per_channel: bool = True,
    fp8_scaling: str | None = "rowwise",
    base: str = "fp32",
    attention: str | None = None,
    quantized_gemm: str = WRAPPERS,
    smoothing: ModuleSmoothing | None = None,
) -> Any:
    """A deep copy of ``module`` with each chosen module replaced by its wrapper; ``module`` is left as it was.

    Args:
        module: The FP32 ``nn.Module``.
        choices: Module path -> what it runs in (``module_choices`` with the same ``base``).
        per_channel: INT8/FP8 weight scales per output channel, else one per tensor.
        fp8_scaling: ``rowwise`` or ``tensorwise`` (``DeviceInfo.fp8_scaling``).
        base: ``fp32``, or ``fp16``/``bf16``: the rest of the copy is converted to that dtype and wrapped in a
            ``PrecisionBoundary`` (floating inputs cast in, floating outputs back to float32).
        attention: An attention implementation to switch the copy to (``attention.set_attention``), or None.
        quantized_gemm: What int8 and fp8 modules run: ``autotune`` (``Int8Linear``, ``Fp8Linear``) or
            ``torchao`` (its static configs, ``torchao_linear.py``; needs the ``torchao`` extra).
        smoothing: SmoothQuant factors of int8/fp8 Linears (``smoothing.smooth_module``): their weight columns are
            multiplied by ``s`` before they are quantized, and ``1 / s`` is folded into the producer of their input
            where that is exact, else applied by a ``SmoothedInput`` around the wrapper. The choices' activation
            ranges must then be those of ``x / s``.

    Raises:
        BuildError: A module cannot take its precision, or the attention cannot be switched.
        MissingExtra: ``quantized_gemm="torchao"`` without torchao installed.
    """
    dtype = float_dtype(base)
    rewritten = copy.deepcopy(module)
    if attention is not None:
        set_attention(rewritten, attention)
    unfolded = _smooth(rewritten, smoothing) if smoothing is not None and smoothing.factors else {}
    # Wrappers are made from the FP32 modules first: converting the copy afterwards must not round an override's
    # FP32 weights, nor the float32 scales and biases of the INT8/FP8 wrappers, to the base dtype.
    wrapped, torchao_configs = {}, {}
    for path, choice in choices.items():
        wrapped[path], config = _wrap_path(rewritten, path, choice, (per_channel, fp8_scaling, quantized_gemm, base))
        if config is not None:
            torchao_configs[path] = config
    if base != "fp32":
        rewritten = rewritten.to(dtype)
    for path, new in wrapped.items():
        rewritten = _replace(rewritten, path, new)
    try:
        quantize_modules(rewritten, torchao_configs)
    except Exception as error:  # noqa: BLE001 - torchao's own errors come in many types
        raise BuildError(f"torchao quantize_: {type(error).__name__}: {error}") from error
    for path, factors in unfolded.items():  # around the wrapper, after torchao found its Linear at the path
        rewritten = _replace(rewritten, path, smoothed_input(rewritten.get_submodule(path), factors))
    if base != "fp32":
        rewritten = wrappers().PrecisionBoundary(rewritten, dtype)
    return rewritten
