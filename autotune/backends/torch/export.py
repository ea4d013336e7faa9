"""The deployable files of a tuned module, and ``load_exported`` that rebuilds the module from them."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.torch.device import ATTENTION_KNOB, BASE_PRECISION_KNOB, DeviceInfo
from autotune.backends.torch.modules import ModuleChoice, ModuleSmoothing, rewrite_module
from autotune.backends.torch.runtime import TorchArtifact, apply_flags, make_artifact
from autotune.backends.torch.smoothing import smoothed_paths
from autotune.backends.torch.torchao_linear import TORCHAO, WRAPPERS
from autotune.plan import Plan
from autotune.run.files import atomic_write

if TYPE_CHECKING:
    from autotune.model.layers import InputSpec

log = logging.getLogger(__name__)

REBUILD_SCRIPT = '''"""Rebuilds the tuned PyTorch module saved in this directory.

    python rebuild.py [cuda|cpu]

Needs autotune and the model's factory ({factory}) importable. In Python:

    from autotune.backends.torch import load_exported
    module = load_exported("{out_dir}", "cuda")
"""

import sys
from pathlib import Path

from autotune.backends.torch import load_exported


def rebuild(device: str = "cuda"):
    """The rewritten module with its quantized weights and static scales, on ``device``, in eval mode."""
    return load_exported(Path(__file__).resolve().parent, device)


if __name__ == "__main__":
    print(rebuild(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
'''
"""``rebuild.py`` of an export; ``{factory}`` and ``{out_dir}`` are filled in."""


def write_export(
    artifact: TorchArtifact,
    plan: Plan,
    out_dir: Path,
    factory: str,
    inputs: Sequence[InputSpec],
    info: DeviceInfo,
    quantized_gemm: str = WRAPPERS,
) -> list[Path]:
    """Writes the loadable module and how to rebuild it; returns the paths, ``module_state.pt`` first.

    Files: ``module_state.pt`` (the rewritten module's state dict), ``rebuild.py``, ``manifest.json`` (factory,
    inputs, base precision, attention, precision per module that differs from the base, knobs, and the one-liner
    reference it is, if one), ``plan.json``, and ``exported.pt2`` from ``torch.export`` where it works (else
    ``export_notes.txt`` says why not).

    Args:
        artifact: The built plan.
        plan: The plan it was built from.
        out_dir: Where the files go (created).
        factory: ``model.torch``, which ``load_exported`` calls for the FP32 module.
        inputs: The model's inputs.
        info: The device it was built for.
        quantized_gemm: What its INT8 and FP8 modules run (``TorchOptions.quantized_gemm``).
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu() for name, tensor in artifact.module.state_dict().items()}
    files = [atomic_write(out_dir / "module_state.pt", lambda tmp: torch.save(state, tmp))]
    files.append(atomic_write(out_dir / "rebuild.py", REBUILD_SCRIPT.format(factory=factory, out_dir=out_dir)))
    manifest = {
        "factory": factory,
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in inputs],
        "base_precision": artifact.knobs.get(BASE_PRECISION_KNOB, "fp32"),
        "attention": artifact.knobs.get(ATTENTION_KNOB),
        "modules": artifact.choices,
        "reference": artifact.reference,
        "fp8_scaling": info.fp8_scaling,
        "quantized_gemm": quantized_gemm,
        "smoothed": smoothed_paths(artifact.module),
        "knobs": artifact.knobs,
        "plan_hash": plan.hash,
        "torch_version": info.torch_version,
        "device": info.to_dict(),
    }
    files.append(atomic_write(out_dir / "manifest.json", json.dumps(manifest, indent=2)))
    files.append(atomic_write(out_dir / "plan.json", plan.to_json(indent=2)))
    files.append(_write_exported_program(artifact, out_dir))
    return files


def _write_exported_program(artifact: TorchArtifact, out_dir: Path) -> Path:
    """Writes ``exported.pt2`` from ``torch.export``, or where that fails ``export_notes.txt`` saying why.

    Returns:
        The file written; the other one is removed, so a stale one from an earlier export does not mislead.
    """
    import torch

    exported, notes = out_dir / "exported.pt2", out_dir / "export_notes.txt"
    try:
        with torch.no_grad():
            program = torch.export.export(artifact.module, tuple(artifact.inputs))
        # torch.export.save checks the suffix: atomic_write's temporary path keeps .pt2
        written = atomic_write(exported, lambda tmp: torch.export.save(program, str(tmp)))
        notes.unlink(missing_ok=True)
        return written
    except Exception as error:  # noqa: BLE001 - torch.export fails in many ways; the state dict still loads
        log.info("torch.export failed: %s", error)
        exported.unlink(missing_ok=True)
        text = f"torch.export.export failed, so there is no exported.pt2; rebuild.py still works.\n{error}\n"
        return atomic_write(notes, text)


def load_exported(out_dir: str | Path, device: str = "cpu") -> Any:
    """Rebuilds the module ``TorchBackend.export`` wrote: the factory's module, rewritten, with the saved state.

    Args:
        out_dir: The export directory (``manifest.json``, ``module_state.pt``).
        device: Where to put the module.

    Returns:
        The rewritten ``nn.Module`` in eval mode; call it like the factory's module (with a base precision other
        than FP32 it is a ``PrecisionBoundary``: floating outputs still come back as float32). It is not compiled:
        wrap it in ``torch.compile`` and a CUDA graph as the build did (``manifest.json`` has the knobs).
    """
    import torch

    from autotune.model.layers import resolve_callable

    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    module = resolve_callable(manifest["factory"])()
    # Placeholder scales: the saved state holds the real ones.
    choices = {
        path: ModuleChoice(precision, (0.0, 1.0) if precision in ("int8", "fp8") else None)
        for path, precision in manifest["modules"].items()
    }
    attention = manifest.get("attention")
    quantized_gemm = manifest.get("quantized_gemm", WRAPPERS)
    smoothed = manifest.get("smoothed", {})  # exports older than smoothing have none
    module = rewrite_module(
        module,
        choices,
        per_channel=True,
        fp8_scaling=manifest.get("fp8_scaling"),
        base=manifest.get("base_precision", "fp32"),  # exports older than the knob ran in FP32
        attention=None if attention is None else str(attention),
        quantized_gemm=quantized_gemm,
        # Placeholder factors: the saved state holds the inverses and the smoothed and folded weights.
        smoothing=ModuleSmoothing({path: np.ones(width, np.float32) for path, width in smoothed.items()}),
    )
    if quantized_gemm == TORCHAO:
        # torchao's quantized weights are tensor subclasses (torchao registers them as safe globals, so
        # weights_only loading takes them), put in place of the placeholders (assign), as torchao's own
        # serialization does.
        state = torch.load(out_dir / "module_state.pt", map_location="cpu", weights_only=True)
        module.load_state_dict(state, strict=True, assign=True)
    else:
        state = torch.load(out_dir / "module_state.pt", map_location="cpu", weights_only=True)
        module.load_state_dict(state, strict=True)
    return module.to(device).eval()


class LoadedEngine:
    """An exported plan compiled, warmed up and captured as the run built it: call it with the model's inputs.

    ``load_engine`` makes it. A call copies the inputs into the engine's static input tensors, runs the module
    once and returns the outputs on the device, ordered on the caller's current stream (a later kernel or
    ``.cpu()`` sees them finished). Where the build captured a CUDA graph, the call is the copies and one replay
    on the caller's stream; the outputs are then the graph's own tensors, which the next call overwrites: clone
    what you keep.

    Attributes:
        artifact: The built module (``autotune.backends.torch.runtime.TorchArtifact``).
    """

    def __init__(self, artifact: Any):
        self.artifact = artifact

    @property
    def input_names(self) -> list[str]:
        """The inputs in order; a call takes them by position or by name."""
        return list(self.artifact.input_names)

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """Runs once: the output tensor, or a list of them where the model has several.

        With a CUDA graph, the inputs are copied in and the graph replayed on the caller's current stream, and
        nothing else runs on the host: what the trial timed (one replay) plus the copies. Without one, the module
        runs on the engine's stream with the build's flags, and the caller's stream waits for it.

        Raises:
            TypeError: An input is missing or unknown.
            ValueError: An input's shape differs from the one the engine was built for.
        """
        import torch

        artifact = self.artifact
        names = artifact.input_names
        if named or len(inputs) != len(names):
            feeds = dict(zip(names, inputs, strict=False)) | named
            if len(inputs) > len(names) or set(feeds) != set(names):
                raise TypeError(f"the engine takes {list(names)}, got {len(inputs)} positional and {sorted(named)}")
            inputs = tuple(feeds[name] for name in names)
        values = [value if isinstance(value, torch.Tensor) else torch.as_tensor(value) for value in inputs]
        for name, value, target in zip(names, values, artifact.inputs, strict=True):
            if value.shape != target.shape:
                raise ValueError(f"input {name!r}: built for {list(target.shape)}, got {list(value.shape)}")
        artifact.staged = None  # the backend's timer must stage its own feeds again
        if artifact.graph is not None:  # the captured kernels need no flags, no grad mode and no stream of ours
            for value, target in zip(values, artifact.inputs, strict=True):
                target.copy_(value, non_blocking=True)
            artifact.graph.replay()
            outputs = artifact.outputs
        else:
            outputs = self._run_module(values)
        return outputs[0] if len(outputs) == 1 else list(outputs)

    def _run_module(self, values: list[Any]) -> list[Any]:
        """Runs the module (no CUDA graph) on the engine's stream with the build's flags."""
        import contextlib

        import torch

        artifact = self.artifact
        apply_flags(artifact)
        stream = artifact.stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(artifact.device))  # inputs written by the caller's stream
        with torch.no_grad(), context:
            for value, target in zip(values, artifact.inputs, strict=True):
                target.copy_(value, non_blocking=True)
            outputs = artifact.launch()
        if stream is not None:
            torch.cuda.current_stream(artifact.device).wait_stream(stream)
        return outputs


def load_engine(out_dir: str | Path, device: str | None = None) -> LoadedEngine:
    """The exported plan as the run measured it: ``load_exported``, then compiled and captured with its knobs.

    The knobs are the manifest's (``mode``, ``cuda_graphs``, ``tf32``, ``cudnn_benchmark``, ...), and the build
    is the backend's own (``runtime.make_artifact``): the same ``torch.compile`` call, warm-up and CUDA graph
    capture, on a stream of its own, as the trial that was timed.

    Args:
        out_dir: The export directory (``manifest.json``, ``module_state.pt``).
        device: Where to run; default the device the run built for (``manifest.json``'s ``device``).

    Raises:
        BuildError: The rebuilt module's compile or capture failed.
    """
    from autotune.model.layers import InputSpec

    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    device = device or str(manifest.get("device", {}).get("device", "cpu"))
    module = load_exported(out_dir, "cpu")
    inputs = [InputSpec(spec["name"], tuple(spec["shape"]), spec["dtype"]) for spec in manifest["inputs"]]
    knobs = dict(manifest["knobs"])
    if not device.startswith("cuda"):  # the CPU runs eager, as every CPU build
        knobs["mode"] = "eager"
    return LoadedEngine(make_artifact(module, inputs, device, knobs, []))
