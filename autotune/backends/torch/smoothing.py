"""SmoothQuant on the torch backend: the same factors the ONNX backends lower, lowered as a module rewrite.

``autotune.quant.layerwise`` chooses SmoothQuant per layer (``smooth-0.5``, ``smooth-0.75``) with the factors
``s_j = max|x_j|^a / max|W_j|^(1-a)`` per input channel ``j``; the ONNX backends multiply the weight's input rows
by ``s`` and put a ``Mul`` by ``1 / s`` on the layer's input. Here the ``nn.Linear``'s weight columns are
multiplied by ``s`` before its INT8/FP8 wrapper quantizes them, and ``x / s`` is made without a kernel of its own:

- folded into the module that produces ``x`` where that leaves the FP32 module's outputs as they were: a
  ``LayerNorm``'s weight and bias, or the output rows (weight rows and bias) of the ``Linear`` before it, as the
  value projection before an attention output projection (``ctx = softmax(QK^T) V`` keeps ``V``'s channels);
- otherwise by ``SmoothedInput``, a multiply by ``1 / s`` on the layer's input, which ``torch.compile`` fuses with
  the activation's quantization (both elementwise) into the kernel that quantizes the input anyway.

Whether a fold is exact is not read from the module's code: the producer candidates are the last ``LayerNorm`` and
the last ``Linear`` of matching width that ran before the layer, and a candidate is kept only where the folded FP32
module gives the original module's outputs on a sample input (``FoldFinder``). A ``LayerNorm`` whose output also
feeds a residual connection (BERT's post-LN blocks) fails that check and is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FOLD_TOLERANCE = 1e-5
"""A fold is exact when no output moves by more than this fraction of the output's largest magnitude (FP32)."""

_TRIAL_FACTORS_SEED = 0


@functools.cache
def smoothed_input_class() -> Any:
    """The ``SmoothedInput`` module class, defined on first use (it needs torch)."""
    import torch
    from torch import nn

    class SmoothedInput(nn.Module):
        """``layer(x * inverse)``: a smoothed layer's input divided by its factors, in float32, in ``x``'s dtype."""

        def __init__(self, layer: nn.Module, inverse: torch.Tensor):
            super().__init__()
            self.layer = layer
            self.register_buffer("inverse", inverse.detach().float().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer((x.float() * self.inverse).to(x.dtype))

        def extra_repr(self) -> str:
            return f"channels={self.inverse.numel()}"

    SmoothedInput.__module__, SmoothedInput.__qualname__ = __name__, "SmoothedInput"
    globals()["SmoothedInput"] = SmoothedInput
    return SmoothedInput


def scale_columns(linear: Any, factors: np.ndarray) -> None:
    """``W[:, j] *= s_j`` in place: the weight of a Linear whose input is divided by ``s``.

    Raises:
        ValueError: ``factors`` is not one positive number per input feature.
    """
    import torch

    _check_factors(linear.in_features, factors)
    with torch.no_grad():
        linear.weight.mul_(torch.as_tensor(factors, dtype=linear.weight.dtype, device=linear.weight.device))


def fold_inverse(producer: Any, factors: np.ndarray) -> None:
    """Divides the output channels of ``producer`` (``nn.LayerNorm`` or ``nn.Linear``) by ``s``, in place.

    Raises:
        ValueError: Another module, a LayerNorm without affine parameters, or a width that does not match.
    """
    import torch
    from torch import nn

    if isinstance(producer, nn.LayerNorm):
        if producer.weight is None or tuple(producer.normalized_shape) != (len(factors),):
            raise ValueError("only an affine LayerNorm over the last axis of the factors' width takes a fold")
        params = [producer.weight, producer.bias]
    elif isinstance(producer, nn.Linear):
        _check_factors(producer.out_features, factors)
        params = [producer.weight, producer.bias]
    else:
        raise ValueError(f"cannot fold smoothing into {type(producer).__name__}")
    with torch.no_grad():
        for param in params:
            if param is not None:
                inverse = torch.as_tensor(1.0 / factors, dtype=param.dtype, device=param.device)
                param.mul_(inverse.view(-1, *([1] * (param.dim() - 1))))


def _check_factors(width: int, factors: np.ndarray) -> None:
    if factors.shape != (width,) or not np.all(factors > 0) or not np.all(np.isfinite(factors)):
        raise ValueError(f"smoothing needs {width} positive finite factors, got shape {list(factors.shape)}")


class FoldFinder:
    """Per smoothed Linear, the module its ``1 / s`` folds into exactly, or None; found once per path.

    Args:
        module: The FP32 module (left as it was after each check).
        sample: Its inputs for the checks (one small batch; integer inputs such as token ids can be ones).
    """

    def __init__(self, module: Any, sample: Sequence[Any]):
        self.module = module
        self.sample = list(sample)
        self._reference: list[Any] | None = None
        self._order: list[str] | None = None
        self._found: dict[str, str | None] = {}

    def producer(self, path: str) -> str | None:
        """The path of the module ``path``'s input divisor folds into, or None where none folds exactly."""
        if path not in self._found:
            self._found[path] = next(
                (candidate for candidate in self._candidates(path) if self._exact(path, candidate)), None
            )
        return self._found[path]

    def _outputs(self) -> list[Any]:
        import torch

        from autotune.backends.torch.runtime import flatten_outputs

        with torch.no_grad():
            return [out.detach().float().clone() for out in flatten_outputs(self.module(*self.sample))]

    def _candidates(self, path: str) -> list[str]:
        """The last LayerNorm and the last Linear of the input's width that ran before ``path``, nearest first."""
        from torch import nn

        if self._order is None:
            self._order = self._call_order()
        target = self.module.get_submodule(path)
        if path not in self._order or not isinstance(target, nn.Linear):
            return []
        width = target.in_features
        found: dict[type, str] = {}
        for name in reversed(self._order[: self._order.index(path)]):
            sub = self.module.get_submodule(name)
            kind = nn.LayerNorm if isinstance(sub, nn.LayerNorm) else nn.Linear if isinstance(sub, nn.Linear) else None
            fits = kind is nn.LayerNorm and tuple(sub.normalized_shape) == (width,) and sub.weight is not None
            fits = fits or (kind is nn.Linear and sub.out_features == width)
            if fits and kind not in found:
                found[kind] = name
        return list(found.values())

    def _call_order(self) -> list[str]:
        """Paths of the LayerNorm and Linear modules in the order they first ran on the sample."""
        from torch import nn

        order: list[str] = []
        handles = [
            sub.register_forward_pre_hook(lambda *_, name=name: order.append(name) if name not in order else None)
            for name, sub in self.module.named_modules()
            if isinstance(sub, (nn.LayerNorm, nn.Linear)) and name
        ]
        try:
            self._reference = self._outputs()
        finally:
            for handle in handles:
                handle.remove()
        return order

    def _exact(self, path: str, producer: str) -> bool:
        """Whether folding trial factors into ``producer`` (and scaling ``path``'s columns) keeps every output."""
        target, source = self.module.get_submodule(path), self.module.get_submodule(producer)
        rng = np.random.default_rng(_TRIAL_FACTORS_SEED)
        factors = np.exp(rng.uniform(-1.5, 1.5, target.in_features)).astype(np.float32)
        saved = {id(p): p.detach().clone() for m in (target, source) for p in m.parameters(recurse=False)}
        try:
            scale_columns(target, factors)
            fold_inverse(source, factors)
            return outputs_match(self._outputs(), self._reference or [])
        finally:
            _restore((target, source), saved)


def _restore(modules: Sequence[Any], saved: Mapping[int, Any]) -> None:
    import torch

    with torch.no_grad():
        for module in modules:
            for param in module.parameters(recurse=False):
                param.copy_(saved[id(param)])


def outputs_match(got: Sequence[Any], expected: Sequence[Any], tolerance: float = FOLD_TOLERANCE) -> bool:
    """True when every output is within ``tolerance`` of its reference's largest magnitude (and shapes agree)."""
    if len(got) != len(expected) or not expected:
        return False
    for out, ref in zip(got, expected, strict=True):
        if out.shape != ref.shape:
            return False
        bound = tolerance * max(float(ref.abs().max()), 1e-30)
        if float((out - ref).abs().max()) > bound:
            return False
    return True


def smooth_module(
    module: Any, smoothing: Mapping[str, np.ndarray], finder: FoldFinder | None = None
) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Smooths the Linears of ``module`` in place: columns times ``s``, and ``1 / s`` folded where it is exact.

    Args:
        module: An FP32 module (the build's copy), changed in place.
        smoothing: Module path -> SmoothQuant factors of the ``nn.Linear`` there.
        finder: Finds the folds (on this module's architecture; ``FoldFinder``); None folds nothing.

    Returns:
        The paths folded, with the module each folded into; and the factors of the other paths, whose input the
        caller divides with ``SmoothedInput`` around the module that ends up at the path.

    Raises:
        ValueError: A path is no ``nn.Linear``, or its factors do not fit it.
    """
    from torch import nn

    folded, unfolded = {}, {}
    for path, factors in smoothing.items():
        target = module.get_submodule(path)
        if not isinstance(target, nn.Linear):
            raise ValueError(f"smoothing is for nn.Linear only, not {type(target).__name__} at {path!r}")
        factors = np.asarray(factors, dtype=np.float32)
        producer = finder.producer(path) if finder is not None else None
        scale_columns(target, factors)
        if producer is not None:
            fold_inverse(module.get_submodule(producer), factors)
            folded[path] = producer
        else:
            unfolded[path] = factors
    return folded, unfolded


def smoothed_input(layer: Any, factors: np.ndarray) -> Any:
    """``layer`` behind a multiply of its input by ``1 / factors`` (``SmoothedInput``)."""
    import torch

    return smoothed_input_class()(layer, torch.from_numpy(np.asarray(1.0 / factors, dtype=np.float32)))


def sample_inputs(specs: Sequence[Any], seed: int = 0) -> list[Any]:
    """One row of inputs for ``FoldFinder``: integer inputs (token ids, masks) ones, floating ones random normal.

    Args:
        specs: The model's ``InputSpec`` list; the first axis (the batch) is made 1.
        seed: Seed of the floating inputs.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for spec in specs:
        shape = [max(int(d), 1) for d in spec.shape]
        if shape:
            shape[0] = 1
        dtype = torch.from_numpy(np.zeros(0, dtype=np.dtype(spec.dtype))).dtype
        if dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            inputs.append(torch.ones(shape, dtype=dtype))
    return inputs


def smoothed_paths(module: Any) -> dict[str, int]:
    """Path -> channels of every ``SmoothedInput`` in a rewritten module (inside its ``PrecisionBoundary``, if any).

    What ``load_exported`` needs to rebuild the module the saved state belongs to; folded layers need nothing,
    their producers' weights are in the state.
    """
    cls = smoothed_input_class()
    root = module.model if type(module).__name__ == "PrecisionBoundary" else module
    return {name: int(sub.inverse.numel()) for name, sub in root.named_modules() if isinstance(sub, cls)}
