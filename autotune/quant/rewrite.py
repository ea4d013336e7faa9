"""Writes a plan's per-layer precisions into an explicitly typed ONNX graph (the lowering).

int8/fp8 layers get Q/DQ pairs and quantized weights, fp16/bf16 layers get Casts and low-precision weights.
Unlike ORT's ``quantize_static``, every Q/DQ pair and Cast a layer adds for its inputs is its own: other readers
of the same tensor (a residual Add, a sibling MatMul left in FP32) keep reading the float tensor. Without this, a
layer's quantization also changes what its float neighbours read, and its accuracy drop is not its own. Where the
input already is an INT8 layer's quantized output, the layer reads it as it is, so integer kernels follow each
other without a dequantize between them (``autotune.quant.placement`` says where each pair goes).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autotune.model.layer_units import GraphIndex, attribute
from autotune.model.layers import Layer
from autotune.model.optypes import (
    CONV_OP_TYPES,
    RECURRENT_OP_TYPES,
    TUNABLE_OP_TYPES,
    WEIGHTED_OP_TYPES,
    WEIGHTLESS_OP_TYPES,
)
from autotune.plan import Plan
from autotune.quant.basetype import BASE_PRECISION_KNOB, BASE_TYPES, base_precision_of, range_float_ops, to_base
from autotune.quant.dynamic import DYNAMIC, DYNAMIC_OP_TYPES, lower_dynamic
from autotune.quant.graphedit import GraphEditor, RewriteError, ensure_opset
from autotune.quant.placement import (
    Grid,
    output_pairs,
    output_tail,
    output_target,
    place_input,
    quantizes_output,
    required_ranges,
)
from autotune.quant.qparams import (
    activation_qparams,
    fp8_activation_scale,
    in_scale_type,
    int32_bias_floor,
    pooling_scale_bounds,
    quantize_bias_int32,
    quantize_weight,
    quantize_weight_fp8,
)
from autotune.quant.recipe import QuantRecipe
from autotune.quant.recurrent import lower_int8_lstm

__all__ = ["RewriteError", "required_ranges", "rewrite", "smooth_weight", "smoothable"]

_GRANULARITIES = ("per_channel", "per_tensor")

_HALF = {
    "fp16": (TensorProto.FLOAT16, np.float16),
    "bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
}

_POOLING = ("AveragePool", "GlobalAveragePool")


def _pooled(node: onnx.NodeProto, layer: Layer) -> int:
    """How many values one output of an average pooling averages (1 where the shapes do not say)."""
    if layer.op_type == "AveragePool":
        return int(np.prod(attribute(node, "kernel_shape", [1])))
    shape = layer.input_shapes[0] if layer.input_shapes else ()
    return int(np.prod(shape[2:])) if len(shape) > 2 and all(d > 0 for d in shape[2:]) else 1


# The names the layerwise probes (autotune/quant/probe.py) import from here.
_quantizes_output = quantizes_output


def _output_tail(graph: onnx.GraphProto, output: str, recipe: QuantRecipe) -> tuple[tuple[int, ...], str]:
    """The nodes of the activation a layer's output Q/DQ folds, and the quantized tensor its readers take."""
    index = GraphIndex(graph)
    return output_tail(index, output, recipe), output_target(index, output, recipe)


def _min_opset(precision: str, op_type: str) -> int:
    """The default-domain opset a precision needs for one op type.

    int8: per-channel DequantizeLinear (``axis``) needs 13. fp8: FLOAT8E4M3FN Q/DQ needs 19.
    bf16: Cast, MatMul and Gemm take bfloat16 from 13, Conv and ConvTranspose only from 22.
    fp16 works at any opset we accept.
    """
    if precision == "int8":
        return 13
    if precision == DYNAMIC:
        return 11  # DynamicQuantizeLinear
    if precision == "fp8":
        return 19
    if precision == "bf16":
        return 22 if op_type in CONV_OP_TYPES else 13
    return 0


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


class _Rewriter(GraphEditor):
    """Lowers the layers of one (copied) model, in graph order, to their precisions."""

    def __init__(
        self,
        model: onnx.ModelProto,
        ranges: Mapping[str, tuple[float, float]],
        recipe: QuantRecipe,
        per_channel: bool,
        layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
        smoothing: Mapping[str, np.ndarray] | None = None,
        scale_type: type | None = None,
    ) -> None:
        super().__init__(model)
        self.scale_type = scale_type  # a half base stores scales in its type (autotune.quant.basetype)
        self.smoothing = smoothing or {}
        self.ranges = ranges
        self.layer_ranges = layer_ranges or {}
        self.recipe = recipe
        self.per_channel = per_channel
        self.cache: dict[tuple, tuple] = {}
        self.quantized: dict[str, Grid] = {}  # INT8 layer outputs written so far: their readers take them as they are

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

    def grid(
        self,
        tensor: str,
        layer: Layer,
        tag: str,
        fp8: bool = False,
        bounds: tuple[float, float] | None = None,
        fixed: tuple[float, float] | None = None,
    ) -> Grid:
        """New scale and zero-point initializers for ``tensor`` from the layer's calibrated range (or ``fixed``)."""
        lo, hi = fixed if fixed is not None else self.range_of(tensor, layer)
        if fp8:
            scale = in_scale_type(fp8_activation_scale(lo, hi), self.scale_type)
            zero: np.ndarray = np.array(0, dtype=ml_dtypes.float8_e4m3fn)
        else:
            least = self.recipe.least_zero_point(layer.op_type)
            scale, zero = activation_qparams(lo, hi, self.recipe.activation_dtype, bounds, least)
            scale = in_scale_type(scale, self.scale_type)  # symmetric with a half base: the zero point stays 0
        scale_name = self.add_init(f"{tensor}__scale__{tag}", np.array(scale, dtype=np.float32))
        return Grid(np.float32(scale), scale_name, self.add_init(f"{tensor}__zp__{tag}", np.array(zero)))

    # ----- int8 / fp8 pieces ------------------------------------------------------------------------------

    def activation_input(self, index: int, layer: Layer, tensor: str, fp8: bool = False) -> np.float32:
        """Quantizes one activation input for this layer (see ``autotune.quant.placement``); returns its scale.

        A smoothed layer (SmoothQuant) first divides the input by its per-channel factors, in a dedicated Mul; the
        layer's range for ``tensor`` is then the range of the divided tensor.
        """
        factors = self.smoothing.get(layer.name) if tensor == layer.activation_inputs[0] else None
        own = fp8 or factors is not None
        place = place_input(self.index, self.quantized, tensor, index, own, self.recipe.quantize_before_zero_pad)
        if place.reuse:
            return self.quantized[place.at].scale
        source = place.at
        if factors is not None:
            inverse = self.add_init(f"{tensor}__smooth__{layer.name}", (1.0 / factors).astype(np.float32))
            source = self.fresh(f"{tensor}__smoothed__{layer.name}")
            self.before[place.reader].append(
                helper.make_node("Mul", [place.at, inverse], [source], self.fresh(f"{layer.name}__smooth"))
            )
        grid = self.quantized[place.source] if place.source is not None else self.grid(tensor, layer, layer.name, fp8)
        dst = self.fresh(f"{place.at}__dq__{layer.name}")
        self.qdq(self.before[place.reader], source, dst, grid.scale_name, grid.zero_name, layer.name)
        self.redirect(self.graph.node[place.reader], place.at, dst)
        return grid.scale

    def quantized_weight(
        self, layer: Layer, fp8: bool, floor_for: np.float32 | None = None
    ) -> tuple[str, str, str, np.ndarray, int | None]:
        """The quantized weight initializers ``(q, scale, zero, scales, axis)``, shared across layers.

        A smoothed layer's weight is its own: its input-channel rows are multiplied by the smoothing factors.
        ``floor_for`` is the input scale of a layer with an int32 bias: its weight scales are raised where the bias
        would overflow int32 (``int32_bias_floor``), which makes the weight that layer's own where it bites.
        """
        factors = self.smoothing.get(layer.name)
        w = self.float_init(layer.weight, layer)
        if factors is not None:
            w = smooth_weight(w, factors, layer)
        per_channel = self.per_channel and w.ndim > 0 and layer.weight_axis is not None
        axis = int(layer.weight_axis) % w.ndim if per_channel else None
        floor = None
        if floor_for is not None and layer.bias is not None:
            shape = (w.shape[axis],) if axis is not None else ()
            floor = int32_bias_floor(self.float_init(layer.bias, layer), floor_for, shape)
        smoothed = layer.name if factors is not None else None
        key = (
            "fp8" if fp8 else "int8",
            layer.weight,
            self.per_channel,
            smoothed,
            None if floor is None else floor.tobytes(),
        )
        if key not in self.cache:
            if fp8:
                q, scales = quantize_weight_fp8(w, axis, per_channel, self.scale_type)
                zeros: np.ndarray = np.zeros(scales.shape, dtype=ml_dtypes.float8_e4m3fn)
            else:
                q, scales = quantize_weight(w, axis, per_channel, floor, self.scale_type, self.recipe.weight_max)
                zeros = np.zeros(scales.shape, dtype=np.int8)
                if self.recipe.weight_dtype == "uint8":
                    # The same integers offset by a zero point of 128: ORT's U8U8 kernels widen to int16 before
                    # they multiply, so they are exact where U8S8 saturates, and the dequantized weight is the same.
                    q = (q.astype(np.int16) + 128).astype(np.uint8)
                    zeros = np.full(scales.shape, 128, dtype=np.uint8)
            tag = "fp8" if fp8 else "int8"
            self.cache[key] = (
                self.add_init(f"{layer.weight}__{tag}", q),
                self.add_init(f"{layer.weight}__{tag}_scale", scales),
                self.add_init(f"{layer.weight}__{tag}_zp", zeros),
                scales,
                axis,
            )
        return self.cache[key]

    def weight_dq(self, index: int, layer: Layer, fp8: bool = False, floor_for: np.float32 | None = None) -> np.ndarray:
        """Replaces the layer's float weight by a low-precision initializer and a dedicated DQ node."""
        q_name, scale_name, zero_name, scales, axis = self.quantized_weight(layer, fp8, floor_for)
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
            # ConvTranspose with groups: output channel g * (C/groups) + j uses weight channel j.
            scales = np.tile(scales, bias.size // max(scales.size, 1))
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

    def check_bias(self, layer: Layer) -> None:
        """RewriteError when the bias length is not a whole number of weight channels (per-channel scales)."""
        init = self.inits.get(layer.weight or "")
        if layer.bias is None or init is None or layer.weight_axis is None or not self.per_channel:
            return
        channels = list(init.dims)[int(layer.weight_axis) % len(init.dims)]
        size = self.float_init(layer.bias, layer).size
        if channels == 0 or size % channels:
            raise RewriteError(
                f"layer {layer.name!r}: bias has {size} values but the weight has {channels} channel scales"
            )

    def output_qdq(self, index: int, layer: Layer, input_scale: np.float32 | None = None) -> None:
        """Puts Q/DQ pairs on the layer output and in the activation it folds (``output_pairs``); readers share them.

        The last pair's tensor is the quantized output the next INT8 layers read as it is.
        """
        bounds = None
        if layer.op_type in _POOLING and input_scale is not None:
            bounds = pooling_scale_bounds(input_scale, _pooled(self.graph.node[index], layer))
        pairs = output_pairs(self.index, layer.output, self.recipe)
        for number, pair in enumerate(pairs):
            tag = f"{layer.name}__out" if number == 0 else f"{layer.name}__out{number}"
            grid = self.grid(pair.tensor, layer, tag, bounds=bounds if number == 0 else None, fixed=pair.fixed_range)
            src = self.rename_output(pair.producer, pair.tensor, "preq")
            self.qdq(self.after[pair.producer], src, pair.tensor, grid.scale_name, grid.zero_name, tag)
            if pair is pairs[-1]:
                self.quantized[pair.tensor] = grid

    # ----- precisions -------------------------------------------------------------------------------------

    def apply_int8(self, layer: Layer) -> None:
        """Q/DQ on the activation inputs, an int8 weight, and (per recipe) int32 bias and output Q/DQ."""
        if layer.op_type in RECURRENT_OP_TYPES:  # dynamically quantized: no Q/DQ (autotune.quant.recurrent)
            lower_int8_lstm(self, layer, self.per_channel, self.recipe)
            return
        index, _ = self.node_of(layer)
        if layer.weight is None and layer.op_type not in ("MatMul", *WEIGHTLESS_OP_TYPES):
            raise RewriteError(f"layer {layer.name!r}: int8 {layer.op_type} needs a constant weight")
        act_scales = [self.activation_input(index, layer, x) for x in dict.fromkeys(layer.activation_inputs)]
        quantized_output = quantizes_output(layer.op_type, self.recipe)
        int32_bias = layer.bias is not None and layer.weight is not None
        int32_bias &= (layer.op_type == "Gemm" and self.recipe.quantize_gemm_bias) or (
            layer.op_type in CONV_OP_TYPES and quantized_output
        )
        if int32_bias:
            self.check_bias(layer)
        if layer.weight is not None:
            w_scales = self.weight_dq(index, layer, floor_for=act_scales[0] if int32_bias else None)
            if int32_bias:
                self.bias_int32(index, layer, act_scales[0], w_scales)
        if quantized_output:
            self.output_qdq(index, layer, act_scales[0])

    def apply_fp8(self, layer: Layer) -> None:
        """FLOAT8E4M3FN Q/DQ on the activation inputs and an fp8 weight; bias and output stay float."""
        index, _ = self.node_of(layer)
        if layer.weight is None and layer.op_type != "MatMul":
            raise RewriteError(f"layer {layer.name!r}: fp8 {layer.op_type} needs a constant weight")
        for tensor in dict.fromkeys(layer.activation_inputs):
            self.activation_input(index, layer, tensor, fp8=True)
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


def _check_base(base: str, recipe: QuantRecipe) -> None:
    """RewriteError unless a half base has TensorRT's kind of recipe.

    Symmetric activations keep a zero point of 0 whatever the scale's rounding, and float biases avoid an int32
    bias scale (``act_scale * weight_scale``), which underflows FP16.
    """
    if base != "fp32" and (not recipe.activation_symmetric or recipe.quantize_gemm_bias or recipe.quantize_conv_output):
        raise RewriteError(
            f"knob {BASE_PRECISION_KNOB}={base} needs symmetric activations and float biases (TensorRT's recipe); "
            f"this backend's recipe quantizes with zero points or int32 biases: use {BASE_PRECISION_KNOB}=fp32"
        )


def _check_plan(layers: Sequence[Layer], plan: Plan) -> tuple[dict[str, str], bool]:
    """Validates the plan against the layers; returns ``(precision by layer, per_channel)``."""
    granularity = plan.knob("weight_granularity", "per_channel")
    if granularity not in _GRANULARITIES:
        raise RewriteError(f"knob weight_granularity must be one of {_GRANULARITIES}, not {granularity!r}")
    precisions = plan.precision_map
    for layer in layers:
        precision = precisions.get(layer.name, "fp32")
        if precision not in ("fp32", "int8", DYNAMIC, "fp8", *_HALF):
            raise RewriteError(f"layer {layer.name!r}: unknown precision {precision!r}")
        if precision == DYNAMIC and layer.op_type not in DYNAMIC_OP_TYPES:
            raise RewriteError(
                f"layer {layer.name!r}: {DYNAMIC} is for {'/'.join(DYNAMIC_OP_TYPES)}, not {layer.op_type}"
            )
        if layer.op_type not in TUNABLE_OP_TYPES:
            raise RewriteError(f"layer {layer.name!r}: {layer.op_type} is not a tunable op type")
        if layer.op_type in (*WEIGHTLESS_OP_TYPES, *RECURRENT_OP_TYPES) and precision not in ("fp32", "int8"):
            raise RewriteError(f"layer {layer.name!r}: a {layer.op_type} layer is fp32 or int8, not {precision}")
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
        layers: The tunable layers, in graph order (a layer reads the INT8 outputs of the layers before it).
        plan: Precision per layer (missing = fp32); knob ``weight_granularity`` is ``per_channel``
            (default) or ``per_tensor``.
        ranges: Calibrated ``(lo, hi)`` per activation tensor; ``required_ranges`` lists the ones needed.
        recipe: How Q/DQ is written for the target backend.
        layer_ranges: Per layer, ranges that replace ``ranges`` for that layer's own Q/DQ nodes (layerwise
            calibration: two layers reading one tensor may clip it differently).
        smoothing: Per INT8 (or FP8) MatMul layer, SmoothQuant factors ``s`` (one per input channel): the layer computes
            ``(x / s) @ (s * W)``, the same product with the activation outliers moved into the weight; its range
            in ``layer_ranges`` must be that of ``x / s``.

    A plan's knob ``base_precision`` (``fp32`` when unset; ``fp16``, ``bf16``) is what the whole graph computes
    in; each layer's precision overrides it (``autotune.quant.basetype``): a layer in the base precision is left
    as it is, an FP32 weighted layer is an FP32 island with Casts around it, an INT8/FP8 layer's Q/DQ scales and
    DQ outputs are of the base type. A weightless layer (a residual Add, pooling) chooses only whether it joins the
    INT8 unit before it: its ``fp32`` is the base.

    Returns:
        A new model with Q/DQ pairs (int8, fp8) or Casts and low-precision weights (fp16, bf16) per layer, with
        the default-domain opset raised where a precision needs it. In a half base, every node left FP32 says
        why in its ``doc_string``.

    Raises:
        RewriteError: The plan has an unknown precision or granularity, a layer cannot take its
            precision, or a needed range is missing.
    """
    precisions, per_channel = _check_plan(layers, plan)
    base = base_precision_of(plan.knob(BASE_PRECISION_KNOB, "fp32"))
    _check_base(base, recipe)
    chosen = [(layer, precisions.get(layer.name, "fp32")) for layer in layers]
    active = [(layer, precision) for layer, precision in chosen if precision not in ("fp32", base)]
    out = ensure_opset(copy.deepcopy(model), _needed_opset(active, base))
    scale_type = BASE_TYPES[base][1] if base in BASE_TYPES else None
    rewriter = _Rewriter(out, ranges, recipe, per_channel, layer_ranges, smoothing, scale_type)
    for layer, precision in active:
        if precision == "int8":
            rewriter.apply_int8(layer)
        elif precision == DYNAMIC:
            lower_dynamic(rewriter, layer, per_channel, recipe.dynamic_weight_max)
        elif precision == "fp8":
            rewriter.apply_fp8(layer)
        else:
            rewriter.apply_half(layer, precision)
    rewriter.finish()
    if base != "fp32":
        _convert_to_base(out, base, chosen)
    return out


def _needed_opset(active: Sequence[tuple[Layer, str]], base: str) -> int:
    """The default-domain opset the rewritten graph needs for its layers' precisions in ``base`` (0: any)."""
    needed = max((_min_opset(precision, layer.op_type) for layer, precision in active), default=0)
    if base == "bf16":
        needed = max(needed, 22)  # Conv, pooling and most elementwise ops take bfloat16 from opset 22
    elif base == "fp16" and any(precision in ("int8", "fp8") for _, precision in active):
        needed = max(needed, 19)  # QuantizeLinear/DequantizeLinear take float16 scales from opset 19
    return needed


def _convert_to_base(out: onnx.ModelProto, base: str, chosen: Sequence[tuple[Layer, str]]) -> None:
    """Converts the rewritten graph to a half ``base`` in place, keeping the plan's FP32 weighted layers FP32."""
    keep = {
        layer.name: f"FP32 override of the {base} base (the plan's choice for this layer)"
        for layer, precision in chosen
        if precision == "fp32" and layer.op_type in WEIGHTED_OP_TYPES
    }
    to_base(out, base, {**range_float_ops(out.graph, base), **keep})
