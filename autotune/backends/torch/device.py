"""What a device offers the torch backend: probed once per process, read as precisions and knobs.

CUDA is probed in a child process (``probe_isolated``), so that the run's parent process never initialises it;
the CPU is probed in place. ``torch_capabilities`` turns a probe into the backend's ``Capabilities``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.backends.base import BackendUnavailable, owns_devices
from autotune.capabilities import Capabilities, Knob
from autotune.model.optypes import MATMUL_OP_TYPES
from autotune.plan import KnobValue

# Convolutions the backend rewrites: nn.Conv1d/2d/3d. ConvTranspose (in autotune.model.optypes.CONV_OP_TYPES) has no
# wrapper here, so its layers are offered FP32 only.
TORCH_CONV_OP_TYPES = ("Conv",)

MODE_KNOB = "mode"
CUDA_GRAPHS_KNOB = "cuda_graphs"
GEMM_BACKENDS_KNOB = "gemm_backends"
TF32_KNOB = "tf32"
CUDNN_BENCHMARK_KNOB = "cudnn_benchmark"
BASE_PRECISION_KNOB = "base_precision"
ATTENTION_KNOB = "attention"
MODES = ("compile", "eager", "max-autotune")
REDUCE_OVERHEAD = "reduce-overhead"
"""``torch.compile(mode="reduce-overhead")``: inductor's own CUDA graphs. Only the one-liner references
(``TorchBackend.build_reference``) run in it; plans use ``cuda_graphs``, one graph of the whole forward."""
GEMM_BACKENDS = ("ATEN", "ATEN,TRITON", "TRITON")
BASE_PRECISIONS = ("fp32", "fp16", "bf16")
"""What ``base_precision`` may take: the dtype the whole module is converted to (``module.to(dtype)``). TF32 is
no base: it is the ``tf32`` flag, which also reaches FP32 layers inside a lower base."""

FALLBACK_KNOBS: dict[str, KnobValue] = {
    MODE_KNOB: "eager",
    CUDA_GRAPHS_KNOB: False,
    GEMM_BACKENDS_KNOB: "ATEN",
    TF32_KNOB: False,
    CUDNN_BENCHMARK_KNOB: False,
    BASE_PRECISION_KNOB: "fp32",
}
"""Values of the knobs a device does not offer: the CPU runs eager, without CUDA flags, in FP32. A module whose
attention cannot be swapped has no ``attention`` value: it keeps its own."""


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


def base_knobs(floats: tuple[str, ...], attention: tuple[str, ...] = ()) -> list[Knob]:
    """The knobs of the whole module: ``base_precision`` (the float precisions offered) and ``attention``.

    Args:
        floats: The float precisions the device runs (``fp32`` first).
        attention: The attention implementations the module can swap between, its users' default first (SDPA
            where it runs: ``autotune.backends.torch.attention.attention_implementations``); no knob with fewer
            than two.
    """
    knobs = []
    if len(floats) > 1:
        knobs.append(
            Knob(
                BASE_PRECISION_KNOB,
                floats,
                "dtype of the whole module (module.to(dtype)); each layer's own precision overrides it",
                follows_precision=True,
            )
        )
    if len(attention) > 1:
        knobs.append(
            Knob(ATTENTION_KNOB, attention, "attention implementation (transformers' attn_implementation)", free=True)
        )
    return knobs


def torch_capabilities(info: DeviceInfo, attention: tuple[str, ...] = (), convolutions: bool = True) -> Capabilities:
    """Precisions per op type and knobs for a device. Pure.

    Linear layers (MatMul, Gemm) take fp16, bf16 (compute capability >= 8.0 on CUDA), int8 (where
    ``torch._int_mm`` works) and fp8 (compute capability >= 8.9 and ``torch._scaled_mm`` works); Conv layers take
    fp16 and bf16. The knobs' first values are the defaults, which the FP32 reference uses: ``base_precision``
    offers the float precisions above with ``fp32`` first, and ``attention`` (``base_knobs``) the implementations
    in ``attention``, the users' default first. ``attention``, ``cuda_graphs`` and ``cudnn_benchmark`` are free
    (``Knob.free``: their values differ at rounding level only), so a run fixes them after the uniform seeds;
    ``gemm_backends`` is not, although numerically neutral: it acts in max-autotune mode only, which a seed does not
    run, so a seed's timing of it would be noise. Neither is ``cudnn_benchmark`` where the module has no
    convolution (``convolutions`` False): there it changes nothing, and a build to time it would be spent on noise.
    SmoothQuant: smoothed int8/fp8 Linears are lowered as a module rewrite (``smoothing.py``).
    """
    floats = _float_precisions(info)
    linear = list(floats)
    if "int8" in info.ops:
        linear.append("int8")
    if info.fp8_scaling is not None and (not info.is_cuda or (info.capability or (0, 0)) >= (8, 9)):
        linear.append("fp8")
    precisions = {op: tuple(linear) for op in MATMUL_OP_TYPES} | {op: tuple(floats) for op in TORCH_CONV_OP_TYPES}
    if not info.is_cuda:
        # Inductor on the CPU needs a C++ toolchain and says nothing about the GPU: the CPU runs eager, for tests.
        knob = Knob(MODE_KNOB, ("eager",), "execution mode: eager only on the CPU")
        return Capabilities(precisions, (knob, *base_knobs(floats, attention)))
    knobs = [*_cuda_knobs(info, convolutions), *base_knobs(floats, attention)]
    return Capabilities(precisions, tuple(knobs))


def _float_precisions(info: DeviceInfo) -> tuple[str, ...]:
    """The float precisions the device runs, ``fp32`` first: fp16, and bf16 from compute capability 8.0 on CUDA."""
    floats = ["fp32"]
    if "fp16" in info.ops:
        floats.append("fp16")
    if "bf16" in info.ops and (not info.is_cuda or (info.capability or (0, 0)) >= (8, 0)):
        floats.append("bf16")
    return tuple(floats)


def _cuda_knobs(info: DeviceInfo, convolutions: bool) -> list[Knob]:
    """The execution knobs of a CUDA device (see :func:`torch_capabilities` for which are free)."""
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
            free=True,
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
    if (info.capability or (0, 0)) >= (8, 0):  # TF32 units exist from Ampere on; elsewhere the flag changes nothing
        knobs.append(Knob(TF32_KNOB, (False, True), "FP32 matmuls and convolutions on TF32 tensor cores"))
    knobs.append(
        Knob(
            CUDNN_BENCHMARK_KNOB,
            (True, False),
            "cuDNN times its convolution algorithms and keeps the best",
            free=convolutions,
        )
    )
    return knobs


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

    from autotune.backends.torch.wrappers import wrappers

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
    modules = wrappers()
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
    "from autotune.backends.torch.device import probe_here\n"
    "print(json.dumps(probe_here(sys.argv[1]).to_dict()))\n"
)


def probe_isolated(device: str, timeout_s: float = 600.0) -> DeviceInfo:
    """Probes ``device`` in a child process, so that this process never initialises CUDA.

    The run's parent process asks for capabilities to build the search space; CUDA belongs to the trial process.

    Raises:
        BackendUnavailable: The probe crashed or hung.
    """
    root = str(Path(__file__).resolve().parents[3])  # the repository: autotune/backends/torch/device.py
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
def probe_in_background(device: str) -> Future[DeviceInfo]:
    """``probe_device(device)`` in a thread, started once per process and device; its future.

    The probe of a CUDA device waits seconds on its child process; the caller goes on meanwhile. A probe done here
    (the CPU, a trial process) is quick, and runs before this returns.
    """
    if device.startswith("cuda") and not owns_devices():
        return _PROBES.submit(probe_device, device)
    future: Future[DeviceInfo] = Future()
    try:
        future.set_result(probe_device(device))
    except Exception as error:  # noqa: BLE001 - raised where the result is read, as from the thread
        future.set_exception(error)
    return future


_PROBES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotune-probe")


@functools.cache
def probe_device(device: str) -> DeviceInfo:
    """What ``device`` offers, probed once per process.

    CUDA is probed in a child process, except in a trial process (``owns_devices``), which initialises CUDA to
    build anyway: a child there would import torch and start CUDA a second time (4-12 s on the H200 machine).
    """
    if device.startswith("cuda") and not owns_devices():
        return probe_isolated(device)
    return probe_here(device)
