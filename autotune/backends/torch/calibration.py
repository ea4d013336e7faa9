"""Activation statistics gathered on the torch backend's own device, for the run's calibration.

ONNX Runtime's CPU took seconds for the BERT-large-shaped encoder's one calibration batch where the GPU runs the FP32
forward in milliseconds (docs/method.md#measurements-behind-the-codes-choices). The tensors are the same: the input of
the module an ONNX
layer is bound to (``binding.bind_layers``) is that layer's activation input. They are binned where they are
(``TensorStats.update_binned``, the same float64 division and truncation as on the CPU), so only the counts leave the
device: copying the encoder's activation values to the host and binning them there was most of what this stage
took. The values differ from ONNX Runtime's in the last bits of float32 (other GEMM kernels), so the
calibration cache keeps them apart (``StatisticsCollector.source``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.quant.calibrate import nonfinite_error
from autotune.quant.histogram import TensorStats

if TYPE_CHECKING:
    from autotune.model.layers import Layer


def module_inputs(
    layers: Sequence[Layer], bindings: Mapping[str, str], calls: Mapping[str, int], tensors: Sequence[str]
) -> dict[str, str] | None:
    """Which module's input each tensor is, or None unless every tensor is the input of a module called once.

    A module called more than once per forward sees other values on each call, which belong to other tensors of the
    ONNX graph; a tensor that is no bound module's input (an activation MatMul's, a quantized output) has no hook.

    Args:
        layers: The layer table.
        bindings: ONNX layer name -> module path (``binding.bind_layers``).
        calls: Module path -> calls per forward pass (``binding.count_calls``).
        tensors: The tensors the calibration needs.
    """
    paths: dict[str, str] = {}
    for layer in layers:
        path = bindings.get(layer.name)
        if path is not None and calls.get(path) == 1 and len(layer.activation_inputs) == 1:
            paths.setdefault(layer.activation_inputs[0], path)
    if any(name not in paths for name in tensors):
        return None
    return {name: paths[name] for name in dict.fromkeys(tensors)}


def collect_module_statistics(
    module: Any,
    sources: Mapping[str, str],
    input_names: Sequence[str],
    device: str,
    batches: Sequence[Mapping[str, np.ndarray]],
    num_bins: int,
) -> dict[str, TensorStats]:
    """Runs an FP32 copy of ``module`` on ``device`` over the batches and gathers the statistics of its inputs.

    Args:
        module: The FP32 module (the factory's); a copy goes to ``device``, the original is left alone.
        sources: Tensor name -> the path of the module whose input it is (``module_inputs``).
        input_names: The model's input names, in the order the module takes them.
        device: ``cuda``, ``cuda:N`` or ``cpu``.
        batches: Calibration feeds by input name.
        num_bins: Histogram bins over the first batch's range.

    Returns:
        Statistics by tensor name, in the order of ``sources``.

    Raises:
        ValueError: A tensor has NaN or Inf values (the message names it and the batch), or ``batches`` is empty.
    """
    import copy

    import torch

    if not batches:
        raise ValueError("calibration data is empty")
    on_device = copy.deepcopy(module).float().eval().to(device)
    binning = _InputBinning(sources, num_bins)
    handles = binning.attach(on_device)
    try:
        with torch.no_grad():
            for binning.batch_index, batch in enumerate(batches):
                feeds = [torch.from_numpy(np.ascontiguousarray(batch[name])).to(device) for name in input_names]
                on_device(*feeds)
    finally:
        for handle in handles:
            handle.remove()
        del on_device
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return binning.stats


class _InputBinning:
    """Forward pre-hooks that bin each hooked module's input into the statistics of the tensors it stands for.

    Binned as the forward reaches each module, one activation at a time is held (the encoder's all: 4.3 GB).

    Attributes:
        stats: Statistics by tensor name, in the order of the sources.
        batch_index: The batch the forward runs now (named when a tensor is not finite).
    """

    def __init__(self, sources: Mapping[str, str], num_bins: int):
        self._tensors_of: dict[str, list[str]] = defaultdict(list)
        for name, path in sources.items():
            self._tensors_of[path].append(name)
        self.stats = {name: TensorStats.empty(num_bins) for name in sources}
        self.batch_index = 0

    def attach(self, module: Any) -> list[Any]:
        """Registers a hook on every source submodule of ``module``; returns the handles that remove them."""
        return [module.get_submodule(path).register_forward_pre_hook(self._hook(path)) for path in self._tensors_of]

    def _hook(self, path: str) -> Callable[[Any, tuple[Any, ...]], None]:
        def hook(_: Any, args: tuple[Any, ...]) -> None:
            for name in self._tensors_of[path]:
                try:
                    update_on_device(self.stats[name], args[0].detach())
                except ValueError:
                    raise nonfinite_error(name, self.batch_index) from None

        return hook


_CHUNK = 1 << 24
"""Values binned per pass on the device: the float64 magnitudes and int64 bins of a chunk take 256 MiB."""


def update_on_device(stats: TensorStats, tensor: Any) -> None:
    """Merges a torch tensor into ``stats`` where it lies: the counts ``TensorStats.update`` gives its values.

    Raises:
        ValueError: The tensor holds NaN or Inf.
    """
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return
    if not flat.is_floating_point():
        flat = flat.double()
    low, high = torch.aminmax(flat)

    def bin_counts(bin_width: float, length: int) -> np.ndarray:
        counts = torch.zeros(length, dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            # IEEE float64 division and truncation toward zero, as numpy's: the same bin for every value
            bins = flat[start : start + _CHUNK].abs().double().div_(bin_width).long().clamp_(max=length - 1)
            counts += torch.bincount(bins, minlength=length)
        return counts.cpu().numpy()

    stats.update_binned(float(low), float(high), flat.numel(), bin_counts)
