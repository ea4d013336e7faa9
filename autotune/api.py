"""The Python API; the CLI is a thin shell over these functions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotune.backends import get_backend
from autotune.config import TuneConfig
from autotune.data import load_dataset
from autotune.evaluate import Evaluator, SetupError, load_model, search_space, with_runtime_shares
from autotune.model import LoadedModel
from autotune.plan import Plan
from autotune.search.space import SearchSpace
from autotune.store import TrialStore
from autotune.trial import TrialResult


def analyze(config: TuneConfig, profile: bool = True) -> tuple[LoadedModel, SearchSpace]:
    """Loads the model, profiles its FP32 runtime per layer, and builds the search space.

    Raises:
        SetupError: The model, data or backend cannot be used.
    """
    try:
        backend = get_backend(config.backend)
        model = load_model(config)
        if profile:
            feeds = load_dataset(config.data.evaluation, model.inputs, "evaluation", config.seed).batches[0]
            model = with_runtime_shares(model, backend, feeds)
    except (ValueError, OSError) as error:
        raise SetupError(str(error)) from error
    return model, search_space(config, model, backend)


def layer_table(model: LoadedModel, space: SearchSpace) -> list[dict[str, Any]]:
    """One row per tunable layer: features plus the precisions the search may give it."""
    return [
        {
            "index": layer.index,
            "name": layer.name,
            "op_type": layer.op_type,
            "macs": layer.macs,
            "params": layer.params,
            "input_shapes": [list(s) for s in layer.input_shapes],
            "output_shape": list(layer.output_shape),
            "depth": layer.depth,
            "runtime_share": layer.runtime_share,
            "choices": list(choices),
        }
        for layer, choices in zip(model.layers, space.choices, strict=True)
    ]


def resolve_plan(spec: str, space: SearchSpace) -> Plan:
    """``fp32``, ``int8`` (every layer that allows it), another precision name, or a plan JSON file.

    Raises:
        SetupError: The file is missing or not a plan, or the plan is outside the space.
    """
    if spec in ("fp32", "fp16", "bf16", "int8", "fp8"):
        return space.uniform(spec)
    path = Path(spec)
    if not path.is_file():
        raise SetupError(f"--plan {spec!r} is neither fp32/int8/... nor an existing plan JSON file")
    try:
        plan = Plan.from_json(path.read_text())
    except (ValueError, json.JSONDecodeError) as error:
        raise SetupError(f"{path} is not a plan: {error}") from error
    plan = space.plan(plan.precision_map, plan.knob_map)
    problems = space.violations(plan)
    if problems:
        raise SetupError(f"{path}: " + "; ".join(problems))
    return plan


def evaluate(config: TuneConfig, plan_spec: str, split: str = "evaluation", isolate: bool = True) -> dict[str, Any]:
    """Builds and measures one plan against FP32 timed in the same run, and keeps its model.

    Args:
        config: The run's config.
        plan_spec: See ``resolve_plan``.
        split: ``evaluation`` or ``holdout``.
        isolate: Run the trial in a child process.

    Returns:
        The result as a JSON-ready dict, with the path of the kept model under ``artifact``.
    """
    _, space = analyze(config, profile=False)
    plan = resolve_plan(plan_spec, space)
    run_dir = config.run_dir
    with TrialStore(run_dir / "evaluations.sqlite") as store, Evaluator(config, store, isolate=isolate) as evaluator:
        result: TrialResult = evaluator.measure(plan, split)
        if result.ok:
            files = evaluator.export(plan, run_dir / "evaluate" / plan.hash)
            result.artifact = files[0]
        store.put(result)
    summary = result.to_dict()
    summary["plan_summary"] = plan.describe()
    return summary
