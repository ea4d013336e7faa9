"""A built TensorRT engine with its execution context, device buffers, stream and timing events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.backends.tensorrt.cuda import CudaRuntime
from autotune.backends.tensorrt.inspect import PrecisionReport
from autotune.plan import KnobValue


@dataclass
class _Tensor:
    """One engine I/O tensor and its device buffer."""

    name: str
    dtype: np.dtype
    pointer: int = 0
    nbytes: int = 0


@dataclass
class TensorRTEngine:
    """A built engine with its execution context, device buffers, stream and timing events.

    Attributes:
        engine: The ``ICudaEngine``.
        context: Its ``IExecutionContext``.
        plan: The serialized engine (``engine.plan``).
        layer_info: The inspector's JSON for the engine.
        report: Requested versus observed precision of every compute node.
        knobs: The knobs it was built with.
        input_names: Engine inputs.
        output_names: Outputs in the ONNX graph's order.
    """

    engine: Any
    context: Any
    plan: bytes
    layer_info: str
    report: PrecisionReport
    knobs: dict[str, KnobValue]
    cuda: CudaRuntime
    input_names: list[str]
    output_names: list[str]
    tensors: dict[str, _Tensor] = field(default_factory=dict)
    stream: Any = None
    start: Any = None
    end: Any = None

    def _buffer(self, tensor: _Tensor, nbytes: int) -> None:
        if nbytes > tensor.nbytes:  # grow only: shapes are fixed by the config, so this happens once
            if tensor.pointer:
                self.cuda.free(tensor.pointer)
            tensor.pointer, tensor.nbytes = self.cuda.malloc(nbytes), nbytes
            if not self.context.set_tensor_address(tensor.name, tensor.pointer):
                raise RuntimeError(f"TensorRT rejected the device address of {tensor.name!r}")

    def enqueue_inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Sets input shapes and queues the host-to-device copies; returns the host arrays (keep them alive)."""
        hosts = []
        for name in self.input_names:
            if name not in feeds:
                raise KeyError(f"feeds lack engine input {name!r}; they have {sorted(feeds)}")
            tensor = self.tensors[name]
            host = np.ascontiguousarray(feeds[name], dtype=tensor.dtype)
            if not self.context.set_input_shape(name, tuple(host.shape)):
                raise ValueError(f"input {name!r}: shape {host.shape} does not fit the engine's profile")
            self._buffer(tensor, host.nbytes)
            self.cuda.to_device(tensor.pointer, host, self.stream)
            hosts.append(host)
        for name in self.output_names:
            tensor = self.tensors[name]
            shape = tuple(self.context.get_tensor_shape(name))
            self._buffer(tensor, int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize)
        return hosts

    def execute(self) -> None:
        """Queues one inference on the stream."""
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")

    def fetch_outputs(self) -> list[np.ndarray]:
        """Copies the outputs back and waits for the stream."""
        outputs = []
        for name in self.output_names:
            tensor = self.tensors[name]
            host = np.empty(tuple(self.context.get_tensor_shape(name)), dtype=tensor.dtype)
            self.cuda.to_host(host, tensor.pointer, self.stream)
            outputs.append(host)
        self.cuda.synchronize(self.stream)
        return outputs

    def close(self) -> None:
        """Frees device buffers, events and the stream; the engine goes with the last reference."""
        for tensor in self.tensors.values():
            if tensor.pointer:
                self.cuda.free(tensor.pointer)
                tensor.pointer, tensor.nbytes = 0, 0
        for event in (self.start, self.end):
            if event is not None:
                self.cuda.destroy_event(event)
        if self.stream is not None:
            self.cuda.destroy_stream(self.stream)
        self.start = self.end = self.stream = None
        self.context = None  # the context must go before the engine it came from

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down cuda-python already
            pass
