"""Running a rewritten module: compile, warm-up and CUDA graph capture, runtime flags, staging feeds, timing.

A built plan is a ``TorchArtifact``: the module on the device, what runs it (the module or its ``torch.compile``
wrapper), static input tensors the feeds are copied into, and on CUDA a side stream, a captured graph and the
events that time it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.backends.base import BuildError
from autotune.backends.torch.device import (
    CUDA_GRAPHS_KNOB,
    CUDNN_BENCHMARK_KNOB,
    GEMM_BACKENDS_KNOB,
    MODE_KNOB,
    REDUCE_OVERHEAD,
    TF32_KNOB,
)
from autotune.plan import KnobValue

if TYPE_CHECKING:
    from autotune.model.layers import InputSpec

_RECOMPILE_LIMIT = 4096
"""One process compiles many variants of the same module classes (one per plan); dynamo's default limit of 8
recompiles would make later plans fall back to eager silently."""


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
        module: The rewritten module on the device (what ``export`` saves).
        forward: What runs it: the module, or its ``torch.compile`` wrapper.
        inputs: Static input tensors on the device, in input order; runs copy the feeds into them.
        input_names: The inputs' names.
        device: ``cpu`` or ``cuda``.
        knobs: The backend knobs it was built with.
        choices: Module path -> precision (the modules that differ from the base precision).
        reference: The one-liner reference it is (``TorchBackend.references``), or None for a plan.
        stream: The non-default CUDA stream it runs and is timed on (None on the CPU).
        graph: The captured ``torch.cuda.CUDAGraph``, if any.
        outputs: With a graph: the output tensors it writes.
        staged: The feeds copied in last (``time_run`` copies only other ones).
        events: CUDA start and end events that time a launch (None on the CPU).
        build_stages_s: Seconds per stage of the build, in order: ``rewrite`` (the module rewrite, set by the
            backend), ``to_device``, ``first_call`` (dynamo and inductor compile there), ``warmup`` (the other
            warm-up calls), ``capture`` (the CUDA graph, and its first replay).
    """

    module: Any
    forward: Any
    inputs: list[Any]
    input_names: list[str]
    device: str
    knobs: dict[str, KnobValue]
    choices: dict[str, str] = field(default_factory=dict)
    reference: str | None = None
    stream: Any = None
    graph: Any = None
    outputs: list[Any] = field(default_factory=list)
    staged: Any = None
    events: tuple[Any, Any] | None = None
    build_stages_s: dict[str, float] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        """True on a CUDA device."""
        return self.device.startswith("cuda")

    def launch(self) -> list[Any]:
        """Runs once on the current stream and returns the output tensors."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return flatten_outputs(self.forward(*self.inputs))


def _torch_dtype(dtype: str) -> Any:
    import torch

    return torch.from_numpy(np.zeros(0, dtype=np.dtype(dtype))).dtype


def static_inputs(inputs: Sequence[InputSpec], device: str) -> list[Any]:
    """Input buffers: zeros, ones for integer inputs (valid token ids)."""
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


def compiled(module: Any, knobs: Mapping[str, KnobValue]) -> Any:
    """The callable a mode runs: the module, ``torch.compile`` of it, or max-autotune with the GEMM backends.

    ``reduce-overhead`` (the one-liner references only) is ``torch.compile(module, mode="reduce-overhead")``, as a
    user writes it: inductor captures its own CUDA graphs.
    """
    import torch

    mode = knobs[MODE_KNOB]
    if mode == "eager":
        return module
    _raise_recompile_limit()
    if mode == "compile":
        return torch.compile(module)
    if mode == REDUCE_OVERHEAD:
        return torch.compile(module, mode=REDUCE_OVERHEAD)
    import torch._inductor

    # No CUDA graphs from inductor: the backend captures the whole forward itself when the knob says so.
    options: dict[str, Any] = dict(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))
    options["max_autotune_gemm_backends"] = str(knobs.get(GEMM_BACKENDS_KNOB, "ATEN"))
    return torch.compile(module, options=options)


def check_output_shapes(outputs: Sequence[Any], wanted: Sequence[tuple[int, ...]]) -> None:
    """Checks a module's outputs against its ONNX export's output shapes (``-1``: any size).

    Raises:
        BuildError: Another number of outputs, or another shape.
    """
    shapes = [tuple(t.shape) for t in outputs]
    if wanted and len(shapes) != len(wanted):
        raise BuildError(
            f"the module returns {len(shapes)} outputs, its ONNX export {len(wanted)}: {shapes} against {list(wanted)}"
        )
    for got, shape in zip(shapes, wanted, strict=False):
        if len(got) != len(shape) or any(w >= 0 and g != w for g, w in zip(got, shape, strict=True)):
            raise BuildError(f"the module's outputs have shapes {shapes}, its ONNX export {list(wanted)}")


def _clear_cublas_workspaces() -> None:
    """Frees cuBLAS's cached per-stream workspaces (what inductor's CUDA graph trees do around a recording)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def make_artifact(
    module: Any,
    inputs: Sequence[InputSpec],
    device: str,
    knobs: dict[str, KnobValue],
    output_shapes: Sequence[tuple[int, ...]],
) -> TorchArtifact:
    """Moves a rewritten module to the device, compiles it, warms it up and captures a CUDA graph (per the knobs).

    Raises:
        BuildError: Its outputs do not match the ONNX export's; compile and capture errors propagate as raised.
    """
    import torch

    started = time.perf_counter()
    module = module.to(device).eval()
    stages = {"to_device": time.perf_counter() - started}
    artifact = TorchArtifact(
        module=module,
        forward=compiled(module, knobs),
        inputs=static_inputs(inputs, device),
        input_names=[spec.name for spec in inputs],
        device=device,
        knobs=knobs,
        build_stages_s=stages,
    )
    if not artifact.is_cuda:
        started = time.perf_counter()
        with torch.no_grad():
            check_output_shapes(artifact.launch(), output_shapes)
        stages["first_call"] = time.perf_counter() - started
        return artifact
    stream = _build_stream(artifact)
    with torch.no_grad():
        outputs = _warm_up(artifact, stream, stages)
        check_output_shapes(outputs, output_shapes)
        if knobs[CUDA_GRAPHS_KNOB]:
            _capture_graph(artifact, stream, stages)
    artifact.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    return artifact


def _build_stream(artifact: TorchArtifact) -> Any:
    """Makes the artifact's device current, sets its CUDA flags, and gives it a stream of its own (returned)."""
    import torch

    index = torch.device(artifact.device).index
    if index is not None:  # graph capture and compiled kernels use the current device
        torch.cuda.set_device(index)
    set_runtime_flags(bool(artifact.knobs[TF32_KNOB]), bool(artifact.knobs[CUDNN_BENCHMARK_KNOB]))
    stream = torch.cuda.Stream(device=artifact.device)
    artifact.stream = stream
    stream.wait_stream(torch.cuda.current_stream(artifact.device))
    return stream


def _warm_up(artifact: TorchArtifact, stream: Any, stages: dict[str, float]) -> Sequence[Any]:
    """Three calls on ``stream``, timed into ``stages`` (``first_call``, ``warmup``); the last call's outputs.

    The first call compiles; then the caching allocator and cuDNN settle.
    """
    import torch

    started = time.perf_counter()
    with torch.cuda.stream(stream):
        for call in range(3):
            outputs = artifact.launch()
            if call == 0:
                stream.synchronize()
                stages["first_call"] = time.perf_counter() - started
                started = time.perf_counter()
    stream.synchronize()
    stages["warmup"] = time.perf_counter() - started
    return outputs


def _capture_graph(artifact: TorchArtifact, stream: Any, stages: dict[str, float]) -> None:
    """Captures a CUDA graph of one call into the artifact and replays it once, timed into ``stages["capture"]``."""
    import torch

    started = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    # cuBLAS keeps one workspace per stream, allocated outside any graph by the warm-up. A graph captured with it
    # would point at memory it does not own, and inductor's own CUDA graphs (the reduce-overhead one-liners) free
    # those workspaces before and after each recording: our replays then hit freed memory (an illegal memory
    # access on the H200). Cleared here, the workspace is allocated during capture, in the graph's private pool,
    # which lives as long as the graph.
    _clear_cublas_workspaces()
    with torch.cuda.graph(graph, stream=stream):
        captured = artifact.launch()
    _clear_cublas_workspaces()  # later work on this stream gets a workspace of its own, not the graph's
    artifact.graph, artifact.outputs = graph, captured
    with torch.cuda.stream(stream):
        artifact.launch()  # a replay that fails should fail the build, not the measurement
    stream.synchronize()
    stages["capture"] = time.perf_counter() - started


def apply_flags(artifact: TorchArtifact) -> None:
    """Sets the CUDA flags the artifact was built with.

    The reference and the plan run interleaved in one process: each sets its own flags before it runs.
    """
    if artifact.is_cuda:
        set_runtime_flags(bool(artifact.knobs[TF32_KNOB]), bool(artifact.knobs[CUDNN_BENCHMARK_KNOB]))


def stage(artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> None:
    """Copies the feeds into the static inputs (on the current stream).

    Raises:
        ValueError: A feed's shape or dtype differs from the one a CUDA graph was captured for.
    """
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


def run_once(artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Stages the feeds, launches once, and returns the outputs on the host (floating ones as float32)."""
    import torch

    apply_flags(artifact)
    context = torch.cuda.stream(artifact.stream) if artifact.stream is not None else contextlib.nullcontext()
    with torch.no_grad(), context:
        stage(artifact, feeds)
        outputs = artifact.launch()
        host = [t.detach().cpu() for t in outputs]
    if artifact.stream is not None:
        artifact.stream.synchronize()
    return [(t.float() if t.is_floating_point() else t).numpy() for t in host]


def time_launch(artifact: TorchArtifact, feeds: Mapping[str, np.ndarray]) -> float:
    """Milliseconds of one launch: CUDA events on the artifact's stream, the wall clock on the CPU.

    The feeds are copied in only when they are not the ones staged last, and the copy is not timed.
    """
    return time_back_to_back(artifact, feeds, 1)


def time_back_to_back(artifact: TorchArtifact, feeds: Mapping[str, np.ndarray], launches: int) -> float:
    """Milliseconds per launch of ``launches`` launches back to back: events around them all, divided by their number.

    As ``time_launch``, the feeds are staged outside the timing; on the CPU the wall clock.
    """
    import torch

    apply_flags(artifact)
    with torch.no_grad():
        if artifact.stream is None:
            if feeds is not artifact.staged:
                stage(artifact, feeds)
            start = time.perf_counter()
            for _ in range(launches):
                artifact.launch()
            return (time.perf_counter() - start) * 1e3 / launches
        start_event, end_event = artifact.events
        with torch.cuda.stream(artifact.stream):
            if feeds is not artifact.staged:
                stage(artifact, feeds)
            start_event.record(artifact.stream)
            for _ in range(launches):
                artifact.launch()
            end_event.record(artifact.stream)
        end_event.synchronize()
        return float(start_event.elapsed_time(end_event)) / launches
