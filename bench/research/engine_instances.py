"""Identical engines, timed in rotating rounds in one process: do they run at the same speed?

Builds ``--engines`` sessions of one ONNX model on ONNX Runtime or OpenVINO (FP32, two threads, as a trial does),
times them in rounds whose order rotates (each engine one warm-up run and three samples a round), and prints each
engine's floor (the mean of its fastest quarter of samples) relative to the first engine's, for the first and the
second half of the rounds, and each engine's median sample over its fastest (how its runs scatter): a limit on any
ratio measured between two builds (docs/measurement.md#quiet-rounds has what an idle VM did).

    python bench/research/engine_instances.py autotune/examples/data/cnn.onnx --shape 32x1x16x16 --rounds 200
    python bench/research/engine_instances.py .cache/autotune/models/autotune.examples.minilm.build_module-*.onnx \\
        --runtime openvino --rounds 30   # the MiniLM ONNX file configs/minilm-cpu.yaml caches
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

SAMPLES_PER_ROUND = 3
SAMPLE_S = 0.005
"""A sample runs the engine back to back for at least this long (one run where one run takes longer)."""


def _feeds(names: list[str], shape: str | None) -> dict[str, np.ndarray]:
    """A float input of ``shape``, or MiniLM's token ids and mask (batch 8, 128 tokens) without one."""
    if shape:
        dims = tuple(int(d) for d in shape.split("x"))
        return {names[0]: np.random.default_rng(0).standard_normal(dims).astype(np.float32)}
    ids = np.random.default_rng(0).integers(100, 20000, (8, 128)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((8, 128), np.int64)}


def engines(path: str, runtime: str, count: int, shape: str | None) -> list[Callable[[], object]]:
    """``count`` identical FP32 engines of the model, each as a function that runs it once."""
    if runtime == "openvino":
        import openvino as ov

        core = ov.Core()
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2, "NUM_STREAMS": 1}
        compiled = [core.compile_model(core.read_model(path), "CPU", config) for _ in range(count)]
        feeds = _feeds([port.get_any_name() for port in compiled[0].inputs], shape)
        requests = [model.create_infer_request() for model in compiled]
        return [lambda request=request: request.infer(feeds) for request in requests]
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sessions = [ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]) for _ in range(count)]
    feeds = _feeds([port.name for port in sessions[0].get_inputs()], shape)
    return [lambda session=session: session.run(None, feeds) for session in sessions]


def rotated_samples(runs: list[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Per engine, its samples (ms per run) over ``rounds`` rounds whose order rotates."""
    started = time.perf_counter()
    runs[0]()
    repeats = max(1, int(SAMPLE_S / (time.perf_counter() - started)))
    samples: list[list[float]] = [[] for _ in runs]
    for round_index in range(rounds):
        for offset in range(len(runs)):
            engine = (round_index + offset) % len(runs)
            runs[engine]()  # the warm-up after a switch
            for _ in range(SAMPLES_PER_ROUND):
                started = time.perf_counter()
                for _ in range(repeats):
                    runs[engine]()
                samples[engine].append((time.perf_counter() - started) / repeats * 1e3)
    return samples


def floor_ms(samples: list[float]) -> float:
    """The mean of the fastest quarter of the samples."""
    ordered = sorted(samples)
    return float(np.mean(ordered[: max(1, len(ordered) // 4)]))


def main() -> None:
    """Times the engines and prints their floors, half by half."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--runtime", choices=["onnxruntime", "openvino"], default="onnxruntime")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--shape", help="the float input's shape, e.g. 32x1x16x16 (default: MiniLM's token inputs)")
    args = parser.parse_args()
    samples = rotated_samples(engines(args.model, args.runtime, args.engines, args.shape), args.rounds)
    for half in (0, 1):
        floors = [floor_ms(s[half * len(s) // 2 : (half + 1) * len(s) // 2]) for s in samples]
        relative = " ".join(f"{floor / floors[0]:.3f}" for floor in floors)
        print(f"half {half + 1}: floors (ms) {' '.join(f'{f:.3f}' for f in floors)}; relative to the first: {relative}")
    scatter = " ".join(f"{float(np.median(s)) / min(s):.3f}" for s in samples)
    print(f"each engine's median sample over its fastest: {scatter}")


if __name__ == "__main__":
    main()
