r"""An LSTM speaker encoder on ONNX Runtime CPU: FP32, ``quantize_dynamic`` and our all-INT8 plan, side by side.

Usage:
    python bench/lstm_encoder.py [--out-dir runs/lstm-encoder] [--frames 100] [--hidden 256] [--batch 8] \
        [--samples 64] [--threads 1] [--rounds 5]

Builds a 3-layer LSTM encoder in PyTorch (40 log-mel features x 100 frames, hidden 256, a linear projection of the
last frame's state to a 256-d embedding; random weights, seed 0), exports it to ONNX (the TorchScript exporter,
which writes one ONNX ``LSTM`` per layer) with random samples (``x``, samples first), and runs

    autotune evaluate MODEL.onnx --data SAMPLES.npz --plan int8 --plan ort-dynamic --json

in which every round times FP32 and each plan in turn (``autotune.measure.timing.side_by_side``). ``int8`` is our plan
with every layer INT8 that the backend offers it for (the LSTMs as ``DynamicQuantizeLSTM``, the projection as
an integer MatMul); ``ort-dynamic`` is ONNX Runtime's ``quantize_dynamic`` on the same op types. The metric is the
embeddings' cosine to FP32's (the data has no labels). Prints one line per plan: latency, speedup over FP32 in
the same rounds, the cosine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

FEATURES = 40


def export_encoder(path: Path, frames: int, hidden: int, batch: int) -> None:
    """Writes the 3-layer LSTM encoder (batch-first input ``x`` [batch, frames, 40]) to ``path``."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(FEATURES, hidden, num_layers=3, batch_first=True)
            self.project = torch.nn.Linear(hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            output, _ = self.lstm(x)
            embedding = self.project(output[:, -1])
            return embedding / embedding.norm(dim=1, keepdim=True)

    torch.manual_seed(0)
    encoder = Encoder().eval()
    example = torch.randn(batch, frames, FEATURES)
    torch.onnx.export(encoder, (example,), str(path), input_names=["x"], output_names=["embedding"], dynamo=False)


def write_samples(path: Path, samples: int, frames: int) -> None:
    """Random log-mel-like samples (``x``, samples first), fixed seed."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.standard_normal((samples, frames, FEATURES)).astype(np.float32))


def main() -> int:
    """Exports the encoder and its samples, runs `autotune evaluate` on them, prints the table; its exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lstm-encoder"))
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model, data = args.out_dir / "lstm_encoder.onnx", args.out_dir / "samples.npz"
    export_encoder(model, args.frames, args.hidden, args.batch)
    write_samples(data, args.samples, args.frames)
    command = [
        *(sys.executable, "-m", "autotune", "evaluate", str(model), "--data", str(data)),
        *("--shape", f"x={args.batch}x{args.frames}x{FEATURES}", "--plan", "int8", "--plan", "ort-dynamic", "--json"),
        *("--set", f"runs_dir={args.out_dir / 'runs'}", "--set", f"cache_dir={args.out_dir / 'cache'}"),
        *("--set", f"backend.intra_op_threads={args.threads}", "--set", f"measure.rounds={args.rounds}"),
    ]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 and not done.stdout.strip().startswith("["):
        sys.stderr.write(done.stderr)
        return done.returncode
    results = json.loads(done.stdout)
    print(f"{'plan':<12} {'latency ms':>11} {'FP32 ms':>9} {'speedup':>8} {'cosine':>8}")
    for spec, row in zip(("int8", "ort-dynamic"), results, strict=True):
        cosine = (row.get("fidelity") or {}).get("cosine")
        print(
            f"{spec:<12} {row['latency_ms']:>11.3f} {row['reference_latency_ms']:>9.3f} {row['speedup']:>7.2f}x "
            f"{cosine if cosine is None else round(cosine, 4)!s:>8}  {row['status']}"
        )
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
