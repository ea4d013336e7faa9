r"""Per-token dynamic INT8 written in ONNX Runtime's own ops: how much of the per-tensor form's drop and speed it keeps.

ONNX Runtime's dynamic MatMul (``DynamicQuantizeMatMul``, the ``int8-dynamic`` precision) quantizes its input with
one range per run. On MiniLM that range costs most of the drop (docs/int8-by-cpu.md, "Where MiniLM's drop goes").
Neither ONNX Runtime nor OpenVINO has a per-token (per-row) dynamic kernel on an AVX2 CPU, so this writes one from
standard ops plus ``com.microsoft.MatMulIntegerToFloat`` and measures it against the per-tensor form, on the
config's evaluation split, every weight MatMul in the form (7-bit weights per output column: exact on AVX2's
saturating U8S8 kernels as on every other CPU):

- ``per-tensor``: ``quantize_dynamic`` (per channel, ``reduce_range``): the ``int8-dynamic`` form.
- ``per-row``: each row's own scale and zero point (``ReduceMax``/``ReduceMin``, per-axis ``QuantizeLinear``), the
  product by ``MatMulIntegerToFloat`` and the zero points' share taken off after it (``zp (x) colsum(W)``).
- ``per-row-scale``: each row's own scale around one zero point per input, from the calibration split (the median
  of the rows' own), so the kernel applies it and only the scale is multiplied after.
- ``per-row-scale`` on one kind of layer at a time (query ... FFN-down), the rest FP32: accuracy only.
- With ``--winner``: a tuning run's exported ONNX Runtime model, and the same with its FP32 MatMuls (FFN-down,
  then FFN-up too, then all) in the ``per-row-scale`` form, on the held-out split.

Speeds are over the FP32 model, every engine timed side by side in the same rounds with the ONNX Runtime backend's
session options (``autotune.measure.timing.side_by_side``)::

    python bench/research/per_token_dynamic.py configs/minilm-cpu.yaml --out bench/results/minilm-per-token-avx2.json
    python bench/research/per_token_dynamic.py configs/minilm-cpu.yaml --winner runs/minilm-cpu/best/model.onnx \
        --out bench/results/minilm-per-token-winner-avx2.json

Research only: nothing in autotune lowers to these graphs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autotune.backends import get_backend
from autotune.config.schema import load_config
from autotune.data import Splits
from autotune.harness.identity import machine_identity
from autotune.harness.prepare import load_model, model_file
from autotune.measure.timing import Protocol, side_by_side
from autotune.metrics import cosine

KINDS = ("query", "key", "value", "attention/output", "intermediate", "output/dense")
"""MiniLM's six MatMuls per block, by the words in their node names (``intermediate``: FFN-up; ``output/dense``:
FFN-down)."""

WEIGHT_MAX = 63  # 7 bits: exact on the U8S8 kernels of every x86 CPU


def kind_of(name: str) -> str | None:
    """The MatMul's kind by its node name (``KINDS``), None for another."""
    return next((kind for kind in KINDS if kind in name), None)


def weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMuls by a constant 2-D weight."""
    inits = {init.name: init for init in model.graph.initializer}
    return [
        n
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
    ]


def int7_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 7-bit weights (``[-64, 63]``), one scale per output column."""
    scale = np.abs(w).max(0) / WEIGHT_MAX
    scale[scale == 0] = 1.0
    return np.clip(np.round(w / scale), -WEIGHT_MAX - 1, WEIGHT_MAX).astype(np.int8), scale.astype(np.float32)


def row_zero_points(path: Path, batches: list[dict[str, np.ndarray]]) -> dict[str, int]:
    """Per weight MatMul input: the median over the calibration rows of each row's own uint8 zero point."""
    import onnxruntime as ort

    model = onnx.load(str(path))
    names = sorted({n.input[0] for n in weight_matmuls(model)})
    for name in names:
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    below = {name: [] for name in names}
    for batch in batches:
        for name, value in zip(names, session.run(names, batch), strict=True):
            rows = value.reshape(-1, value.shape[-1])
            high, low = np.maximum(rows.max(1), 0), np.minimum(rows.min(1), 0)
            below[name].append(-low / np.maximum(high - low, 1e-12))
    return {name: int(np.clip(np.round(np.median(np.concatenate(v)) * 255), 1, 254)) for name, v in below.items()}


def per_row(path: Path, which: Callable[[str], bool], zero_points: dict[str, int] | None) -> onnx.ModelProto:
    """The model with ``which`` MatMuls per-row dynamic: own zero points (``zero_points`` None) or one per input."""
    model = onnx.load(str(path))
    inits = {init.name: init for init in model.graph.initializer}

    def const(name: str, value: np.ndarray) -> str:
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    const("pt_one", np.array(1.0, np.float32))
    const("pt_eps", np.array(1e-8, np.float32))
    const("pt_zero", np.array(0.0, np.float32))
    const("pt_axis1", np.array([1], np.int64))
    targets = {node.name for node in weight_matmuls(model) if which(node.name)}
    nodes: list[onnx.NodeProto] = []
    quantized: dict[str, tuple[str, str, str | None]] = {}  # input -> (its rows' scales, uint8, zero point(s))
    for node in model.graph.node:
        if node.name not in targets:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        x, p = node.input[0], node.name

        def add(op: str, inputs: list[str], out: str, domain: str | None = None, p: str = p, **attrs) -> str:
            nodes.append(helper.make_node(op, inputs, [p + out], p + out, domain=domain, **attrs))
            return p + out

        x2 = add("Reshape", [x, const(p + "_k", np.array([-1, w.shape[0]], np.int64))], "_x2")
        if x not in quantized:
            high = add("ReduceMax", [x2], "_max", axes=[1], keepdims=0)
            low = add("ReduceMin", [x2], "_min", axes=[1], keepdims=0)
            if zero_points is None:
                high, low = add("Max", [high, "pt_zero"], "_hi"), add("Min", [low, "pt_zero"], "_lo")
                width = add("Mul", [add("Sub", [high, low], "_w"), const(p + "_255", np.float32(1 / 255))], "_s0")
                scale = add("Max", [width, "pt_eps"], "_s")
                zero = add("Round", [add("Div", [add("Neg", [low], "_nlo"), scale], "_zf")], "_z")
                q = add("QuantizeLinear", [x2, scale, add("Cast", [zero], "_zu", to=TensorProto.UINT8)], "_q", axis=0)
                quantized[x] = (scale, q, zero)
            else:
                z = zero_points[x]
                above = add("Mul", [high, const(p + "_a", np.float32(1 / (255 - z)))], "_sa")
                under = add("Mul", [low, const(p + "_b", np.float32(-1 / z))], "_sb")
                scale = add("Max", [above, under, "pt_eps"], "_s")
                scaled = add("Div", [x2, add("Unsqueeze", [scale, "pt_axis1"], "_s1")], "_xs")
                q = add("QuantizeLinear", [scaled, "pt_one", const(p + "_zq", np.array(z, np.uint8))], "_q")
                quantized[x] = (scale, q, None)
        scale, q, zero = quantized[x]
        wq, w_scale = int7_weight(w)
        kernel_zero = [] if zero_points is None else [const(p + "_zk", np.array(zero_points[x], np.uint8))]
        y = add(
            "MatMulIntegerToFloat",
            [q, const(p + "_wq", wq), "pt_one", const(p + "_ws", w_scale), *kernel_zero],
            "_y",
            domain="com.microsoft",
        )
        if zero is not None:  # the kernel took no zero point: take each row's share off, zp_r * colsum(W) * w_scale
            colsum = (w_scale * wq.astype(np.int64).sum(0)).astype(np.float32)[None, :]
            share = add("MatMul", [add("Unsqueeze", [zero, "pt_axis1"], "_z1"), const(p + "_cs", colsum)], "_zc")
            y = add("Sub", [y, share], "_yc")
        y = add("Mul", [y, add("Unsqueeze", [scale, "pt_axis1"], "_sy")], "_ys")
        lead = add("Shape", [x], "_lead", end=-1)
        shape = add("Concat", [lead, const(p + "_n", np.array([w.shape[1]], np.int64))], "_shape", axis=0)
        nodes.append(helper.make_node("Reshape", [y, shape], [node.output[0]], p))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def per_tensor(path: Path, workdir: Path) -> onnx.ModelProto:
    """ORT's ``quantize_dynamic`` on every weight MatMul, per channel, 7-bit weights: the ``int8-dynamic`` form."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = workdir / "per_tensor.onnx"
    names = [n.name for n in weight_matmuls(onnx.load(str(path)))]
    quantize_dynamic(
        str(path),
        str(out),
        per_channel=True,
        reduce_range=True,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=names,
        op_types_to_quantize=["MatMul"],
    )
    return onnx.load(str(out))


def side_by_side_figures(
    backend, graphs: dict[str, onnx.ModelProto], data: list[dict[str, np.ndarray]], rounds: int
) -> tuple[dict[str, dict], list[np.ndarray]]:
    """Each graph's drop against ``graphs["fp32"]`` on ``data`` and its speedup over it, timed side by side.

    Returns:
        The figures by graph name, and FP32's outputs on ``data`` (the reference of other drops on it).
    """
    knobs = backend.fp32_reference_knobs()
    engines = {name: backend.build_graph(graph, knobs) for name, graph in graphs.items()}

    def outputs(engine) -> list[np.ndarray]:
        return [backend.run_engine(engine, batch)[0] for batch in data]

    fp32 = engines.pop("fp32")
    reference = outputs(fp32)
    latencies = side_by_side(
        [lambda engine=engine: backend.run_engine(engine, data[0]) for engine in engines.values()],
        lambda: backend.run_engine(fp32, data[0]),
        Protocol(warmup=1, repeats=2, rounds=rounds, settle_s=1.0),
    )
    figures = {}
    for (name, engine), latency in zip(engines.items(), latencies, strict=True):
        figures[name] = {
            "drop": 1.0 - cosine(outputs(engine), reference),
            "speedup": latency.speedup,
            "busy": latency.busy.describe() if latency.busy else None,
        }
        print(f"{name:24s} drop {figures[name]['drop']:.5f}  {latency.speedup:.3f}x FP32")
    return figures, reference


def main() -> None:
    """Builds the forms, scores them and times them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], help="a config override, as autotune's --set")
    parser.add_argument("--winner", type=Path, help="an exported model.onnx of the config's model (ONNX Runtime)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = load_config(args.config, ["backend.name=onnxruntime", *args.set])
    path = model_file(config.model, config.inputs, "onnxruntime", config.cache_dir)
    inputs = load_model(config.model, config.inputs, "onnxruntime", config.cache_dir).inputs
    splits = Splits(config.data, config.seed)
    calibration = splits.load("calibration", inputs).batches
    backend = get_backend(config.backend)
    found = {"command": vars(args) | {"out": str(args.out), "winner": str(args.winner)}}
    found["machine"] = machine_identity(type(backend))

    if args.winner is None:
        evaluation = splits.load("evaluation", inputs).batches
        zero_points = row_zero_points(path, calibration)
        with tempfile.TemporaryDirectory() as tmp:
            graphs = {
                "fp32": onnx.load(str(path)),
                "per-tensor": per_tensor(path, Path(tmp)),
                "per-row": per_row(path, lambda name: True, None),
                "per-row-scale": per_row(path, lambda name: True, zero_points),
            }
        found["forms"], reference = side_by_side_figures(backend, graphs, evaluation, args.rounds)
        by_kind = found["per_row_scale_by_kind"] = {}
        knobs = backend.fp32_reference_knobs()
        for kind in KINDS:
            alone = per_row(path, lambda name, kind=kind: kind_of(name) == kind, zero_points)
            engine = backend.build_graph(alone, knobs)
            by_kind[kind] = 1.0 - cosine([backend.run_engine(engine, batch)[0] for batch in evaluation], reference)
            print(f"per-row-scale on {kind} alone: drop {by_kind[kind]:.5f}")
    else:  # the winner's FP32 MatMuls in the per-row-scale form, on the held-out split the winner was confirmed on
        zero_points = row_zero_points(args.winner, calibration)
        graphs = {"fp32": onnx.load(str(path)), "winner": onnx.load(str(args.winner))}
        for label, kinds in (("FFN-down", {"output/dense"}), ("FFN-down and FFN-up", {"output/dense", "intermediate"})):
            graphs[f"winner, {label} per row"] = per_row(args.winner, lambda n, k=kinds: kind_of(n) in k, zero_points)
        graphs["winner, all FP32 per row"] = per_row(args.winner, lambda name: True, zero_points)
        found["winner"], _ = side_by_side_figures(backend, graphs, splits.load("holdout", inputs).batches, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
