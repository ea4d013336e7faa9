r"""Which runtime for this CPU: the ONNX Runtime and OpenVINO winners and OpenVINO's references, side by side.

Usage (after an ONNX Runtime run and an OpenVINO run of the same config; a plan JSON in place of a best/ directory
is built as a run of the config on that backend builds it, its calibration from the cache):
    python bench/openvino_vs_ort.py configs/minilm-cpu.yaml --ort runs/minilm-cpu/best --openvino runs/minilm-ov/best \
        --out bench/results/openvino/minilm-cpu.json [--references ov-default nncf-quantize nncf-accuracy-control]

In one process, on the config's held-out batches, with the config's threads: ONNX Runtime's FP32 session (the
clock), its exported winner (the session options of its ``session.json`` and plan), OpenVINO's FP32 model (f32
hint), OpenVINO's exported winner (``openvino.json``'s properties), and the OpenVINO references named, built as
the OpenVINO backend builds them. All are timed in the same rounds, the order rotating (``autotune.measure.timing.
side_by_side``): every figure is a ratio to ONNX Runtime FP32 in the same rounds, so two rows compare directly.
Each row's drop is ``1 - cosine`` of its outputs to ONNX Runtime FP32's, on the same batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx

from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.backends.openvino import OpenVINOCPU
from autotune.config.schema import load_config
from autotune.data import load_dataset
from autotune.harness.prepare import load_model
from autotune.measure.timing import Protocol, side_by_side
from autotune.metrics import cosine
from autotune.plan import Plan


def _from_plan(config_path: str, overrides: list[str], backend: str, plan_file: Path):
    """The engine of a plan file, built as a run of the config on ``backend`` builds it (calibration cached)."""
    from autotune.harness.runner import TrialRunner

    config = load_config(config_path, [*overrides, f"backend.name={backend}"])
    runner = TrialRunner(config)
    return runner.build(Plan.from_json(plan_file.read_text()), config.run_dir).engine


def _ort_winner(backend: OnnxRuntimeCPU, best: Path, args: argparse.Namespace):
    if best.is_file():  # a plan JSON (a trial's plan from the store)
        return _from_plan(args.config, args.set, "onnxruntime", best)
    plan = Plan.from_json((best / "plan.json").read_text()) if (best / "plan.json").is_file() else None
    knobs = plan.knob_map if plan is not None else {}
    return backend.build_graph(onnx.load(str(best / "model.onnx")), knobs)


def _ov_winner(backend: OpenVINOCPU, best: Path, args: argparse.Namespace):
    if best.is_file():
        return _from_plan(args.config, args.set, "openvino", best)
    manifest = json.loads((best / "openvino.json").read_text())
    return backend.compile(backend.core.read_model(str(best / "model.xml")), manifest["config"])


def main() -> int:
    """Builds every engine, times them side by side, prints and writes the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--ort", type=Path, help="the ONNX Runtime run's best/ directory, or a plan (optional)")
    parser.add_argument("--openvino", type=Path, required=True, help="the OpenVINO run's best/ directory, or a plan")
    parser.add_argument("--references", nargs="*", default=["ov-default"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
    holdout = load_dataset(config.data.holdout or config.data.evaluation, model.inputs, "holdout", config.seed + 1)
    calibration = load_dataset(config.data.calibration, model.inputs, "calibration", config.seed + 2).batches
    threads = config.backend.intra_op_threads
    ort, ov = OnnxRuntimeCPU(threads), OpenVINOCPU(threads, config.accuracy_budget, config.metric.name)
    ov.prepare(model, model.layer_names)
    engines = {
        "ort-fp32": (ort, ort.build_graph(model.proto, {})),
        "ov-fp32": (ov, ov.build_graph(model.proto, {})),
        "ov-winner": (ov, _ov_winner(ov, args.openvino, args)),
    }
    if args.ort is not None:
        engines["ort-winner"] = (ort, _ort_winner(ort, args.ort, args))
    for name in args.references:
        engines[name] = (ov, ov.build_reference(name, calibration, args.out.parent).engine)
    batches = holdout.batches
    outputs = {name: [b.run_engine(e, batch)[0] for batch in batches] for name, (b, e) in engines.items()}

    def runner(name: str):
        backend, engine = engines[name]
        return lambda: [backend.run_engine(engine, batch) for batch in batches[:2]]

    names = [name for name in engines if name != "ort-fp32"]
    protocol = Protocol(warmup=1, repeats=3, rounds=args.rounds, settle_s=2.0, max_rounds=2 * args.rounds)
    latencies = side_by_side([runner(name) for name in names], runner("ort-fp32"), protocol)
    rows = [{"engine": "ort-fp32", "speedup_vs_ort_fp32": 1.0, "drop": 0.0}]
    for name, latency in zip(names, latencies, strict=True):
        drop = 1.0 - cosine(outputs[name], outputs["ort-fp32"])
        rows.append({"engine": name, "speedup_vs_ort_fp32": latency.speedup, "drop": drop, "ms": latency.median_ms})
    winner = dict(zip(names, latencies, strict=True))
    # Every ratio of a round shares that round's ORT FP32 median: the quotient of two compares them directly.
    over = {
        name: float(
            np.median([a / b for a, b in zip(winner["ov-winner"].round_speedups, latency.round_speedups, strict=True)])
        )
        for name, latency in winner.items()
        if name != "ov-winner"
    }
    ratio = over.get("ort-winner")
    result = {
        "config": args.config,
        "command": " ".join(sys.argv),
        "rows": rows,
        "ov_winner_over_ort_winner": ratio,
        "ov_winner_over_each_round_by_round": over,
        "budget": config.accuracy_budget,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"{row['engine']:<24} {row['speedup_vs_ort_fp32']:6.2f}x ORT FP32   drop {row['drop']:.2e}")
    for name, value in over.items():
        print(f"OpenVINO winner / {name}, round by round: {value:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
