"""Whether each FP8 Linear's input quantization runs inside its producer's kernel under torch.compile (CUDA).

For the producers of the encoder's Linears (a LayerNorm before q/k/v and the FFN up-projection, a GELU before the
down-projection), with and without a SmoothQuant ``SmoothedInput``, with torchao's static FP8 and the backend's
own ``Fp8Linear``: the block is rewritten as a build rewrites it (``rewrite_module``, BF16 base), compiled, and one
call profiled; the CUDA kernels it launched are listed in order. Inductor names a fused kernel after the ops in it
(``triton_..._fused_..._native_layer_norm_...``), so the quantization is fused where the kernel that computes the
producer also holds the cast (``_to_copy``/``clamp``) and no other elementwise kernel runs before the GEMM.

    python bench/fp8_fusion.py --out OUT [--tokens 16384] [--gemm torchao autotune] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def block(producer: str, hidden: int, ffn: int):
    """An FP32 block whose ``up`` reads a LayerNorm (``layernorm``) or whose ``down`` reads a GELU (``gelu``)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, ffn)
            self.down = nn.Linear(ffn, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if producer == "layernorm":
                return self.up(self.norm(x))
            return self.down(nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    return Block().eval()


def kernels(producer: str, gemm: str, smoothed: bool, tokens: int, device: str = "cuda") -> list[str]:
    """The kernels of one compiled call of the block with its FP8 Linear.

    On CUDA the kernels launched, in order (the profiler's names); on the CPU the fused C++ kernels inductor wrote
    (``cpp_fused_<ops>``), which show the same fusion decisions at the graph level.
    """
    import re

    import torch
    from torch._inductor.utils import run_and_get_code

    from autotune.backends.torch.modules import ModuleChoice, ModuleSmoothing, rewrite_module

    hidden, ffn = 1024, 4096
    path = "up" if producer == "layernorm" else "down"
    width = hidden if path == "up" else ffn
    choices = {path: ModuleChoice("fp8", (-8.0, 8.0))}
    smoothing = None
    if smoothed:
        factors = np.exp(np.random.default_rng(0).uniform(-1, 1, width)).astype(np.float32)
        smoothing = ModuleSmoothing({path: factors})  # no finder: the SmoothedInput multiply, not a fold
    module = rewrite_module(
        block(producer, hidden, ffn),
        choices,
        fp8_scaling="rowwise" if device == "cuda" else "tensorwise",
        base="bf16",
        quantized_gemm=gemm,
        smoothing=smoothing,
    ).to(device)
    compiled = torch.compile(module)
    x = torch.randn(tokens, hidden, device=device)
    if device == "cpu":
        with torch.no_grad():
            _, code = run_and_get_code(compiled, x)
        return sorted(set(re.findall(r"cpp_fused_\w+", "\n".join(code))))
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(x)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]


def main() -> int:
    """Every producer x GEMM x smoothing variant; the kernels to stdout and ``OUT/fp8_fusion.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gemm", nargs="+", default=["torchao", "autotune"], help="quantized_gemm values to list")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for producer in ("layernorm", "gelu"):
        for gemm in args.gemm:
            for smoothed in (False, True):
                try:
                    names = kernels(producer, gemm, smoothed, args.tokens, args.device)
                except Exception as error:  # noqa: BLE001 - a variant that fails is a row, not the end
                    names = [f"error: {type(error).__name__}: {str(error)[:300]}"]
                rows.append({"producer": producer, "gemm": gemm, "smoothed": smoothed, "kernels": names})
                print(f"{producer:9} {gemm:8} smoothed={smoothed!s:5} {len(names)} kernels:", flush=True)
                for name in names:
                    print(f"    {name[:150]}", flush=True)
    (args.out / "fp8_fusion.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
