"""``TorchBackend``: PyTorch on NVIDIA GPUs (eager on the CPU for tests), a plan built as a module rewrite.

``prepare`` maps the layer table onto the factory's modules (``binding.py``); ``build`` rewrites a copy of the
FP32 module with each chosen module's wrapper (``modules.py``), then compiles, warms up and captures it
(``runtime.py``); ``export`` writes the files ``load_exported`` rebuilds it from (``export.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.base import Backend, BackendUnavailable, BuildError
from autotune.backends.torch.binding import bind_layers, count_calls
from autotune.backends.torch.device import FALLBACK_KNOBS, probe_device, torch_capabilities
from autotune.backends.torch.export import write_export
from autotune.backends.torch.modules import module_choices, rewrite_module
from autotune.backends.torch.runtime import TorchArtifact, make_artifact, run_once, time_launch
from autotune.capabilities import Capabilities
from autotune.config import TorchOptions
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, KnobValue, Plan
from autotune.quant.lowering import Quantization
from autotune.quant.recipe import TORCH

if TYPE_CHECKING:
    from autotune.model import LoadedModel

NEEDS_FACTORY = (
    "the torch backend needs model.torch: a 'package.module:function' factory; "
    "ONNX-only models run on onnxruntime or tensorrt"
)


class TorchBackend(Backend):
    """PyTorch modules on an NVIDIA GPU (or eager on the CPU for tests), built straight from plans.

    Args:
        factory: ``model.torch``, the ``package.module:function`` that returns the FP32 module.
        options: ``backend.options`` (``autotune.config.TorchOptions``): ``device`` is ``cuda`` (the default),
            ``cuda:N``, or ``cpu`` for eager CPU runs.

    Raises:
        BackendUnavailable: No factory (an ONNX-only model), or no CUDA device for ``device: cuda``.
        TypeError: ``options`` is not a ``TorchOptions`` (validate a dict with ``autotune.config.BackendConfig``).
    """

    name = "torch"
    recipe = TORCH

    def __init__(self, factory: str | None, options: TorchOptions | None = None):
        if not factory:
            raise BackendUnavailable(NEEDS_FACTORY)
        if options is not None and not isinstance(options, TorchOptions):
            # Another backend's options (or a raw dict) would fail later with an obscure attribute error.
            raise TypeError(f"TorchBackend takes autotune.config.TorchOptions, got {type(options).__name__}")
        self.options = options if options is not None else TorchOptions()
        self.factory = factory
        self.device = self.options.device
        self.info = probe_device(self.device)
        if not self.info.available:
            cpu_build = "+cpu" in self.info.torch_version
            raise BackendUnavailable(
                f"the torch backend found no CUDA device {self.device!r} (torch {self.info.torch_version}"
                f"{', a CPU-only build' if cpu_build else ''}{'; ' + self.info.name if self.info.name else ''}); "
                f"run it on an NVIDIA GPU, or set backend.options.device: cpu for eager runs on the CPU"
            )
        self._capabilities = torch_capabilities(self.info)
        self._fp32: Any = None
        self._bindings: dict[str, str] = {}
        self._output_shapes: list[tuple[int, ...]] = []
        self.model: LoadedModel | None = None

    # -- setup

    def capabilities(self) -> Capabilities:
        """Precisions and knobs of this device and torch (``torch_capabilities``); no SmoothQuant."""
        return self._capabilities

    def fp32_module(self) -> Any:
        """The factory's module in eval mode on the CPU, made once; builds rewrite deep copies of it."""
        if self._fp32 is None:
            from autotune.model import resolve_callable

            module = resolve_callable(self.factory)()
            self._fp32 = module.eval()
        return self._fp32

    def prepare(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Maps the layer table onto the factory's modules and checks that the weights are the exported ones.

        Raises:
            ValueError: A searched layer has no module (the message names ``search.exclude_layers``), or the
                factory's weights differ from the ONNX export's.
        """
        from autotune.model import weight_array

        output_shapes = [
            tuple(d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim)
            for value in model.proto.graph.output
        ]
        module = self.fp32_module()
        paths = set(bind_layers(module, model.layers, ()).values())
        self._bindings = bind_layers(
            module,
            model.layers,
            set(searched),
            lambda name: weight_array(model.proto, name),
            count_calls(module, list(model.inputs), paths),
        )
        # Only a model that binds is kept: build refuses to run before a successful prepare.
        self.model, self._output_shapes = model, output_shapes

    def knob_values(self, knobs: Mapping[str, KnobValue]) -> dict[str, KnobValue]:
        """Every backend knob's value for a plan's knobs: given, else the default (``FALLBACK_KNOBS`` if absent).

        Raises:
            BuildError: An unknown knob, or a value the device does not offer.
        """
        offered = {knob.name: knob for knob in self._capabilities.knobs}
        values = dict(FALLBACK_KNOBS) | {knob.name: knob.default for knob in offered.values()}
        for name, value in knobs.items():
            if name in (CALIBRATION_KNOB, GRANULARITY_KNOB):
                continue
            if name not in offered:
                raise BuildError(
                    f"unknown knob {name!r} for the torch backend on {self.device}; knobs: {sorted(offered)}"
                )
            if not any(type(value) is type(v) and value == v for v in offered[name].values):
                raise BuildError(f"knob {name}={value!r} is not offered; allowed {list(offered[name].values)}")
            values[name] = value
        return values

    # -- build

    def build(self, plan: Plan, quantization: Quantization, workdir: Path) -> TorchArtifact:
        """Rewrites the module, moves it to the device, compiles it, warms it up and captures a CUDA graph.

        Args:
            plan: Precision per layer and the knobs.
            quantization: The calibrated ranges (``ranges``, and ``layer_ranges`` for ``layerwise``); the static
                activation scales of int8 and fp8 modules come from them.
            workdir: Unused: the module lives in memory.

        Raises:
            BuildError: The plan or the knobs do not fit, SmoothQuant factors came with it, or any step failed
                (the message says which).
        """
        if self._fp32 is None or self.model is None:
            raise BuildError("the torch backend builds only after prepare(model, searched)")
        if quantization.smoothing:
            # Smoothed ranges belong to x / s, and the rewritten module sees x: its scales would be wrong.
            raise BuildError(
                f"the torch backend takes no SmoothQuant factors (capabilities().smoothing is False), "
                f"got them for {sorted(quantization.smoothing)}"
            )
        knobs = self.knob_values(plan.knob_map)
        choices = module_choices(
            plan, self.model.layers, self._bindings, quantization.ranges, quantization.layer_ranges
        )
        per_channel = plan.knob(GRANULARITY_KNOB, "per_channel") == "per_channel"
        self._release_memory()
        try:
            module = rewrite_module(self.fp32_module(), choices, per_channel, self.info.fp8_scaling)
            artifact = make_artifact(module, self.model.inputs, self.device, knobs, self._output_shapes)
        except BuildError:
            raise
        except Exception as error:  # noqa: BLE001 - compile, capture and kernel errors come in many types
            raise BuildError(f"{type(error).__name__}: {error}") from error
        artifact.choices = {path: choice.precision for path, choice in choices.items()}
        return artifact

    def _release_memory(self) -> None:
        """Frees the previous trial's module and graph before the next build allocates its own."""
        gc.collect()
        if self.info.is_cuda:
            import torch

            torch.cuda.empty_cache()

    # -- run

    def run(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch; floating outputs come back as float32 numpy arrays, in output order."""
        return run_once(artifact, feeds)

    def time_run(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> float:
        """Milliseconds of one launch: CUDA events on the artifact's stream, the wall clock on the CPU.

        The feeds are copied in only when they are not the ones staged last, and the copy is not timed.
        """
        return time_launch(artifact, feeds)

    # -- export

    def export(self, artifact: TorchArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes the loadable module and how to rebuild it; returns the paths, ``module_state.pt`` first.

        Files: ``module_state.pt``, ``rebuild.py``, ``manifest.json``, ``plan.json``, and ``exported.pt2`` or
        ``export_notes.txt`` (``autotune.backends.torch.export.write_export``).

        Raises:
            BuildError: Called before ``prepare``.
        """
        if self.model is None:
            raise BuildError("the torch backend exports only after prepare(model, searched)")
        return write_export(artifact, plan, out_dir, self.factory, self.model.inputs, self.info)
