"""ONNX layers -> the modules they came from: the TorchScript exporter names nodes after module paths.

The ONNX export of the ``model.torch`` factory gives the layer table and our calibration; the torch backend maps
each layer back onto the ``nn.Linear`` or ``nn.Conv*d`` it came from, and rewrites that module.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.torch.device import TORCH_CONV_OP_TYPES
from autotune.backends.torch.runtime import static_inputs
from autotune.model.optypes import MATMUL_OP_TYPES

if TYPE_CHECKING:
    from autotune.model.layers import InputSpec, Layer


def module_path(layer_name: str) -> str:
    """The module path an ONNX node name of the TorchScript exporter points at. Pure.

    ``/encoder/layer.0/attention/self/query/MatMul`` -> ``encoder.layer.0.attention.self.query``: strip the leading
    ``/``, drop the last part (the op type), join the scopes with ``.``. ``/MatMul`` gives ``""``, the root.
    """
    return ".".join(layer_name.lstrip("/").split("/")[:-1])


def _scope_name(qualified: str) -> str:
    """The scope name the exporter gives a module: its path from the last non-numeric part on."""
    atoms = qualified.split(".")
    for index in range(len(atoms) - 1, -1, -1):
        if not atoms[index].isnumeric():
            return ".".join(atoms[index:])
    return qualified


def _child(parent: str, scope: str, names: Collection[str]) -> str | None:
    prefix = f"{parent}." if parent else ""
    if prefix + scope in names:
        return prefix + scope
    candidates = [n for n in names if n.startswith(prefix) and n != parent and _scope_name(n) == scope]
    return min(candidates, key=len) if candidates else None


def resolve_module_path(layer_name: str, module_names: Collection[str]) -> str | None:
    """The module an ONNX node of the TorchScript exporter belongs to, or None. Pure.

    ``module_path`` is the first guess. The exporter names a scope after the module's path from its last
    non-numeric part (``nn.Sequential`` children become ``net.0``, under scope ``net``), and suffixes ``_1``,
    ``_2`` to a module called again; each scope is matched against ``module_names`` with those rules.

    Args:
        layer_name: The ONNX node name, e.g. ``/net/net.0/Gemm``.
        module_names: The names of ``named_modules()`` (``""`` is the root).
    """
    if not layer_name.startswith("/"):
        return None  # not an exporter name: a hand-written graph
    names = set(module_names)
    guess = module_path(layer_name)
    if guess in names:
        return guess
    current = ""
    for scope in layer_name.lstrip("/").split("/")[:-1]:
        found = _child(current, scope, names)
        base, _, suffix = scope.rpartition("_")
        if found is None and base and suffix.isdigit():
            found = _child(current, base, names)
        if found is None:
            return None
        current = found
    return current


def _bind_one(layer: Layer, modules: Mapping[str, Any], weight_of: Callable[[str], np.ndarray] | None) -> str:
    """The module path of one layer.

    Raises:
        LookupError: The layer cannot be mapped; the message says why.
        ValueError: The module's weights differ from the ONNX model's (a stale or non-deterministic export).
    """
    from torch import nn

    if layer.op_type not in MATMUL_OP_TYPES + TORCH_CONV_OP_TYPES:
        raise LookupError(f"{layer.op_type} layers are not rewritten by the torch backend")
    if layer.weight is None:
        raise LookupError("an activation x activation MatMul belongs to no nn.Linear")
    path = resolve_module_path(layer.name, modules)
    if path is None:
        raise LookupError(f"no module at {module_path(layer.name)!r} (export with torch.onnx.export(dynamo=False))")
    module = modules[path]
    linear = layer.op_type in MATMUL_OP_TYPES
    wanted = nn.Linear if linear else (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if not isinstance(module, wanted):
        raise LookupError(f"module {path!r} is a {type(module).__name__}, not {'nn.Linear' if linear else 'nn.Conv'}")
    if weight_of is None:
        return path
    onnx_weight = np.asarray(weight_of(layer.weight))
    weight = module.weight.detach().float().cpu().numpy()
    if linear and layer.weight_axis is not None and int(layer.weight_axis) % 2 == 1:
        weight = weight.T  # a MatMul holds W^T: output channels on the last axis
    if onnx_weight.shape != weight.shape:
        raise LookupError(f"module {path!r} has weight shape {list(weight.shape)}, the ONNX layer {onnx_weight.shape}")
    # Conv weights may differ legitimately: the exporter folds a following BatchNorm into them. An export holds the
    # module's own bits, so equality answers in one pass; allclose's temporaries took seconds of a large model's
    # set-up, per process.
    if (
        linear
        and not np.array_equal(onnx_weight, weight)
        and not np.allclose(onnx_weight, weight, rtol=1e-4, atol=1e-6)
    ):
        raise ValueError(
            f"the weights of module {path!r} differ from those of ONNX layer {layer.name!r}: the model.torch "
            f"factory must return the same weights every call (seed it, or load a checkpoint), and the cached "
            f"ONNX export is stale if the weights changed (delete it under cache_dir/models)"
        )
    return path


def one_row(inputs: Sequence[InputSpec]) -> list[InputSpec] | None:
    """The inputs with a batch of one, where they share a leading (batch) dimension above 1; else None."""
    leading = {spec.shape[0] if spec.shape else None for spec in inputs}
    if len(leading) != 1 or None in leading or leading == {1}:
        return None
    return [dataclasses.replace(spec, shape=(1, *spec.shape[1:])) for spec in inputs]


def count_calls(module: Any, inputs: Sequence[InputSpec], paths: Collection[str]) -> dict[str, int]:
    """How often one forward pass (on ``runtime.static_inputs``, on the CPU) calls each module in ``paths``.

    The pass runs one row of the batch where the inputs share a batch dimension: how often a module is called does
    not depend on the batch, and the whole batch on the CPU took 9 s of the BERT-large-shaped encoder's set-up. A
    module that refuses one row is run on the whole batch.
    """
    import torch

    counts = dict.fromkeys(paths, 0)
    handles = []
    for path in counts:

        def hook(*_: Any, path: str = path) -> None:
            counts[path] += 1

        handles.append(module.get_submodule(path).register_forward_hook(hook))
    try:
        with torch.no_grad():
            row = one_row(inputs)
            try:
                module(*static_inputs(row or inputs, "cpu"))
            except Exception:  # noqa: BLE001 - a module written for its batch size: count on the whole batch
                if row is None:
                    raise
                counts.update(dict.fromkeys(paths, 0))
                module(*static_inputs(inputs, "cpu"))
    finally:
        for handle in handles:
            handle.remove()
    return counts


def bind_layers(
    module: Any,
    layers: Sequence[Layer],
    searched: Collection[str],
    weight_of: Callable[[str], np.ndarray] | None = None,
    calls: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Maps ONNX layers onto the modules of ``module``.

    Args:
        module: The FP32 ``nn.Module`` the ONNX model was exported from.
        layers: The layer table.
        searched: Layers the search may change: each must map.
        weight_of: ONNX initializer name -> array, to check that the module's weights are the exported ones.
        calls: Module path -> calls per forward pass (``count_calls``). A module called more often than the
            layer table has layers for it does not map: the exporter passes a reused module's weight through an
            Identity on later calls, which are then no tunable layers, and their inputs were never calibrated.

    Returns:
        Layer name -> module path, for every layer that maps.

    Raises:
        ValueError: A searched layer does not map (the message names ``search.exclude_layers``), or the weights
            differ from the ONNX model's.
    """
    modules = dict(module.named_modules())
    bound: dict[str, str] = {}
    problems: dict[str, str] = {}
    for layer in layers:
        try:
            bound[layer.name] = _bind_one(layer, modules, weight_of)
        except LookupError as error:
            if layer.name in searched:
                problems[layer.name] = str(error)
    for path, count in (calls or {}).items():
        names = [name for name, bound_path in bound.items() if bound_path == path]
        if count > len(names):
            for name in names:
                del bound[name]
                if name in searched:
                    problems[name] = (
                        f"module {path!r} runs {count} times per forward pass but only {len(names)} of its calls "
                        f"are tunable ONNX layers, so the other calls have no calibrated range"
                    )
    if problems:
        pattern = "^(?:" + "|".join(re.escape(name) for name in problems) + ")$"
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise ValueError(
            f"the torch backend cannot map {len(problems)} searched layers onto modules: {lines}. "
            f"Keep them in FP32 with search.exclude_layers: {pattern!r}"
        )
    return bound
