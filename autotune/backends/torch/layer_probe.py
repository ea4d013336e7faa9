"""The layerwise calibration's single-layer evaluations on the torch backend's own device.

``autotune.quant.layerwise`` quantizes each layer alone with each candidate range and keeps the candidate whose
model output stays closest to FP32. On ONNX Runtime's CPU that took minutes for MiniLM on the GPU machine (its
probes run two threads each), while the GPU sat idle. ``TorchLayerProbe`` runs the same evaluations where the
backend builds: one FP32 copy of the factory's module on the device, and per candidate the layer's module
swapped for the ``Int8Linear`` or ``Fp8Linear`` a build would put there (same static scale, per-channel weights;
a SmoothQuant candidate's weight columns times ``s`` behind a ``SmoothedInput``), then the whole forward on every
batch. The error is the backend's own: the GEMM that plans run, not a Q/DQ simulation.

A module that runs several ONNX layers is quantized for all its calls, as a build must. The forward is the whole
model's, except that the blocks of its longest ``nn.ModuleList`` (a transformer's layers) that ran before the
layer's module replay their FP32 outputs (``BlockReplay``), with the same errors to the last bit and in less time
(docs/method.md#measurements-behind-the-codes-choices). The ONNX probes likewise run only the part downstream of the
layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.torch.modules import activation_scale
from autotune.backends.torch.runtime import flatten_outputs
from autotune.backends.torch.wrappers import wrappers
from autotune.quant.probe import sample_powers

if TYPE_CHECKING:
    from autotune.model.layers import Layer


REPLAY_BYTES = 4 << 30
"""At most this much device memory holds the blocks' FP32 outputs for ``BlockReplay``; above it, no replay."""


def _clone(value: Any) -> Any:
    """A copy of a module's output whose tensors no later in-place op can change."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda item: item.clone() if hasattr(item, "clone") else item, value)


class BlockReplay:
    """The blocks of a module's longest ``nn.ModuleList``, replaying their FP32 outputs ahead of a probed layer.

    Recorded in the FP32 reference pass: each block's output per batch, and for each probed module how many blocks
    had finished before it first ran. Those blocks cannot depend on it, so a forward with the module quantized
    replays their outputs instead of computing them. The replay is used only once a forward with every block
    replayed reproduced the reference output exactly (a module whose blocks are called more than once, or depend
    on state the replay does not keep, is run whole).

    Args:
        module: The probe's FP32 module.
        paths: Module paths of the layers the probe quantizes.
    """

    def __init__(self, module: Any, paths: Sequence[str]):
        from torch import nn

        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
        self.blocks: list[Any] = list(max(lists, key=len)) if lists else []
        self.paths = list(paths)
        self.module = module
        self.outputs: list[list[Any]] = []  # per batch, per block
        self.finished_before: dict[str, int] = {}
        self.usable = False
        self._batch = 0

    def record(self, forward: Callable[[int], Any]) -> list[Any]:
        """Runs ``forward(batch)`` for every batch with the blocks watched; returns its results.

        ``forward`` is called with each batch index in turn until it returns None.
        """
        if not self.blocks:
            return self._all(forward)
        calls: list[list[Any]] = []
        handles = [
            block.register_forward_hook(lambda _, __, output, i=i: calls[-1].append((i, _clone(output))))
            for i, block in enumerate(self.blocks)
        ]
        for path in self.paths:

            def first_call(*_: Any, path: str = path) -> None:
                self.finished_before.setdefault(path, len(calls[-1]))

            handles.append(self.module.get_submodule(path).register_forward_pre_hook(first_call))
        results = []
        try:
            while True:
                calls.append([])
                result = forward(len(results))
                if result is None:
                    break
                results.append(result)
        finally:
            for handle in handles:
                handle.remove()
        calls.pop()
        in_order = all([i for i, _ in batch] == list(range(len(self.blocks))) for batch in calls)
        size = sum(t.numel() * t.element_size() for batch in calls for _, out in batch for t in _tensors(out))
        if calls and in_order and size <= REPLAY_BYTES:
            self.outputs = [[out for _, out in batch] for batch in calls]
            with self.replaying(len(self.blocks)):
                self._batch = 0
                self.usable = _equal(forward(0), results[0])
        return results

    def _all(self, forward: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = []
        while (result := forward(len(results))) is not None:
            results.append(result)
        return results

    def skipped(self, path: str) -> int:
        """How many blocks a forward with ``path`` quantized replays."""
        return self.finished_before.get(path, 0) if self.usable else 0

    def at_batch(self, index: int) -> None:
        """The batch whose outputs the replayed blocks return next."""
        self._batch = index

    @contextlib.contextmanager
    def replaying(self, count: int) -> Iterator[None]:
        """The first ``count`` blocks return their recorded outputs instead of running."""
        for index, block in enumerate(self.blocks[:count]):
            block.forward = lambda *_, index=index, **__: _clone(self.outputs[self._batch][index])
        try:
            yield
        finally:
            for block in self.blocks[:count]:
                del block.forward  # the class's forward again


def _tensors(value: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if hasattr(leaf, "numel")]


def _equal(got: Any, expected: Any) -> bool:
    import torch

    return got is not None and got.shape == expected.shape and bool(torch.equal(got, expected))


def _swap(root: Any, path: str, new: Any) -> Any:
    """Puts ``new`` at ``path`` (a submodule, not the root) and returns what was there."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, name)
    setattr(parent, name, new)
    return old


class TorchLayerProbe:
    """``autotune.quant.layerwise.LayerProbe`` on a torch device: each candidate as an int8/fp8 wrapper in place.

    Args:
        module: The FP32 module (the factory's); a copy goes to ``device``, the original is left alone.
        bindings: ONNX layer name -> module path (``binding.bind_layers``).
        input_names: The model's input names, in the order the module takes them.
        device: ``cuda``, ``cuda:N`` or ``cpu``.
        per_channel: Weight scales per output channel (the plans' default granularity), else per tensor.
        precision: What the candidates are measured in: ``int8`` (``Int8Linear``) or ``fp8`` (``Fp8Linear``
            with ``fp8_scaling``), the quantized Linears that pay on the device.
        fp8_scaling: ``rowwise`` or ``tensorwise`` (``DeviceInfo.fp8_scaling``), for ``fp8``.
    """

    def __init__(
        self,
        module: Any,
        bindings: Mapping[str, str],
        input_names: Sequence[str],
        device: str,
        per_channel: bool = True,
        precision: str = "int8",
        fp8_scaling: str = "rowwise",
    ):
        import copy

        if precision not in ("int8", "fp8"):
            raise ValueError(f"the layer probe measures int8 or fp8, not {precision!r}")
        self.device = device
        self.precision, self.fp8_scaling = precision, fp8_scaling
        self.name = f"torch:{device}" if precision == "int8" else f"torch:{device}:{precision}"
        self.bindings = dict(bindings)
        self.input_names = list(input_names)
        self.per_channel = per_channel
        self.module = copy.deepcopy(module).float().eval().to(device)
        self._references: dict[tuple[int, int], list[Any]] = {}
        self._feeds: dict[int, list[list[Any]]] = {}
        self.replay = BlockReplay(self.module, [])
        """The blocks replayed ahead of a probed layer, as recorded with the latest reference."""
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
            self.replay = BlockReplay(self.module, sorted({path for path in self.bindings.values() if path}))

            def forward(index: int) -> Any:
                return self._output(inputs[index], output_index) if index < len(inputs) else None

            with torch.no_grad():
                self._references[key] = self.replay.record(forward)
        return self._references[key]

    def channel_ranges(
        self, layers: Sequence[Layer], batches: Sequence[Mapping[str, np.ndarray]]
    ) -> dict[str, tuple[list[float], list[float]]]:
        """Per input tensor of ``layers``, its per-channel ``(min, max)`` over the batches (what smoothing needs).

        Read on the device from the input of each layer's module (the last axis is the channel); a module called
        several times per forward gives the union of its calls.

        Raises:
            ValueError: A layer has no module.
        """
        import torch

        paths: dict[str, list[str]] = {}
        for layer in layers:
            path = self.bindings.get(layer.name)
            if not path:
                raise ValueError(f"layer {layer.name} has no module of its own on {self.device}")
            paths.setdefault(path, []).append(layer.activation_inputs[0])
        found: dict[str, list[Any]] = {}

        def hook(path: str) -> Callable[..., None]:
            def record(_: Any, args: tuple[Any, ...]) -> None:
                flat = args[0].detach().float().reshape(-1, args[0].shape[-1])
                lo, hi = flat.amin(dim=0), flat.amax(dim=0)
                if path in found:
                    lo, hi = torch.minimum(found[path][0], lo), torch.maximum(found[path][1], hi)
                found[path] = [lo, hi]

            return record

        handles = [self.module.get_submodule(path).register_forward_pre_hook(hook(path)) for path in paths]
        try:
            with torch.no_grad():
                for feeds in self._inputs(batches):
                    self.module(*feeds)
        finally:
            for handle in handles:
                handle.remove()
        ranges = {}
        for path, tensors in paths.items():
            lo, hi = (values.cpu().double().tolist() for values in found[path])
            ranges.update({tensor: (lo, hi) for tensor in tensors})
        return ranges

    def _quantized(self, original: Any, lo: float, hi: float, factors: np.ndarray | None) -> Any:
        """The module a build puts in ``original``'s place: smoothed first where ``factors`` are given."""
        import copy

        from autotune.backends.torch.smoothing import scale_columns, smoothed_input

        linear = original
        if factors is not None:
            linear = copy.deepcopy(original)
            scale_columns(linear, np.asarray(factors, dtype=np.float32))
        scale = activation_scale(float(lo), float(hi), self.precision)
        modules = wrappers()
        if self.precision == "int8":
            quantized = modules.Int8Linear.from_linear(linear, scale, self.per_channel)
        else:
            quantized = modules.Fp8Linear.from_linear(linear, scale, self.per_channel, self.fp8_scaling)
        if factors is not None:
            quantized = smoothed_input(quantized, np.asarray(factors, dtype=np.float32))
        return quantized.to(self.device)

    def noise(
        self,
        layer: Layer,
        candidates: Sequence[Mapping[str, tuple[float, float]]],
        batches: Sequence[Mapping[str, np.ndarray]],
        output_index: int,
        smoothing: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[float], float]:
        """Per candidate, the scored output's noise-to-signal summed over the samples; and how many samples.

        A sample's noise-to-signal is its squared error over its FP32 output's power
        (``autotune.quant.probe.sample_powers``). ``smoothing`` holds each candidate's SmoothQuant factors or None:
        a smoothed candidate's range is that of ``x / s``, and its module is smoothed as a build smooths it.

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
            raise ValueError(f"{layer.name}: {self.precision} is for nn.Linear only, not {type(original).__name__}")
        tensor = layer.activation_inputs[0]
        references = self.reference(batches, output_index)
        inputs = self._inputs(batches)
        factors_of = list(smoothing) if smoothing is not None else [None] * len(candidates)
        noise = []
        replay = self.replay
        with torch.no_grad(), replay.replaying(replay.skipped(path)):
            # One floor and one measure with the ONNX probes: the numpy powers, moved to the device once per layer.
            powers = [
                torch.as_tensor(sample_powers(out.double().cpu().numpy()), device=out.device) for out in references
            ]
            samples = float(sum(len(power) for power in powers))
            for ranges, factors in zip(candidates, factors_of, strict=True):
                if tensor not in ranges:
                    raise ValueError(f"no calibrated range for {tensor!r}, the input of {layer.name}")
                quantized = self._quantized(original, *ranges[tensor], factors)
                _swap(self.module, path, quantized)
                total = 0.0
                try:
                    for index, (feeds, ref) in enumerate(zip(inputs, references, strict=True)):
                        replay.at_batch(index)
                        error = (self._output(feeds, output_index).double() - ref.double()).reshape(len(ref), -1)
                        total += float((torch.square(error).sum(dim=1) / powers[index]).sum())
                finally:
                    _swap(self.module, path, original)
                noise.append(total)
        return noise, samples
