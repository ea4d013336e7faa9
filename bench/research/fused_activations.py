r"""Where an INT8 conv's SiLU (``x * sigmoid(x)``) and HardSwish tails get their Q/DQ pairs, timed on ONNX Runtime CPU.

A stack of ``--depth`` 3x3 convolutions (BatchNorm folded into them, as a PyTorch export writes them) at ``--channels``
channels, ``--size`` x ``--size``, batch ``--batch``, each followed by a SiLU (``Sigmoid`` + ``Mul``), quantized in
several ways, each timed against the FP32 model in the same process, interleaved round by round, one intra-op
thread, in thread CPU time (so other load on the machine hardly moves the ratios). The hand-written variants have
uint8 activations with max-calibrated ranges, int8 per-channel weights and int32 biases; the SNR is of the output
against FP32 on a held-out batch.

- ``ort``: what ``onnxruntime.quantization.quantize_static`` writes (QDQ format, its defaults: int8 activations,
  per-tensor weights; every Conv, Sigmoid and Mul quantized). ORT fuses none of it on x86 (its QLinearConv wants
  uint8 activations there): float kernels between Q/DQ pairs.
- ``ort-u8``: the same with ``activation_type=QUInt8, per_channel=True``, the settings ORT recommends for x86
  (ORT: QLinearConv, QLinearSigmoid, QLinearMul, as ``c``).
- ``b``: Q/DQ after each Conv and after each Mul; the Sigmoid and Mul run in float between (ORT: QLinearConv, then
  DequantizeLinear -> Sigmoid, Mul -> QuantizeLinear).
- ``c``: Q/DQ after each Conv, Sigmoid (over [0, 1]) and Mul (ORT: QLinearConv, QLinearSigmoid, QLinearMul).
- ``d``: Q/DQ on each Conv's input and after each Mul only: the conv's output stays float (ORT cannot fuse a
  QLinearConv without an output Q, so it runs the float conv on dequantized weights).

``--tail hardswish`` puts ``HardSwish`` after each conv instead (``b``: Q/DQ after the Conv and the HardSwish;
``d`` as above), ``--tail hardsigmoid`` ``Mul(x, HardSigmoid(x))`` (``b``; ``c``: Q/DQ after the HardSigmoid too).

    python bench/research/fused_activations.py --rounds 15                     # SiLU
    python bench/research/fused_activations.py --rounds 15 --tail hardswish
    python bench/research/fused_activations.py --rounds 15 --tail hardsigmoid
    python bench/research/fused_activations.py --openvino --rounds 0           # each variant also runs on OpenVINO

Result (2-core AMD EPYC VM with AVX512-VNNI, ORT 1.32, defaults: 12 convs, 64 channels, 80x80, batch 2; 15 rounds,
thread CPU time; load average 5 from other jobs): speedup over FP32, median of the rounds (range), and output SNR.

    SiLU:         ort 0.75x (0.70-0.76) 27.2 dB   ort-u8 3.25x (3.11-3.49) 27.5 dB
                  b 2.83x (2.59-3.02) 27.6 dB   c 3.29x (3.16-3.52) 27.5 dB   d 0.81x (0.78-0.88) 29.8 dB
    HardSwish:    b 3.03x (2.52-3.14) 29.0 dB   d 0.78x (0.73-0.81) 31.1 dB
    HardSigmoid:  b 2.99x (2.71-3.30) 26.8 dB   c 3.14x (2.78-3.45) 26.8 dB   d 0.78x (0.73-0.82) 29.1 dB

``c`` is the fastest at the same accuracy (1.16x ``b`` on the SiLU stack; the same graph as ``ort-u8``), and what
``autotune.quant.placement.output_pairs`` writes for a layer with a gated tail; an ONNX ``HardSwish`` has no integer
kernel, so it gets ``b``. ``d`` keeps the most accuracy but loses the integer conv. With ``--openvino`` every variant
compiles and runs on OpenVINO 2026.4's CPU plugin at the SNR ORT gives (no timing claims).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def stack(depth: int, channels: int, size: int, batch: int, tail: str, seed: int = 0) -> onnx.ModelProto:
    """``depth`` 3x3 convs with biases (BN folded), each followed by ``tail``: silu, hardswish or hardsigmoid."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        fan_in = channels * 9
        w = rng.normal(0, (2.0 / fan_in) ** 0.5, (channels, channels, 3, 3)).astype(np.float32)
        b = rng.normal(0, 0.1, channels).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        conv = f"conv{i}"
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [conv], f"Conv{i}", pads=[1, 1, 1, 1]))
        out = f"act{i}"
        if tail == "hardswish":
            nodes.append(helper.make_node("HardSwish", [conv], [out], f"HardSwish{i}"))
        else:
            gate_op = "Sigmoid" if tail == "silu" else "HardSigmoid"
            nodes.append(helper.make_node(gate_op, [conv], [f"gate{i}"], f"{gate_op}{i}"))
            nodes.append(helper.make_node("Mul", [conv, f"gate{i}"], [out], f"Mul{i}"))
        x = out
    shape = [batch, channels, size, size]
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def session(model: onnx.ModelProto, intermediate: list[str] | None = None):
    """A one-thread ORT CPU session; ``intermediate`` tensors become extra outputs (for calibration)."""
    import onnxruntime as ort

    if intermediate:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in intermediate)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ranges(model: onnx.ModelProto, batches: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """Min/max of every node output over the batches (zero always inside, as uint8 with a zero point needs)."""
    names = [out for node in model.graph.node for out in node.output]
    runner = session(model, names)
    found = {"x": (min(0.0, *(float(b.min()) for b in batches)), max(0.0, *(float(b.max()) for b in batches)))}
    for batch in batches:
        for name, value in zip([o.name for o in runner.get_outputs()], runner.run(None, {"x": batch}), strict=True):
            lo, hi = found.get(name, (0.0, 0.0))
            found[name] = (min(lo, float(value.min())), max(hi, float(value.max())))
    return found


def _qparams(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    scale = max(hi - lo, 1e-8) / 255.0
    return np.array(scale, np.float32), np.array(round(-lo / scale), np.uint8)


def hand_qdq(model: onnx.ModelProto, quantized: set[str], found: dict[str, tuple[float, float]]) -> onnx.ModelProto:
    """Q/DQ after the graph input and every tensor of ``quantized``; int8 per-channel weights, int32 biases."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    graph = out.graph
    weights = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    nodes, inits, act_scale = [], [], {}

    def qdq(tensor: str) -> str:
        scale, zero = _qparams(*found[tensor])
        act_scale[tensor] = float(scale)
        inits.extend([numpy_helper.from_array(scale, f"{tensor}_s"), numpy_helper.from_array(zero, f"{tensor}_z")])
        nodes.append(helper.make_node("QuantizeLinear", [tensor, f"{tensor}_s", f"{tensor}_z"], [f"{tensor}_q"]))
        return dequantize(tensor, "")

    def dequantize(prefix: str, kind: str, **axis: int) -> str:
        names = [f"{prefix}_{kind}q", f"{prefix}_{kind}s", f"{prefix}_{kind}z"]
        nodes.append(helper.make_node("DequantizeLinear", names, [f"{prefix}_{kind}dq"], **axis))
        return f"{prefix}_{kind}dq"

    renamed = {"x": qdq("x")}
    for node in graph.node:
        inputs = [renamed.get(name, name) for name in node.input]
        if node.op_type == "Conv" and node.input[0] in renamed:
            w, b = weights[node.input[1]], weights[node.input[2]]
            w_scale = (np.abs(w).reshape(w.shape[0], -1).max(axis=1) / 127.0).astype(np.float32)
            w_q = np.clip(np.round(w / w_scale[:, None, None, None]), -127, 127).astype(np.int8)
            b_scale = (w_scale * act_scale[node.input[0]]).astype(np.float32)
            b_q = np.round(b / b_scale).astype(np.int32)
            name = node.input[1]
            inits += [
                numpy_helper.from_array(w_q, f"{name}_q"),
                numpy_helper.from_array(w_scale, f"{name}_s"),
                numpy_helper.from_array(np.zeros_like(w_q[:, 0, 0, 0]), f"{name}_z"),
                numpy_helper.from_array(b_q, f"{name}_bq"),
                numpy_helper.from_array(b_scale, f"{name}_bs"),
                numpy_helper.from_array(np.zeros(b_q.shape, np.int32), f"{name}_bz"),
            ]
            inputs[1:3] = [dequantize(name, "", axis=0), dequantize(name, "b", axis=0)]
        del node.input[:]
        node.input.extend(inputs)
        nodes.append(node)
        for tensor in node.output:
            if tensor in quantized:
                renamed[tensor] = qdq(tensor)
    graph.output[0].name = renamed.get(graph.output[0].name, graph.output[0].name)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    onnx.checker.check_model(out)
    return out


def ort_quantize_static(model: onnx.ModelProto, batches: list[np.ndarray], **settings: object) -> onnx.ModelProto:
    """``quantize_static`` in QDQ format with its defaults but ``settings``, calibrated on ``batches`` (MinMax)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{"x": batch} for batch in batches])

        def get_next(self):
            return next(self.items, None)

    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "fp32.onnx", Path(folder) / "int8.onnx"
        onnx.save(model, source)
        quantize_static(str(source), str(target), Reader(), quant_format=QuantFormat.QDQ, **settings)
        return onnx.load(str(target))


def variants(model: onnx.ModelProto, tail: str, batches: list[np.ndarray]) -> dict[str, onnx.ModelProto]:
    """The INT8 placements to compare, by name (see the module docstring)."""
    found = ranges(model, batches)
    convs = {n.output[0] for n in model.graph.node if n.op_type == "Conv"}
    ends = {n.output[0] for n in model.graph.node if n.op_type in ("Mul", "HardSwish")}
    gates = {n.output[0] for n in model.graph.node if n.op_type in ("Sigmoid", "HardSigmoid")}
    chosen = {"b": hand_qdq(model, convs | ends, found), "d": hand_qdq(model, ends, found)}
    if tail != "hardswish":  # the gate's range is its output's whole span, as autotune.quant writes it
        chosen["c"] = hand_qdq(model, convs | gates | ends, found | dict.fromkeys(gates, (0.0, 1.0)))
    if tail == "silu":
        from onnxruntime.quantization import QuantType

        chosen = {
            "ort": ort_quantize_static(model, batches),
            "ort-u8": ort_quantize_static(model, batches, activation_type=QuantType.QUInt8, per_channel=True),
            **chosen,
        }
    return chosen


def snr_db(reference: np.ndarray, value: np.ndarray) -> float:
    """Signal-to-noise ratio of ``value`` against ``reference``, in dB."""
    noise = float(np.mean((reference.astype(np.float64) - value) ** 2))
    return 10 * np.log10(float(np.mean(reference.astype(np.float64) ** 2)) / max(noise, 1e-30))


def time_side_by_side(sessions: dict[str, object], feed: dict, rounds: int) -> dict[str, list[float]]:
    """Thread CPU seconds of one run per session per round; the sessions take turns within each round."""
    for runner in sessions.values():
        runner.run(None, feed)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for round_index in range(rounds):
        order = list(sessions) if round_index % 2 == 0 else list(reversed(sessions))
        for name in order:
            started = time.thread_time()
            sessions[name].run(None, feed)
            times[name].append(time.thread_time() - started)
    return times


def openvino_check(models: dict[str, onnx.ModelProto], feed: np.ndarray, reference: np.ndarray) -> None:
    """Compiles and runs each model on OpenVINO's CPU plugin; prints the output's SNR against ORT's FP32."""
    import openvino as ov

    core = ov.Core()
    for name, model in models.items():
        compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU")
        value = compiled({"x": feed})[compiled.output(0)]
        print(f"openvino {name}: runs, SNR {snr_db(reference, value):.1f} dB")


def main() -> None:
    """Builds the stack, quantizes it each way, prints the speedups over FP32 and the SNRs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tail", choices=("silu", "hardswish", "hardsigmoid"), default="silu")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=80)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--openvino", action="store_true", help="also run every variant on OpenVINO's CPU plugin")
    args = parser.parse_args()
    model = stack(args.depth, args.channels, args.size, args.batch, args.tail)
    rng = np.random.default_rng(1)
    shape = (args.batch, args.channels, args.size, args.size)
    batches = [rng.normal(0, 1, shape).astype(np.float32) for _ in range(4)]
    held_out = rng.normal(0, 1, shape).astype(np.float32)
    models = {"fp32": model, **variants(model, args.tail, batches)}
    sessions = {name: session(m) for name, m in models.items()}
    reference = sessions["fp32"].run(None, {"x": held_out})[0]
    times = time_side_by_side(sessions, {"x": held_out}, args.rounds) if args.rounds else {}
    print(f"{args.tail}: {args.depth} convs, {args.channels} channels, {args.size}x{args.size}, batch {args.batch}")
    for name, runner in sessions.items():
        snr = snr_db(reference, runner.run(None, {"x": held_out})[0])
        line = f"{name:5s} SNR {snr:6.1f} dB"
        if times:
            ratios = [f / t for f, t in zip(times["fp32"], times[name], strict=True)]
            line += f"  speedup {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            line += f"  {statistics.median(times[name]) * 1e3:.0f} ms CPU"
        print(line)
    if args.openvino:
        openvino_check(models, held_out, reference)


if __name__ == "__main__":
    main()
