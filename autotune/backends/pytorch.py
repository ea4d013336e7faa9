"""PyTorch on NVIDIA GPUs (eager on the CPU for tests): a plan becomes a module rewrite, compiled and graph-captured.

The ONNX export of the ``model.torch`` factory still gives the layer table and our calibration; this backend maps
each ONNX layer back onto the ``nn.Linear`` or ``nn.Conv*d`` it came from (the TorchScript exporter names nodes
after module paths) and replaces the module by a wrapper running in the chosen precision:

- fp16 / bf16: the layer's weights in that dtype, the input cast in and the output cast back (the ONNX Casts).
- int8 (Linear): symmetric int8 activations with a static scale from our calibration, int8 weights with per-channel
  (or per-tensor) scales, ``torch._int_mm`` with an int32 accumulator, rescaled to float32.
- fp8 (Linear): e4m3 activations with a static scale, per-channel e4m3 weights, ``torch._scaled_mm``.

Static scales matter: dynamic activation quantization (amax per call) made INT8 and FP8 slower than FP16 on an H200.

torch is imported lazily: ``import autotune.backends.pytorch`` does not import it; the wrapper modules are defined
on first use (``Int8Linear`` and friends resolve through the module's ``__getattr__``).
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.base import Backend, BackendUnavailable, BuildError, Capabilities, Knob
from autotune.plan import KnobValue, Plan
from autotune.quant.qparams import (
    FP8_MAX,
    activation_qparams,
    fp8_activation_scale,
    quantize_weight,
    quantize_weight_fp8,
)
from autotune.quant.recipe import TORCH
from autotune.search.space import CALIBRATION_KNOB, GRANULARITY_KNOB

if TYPE_CHECKING:
    from autotune.model import InputSpec, Layer, LoadedModel

log = logging.getLogger(__name__)

OPTIONS = ("device",)
"""Keys of ``backend.options`` for the torch backend."""

NEEDS_FACTORY = (
    "the torch backend needs model.torch: a 'package.module:function' factory; "
    "ONNX-only models run on onnxruntime or tensorrt"
)

LINEAR_OPS = ("MatMul", "Gemm")
CONV_OPS = ("Conv",)

MODE_KNOB = "mode"
CUDA_GRAPHS_KNOB = "cuda_graphs"
GEMM_BACKENDS_KNOB = "gemm_backends"
TF32_KNOB = "tf32"
CUDNN_BENCHMARK_KNOB = "cudnn_benchmark"
MODES = ("compile", "eager", "max-autotune")
GEMM_BACKENDS = ("ATEN", "ATEN,TRITON", "TRITON")

# Values of the knobs a device does not offer: the CPU runs eager, without CUDA flags.
_FALLBACK_KNOBS: dict[str, KnobValue] = {
    MODE_KNOB: "eager",
    CUDA_GRAPHS_KNOB: False,
    GEMM_BACKENDS_KNOB: "ATEN",
    TF32_KNOB: False,
    CUDNN_BENCHMARK_KNOB: False,
}

INT8_PAD_ROWS = 32
"""``torch._int_mm`` on CUDA needs more than 16 rows: 16 rows or fewer are padded with zero rows to this many."""

FP8_ROW_MULTIPLE = 16
"""``torch._scaled_mm`` on CUDA needs a multiple of 16 rows."""

_RECOMPILE_LIMIT = 4096
"""One process compiles many variants of the same module classes (one per plan); dynamo's default limit of 8
recompiles would make later plans fall back to eager silently."""


# ---- the device and what it offers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """What a device offers, probed once per process.

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        torch_version: ``torch.__version__``.
        available: False when CUDA was asked for and there is none.
        capability: CUDA compute capability ``(major, minor)``; None on the CPU.
        name: The GPU's name, for messages.
        ops: What worked on tiny tensors: ``fp16``, ``bf16``, ``int8`` (``torch._int_mm``), ``fp8_rowwise`` and
            ``fp8_tensorwise`` (``torch._scaled_mm`` scalings), ``compile`` (dynamo and Triton), ``gemm_backends``
            (``max_autotune_gemm_backends`` exists).
    """

    device: str
    torch_version: str
    available: bool = True
    capability: tuple[int, int] | None = None
    name: str = ""
    ops: frozenset[str] = frozenset()

    @property
    def is_cuda(self) -> bool:
        """True for a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def fp8_scaling(self) -> str | None:
        """The ``torch._scaled_mm`` scaling FP8 layers use, or None.

        ``rowwise`` (per-channel weight scales inside the GEMM) where it runs, else ``tensorwise`` (the weight
        scales applied to its float32 output).
        """
        for scaling in ("rowwise", "tensorwise"):
            if f"fp8_{scaling}" in self.ops:
                return scaling
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_dict`` reverses it."""
        return {
            "device": self.device,
            "torch_version": self.torch_version,
            "available": self.available,
            "capability": list(self.capability) if self.capability else None,
            "name": self.name,
            "ops": sorted(self.ops),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceInfo:
        """Reads ``to_dict`` output."""
        capability = data.get("capability")
        return cls(
            device=str(data["device"]),
            torch_version=str(data["torch_version"]),
            available=bool(data.get("available", True)),
            capability=(int(capability[0]), int(capability[1])) if capability else None,
            name=str(data.get("name", "")),
            ops=frozenset(data.get("ops", ())),
        )


def torch_capabilities(info: DeviceInfo) -> Capabilities:
    """Precisions per op type and knobs for a device. Pure.

    Linear layers (MatMul, Gemm) take fp16, bf16 (compute capability >= 8.0 on CUDA), int8 (where
    ``torch._int_mm`` works) and fp8 (compute capability >= 8.9 and ``torch._scaled_mm`` works); Conv layers take
    fp16 and bf16. The knobs' first values are the defaults, which the FP32 reference uses.
    """
    cc = info.capability or (0, 0)
    floats = ["fp32"]
    if "fp16" in info.ops:
        floats.append("fp16")
    if "bf16" in info.ops and (not info.is_cuda or cc >= (8, 0)):
        floats.append("bf16")
    linear = list(floats)
    if "int8" in info.ops:
        linear.append("int8")
    if info.fp8_scaling is not None and (not info.is_cuda or cc >= (8, 9)):
        linear.append("fp8")
    precisions = {op: tuple(linear) for op in LINEAR_OPS} | {op: tuple(floats) for op in CONV_OPS}
    if not info.is_cuda:
        # Inductor on the CPU needs a C++ toolchain and says nothing about the GPU: the CPU runs eager, for tests.
        return Capabilities(precisions, (Knob(MODE_KNOB, ("eager",), "execution mode: eager only on the CPU"),))
    compiled = "compile" in info.ops
    knobs = [
        Knob(
            MODE_KNOB,
            MODES if compiled else ("eager",),
            "execution: torch.compile (default mode), eager, or torch.compile max-autotune (slow to build)",
        ),
        Knob(
            CUDA_GRAPHS_KNOB,
            (True, False),
            "capture the whole forward in one CUDA graph, so launch overhead does not hide per-layer savings",
        ),
    ]
    if compiled and "gemm_backends" in info.ops:
        knobs.append(
            Knob(
                GEMM_BACKENDS_KNOB,
                GEMM_BACKENDS,
                "GEMM implementations max-autotune picks from (the tactic sources); ignored in other modes",
            )
        )
    if cc >= (8, 0):  # TF32 units exist from Ampere on; elsewhere the flag changes nothing
        knobs.append(Knob(TF32_KNOB, (False, True), "FP32 matmuls and convolutions on TF32 tensor cores"))
    knobs.append(Knob(CUDNN_BENCHMARK_KNOB, (True, False), "cuDNN times its convolution algorithms and keeps the best"))
    return Capabilities(precisions, tuple(knobs))


def _works(run: Callable[[], Any]) -> bool:
    """True when ``run`` returns finite tensors without raising."""
    import torch

    try:
        out = run()
        return bool(torch.isfinite(out.float()).all())
    except Exception:  # noqa: BLE001 - any failure means the op is not usable here
        return False


def probe_here(device: str) -> DeviceInfo:
    """Probes ``device`` in this process with tiny tensors (initialises CUDA for a CUDA device)."""
    import torch
    from torch import nn

    version = str(torch.__version__)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return DeviceInfo(device, version, available=False)
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return DeviceInfo(device, version, available=False, name=f"{torch.cuda.device_count()} CUDA devices")
        capability = tuple(torch.cuda.get_device_capability(index))
        name = torch.cuda.get_device_name(index)
    else:
        capability, name = None, "cpu"
    modules = _wrappers()
    with torch.random.fork_rng(devices=[]):  # the probe leaves the caller's random stream alone
        torch.manual_seed(0)
        x = torch.randn(32, 32).to(device)
        image = torch.randn(1, 4, 8, 8).to(device)
        linear = nn.Linear(32, 32)
        conv = nn.Conv2d(4, 8, 3)
    ops = set()
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if _works(lambda d=dtype: modules.CastLayer(linear, d).to(device)(x)) and _works(
            lambda d=dtype: modules.CastLayer(conv, d).to(device)(image)
        ):
            ops.add(precision)
    if _works(lambda: modules.Int8Linear.from_linear(linear, 0.05, True).to(device)(x)):
        ops.add("int8")
    if hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm"):
        for scaling in ("rowwise", "tensorwise"):
            if _works(lambda s=scaling: modules.Fp8Linear.from_linear(linear, 0.05, True, s).to(device)(x)):
                ops.add(f"fp8_{scaling}")
    if device.startswith("cuda"):
        import importlib.util

        import torch._dynamo

        supported = getattr(torch._dynamo, "is_dynamo_supported", lambda: True)
        if supported() and importlib.util.find_spec("triton") is not None:
            ops.add("compile")
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "max_autotune_gemm_backends"):
                ops.add("gemm_backends")
    return DeviceInfo(device, version, True, capability, name, frozenset(ops))  # type: ignore[arg-type]


_PROBE_CODE = (
    "import json, sys\n"
    "from autotune.backends.pytorch import probe_here\n"
    "print(json.dumps(probe_here(sys.argv[1]).to_dict()))\n"
)


def probe_isolated(device: str, timeout_s: float = 600.0) -> DeviceInfo:
    """Probes ``device`` in a child process, so that this process never initialises CUDA.

    The run's parent process asks for capabilities to build the search space; CUDA belongs to the trial process.

    Raises:
        BackendUnavailable: The probe crashed or hung.
    """
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, device],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise BackendUnavailable(f"probing {device} with torch took longer than {timeout_s:.0f} s") from error
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise BackendUnavailable(f"probing {device} with torch failed (exit code {done.returncode}): {tail}")
    return DeviceInfo.from_dict(json.loads(lines[-1]))


@functools.cache
def probe_device(device: str) -> DeviceInfo:
    """What ``device`` offers, probed once per process: CUDA in a child process, the CPU here."""
    if device.startswith("cuda"):
        return probe_isolated(device)
    return probe_here(device)


# ---- ONNX layers -> modules ----------------------------------------------------------------------------------


def module_path(layer_name: str) -> str:
    """The module path an ONNX node name of the TorchScript exporter points at. Pure.

    ``/encoder/layer.0/attention/self/query/MatMul`` -> ``encoder.layer.0.attention.self.query``: strip the leading
    ``/``, drop the last part (the op type), join the scopes with ``.``. ``/MatMul`` gives ``""``, the root.
    """
    return ".".join(layer_name.lstrip("/").split("/")[:-1])


def _scope_name(qualified: str) -> str:
    """The scope name the exporter gives a module: its path from the last non-numeric part on."""
    atoms = qualified.split(".")
    for index in range(len(atoms) - 1, -1, -1):
        if not atoms[index].isnumeric():
            return ".".join(atoms[index:])
    return qualified


def _child(parent: str, scope: str, names: Collection[str]) -> str | None:
    prefix = f"{parent}." if parent else ""
    if prefix + scope in names:
        return prefix + scope
    candidates = [n for n in names if n.startswith(prefix) and n != parent and _scope_name(n) == scope]
    return min(candidates, key=len) if candidates else None


def resolve_module_path(layer_name: str, module_names: Collection[str]) -> str | None:
    """The module an ONNX node of the TorchScript exporter belongs to, or None. Pure.

    ``module_path`` is the first guess. The exporter names a scope after the module's path from its last
    non-numeric part (``nn.Sequential`` children become ``net.0``, under scope ``net``), and suffixes ``_1``,
    ``_2`` to a module called again; each scope is matched against ``module_names`` with those rules.

    Args:
        layer_name: The ONNX node name, e.g. ``/net/net.0/Gemm``.
        module_names: The names of ``named_modules()`` (``""`` is the root).
    """
    if not layer_name.startswith("/"):
        return None  # not an exporter name: a hand-written graph
    names = set(module_names)
    guess = module_path(layer_name)
    if guess in names:
        return guess
    current = ""
    for scope in layer_name.lstrip("/").split("/")[:-1]:
        found = _child(current, scope, names)
        base, _, suffix = scope.rpartition("_")
        if found is None and base and suffix.isdigit():
            found = _child(current, base, names)
        if found is None:
            return None
        current = found
    return current


def _bind_one(layer: Layer, modules: Mapping[str, Any], weight_of: Callable[[str], np.ndarray] | None) -> str:
    """The module path of one layer.

    Raises:
        LookupError: The layer cannot be mapped; the message says why.
        ValueError: The module's weights differ from the ONNX model's (a stale or non-deterministic export).
    """
    from torch import nn

    if layer.op_type not in LINEAR_OPS + CONV_OPS:
        raise LookupError(f"{layer.op_type} layers are not rewritten by the torch backend")
    if layer.weight is None:
        raise LookupError("an activation x activation MatMul belongs to no nn.Linear")
    path = resolve_module_path(layer.name, modules)
    if path is None:
        raise LookupError(f"no module at {module_path(layer.name)!r} (export with torch.onnx.export(dynamo=False))")
    module = modules[path]
    linear = layer.op_type in LINEAR_OPS
    wanted = nn.Linear if linear else (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if not isinstance(module, wanted):
        raise LookupError(f"module {path!r} is a {type(module).__name__}, not {'nn.Linear' if linear else 'nn.Conv'}")
    if weight_of is None:
        return path
    onnx_weight = np.asarray(weight_of(layer.weight))
    weight = module.weight.detach().float().cpu().numpy()
    if linear and layer.weight_axis is not None and int(layer.weight_axis) % 2 == 1:
        weight = weight.T  # a MatMul holds W^T: output channels on the last axis
    if onnx_weight.shape != weight.shape:
        raise LookupError(f"module {path!r} has weight shape {list(weight.shape)}, the ONNX layer {onnx_weight.shape}")
    # Conv weights may differ legitimately: the exporter folds a following BatchNorm into them.
    if linear and not np.allclose(onnx_weight, weight, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"the weights of module {path!r} differ from those of ONNX layer {layer.name!r}: the model.torch "
            f"factory must return the same weights every call (seed it, or load a checkpoint), and the cached "
            f"ONNX export is stale if the weights changed (delete it under cache_dir/models)"
        )
    return path


def count_calls(module: Any, inputs: Sequence[InputSpec], paths: Collection[str]) -> dict[str, int]:
    """How often one forward pass (on ``export_torch``'s example inputs, on the CPU) calls each module in ``paths``."""
    import torch

    counts = dict.fromkeys(paths, 0)
    handles = []
    for path in counts:

        def hook(*_: Any, path: str = path) -> None:
            counts[path] += 1

        handles.append(module.get_submodule(path).register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(*_static_inputs(inputs, "cpu"))
    finally:
        for handle in handles:
            handle.remove()
    return counts


def bind_layers(
    module: Any,
    layers: Sequence[Layer],
    searched: Collection[str],
    weight_of: Callable[[str], np.ndarray] | None = None,
    calls: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Maps ONNX layers onto the modules of ``module``.

    Args:
        module: The FP32 ``nn.Module`` the ONNX model was exported from.
        layers: The layer table.
        searched: Layers the search may change: each must map.
        weight_of: ONNX initializer name -> array, to check that the module's weights are the exported ones.
        calls: Module path -> calls per forward pass (``count_calls``). A module called more often than the
            layer table has layers for it does not map: the exporter passes a reused module's weight through an
            Identity on later calls, which are then no tunable layers, and their inputs were never calibrated.

    Returns:
        Layer name -> module path, for every layer that maps.

    Raises:
        ValueError: A searched layer does not map (the message names ``search.exclude_layers``), or the weights
            differ from the ONNX model's.
    """
    modules = dict(module.named_modules())
    bound: dict[str, str] = {}
    problems: dict[str, str] = {}
    for layer in layers:
        try:
            bound[layer.name] = _bind_one(layer, modules, weight_of)
        except LookupError as error:
            if layer.name in searched:
                problems[layer.name] = str(error)
    for path, count in (calls or {}).items():
        names = [name for name, bound_path in bound.items() if bound_path == path]
        if count > len(names):
            for name in names:
                del bound[name]
                if name in searched:
                    problems[name] = (
                        f"module {path!r} runs {count} times per forward pass but only {len(names)} of its calls "
                        f"are tunable ONNX layers, so the other calls have no calibrated range"
                    )
    if problems:
        pattern = "^(?:" + "|".join(re.escape(name) for name in problems) + ")$"
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise ValueError(
            f"the torch backend cannot map {len(problems)} searched layers onto modules: {lines}. "
            f"Keep them in FP32 with search.exclude_layers: {pattern!r}"
        )
    return bound


# ---- precisions per module -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleChoice:
    """What one module runs in.

    Attributes:
        precision: ``fp16``, ``bf16``, ``int8`` or ``fp8``.
        activation_range: Calibrated ``(lo, hi)`` of the module's input (int8 and fp8).
    """

    precision: str
    activation_range: tuple[float, float] | None = None


def activation_scale(lo: float, hi: float, precision: str) -> float:
    """The static activation scale of a calibrated range: symmetric int8 (``amax / 127``) or e4m3 (``amax / 448``)."""
    if precision == "int8":
        return float(activation_qparams(lo, hi, "int8")[0])
    if precision == "fp8":
        return float(fp8_activation_scale(lo, hi))
    raise ValueError(f"{precision} has no activation scale")


def module_choices(
    plan: Plan,
    layers: Sequence[Layer],
    bindings: Mapping[str, str],
    ranges: Mapping[str, tuple[float, float]],
    layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
) -> dict[str, ModuleChoice]:
    """Module path -> what it runs in, for the modules a plan takes out of FP32. Pure.

    A module called from several places (several ONNX layers) needs one precision; its activation range is the
    union of the calls' ranges. ``layer_ranges`` replaces ``ranges`` for the layers it names.

    Raises:
        BuildError: A non-FP32 layer has no module, a shared module gets two precisions, or a range is missing.
    """
    precisions = plan.precision_map
    calls: dict[str, list[Layer]] = {}
    for layer in layers:
        precision = precisions.get(layer.name, "fp32")
        if layer.name not in bindings:
            if precision != "fp32":
                raise BuildError(f"layer {layer.name} has no module to run in {precision}")
            continue
        calls.setdefault(bindings[layer.name], []).append(layer)
    choices = {}
    for path, group in calls.items():
        chosen = {precisions.get(layer.name, "fp32") for layer in group}
        if len(chosen) > 1:
            names = ", ".join(f"{layer.name}={precisions.get(layer.name, 'fp32')}" for layer in group)
            raise BuildError(f"module {path!r} runs several layers that need one precision: {names}")
        precision = chosen.pop()
        if precision == "fp32":
            continue
        span = None
        if precision in ("int8", "fp8"):
            found = []
            for layer in group:
                tensor = layer.activation_inputs[0]
                own = (layer_ranges or {}).get(layer.name, ranges)
                if tensor not in own:
                    raise BuildError(f"no calibrated range for {tensor!r}, the input of {layer.name}")
                found.append(own[tensor])
            span = (min(float(lo) for lo, _ in found), max(float(hi) for _, hi in found))
        choices[path] = ModuleChoice(precision, span)
    return choices


# ---- the wrapper modules -------------------------------------------------------------------------------------

_WRAPPER_NAMES = ("CastLayer", "Int8Linear", "Fp8Linear")


def _define_cast_layer() -> Any:
    """The fp16/bf16 wrapper class."""
    import torch
    from torch import nn

    class CastLayer(nn.Module):
        """A Linear or Conv with weights in fp16/bf16; the input is cast in and the output back to its dtype."""

        def __init__(self, layer: nn.Module, dtype: torch.dtype):
            super().__init__()
            self.layer = copy.deepcopy(layer).to(dtype)
            self.compute_dtype = dtype

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x.to(self.compute_dtype)).to(x.dtype)

        def extra_repr(self) -> str:
            return f"compute_dtype={self.compute_dtype}"

    return CastLayer


def _round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def _define_int8_linear() -> Any:
    """The int8 Linear wrapper class."""
    import torch
    from torch import nn

    class Int8Linear(nn.Module):
        """``y = int_mm(q(x), q(W)^T) * act_scale * w_scale + b`` with a static activation scale.

        Buffers: ``weight_q`` [out, in] int8, ``act_scale`` (0-d), ``weight_scale`` [out] (per-tensor scales are
        repeated), ``out_scale`` = act_scale * weight_scale, ``bias`` [out] float32 or None.
        """

        def __init__(self, in_features: int, out_features: int, bias: bool):
            super().__init__()
            self.in_features = in_features
            self.out_features = out_features
            # cuBLASLt's int8 GEMM wants both feature counts in multiples of 8: zero rows and columns pad the
            # weight (they add nothing to the sums), so every Linear can run in int8.
            self.in_padded, self.out_padded = _round_up(in_features, 8), _round_up(out_features, 8)
            self.register_buffer("weight_q", torch.zeros(self.out_padded, self.in_padded, dtype=torch.int8))
            self.register_buffer("act_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("weight_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("out_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)

        @classmethod
        def from_linear(cls, linear: nn.Linear, act_scale: float, per_channel: bool) -> Int8Linear:
            """Quantizes an ``nn.Linear`` with ``autotune.quant.qparams.quantize_weight`` (axis 0: output channels)."""
            module = cls(linear.in_features, linear.out_features, linear.bias is not None)
            q, scales = quantize_weight(linear.weight.detach().float().cpu().numpy(), 0, per_channel)
            scales = np.broadcast_to(scales, (linear.out_features,)).astype(np.float32)
            out, inp = linear.out_features, linear.in_features
            with torch.no_grad():
                module.weight_q[:out, :inp].copy_(torch.from_numpy(q))
                module.act_scale.fill_(float(np.float32(act_scale)))
                module.weight_scale[:out].copy_(torch.from_numpy(scales))
                module.out_scale[:out].copy_(torch.from_numpy(np.float32(act_scale) * scales))
                if linear.bias is not None:
                    module.bias.copy_(linear.bias.detach().float().cpu())
            return module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features).float()
            rows = flat.shape[0]
            pad_rows = INT8_PAD_ROWS - rows if flat.is_cuda and rows <= 16 else 0
            if pad_rows or self.in_padded != self.in_features:
                flat = torch.nn.functional.pad(flat, (0, self.in_padded - self.in_features, 0, pad_rows))
            # x / scale in float32 and round-half-to-even, as ONNX QuantizeLinear and our fake_quant do
            q = torch.clamp(torch.round(flat / self.act_scale), -128, 127).to(torch.int8)
            y = torch._int_mm(q, self.weight_q.t())[:rows, : self.out_features].float()
            y = y * self.out_scale[: self.out_features]
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, self.out_features).to(x.dtype)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}"

    return Int8Linear


def _define_fp8_linear() -> Any:
    """The fp8 Linear wrapper class."""
    import torch
    from torch import nn

    class Fp8Linear(nn.Module):
        """``y = scaled_mm(q(x), q(W)^T)`` in e4m3 with a static activation scale and per-channel weight scales.

        ``scaling`` is ``rowwise`` (scales inside the GEMM, bfloat16 output as rowwise kernels require) or
        ``tensorwise`` (the activation scale inside, the weight scales on the float32 output).
        """

        def __init__(self, in_features: int, out_features: int, bias: bool, scaling: str = "rowwise"):
            super().__init__()
            if scaling not in ("rowwise", "tensorwise"):
                raise ValueError(f"fp8 scaling must be 'rowwise' or 'tensorwise', not {scaling!r}")
            self.in_features = in_features
            self.out_features = out_features
            self.scaling = scaling
            # _scaled_mm wants feature counts in multiples of 16: zero-padded weights, as in Int8Linear
            self.in_padded, self.out_padded = _round_up(in_features, 16), _round_up(out_features, 16)
            weight = torch.zeros(self.out_padded, self.in_padded, dtype=torch.uint8).view(torch.float8_e4m3fn)
            self.register_buffer("weight_q", weight)
            self.register_buffer("act_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("weight_scale", torch.ones(self.out_padded, dtype=torch.float32))
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)
            self.register_buffer("one", torch.ones((), dtype=torch.float32), persistent=False)

        @classmethod
        def from_linear(cls, linear: nn.Linear, act_scale: float, per_channel: bool, scaling: str) -> Fp8Linear:
            """Quantizes an ``nn.Linear`` with ``autotune.quant.qparams.quantize_weight_fp8`` (axis 0)."""
            module = cls(linear.in_features, linear.out_features, linear.bias is not None, scaling)
            q, scales = quantize_weight_fp8(linear.weight.detach().float().cpu().numpy(), 0, per_channel)
            scales = np.broadcast_to(scales, (linear.out_features,)).astype(np.float32)
            out, inp = linear.out_features, linear.in_features
            with torch.no_grad():
                # ml_dtypes and torch share the e4m3fn bit layout
                module.weight_q[:out, :inp].copy_(
                    torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
                )
                module.act_scale.fill_(float(np.float32(act_scale)))
                module.weight_scale[:out].copy_(torch.from_numpy(scales))
                if linear.bias is not None:
                    module.bias.copy_(linear.bias.detach().float().cpu())
            return module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features).float()
            rows = flat.shape[0]
            pad_rows = -rows % FP8_ROW_MULTIPLE if flat.is_cuda else 0
            if pad_rows or self.in_padded != self.in_features:
                flat = torch.nn.functional.pad(flat, (0, self.in_padded - self.in_features, 0, pad_rows))
            q = torch.clamp(flat / self.act_scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            if self.scaling == "rowwise":
                scale_a = self.act_scale.expand(q.shape[0], 1).contiguous()
                y = torch._scaled_mm(
                    q,
                    self.weight_q.t(),
                    scale_a=scale_a,
                    scale_b=self.weight_scale.view(1, -1),
                    out_dtype=torch.bfloat16,
                )
                y = y[:rows, : self.out_features].float()
            else:
                y = torch._scaled_mm(
                    q, self.weight_q.t(), scale_a=self.act_scale, scale_b=self.one, out_dtype=torch.float32
                )
                y = y[:rows, : self.out_features] * self.weight_scale[: self.out_features]
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, self.out_features).to(x.dtype)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}"

    return Fp8Linear


@functools.cache
def _wrappers() -> Any:
    """Defines the wrapper modules on first use, so that importing this file does not import torch."""
    import types

    namespace = types.SimpleNamespace(
        CastLayer=_define_cast_layer(), Int8Linear=_define_int8_linear(), Fp8Linear=_define_fp8_linear()
    )
    for name in _WRAPPER_NAMES:  # importable by name (pickle, torch.save of whole modules, people)
        cls = getattr(namespace, name)
        cls.__module__, cls.__qualname__ = __name__, name
        globals()[name] = cls
    return namespace


def __getattr__(name: str) -> Any:
    """``Int8Linear``, ``Fp8Linear`` and ``CastLayer`` are defined on first access (they need torch)."""
    if name in _WRAPPER_NAMES:
        return getattr(_wrappers(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _replace(root: Any, path: str, new: Any) -> Any:
    """Puts ``new`` at ``path`` in ``root``; returns the (possibly new) root."""
    if not path:
        return new
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
    return root


def _wrap(module: Any, choice: ModuleChoice, per_channel: bool, fp8_scaling: str | None) -> Any:
    import torch
    from torch import nn

    modules = _wrappers()
    if choice.precision in ("fp16", "bf16"):
        return modules.CastLayer(module, torch.float16 if choice.precision == "fp16" else torch.bfloat16)
    if not isinstance(module, nn.Linear):
        raise BuildError(f"{choice.precision} is for nn.Linear only, not {type(module).__name__}")
    lo, hi = choice.activation_range if choice.activation_range is not None else (0.0, 0.0)
    scale = activation_scale(lo, hi, choice.precision)
    if choice.precision == "int8":
        return modules.Int8Linear.from_linear(module, scale, per_channel)
    if choice.precision == "fp8":
        if fp8_scaling is None:
            raise BuildError("fp8 needs torch._scaled_mm and torch.float8_e4m3fn, which this torch lacks")
        return modules.Fp8Linear.from_linear(module, scale, per_channel, fp8_scaling)
    raise BuildError(f"the torch backend has no precision {choice.precision!r}")


def rewrite_module(
    module: Any,
    choices: Mapping[str, ModuleChoice],
    per_channel: bool = True,
    fp8_scaling: str | None = "rowwise",
) -> Any:
    """A deep copy of ``module`` with each chosen module replaced by its wrapper; ``module`` is left as it was.

    Args:
        module: The FP32 ``nn.Module``.
        choices: Module path -> what it runs in (``module_choices``).
        per_channel: INT8/FP8 weight scales per output channel, else one per tensor.
        fp8_scaling: ``rowwise`` or ``tensorwise`` (``DeviceInfo.fp8_scaling``).

    Raises:
        BuildError: A module cannot take its precision.
    """
    rewritten = copy.deepcopy(module)
    for path, choice in choices.items():
        try:
            target = rewritten.get_submodule(path) if path else rewritten
        except AttributeError as error:
            raise BuildError(f"no module {path!r} to rewrite: {error}") from error
        try:
            rewritten = _replace(rewritten, path, _wrap(target, choice, per_channel, fp8_scaling))
        except BuildError:
            raise
        except Exception as error:  # noqa: BLE001 - a wrapper that fails to build is a failed build
            raise BuildError(f"{path}: {type(error).__name__}: {error}") from error
    return rewritten


# ---- running -------------------------------------------------------------------------------------------------


def flatten_outputs(out: Any) -> list[Any]:
    """A module's outputs as a flat list of tensors, in the order the ONNX exporter flattens them."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if out is None:
        return []
    if isinstance(out, Mapping):
        return [t for value in out.values() for t in flatten_outputs(value)]
    if isinstance(out, (list, tuple)):
        return [t for value in out for t in flatten_outputs(value)]
    if hasattr(out, "to_tuple"):
        return flatten_outputs(out.to_tuple())
    raise TypeError(f"cannot read a {type(out).__name__} as model outputs")


def set_runtime_flags(tf32: bool, cudnn_benchmark: bool) -> None:
    """Sets the process-wide CUDA flags an artifact was built with.

    The legacy TF32 setters keep the legacy and the new (``fp32_precision``) getters consistent: after the new
    setters, reading a legacy flag raises on torch >= 2.9, and dynamo still reads one.
    """
    import torch

    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)


def runtime_flags() -> dict[str, bool]:
    """The process-wide flags ``set_runtime_flags`` sets."""
    import torch

    return {
        "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


@dataclass
class TorchArtifact:
    """A built plan.

    Attributes:
        module: The rewritten module on the device (what ``export_plan`` saves).
        forward: What runs it: the module, or its ``torch.compile`` wrapper.
        inputs: Static input tensors on the device, in input order; runs copy the feeds into them.
        input_names: The inputs' names.
        device: ``cpu`` or ``cuda``.
        knobs: The backend knobs it was built with.
        choices: Module path -> precision.
        stream: The non-default CUDA stream it runs and is timed on (None on the CPU).
        graph: The captured ``torch.cuda.CUDAGraph``, if any.
        outputs: With a graph: the output tensors it writes.
    """

    module: Any
    forward: Any
    inputs: list[Any]
    input_names: list[str]
    device: str
    knobs: dict[str, KnobValue]
    choices: dict[str, str] = field(default_factory=dict)
    stream: Any = None
    graph: Any = None
    outputs: list[Any] = field(default_factory=list)
    staged: Any = None
    events: tuple[Any, Any] | None = None

    def launch(self) -> list[Any]:
        """Runs once on the current stream and returns the output tensors."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return flatten_outputs(self.forward(*self.inputs))


def _torch_dtype(dtype: str) -> Any:
    import torch

    return torch.from_numpy(np.zeros(0, dtype=np.dtype(dtype))).dtype


def _static_inputs(inputs: Sequence[InputSpec], device: str) -> list[Any]:
    """Input buffers like ``export_torch``'s examples: zeros, ones for integer inputs (valid token ids)."""
    import torch

    return [
        torch.full(spec.shape, 1 if "int" in spec.dtype else 0, dtype=_torch_dtype(spec.dtype), device=device)
        for spec in inputs
    ]


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    for names, value in (
        (("recompile_limit", "cache_size_limit"), _RECOMPILE_LIMIT),
        (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 16 * _RECOMPILE_LIMIT),
    ):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None and getattr(config, name) < value:
            setattr(config, name, value)


def _compiled(module: Any, knobs: Mapping[str, KnobValue]) -> Any:
    """The callable a mode runs: the module, ``torch.compile`` of it, or max-autotune with the GEMM backends."""
    import torch

    mode = knobs[MODE_KNOB]
    if mode == "eager":
        return module
    _raise_recompile_limit()
    if mode == "compile":
        return torch.compile(module)
    import torch._inductor

    # No CUDA graphs from inductor: the backend captures the whole forward itself when the knob says so.
    options: dict[str, Any] = dict(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))
    options["max_autotune_gemm_backends"] = str(knobs.get(GEMM_BACKENDS_KNOB, "ATEN"))
    return torch.compile(module, options=options)


# ---- export --------------------------------------------------------------------------------------------------

_REBUILD_SCRIPT = '''"""Rebuilds the tuned PyTorch module saved in this directory.

    python rebuild.py [cuda|cpu]

Needs autotune and the model's factory ({factory}) importable. In Python:

    from autotune.backends.pytorch import load_exported
    module = load_exported("{out_dir}", "cuda")
"""

import sys
from pathlib import Path

from autotune.backends.pytorch import load_exported


def rebuild(device: str = "cuda"):
    """The rewritten module with its quantized weights and static scales, on ``device``, in eval mode."""
    return load_exported(Path(__file__).resolve().parent, device)


if __name__ == "__main__":
    print(rebuild(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
'''


def _write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    tmp = path.with_name(f".tmp-{path.name}")  # same suffix: torch.export.save wants .pt2
    write(tmp)
    tmp.replace(path)  # readers see the old file or the new one, never a torn file
    return path


def load_exported(out_dir: str | Path, device: str = "cpu") -> Any:
    """Rebuilds the module ``export_plan`` wrote: the factory's module, rewritten, with the saved state.

    Args:
        out_dir: The export directory (``manifest.json``, ``module_state.pt``).
        device: Where to put the module.

    Returns:
        The rewritten ``nn.Module`` in eval mode; call it like the factory's module.
    """
    import torch

    from autotune.model import resolve_callable

    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    module = resolve_callable(manifest["factory"])()
    # Placeholder scales: the saved state holds the real ones.
    choices = {
        path: ModuleChoice(precision, (0.0, 1.0) if precision in ("int8", "fp8") else None)
        for path, precision in manifest["modules"].items()
    }
    module = rewrite_module(module, choices, per_channel=True, fp8_scaling=manifest.get("fp8_scaling"))
    state = torch.load(out_dir / "module_state.pt", map_location="cpu", weights_only=True)
    module.load_state_dict(state, strict=True)
    return module.to(device).eval()


# ---- the backend ---------------------------------------------------------------------------------------------


class TorchBackend(Backend):
    """PyTorch modules on an NVIDIA GPU (or eager on the CPU for tests), built straight from plans.

    Args:
        factory: ``model.torch``, the ``package.module:function`` that returns the FP32 module.
        options: ``backend.options``: ``device`` (``cuda`` default, ``cuda:N``, or ``cpu`` for eager CPU runs).

    Raises:
        BackendUnavailable: No factory (an ONNX-only model), or no CUDA device for ``device: cuda``.
        ValueError: An unknown option or a bad device.
    """

    name = "torch"
    recipe = TORCH
    builds_from_plan = True

    def __init__(self, factory: str | None, options: Mapping[str, Any] | None = None):
        if not factory:
            raise BackendUnavailable(NEEDS_FACTORY)
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"backend.options: unknown keys {unknown} for the torch backend; allowed: {list(OPTIONS)}")
        device = str(options.get("device", "cuda"))
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise ValueError(f"backend.options.device must be 'cuda', 'cuda:N' or 'cpu', not {device!r}")
        self.factory = factory
        self.device = device
        self.info = probe_device(device)
        if not self.info.available:
            cpu_build = "+cpu" in self.info.torch_version
            raise BackendUnavailable(
                f"the torch backend found no CUDA device {device!r} (torch {self.info.torch_version}"
                f"{', a CPU-only build' if cpu_build else ''}{'; ' + self.info.name if self.info.name else ''}); "
                f"run it on an NVIDIA GPU, or set backend.options.device: cpu for eager runs on the CPU"
            )
        self._capabilities = torch_capabilities(self.info)
        self._fp32: Any = None
        self._bindings: dict[str, str] = {}
        self._inputs: list[InputSpec] = []
        self._output_shapes: list[tuple[int, ...]] = []

    # -- setup

    def capabilities(self) -> Capabilities:
        """Precisions and knobs of this device and torch (``torch_capabilities``)."""
        return self._capabilities

    def fp32_module(self) -> Any:
        """The factory's module in eval mode on the CPU, made once; builds rewrite deep copies of it."""
        if self._fp32 is None:
            from autotune.model import resolve_callable

            module = resolve_callable(self.factory)()
            self._fp32 = module.eval()
        return self._fp32

    def bind(self, model: LoadedModel, searched: Sequence[str]) -> None:
        """Maps the layer table onto the factory's modules and checks that the weights are the exported ones.

        Raises:
            ValueError: A searched layer has no module (the message names ``search.exclude_layers``), or the
                factory's weights differ from the ONNX export's.
        """
        from autotune.model import weight_array

        self._inputs = list(model.inputs)
        self._output_shapes = [
            tuple(d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim)
            for value in model.proto.graph.output
        ]
        module = self.fp32_module()
        paths = set(bind_layers(module, model.layers, ()).values())
        self._bindings = bind_layers(
            module,
            model.layers,
            set(searched),
            lambda name: weight_array(model.proto, name),
            count_calls(module, self._inputs, paths),
        )

    def knob_values(self, knobs: Mapping[str, KnobValue]) -> dict[str, KnobValue]:
        """Every backend knob's value for a plan's knobs: given, else the default (``_FALLBACK_KNOBS`` if absent).

        Raises:
            BuildError: An unknown knob, or a value the device does not offer.
        """
        offered = {knob.name: knob for knob in self._capabilities.knobs}
        values = dict(_FALLBACK_KNOBS) | {knob.name: knob.default for knob in offered.values()}
        for name, value in knobs.items():
            if name in (CALIBRATION_KNOB, GRANULARITY_KNOB):
                continue
            if name not in offered:
                raise BuildError(
                    f"unknown knob {name!r} for the torch backend on {self.device}; knobs: {sorted(offered)}"
                )
            if not any(type(value) is type(v) and value == v for v in offered[name].values):
                raise BuildError(f"knob {name}={value!r} is not offered; allowed {list(offered[name].values)}")
            values[name] = value
        return values

    # -- build

    def build(self, model: Any, knobs: Mapping[str, KnobValue], workdir: Path | None = None) -> Any:
        """Not used: the torch backend builds plans (``build_plan``)."""
        raise BuildError("the torch backend builds plans, not ONNX models: use build_plan")

    def build_plan(
        self,
        plan: Plan,
        layers: Sequence[Layer],
        ranges: Mapping[str, tuple[float, float]],
        workdir: Path,
        layer_ranges: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
    ) -> TorchArtifact:
        """Rewrites the module, moves it to the device, compiles it, warms it up and captures a CUDA graph.

        Raises:
            BuildError: The plan or the knobs do not fit, or any step failed (the message says which).
        """
        if self._fp32 is None or not self._inputs:
            raise BuildError("the torch backend builds only after bind(model, searched)")
        knobs = self.knob_values(plan.knob_map)
        choices = module_choices(plan, layers, self._bindings, ranges, layer_ranges)
        per_channel = plan.knob(GRANULARITY_KNOB, "per_channel") == "per_channel"
        self._release_memory()
        try:
            module = rewrite_module(self.fp32_module(), choices, per_channel, self.info.fp8_scaling)
            artifact = self._prepare(module, knobs)
        except BuildError:
            raise
        except Exception as error:  # noqa: BLE001 - compile, capture and kernel errors come in many types
            raise BuildError(f"{type(error).__name__}: {error}") from error
        artifact.choices = {path: choice.precision for path, choice in choices.items()}
        return artifact

    def _release_memory(self) -> None:
        """Frees the previous trial's module and graph before the next build allocates its own."""
        gc.collect()
        if self.info.is_cuda:
            import torch

            torch.cuda.empty_cache()

    def _prepare(self, module: Any, knobs: dict[str, KnobValue]) -> TorchArtifact:
        import torch

        module = module.to(self.device).eval()
        inputs = _static_inputs(self._inputs, self.device)
        artifact = TorchArtifact(
            module=module,
            forward=_compiled(module, knobs),
            inputs=inputs,
            input_names=[spec.name for spec in self._inputs],
            device=self.device,
            knobs=knobs,
        )
        if not self.info.is_cuda:
            with torch.no_grad():
                self._check_outputs(artifact.launch())
            return artifact
        index = torch.device(self.device).index
        if index is not None:  # graph capture and compiled kernels use the current device
            torch.cuda.set_device(index)
        set_runtime_flags(bool(knobs[TF32_KNOB]), bool(knobs[CUDNN_BENCHMARK_KNOB]))
        stream = torch.cuda.Stream(device=self.device)
        artifact.stream = stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for _ in range(3):  # the first call compiles; then the caching allocator and cuDNN settle
                    outputs = artifact.launch()
            stream.synchronize()
            self._check_outputs(outputs)
            if knobs[CUDA_GRAPHS_KNOB]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    captured = artifact.launch()
                artifact.graph, artifact.outputs = graph, captured
                with torch.cuda.stream(stream):
                    artifact.launch()  # a replay that fails should fail the build, not the measurement
                stream.synchronize()
        artifact.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        return artifact

    def _check_outputs(self, outputs: list[Any]) -> None:
        shapes = [tuple(t.shape) for t in outputs]
        if self._output_shapes and len(shapes) != len(self._output_shapes):
            raise BuildError(
                f"the module returns {len(shapes)} outputs, its ONNX export {len(self._output_shapes)}: "
                f"{shapes} against {self._output_shapes}"
            )
        for got, wanted in zip(shapes, self._output_shapes, strict=False):
            if len(got) != len(wanted) or any(w >= 0 and g != w for g, w in zip(got, wanted, strict=True)):
                raise BuildError(f"the module's outputs have shapes {shapes}, its ONNX export {self._output_shapes}")

    # -- run

    def _stage(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> None:
        """Copies the feeds into the static inputs (on the current stream)."""
        import torch

        for index, name in enumerate(artifact.input_names):
            array = np.ascontiguousarray(feeds[name])
            source = torch.from_numpy(array)
            target = artifact.inputs[index]
            if tuple(target.shape) == tuple(source.shape) and target.dtype == source.dtype:
                target.copy_(source)
            elif artifact.graph is None:
                artifact.inputs[index] = source.to(artifact.device)
            else:
                raise ValueError(
                    f"input {name!r}: the CUDA graph was captured for {list(target.shape)} {target.dtype}, "
                    f"got {list(source.shape)} {source.dtype}"
                )
        artifact.staged = feeds

    def _flags(self, artifact: TorchArtifact) -> None:
        # The reference and the plan run interleaved in one process: each sets its own flags before it runs.
        if self.info.is_cuda:
            set_runtime_flags(bool(artifact.knobs[TF32_KNOB]), bool(artifact.knobs[CUDNN_BENCHMARK_KNOB]))

    def run(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch; floating outputs come back as float32 numpy arrays, in output order."""
        import contextlib

        import torch

        self._flags(artifact)
        context = torch.cuda.stream(artifact.stream) if artifact.stream is not None else contextlib.nullcontext()
        with torch.no_grad(), context:
            self._stage(artifact, feeds)
            outputs = artifact.launch()
            host = [t.detach().cpu() for t in outputs]
        if artifact.stream is not None:
            artifact.stream.synchronize()
        return [(t.float() if t.is_floating_point() else t).numpy() for t in host]

    def time_run(self, artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> float:
        """Milliseconds of one launch: CUDA events on the artifact's stream, the wall clock on the CPU.

        The feeds are copied in only when they are not the ones staged last, and the copy is not timed.
        """
        import torch

        self._flags(artifact)
        with torch.no_grad():
            if artifact.stream is None:
                if feeds is not artifact.staged:
                    self._stage(artifact, feeds)
                start = time.perf_counter()
                artifact.launch()
                return (time.perf_counter() - start) * 1e3
            start_event, end_event = artifact.events
            with torch.cuda.stream(artifact.stream):
                if feeds is not artifact.staged:
                    self._stage(artifact, feeds)
                start_event.record(artifact.stream)
                artifact.launch()
                end_event.record(artifact.stream)
            end_event.synchronize()
            return float(start_event.elapsed_time(end_event))

    # -- export

    def export_plan(self, artifact: TorchArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes the loadable module and how to rebuild it; returns the paths, ``module_state.pt`` first.

        Files: ``module_state.pt`` (the rewritten module's state dict), ``rebuild.py``, ``manifest.json`` (factory,
        inputs, precision per module, knobs), ``plan.json``, and ``exported.pt2`` from ``torch.export`` where it
        works (else ``export_notes.txt`` says why not).
        """
        import torch

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().cpu() for name, tensor in artifact.module.state_dict().items()}
        files = [_write_atomic(out_dir / "module_state.pt", lambda tmp: torch.save(state, tmp))]
        script = _REBUILD_SCRIPT.format(factory=self.factory, out_dir=out_dir)
        files.append(_write_atomic(out_dir / "rebuild.py", lambda tmp: tmp.write_text(script)))
        manifest = {
            "factory": self.factory,
            "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in self._inputs],
            "modules": artifact.choices,
            "fp8_scaling": self.info.fp8_scaling,
            "knobs": artifact.knobs,
            "plan_hash": plan.hash,
            "torch_version": self.info.torch_version,
            "device": self.info.to_dict(),
        }
        files.append(
            _write_atomic(out_dir / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=2)))
        )
        files.append(_write_atomic(out_dir / "plan.json", lambda tmp: tmp.write_text(plan.to_json(indent=2))))
        exported, notes = out_dir / "exported.pt2", out_dir / "export_notes.txt"
        try:
            with torch.no_grad():
                program = torch.export.export(artifact.module, tuple(artifact.inputs))
            files.append(_write_atomic(exported, lambda tmp: torch.export.save(program, str(tmp))))
            notes.unlink(missing_ok=True)
        except Exception as error:  # noqa: BLE001 - torch.export fails in many ways; the state dict still loads
            log.info("torch.export failed: %s", error)
            exported.unlink(missing_ok=True)
            text = f"torch.export.export failed, so there is no exported.pt2; rebuild.py still works.\n{error}\n"
            files.append(_write_atomic(notes, lambda tmp: tmp.write_text(text)))
        return files
