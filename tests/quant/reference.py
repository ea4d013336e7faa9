"""Tiny hand-built ONNX models and an independent numpy reference (float and INT8 fake-quant) for rewrite tests.

Shared by ``tests/quant/test_rewrite.py`` and ``tests/backends/test_int8_kernels.py``; a helper module, not a test
module, so no test module imports another.
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper, numpy_helper

from autotune.quant.qparams import activation_qparams, fake_quant, quantize_weight

RNG_SEED = 1234
F = TensorProto.FLOAT


# ----------------------------------------------------------------------------------------------------------
# model builders
# ----------------------------------------------------------------------------------------------------------


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def model_mlp(rng: np.random.Generator) -> onnx.ModelProto:
    """(a) X -> MatMul(W1) -> Relu -> MatMul(W2) -> Y, and X + Res -> Z."""
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"], "mm1"),
        helper.make_node("Relu", ["h"], ["r"], "relu"),
        helper.make_node("MatMul", ["r", "W2"], ["Y"], "mm2"),
        helper.make_node("Add", ["X", "Res"], ["Z"], "add"),
    ]
    inits = [
        _init("W1", rng.normal(size=(8, 16))),
        _init("W2", rng.normal(size=(16, 4)) * 0.3),
        _init("Res", rng.normal(size=(4, 8))),
    ]
    return _model(nodes, [("X", [4, 8])], [("Y", [4, 4]), ("Z", [4, 8])], inits)


def model_qk(rng: np.random.Generator) -> onnx.ModelProto:
    """(b) A feeds two MatMuls (q, k) and a residual Add."""
    nodes = [
        helper.make_node("MatMul", ["A", "Wq"], ["Q"], "q_proj"),
        helper.make_node("MatMul", ["A", "Wk"], ["K"], "k_proj"),
        helper.make_node("Add", ["A", "R"], ["S"], "residual"),
    ]
    inits = [_init("Wq", rng.normal(size=(8, 8))), _init("Wk", rng.normal(size=(8, 8)))]
    return _model(nodes, [("A", [4, 8]), ("R", [4, 8])], [("Q", [4, 8]), ("K", [4, 8]), ("S", [4, 8])], inits)


def model_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    """(c) Conv(bias) -> Relu -> Conv(bias) on [1, 3, 8, 8]."""
    nodes = [
        helper.make_node("Conv", ["X", "Wc1", "Bc1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "Wc2", "Bc2"], ["Y"], "conv2"),
    ]
    inits = [
        _init("Wc1", rng.normal(size=(4, 3, 3, 3)) * 0.5),
        _init("Bc1", rng.normal(size=(4,)) * 0.1),
        _init("Wc2", rng.normal(size=(2, 4, 3, 3)) * 0.3),
        _init("Bc2", rng.normal(size=(2,)) * 0.1),
    ]
    return _model(nodes, [("X", [1, 3, 8, 8])], [("Y", [1, 2, 6, 6])], inits)


def model_gemm(rng: np.random.Generator) -> onnx.ModelProto:
    """(d) Gemm with transB=1 and a bias."""
    nodes = [helper.make_node("Gemm", ["X", "Wg", "Cg"], ["Y"], "gemm", transB=1)]
    inits = [_init("Wg", rng.normal(size=(16, 8))), _init("Cg", rng.normal(size=(16,)) * 0.1)]
    return _model(nodes, [("X", [4, 8])], [("Y", [4, 16])], inits)


def model_deconv(rng: np.random.Generator) -> onnx.ModelProto:
    """ConvTranspose with a bias, weight [C_in, C_out, k, k] (channel axis 1)."""
    nodes = [helper.make_node("ConvTranspose", ["X", "Wt", "Bt"], ["Y"], "deconv")]
    inits = [_init("Wt", rng.normal(size=(3, 4, 3, 3)) * 0.5), _init("Bt", rng.normal(size=(4,)) * 0.1)]
    return _model(nodes, [("X", [1, 3, 5, 5])], [("Y", [1, 4, 7, 7])], inits)


def model_shared(rng: np.random.Generator) -> onnx.ModelProto:
    """X -> MatMul(W) -> Relu -> MatMul(W): one weight initializer read by two layers."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["a"], "first"),
        helper.make_node("Relu", ["a"], ["b"], "relu"),
        helper.make_node("MatMul", ["b", "W"], ["Y"], "second"),
    ]
    return _model(nodes, [("X", [4, 8])], [("Y", [4, 8])], [_init("W", rng.normal(size=(8, 8)) * 0.4)])


def model_attn(rng: np.random.Generator) -> onnx.ModelProto:
    """An activation x activation MatMul (QK^T style) after a weight MatMul."""
    nodes = [
        helper.make_node("MatMul", ["A", "Wq"], ["q"], "q_proj"),
        helper.make_node("MatMul", ["q", "Bt"], ["Y"], "scores"),
    ]
    return _model(nodes, [("A", [4, 8]), ("Bt", [8, 5])], [("Y", [4, 5])], [_init("Wq", rng.normal(size=(8, 8)))])


BUILDERS = {
    "mlp": model_mlp,
    "qk": model_qk,
    "cnn": model_cnn,
    "gemm": model_gemm,
    "deconv": model_deconv,
    "shared": model_shared,
    "attn": model_attn,
}


# ----------------------------------------------------------------------------------------------------------
# numpy forward (float and fake-quant reference)
# ----------------------------------------------------------------------------------------------------------


def _attr(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, pads) -> np.ndarray:
    top, left, bottom, right = pads
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    windows = sliding_window_view(x, w.shape[2:], axis=(2, 3))
    y = np.einsum("nchwij,ocij->nohw", windows, w).astype(np.float32)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _conv_transpose(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """Stride 1, no padding, one group."""
    kh, kw = w.shape[2:]
    y = np.zeros((x.shape[0], w.shape[1], x.shape[2] + kh - 1, x.shape[3] + kw - 1), np.float32)
    for i in range(kh):
        for j in range(kw):
            y[:, :, i : i + x.shape[2], j : j + x.shape[3]] += np.einsum("nchw,co->nohw", x, w[:, :, i, j])
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _run_node(node: onnx.NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    if node.op_type == "MatMul":
        return ins[0] @ ins[1]
    if node.op_type == "Relu":
        return np.maximum(ins[0], 0)
    if node.op_type == "Add":
        return ins[0] + ins[1]
    if node.op_type == "Conv":
        return _conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, _attr(node, "pads", [0, 0, 0, 0]))
    if node.op_type == "ConvTranspose":
        return _conv_transpose(ins[0], ins[1], ins[2] if len(ins) > 2 else None)
    if node.op_type == "Gemm":
        b = ins[1].T if _attr(node, "transB", 0) else ins[1]
        return ins[0] @ b + (ins[2] if len(ins) > 2 else 0)
    raise NotImplementedError(node.op_type)


def forward(model: onnx.ModelProto, feeds: dict, input_hooks=None, output_hooks=None) -> dict[str, np.ndarray]:
    """Runs the float graph in numpy; hooks replace a node's inputs / a tensor's value (fake quant)."""
    env = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    env.update({k: np.asarray(v, dtype=np.float32) for k, v in feeds.items()})
    for node in model.graph.node:
        ins = [env[name] for name in node.input]
        if input_hooks and node.name in input_hooks:
            ins = input_hooks[node.name](ins)
        out = np.asarray(_run_node(node, ins), dtype=np.float32)
        if output_hooks and node.output[0] in output_hooks:
            out = output_hooks[node.output[0]](out)
        env[node.output[0]] = out
    return env


def _dequantized_weight(
    w: np.ndarray, axis: int | None, per_channel: bool, qmax: int = 127
) -> tuple[np.ndarray, np.ndarray]:
    q, scales = quantize_weight(w, axis, per_channel, qmax=qmax)
    shape = [1] * w.ndim
    if per_channel:
        shape[axis % w.ndim] = -1
    return q.astype(np.float32) * scales.reshape(shape), scales


def _sole_relu_output(model: onnx.ModelProto, tensor: str) -> str | None:
    readers = [n for n in model.graph.node if tensor in n.input]
    if len(readers) == 1 and readers[0].op_type == "Relu" and tensor not in {o.name for o in model.graph.output}:
        return readers[0].output[0]
    return None


def int8_reference(model, layers, plan, ranges, recipe, feeds, ort_bias=False) -> dict[str, np.ndarray]:
    """Numpy fake-quant forward of an int8 plan, written independently of rewrite.py.

    Weights are quantized to the recipe's range (``weight_max``: 8 or 7 bits), as the scheme in use does (uint8
    weights hold the same integers, offset by their zero point).

    ``ort_bias`` mimics ORT's optimizer, which quantizes a float Conv bias to int32 (act_scale * w_scale)
    whenever the Conv reads DQ outputs, whatever the graph says.
    """
    per_channel = plan.knob("weight_granularity", "per_channel") == "per_channel"
    dtype = recipe.activation_dtype
    input_hooks, output_hooks = {}, {}
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for layer in layers:
        if plan.precision_map.get(layer.name, "fp32") != "int8":
            continue
        node = next(n for n in model.graph.node if n.name == layer.name)
        least = recipe.least_zero_point(layer.op_type)
        act = {x: activation_qparams(*ranges[x], dtype, None, least) for x in layer.activation_inputs}
        replace = {}
        w_scales = None
        if layer.weight is not None:
            replace[layer.weight], w_scales = _dequantized_weight(
                inits[layer.weight], layer.weight_axis, per_channel, recipe.weight_max
            )
        is_conv = layer.op_type in ("Conv", "ConvTranspose")
        quant_out = recipe.quantize_conv_output if is_conv else recipe.quantize_matmul_output
        if is_conv and (quant_out or ort_bias) and layer.bias is not None:
            bias_scale = act[layer.activation_inputs[0]][0] * w_scales
            replace[layer.bias] = fake_quant(inits[layer.bias], bias_scale, 0, "int32", axis=0)

        def hook(ins, node=node, act=act, replace=replace):
            out = []
            for name, value in zip(node.input, ins, strict=True):
                if name in act:
                    value = fake_quant(value, *act[name], dtype)
                out.append(replace.get(name, value))
            return out

        input_hooks[layer.name] = hook
        if quant_out:
            target = layer.output
            if recipe.fold_activation_into_output and _sole_relu_output(model, layer.output):
                target = _sole_relu_output(model, layer.output)
            params = activation_qparams(*ranges[target], dtype)
            output_hooks[target] = lambda v, params=params: fake_quant(v, *params, dtype)
    return forward(model, feeds, input_hooks, output_hooks)


def random_feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Standard-normal inputs of the graph's static shapes."""
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.normal(size=shape).astype(np.float32)
    return feeds
