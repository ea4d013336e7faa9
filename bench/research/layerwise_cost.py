"""The layerwise calibration's cost, this tree's against an earlier revision's, on one model and calibration set.

Both versions run in this process, in alternating rounds, on the same model, batches and ``Calibration`` (its
ranges computed before either is timed, so neither pays the entropy search): CPU seconds (``time.process_time``:
ONNX Runtime's threads are in-process), wall seconds, seconds per layer and per MB of the FP32 activations the
calibration caches, and how the two agree (same choice per layer; the chosen error's deviation from the earlier
version's, which is exact for its chosen candidate).

    python bench/detectors.py --model yolo
    python bench/research/layerwise_cost.py runs/detectors/yolo --data runs/detectors/yolo/data.npz --batches 4

``DIR`` holds ``model.onnx`` and ``calib.npz`` (one array per model input, samples first, cut into batches of the
input's first dimension); ``--data``/``--start`` read another file, e.g. ``bench/detectors.py``'s ``data.npz``
(calibration split: its first 8 samples). The ranges are computed before either version is timed, so this leaves
out the entropy search (``autotune evaluate CONFIG --plan int8`` with a fresh cache times all of it:
``bench/results/detectors/layerwise-yolo.txt``).

Results (2026-12-06, 2-core AMD EPYC VM shared with four other sessions, load average 1-11; one round each, old
first; ORT 1.32), ``bench/detectors.py``'s YOLO-like detector (186 layers then, its calibration split: 4 batches
of 2 photographs), against ``--old cefb98c``:

- c9b0668 (every candidate one batch, the leader until the standard error of its ratio over the images it ran was
  within 5 %): 63.6 -> 69.3 CPU s (0.92x), 166/186 choices the same, one 4.7x worse; chosen errors up to 33x off
  (64 % at the 90th percentile). Withdrawn.
- The race of cefb98c with an allowance from ``budget.minutes``: 80.9 -> 85.6 CPU s (0.95x, within the machine's
  noise), 186/186 choices and every chosen error the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _old_module(revision: str):
    """``autotune/quant/layerwise.py`` as it was at ``revision``, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{revision}:autotune/quant/layerwise.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path("/tmp") / f"layerwise_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"layerwise_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _counting_fp32(module, cached: list[float]) -> None:
    """Wraps the module's FP32 pass (its own, or ``probe.fp32_pass``) to record the MB of activations it caches."""
    owner, name = (module, "_fp32_pass") if hasattr(module, "_fp32_pass") else (module.probe, "fp32_pass")
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        outputs, values, channels = original(*args, **kwargs)
        cached.append(sum(np.asarray(v).nbytes for batch in values for v in batch.values()) / 2**20)
        return outputs, values, channels

    setattr(owner, name, wrapped)


def main() -> None:
    """Times both versions on the model and batches the command line names; prints one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--data", type=Path, help="the .npz to read (default: DIR/calib.npz)")
    parser.add_argument("--start", type=int, default=0, help="the first sample of the calibration split")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--old", default="cefb98c", help="the revision to compare with")
    args = parser.parse_args()

    import onnx

    from autotune.backends.onnxruntime import int8_recipe
    from autotune.model.layers import prepare_model
    from autotune.quant import layerwise as new
    from autotune.quant.calibrate import METHODS, calibrate
    from autotune.quant.rewrite import required_ranges

    loaded = prepare_model(onnx.load(args.dir / "model.onnx"), args.dir / "model.onnx", None)
    arrays = {k: v[args.start :] for k, v in np.load(args.data or args.dir / "calib.npz").items() if k != "labels"}
    first = next(iter(arrays))
    size = int(loaded.inputs[0].shape[0])
    batches = [{k: v[i * size : (i + 1) * size] for k, v in arrays.items()} for i in range(args.batches)]
    assert all(len(b[first]) == size for b in batches), "not enough samples for --batches"
    recipe = int8_recipe()
    calibration = calibrate(loaded.proto, required_ranges(loaded.layers, recipe, loaded.proto), batches, None, "")
    for method in METHODS:
        calibration.ranges(method)
    versions = {"old": _old_module(args.old), "new": new}
    cached = {name: [] for name in versions}
    for name, module in versions.items():
        _counting_fp32(module, cached[name])
    timings = {name: [] for name in versions}
    chosen = {}
    for _ in range(args.rounds):
        for name, module in versions.items():
            cpu, wall = time.process_time(), time.perf_counter()
            chosen[name] = module.choose_layer_methods(
                loaded.proto, loaded.layers, recipe, calibration, batches, 0, progress=False
            )
            timings[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    print(json.dumps(_summary(loaded.layers, timings, cached, chosen, args)))


def _summary(layers, timings, cached, chosen, args) -> dict:
    """Median CPU and wall per version, per layer and per MB, their ratio, and how the choices agree."""
    out = {"layers": len(layers), "batches": args.batches, "rounds": args.rounds}
    for name, runs in timings.items():
        cpu = float(np.median([c for c, _ in runs]))
        wall = float(np.median([w for _, w in runs]))
        megabytes = cached[name][0]
        out[name] = {
            "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1),
            "cpu_s_per_layer": round(cpu / len(layers), 3),
            "cpu_s_per_cached_mb": round(cpu / megabytes, 4),
            "cached_mb": round(megabytes, 1),
        }
    out["cpu_ratio"] = round(out["old"]["cpu_s"] / out["new"]["cpu_s"], 2)
    out["wall_ratio"] = round(out["old"]["wall_s"] / out["new"]["wall_s"], 2)
    old, new = chosen["old"], chosen["new"]
    same = [n for n in old.methods if old.methods[n] == new.methods[n]]
    deviation = [abs(math.log(new.errors[n][old.methods[n]] / old.errors[n][old.methods[n]])) for n in same]
    # Where the choice differs: the old error of the new choice over the old choice's (>= 1 where old was exact).
    regret = [old.errors[n][new.methods[n]] / old.errors[n][old.methods[n]] for n in old.methods if n not in same]
    out["same_choice"] = f"{len(same)}/{len(old.methods)}"
    out["chosen_error_log_deviation"] = {
        "p50": round(float(np.percentile(deviation, 50)), 4),
        "p90": round(float(np.percentile(deviation, 90)), 4),
        "max": round(float(np.max(deviation)), 4),
    }
    out["other_choice_old_error_ratio_max"] = round(max(regret), 4) if regret else None
    return out


if __name__ == "__main__":
    main()
