"""Writes a plan's per-layer precisions into an explicitly typed ONNX graph.

int8/fp8 layers get Q/DQ pairs and quantized weights, fp16/bf16 layers get Casts and low-precision weights.
Unlike ORT's ``quantize_static``, every Q/DQ pair and Cast written here is dedicated to one layer: other
consumers of the same tensor (a residual Add, a sibling MatMul left in FP32) keep reading the float tensor.
Without this, a layer's quantization also changes what its float neighbours read, and its accuracy drop is not
its own.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, defs, helper, numpy_helper, version_converter

from autotune.model import Layer
from autotune.plan import Plan
from autotune.quant.qparams import (
    activation_qparams,
    fp8_activation_scale,
    quantize_bias_int32,
    quantize_weight,
    quantize_weight_fp8,
)
from autotune.quant.recipe import QuantRecipe

_CONV_OPS = ("Conv", "ConvTranspose")
_MATMUL_OPS = ("MatMul", "Gemm")
_DEFAULT_DOMAINS = ("", "ai.onnx")
_GRANULARITIES = ("per_channel", "per_tensor")

_HALF = {
    "fp16": (TensorProto.FLOAT16, np.float16),
    "bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
}


class RewriteError(ValueError):
    """The plan cannot be written into the model; the message names the layer or tensor and the fix."""


def _min_opset(precision: str, op_type: str) -> int:
    """The default-domain opset a precision needs for one op type.

    int8: per-channel DequantizeLinear (``axis``) needs 13. fp8: FLOAT8E4M3FN Q/DQ needs 19.
    bf16: Cast, MatMul and Gemm take bfloat16 from 13, Conv and ConvTranspose only from 22.
    fp16 works at any opset we accept.
    """
    if precision == "int8":
        return 13
    if precision == "fp8":
        return 19
    if precision == "bf16":
        return 22 if op_type in _CONV_OPS else 13
    return 0


def _default_opset(model: onnx.ModelProto) -> int:
    return next((op.version for op in model.opset_import if op.domain in _DEFAULT_DOMAINS), 0)


def _ensure_opset(model: onnx.ModelProto, needed: int) -> onnx.ModelProto:
    """Raises the default-domain opset to ``needed``, converting ops whose definition changed in between.

    Bumping the number alone is only safe when no op in the graph got a new version (e.g. Squeeze moved
    ``axes`` to an input in 13), so such graphs go through ONNX's version converter.
    """
    current = _default_opset(model)
    if current >= needed:
        return model
    changed = set()
    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        try:
            if defs.get_schema(node.op_type, needed, "").since_version > current:
                changed.add(node.op_type)
        except defs.SchemaError:
            changed.add(node.op_type)
    if changed:
        try:
            model = version_converter.convert_version(model, needed)
        except Exception as error:  # noqa: BLE001 - the converter raises several types
            raise RewriteError(
                f"the plan needs opset {needed} but the model has opset {current} and ops {sorted(changed)} "
                f"could not be converted ({error}); re-export the model at opset >= {needed}"
            ) from error
    else:
        entry = next((op for op in model.opset_import if op.domain in _DEFAULT_DOMAINS), None)
        if entry is None:
            entry = model.opset_import.add()
            entry.domain = ""
        entry.version = needed
    model.ir_version = max(
        model.ir_version, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    )
    return model


def _consumers(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Tensor name to the indices of the nodes that read it (a node reading it twice counts once)."""
    consumers: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(graph.node):
        for name in dict.fromkeys(node.input):
            if name:
                consumers[name].append(index)
    return consumers


def _sole_relu(graph: onnx.GraphProto, consumers: Mapping[str, list[int]], tensor: str) -> int | None:
    """The index of the Relu that is the only reader of ``tensor``, or None."""
    readers = consumers.get(tensor, [])
    if len(readers) != 1 or tensor in {o.name for o in graph.output}:
        return None
    return readers[0] if graph.node[readers[0]].op_type == "Relu" else None


def _quantizes_output(op_type: str, recipe: QuantRecipe) -> bool:
    """Whether an int8 layer of ``op_type`` gets a Q/DQ pair on its output under ``recipe``."""
    if op_type in _CONV_OPS:
        return recipe.quantize_conv_output
    return recipe.quantize_matmul_output


def _output_target(
    graph: onnx.GraphProto, consumers: Mapping[str, list[int]], output: str, recipe: QuantRecipe
) -> tuple[int | None, str]:
    """Where an output Q/DQ goes.

    Returns:
        ``(relu index, relu output)`` when folded into a sole Relu, else ``(None, output)``.
    """
    if recipe.fold_relu_into_output:
        relu = _sole_relu(graph, consumers, output)
        if relu is not None:
            return relu, graph.node[relu].output[0]
    return None, output


def smoothable(layer: Layer) -> bool:
    """SmoothQuant applies: a MatMul whose constant 2-D weight has one row per channel of the input's last axis."""
    return layer.op_type == "MatMul" and layer.weight is not None and layer.weight_axis in (1, -1)


def smooth_weight(w: np.ndarray, factors: np.ndarray, layer: Layer) -> np.ndarray:
    """``diag(factors) @ w``: the weight of a smoothed layer, or RewriteError when the shapes do not fit."""
    if not smoothable(layer) or w.ndim != 2 or factors.shape != (w.shape[0],):
        raise RewriteError(
            f"layer {layer.name!r}: smoothing needs a MatMul with a 2-D weight and one factor per input channel "
            f"(weight {list(w.shape)}, {factors.size} factors)"
        )
    return (w * factors[:, None].astype(w.dtype)).astype(w.dtype)


def required_ranges(layers: Sequence[Layer], recipe: QuantRecipe, model: onnx.ModelProto) -> list[str]:
    """Every tensor whose calibrated range ``rewrite`` may need when the layers run in int8 (or fp8).

    Args:
        layers: The tunable layers.
        recipe: The backend's recipe (decides which outputs are quantized and whether Relus are folded).
        model: The model the layers come from.

    Returns:
        Tensor names, each once, in layer order: activation inputs, then quantized outputs (or the Relu
        outputs they fold into).
    """
    consumers = _consumers(model.graph)
    names: list[str] = []
    for layer in layers:
        names.extend(layer.activation_inputs)
        if _quantizes_output(layer.op_type, recipe):
            names.append(_output_target(model.graph, consumers, layer.output, recipe)[1])
    return list(dict.fromkeys(names))


class _Rewriter:
    """Edits one (copied) model in place; new nodes are collected per position, spliced in by ``finish``."""

    def __init__(
        self,
        model: onnx.ModelProto,
        ranges: Mapping[str, tuple[float, float]],
        recipe: QuantRecipe,
        per_channel: bool,
        layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
        smoothing: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.model = model
        self.smoothing = smoothing or {}
        self.graph = model.graph
        self.ranges = ranges
        self.layer_ranges = layer_ranges or {}
        self.recipe = recipe
        self.per_channel = per_channel
        self.inits = {init.name: init for init in self.graph.initializer}
        self.node_index = {node.name: i for i, node in enumerate(self.graph.node) if node.name}
        self.consumers = _consumers(self.graph)
        self.taken = {name for node in self.graph.node for name in (*node.input, *node.output, node.name)}
        self.taken |= {v.name for v in (*self.graph.input, *self.graph.output, *self.graph.value_info)}
        self.taken |= set(self.inits)
        self.prologue: list[onnx.NodeProto] = []
        self.before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.after: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.replaced: set[str] = set()
        self.cache: dict[tuple, tuple] = {}

    # ----- names and initializers -------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        """A tensor or node name not used anywhere in the graph yet."""
        name, suffix = base, 1
        while name in self.taken:
            name, suffix = f"{base}_{suffix}", suffix + 1
        self.taken.add(name)
        return name

    def add_init(self, base: str, array: np.ndarray) -> str:
        """Adds ``array`` as a new initializer and returns its (unique) name."""
        name = self.fresh(base)
        tensor = numpy_helper.from_array(np.asarray(array), name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def float_init(self, name: str, layer: Layer) -> np.ndarray:
        """The float32 initializer ``name`` as an array, or RewriteError."""
        init = self.inits.get(name)
        if init is None or init.data_type != TensorProto.FLOAT:
            raise RewriteError(f"layer {layer.name!r}: {name!r} is not a float32 initializer in the model")
        return numpy_helper.to_array(init)

    def range_of(self, tensor: str, layer: Layer) -> tuple[float, float]:
        """The calibrated range of ``tensor`` for ``layer``, or RewriteError saying calibration must cover it."""
        ranges = self.layer_ranges.get(layer.name, self.ranges)
        if tensor not in ranges:
            raise RewriteError(
                f"layer {layer.name!r}: no calibrated range for tensor {tensor!r}; calibration must cover it "
                f"(collect every tensor listed by required_ranges())"
            )
        lo, hi = ranges[tensor]
        return float(lo), float(hi)

    # ----- graph edits ------------------------------------------------------------------------------------

    def node_of(self, layer: Layer) -> tuple[int, onnx.NodeProto]:
        """The node of ``layer`` and its index, checked against the layer table."""
        index = self.node_index.get(layer.name)
        if index is None:
            raise RewriteError(f"layer {layer.name!r} is not a node of the model; rebuild the layer table")
        node = self.graph.node[index]
        if node.op_type != layer.op_type:
            raise RewriteError(f"layer {layer.name!r} is a {node.op_type} in the model, not a {layer.op_type}")
        return index, node

    def qdq(self, out: list[onnx.NodeProto], src: str, dst: str, scale: str, zero: str, tag: str) -> None:
        """Appends ``QuantizeLinear(src) -> DequantizeLinear -> dst`` to ``out``."""
        quantized = self.fresh(f"{src}__q__{tag}")
        out.append(helper.make_node("QuantizeLinear", [src, scale, zero], [quantized], self.fresh(f"{tag}__{src}__Q")))
        out.append(
            helper.make_node("DequantizeLinear", [quantized, scale, zero], [dst], self.fresh(f"{tag}__{src}__DQ"))
        )

    def rename_output(self, index: int, tensor: str, suffix: str) -> str:
        """Makes node ``index`` write a new tensor instead of ``tensor``; the caller then writes ``tensor``.

        Downstream nodes and graph outputs keep their names this way, so nothing else needs rewiring.
        """
        node = self.graph.node[index]
        new = self.fresh(f"{tensor}__{suffix}")
        for slot, name in enumerate(node.output):
            if name == tensor:
                node.output[slot] = new
        return new

    @staticmethod
    def redirect(node: onnx.NodeProto, old: str, new: str) -> None:
        """Points only this node's inputs named ``old`` at ``new``."""
        for slot, name in enumerate(node.input):
            if name == old:
                node.input[slot] = new

    # ----- int8 / fp8 pieces ------------------------------------------------------------------------------

    def activation_qdq(self, index: int, layer: Layer, tensor: str, fp8: bool = False) -> np.float32:
        """Puts a Q/DQ pair dedicated to this layer on one activation input; returns the activation scale.

        A smoothed layer (SmoothQuant) first divides the input by its per-channel factors, in a dedicated Mul; the
        layer's range for ``tensor`` is then the range of the divided tensor.
        """
        source = tensor
        factors = self.smoothing.get(layer.name) if tensor == layer.activation_inputs[0] else None
        if factors is not None:
            inverse = self.add_init(f"{tensor}__smooth__{layer.name}", (1.0 / factors).astype(np.float32))
            source = self.fresh(f"{tensor}__smoothed__{layer.name}")
            self.before[index].append(
                helper.make_node("Mul", [tensor, inverse], [source], self.fresh(f"{layer.name}__smooth"))
            )
        lo, hi = self.range_of(tensor, layer)
        if fp8:
            scale = fp8_activation_scale(lo, hi)
            zero: np.ndarray = np.array(0, dtype=ml_dtypes.float8_e4m3fn)
        else:
            scale, zero = activation_qparams(lo, hi, self.recipe.activation_dtype)
        scale_name = self.add_init(f"{tensor}__scale__{layer.name}", np.array(scale, dtype=np.float32))
        zero_name = self.add_init(f"{tensor}__zp__{layer.name}", np.array(zero))
        dst = self.fresh(f"{tensor}__dq__{layer.name}")
        self.qdq(self.before[index], source, dst, scale_name, zero_name, layer.name)
        self.redirect(self.graph.node[index], tensor, dst)
        return scale

    def quantized_weight(self, layer: Layer, fp8: bool) -> tuple[str, str, str, np.ndarray, int | None]:
        """The quantized weight initializers ``(q, scale, zero, scales, axis)``, shared across layers.

        A smoothed layer's weight is its own: its input-channel rows are multiplied by the smoothing factors.
        """
        factors = self.smoothing.get(layer.name)
        key = ("fp8" if fp8 else "int8", layer.weight, self.per_channel, layer.name if factors is not None else None)
        if key not in self.cache:
            w = self.float_init(layer.weight, layer)
            if factors is not None:
                w = smooth_weight(w, factors, layer)
            per_channel = self.per_channel and w.ndim > 0 and layer.weight_axis is not None
            axis = int(layer.weight_axis) % w.ndim if per_channel else None
            if fp8:
                q, scales = quantize_weight_fp8(w, axis, per_channel)
                zeros: np.ndarray = np.zeros(scales.shape, dtype=ml_dtypes.float8_e4m3fn)
            else:
                q, scales = quantize_weight(w, axis, per_channel)
                zeros = np.zeros(scales.shape, dtype=np.int8)
            tag = "fp8" if fp8 else "int8"
            self.cache[key] = (
                self.add_init(f"{layer.weight}__{tag}", q),
                self.add_init(f"{layer.weight}__{tag}_scale", scales),
                self.add_init(f"{layer.weight}__{tag}_zp", zeros),
                scales,
                axis,
            )
        return self.cache[key]

    def weight_dq(self, index: int, layer: Layer, fp8: bool = False) -> np.ndarray:
        """Replaces the layer's float weight by a low-precision initializer and a dedicated DQ node."""
        q_name, scale_name, zero_name, scales, axis = self.quantized_weight(layer, fp8)
        dst = self.fresh(f"{layer.weight}__dq__{layer.name}")
        kwargs = {"axis": axis} if axis is not None else {}
        self.prologue.append(
            helper.make_node(
                "DequantizeLinear",
                [q_name, scale_name, zero_name],
                [dst],
                self.fresh(f"{layer.name}__w__DQ"),
                **kwargs,
            )
        )
        self.redirect(self.graph.node[index], layer.weight, dst)
        self.replaced.add(layer.weight)
        return scales

    def bias_int32(self, index: int, layer: Layer, act_scale: np.float32, w_scales: np.ndarray) -> None:
        """Quantizes a Conv or Gemm bias to int32 (scale act_scale * weight_scales) so ORT fuses the integer kernel."""
        bias = self.float_init(layer.bias, layer)
        scales = (np.float32(act_scale) * np.asarray(w_scales, dtype=np.float32)).astype(np.float32)
        if scales.ndim == 1 and scales.size != bias.size:
            groups = bias.size // max(scales.size, 1)
            if groups * scales.size != bias.size:
                raise RewriteError(
                    f"layer {layer.name!r}: bias has {bias.size} values but the weight has {scales.size} channel scales"
                )
            # ConvTranspose with groups: output channel g * (C/groups) + j uses weight channel j.
            scales = np.tile(scales, groups)
        q = quantize_bias_int32(bias, scales)
        q_name = self.add_init(f"{layer.bias}__int32__{layer.name}", q)
        scale_name = self.add_init(f"{layer.bias}__int32_scale__{layer.name}", scales)
        zero_name = self.add_init(f"{layer.bias}__int32_zp__{layer.name}", np.zeros(scales.shape, dtype=np.int32))
        dst = self.fresh(f"{layer.bias}__dq__{layer.name}")
        kwargs = {"axis": 0} if scales.ndim == 1 else {}
        self.prologue.append(
            helper.make_node(
                "DequantizeLinear",
                [q_name, scale_name, zero_name],
                [dst],
                self.fresh(f"{layer.name}__b__DQ"),
                **kwargs,
            )
        )
        self.redirect(self.graph.node[index], layer.bias, dst)
        self.replaced.add(layer.bias)

    def output_qdq(self, index: int, layer: Layer) -> None:
        """Puts a Q/DQ pair on the layer output, or after its sole Relu when the recipe folds Relus."""
        relu, tensor = _output_target(self.graph, self.consumers, layer.output, self.recipe)
        producer = index if relu is None else relu
        scale, zero = activation_qparams(*self.range_of(tensor, layer), self.recipe.activation_dtype)
        scale_name = self.add_init(f"{tensor}__scale__{layer.name}__out", np.array(scale, dtype=np.float32))
        zero_name = self.add_init(f"{tensor}__zp__{layer.name}__out", np.array(zero))
        src = self.rename_output(producer, tensor, "preq")
        self.qdq(self.after[producer], src, tensor, scale_name, zero_name, f"{layer.name}__out")

    # ----- precisions -------------------------------------------------------------------------------------

    def apply_int8(self, layer: Layer) -> None:
        """Q/DQ on the activation inputs, an int8 weight, and (per recipe) int32 bias and output Q/DQ."""
        index, _ = self.node_of(layer)
        if layer.weight is None and layer.op_type != "MatMul":
            raise RewriteError(f"layer {layer.name!r}: int8 {layer.op_type} needs a constant weight")
        act_scales = [self.activation_qdq(index, layer, x) for x in dict.fromkeys(layer.activation_inputs)]
        w_scales = self.weight_dq(index, layer) if layer.weight is not None else None
        gemm_bias = layer.op_type == "Gemm" and self.recipe.quantize_gemm_bias
        if gemm_bias and layer.bias is not None and w_scales is not None:
            self.bias_int32(index, layer, act_scales[0], w_scales)
        if not _quantizes_output(layer.op_type, self.recipe):
            return
        if layer.op_type in _CONV_OPS and layer.bias is not None and w_scales is not None:
            self.bias_int32(index, layer, act_scales[0], w_scales)
        self.output_qdq(index, layer)

    def apply_fp8(self, layer: Layer) -> None:
        """FLOAT8E4M3FN Q/DQ on the activation inputs and an fp8 weight; bias and output stay float."""
        index, _ = self.node_of(layer)
        if layer.weight is None and layer.op_type != "MatMul":
            raise RewriteError(f"layer {layer.name!r}: fp8 {layer.op_type} needs a constant weight")
        for tensor in dict.fromkeys(layer.activation_inputs):
            self.activation_qdq(index, layer, tensor, fp8=True)
        if layer.weight is not None:
            self.weight_dq(index, layer, fp8=True)

    def half_init(self, name: str, precision: str) -> str:
        """A fp16/bf16 copy of a float initializer, shared by all layers that use it in that precision."""
        key = (precision, name)
        if key not in self.cache:
            array = numpy_helper.to_array(self.inits[name]).astype(_HALF[precision][1])
            self.cache[key] = (self.add_init(f"{name}__{precision}", array),)
        self.replaced.add(name)
        return self.cache[key][0]

    def apply_half(self, layer: Layer, precision: str) -> None:
        """Runs the node in fp16/bf16: low-precision weights, Casts on activations, output Cast to float."""
        index, node = self.node_of(layer)
        elem_type = _HALF[precision][0]
        casts: dict[str, str] = {}
        for slot, name in enumerate(node.input):
            if not name:
                continue
            init = self.inits.get(name)
            if init is not None and init.data_type == TensorProto.FLOAT:
                node.input[slot] = self.half_init(name, precision)
                continue
            if name not in casts:  # one dedicated Cast per tensor, even when the node reads it twice
                casts[name] = self.fresh(f"{name}__{precision}__{layer.name}")
                self.before[index].append(
                    helper.make_node(
                        "Cast", [name], [casts[name]], self.fresh(f"{layer.name}__{name}__Cast"), to=elem_type
                    )
                )
            node.input[slot] = casts[name]
        for tensor in list(node.output):
            if not tensor:
                continue
            low = self.rename_output(index, tensor, precision)
            self.after[index].append(
                helper.make_node("Cast", [low], [tensor], self.fresh(f"{layer.name}__out__Cast"), to=TensorProto.FLOAT)
            )

    # ----- assembly ---------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Splices the new nodes in topological order and drops float initializers nothing reads any more."""
        ordered = list(self.prologue)
        for index, node in enumerate(self.graph.node):
            ordered.extend(self.before.get(index, []))
            ordered.append(copy.deepcopy(node))
            ordered.extend(self.after.get(index, []))
        self.graph.ClearField("node")
        self.graph.node.extend(ordered)
        used = _used_names(self.graph)
        unused = {name for name in self.replaced if name not in used}
        if unused:
            kept = [init for init in self.graph.initializer if init.name not in unused]
            self.graph.ClearField("initializer")
            self.graph.initializer.extend(kept)
            # Old IR versions list initializers as graph inputs too; drop the input with the initializer.
            inputs = [value for value in self.graph.input if value.name not in unused]
            self.graph.ClearField("input")
            self.graph.input.extend(inputs)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name read by a node or a graph output (subgraphs too: they may capture outer tensors)."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            subgraphs = [*attribute.graphs, attribute.g] if attribute.HasField("g") else list(attribute.graphs)
            for subgraph in subgraphs:
                used |= _used_names(subgraph)
    return used


def _check_plan(layers: Sequence[Layer], plan: Plan) -> tuple[dict[str, str], bool]:
    """Validates the plan against the layers; returns ``(precision by layer, per_channel)``."""
    granularity = plan.knob("weight_granularity", "per_channel")
    if granularity not in _GRANULARITIES:
        raise RewriteError(f"knob weight_granularity must be one of {_GRANULARITIES}, not {granularity!r}")
    precisions = plan.precision_map
    for layer in layers:
        precision = precisions.get(layer.name, "fp32")
        if precision not in ("fp32", "int8", "fp8", *_HALF):
            raise RewriteError(f"layer {layer.name!r}: unknown precision {precision!r}")
        if layer.op_type not in (*_CONV_OPS, *_MATMUL_OPS):
            raise RewriteError(f"layer {layer.name!r}: {layer.op_type} is not a tunable op type")
    return precisions, granularity == "per_channel"


def rewrite(
    model: onnx.ModelProto,
    layers: Sequence[Layer],
    plan: Plan,
    ranges: Mapping[str, tuple[float, float]],
    recipe: QuantRecipe,
    layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
    smoothing: Mapping[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """Writes the plan's per-layer precisions into a new, explicitly typed model.

    Args:
        model: The float model the layer table was built from; it is not modified.
        layers: The tunable layers.
        plan: Precision per layer (missing = fp32); knob ``weight_granularity`` is ``per_channel``
            (default) or ``per_tensor``.
        ranges: Calibrated ``(lo, hi)`` per activation tensor; ``required_ranges`` lists the ones needed.
        recipe: How Q/DQ is written for the target backend.
        layer_ranges: Per layer, ranges that replace ``ranges`` for that layer's own Q/DQ nodes (layerwise
            calibration: two layers reading one tensor may clip it differently).
        smoothing: Per INT8 (or FP8) MatMul layer, SmoothQuant factors ``s`` (one per input channel): the layer computes
            ``(x / s) @ (s * W)``, the same product with the activation outliers moved into the weight; its range
            in ``layer_ranges`` must be that of ``x / s``.

    Returns:
        A new model with dedicated Q/DQ pairs (int8, fp8) or Casts and low-precision weights (fp16, bf16)
        per layer, with the default-domain opset raised where a precision needs it.

    Raises:
        RewriteError: The plan has an unknown precision or granularity, a layer cannot take its
            precision, or a needed range is missing.
    """
    precisions, per_channel = _check_plan(layers, plan)
    active = [(layer, precisions.get(layer.name, "fp32")) for layer in layers]
    active = [(layer, precision) for layer, precision in active if precision != "fp32"]
    out = copy.deepcopy(model)
    needed = max((_min_opset(precision, layer.op_type) for layer, precision in active), default=0)
    out = _ensure_opset(out, needed)
    rewriter = _Rewriter(out, ranges, recipe, per_channel, layer_ranges, smoothing)
    for layer, precision in active:
        if precision == "int8":
            rewriter.apply_int8(layer)
        elif precision == "fp8":
            rewriter.apply_fp8(layer)
        else:
            rewriter.apply_half(layer, precision)
    rewriter.finish()
    return out
