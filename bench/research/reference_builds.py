"""What the torch backend's FP32 reference costs to build and how fast it runs, by how it is built, each cold.

Usage (on a CUDA machine; MiniLM needs its weights, ``AUTOTUNE_MINILM_DIR`` or the minilm extra):
    python bench/research/reference_builds.py --out OUT [--factory autotune.examples.minilm:build_module --batch 64] ...
        [--variant one-liner-bf16 --variant plan-bf16 ...]

Per factory and variant, one fresh process with empty inductor and Triton caches (a model's first run) builds the
factory's module in FP32 (BF16: the -bf16 variants) with the users' attention (the knob defaults), as
``TorchBackend`` builds a plan, then times it: one launch (median of 50 after 10) and 20 launches back to back
(median of 15), CUDA events. Variants:
``compile`` (``torch.compile`` and a CUDA graph: the reference before 2026-12-04), ``eager-graph`` (eager, one CUDA
graph: the reference now), ``dynamo-eager`` (``torch.compile(backend="eager")``, a CUDA graph), ``eager-nograph``;
and in BF16, ``one-liner-bf16`` (the users' ``.to(torch.bfloat16)`` under ``torch.compile(mode="reduce-overhead")``,
built as the run's ``torch-bf16`` row is: a plain compile of the module) beside ``plan-bf16`` (the search's all-BF16
plan: compiled, one CUDA graph), what a trial build costs against a user's compile, both cold.
Each row also has the largest difference of its outputs from eager's on one evaluation batch. Writes
``OUT/reference_builds.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("eager-graph", "dynamo-eager", "compile", "eager-nograph", "one-liner-bf16", "plan-bf16")
DEFAULT_MODELS = (("autotune.examples.minilm:build_module", 64), ("autotune.examples.encoder:build_module", 128))


def measure(variant: str, factory: str, batch: int) -> dict:
    """One variant of one factory, built and timed in this process."""
    import importlib
    from types import SimpleNamespace

    import numpy as np
    import torch

    from autotune.backends.torch import runtime
    from autotune.backends.torch.backend import TorchBackend
    from autotune.config.schema import TorchOptions
    from autotune.model.layers import InputSpec

    examples = importlib.import_module(factory.split(":")[0])
    backend = TorchBackend(factory, TorchOptions(device="cuda"))
    backend.load_ahead()
    inputs = [InputSpec("input_ids", (batch, 128), "int64"), InputSpec("attention_mask", (batch, 128), "int64")]
    backend.model, backend._output_shapes = SimpleNamespace(inputs=inputs), []
    knobs = backend.knob_values({})
    if variant == "dynamo-eager":
        runtime.compiled = lambda module, knobs: torch.compile(module, backend="eager")
    if variant.startswith("eager"):
        knobs["mode"] = "eager"
    if variant == "eager-nograph":
        knobs["cuda_graphs"] = False
    if variant.endswith("-bf16"):
        knobs["base_precision"] = "bf16"
    if variant == "one-liner-bf16":  # as TorchBackend.build_reference builds torch-bf16
        knobs["mode"], knobs["cuda_graphs"] = "reduce-overhead", False
    feeds = examples.batches("evaluation", batch_size=batch)[0]
    row: dict = {"variant": variant, "factory": factory, "batch": batch}
    try:
        started = time.perf_counter()
        artifact = backend._make({}, knobs)
        row["build_s"] = round(time.perf_counter() - started, 2)
        row["build_stages_s"] = {stage: round(s, 2) for stage, s in artifact.build_stages_s.items()}
        outputs = backend.run(artifact, feeds)[0]
        one = [backend.time_run(artifact, feeds) for _ in range(60)][10:]
        back_to_back = [backend.time_back_to_back(artifact, feeds, 20) for _ in range(15)]
        row["one_launch_ms"] = round(float(np.median(one)), 4)
        row["back_to_back_ms"] = round(float(np.median(back_to_back)), 4)
        eager = backend.run(backend._make({}, {**knobs, "mode": "eager", "cuda_graphs": False}), feeds)[0]
        row["max_abs_from_eager"] = float(np.abs(outputs - eager).max())
    except Exception as error:  # noqa: BLE001 - a variant that fails is a row with its error
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def main() -> None:
    """Runs every variant of every factory in a fresh process and writes the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--factory", action="append", help="package.module:function (default MiniLM, encoder)")
    parser.add_argument("--batch", action="append", type=int, help="one per --factory")
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="default: all")
    parser.add_argument("--one", nargs=3, metavar=("VARIANT", "FACTORY", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], int(args.one[2]))))
        return
    models = list(zip(args.factory, args.batch, strict=True)) if args.factory else list(DEFAULT_MODELS)
    rows = []
    for factory, batch in models:
        for variant in args.variant or VARIANTS:
            caches = tempfile.mkdtemp(prefix="reference-builds-")
            env = {
                **os.environ,
                "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
                "TRITON_CACHE_DIR": f"{caches}/triton",
            }
            command = [sys.executable, __file__, "--out", str(args.out), "--one", variant, factory, str(batch)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            rows.append(
                json.loads(lines[-1])
                if lines
                else {"variant": variant, "factory": factory, "error": done.stderr[-300:]}
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reference_builds.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("| factory | batch | variant | build s | one launch ms | back to back ms | max abs from eager |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [row.get(key, row.get("error", "")) for key in ("build_s", "one_launch_ms", "back_to_back_ms")]
        print(
            f"| {row['factory']} | {row.get('batch')} | {row['variant']} | {' | '.join(map(str, cells))} | "
            f"{row.get('max_abs_from_eager', '')} |"
        )


if __name__ == "__main__":
    main()
