r"""Reads TensorRT's engine inspector JSON and checks that each layer runs in the precision the plan asked for.

Pure: works on the JSON text of ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)`` (or
trtexec's ``--exportLayerInfo``) of an engine built with ``ProfilingVerbosity.DETAILED``. Two layouts exist:

- 10.x: ``{"Layers": [...], "Bindings": ["x", "y"]}``; each tensor has one ``"Format/Datatype"`` string such
  as ``"Row major linear FP32"`` or ``"Channel major FP16 format where channel % 8 == 0"``.
- 11.x: ``{"Layers": [...], "I/O Tensors": [{"Name", "IOMode", "DataType", ...}]}``; a tensor's format and
  data type are separate fields (seen spelled ``DataType`` and ``Datatype``).

With LAYER_NAMES_ONLY verbosity ``Layers`` is a list of names and nothing can be checked. Engine layers point
back to the ONNX nodes they were made from through ``Metadata`` entries ``[ONNX Layer: <node name>]``, joined
with the ASCII separators ``\x1f`` (nodes fused into one layer) and ``\x1e``. A TensorRT 11 build silently
keeping a layer in FP32 is a known failure (docs/tensorrt.md, "What a build does"), so a requested precision
that did not land is reported, not assumed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PRECISION_ORDER = ("int4", "fp8", "int8", "fp16", "bf16", "fp32")
"""Narrowest first: a layer with an int8 and an fp32 input computes in int8 (a fused quantized kernel)."""

_TYPE_PATTERNS = (
    # Longest and most specific spellings first: "Float8" must not read as "Float", "BFloat16" not as "Float16".
    (re.compile(r"\b(?:fp8|float8\w*|e4m3\w*)\b", re.I), "fp8"),
    (re.compile(r"\b(?:bf16|bfloat16)\b", re.I), "bf16"),
    (re.compile(r"\b(?:fp16|half|float16)\b", re.I), "fp16"),
    (re.compile(r"\b(?:fp32|float|float32|tf32)\b", re.I), "fp32"),
    (re.compile(r"\b(?:uint8)\b", re.I), "uint8"),
    (re.compile(r"\b(?:int8)\b", re.I), "int8"),
    (re.compile(r"\b(?:int4)\b", re.I), "int4"),
    (re.compile(r"\b(?:fp4|e2m1)\b", re.I), "fp4"),
    (re.compile(r"\b(?:int32|int64|bool)\b", re.I), "index"),
)
_METADATA_ENTRY = re.compile(r"^\s*\[ONNX Layer:\s*(.*?)\]\s*$", re.S)
_SKIPPED_TYPES = ("reformat", "noop", "constant", "shuffle", "cast", "quantize", "dequantize")
_COMPUTE_HINTS = ("conv", "gemm", "matrixmultiply", "matmul", "fullyconnected", "deconv", "fusion", "kgen", "myelin")


class InspectorFormatError(ValueError):
    """The inspector output is not JSON or has no ``Layers``."""


def normalize_dtype(text: object) -> str | None:
    """A precision name from any spelling TensorRT uses for a data type.

    Args:
        text: ``"Row major linear FP32"``, ``"Half"``, ``"INT8"``, ``"DataType.BF16"``, ...

    Returns:
        ``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp8``, ``int4``, ``fp4``, ``uint8``, ``index`` (int32/int64/bool
        tensors, which say nothing about compute precision), or None when no type is named.
    """
    if not isinstance(text, str):
        return None
    text = text.replace("DataType.", " ").replace("_", " ")
    for pattern, name in _TYPE_PATTERNS:
        if pattern.search(text):
            return name
    return None


def _get(entry: Mapping[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present in ``entry``, compared case-insensitively and ignoring spaces."""
    folded = {str(k).replace(" ", "").lower(): v for k, v in entry.items()}
    for key in keys:
        value = folded.get(key.replace(" ", "").lower())
        if value is not None:
            return value
    return None


def tensor_dtype(entry: object) -> str | None:
    """The data type of one tensor entry of either layout (a dict, or a bare string)."""
    if isinstance(entry, str):
        return normalize_dtype(entry)
    if not isinstance(entry, Mapping):
        return None
    for key in ("DataType", "Datatype", "Data Type", "Format/Datatype", "Format/DataType", "Type"):
        value = _get(entry, key)
        if value is not None:
            found = normalize_dtype(value)
            if found is not None:
                return found
    return normalize_dtype(_get(entry, "Format"))


def onnx_nodes(metadata: object) -> tuple[str, ...]:
    r"""ONNX node names in a layer's ``Metadata`` (``[ONNX Layer: a]\x1f[ONNX Layer: b]``), in order, each once."""
    if not isinstance(metadata, str) or not metadata:
        return ()
    names = []
    for part in re.split(r"[\x1e\x1f]", metadata):
        # Some builds concatenate entries without a separator ("[ONNX Layer: a][ONNX Layer: b]"); split between
        # them rather than at every "]", which a node name may contain.
        for entry in re.split(r"(?<=\])\s*(?=\[ONNX Layer:)", part):
            match = _METADATA_ENTRY.match(entry)
            if match:
                names.append(match.group(1))
    return tuple(dict.fromkeys(name.strip() for name in names if name.strip()))


@dataclass(frozen=True)
class EngineLayer:
    """One layer of a built engine.

    Attributes:
        name: The engine layer's name (fused layers read ``"a + b"``).
        layer_type: ``LayerType`` (``CaskConvolution``, ``MatrixMultiply``, ``Reformat``, ``kgen`` ...).
        onnx_nodes: The ONNX nodes it was made from, from its metadata.
        input_types: Normalized data types of its tensor inputs.
        output_types: Normalized data types of its outputs.
        weight_type: Normalized type of its embedded weights, if reported.
        tactic: The chosen kernel, if reported.
    """

    name: str
    layer_type: str = ""
    onnx_nodes: tuple[str, ...] = ()
    input_types: tuple[str | None, ...] = ()
    output_types: tuple[str | None, ...] = ()
    weight_type: str | None = None
    tactic: str | None = None

    @property
    def is_foreign(self) -> bool:
        """A Myelin subgraph (``{ForeignNode[...]}``) whose inner per-node precision the inspector does not show."""
        return self.name.startswith("{ForeignNode") or "foreignnode" in self.layer_type.lower()

    @property
    def is_auxiliary(self) -> bool:
        """A layer that moves or converts data rather than computing the node (reformat, shuffle, cast, Q, DQ)."""
        kind = self.layer_type.lower()
        return any(word in kind for word in _SKIPPED_TYPES) or self.name.startswith("Reformatting CopyNode")

    @property
    def precision(self) -> str | None:
        """The narrowest compute type among its inputs and weights, or None when none is reported.

        Outputs are not used: a quantized kernel without an output Q writes float.
        """
        seen = {t for t in (*self.input_types, self.weight_type) if t in PRECISION_ORDER}
        return next((p for p in PRECISION_ORDER if p in seen), None)


@dataclass(frozen=True)
class IOTensor:
    """One engine input or output.

    Attributes:
        name: Tensor name.
        mode: ``input``, ``output`` or ``""`` when the layout does not say (10.x ``Bindings``).
        dtype: Normalized data type, where reported.
    """

    name: str
    mode: str = ""
    dtype: str | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the inspector reported.

    Attributes:
        layers: The engine's layers, in execution order.
        io_tensors: Its inputs and outputs.
        layout: ``"10.x"`` (``Bindings``), ``"11.x"`` (``I/O Tensors``) or ``"unknown"``.
        detailed: Whether layers came with details (DETAILED verbosity) rather than names only.
    """

    layers: tuple[EngineLayer, ...]
    io_tensors: tuple[IOTensor, ...] = ()
    layout: str = "unknown"
    detailed: bool = True

    def layers_of(self, node: str) -> list[EngineLayer]:
        """Engine layers whose metadata names the ONNX node ``node``."""
        return [layer for layer in self.layers if node in layer.onnx_nodes]


def _parse_layer(entry: object) -> EngineLayer:
    if isinstance(entry, str):
        return EngineLayer(name=entry, onnx_nodes=onnx_nodes(entry))
    if not isinstance(entry, Mapping):
        return EngineLayer(name=str(entry))
    name = str(_get(entry, "Name") or "")
    metadata = _get(entry, "Metadata")
    nodes = onnx_nodes(metadata) or onnx_nodes(name)
    inputs = _get(entry, "Inputs") or []
    outputs = _get(entry, "Outputs") or []
    weights = _get(entry, "Weights")
    weight_type = tensor_dtype(weights) if isinstance(weights, Mapping) else None
    return EngineLayer(
        name=name,
        layer_type=str(_get(entry, "LayerType", "Layer Type") or ""),
        onnx_nodes=nodes,
        input_types=tuple(tensor_dtype(i) for i in inputs if isinstance(i, Mapping | str)),
        output_types=tuple(tensor_dtype(o) for o in outputs if isinstance(o, Mapping | str)),
        weight_type=weight_type,
        tactic=str(_get(entry, "TacticName") or "") or None,
    )


def _parse_io(data: Mapping[str, Any]) -> tuple[tuple[IOTensor, ...], str]:
    tensors = _get(data, "I/O Tensors", "IOTensors")
    if isinstance(tensors, list):
        parsed = []
        for entry in tensors:
            if isinstance(entry, Mapping):
                mode = str(_get(entry, "IOMode", "Mode") or "").lower()
                parsed.append(IOTensor(str(_get(entry, "Name") or ""), mode, tensor_dtype(entry)))
            else:
                parsed.append(IOTensor(str(entry)))
        return tuple(parsed), "11.x"
    bindings = _get(data, "Bindings")
    if isinstance(bindings, list):
        return tuple(IOTensor(str(_get(b, "Name") if isinstance(b, Mapping) else b)) for b in bindings), "10.x"
    return (), "unknown"


def parse_engine_info(source: str | Mapping[str, Any]) -> EngineInfo:
    """Parses inspector JSON of either layout.

    Args:
        source: The JSON text, or the already decoded object.

    Returns:
        The engine's layers and I/O tensors.

    Raises:
        InspectorFormatError: Not JSON, or no ``Layers`` list.
    """
    if isinstance(source, str):
        try:
            data = json.loads(source)
        except json.JSONDecodeError as error:
            raise InspectorFormatError(f"the engine inspector output is not JSON: {error}") from error
    else:
        data = source
    layers = _get(data, "Layers") if isinstance(data, Mapping) else None
    if not isinstance(layers, list):
        raise InspectorFormatError("the engine inspector output has no 'Layers' list")
    io_tensors, layout = _parse_io(data)
    parsed = tuple(_parse_layer(entry) for entry in layers)
    detailed = any(isinstance(entry, Mapping) for entry in layers)
    return EngineInfo(layers=parsed, io_tensors=io_tensors, layout=layout, detailed=detailed)


@dataclass(frozen=True)
class LayerCheck:
    """The requested and the observed precision of one tunable layer.

    Attributes:
        node: The ONNX node (tunable layer) name.
        requested: The precision the typed model asks for.
        observed: The precision the engine runs it in, or None when the inspector does not tell.
        engine_layers: Names of the engine layers that compute it.
        note: Why it could not be verified, or what the engine layer's inputs were.
    """

    node: str
    requested: str
    observed: str | None
    engine_layers: tuple[str, ...] = ()
    note: str = ""

    @property
    def verified(self) -> bool:
        """The inspector told the precision."""
        return self.observed is not None

    @property
    def landed(self) -> bool:
        """The requested precision is the one observed (fp32 also covers TF32 kernels)."""
        return self.observed == self.requested

    def describe(self) -> str:
        """One line for an error or a log."""
        layers = ", ".join(repr(n) for n in self.engine_layers) or "no engine layer"
        if not self.verified:
            return f"layer {self.node!r}: requested {self.requested}, not verifiable ({self.note or layers})"
        return (
            f"requested {self.requested} for layer {self.node!r}, engine runs it in {self.observed} "
            f"(engine layers {layers}{'; ' + self.note if self.note else ''})"
        )


@dataclass(frozen=True)
class PrecisionReport:
    """Every tunable layer's requested and observed precision."""

    checks: tuple[LayerCheck, ...] = field(default_factory=tuple)

    @property
    def mismatches(self) -> list[LayerCheck]:
        """Layers the engine runs in another precision than requested."""
        return [check for check in self.checks if check.verified and not check.landed]

    @property
    def unverified(self) -> list[LayerCheck]:
        """Layers whose precision the inspector does not tell."""
        return [check for check in self.checks if not check.verified]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: per layer requested, observed, engine layers."""
        return {
            check.node: {
                "requested": check.requested,
                "observed": check.observed,
                "engine_layers": list(check.engine_layers),
                "note": check.note,
            }
            for check in self.checks
        }


def _compute_layers(candidates: Sequence[EngineLayer]) -> list[EngineLayer]:
    """The layers that compute a node: weighted-kernel types first, else anything but reformats and casts."""
    compute = [c for c in candidates if not c.is_auxiliary]
    hinted = [c for c in compute if any(h in c.layer_type.lower() for h in _COMPUTE_HINTS)]
    return hinted or compute


def _check_one(info: EngineInfo, node: str, requested: str) -> LayerCheck:
    if not info.detailed:
        return LayerCheck(node, requested, None, note="the engine was not built with ProfilingVerbosity.DETAILED")
    candidates = info.layers_of(node)
    if not candidates:
        return LayerCheck(node, requested, None, note="no engine layer carries its [ONNX Layer] metadata")
    compute = _compute_layers(candidates)
    names = tuple(c.name for c in (compute or candidates))
    if not compute:
        return LayerCheck(node, requested, None, names, "only reformat/cast layers carry its metadata")
    if all(c.is_foreign for c in compute):
        return LayerCheck(node, requested, None, names, "inside a Myelin ForeignNode; per-node types not reported")
    precisions = [c.precision for c in compute if c.precision is not None]
    if not precisions:
        return LayerCheck(node, requested, None, names, "its engine layers report no input or weight types")
    observed = min(precisions, key=PRECISION_ORDER.index)
    first = next(c for c in compute if c.precision == observed)
    inputs = ", ".join(t or "?" for t in first.input_types)
    note = f"{first.layer_type or 'layer'} inputs [{inputs}]" + (
        f", weights {first.weight_type}" if first.weight_type else ""
    )
    return LayerCheck(node, requested, observed, names, note)


def check_precisions(info: EngineInfo, requested: Mapping[str, str]) -> PrecisionReport:
    """Compares what each tunable layer asked for with what the engine runs.

    Args:
        info: The parsed inspector output.
        requested: ONNX node name to requested precision (``rules.requested_precisions``).

    Returns:
        One check per requested node, in the order given.
    """
    return PrecisionReport(tuple(_check_one(info, node, precision) for node, precision in requested.items()))


def summarize(report: PrecisionReport, nodes: Iterable[str] | None = None) -> str:
    """Mismatches and unverified layers as lines (empty when everything landed)."""
    wanted = set(nodes) if nodes is not None else None
    lines = [c.describe() for c in report.mismatches + report.unverified if wanted is None or c.node in wanted]
    return "\n".join(lines)
