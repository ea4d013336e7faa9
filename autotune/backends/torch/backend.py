"""``TorchBackend``: PyTorch on NVIDIA GPUs (eager on the CPU for tests), a plan built as a module rewrite.

``prepare`` maps the layer table onto the factory's modules (``binding.py``); ``build`` rewrites a copy of the
FP32 module with each chosen module's wrapper (``modules.py``), then compiles, warms up and captures it
(``runtime.py``); ``export`` writes the files ``load_exported`` rebuilds it from (``export.py``).
``build_reference`` builds the one-liners a user would write instead (``model.to(dtype)`` and
``torch.compile(mode="reduce-overhead")`` on the module as its users load it, SDPA attention where transformers
would pick it; torchao's FP8 dynamic one-liner where the GPU has FP8), measured like plans.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.base import Backend, BackendUnavailable, BuildError
from autotune.backends.torch.attention import attention_implementations
from autotune.backends.torch.binding import bind_layers, count_calls
from autotune.backends.torch.device import (
    ATTENTION_KNOB,
    BASE_PRECISION_KNOB,
    CUDA_GRAPHS_KNOB,
    FALLBACK_KNOBS,
    MODE_KNOB,
    REDUCE_OVERHEAD,
    TF32_KNOB,
    DeviceInfo,
    probe_in_background,
    torch_capabilities,
)
from autotune.backends.torch.export import write_export
from autotune.backends.torch.layer_probe import TorchLayerProbe
from autotune.backends.torch.modules import ModuleSmoothing, module_choices, rewrite_module
from autotune.backends.torch.runtime import TorchArtifact, make_artifact, run_once, time_back_to_back, time_launch
from autotune.backends.torch.smoothing import FoldFinder, sample_inputs
from autotune.backends.torch.torchao_linear import TORCHAO, TORCHAO_MODULE, torchao
from autotune.capabilities import Capabilities
from autotune.config.schema import TorchOptions
from autotune.extras import MissingExtra, check_installed
from autotune.plan import CALIBRATION_KNOB, GRANULARITY_KNOB, KnobValue, Plan
from autotune.quant.lowering import Quantization
from autotune.quant.recipe import TORCH

if TYPE_CHECKING:
    from autotune.model.layers import LoadedModel
    from autotune.quant.calibrate import StatisticsCollector

NEEDS_FACTORY = (
    "the torch backend needs model.torch: a 'package.module:function' factory; "
    "ONNX-only models run on onnxruntime or tensorrt"
)

REFERENCES: dict[str, tuple[str, bool]] = {
    "torch-tf32": ("fp32", True),
    "torch-fp16": ("fp16", False),
    "torch-bf16": ("bf16", False),
}
"""The one-liner references: name -> (the dtype the whole module is converted to, the TF32 flag). FP32 itself is
the run's reference (the all-FP32 plan)."""

TORCHAO_FP8_REFERENCE = "torchao-fp8"
"""torchao's FP8 one-liner on the BF16 module: ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow()))``, every ``nn.Linear`` with dynamic per-row FP8 activations and weights, then
``torch.compile(mode="reduce-overhead")``. Offered where a Linear may take fp8 on CUDA and torchao is installed."""
TORCHAO_FP8_BASE = "bf16"
"""The dtype of the module torchao's FP8 one-liner quantizes: torchao's FP8 recipes are written for BF16 models."""


def has_convolutions(module: Any) -> bool:
    """True when ``module`` holds a convolution (``nn.Conv1d/2d/3d`` or a transposed one), what cuDNN's search tunes."""
    from torch import nn

    return any(isinstance(sub, nn.modules.conv._ConvNd) for sub in module.modules())


def torchao_installed() -> bool:
    """True when torchao can be imported (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def quantize_fp8_dynamic(module: Any) -> None:
    """Applies torchao's FP8 one-liner to ``module`` in place: dynamic per-row FP8 for every ``nn.Linear``.

    ``set_inductor_config`` stays off: torchao's inductor settings are process-wide and would change every later
    build of the process (``torchao_linear.py`` says the same of the static configs).
    """
    quantization = torchao()
    config = quantization.Float8DynamicActivationFloat8WeightConfig(
        granularity=quantization.PerRow(), set_inductor_config=False
    )
    quantization.quantize_(module, config)


class TorchBackend(Backend):
    """PyTorch modules on an NVIDIA GPU (or eager on the CPU for tests), built straight from plans.

    Args:
        factory: ``model.torch``, the ``package.module:function`` that returns the FP32 module.
        options: ``backend.options`` (``autotune.config.schema.TorchOptions``): ``device`` is ``cuda`` (the default),
            ``cuda:N``, or ``cpu`` for eager CPU runs.

    Raises:
        BackendUnavailable: No factory (an ONNX-only model), or no CUDA device for ``device: cuda``.
        TypeError: ``options`` is not a ``TorchOptions`` (validate a dict with
            ``autotune.config.schema.BackendConfig``).
    """

    exports_batch_free = True
    runs_on_gpu = True

    name = "torch"
    recipe = TORCH
    # A second build of the FP32 reference would run the same kernels in the same kind of CUDA graph, on a second
    # copy of the weights on the device (when it was compiled, 6-15 s on the H200 for MiniLM and the encoder).
    reuses_fp32_build = True

    def __init__(self, factory: str | None, options: TorchOptions | None = None):
        if not factory:
            raise BackendUnavailable(NEEDS_FACTORY)
        if options is not None and not isinstance(options, TorchOptions):
            # Another backend's options (or a raw dict) would fail later with an obscure attribute error.
            raise TypeError(f"TorchBackend takes autotune.config.schema.TorchOptions, got {type(options).__name__}")
        self.options = options if options is not None else TorchOptions()
        self.factory = factory
        self.device = self.options.device
        # The probe of a CUDA device runs in a child process for seconds (torch's import and CUDA's start: 11-13 s
        # on a cold H200 machine); the run's process exports the model meanwhile, and waits at the first ``info``.
        self._probe = probe_in_background(self.device)
        self._info: DeviceInfo | None = None
        if self.options.quantized_gemm == TORCHAO:
            try:  # checked, not imported: the run's process never builds, the trial process imports it
                check_installed(*TORCHAO_MODULE)
            except MissingExtra as error:
                raise BackendUnavailable(str(error)) from error
        self._capabilities: Capabilities | None = None
        self._built = False
        self._fp32: Any = None
        self._bindings: dict[str, str] = {}
        self._calls: dict[str, int] = {}
        self._output_shapes: list[tuple[int, ...]] = []
        self._finder: FoldFinder | None = None
        self.model: LoadedModel | None = None

    # -- setup

    @property
    def info(self) -> DeviceInfo:
        """What the device offers (``probe_device``), once its probe has ended.

        Raises:
            BackendUnavailable: No such CUDA device (the message says how to run on the CPU), or the probe failed.
        """
        if self._info is None:
            info = self._probe.result()
            if not info.available:
                cpu_build = "+cpu" in info.torch_version
                raise BackendUnavailable(
                    f"the torch backend found no CUDA device {self.device!r} (torch {info.torch_version}"
                    f"{', a CPU-only build' if cpu_build else ''}{'; ' + info.name if info.name else ''}); "
                    f"run it on an NVIDIA GPU, or set backend.options.device: cpu for eager runs on the CPU"
                )
            self._info = info
        return self._info

    def capabilities(self) -> Capabilities:
        """Precisions and knobs of this device, torch and module (``torch_capabilities``); SmoothQuant included.

        The ``attention`` knob depends on the module (``attention_implementations``), and whether
        ``cudnn_benchmark`` is free on whether it has convolutions, so the first call makes the factory's module;
        ``prepare`` needs it anyway.
        """
        if self._capabilities is None:
            module = self.fp32_module()
            self._capabilities = torch_capabilities(
                self.info, attention_implementations(module), has_convolutions(module)
            )
        return self._capabilities

    def fp32_reference_knobs(self) -> dict[str, KnobValue]:
        """The FP32 reference runs eager, replayed from one CUDA graph: no ``torch.compile``.

        Its cold compile was most of a first run's set-up on the H200, where the eager module captured in under a
        second and ran about as fast (docs/method.md#measurements-behind-the-codes-choices). A reference is a clock and
        the model's own outputs, not a contender: the one-liners
        (``references``) and the search's plans are compiled. On the CPU every build is eager already.
        """
        offered = {knob.name for knob in self.capabilities().knobs}
        wanted = {MODE_KNOB: "eager", CUDA_GRAPHS_KNOB: True}
        return {name: value for name, value in wanted.items() if name in offered}

    def load_ahead(self) -> None:
        """Makes the factory's module and reads the device's capabilities (a transformers model: 4-9 s on the H200).

        Not inductor's compile workers, which torch starts at the first compile: started here, on a first run they
        shared the cores with the run's export (MiniLM's set-up 40 s against 35 s).
        """
        self.capabilities()

    def fp32_module(self) -> Any:
        """The factory's module in eval mode on the CPU, made once; builds rewrite deep copies of it."""
        if self._fp32 is None:
            from autotune.model.layers import factory_module

            self._fp32 = factory_module(self.factory)
        return self._fp32

    def prepare(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Maps the layer table onto the factory's modules and checks that the weights are the exported ones.

        Raises:
            ValueError: A searched layer has no module (the message names ``search.exclude_layers``), or the
                factory's weights differ from the ONNX export's.
        """
        from autotune.model.layers import weight_array

        output_shapes = [
            tuple(d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim)
            for value in model.proto.graph.output
        ]
        module = self.fp32_module()
        paths = set(bind_layers(module, model.layers, ()).values())
        calls = count_calls(module, list(model.inputs), paths)
        self._bindings = bind_layers(
            module, model.layers, set(searched), lambda name: weight_array(model.proto, name), calls
        )
        self._calls = calls
        # Only a model that binds is kept: build refuses to run before a successful prepare.
        self.model, self._output_shapes, self.searched = model, output_shapes, tuple(searched)

    def knob_values(self, knobs: Mapping[str, KnobValue]) -> dict[str, KnobValue]:
        """Every backend knob's value for a plan's knobs: given, else the default (``FALLBACK_KNOBS`` if absent).

        Raises:
            BuildError: An unknown knob, or a value the device does not offer.
        """
        offered = {knob.name: knob for knob in self.capabilities().knobs}
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
                activation scales of int8 and fp8 modules come from them. Its SmoothQuant factors (``layerwise``)
                smooth the int8 and fp8 Linears they name (``smoothing.py``).
            workdir: Unused: the module lives in memory.

        Raises:
            BuildError: The plan or the knobs do not fit, or any step failed (the message says which).
        """
        if self._fp32 is None or self.model is None:
            raise BuildError("the torch backend builds only after prepare(model, searched)")
        knobs = self.knob_values(plan.knob_map)
        base = str(knobs[BASE_PRECISION_KNOB])
        choices = module_choices(
            plan, self.model.layers, self._bindings, quantization.ranges, quantization.layer_ranges, base
        )
        per_channel = plan.knob(GRANULARITY_KNOB, "per_channel") == "per_channel"
        smoothing = self._smoothing(choices, quantization.smoothing)
        artifact = self._make(choices, knobs, per_channel, smoothing=smoothing)
        artifact.choices = {path: choice.precision for path, choice in choices.items()}
        return artifact

    def _smoothing(self, choices: Mapping[str, Any], factors: Mapping[str, np.ndarray]) -> ModuleSmoothing | None:
        """The SmoothQuant factors of the int8/fp8 modules by module path, with the fold finder; None if none.

        Factors of layers that run in a float precision are left out: they would only add a multiply.

        Raises:
            BuildError: Two layers of one module came with different factors.
        """
        by_path: dict[str, np.ndarray] = {}
        for layer, layer_factors in factors.items():
            path = self._bindings.get(layer)
            choice = choices.get(path) if path is not None else None
            if choice is None or choice.precision not in ("int8", "fp8"):
                continue
            if path in by_path and not np.array_equal(by_path[path], layer_factors):
                raise BuildError(f"module {path!r} runs several layers with different SmoothQuant factors")
            by_path[path] = np.asarray(layer_factors, dtype=np.float32)
        if not by_path:
            return None
        if self._finder is None:
            self._finder = FoldFinder(self.fp32_module(), sample_inputs(self.model.inputs))
        return ModuleSmoothing(by_path, self._finder)

    def _make(
        self,
        choices: Mapping[str, Any],
        knobs: dict[str, KnobValue],
        per_channel: bool = True,
        quantize: Callable[[Any], None] | None = None,
        smoothing: ModuleSmoothing | None = None,
    ) -> TorchArtifact:
        """Rewrites a copy of the FP32 module (``rewrite_module``) and makes it an artifact (``make_artifact``).

        ``quantize`` changes the rewritten copy in place before it is compiled (a one-liner's torchao call);
        ``smoothing`` smooths its int8/fp8 Linears (``ModuleSmoothing``).

        Raises:
            BuildError: Any step failed; the message says which.
        """
        attention = knobs.get(ATTENTION_KNOB)
        self._release_memory()
        started = time.perf_counter()
        try:
            module = rewrite_module(
                self.fp32_module(),
                choices,
                per_channel,
                self.info.fp8_scaling,
                base=str(knobs[BASE_PRECISION_KNOB]),
                attention=None if attention is None else str(attention),
                quantized_gemm=self.options.quantized_gemm,
                smoothing=smoothing,
            )
            if quantize is not None:
                quantize(module)
            rewrite_s = time.perf_counter() - started
            artifact = make_artifact(module, self.model.inputs, self.device, knobs, self._output_shapes)
            artifact.build_stages_s = {"rewrite": rewrite_s, **artifact.build_stages_s}
            return artifact
        except BuildError:
            raise
        except Exception as error:  # noqa: BLE001 - compile, capture and kernel errors come in many types
            raise BuildError(f"{type(error).__name__}: {error}") from error

    def statistics_collector(self, tensors: Sequence[str]) -> StatisticsCollector | None:
        """On CUDA, the calibration's statistics from the factory's module on the GPU (``calibration.py``).

        None on the CPU (ONNX Runtime runs the graph, as for every backend) and where a tensor is not the input of a
        module called once per forward (``module_inputs``).
        """
        if not self.info.is_cuda or self.model is None:
            return None
        from autotune.backends.torch.calibration import collect_module_statistics, module_inputs
        from autotune.quant.calibrate import StatisticsCollector

        sources = module_inputs(self.model.layers, self._bindings, self._calls, tensors)
        if sources is None:
            return None
        names = [spec.name for spec in self.model.inputs]
        module, device = self.fp32_module(), self.device
        return StatisticsCollector(
            f"torch:{self.info.name}",
            lambda batches, num_bins: collect_module_statistics(module, sources, names, device, batches, num_bins),
        )

    def layer_probe(self) -> TorchLayerProbe | None:
        """On CUDA, the layerwise calibration's single-layer evaluations on the GPU (``layer_probe.py``).

        On the CPU, None: they run on ONNX Runtime as for every backend, with the same results as before. Where a
        Linear may take fp8, the candidates are measured in FP8 (``Fp8Linear``), the quantized GEMM that pays on
        such a GPU, else in INT8; the SmoothQuant candidates are smoothed as builds smooth them.
        """
        if not self.info.is_cuda or self.model is None:
            return None
        names = [spec.name for spec in self.model.inputs]
        fp8 = any("fp8" in choices for choices in self.capabilities().precisions.values())
        return TorchLayerProbe(
            self.fp32_module(),
            self._bindings,
            names,
            self.device,
            precision="fp8" if fp8 and self.info.fp8_scaling else "int8",
            fp8_scaling=self.info.fp8_scaling or "rowwise",
        )

    # -- the one-liner references

    def references(self) -> tuple[str, ...]:
        """The one-liners this device runs: the names of ``REFERENCES`` it offers.

        ``torch-tf32`` where there is a ``tf32`` knob, ``torch-fp16`` and ``torch-bf16`` where ``base_precision``
        offers them, ``torchao-fp8`` (``TORCHAO_FP8_REFERENCE``) on CUDA where a Linear may take fp8 on a BF16
        base and torchao is installed. FP32 is the run's reference already.
        """
        capabilities = self.capabilities()
        offered = {knob.name: knob.values for knob in capabilities.knobs}
        bases = offered.get(BASE_PRECISION_KNOB, ("fp32",))
        names = [name for name, (base, tf32) in REFERENCES.items() if (TF32_KNOB in offered if tf32 else base in bases)]
        fp8_linears = any("fp8" in choices for choices in capabilities.precisions.values())
        if self.info.is_cuda and fp8_linears and TORCHAO_FP8_BASE in bases and torchao_installed():
            names.append(TORCHAO_FP8_REFERENCE)
        return tuple(names)

    def build_reference(
        self, name: str, calibration: Sequence[Mapping[str, np.ndarray]] = (), workdir: Path | None = None
    ) -> TorchArtifact:
        """Builds a one-liner, the users' module ``.to(dtype)`` under ``torch.compile(mode="reduce-overhead")``.

        That is compiled and in inductor's CUDA graphs, what a user writes; ``torch-tf32`` sets the flag only,
        ``torchao-fp8`` quantizes the BF16 module's Linears with torchao first (``quantize_fp8_dynamic``). The
        module runs the attention its users get (the ``attention`` knob's default: SDPA where transformers would
        pick it, not the eager attention a factory sets for the ONNX export). The CUDA flags other than TF32 are
        the knob defaults, as the FP32 reference's are, so the one-liner differs from the search's FP32 plan only
        in what its name says.
        On the CPU it runs eager, as every build there.

        Args:
            name: One of ``references()``.
            calibration: Unused: no one-liner of this backend calibrates.
            workdir: Unused: the module lives in memory.

        Raises:
            BuildError: An unknown or unoffered name, no ``prepare`` yet, or the build failed.
        """
        if name not in self.references():
            raise BuildError(f"the torch backend on {self.device} has no reference {name!r}: {self.references()}")
        if self._fp32 is None or self.model is None:
            raise BuildError("the torch backend builds only after prepare(model, searched)")
        base, tf32 = REFERENCES.get(name, (TORCHAO_FP8_BASE, False))
        knobs = self.knob_values({})  # the attention knob's default is the users' (attention_implementations)
        knobs[BASE_PRECISION_KNOB] = base
        if self.info.is_cuda:
            knobs[TF32_KNOB] = tf32
            if knobs[MODE_KNOB] != "eager":  # torch.compile works here
                knobs[MODE_KNOB], knobs[CUDA_GRAPHS_KNOB] = REDUCE_OVERHEAD, False
        quantize = quantize_fp8_dynamic if name == TORCHAO_FP8_REFERENCE else None
        artifact = self._make({}, knobs, quantize=quantize)
        artifact.reference = name
        return artifact

    def _release_memory(self) -> None:
        """Frees the previous trial's module and graph before the next build allocates its own.

        Nothing before the first build: a collection then only walks the heap transformers left.
        """
        if not self._built:
            self._built = True
            return
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

    def time_back_to_back(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray], launches: int) -> float:
        """Milliseconds per launch of ``launches`` launches back to back: CUDA events around them all."""
        return time_back_to_back(artifact, feeds, launches)

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
        return write_export(
            artifact, plan, out_dir, self.factory, self.model.inputs, self.info, self.options.quantized_gemm
        )
