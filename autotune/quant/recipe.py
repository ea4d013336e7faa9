"""Quantization recipes: how a backend wants INT8 written into the graph."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.model.optypes import MATMUL_OP_TYPES


@dataclass(frozen=True)
class QuantRecipe:
    """How Q/DQ nodes are written for one backend.

    Attributes:
        activation_dtype: ``"uint8"`` (asymmetric, with a zero point) or ``"int8"`` (symmetric, zero point 0).
        weight_dtype: ``"int8"`` (symmetric, zero point 0) or ``"uint8"``: the same integers offset by a zero point
            of 128, for CPUs whose u8 x s8 kernels saturate but whose u8 x u8 ones do not.
        weight_max: Weights are quantized to ``[-weight_max, weight_max]``: 127 (8 bits), or 64 (7 bits, ORT's
            ``reduce_range``) where the CPU's u8 x s8 kernels add pairs of products in int16 and saturate
            (x86 without VNNI; ``autotune.backends.int8_kernels`` probes it).
        dynamic_weight_max: The weight range of ``int8-dynamic`` layers (``autotune.quant.dynamic``), int8
            weights in ``[-dynamic_weight_max, dynamic_weight_max]``: 127, or 64 where the CPU's U8S8 kernels
            saturate.
        quantize_matmul_output: Put Q/DQ on MatMul/Gemm outputs too. ORT CPU is faster without
            (it fuses DQ-MatMul into MatMulIntegerToFloat; tests/backends/test_onnxruntime.py checks the fusion).
        quantize_conv_output: Put Q/DQ on the outputs of Conv layers and of weightless layers (Add, pooling, ...):
            ORT needs it to fuse QLinearConv, QLinearAdd, ..., and the next INT8 layer then reads the integers.
        fold_activation_into_output: When the quantized output feeds a single Relu or Clip, put the output Q/DQ
            after it (its saturation is the quantized range's; ORT then drops it from the integer kernel).
        quantize_before_zero_pad: Put a layer's input Q/DQ before the zero Pad only it reads, not between the Pad
            and the conv (ORT folds DQ -> Pad -> Conv into one QLinearConv; TensorRT fuses Q/DQ next to the conv).
        quantize_gemm_bias: Quantize a Gemm's bias to int32 (ORT then fuses QGemm with a float output;
            with a float bias it runs DQ + float Gemm, losing accuracy for no speed).
        min_matmul_zero_point: The least zero point of a uint8 activation a MatMul or Gemm reads: a range that
            starts at 0 (after a Relu) is widened below 0 by so many steps (OpenVINO: ``OPENVINO_RECIPE``).
    """

    activation_dtype: str = "uint8"
    weight_dtype: str = "int8"
    weight_max: int = 127
    # Not part of a recipe's identity (repr, equality, hash): it changes no static Q/DQ layer, so the layerwise
    # choices and their caches, keyed by the recipe, stay those of the static scheme.
    dynamic_weight_max: int = field(default=127, repr=False, compare=False)
    quantize_matmul_output: bool = False
    quantize_conv_output: bool = True
    fold_activation_into_output: bool = True
    quantize_before_zero_pad: bool = True
    quantize_gemm_bias: bool = True
    min_matmul_zero_point: int = 0

    @property
    def activation_symmetric(self) -> bool:
        """Symmetric activations have a zero point of 0."""
        return self.activation_dtype == "int8"

    def least_zero_point(self, op_type: str) -> int:
        """The least uint8 zero point of an activation a layer of ``op_type`` reads (``min_matmul_zero_point``)."""
        return self.min_matmul_zero_point if op_type in MATMUL_OP_TYPES else 0


ORT_X86 = QuantRecipe(activation_dtype="uint8")
"""uint8 activations and int8 per-channel weights: the only INT8 recipe that is fast on x86 ORT (VNNI)."""

ORT_X86_UINT8_WEIGHTS = QuantRecipe(activation_dtype="uint8", weight_dtype="uint8")
"""ORT_X86 with uint8 weights (zero point 128, the same 8-bit grid): ORT's U8U8 kernels widen to int16 before
multiplying, so they are exact on x86 without VNNI, where the U8S8 ones saturate."""

ORT_X86_7BIT_WEIGHTS = QuantRecipe(activation_dtype="uint8", weight_max=64)
"""ORT_X86 with 7-bit weights (``reduce_range``): exact on x86 without VNNI, whose U8S8 kernels add pairs of
u8 x s8 products in int16 (2 x 255 x 64 = 32,640 fits; 2 x 255 x 127 does not)."""

TENSORRT = QuantRecipe(
    activation_dtype="int8",
    quantize_conv_output=False,
    fold_activation_into_output=False,
    quantize_before_zero_pad=False,
    quantize_gemm_bias=False,
)
"""TensorRT: symmetric int8 everywhere, zero points of 0; TensorRT fuses output Q/DQ itself."""

TORCH = QuantRecipe(
    activation_dtype="int8",
    quantize_matmul_output=False,
    quantize_conv_output=False,
    fold_activation_into_output=False,
    quantize_gemm_bias=False,
)
"""PyTorch: symmetric int8 (and e4m3) activations with static scales, read only at each layer's input; a
quantized layer returns float, so no output ranges are needed."""
