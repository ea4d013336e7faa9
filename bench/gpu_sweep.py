r"""Where FP8 and INT8 GEMMs beat BF16 on a GPU, and the MiniLM GPU evaluator's set-up time, in one device call.

Usage (on the GPU machine, from the repository root, after ``bash bench/device_wheels.sh install``):
    PYTHONPATH=.device/site:. python bench/gpu_sweep.py --out $OUT --minilm-dir .device/minilm --time-limit 500

Stages, in order, each recorded in the results whatever happens to it (an error is a row with its message):

1. ``gemm``: every shape of ``gemm_shapes`` (M = batch x tokens, K, N across 384..4096), each kernel captured in
   a CUDA graph and replayed (no compile): BF16 ``torch.mm``; FP8 ``torch._scaled_mm`` rowwise and tensorwise on
   pre-quantized operands (the GEMM alone) and with the static activation quantization in front (what a layer
   pays when nothing fuses it); INT8 ``torch._int_mm`` alone and with quantization.
2. ``setup``: ``Evaluator(configs/minilm-gpu-b64.yaml)`` from a fresh cache: export, calibration, the layerwise
   calibration (on the GPU: ``TorchBackend.layer_probe``) and the FP32 build; its seconds.
3. ``e2e``: per model and batch (``--models``), the BF16 one-liner (``model.to(torch.bfloat16)`` +
   ``torch.compile(mode="reduce-overhead")``) and each variant of ``--variants``: BF16 base, SDPA attention, every
   Linear in the variant's precision, compiled and captured in one CUDA graph as the torch backend builds plans.
   Static activation scales come from one FP32 forward on the same inputs (max calibration). Timed interleaved in
   rounds in this process (one launch per timing, synchronised), with each variant's cosine to the FP32 output.

Compiles cost 10-120 s each, so ``--time-limit`` bounds the call: a variant whose compile would start after the
limit minus ``--compile-reserve`` is skipped (and says so). Results go to ``sweep.json`` and ``sweep.md`` in
``--out`` after every row, so a killed call keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

GEMM_M = (1024, 8192, 32768)
"""Rows: batch x 128 tokens at batch 8, 64 and 256."""
GEMM_KN = ((384, 384), (384, 1536), (1536, 384), (1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096))
"""(K, N): MiniLM's attention and FFN GEMMs (hidden 384, FFN 1536), BERT-large's (1024, 4096), and a square 4096."""
GEMM_KERNELS = ("bf16", "fp8_rowwise_gemm", "fp8_rowwise_quant", "fp8_tensorwise_gemm", "int8_gemm", "int8_quant")

MODELS = {
    "minilm": "all-MiniLM-L6-v2 (6 layers, hidden 384, FFN 1536), its real weights",
    "bert-large": "autotune.examples.encoder: BERT-large-shaped (hidden 1024, FFN 4096), random weights",
}
DEFAULT_MODELS = ("bert-large:128", "minilm:256", "minilm:64", "minilm:8", "bert-large:32")
VARIANTS = {
    "bf16": "every Linear BF16 (the base precision)",
    "fp8": "our Fp8Linear (torch._scaled_mm, static scale) on every Linear",
    "int8": "our Int8Linear (torch._int_mm, static scale) on every Linear",
    "torchao-fp8-static": "torchao Float8StaticActivationFloat8WeightConfig on every Linear",
    "torchao-int8-static": "torchao Int8StaticActivationInt8WeightConfig on every Linear",
    "torchao-fp8-dynamic": "torchao Float8DynamicActivationFloat8WeightConfig(PerRow) on every Linear",
}
DEFAULT_VARIANTS = ("bf16", "fp8", "torchao-fp8-static", "torchao-int8-static", "int8", "torchao-fp8-dynamic")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--models`` entries are ``NAME:BATCH`` with NAME in ``MODELS``.

    Raises:
        SystemExit: A malformed model entry or an unknown variant or stage (argparse's one-line error).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for sweep.json and sweep.md")
    parser.add_argument("--stages", nargs="+", default=["gemm", "setup", "e2e"], choices=["gemm", "setup", "e2e"])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="NAME:BATCH, e.g. minilm:64")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--minilm-dir", type=Path, help="sets AUTOTUNE_MINILM_DIR (a folder written by minilm pack)")
    parser.add_argument("--setup-config", default="configs/minilm-gpu-b64.yaml", help="config of the setup stage")
    parser.add_argument("--time-limit", type=float, default=500.0, help="seconds after which nothing new starts")
    parser.add_argument("--compile-reserve", type=float, default=60.0, help="seconds a compile is assumed to need")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per model")
    parser.add_argument("--repeats", type=int, default=30, help="timed launches per variant and round")
    parser.add_argument("--gemm-repeats", type=int, default=50, help="timed graph replays per GEMM kernel")
    args = parser.parse_args(argv)
    try:
        args.models = [parse_model(entry) for entry in args.models]
    except ValueError as error:
        parser.error(str(error))
    return args


def parse_model(entry: str) -> tuple[str, int]:
    """``NAME:BATCH`` -> (name, batch).

    Raises:
        ValueError: Not ``NAME:BATCH``, an unknown name, or a batch that is not a positive integer.
    """
    name, _, batch = entry.partition(":")
    if name not in MODELS or not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"--models entry {entry!r} must be NAME:BATCH with NAME in {sorted(MODELS)}, e.g. minilm:64")
    return name, int(batch)


def gemm_shapes(rows: Sequence[int] = GEMM_M, kn: Sequence[tuple[int, int]] = GEMM_KN) -> list[tuple[int, int, int]]:
    """Every (M, K, N) of the GEMM stage, smallest M first."""
    return [(m, k, n) for m in rows for k, n in kn]


class Clock:
    """Seconds since the start, the deadline, and timestamped progress lines."""

    def __init__(self, time_limit: float, compile_reserve: float, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.started = now()
        self.time_limit = time_limit
        self.compile_reserve = compile_reserve

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.now() - self.started

    def can_start(self, needs: float = 0.0) -> bool:
        """Whether work needing ``needs`` seconds ends before the time limit."""
        return self.elapsed() + needs <= self.time_limit

    def log(self, message: str) -> None:
        """One flushed progress line with the wall-clock time and the seconds since the start."""
        print(f"[sweep {time.strftime('%H:%M:%S')} {self.elapsed():7.1f} s] {message}", flush=True)


def new_results(argv: Sequence[str]) -> dict[str, Any]:
    """The results skeleton: date, command, and one list of rows per stage."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python bench/gpu_sweep.py " + " ".join(shlex.quote(a) for a in argv),
        "environment": {},
        "gemm": [],
        "setup": [],
        "e2e": [],
        "errors": [],
    }


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables: GEMMs (speedup over BF16 per kernel), set-up, and end to end."""
    env = results.get("environment", {})
    lines = [
        f"Measured {results.get('date', '?')} on {env.get('device', 'no CUDA device')}, torch {env.get('torch', '?')}, "
        f"CUDA {env.get('cuda', '?')}, torchao {env.get('torchao', '?')}.",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        "## GEMMs: median ms per replay of a CUDA graph; x = BF16 / kernel (> 1: faster than BF16)",
        "",
        "| M | K | N | BF16 ms | " + " | ".join(k for k in GEMM_KERNELS if k != "bf16") + " | error |",
        "|---|---|---|---|" + "---|" * (len(GEMM_KERNELS) - 1) + "---|",
    ]
    for row in results.get("gemm", []):
        ms = row.get("ms", {})
        base = ms.get("bf16")
        cells = [
            "-" if ms.get(k) is None or not base else f"{ms[k]:.4f} ({base / ms[k]:.2f}x)"
            for k in GEMM_KERNELS
            if k != "bf16"
        ]
        error = "; ".join(f"{k}: {v}" for k, v in row.get("errors", {}).items())
        lines.append(f"| {row['m']} | {row['k']} | {row['n']} | {_cell(base, '.4f')} | {' | '.join(cells)} | {error} |")
    lines += ["", "## MiniLM GPU evaluator set-up", "", "| config | status | seconds | error |", "|---|---|---|---|"]
    for row in results.get("setup", []):
        lines.append(
            f"| {row.get('config')} | {row.get('status')} | {_cell(row.get('seconds'), '.1f')} | "
            f"{_first_line(row.get('error'))} |"
        )
    lines += [
        "",
        "## End to end: BF16 base + SDPA, compiled, one CUDA graph; ratio = BF16 one-liner / variant (> 1: faster)",
        "",
        "| model | batch | variant | status | ms (IQR) | one-liner ms | ratio | cosine to FP32 | compile s | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results.get("e2e", []):
        cells = [
            row.get("model"),
            row.get("batch"),
            row.get("variant"),
            row.get("status"),
            f"{_cell(row.get('ms'), '.4f')} ({_cell(row.get('iqr_ms'), '.4f')})",
            _cell(row.get("oneliner_ms"), ".4f"),
            _cell(row.get("ratio"), ".3f"),
            _cell(row.get("cosine"), ".6f"),
            _cell(row.get("compile_s"), ".1f"),
            _first_line(row.get("error") or row.get("note")),
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    for error in results.get("errors", []):
        lines.append(f"\nError in {error.get('stage')}: {_first_line(error.get('error'))}")
    return "\n".join(lines) + "\n"


def _first_line(text: str | None, limit: int = 160) -> str:
    """The last non-empty line of an error (a traceback's message), cut and escaped for a table cell."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return line.replace("|", "\\|")


def write(results: dict[str, Any], out: Path) -> None:
    """Writes ``sweep.json`` and ``sweep.md``, each replaced whole so a kill never leaves half a file."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("sweep.json", json.dumps(results, indent=2, default=str)), ("sweep.md", markdown(results))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """The median and the interquartile range of ``values``."""
    import numpy as np

    q1, med, q3 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return float(med), float(q3 - q1)


# ---- on the GPU ---------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """Device and library versions; what cannot be read is recorded as its error."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    for module in ("torch", "torchao", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001 - reported, not required
            info[module] = f"unavailable ({type(error).__name__})"
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as error:  # noqa: BLE001
        info["torch_error"] = f"{type(error).__name__}: {error}"
    return info


def graph_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (no launch overhead, no compile)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median_iqr(times)[0]


def gemm_kernels(m: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    """The kernels of one shape, each a closure over its own operands on the GPU."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    fp8 = torch.float8_e4m3fn
    x8, w8 = (x / 8).to(fp8), (w * 8).to(fp8)
    one = torch.ones((), device="cuda")
    row_a, col_b = torch.full((m, 1), 0.125, device="cuda"), torch.full((1, n), 0.125, device="cuda")
    xi = torch.randint(-128, 127, (m, k), device="cuda", dtype=torch.int8)
    wi = torch.randint(-128, 127, (n, k), device="cuda", dtype=torch.int8)
    act_scale = torch.tensor(0.05, device="cuda")

    def fp8_rowwise_quant() -> Any:
        q = torch.clamp(x / act_scale, -448.0, 448.0).to(fp8)
        return torch._scaled_mm(q, w8.t(), scale_a=row_a, scale_b=col_b, out_dtype=torch.bfloat16)

    def int8_quant() -> Any:
        q = torch.clamp(torch.round(x / act_scale), -128, 127).to(torch.int8)
        return torch._int_mm(q, wi.t()).to(torch.bfloat16) * act_scale

    return {
        "bf16": lambda: torch.mm(x, w.t()),
        "fp8_rowwise_gemm": lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=row_a, scale_b=col_b, out_dtype=torch.bfloat16
        ),
        "fp8_rowwise_quant": fp8_rowwise_quant,
        "fp8_tensorwise_gemm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "int8_gemm": lambda: torch._int_mm(xi, wi.t()),
        "int8_quant": int8_quant,
    }


def run_gemm(args: argparse.Namespace, results: dict[str, Any], clock: Clock) -> None:
    """Stage 1: every shape, every kernel; a row per shape, written as it completes."""
    import torch

    for m, k, n in gemm_shapes():
        if not clock.can_start():
            results["gemm"].append({"m": m, "k": k, "n": n, "ms": {}, "errors": {"*": "time limit reached"}})
            continue
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "ms": {}, "errors": {}}
        try:
            kernels = gemm_kernels(m, k, n)
        except Exception as error:  # noqa: BLE001 - a shape that cannot be set up is a row with its error
            row["errors"]["*"] = f"{type(error).__name__}: {error}"
            kernels = {}
        for name, fn in kernels.items():
            try:
                row["ms"][name] = graph_ms(fn, args.gemm_repeats)
            except Exception as error:  # noqa: BLE001
                row["errors"][name] = f"{type(error).__name__}: {error}"
        del kernels
        torch.cuda.empty_cache()
        results["gemm"].append(row)
        write(results, args.out)
        base = row["ms"].get("bf16")
        best = min(((v, key) for key, v in row["ms"].items() if key != "bf16"), default=(None, None))
        clock.log(f"gemm {m}x{k}x{n}: bf16 {_cell(base, '.4f')} ms, fastest other {best[1]} {_cell(best[0], '.4f')} ms")


_SETUP_CODE = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO)  # the trial process logs where the set-up's seconds went
from autotune.config import load_config
from autotune.harness import Evaluator
from autotune.store import TrialStore
config = load_config(sys.argv[1], sys.argv[2:])
started = time.perf_counter()
store = TrialStore(config.run_dir / "setup.sqlite")
with Evaluator(config, store):
    seconds = time.perf_counter() - started
store.close()
print(json.dumps({"seconds": seconds}))
"""


def run_setup(args: argparse.Namespace, results: dict[str, Any], clock: Clock) -> None:
    """Stage 2: the evaluator's set-up from an empty cache, in a child process (its own CUDA context)."""
    row: dict[str, Any] = {"config": args.setup_config, "status": "skipped"}
    results["setup"].append(row)
    budget = args.time_limit - clock.elapsed()
    if budget < 30:
        row["error"] = "time limit reached"
        return
    overrides = [f"cache_dir={args.out / 'setup-cache'}", f"runs_dir={args.out / 'setup-runs'}"]
    command = [sys.executable, "-c", _SETUP_CODE, args.setup_config, *overrides]
    clock.log(f"setup: Evaluator({args.setup_config}) from an empty cache (at most {budget:.0f} s)")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget, cwd=ROOT, check=False)
        row["wall_s"] = time.perf_counter() - started
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            row.update(status="ok", seconds=json.loads(lines[-1])["seconds"])
        else:
            row.update(status="error", error=(done.stderr or done.stdout)[-3000:])
        row["log_tail"] = (done.stderr or "")[-3000:]
    except subprocess.TimeoutExpired:
        row.update(status="timeout", error=f"still setting up after {budget:.0f} s", wall_s=budget)
    write(results, args.out)
    clock.log(f"setup: {row['status']} {_cell(row.get('seconds'), '.1f')} s")


def build_model(name: str) -> Any:
    """The FP32 module of ``name`` on the CPU, in eval mode."""
    if name == "minilm":
        from autotune.examples.minilm import build_module

        return build_module().eval()
    from autotune.examples.encoder import build_module  # eager attention; builds switch to SDPA, as for MiniLM

    return build_module().eval()


def model_inputs(name: str, batch: int) -> list[Any]:
    """input_ids and attention_mask of the first held-out batch of the model's example (128 tokens a row).

    MiniLM's are real sentences; the encoder's are random ids of padded lengths, what its config tunes on.
    """
    import torch

    if name == "minilm":
        from autotune.examples.minilm import batches
    else:
        from autotune.examples.encoder import batches
    feeds = batches("holdout", batch_size=batch)[0]
    return [torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])]


def linear_ranges(module: Any, inputs: Sequence[Any]) -> dict[str, tuple[float, float]]:
    """Path -> (-amax, amax) of every ``nn.Linear``'s input in one FP32 forward (max calibration)."""
    import torch
    from torch import nn

    ranges: dict[str, tuple[float, float]] = {}
    handles = []
    for path, child in module.named_modules():
        if isinstance(child, nn.Linear):

            def hook(_: Any, args: Any, path: str = path) -> None:
                amax = float(args[0].detach().abs().max())
                ranges[path] = (-max(amax, ranges.get(path, (0, 0))[1]), max(amax, ranges.get(path, (0, 0))[1]))

            handles.append(child.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def build_variant(module: Any, variant: str, ranges: dict[str, tuple[float, float]], inputs: Sequence[Any]) -> Any:
    """A compiled, CUDA-graph-captured artifact of one variant (``runtime.make_artifact``, as plans build)."""
    from autotune.backends.torch import ModuleChoice, probe_device, rewrite_module
    from autotune.backends.torch.runtime import make_artifact
    from autotune.model import InputSpec

    knobs = {"mode": "compile", "cuda_graphs": True, "tf32": False, "cudnn_benchmark": False, "base_precision": "bf16"}
    specs = [InputSpec(f"in{i}", tuple(t.shape), str(t.dtype).removeprefix("torch.")) for i, t in enumerate(inputs)]
    # torchao's dynamic config quantizes every Linear of the BF16 module itself, below.
    precision = {"torchao-fp8-dynamic": "bf16", "torchao-fp8-static": "fp8", "torchao-int8-static": "int8"}.get(
        variant, variant
    )
    choices = {} if precision == "bf16" else {path: ModuleChoice(precision, span) for path, span in ranges.items()}
    gemm = "torchao" if variant.endswith("-static") else "autotune"
    rewritten = rewrite_module(
        module, choices, True, probe_device("cuda").fp8_scaling, base="bf16", attention="sdpa", quantized_gemm=gemm
    )
    if variant == "torchao-fp8-dynamic":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
        quantize_(rewritten, config)
    artifact = make_artifact(rewritten, specs, "cuda", knobs, [])
    for target, source in zip(artifact.inputs, inputs, strict=True):
        target.copy_(source)
    return artifact


def oneliner(module: Any, inputs: Sequence[Any]) -> Callable[[], Any]:
    """``torch.compile(model.to(torch.bfloat16), mode="reduce-overhead")``, warmed up; returns a call."""
    import copy

    import torch

    compiled = torch.compile(copy.deepcopy(module).to(torch.bfloat16).cuda(), mode="reduce-overhead")
    feeds = [t.cuda() for t in inputs]

    def call() -> Any:
        return compiled(*feeds)

    with torch.no_grad():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    return call


def first_output(out: Any) -> Any:
    """The first tensor of a module's output (the last hidden state of a transformers encoder)."""
    from autotune.backends.torch.runtime import flatten_outputs

    return flatten_outputs(out)[0]


def run_model(args: argparse.Namespace, results: dict[str, Any], clock: Clock, name: str, batch: int) -> None:
    """Stage 3 for one model and batch: build the one-liner and each variant, then time them interleaved."""
    import torch

    rows = {}
    module = build_model(name)
    inputs = model_inputs(name, batch)
    ranges = linear_ranges(module, inputs)
    with torch.no_grad():
        reference = first_output(module.cuda()(*[t.cuda() for t in inputs])).float()
    module.cpu()
    calls: dict[str, Callable[[], Any]] = {}
    for variant in ("oneliner-bf16", *args.variants):
        row = {"model": name, "batch": batch, "variant": variant, "status": "skipped"}
        rows[variant] = row
        results["e2e"].append(row)
        if not clock.can_start(args.compile_reserve):
            row["note"] = f"not built: a compile would end after --time-limit {args.time_limit:.0f} s"
            write(results, args.out)
            continue
        clock.log(f"{name} b{batch} {variant}: compiling")
        started = time.perf_counter()
        try:
            if variant == "oneliner-bf16":
                calls[variant] = oneliner(module, inputs)
            else:
                artifact = build_variant(module, variant, ranges, inputs)
                calls[variant] = artifact.launch  # replays its CUDA graph
            with torch.no_grad():
                out = first_output(calls[variant]()).float()
            row["cosine"] = float(torch.nn.functional.cosine_similarity(out.ravel(), reference.ravel(), dim=0))
            row.update(status="built", compile_s=time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - a variant that fails to build is a row with its error
            row.update(status="error", error=traceback.format_exc()[-3000:], compile_s=time.perf_counter() - started)
            clock.log(f"{name} b{batch} {variant}: {type(error).__name__}: {_first_line(str(error))}")
        write(results, args.out)
    times = interleaved(calls, args.rounds, args.repeats)
    base = median_iqr(times["oneliner-bf16"])[0] if times.get("oneliner-bf16") else None
    for variant, samples in times.items():
        med, iqr = median_iqr(samples)
        rows[variant].update(status="ok", ms=med, iqr_ms=iqr, oneliner_ms=base, ratio=base / med if base else None)
        clock.log(f"{name} b{batch} {variant}: {med:.4f} ms, ratio {_cell(rows[variant]['ratio'], '.3f')}")
    write(results, args.out)


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int, repeats: int) -> dict[str, list[float]]:
    """Per call, ms of single synchronised launches, the calls taking turns round by round."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in calls}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        for _ in range(rounds):
            for name, call in calls.items():
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    start.record()
                    call()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the stages in order within the time limit; writes sweep.json and sweep.md as it goes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clock = Clock(args.time_limit, args.compile_reserve)
    sys.path[:0] = [str(p) for p in (ROOT / ".device" / "site", ROOT) if p.is_dir() and str(p) not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / ".device" / "site"), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    if args.minilm_dir is not None:
        os.environ["AUTOTUNE_MINILM_DIR"] = str(args.minilm_dir.resolve())
    results = new_results(argv)
    results["environment"] = environment()
    write(results, args.out)
    clock.log(f"{results['environment'].get('device', 'no CUDA device')}; stages {args.stages}")
    stages: list[tuple[str, Callable[[], None]]] = []
    if "gemm" in args.stages:
        stages.append(("gemm", lambda: run_gemm(args, results, clock)))
    if "setup" in args.stages:
        stages.append(("setup", lambda: run_setup(args, results, clock)))
    if "e2e" in args.stages:
        for name, batch in args.models:
            stages.append((f"e2e {name}:{batch}", lambda n=name, b=batch: run_model(args, results, clock, n, b)))
    for stage, run in stages:
        if not clock.can_start():
            results["errors"].append({"stage": stage, "error": "not started: time limit reached"})
            continue
        try:
            run()
        except Exception as error:  # noqa: BLE001 - a stage that fails is recorded; the next one runs
            results["errors"].append({"stage": stage, "error": traceback.format_exc()[-3000:]})
            clock.log(f"{stage}: {type(error).__name__}: {_first_line(str(error))}")
        finally:
            try:
                import torch

                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001, S110 - only tidying up
                pass
        write(results, args.out)
    results["wall_s"] = clock.elapsed()
    write(results, args.out)
    clock.log(f"done; wrote {args.out / 'sweep.json'} and sweep.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
