"""How far the layerwise race's choices are from scoring every candidate on every batch, and what the ranges cost.

On one model and its calibration split: the whole FP32 graph's milliseconds per batch as written and optimized
(two threads, graph optimizations off and all on, as ``probe.session`` runs the probes and the parts after a
layer), the entropy ranges' seconds (``Calibration.ranges("entropy")``), then
``choose_layer_methods`` twice, with the race and ``exhaustive``: the seconds of each, how many layers choose the
same candidate, and, where they differ, the race's choice's exact error over the exhaustive choice's.

    python bench/detectors.py --model yolo
    python bench/research/layerwise_race.py runs/detectors/yolo

Run with ``PYTHONPATH`` at a checkout of another revision to time its ranges and race the same way (a revision
without ``exhaustive`` fails at the second step; its ranges line is printed first).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    """Prints one JSON line per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="holds model.onnx and data.npz, as bench/detectors.py writes them")
    parser.add_argument("--batches", type=int, default=4, help="calibration batches (the split's first samples)")
    args = parser.parse_args()

    import onnx

    from autotune.backends.onnxruntime import int8_recipe
    from autotune.model.layers import prepare_model
    from autotune.quant.calibrate import calibrate
    from autotune.quant.layerwise import choose_layer_methods
    from autotune.quant.rewrite import required_ranges

    loaded = prepare_model(onnx.load(args.dir / "model.onnx"), args.dir / "model.onnx", None)
    size = int(loaded.inputs[0].shape[0])
    arrays = {k: v for k, v in np.load(args.dir / "data.npz").items() if k != "labels"}
    batches = [{k: v[i * size : (i + 1) * size] for k, v in arrays.items()} for i in range(args.batches)]
    print(json.dumps(_fp32_ms(loaded.proto, batches[0])), flush=True)
    recipe = int8_recipe()
    calibration = calibrate(loaded.proto, required_ranges(loaded.layers, recipe, loaded.proto), batches, None, "")
    started = time.perf_counter()
    calibration.ranges("entropy")
    seconds = time.perf_counter() - started
    print(json.dumps({"tensors": len(calibration.stats), "entropy_ranges_s": round(seconds, 2)}), flush=True)
    for method in ("max", "percentile"):
        calibration.ranges(method)
    chosen, seconds = {}, {}
    for name, exhaustive in (("race", False), ("exhaustive", True)):
        started = time.perf_counter()
        chosen[name] = choose_layer_methods(
            loaded.proto, loaded.layers, recipe, calibration, batches, 0, progress=False, exhaustive=exhaustive
        )
        seconds[name] = round(time.perf_counter() - started, 1)
    race, exact = chosen["race"], chosen["exhaustive"]
    differ = [name for name in exact.methods if race.methods[name] != exact.methods[name]]
    regret = [exact.errors[n][race.methods[n]] / exact.errors[n][exact.methods[n]] for n in differ]
    print(
        json.dumps(
            {
                "layers": len(exact.methods),
                "seconds": seconds,
                "same_choice": len(exact.methods) - len(differ),
                "race_choice_error_over_best_max": round(max(regret), 3) if regret else None,
            }
        )
    )


def _fp32_ms(model, batch) -> dict[str, float]:
    """Median milliseconds of the FP32 graph on one batch, as written and optimized, 20 runs each after 3."""
    import onnxruntime as ort

    out = {}
    levels = {
        "as_written_ms": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "optimized_ms": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    for name, level in levels.items():
        options = ort.SessionOptions()
        options.graph_optimization_level, options.intra_op_num_threads = level, 2
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = {value.name: batch[value.name] for value in session.get_inputs()}
        for _ in range(3):
            session.run(None, feed)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - started)
        out[name] = round(float(np.median(times)) * 1e3, 1)
    return out


if __name__ == "__main__":
    main()
