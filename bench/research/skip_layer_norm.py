"""ONNX Runtime's SkipLayerNormalization kernel against the Add and LayerNormalization it replaces, on this CPU.

Two measurements, each in interleaved rounds on sessions built as the backend builds them (2 threads by default):

- one node: ``SkipLayerNormalization`` against ``Add`` (+ the bias ``Add``) and ``LayerNormalization``, on a
  ``--rows`` x ``--hidden`` activation (MiniLM at batch 8: 1024 x 384);
- each ONNX file given: its session with ORT's ``SkipLayerNormFusion`` on (ORT's default) and off, every other
  optimizer as ``autotune`` builds it (``disabled_optimizers`` of the backend); an exported winner's
  ``model.onnx`` reads the same way. Its feeds are ones of the graph's input shapes (``--shape NAME=DIMS`` for
  a dynamic one), token ids set to 1000.

    python bench/research/skip_layer_norm.py .cache/autotune/models/autotune.examples.minilm.build_module-*.onnx \
        runs/minilm-cpu/best/model.onnx --shape input_ids=8x128 --shape attention_mask=8x128

Prints each ratio as "off over on" (above 1: the fusion costs time here) and the largest output difference.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.onnxruntime import SKIP_LAYER_NORM_KNOB, disabled_optimizers, spinning_entries
from autotune.config.auto import parse_shapes


def node_model(fused: bool, bias: bool, rows: int, hidden: int) -> bytes:
    """One SkipLayerNormalization, or the Add (+ bias Add) and LayerNormalization it stands for."""
    shape = [rows, hidden]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in ("x", "skip")]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.normal(1.0, 0.1, hidden).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0.0, 0.1, hidden).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0.0, 0.1, hidden).astype(np.float32), "bias"),
    ]
    if fused:
        names = ["x", "skip", "gamma", "beta"] + (["bias"] if bias else [])
        nodes = [helper.make_node("SkipLayerNormalization", names, ["y"], domain="com.microsoft", epsilon=1e-12)]
    else:
        nodes = [helper.make_node("Add", ["x", "skip"], ["sum"])]
        if bias:
            nodes.append(helper.make_node("Add", ["sum", "bias"], ["biased"]))
        last = "biased" if bias else "sum"
        nodes.append(helper.make_node("LayerNormalization", [last, "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12))
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(nodes, "skip_layer_norm", inputs, [output], [i for i in initializers if i.name in used])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes | str, threads: int, disabled: list[str]):
    """An ONNX Runtime CPU session as the backend builds one, with ``disabled`` optimizers off.

    ``threads`` intra-op threads whose spinning stops when a run returns, so that one session's threads do not take
    the cores from the next one timed.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    for key, value in spinning_entries({}).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def interleaved(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, np.ndarray]:
    """Seconds of one run of each callable per round, in turn, after one warm-up run each per round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: np.array(values) for name, values in times.items()}


def feeds_of(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Ones of each graph input's shape (token ids 1000); ``shapes`` for dynamic dimensions."""
    graph = onnx.load(path, load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    feeds = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        dims = shapes.get(value.name) or [d.dim_value for d in value.type.tensor_type.shape.dim]
        if not all(dims):
            raise SystemExit(f"{path}: input {value.name} has a dynamic dimension: pass --shape {value.name}=DIMS")
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = np.full(dims, 1000 if "ids" in value.name else 1, dtype)
    return feeds


def main() -> None:
    """Times the one-node forms, then each model with the fusion on and off, and prints the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="ONNX files to time with the fusion on and off")
    parser.add_argument("--shape", action="append", default=[], help="NAME=DIMS of a model input, e.g. input_ids=8x128")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of the one-node test (the models take 12)")
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    node_feeds = {name: rng.standard_normal((args.rows, args.hidden), dtype=np.float32) for name in ("x", "skip")}
    for bias in (False, True):
        sessions = {
            fused: session(node_model(fused, bias, args.rows, args.hidden), args.threads, []) for fused in (True, False)
        }
        times = interleaved({str(f): lambda s=s: s.run(None, node_feeds) for f, s in sessions.items()}, args.rounds)
        on, off = (sessions[f].run(None, node_feeds)[0] for f in (True, False))
        fused_us, unfused_us = (np.median(times[str(f)]) * 1e6 for f in (True, False))
        print(
            f"one node, {args.rows}x{args.hidden}, bias {'yes' if bias else 'no'}: SkipLayerNormalization "
            f"{fused_us:.0f} us, Add+LayerNormalization {unfused_us:.0f} us: off over on "
            f"{np.median(times['True'] / times['False']):.2f}x, max difference {np.abs(on - off).max():.1e}"
        )
    shapes = parse_shapes(args.shape)
    for path in args.models:
        graph = onnx.load(path, load_external_data=False).graph
        quantized = any(node.op_type == "DequantizeLinear" for node in graph.node)
        sessions = {
            on: session(path, args.threads, disabled_optimizers({SKIP_LAYER_NORM_KNOB: on}, quantized))
            for on in (True, False)
        }
        feeds = feeds_of(path, shapes)
        times = interleaved({str(on): lambda s=s, f=feeds: s.run(None, f) for on, s in sessions.items()}, 12)
        on, off = (sessions[flag].run(None, feeds)[0] for flag in (True, False))
        print(
            f"{path}: fusion on {np.median(times['True']) * 1e3:.1f} ms, off {np.median(times['False']) * 1e3:.1f} ms: "
            f"off over on {np.median(times['True'] / times['False']):.2f}x, max difference {np.abs(on - off).max():.1e}"
        )


if __name__ == "__main__":
    main()
