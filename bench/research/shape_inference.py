"""Shape inference of a large ONNX model: onnx's own, against ``autotune.model.shapes`` (the weights' bytes left out).

Usage:
    python bench/research/shape_inference.py MODEL.onnx [--reps 4]
    e.g. the BERT-large-shaped encoder's weights (530 MB; a batch-1 export has the same ones):
    python -c "from pathlib import Path; from autotune.model.layers import InputSpec as I;
    from autotune.model.torch_export import export_torch as e; e('autotune.examples.encoder:build_module',
      [I('input_ids', (1, 128), 'int64'), I('attention_mask', (1, 128), 'int64')], Path('encoder.onnx'), opset=17)"

Each repetition times both on a fresh load of the model, interleaved, so a slow spell of the machine falls on
both; prints the medians, their ratio, and whether the two results are the same model byte for byte.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import onnx
from onnx import shape_inference

from autotune.model.shapes import infer_shapes_in_place


def main() -> None:
    """Times both inferences ``--reps`` times, interleaved, and prints the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"onnx": [], "autotune.model.shapes": []}
    same = True
    for _ in range(args.reps):
        model = onnx.load(str(args.model))
        started = time.perf_counter()
        expected = shape_inference.infer_shapes(model, data_prop=True)
        seconds["onnx"].append(time.perf_counter() - started)
        started = time.perf_counter()
        infer_shapes_in_place(model, data_prop=True)
        seconds["autotune.model.shapes"].append(time.perf_counter() - started)
        same = same and model.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    size_mb = args.model.stat().st_size / 1e6
    print(f"{args.model} ({size_mb:.0f} MB), {args.reps} interleaved repetitions, median seconds:")
    for name, median in medians.items():
        print(f"  {name:16s} {median:6.2f}  ({', '.join(f'{s:.2f}' for s in seconds[name])})")
    ratio = medians["onnx"] / medians["autotune.model.shapes"]
    print(f"onnx's time over autotune.model.shapes': {ratio:.1f}x; same result: {same}")


if __name__ == "__main__":
    main()
