"""A plan's base precision: the whole typed graph computes in FP16 or BF16, and the plan's layers override it.

With ``base_precision`` fp16 or bf16 every float tensor of the graph is of that type (initializers converted),
except around the nodes that stay FP32: a plan's FP32 layers (overrides) and the ops whose values leave FP16's
range (``range_float_ops``). Casts sit where the two meet and at the graph inputs and outputs, so the model's
inputs and outputs keep their types. The Q/DQ the lowering wrote for INT8/FP8 layers is retyped with the rest:
its scales (already rounded to the base type, ``autotune.quant.qparams.in_scale_type``) and so its DQ outputs are
of the base type, which is what the consumer computes in, as TensorRT's strong typing requires.

Why not a library converter: ONNX Runtime ships ``onnxruntime.transformers.float16.convert_float_to_float16``
(onnxconverter-common's converter; onnxconverter-common itself is not installed). It converts to FP16 only (no
BF16), and an initializer shared by a blocked (FP32) node and a converted one is converted for both, so an FP32
override would silently read FP16-rounded weights; it also rounds Q/DQ scales after the weights were quantized
against them. The pass below is the minimal one this lowering needs: per-slot types from the ONNX schemas, one
Cast per tensor and type, and initializers copied per type.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, defs, helper, numpy_helper

from autotune.model.shapes import infer_shapes
from autotune.quant.graphedit import GraphEditor, RewriteError, default_opset

BASE_PRECISION_KNOB = "base_precision"
"""The plan knob of the precision the whole graph computes in (graph backends; the torch backend's has the same
name and meaning)."""

BASE_TYPES = {"fp16": (TensorProto.FLOAT16, np.float16), "bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16)}
"""Half bases: ONNX element type and numpy type. ``fp32`` is the base that changes nothing."""

BASE_PRECISIONS = ("fp32", *BASE_TYPES)

_FP16_RANGE = {
    "Pow": "a square overflows FP16 above 256 (a decomposed LayerNorm's variance)",
    "ReduceSumSquare": "a sum of squares overflows FP16 above 256",
    "ReduceL2": "its sum of squares overflows FP16 above 256",
    "LayerNormalization": "its variance overflows FP16 for activations above 256, and TensorRT normalizes in the "
    "type of its input",
}
"""Ops kept FP32 in an FP16 base, and why. BF16 has FP32's exponent range, so a BF16 base keeps none."""

_RANGE_FOLLOWERS = ("ReduceMean", "ReduceSum", "Add", "Sqrt")
"""Ops that reduce or shift a kept op's output: they stay FP32 with it, up to the Sqrt that brings the values
back into FP16's range (a decomposed LayerNorm: Pow -> ReduceMean -> Add(eps) -> Sqrt stays FP32, Div does not)."""

_DTYPE_ATTRIBUTE_OPS = ("EyeLike", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")


def base_precision_of(knob_value: object) -> str:
    """A plan's ``base_precision`` knob value, checked.

    Raises:
        RewriteError: Not one of ``BASE_PRECISIONS``.
    """
    base = str(knob_value)
    if base not in BASE_PRECISIONS:
        raise RewriteError(f"knob {BASE_PRECISION_KNOB} must be one of {BASE_PRECISIONS}, not {knob_value!r}")
    return base


def range_float_ops(graph: onnx.GraphProto, base: str) -> dict[str, str]:
    """The nodes that stay FP32 in ``base`` because their values leave its range, each with the reason.

    Only an FP16 base keeps any (``_FP16_RANGE``, and the reductions that follow them up to a Sqrt).
    """
    if base != "fp16":
        return {}
    producer = {name: node for node in graph.node for name in node.output if name}
    kept: dict[str, str] = {}
    for node in graph.node:
        if node.op_type in _FP16_RANGE:
            kept[node.name] = f"FP32 in the fp16 base: {_FP16_RANGE[node.op_type]}"
            continue
        if node.op_type not in _RANGE_FOLLOWERS:
            continue
        sources = [producer.get(name) for name in node.input if name]
        source = next(
            (s for s in sources if s is not None and s.name in kept and s.op_type != "Sqrt"),
            None,
        )
        if source is not None:
            kept[node.name] = f"FP32 in the fp16 base: reads {source.op_type} {source.name!r}, outside FP16's range"
    return kept


def _allowed(schema: defs.OpSchema, slot: int, inputs: bool) -> set[str] | None:
    """The type strings a node slot may take, from its schema (None when the schema does not say)."""
    formals = schema.inputs if inputs else schema.outputs
    if not formals:
        return None
    formal = formals[min(slot, len(formals) - 1)]
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return constraints.get(formal.type_str, {formal.type_str})


class _BaseTyper(GraphEditor):
    """Retypes one (copied) model to a half base; ``keep`` names the nodes that stay FP32."""

    def __init__(self, model: onnx.ModelProto, base: str, keep: Mapping[str, str]) -> None:
        super().__init__(model)
        self.base = base
        self.base_type, self.base_np = BASE_TYPES[base]
        self.base_str = "tensor(bfloat16)" if base == "bf16" else "tensor(float16)"
        self.keep = dict(keep)
        self.opset = default_opset(model)
        inferred = infer_shapes(model)  # types only: the weights' bytes stay out of it
        self.types: dict[str, int] = {init.name: init.data_type for init in self.graph.initializer}
        for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                self.types.setdefault(value.name, value.type.tensor_type.elem_type)
        self.producer_at = {name: i for i, node in enumerate(self.graph.node) for name in node.output if name}
        self.versions: dict[str, dict[int, str]] = {}  # float tensor -> its type -> the tensor holding it
        self.float_inputs: dict[int, set[int]] = {}  # node index -> input slots that stay FLOAT in a base node

    # ----- what runs in the base --------------------------------------------------------------------------

    def classify(self, index: int, node: onnx.NodeProto) -> None:
        """Keeps a node FP32 when its schema has no base type for a float output; notes FLOAT-only input slots."""
        if node.name in self.keep:
            return
        if any(attribute.HasField("g") or attribute.graphs for attribute in node.attribute):
            self.keep[node.name] = "FP32: it has a subgraph, which the base conversion does not enter"
            return
        float_outputs = [i for i, name in enumerate(node.output) if self.types.get(name) == TensorProto.FLOAT]
        float_inputs = [i for i, name in enumerate(node.input) if name and self.types.get(name) == TensorProto.FLOAT]
        if not float_outputs and not float_inputs:
            return
        try:
            schema = defs.get_schema(node.op_type, self.opset, node.domain or "")
        except defs.SchemaError:
            self.keep[node.name] = f"FP32: no ONNX schema for {node.domain or 'ai.onnx'}.{node.op_type}"
            return
        for slot in float_outputs:
            allowed = _allowed(schema, slot, inputs=False)
            if allowed is not None and self.base_str not in allowed:
                self.keep[node.name] = f"FP32: ONNX {node.op_type} (opset {self.opset}) has no {self.base} type"
                return
        self.float_inputs[index] = {
            slot for slot in float_inputs if self.base_str not in (_allowed(schema, slot, inputs=True) or {""})
        }

    # ----- tensors in a wanted type -----------------------------------------------------------------------

    def initializer_as(self, name: str, wanted: int) -> str:
        """``name`` (a FLOAT initializer) in the wanted type: itself, or a converted copy shared by its readers."""
        if wanted == TensorProto.FLOAT:
            return name
        versions = self.versions.setdefault(name, {TensorProto.FLOAT: name})
        if wanted not in versions:
            array = numpy_helper.to_array(self.inits[name])
            if self.base == "fp16":  # FP16 ends at 65504: saturate rather than write inf
                finite = float(np.finfo(np.float16).max)
                array = np.clip(array, -finite, finite)
            versions[wanted] = self.add_init(f"{name}__{self.base}", array.astype(self.base_np))
            self.replaced.add(name)
        return versions[wanted]

    def tensor_as(self, name: str, wanted: int) -> str:
        """An activation in the wanted type: the tensor itself, or one Cast of it shared by every such reader."""
        versions = self.versions[name]
        if wanted not in versions:
            source = next(iter(versions.values()))
            cast = self.fresh(f"{name}__{'fp32' if wanted == TensorProto.FLOAT else self.base}")
            node = helper.make_node("Cast", [source], [cast], self.fresh(f"{name}__Cast"), to=wanted)
            if name in self.producer_at:
                self.after[self.producer_at[name]].append(node)
            else:
                self.prologue.append(node)
            versions[wanted] = cast
        return versions[wanted]

    # ----- the pass ---------------------------------------------------------------------------------------

    def retype_attributes(self, node: onnx.NodeProto) -> None:
        """Casts to FLOAT, float constants and dtype attributes of a base node take the base type."""
        for position, attribute in enumerate(node.attribute):
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = self.base_type
            elif node.op_type in _DTYPE_ATTRIBUTE_OPS and attribute.name == "dtype":
                attribute.i = self.base_type if attribute.i == TensorProto.FLOAT else attribute.i
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                array = numpy_helper.to_array(attribute.t).astype(self.base_np)
                attribute.t.CopyFrom(numpy_helper.from_array(array, attribute.t.name))
            elif node.op_type == "Constant" and attribute.name in ("value_float", "value_floats"):
                values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
                tensor = numpy_helper.from_array(np.asarray(values, dtype=self.base_np), "value")
                node.attribute[position].CopyFrom(helper.make_attribute("value", tensor))
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            # Without a value ConstantOfShape writes FLOAT zeros.
            zero = numpy_helper.from_array(np.zeros(1, dtype=self.base_np), "value")
            node.attribute.append(helper.make_attribute("value", zero))

    def run(self) -> None:
        """Retypes every node; Casts are spliced in by ``finish``."""
        graph = self.graph
        for index, node in enumerate(graph.node):
            self.classify(index, node)
        for value in graph.input:
            if self.types.get(value.name) == TensorProto.FLOAT and value.name not in self.inits:
                self.versions[value.name] = {TensorProto.FLOAT: value.name}
        self.cast_outputs()
        for index, node in enumerate(graph.node):
            in_base = node.name not in self.keep
            if not in_base:
                node.doc_string = self.keep[node.name]
            float_only = self.float_inputs.get(index, set())
            for slot, name in enumerate(node.input):
                if not name or self.types.get(name) != TensorProto.FLOAT:
                    continue
                wanted = self.base_type if in_base and slot not in float_only else TensorProto.FLOAT
                if name in self.inits:
                    node.input[slot] = self.initializer_as(name, wanted)
                elif name in self.versions:
                    node.input[slot] = self.tensor_as(name, wanted)
            if in_base:
                self.retype_attributes(node)
            for name in node.output:
                if name and self.types.get(name) == TensorProto.FLOAT:
                    self.versions.setdefault(name, {})[self.base_type if in_base else TensorProto.FLOAT] = name
        self.retype_value_info()

    def cast_outputs(self) -> None:
        """A graph output computed in the base is cast back to FLOAT, so the model's outputs keep their type.

        The producer writes a new tensor, which the graph's readers read instead; the Cast writes the output.
        """
        for value in self.graph.output:
            index = self.producer_at.get(value.name)
            if index is None or self.types.get(value.name) != TensorProto.FLOAT:
                continue
            if self.graph.node[index].name in self.keep:
                continue
            low = self.rename_output(index, value.name, self.base)
            for reader in self.graph.node:
                self.redirect(reader, value.name, low)
            self.types[low], self.producer_at[low] = TensorProto.FLOAT, index
            self.after[index].append(
                helper.make_node("Cast", [low], [value.name], self.fresh(f"{value.name}__Cast"), to=TensorProto.FLOAT)
            )
            self.versions[low] = {TensorProto.FLOAT: value.name}

    def retype_value_info(self) -> None:
        """Declared types follow the tensors: value_info of a tensor now in the base says so."""
        for value in self.graph.value_info:
            versions = self.versions.get(value.name, {})
            if versions.get(self.base_type) == value.name and value.type.HasField("tensor_type"):
                value.type.tensor_type.elem_type = self.base_type


def to_base(model: onnx.ModelProto, base: str, keep: Mapping[str, str]) -> dict[str, str]:
    """Retypes ``model`` in place to compute in ``base``; returns the nodes left FP32 with why.

    Args:
        model: A typed model (the lowering's copy), in topological order.
        base: ``fp16`` or ``bf16`` (``fp32`` changes nothing).
        keep: Node name to why it stays FP32 (the plan's FP32 layers, ``range_float_ops``). Nodes whose ONNX
            schema has no base type at the model's opset, and nodes with subgraphs, are added with their reason.

    Returns:
        Every node left FP32 and why; the same text is the node's ``doc_string`` in the model.
    """
    if base == "fp32":
        return {}
    typer = _BaseTyper(model, base, keep)
    typer.run()
    typer.finish()
    return typer.keep
