r"""Runs a lowered INT8 graph and its FP32 graph on MiniLM's held-out batches; saves the outputs, or compares with them.

Why: an emulated CPU (``qemu-x86_64 -cpu Haswell``: AVX2, no AVX-512/VNNI) gives ONNX Runtime's kernels for that CPU
but no meaningful speed, so what it can show is whether a graph computes the same numbers there as natively. Run it
natively first (writes OUT.npz), then under qemu with the same arguments (compares with OUT.npz):

    autotune evaluate configs/minilm-cpu.yaml --plan fp32 --plan int8 --split holdout \
        --set 'search.knobs.int8_scheme=[u8u8]'          # its evaluate/<hash>/ folders: model.onnx, session.json
    python bench/research/int8_emulated.py INT8_DIR FP32_DIR OUT.npz --batches 8
    qemu-x86_64 -cpu Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid .venv/bin/python bench/research/int8_emulated.py \
        INT8_DIR FP32_DIR OUT.npz --batches 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def session(folder: Path):
    """The folder's model.onnx with the optimizers its session.json disabled, on two intra-op threads."""
    import onnxruntime as ort

    info = json.loads((folder / "session.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    return ort.InferenceSession(
        str(folder / "model.onnx"),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=info.get("disabled_optimizers", []),
    )


def main() -> None:
    """Runs both graphs on the first batches; writes their outputs, or prints the largest difference per batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("int8_dir", type=Path)
    parser.add_argument("fp32_dir", type=Path)
    parser.add_argument("out", type=Path, help="outputs of the native run (.npz): written if absent, else compared")
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args()
    from autotune.examples.minilm import batches

    feeds = batches("holdout")[: args.batches]
    started = time.perf_counter()
    outputs = {}
    for kind, folder in (("int8", args.int8_dir), ("fp32", args.fp32_dir)):
        graph = session(folder)
        outputs |= {f"{kind}_{i}": graph.run(None, feed)[0] for i, feed in enumerate(feeds)}
    print(f"{len(feeds)} batches in {time.perf_counter() - started:.1f} s")
    if not args.out.exists():
        np.savez(args.out, **outputs)
        print(f"wrote {args.out}")
        return
    native = np.load(args.out)
    for i in range(len(feeds)):
        diffs = {kind: float(np.abs(outputs[f"{kind}_{i}"] - native[f"{kind}_{i}"]).max()) for kind in ("int8", "fp32")}
        print(f"batch {i}: max |here - native| int8 {diffs['int8']:.3g}, fp32 {diffs['fp32']:.3g}")


if __name__ == "__main__":
    main()
