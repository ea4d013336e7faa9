"""Exporting a PyTorch ``model.torch`` factory's module to ONNX for the layer table, with ``torch.onnx.export``.

For the torch backend (``batch_free``) the module is traced at two rows with its batch left symbolic, and the graph
checked on ONNX Runtime at another batch; graphs that ONNX Runtime or TensorRT run are exported at their shapes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autotune.model.layers import InputSpec, factory_module

log = logging.getLogger(__name__)


def export_torch(
    factory: str, inputs: Sequence[InputSpec], out_path: Path, opset: int = 17, batch_free: bool = False
) -> Path:
    """Exports a PyTorch module built by ``module:function`` to ONNX with ``torch.onnx.export``.

    The exporter traces one forward pass on the CPU; at the configured batch that pass was most of the export (the
    BERT-large-shaped encoder at 128 x 128 tokens: a forward of 16K tokens on the CPU). With ``batch_free``, where the
    inputs share a leading (batch) dimension above ``TRACE_BATCH``, the module is traced at ``TRACE_BATCH`` rows with
    that dimension left symbolic, as exporters of transformers models do; the layer table's shapes still come from
    the configured ones, written in on load (``fix_input_shapes``). A module whose graph keeps the traced batch
    somewhere (a reshape to a constant, say) fails ``_check_batch_free`` and is exported at the configured shapes.

    Args:
        factory: ``"package.module:function"`` returning a ``torch.nn.Module``.
        inputs: Example input names, shapes and dtypes.
        out_path: Where to write the ONNX file.
        opset: ONNX opset.
        batch_free: Trace at ``TRACE_BATCH`` rows where that is exact. For the torch backend, which runs the module
            and reads only the layers from the graph; a graph that ONNX Runtime or TensorRT runs is exported at its
            shapes (a graph traced batch-free keeps its shape arithmetic: 743 nodes against 462 for the encoder).

    Returns:
        ``out_path``.
    """
    module = factory_module(factory)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Runs started side by side may export the same cached model at once: each writes its own file.
    descriptor, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.stem}.", suffix=".onnx")
    os.close(descriptor)
    try:
        traced = _traced_inputs(inputs) if batch_free else None
        if traced is not None:
            try:
                _trace_to_onnx(module, traced, tmp, opset, batch_free=True)
                _check_batch_free(tmp, traced)
            except Exception as error:  # noqa: BLE001 - any failure of the short path leaves the full export
                log.info("exporting %s at its configured batch: traced at %d rows, %s", factory, TRACE_BATCH, error)
                traced = None
        if traced is None:
            _trace_to_onnx(module, inputs, tmp, opset, batch_free=False)
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out_path


TRACE_BATCH = 2
"""Rows ``export_torch`` traces a batched module at: two, not one, as a size-1 dimension may be folded as a
broadcast and then fixed in the graph."""


def _traced_inputs(inputs: Sequence[InputSpec]) -> list[InputSpec] | None:
    """The inputs at ``TRACE_BATCH`` rows, where they share a leading dimension above it; else None."""
    leading = {spec.shape[0] if spec.shape else None for spec in inputs}
    if len(leading) != 1 or None in leading or next(iter(leading)) <= TRACE_BATCH:
        return None
    return _with_rows(inputs, TRACE_BATCH)


def _with_rows(inputs: Sequence[InputSpec], rows: int) -> list[InputSpec]:
    return [dataclasses.replace(spec, shape=(rows, *spec.shape[1:])) for spec in inputs]


def _example_arrays(inputs: Sequence[InputSpec], seed: int = 0) -> list[np.ndarray]:
    """Example inputs to trace and check an export with, their rows alike.

    Ones for integer inputs (valid token ids and masks); one random row repeated for float inputs, so outputs whose
    rows differ owe it to the graph.
    """
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in inputs:
        if "int" in spec.dtype or spec.dtype == "bool":
            arrays.append(np.ones(spec.shape, dtype=np.dtype(spec.dtype)))
            continue
        row = rng.standard_normal(spec.shape[1:]).astype(spec.dtype)
        arrays.append(np.ascontiguousarray(np.broadcast_to(row, spec.shape)))
    return arrays


def _trace_to_onnx(module: Any, inputs: Sequence[InputSpec], path: str, opset: int, batch_free: bool) -> None:
    import torch  # heavy: only when a torch model is exported

    names = [spec.name for spec in inputs]
    with torch.no_grad():
        torch.onnx.export(
            module,
            tuple(torch.from_numpy(array) for array in _example_arrays(inputs)),
            path,
            input_names=names,
            opset_version=opset,
            dynamo=False,
            do_constant_folding=True,
            dynamic_axes={name: {0: "batch"} for name in names} if batch_free else None,
        )


def _check_batch_free(path: str, traced: Sequence[InputSpec]) -> None:
    """Raises unless the graph at ``path`` runs at another batch than it was traced at, and its rows stay alike.

    ONNX Runtime runs it (no graph optimizations: this only checks shapes and rows) on ``TRACE_BATCH`` rows and on
    one row more: every output must have the same shape but for a leading dimension that follows the batch, and
    every row of a batched output must equal the first (the rows of the examples are alike).
    """
    import onnxruntime as ort  # the base install's runtime

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [spec.name for spec in traced]
    rows = traced[0].shape[0]
    outputs = []
    for batch in (rows, rows + 1):
        feeds = _example_arrays(_with_rows(traced, batch))
        outputs.append(session.run(None, dict(zip(names, feeds, strict=True))))
    for index, (small, large) in enumerate(zip(*outputs, strict=True)):
        small, large = np.asarray(small), np.asarray(large)
        batched = small.ndim > 0 and small.shape[0] == rows
        expected = (rows + 1, *small.shape[1:]) if batched else small.shape
        if large.shape != expected:
            raise ValueError(f"keeps its traced batch: output {index} is {large.shape} at {rows + 1} rows")
        if batched and np.issubdtype(large.dtype, np.number):
            scale = float(np.abs(large).max()) if large.size else 0.0
            if not np.allclose(large, large[:1], rtol=1e-4, atol=1e-5 * max(scale, 1.0)):
                raise ValueError(f"mixes its rows: output {index}'s rows differ for alike inputs")
