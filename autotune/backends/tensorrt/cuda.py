"""The few CUDA runtime calls the TensorRT backend makes (buffers, a stream, timing events), through cuda-python.

cuda-python is imported lazily, by ``import_cudart``: ``import autotune.backends.tensorrt`` works without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autotune.backends.base import BackendUnavailable


def import_cudart() -> Any:
    """cuda-python's CUDA runtime module.

    Raises:
        BackendUnavailable: cuda-python is not installed.
    """
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6 had only this layout
        except ImportError as error:
            raise BackendUnavailable(
                f"cuda-python is not installed ({error}); the TensorRT backend moves data and times runs through "
                f"it: `pip install cuda-python` (or `pip install -e .[tensorrt]`)"
            ) from error
    return cudart


class CudaRuntime:
    """The few CUDA runtime calls the backend needs, through cuda-python, with errors raised as exceptions.

    Args:
        cudart: ``cuda.bindings.runtime``.
        device: The device index.

    Raises:
        BackendUnavailable: No CUDA GPU (or no driver) is found.
    """

    def __init__(self, cudart: Any, device: int = 0):
        self.cudart = cudart
        self.device = device
        error, count = cudart.cudaGetDeviceCount()
        if error != cudart.cudaError_t.cudaSuccess or count == 0:
            raise BackendUnavailable(
                f"no CUDA GPU: cudaGetDeviceCount says {self._describe(error)} with {count} devices; "
                f"the TensorRT backend needs an NVIDIA GPU and driver (use backend.name: onnxruntime on CPUs)"
            )
        if device >= count:
            raise BackendUnavailable(f"backend.options.device is {device} but only {count} CUDA devices exist")
        self.check(cudart.cudaSetDevice(device), "cudaSetDevice")

    def _describe(self, error: Any) -> str:
        try:
            name = self.cudart.cudaGetErrorString(error)[1]
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - only used to word an error message
            return str(error)

    def check(self, result: Any, what: str) -> Any:
        """Unwraps cuda-python's ``(error, value...)`` tuples.

        Raises:
            RuntimeError: The call failed.
        """
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self.cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {self._describe(error)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)`` of the device."""
        props = self.check(self.cudart.cudaGetDeviceProperties(self.device), "cudaGetDeviceProperties")
        return int(props.major), int(props.minor)

    def device_name(self) -> str:
        """The device's name."""
        props = self.check(self.cudart.cudaGetDeviceProperties(self.device), "cudaGetDeviceProperties")
        name = props.name
        return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00")

    def malloc(self, nbytes: int) -> int:
        """A device allocation of at least one byte."""
        return int(self.check(self.cudart.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))

    def free(self, pointer: int) -> None:
        """Frees a device allocation."""
        self.check(self.cudart.cudaFree(pointer), "cudaFree")

    def stream(self) -> Any:
        """A new non-default stream (TensorRT adds device syncs on the default stream)."""
        return self.check(self.cudart.cudaStreamCreate(), "cudaStreamCreate")

    def destroy_stream(self, stream: Any) -> None:
        """Destroys a stream."""
        self.check(self.cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def event(self) -> Any:
        """A new CUDA event (timing enabled)."""
        return self.check(self.cudart.cudaEventCreate(), "cudaEventCreate")

    def destroy_event(self, event: Any) -> None:
        """Destroys an event."""
        self.check(self.cudart.cudaEventDestroy(event), "cudaEventDestroy")

    def to_device(self, pointer: int, array: np.ndarray, stream: Any) -> None:
        """Copies a C-contiguous host array to the device, ordered on ``stream``."""
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.check(
            self.cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, kind, stream), "cudaMemcpyAsync"
        )

    def to_host(self, array: np.ndarray, pointer: int, stream: Any) -> None:
        """Copies device memory into a C-contiguous host array, ordered on ``stream``."""
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.check(
            self.cudart.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, kind, stream), "cudaMemcpyAsync"
        )

    def record(self, event: Any, stream: Any) -> None:
        """Records ``event`` on ``stream``."""
        self.check(self.cudart.cudaEventRecord(event, stream), "cudaEventRecord")

    def synchronize(self, stream: Any) -> None:
        """Waits for everything queued on ``stream``."""
        self.check(self.cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events, after waiting for the second."""
        self.check(self.cudart.cudaEventSynchronize(end), "cudaEventSynchronize")
        return float(self.check(self.cudart.cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))
