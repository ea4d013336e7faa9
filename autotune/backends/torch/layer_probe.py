"""The layerwise calibration's single-layer evaluations on the torch backend's own device.

``autotune.quant.layerwise`` quantizes each layer alone with each candidate range and keeps the candidate whose
model output stays closest to FP32. On ONNX Runtime's CPU that took minutes for MiniLM on the GPU machine (its
probes run two threads each), while the GPU sat idle. ``TorchLayerProbe`` runs the same evaluations where the
backend builds: one FP32 copy of the factory's module on the device, and per candidate the layer's module
swapped for the ``Int8Linear`` a build would put there (same static scale, per-channel weights), then the whole
forward on every batch. The error is the backend's own: the int8 GEMM that plans run, not a Q/DQ simulation.

A whole forward per candidate costs milliseconds on a GPU, so nothing is cut out of the model (the ONNX probes
run only the part downstream of the layer, to save CPU time). A module that runs several ONNX layers is
quantized for all its calls, as a build must.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.torch.modules import activation_scale
from autotune.backends.torch.runtime import flatten_outputs
from autotune.backends.torch.wrappers import wrappers

if TYPE_CHECKING:
    from autotune.model import Layer


def _swap(root: Any, path: str, new: Any) -> Any:
    """Puts ``new`` at ``path`` (a submodule, not the root) and returns what was there."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, name)
    setattr(parent, name, new)
    return old


class TorchLayerProbe:
    """``autotune.quant.layerwise.LayerProbe`` on a torch device: each candidate as an ``Int8Linear`` in place.

    Args:
        module: The FP32 module (the factory's); a copy goes to ``device``, the original is left alone.
        bindings: ONNX layer name -> module path (``binding.bind_layers``).
        input_names: The model's input names, in the order the module takes them.
        device: ``cuda``, ``cuda:N`` or ``cpu``.
        per_channel: Weight scales per output channel (the plans' default granularity), else per tensor.
    """

    def __init__(
        self,
        module: Any,
        bindings: Mapping[str, str],
        input_names: Sequence[str],
        device: str,
        per_channel: bool = True,
    ):
        import copy

        self.device = device
        self.name = f"torch:{device}"
        self.bindings = dict(bindings)
        self.input_names = list(input_names)
        self.per_channel = per_channel
        self.module = copy.deepcopy(module).float().eval().to(device)
        self._references: dict[tuple[int, int], list[Any]] = {}
        self._feeds: dict[int, list[list[Any]]] = {}
        self.forwards = 0
        """Forward passes run so far (FP32 references included)."""

    def _inputs(self, batches: Sequence[Mapping[str, np.ndarray]]) -> list[list[Any]]:
        """The batches as tensors on the device, copied once per batch list."""
        import torch

        key = id(batches)
        if key not in self._feeds:
            self._feeds = {
                key: [
                    [torch.from_numpy(np.ascontiguousarray(batch[name])).to(self.device) for name in self.input_names]
                    for batch in batches
                ]
            }
            self._references = {}
        return self._feeds[key]

    def _output(self, feeds: Sequence[Any], output_index: int) -> Any:
        self.forwards += 1
        return flatten_outputs(self.module(*feeds))[output_index].float()

    def reference(self, batches: Sequence[Mapping[str, np.ndarray]], output_index: int) -> list[Any]:
        """The FP32 module's scored output per batch, on the device (computed once per batch list)."""
        import torch

        inputs = self._inputs(batches)
        key = (id(batches), output_index)
        if key not in self._references:
            with torch.no_grad():
                self._references[key] = [self._output(feeds, output_index) for feeds in inputs]
        return self._references[key]

    def noise(
        self,
        layer: Layer,
        candidates: Sequence[Mapping[str, tuple[float, float]]],
        batches: Sequence[Mapping[str, np.ndarray]],
        output_index: int,
    ) -> tuple[list[float], float]:
        """Per candidate, the summed squared error of the scored output; and the summed squared FP32 output.

        Raises:
            ValueError: The layer has no module, its module is not an ``nn.Linear``, or a candidate lacks the
                range of the layer's input.
        """
        import torch
        from torch import nn

        path = self.bindings.get(layer.name)
        if not path:
            raise ValueError(f"layer {layer.name} has no module of its own to quantize on {self.device}")
        original = self.module.get_submodule(path)
        if not isinstance(original, nn.Linear):
            raise ValueError(f"{layer.name}: int8 is for nn.Linear only, not {type(original).__name__}")
        tensor = layer.activation_inputs[0]
        references = self.reference(batches, output_index)
        inputs = self._inputs(batches)
        int8_linear = wrappers().Int8Linear
        noise = []
        with torch.no_grad():
            signal = float(sum(torch.square(out.double()).sum() for out in references))
            for ranges in candidates:
                if tensor not in ranges:
                    raise ValueError(f"no calibrated range for {tensor!r}, the input of {layer.name}")
                lo, hi = ranges[tensor]
                scale = activation_scale(float(lo), float(hi), "int8")
                quantized = int8_linear.from_linear(original, scale, self.per_channel).to(self.device)
                _swap(self.module, path, quantized)
                try:
                    total = sum(
                        torch.square(self._output(feeds, output_index).double() - ref.double()).sum()
                        for feeds, ref in zip(inputs, references, strict=True)
                    )
                finally:
                    _swap(self.module, path, original)
                noise.append(float(total))
        return noise, signal
