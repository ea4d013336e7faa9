"""The Python API; the CLI is a thin shell over these functions."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from autotune.backends import BuildError, backend_class, get_backend
from autotune.config.schema import TuneConfig
from autotune.data import Splits
from autotune.harness import Evaluator, SetupError, load_model, prepare_backend, search_space, with_runtime_shares
from autotune.harness.prepare import calibrate_ranges
from autotune.harness.runtime_choice import RuntimeChoice, SeedSetup, backend_on, choose, time_seeds
from autotune.measure.selfcheck import say
from autotune.metrics import check_labels
from autotune.model.layers import LoadedModel, factory_module
from autotune.plan import PRECISIONS, Plan
from autotune.run.store import TrialStore
from autotune.search.space import SearchSpace

Timer = Callable[[TuneConfig, Sequence[str]], tuple[dict[str, dict[str, float]], dict[str, str]]]
"""Times the seeds of the runtimes named for a config (``Timings``), and says which it could not time."""


def choose_runtime(
    config: TuneConfig,
    measure: Timer | None = None,
    say: Callable[[str], None] = lambda line: None,
    timed: bool = True,
    splits: Splits | None = None,
) -> tuple[TuneConfig, RuntimeChoice | None]:
    """The config to run with: as it is where it names a runtime, else with the measured choice.

    Args:
        config: The run's config.
        measure: Times the seeds (default :func:`seed_timings`).
        say: Prints the choice's line.
        timed: False: ONNX Runtime without timing, for a command that only looks at the model (``inspect``).
        splits: The run's data splits, which the seeds calibrate on (default: loaded here).

    Returns:
        The config naming a runtime, and the choice (None where the config named one).
    """
    timer = measure or (lambda config, runtimes: seed_timings(config, runtimes, splits))
    choice = choose(config.backend.name, lambda runtimes: timer(config, runtimes), say, timed)
    if choice is None:
        return config, None
    return config.model_copy(update={"backend": choice.backend_of(config.backend)}), choice


def with_backend(config: TuneConfig, name: str, references_of: Sequence[str] = ()) -> TuneConfig:
    """``config`` on the runtime ``name``, ``references_of`` the runtimes whose one-liners are references too."""
    return config.model_copy(update={"backend": backend_on(config.backend, name, references_of)})


def seed_timings(
    config: TuneConfig, runtimes: Sequence[str], splits: Splits | None = None
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Each runtime's seeds built from the config as a run on it would build them, and timed side by side.

    See :func:`autotune.harness.runtime_choice.time_seeds`.

    Raises:
        SetupError: ONNX Runtime cannot set the run up (the model, the data): the error the run would stop with.
    """
    splits = splits or Splits(config.data, config.seed)
    return time_seeds(runtimes, lambda runtime: _seed_setup(with_backend(config, runtime), splits))


def _seed_setup(config: TuneConfig, splits: Splits) -> SeedSetup:
    """The backend, model, search space and calibration the seeds on ``config``'s runtime are built from.

    Raises:
        SetupError: The model, the data or the backend cannot be used.
    """
    try:
        backend = get_backend(config.backend, config.model, config.accuracy_budget, config.metric.name)
        model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
        space = search_space(config.search, model, backend)
        prepare_backend(backend, model, space)
        data = splits.load("calibration", model.inputs)
    except (ValueError, OSError) as error:
        raise SetupError(str(error)) from error
    ranges = lambda: calibrate_ranges(config.calibration, config.cache_dir, model, backend, data).ranges("max")  # noqa: E731
    return SeedSetup(backend, model, space, data, ranges, config.cache_dir / "runtime_choice" / config.backend.name)


def analyze(
    config: TuneConfig,
    profile: bool = True,
    model_ready: Callable[[], None] | None = None,
    splits: Splits | None = None,
) -> tuple[LoadedModel, SearchSpace]:
    """Loads the model, profiles its FP32 runtime per layer, and builds the search space.

    Args:
        config: The run's config.
        profile: Time each layer's share of FP32 runtime where the backend can.
        model_ready: Called once the trial process may read the model: where the backend profiles, once the model
            is loaded and profiled (the trial process would load the same cores the profile times); elsewhere once
            its ONNX file exists (exported first where needed), so both processes build the layer table at once.
            Either way before the rest of the analysis (the device's capabilities, the binding); ``tune`` lets its
            trial process go there.
        splits: The run's data splits, which the profile's batch is read from (default: loaded here).

    Raises:
        SetupError: The model, data or backend cannot be used (the FP32 model does not run on the backend, or a
            backend cannot build a searched layer).
    """
    factory_module.cache_clear()  # this analysis calls the factory afresh, once
    try:
        backend = get_backend(config.backend, config.model, config.accuracy_budget, config.metric.name)
        profiles = profile and backend.profiles
        model = load_model(
            config.model,
            config.inputs,
            config.backend.name,
            config.cache_dir,
            file_ready=None if profiles else model_ready,
        )
        if profiles:
            splits = splits or Splits(config.data, config.seed)
            feeds = splits.load("evaluation", model.inputs).batches[0]
            try:
                model = with_runtime_shares(model, backend, feeds)
            except BuildError as error:
                raise SetupError(
                    f"{model.path}: the FP32 model does not run on {backend.name}: {error}; "
                    f"replace the operator it names, or choose another backend"
                ) from error
    except (ValueError, OSError) as error:
        raise SetupError(str(error)) from error
    if profiles and model_ready is not None:
        model_ready()
    space = search_space(config.search, model, backend)
    prepare_backend(backend, model, space)  # a layer the backend cannot build fails here, before a run directory
    return model, space


def _scores_per_sample(model: onnx.ModelProto, output: str) -> int | None:
    """The non-batch size of a graph output (the classes of a classifier), or None where a dim is unknown."""
    for value in model.graph.output:
        if value.name == output:
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
            if len(dims) >= 2 and all(d > 0 for d in dims[1:]):
                return int(np.prod(dims[1:]))
    return None


def check_data(config: TuneConfig, model: LoadedModel, splits: Splits | None = None) -> None:
    """Loads every data split and checks it against the model's inputs and the metric.

    The trial process checks the same, but only once the run directory exists: ``tune`` calls this first, so
    bad data (or labels that do not fit the metric) leaves nothing behind that a resume would trust.

    Args:
        config: The run's config.
        model: The loaded model (``analyze``).
        splits: The run's data splits, each loaded once (default: loaded here).

    Raises:
        SetupError: A split is missing, empty, of the wrong shape or dtype, or not finite; its labels do not fit
            the metric; or ``metric.output`` is not a model output.
    """
    output = config.metric.output or model.output_names[0]
    if output not in model.output_names:
        raise SetupError(f"metric.output {output!r} is not a model output; outputs: {model.output_names}")
    classes = _scores_per_sample(model.proto, output)
    splits = splits or Splits(config.data, config.seed)
    checked = ["calibration", "evaluation", *(["holdout"] if config.data.holdout is not None else [])]
    for what in checked:
        try:
            dataset = splits.load(what, model.inputs)
            if what != "calibration":
                sizes = [next(iter(batch.values())).shape[0] for batch in dataset.batches]
                check_labels(config.metric.name, dataset.labels, sizes, classes, what)
        except (ValueError, OSError) as error:
            raise SetupError(str(error)) from error


def layer_table(model: LoadedModel, space: SearchSpace) -> list[dict[str, Any]]:
    """One row per tunable layer: features plus the precisions the search may give it.

    ``nodes`` are the nodes one decision covers (a zero Pad before the op, the op, a Relu/Clip folded after it) and
    ``unit`` their op types, e.g. ``Pad+Conv+Clip``. ``weight_source`` says where the weight came from:
    ``initializer``, or the chain intake folded into one (``Constant``, ``Constant+Transpose``); None without one.
    """
    op_types = {node.name: node.op_type for node in model.proto.graph.node}
    return [
        {
            "index": layer.index,
            "name": layer.name,
            "op_type": layer.op_type,
            "nodes": list(layer.nodes or (layer.name,)),
            "unit": "+".join(op_types.get(name, "?") for name in layer.nodes or (layer.name,)),
            "macs": layer.macs,
            "params": layer.params,
            "input_shapes": [list(s) for s in layer.input_shapes],
            "output_shape": list(layer.output_shape),
            "depth": layer.depth,
            "weight": layer.weight,
            "weight_source": layer.weight_source,
            "runtime_share": layer.runtime_share,
            "choices": list(choices),
        }
        for layer, choices in zip(model.layers, space.choices, strict=True)
    ]


def float_ops(model: LoadedModel, backend: str | None = None) -> list[dict[str, str]]:
    """The ops that stay FP32 although they are tunable or read an INT8 layer's output, each with the reason.

    With the TensorRT ``backend`` (its ``backend.name``), also the ops its typed graph keeps FP32 in an FP16 base
    (``base_precision: fp16``) because their values leave FP16's range (``autotune.quant.basetype.range_float_ops``).
    """
    op_types = {node.name: node.op_type for node in model.proto.graph.node}
    reasons = dict(model.float_ops)
    if backend is not None and backend_class(backend).fp16_base_range_checked:
        from autotune.quant.basetype import range_float_ops

        for name, why in range_float_ops(model.proto.graph, "fp16").items():
            reasons.setdefault(name, why)
    return [{"name": name, "op_type": op_types.get(name, "?"), "reason": why} for name, why in reasons.items()]


def references(config: TuneConfig) -> tuple[str, ...]:
    """The one-liners of the config's backend (``Backend.references``), e.g. ``ort-static`` for ONNX Runtime.

    Raises:
        BackendUnavailable: The backend's runtime is not installed.
    """
    return get_backend(config.backend, config.model, config.accuracy_budget, config.metric.name).references()


def resolve_plan(spec: str, space: SearchSpace, one_liners: tuple[str, ...] = ()) -> Plan:
    """The plan ``--plan`` names: a precision for every layer that allows it, a one-liner, or a plan JSON file.

    Args:
        spec: ``fp32``, ``int8`` or another precision name; one of ``one_liners`` (its reference plan); or a
            plan JSON file.
        space: The run's search space.
        one_liners: The backend's one-liners (``references``).

    Raises:
        SetupError: The file is missing or not a plan, or the plan is outside the space.
    """
    if spec in PRECISIONS:
        return space.uniform(spec)
    if spec in one_liners:
        return Plan.reference_plan(space.layer_names, spec)
    path = Path(spec)
    if not path.is_file():
        offered = "/".join(PRECISIONS + one_liners)
        raise SetupError(f"--plan {spec!r} is neither one of {offered} nor an existing plan JSON file")
    try:
        plan = Plan.from_json(path.read_text())
    except (ValueError, json.JSONDecodeError) as error:
        raise SetupError(f"{path} is not a plan: {error}") from error
    if plan.reference is not None:  # the plan.json of an exported one-liner
        if plan.reference not in one_liners:
            raise SetupError(f"{path}: {plan.reference!r} is not a one-liner of this backend: {list(one_liners)}")
        return Plan.reference_plan(space.layer_names, plan.reference)
    unsearched = sorted(set(plan.knob_map) - {knob.name for knob in space.knobs})
    if unsearched:  # dropped, the plan would build as another one (an opt-in knob's default)
        raise SetupError(
            f"{path}: sets knobs {unsearched} that this run's search space lacks; name them in the config's "
            f"search.knobs (e.g. search.knobs.{unsearched[0]}: [{plan.knob_map[unsearched[0]]!r}])"
        )
    # Checked as written: completing it first would drop the layers this space lacks (a plan file of another
    # model would quietly run all FP32).
    problems = space.violations(plan)
    if problems:
        raise SetupError(f"{path}: " + "; ".join(problems))
    return space.plan(plan.precision_map, plan.knob_map)


def evaluate(config: TuneConfig, plan_spec: str, split: str = "evaluation", isolate: bool = True) -> dict[str, Any]:
    """Builds and measures one plan against FP32 timed in the same run, and keeps its model.

    Args:
        config: The run's config.
        plan_spec: See ``resolve_plan``; the backend's one-liners (``references``) are offered too.
        split: ``evaluation`` or ``holdout``.
        isolate: Run the trial in a child process.

    Returns:
        The result as a JSON-ready dict, with the path of the kept model under ``artifact``.
    """
    return evaluate_side_by_side(config, [plan_spec], split, isolate)[0]


def evaluate_side_by_side(
    config: TuneConfig, plan_specs: list[str], split: str = "evaluation", isolate: bool = True
) -> list[dict[str, Any]]:
    """Builds several plans in one trial process and times them against FP32 in the same rounds.

    Every round times FP32 and each plan in turn (``autotune.measure.timing.side_by_side``), so the plans are compared
    seconds apart, not across the minutes of machine drift between one plan's measurement and the next; one
    process means one warm-up, one data load, one calibration.

    Args:
        config: The run's config.
        plan_specs: See ``resolve_plan``; every spec is checked before the first build.
        split: ``evaluation`` or ``holdout``.
        isolate: Run the trials in a child process.

    Returns:
        One JSON-ready result per plan, in the given order, each with the path of its kept model under
        ``artifact``.
    """
    config, _ = choose_runtime(config, say=say)
    _, space = analyze(config, profile=False)
    one_liners = references(config)
    plans = [resolve_plan(spec, space, one_liners) for spec in plan_specs]
    run_dir = config.run_dir
    summaries = []
    with TrialStore(run_dir / "evaluations.sqlite") as store, Evaluator(config, store, isolate=isolate) as evaluator:
        for plan, result in zip(plans, evaluator.measure_side_by_side(plans, split), strict=True):
            if result.ok:
                files = evaluator.export(plan, run_dir / "evaluate" / plan.hash)
                result.artifact = files[0]
            store.put(result)
            summary = result.to_dict()
            summary["plan_summary"] = plan.describe()
            summaries.append(summary)
    return summaries


def load(best_dir: str | Path, device: str | None = None) -> Any:
    """A run's exported winner, ready to call at the speed the run measured: ``autotune.load("runs/NAME/best")``.

    A torch export (``manifest.json``) comes back compiled and captured with the winner's knobs
    (``autotune.backends.torch.load_engine``); call it with the model's inputs. An OpenVINO export
    (``openvino.json``) comes back as OpenVINO's compiled model, with the properties the run measured it with; call
    it with a dict of the model's inputs.

    Args:
        best_dir: The export directory (a run's ``best/``).
        device: Where to run; default the device the run built for.

    Raises:
        ValueError: The directory holds no torch or OpenVINO export (ONNX Runtime's ``model.onnx`` and TensorRT's
            ``engine.plan`` load with their own runtimes).
    """
    best_dir = Path(best_dir)
    if (best_dir / "openvino.json").is_file():
        from autotune.backends.openvino import load_compiled

        return load_compiled(best_dir)
    if not (best_dir / "manifest.json").is_file():
        found = sorted(path.name for path in best_dir.iterdir()) if best_dir.is_dir() else []
        raise ValueError(
            f"{best_dir}: no manifest.json, so no torch export (found {found}); an ONNX Runtime export is "
            f"model.onnx (onnxruntime.InferenceSession) and a TensorRT one engine.plan"
        )
    from autotune.backends.torch import load_engine

    return load_engine(best_dir, device)
