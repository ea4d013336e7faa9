"""Backends build and run engines behind one contract (``base.Backend``); each imports its runtime lazily."""

from __future__ import annotations

from autotune.backends.base import Backend, BackendUnavailable, BuildError, GraphArtifact, GraphBackend
from autotune.capabilities import Capabilities, Knob
from autotune.config.schema import BackendConfig, ModelConfig

_AUTO = "backend 'auto' is a runtime chosen when a run starts (autotune tune, evaluate); name one to use it here"


def backend_class(name: str) -> type[Backend]:
    """The class of the backend a config names, for what it says of itself before one is made.

    Its runtime is not imported.

    Raises:
        BackendUnavailable: No backend has that name.
    """
    if name == "onnxruntime":
        from autotune.backends.onnxruntime import OnnxRuntimeCPU

        return OnnxRuntimeCPU
    if name == "openvino":
        from autotune.backends.openvino import OpenVINOCPU

        return OpenVINOCPU
    if name == "tensorrt":
        from autotune.backends.tensorrt import TensorRTBackend

        return TensorRTBackend
    if name == "torch":
        from autotune.backends.torch import TorchBackend

        return TorchBackend
    if name == "auto":
        raise BackendUnavailable(_AUTO)
    raise BackendUnavailable(f"backend {name!r} is not available in this version of autotune")


def get_backend(
    config: BackendConfig,
    model: ModelConfig | None = None,
    accuracy_budget: float | None = None,
    metric: str = "cosine",
) -> Backend:
    """The backend a config names, with its typed options (``config.BACKEND_OPTIONS``).

    Args:
        config: The ``backend`` section.
        model: The ``model`` section; the torch backend builds from its ``torch`` factory.
        accuracy_budget: The run's budget; OpenVINO's accuracy-control reference quantizes within it.
        metric: The run's metric name; OpenVINO's accuracy-control reference judges by it.

    Raises:
        BackendUnavailable: Its runtime is not installed (the message says how to install it), or the torch
            backend has no PyTorch model or no CUDA device.
        MissingExtra: The ``openvino`` extra is not installed (one line naming it).
    """
    if any(name != config.name for name in getattr(config.options, "reference_runtimes", ())):
        return _with_other_references(config, model, accuracy_budget, metric)
    if config.name == "onnxruntime":
        from autotune.backends.onnxruntime import OnnxRuntimeCPU

        return OnnxRuntimeCPU(intra_op_threads=config.intra_op_threads)
    if config.name == "openvino":
        from autotune.backends.openvino import OpenVINOCPU

        return OpenVINOCPU(config.intra_op_threads, accuracy_budget, metric)
    if config.name == "tensorrt":
        from autotune.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(options=config.options)
    if config.name == "torch":
        from autotune.backends.torch import TorchBackend

        return TorchBackend(model.torch if model is not None else None, options=config.options)
    if config.name == "auto":
        raise BackendUnavailable(_AUTO)
    raise BackendUnavailable(f"backend {config.name!r} is not available in this version of autotune")


def _with_other_references(
    config: BackendConfig, model: ModelConfig | None, accuracy_budget: float | None, metric: str
) -> Backend:
    """The backend a config names, whose one-liners include those of ``options.reference_runtimes``."""
    from autotune.backends.other_references import WithOtherReferences

    def alone(name: str) -> Backend:
        return get_backend(
            config.model_copy(update={"name": name, "options": type(config.options)()}), model, accuracy_budget, metric
        )

    others = [alone(name) for name in config.options.reference_runtimes if name != config.name]
    return WithOtherReferences(alone(config.name), others)  # type: ignore[return-value] - the run's, delegating


def searching_references(name: str) -> tuple[str, ...]:
    """``Backend.searching_references`` of the backend named ``name``, without loading its runtime."""
    if name == "openvino":
        from autotune.backends.openvino import OpenVINOCPU

        return OpenVINOCPU.searching_references
    return ()


__all__ = [
    "Backend",
    "BackendUnavailable",
    "BuildError",
    "Capabilities",
    "GraphArtifact",
    "GraphBackend",
    "Knob",
    "backend_class",
    "get_backend",
    "searching_references",
]
