"""What a run prepares once, before any trial: model, search space, data, calibration.

Every function raises ``SetupError`` with a message a user can act on: a run that cannot start builds nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.backends import Backend, backend_class
from autotune.config.schema import CalibrationConfig, InputConfig, ModelConfig, SearchSpaceConfig
from autotune.data import Dataset
from autotune.model.layers import InputSpec, LoadedModel, load_onnx, prepare_model
from autotune.model.torch_export import export_torch
from autotune.plan import CALIBRATION_KNOB, INT8_SCHEME_KNOB, Plan
from autotune.quant.calibrate import METHODS, Calibration, CalibrationSettings, StatisticsCollector, calibrate
from autotune.quant.dynamic import DYNAMIC
from autotune.quant.forms import Form, form_errors
from autotune.quant.layerwise import LAYERWISE, SMOOTHING, LayerwiseChoices, choose_layer_methods
from autotune.quant.lowering import Quantization
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import required_ranges
from autotune.search.space import SearchSpace, build_space

log = logging.getLogger(__name__)


class SetupError(RuntimeError):
    """The run cannot start (bad model, data, or config); nothing was built."""


class Stages:
    """Wall seconds per named stage of the set-up, in the order they ran (a stage run twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Times the ``with`` block as stage ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def config_inputs(inputs: Sequence[InputConfig]) -> list[InputSpec]:
    """The input specs of the config's ``inputs``."""
    return [InputSpec(i.name, tuple(i.shape), i.dtype) for i in inputs]


def model_file(model: ModelConfig, inputs: Sequence[InputConfig], backend: str, cache_dir: Path) -> Path:
    """The ONNX file of the model, exporting a PyTorch factory on first use (cached by factory and shapes).

    Args:
        model: The config's ``model`` section.
        inputs: The config's ``inputs``: the shapes a PyTorch factory is exported with.
        backend: The backend's name (``backend.name``): some export batch-free (``exports_batch_free``).
        cache_dir: Where exported models are cached (``cache_dir``).
    """
    if model.onnx is not None:
        return model.onnx
    specs = config_inputs(inputs)
    if not specs:
        raise SetupError("model.torch needs inputs: with names, shapes and dtypes to export the module")
    batch_free = backend_class(backend).exports_batch_free
    identity = (model.torch, specs, model.opset, *(("batch_free",) if batch_free else ()))
    key = hashlib.sha256(repr(identity).encode()).hexdigest()[:12]
    path = cache_dir / "models" / f"{model.torch.replace(':', '.')}-{key}.onnx"
    if not path.exists():
        log.info("exporting %s to %s", model.torch, path)
        export_torch(model.torch, specs, path, opset=model.opset, batch_free=batch_free)
    return path


def load_model(
    model: ModelConfig,
    inputs: Sequence[InputConfig],
    backend: str,
    cache_dir: Path,
    file_ready: Callable[[], None] | None = None,
) -> LoadedModel:
    """Loads (or exports) the model and builds its layer table.

    Args:
        model: The config's ``model`` section.
        inputs: The config's ``inputs``.
        backend: The backend's name (``backend.name``).
        cache_dir: Where exported models are cached (``cache_dir``).
        file_ready: Called once the model's ONNX file exists (exported first where needed), before it is read.
    """
    path = model_file(model, inputs, backend, cache_dir)
    if file_ready is not None:
        file_ready()
    return prepare_model(load_onnx(path), path, config_inputs(inputs) or None, model.include_activation_matmuls)


def with_runtime_shares(model: LoadedModel, backend: Backend, feeds: Mapping[str, Any]) -> LoadedModel:
    """The model with each layer's share of FP32 runtime filled in, where the backend can profile."""
    shares = backend.profile(model, feeds)
    if shares is None:
        return model
    model.layers = [dataclasses.replace(layer, runtime_share=shares.get(layer.name)) for layer in model.layers]
    return model


def search_space(search: SearchSpaceConfig, model: LoadedModel, backend: Backend) -> SearchSpace:
    """The search space of a run.

    Raises:
        SetupError: The config's search restrictions do not fit the backend.
    """
    try:
        op_types = {node.op_type for node in model.proto.graph.node}
        return build_space(model.layers, backend.capabilities(), search, op_types)
    except ValueError as error:
        raise SetupError(str(error)) from error


def prepare_backend(backend: Backend, model: LoadedModel, space: SearchSpace) -> None:
    """Hands the model to the backend once.

    Raises:
        SetupError: The backend cannot build a searched layer (the message says how to keep it FP32).
    """
    try:
        backend.prepare(model, [space.layer_names[i] for i in space.searchable])
    except ValueError as error:
        raise SetupError(str(error)) from error


def statistics_collector(model: LoadedModel, backend: Backend) -> StatisticsCollector | None:
    """The backend's own collection of the tensors the calibration needs (``Backend.statistics_collector``)."""
    return backend.statistics_collector(required_ranges(model.layers, backend.recipe, model.proto))


def calibrate_ranges(
    config: CalibrationConfig,
    cache_dir: Path,
    model: LoadedModel,
    backend: Backend,
    data: Dataset,
    collector: StatisticsCollector | None = None,
) -> Calibration:
    """Activation statistics of every tensor a quantized layer needs, cached per model, data and source.

    ``config`` is the ``calibration`` section, ``cache_dir`` the run's; ``collector``: the backend's own
    (``statistics_collector``); None: ONNX Runtime runs the ONNX graph.
    """
    tensors = required_ranges(model.layers, backend.recipe, model.proto)
    settings = CalibrationSettings(percentile=config.percentile, num_bins=config.num_bins)
    cache = cache_dir / "calibration"
    try:
        try:
            return calibrate(model.proto, tensors, data.batches, cache, model.hash, settings, collector)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - the device's failure (out of memory, say) costs only time
            if collector is None:
                raise
            log.warning("%s did not gather the calibration (%s); ONNX Runtime runs the model", collector.source, error)
            return calibrate(model.proto, tensors, data.batches, cache, model.hash, settings)
    except ValueError as error:
        raise SetupError(f"calibration failed: {error}") from error


@dataclasses.dataclass(frozen=True)
class LayerwiseBounds:
    """Where the layerwise choices are cached and how long choosing them may take.

    Attributes:
        cache_dir: The run's cache folder (``cache_dir``); the choices go in its ``calibration`` folder.
        allowance_s: Seconds choosing may take (``layerwise_allowance_s`` of ``budget.minutes``); None: no limit.
    """

    cache_dir: Path
    allowance_s: float | None = None


def choose_layerwise(
    bounds: LayerwiseBounds,
    model: LoadedModel,
    backend: Backend,
    space: SearchSpace,
    calibration: Calibration,
    data: Dataset,
    output_index: int,
    recipe: QuantRecipe | None = None,
) -> LayerwiseChoices | None:
    """Per-layer calibration recipes, when the search may use ``layerwise`` calibration; None otherwise.

    The candidates' errors are measured with ``recipe``, the INT8 scheme of the plans they serve
    (``Backend.recipe_for``); None: the backend's default ``recipe``. The candidates' errors are cached under
    ``bounds.cache_dir``; with an allowance (``LAYERWISE_SHARE`` of ``budget.minutes``), choosing takes at most it.
    """
    offered = next((knob.values for knob in space.knobs if knob.name == CALIBRATION_KNOB), ())
    if LAYERWISE not in offered:
        return None
    layers = [layer for layer, options in zip(space.layers, space.choices, strict=True) if "int8" in options]
    candidates = (*METHODS, *SMOOTHING) if backend.capabilities().smoothing else METHODS
    try:
        choices = choose_layer_methods(
            model.proto,
            layers,
            recipe or backend.recipe,
            calibration,
            data.batches,
            output_index,
            cache_dir=bounds.cache_dir / "calibration",
            model_hash=model.hash,
            methods=candidates,
            # The bar shows a person where a first run's minutes go; logs and captured output get the summary line.
            progress=log.isEnabledFor(logging.INFO) and sys.stderr.isatty(),
            layer_probe=backend.layer_probe(),  # the backend's own device where it has one (torch on CUDA)
            allowance_s=bounds.allowance_s,
        )
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types
        raise SetupError(
            f"layerwise calibration failed: {error}; leave 'layerwise' out of "
            f"search.calibration_methods to calibrate every layer alike"
        ) from error
    return choices


def int8_forms(backend: Backend, space: SearchSpace) -> list[Form]:
    """The INT8 forms the space offers besides the default scheme: the other exact schemes, ``int8-dynamic``."""
    forms = []
    knob = next((knob for knob in space.knobs if knob.name == INT8_SCHEME_KNOB), None)
    for value in knob.values if knob is not None else ():
        if value != knob.default:  # type: ignore[union-attr]
            plan = space.uniform("int8", {INT8_SCHEME_KNOB: value})
            forms.append(Form(str(value), "int8", backend.recipe_for(plan)))
    if any(DYNAMIC in options for options in space.choices):
        forms.append(Form(DYNAMIC, DYNAMIC, backend.recipe))
    return forms


def measure_forms(
    bounds: LayerwiseBounds,
    model: LoadedModel,
    backend: Backend,
    space: SearchSpace,
    calibration: Calibration,
    data: Dataset,
    output_index: int,
    choices: LayerwiseChoices | None,
) -> dict[str, dict[str, float]]:
    """Per INT8 form of :func:`int8_forms`, each layer's single-layer error (``autotune.quant.forms``).

    Empty without layerwise choices or other forms; a failure is logged and leaves the forms to the trials.
    """
    forms = int8_forms(backend, space)
    if choices is None or not forms:
        return {}
    try:
        return form_errors(
            model,
            forms,
            choices,
            calibration,
            data.batches,
            output_index,
            cache_dir=bounds.cache_dir / "calibration",
            allowance_s=bounds.allowance_s,
        )
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types; the trials still measure
        log.warning("the INT8 forms' per-layer errors could not be measured (%s); the trials will tell", error)
        return {}


class Quantizations:
    """The ``Quantization`` each plan is built with, by its calibration knob and, for ``layerwise``, its INT8 scheme.

    The layerwise choices weigh each layer's candidates by the error they cause with the scheme that runs (7-bit
    weights err more than 8-bit ones), so a plan whose scheme differs from the one ``layerwise`` was chosen with
    gets choices made with its own: by ``choose``, once per scheme, when the first such plan is built.

    Args:
        model: The run's model.
        calibration: Activation statistics of the run.
        layerwise: Per-layer recipes, or None when ``layerwise`` is not offered.
        recipe: The INT8 scheme ``layerwise`` was chosen with; None: the one of every plan (``recipe_for`` unused).
        recipe_for: The scheme a plan is lowered with (``Backend.recipe_for``).
        choose: Per-layer recipes chosen with another scheme (``choose_layerwise`` with ``recipe``).
    """

    def __init__(
        self,
        model: LoadedModel,
        calibration: Calibration,
        layerwise: LayerwiseChoices | None,
        recipe: QuantRecipe | None = None,
        recipe_for: Callable[[Plan], QuantRecipe] | None = None,
        choose: Callable[[QuantRecipe], LayerwiseChoices | None] | None = None,
    ):
        self.model = model
        self.calibration = calibration
        self.layerwise = layerwise
        self._recipe_for = recipe_for
        self._choose = choose
        # Made at the first plan that needs them: a layer's ranges by ``entropy`` or ``percentile`` take a search
        # over its histogram (1 s for MiniLM's 36 layers), which FP32, float and uniformly calibrated plans never read.
        self._by_recipe: dict[QuantRecipe | None, Quantization] = {}
        self._chosen: dict[QuantRecipe | None, LayerwiseChoices | None] = {recipe: layerwise}
        self._default_recipe = recipe

    def _layerwise_quantization(self, layerwise: LayerwiseChoices | None) -> Quantization:
        smoothing = layerwise.smoothing(self.model.proto, self.model.layers) if layerwise else {}
        return Quantization(
            self.calibration.ranges("max"),
            layerwise.layer_ranges(self.calibration, smoothing, self.model.layers) if layerwise else {},
            smoothing,
        )

    def layerwise_for(self, recipe: QuantRecipe | None) -> Quantization:
        """The ``layerwise`` quantization chosen with ``recipe`` (chosen now where it was not yet)."""
        if self._default_recipe is None or self._choose is None:
            recipe = self._default_recipe
        if recipe not in self._by_recipe:
            choices = self._chosen[recipe] if recipe in self._chosen else self._choose(recipe)
            self._by_recipe[recipe] = self._layerwise_quantization(choices)
        return self._by_recipe[recipe]

    def __call__(self, plan: Plan) -> Quantization:
        """The ranges (and, for ``layerwise``, per-layer ranges and SmoothQuant factors) of a plan's method.

        Raises:
            ValueError: ``layerwise`` was not prepared for this run.
        """
        method = str(plan.knob(CALIBRATION_KNOB, "max"))
        if method == LAYERWISE:
            if self.layerwise is None:
                raise ValueError("calibration=layerwise is not offered by this run's search.calibration_methods")
            return self.layerwise_for(self._recipe_for(plan) if self._recipe_for is not None else None)
        return Quantization(self.calibration.ranges(method))
