"""The config of a model nobody configured: inputs read from its graph, one ``.npz`` split three ways, defaults stated.

``autotune tune model.onnx --data samples.npz`` runs on the config this module drafts, and ``autotune init`` prints
the same config with a comment per section, to edit. The data file holds one array per model input, named after it,
with the samples along the first axis (and optionally a ``labels`` array), as every ``npz`` data source does; the
draft reads it through ``data.<split>.npz`` with ``start`` and ``stop``, so no second copy of the data is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from autotune.config.schema import ConfigError
from autotune.model.layers import InputSpec, ModelError, graph_inputs, load_onnx

DEFAULT_BATCH = 8
"""The batch of an input whose first dimension the graph leaves dynamic (smaller where the data is short)."""

METRICS = ("cosine", "top1_agreement", "top1")
"""What ``--metric`` may name: fidelity to the FP32 outputs, or top-1 against the file's ``labels``."""

DEFAULT_METRIC = "cosine"

DEFAULT_ACCURACY_BUDGET = 0.01
"""The accuracy drop allowed: 0.01 of mean cosine, of top-1 agreement, or of top-1 accuracy (one point)."""

SPLITS = ("calibration", "evaluation", "holdout")
"""The three splits, in file order: the first quarter of the batches, the half after it, the last quarter."""


@dataclass
class Draft:
    """A raw config mapping for one model and data file, with why each section is what it is.

    Attributes:
        data: The config as ``parse_config`` takes it (overrides may still be applied to it).
        notes: Per top-level key, the comment ``autotune init`` writes above it.
        summary: One line for the log: inputs, split sizes, metric and budget.
    """

    data: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)
    summary: str = ""


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``--shape name=8x128`` arguments as ``{name: (8, 128)}``.

    Raises:
        ConfigError: An item is not ``name=DIMxDIM...`` with positive integer dimensions.
    """
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(dim) for dim in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not name.strip() or not shape or min(shape) <= 0:
            raise ConfigError(f"--shape {item!r}: write it as INPUT=DIMxDIM..., e.g. --shape input_ids=8x128")
        shapes[name.strip()] = shape
    return shapes


def _check_runtime_loads(path: Path) -> None:
    """Raises ``ConfigError`` with ONNX Runtime's first line when its CPU provider cannot load the model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types per failure
        first = (str(error).strip().splitlines() or ["no message"])[0][:300]
        raise ConfigError(
            f"{path}: ONNX Runtime {ort.__version__} cannot load this model ({first}); re-export it with an opset and "
            'ops ONNX Runtime supports, then check it with `python -c "import onnxruntime as o; '
            f"o.InferenceSession('{path}')\"`"
        ) from None


def _read_samples(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"--data {path} does not exist: give an .npz with one array per model input")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"--data {path} is not a readable .npz without pickles ({error}): write it with numpy.savez"
        ) from None


def _input_shape(spec: InputSpec, array: np.ndarray, batch: int, data: Path) -> tuple[int, ...]:
    """The shape one input is tuned at: the graph's static dimensions, the data's for the dynamic ones."""
    if array.ndim != len(spec.shape):
        raise ConfigError(
            f"--data {data}: array {spec.name!r} has shape {list(array.shape)} (samples first), the model takes "
            f"rank {len(spec.shape)} {_dims(spec.shape)}: stack one sample per row along a first axis"
        )
    shape = [batch, *array.shape[1:]]
    for axis, declared in enumerate(spec.shape[1:], start=1):
        if declared > 0 and declared != array.shape[axis]:
            raise ConfigError(
                f"--data {data}: array {spec.name!r} has samples of {list(array.shape[1:])}, the model takes "
                f"{_dims(spec.shape)}: resize the data to dimension {axis} = {declared}"
            )
    return tuple(shape)


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if dim < 0 else str(dim) for dim in shape) + "]"


def _resolve_inputs(
    declared: list[InputSpec], arrays: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], data: Path
) -> list[InputSpec]:
    """Every graph input at the shape it is tuned with, its batch shared (the first dimension of each)."""
    names = [spec.name for spec in declared]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise ConfigError(f"--shape names {unknown}, which the model does not take; its inputs: {names}")
    missing = [name for name in names if name not in arrays]
    if missing:
        raise ConfigError(
            f"--data {data} has arrays {sorted(arrays)} but no {missing}: save one array per model input, named after "
            f"it, e.g. numpy.savez('{data.name}', {', '.join(f'{name}=...' for name in names)})"
        )
    samples = {name: int(arrays[name].shape[0]) if arrays[name].ndim else 0 for name in names}
    if len(set(samples.values())) != 1:
        raise ConfigError(
            f"--data {data}: the inputs' arrays hold different sample counts {samples}; give each as many"
        )
    total = next(iter(samples.values()))
    batch = _batch(declared, shapes, total)
    resolved = []
    for spec in declared:
        shape = shapes.get(spec.name) or _input_shape(spec, arrays[spec.name], batch, data)
        if len(shape) != len(spec.shape) or any(d > 0 and d != s for d, s in zip(spec.shape, shape, strict=False)):
            raise ConfigError(
                f"--shape {spec.name}={'x'.join(map(str, shape))} does not fit the model's {_dims(spec.shape)}: "
                "keep its rank and its fixed dimensions"
            )
        if tuple(arrays[spec.name].shape[1:]) != shape[1:]:
            raise ConfigError(
                f"--data {data}: array {spec.name!r} has samples of {list(arrays[spec.name].shape[1:])}, "
                f"the shape {list(shape)} takes {list(shape[1:])}: resize the data or change --shape"
            )
        if arrays[spec.name].dtype != np.dtype(spec.dtype):
            raise ConfigError(
                f"--data {data}: array {spec.name!r} is {arrays[spec.name].dtype}, the model takes {spec.dtype}: "
                f"save it with .astype('{spec.dtype}')"
            )
        resolved.append(InputSpec(spec.name, tuple(shape), spec.dtype))
    if len({spec.shape[0] for spec in resolved}) != 1:
        raise ConfigError(f"the inputs' first dimensions differ {[list(s.shape) for s in resolved]}: one batch for all")
    return resolved


def _batch(declared: list[InputSpec], shapes: dict[str, tuple[int, ...]], total: int) -> int:
    """The batch: a ``--shape``'s first dimension, else the graph's, else ``DEFAULT_BATCH`` where the data has it."""
    if shapes:
        return next(iter(shapes.values()))[0]
    fixed = [spec.shape[0] for spec in declared if spec.shape and spec.shape[0] > 0]
    return fixed[0] if fixed else max(1, min(DEFAULT_BATCH, total // len(SPLITS)))


def _split(total: int, batch: int, data: Path) -> dict[str, tuple[int, int]]:
    """Sample ranges of the splits, in whole batches: a quarter calibrates, a half evaluates, a quarter is held out."""
    batches = total // batch
    if batches < len(SPLITS):
        raise ConfigError(
            f"--data {data} holds {total} samples: {len(SPLITS) * batch} or more are needed for three splits of a "
            f"batch of {batch} (give more samples, or a smaller batch with --shape)"
        )
    quarter = max(1, batches // 4)
    bounds = [0, quarter, batches - quarter, batches]
    return {split: (bounds[i] * batch, bounds[i + 1] * batch) for i, split in enumerate(SPLITS)}


def _run_name(path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-_.").replace("..", ".")
    return name or "model"


def draft_config(
    model: str | Path, data: str | Path, shapes: dict[str, tuple[int, ...]] | None = None, metric: str | None = None
) -> Draft:
    """The config of ``model`` tuned on the samples of ``data``, as ``autotune tune model.onnx --data`` runs it.

    Args:
        model: An ONNX file.
        data: An ``.npz`` with one array per model input (samples first), and optionally ``labels``.
        shapes: ``--shape`` values: an input's full shape, its first dimension the batch of every input.
        metric: One of ``METRICS``; default ``cosine`` of the first output against FP32.

    Returns:
        The draft, its paths absolute.

    Raises:
        ConfigError: One line naming the fix: a model that cannot be read or loaded, data that does not fit it.
    """
    model_path, data_path = Path(model).resolve(), Path(data).resolve()
    metric = metric or DEFAULT_METRIC
    if metric not in METRICS:
        raise ConfigError(f"--metric {metric}: choose one of {', '.join(METRICS)}")
    try:
        graph = load_onnx(model_path)
    except ModelError as error:
        raise ConfigError(str(error).replace("fix model.onnx in the config", "check the path")) from None
    _check_runtime_loads(model_path)
    arrays = _read_samples(data_path)
    inputs = _resolve_inputs(graph_inputs(graph), arrays, shapes or {}, data_path)
    batch, total = inputs[0].shape[0], int(arrays[inputs[0].name].shape[0])
    ranges = _split(total, batch, data_path)
    if metric == "top1" and "labels" not in arrays:
        raise ConfigError(f"--metric top1 scores against labels: add a 'labels' array to {data_path}, or drop --metric")
    spans = ", ".join(f"{split} {start}:{stop}" for split, (start, stop) in ranges.items())
    config = {
        "name": _run_name(model_path),
        "model": {"onnx": str(model_path)},
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in inputs],
        "data": {split: {"npz": str(data_path), "start": a, "stop": b} for split, (a, b) in ranges.items()},
        "metric": {"name": metric},
        "accuracy_budget": DEFAULT_ACCURACY_BUDGET,
        "backend": {"name": "auto"},
    }
    notes = _notes(graph, inputs, total, data_path, metric)
    summary = (
        f"{model_path.name}: inputs {', '.join(f'{s.name} {list(s.shape)} {s.dtype}' for s in inputs)}; "
        f"{data_path.name}: {total} samples, {spans}; metric {metric}, accuracy budget {DEFAULT_ACCURACY_BUDGET}"
    )
    return Draft(config, notes, summary)


def _notes(graph: Any, inputs: list[InputSpec], total: int, data: Path, metric: str) -> dict[str, str]:
    """What ``autotune init`` says above each section it decided."""
    dynamic = [s.name for s in graph_inputs(graph) if any(d < 0 for d in s.shape)]
    batch = inputs[0].shape[0]
    output = graph.graph.output[0].name if graph.graph.output else "?"
    from_data = f"; the dynamic dimensions of {dynamic} from the data (batch {batch}; change with --shape)"
    return {
        "name": "The run directory is runs/<name>",
        "inputs": "Read from the graph" + (from_data if dynamic else ""),
        "data": f"{total} samples of {data.name} in file order, in batches of {batch}: the first quarter "
        "calibrates, the next half evaluates every plan, the last quarter is held out to confirm the finalists "
        "(shuffle the file first if it is sorted)",
        "metric": f"{metric} of the first output ({output}) against the FP32 model"
        if metric != "top1"
        else "top-1 accuracy against the file's labels",
        "accuracy_budget": "The largest drop of the metric a plan may cost",
        "backend": "The CPU runtime whose FP32 and all-INT8 seeds run fastest on this machine, timed side by side "
        "when the run starts (ONNX Runtime; OpenVINO where it is installed); name one to skip the timing",
    }


def commented_yaml(config: dict[str, Any], notes: dict[str, str], header: str) -> str:
    """``config`` as YAML, each top-level key under its note, ``header`` on top (every line a comment)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in config.items():
        if key in notes:
            lines.extend(f"# {line}" for line in _wrap(notes[key]))
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=None)
        if text.startswith("{"):  # a scalar: its key on a line of its own, not a one-key flow mapping
            text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False)
        lines.append(text.rstrip())
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 112) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]
