"""ONNX Runtime on the CPU: the embedded default backend."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from autotune.backends.base import BuildError, GraphBackend
from autotune.capabilities import Capabilities, Knob
from autotune.optypes import TUNABLE_OP_TYPES
from autotune.plan import KnobValue
from autotune.quant.recipe import ORT_X86

if TYPE_CHECKING:
    from autotune.model import LoadedModel

_LEVELS = ("all", "extended", "basic")


class OnnxRuntimeCPU(GraphBackend):
    """ONNX Runtime with the CPU execution provider.

    FP16 is not offered: x86 CPUs without avx512_fp16 run it as FP32 with extra Casts.
    INT8 uses uint8 activations and int8 per-channel weights, the only recipe that is fast on x86.

    Args:
        intra_op_threads: Threads per session, fixed by the deployment.
    """

    name = "onnxruntime"
    recipe = ORT_X86

    def __init__(self, intra_op_threads: int = 2):
        import onnxruntime  # noqa: F401 - fail at construction if missing

        self.intra_op_threads = intra_op_threads

    def capabilities(self) -> Capabilities:
        """INT8 for weight layers; optimization level and spinning as knobs."""
        int8 = ("fp32", "int8")
        return Capabilities(
            precisions={op: int8 for op in TUNABLE_OP_TYPES},
            knobs=(
                Knob(
                    "graph_optimization_level", _LEVELS, "ORT graph optimizations; INT8 needs >= extended to fuse Q/DQ"
                ),
                Knob("allow_spinning", (True, False), "intra-op threads spin while waiting for work"),
            ),
        )

    def _session_options(self, knobs: Mapping[str, KnobValue]) -> Any:
        import onnxruntime as ort

        level = str(knobs.get("graph_optimization_level", "all"))
        if level not in _LEVELS:
            raise BuildError(f"graph_optimization_level {level!r} is not one of {_LEVELS}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        }[level]
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if knobs.get("allow_spinning", True) else "0"
        )
        options.log_severity_level = 3
        return options

    def _session(
        self, model: onnx.ModelProto, knobs: Mapping[str, KnobValue], optimized_path: str | None = None
    ) -> Any:
        import onnxruntime as ort

        options = self._session_options(knobs)
        if optimized_path is not None:
            options.optimized_model_filepath = optimized_path
        # ORT 1.32's MatMulAddFusion (basic level) turns DQ -> MatMul -> Add into DQ -> float Gemm before the
        # QDQ fusions run, so INT8 MatMuls never become MatMulIntegerToFloat and run slower than FP32.
        quantized = any(node.op_type == "DequantizeLinear" for node in model.graph.node)
        return ort.InferenceSession(
            model.SerializeToString(),
            options,
            providers=["CPUExecutionProvider"],
            disabled_optimizers=["MatMulAddFusion"] if quantized else [],
        )

    def build_graph(self, graph: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path | None = None) -> Any:
        """Creates an inference session (the ORT "engine").

        Raises:
            BuildError: ORT rejected the model.
        """
        try:
            return self._session(graph, knobs)
        except Exception as error:  # noqa: BLE001 - ORT raises its own exception types for a bad graph
            raise BuildError(f"ONNX Runtime could not create a session: {error}") from error

    def optimized_model(self, model: onnx.ModelProto, knobs: Mapping[str, KnobValue]) -> onnx.ModelProto:
        """The graph ORT actually runs for these knobs (after its fusions), to check which kernels a plan gets."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "optimized.onnx")
            self._session(model, knobs, path)
            return onnx.load(path)

    def run_engine(self, engine: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch on a session."""
        return engine.run(None, dict(feeds))

    def profile(self, model: LoadedModel, feeds: Mapping[str, np.ndarray]) -> dict[str, float] | None:
        """Per-layer shares of FP32 runtime from ORT's profiler.

        Profiled with graph optimizations off, where every node keeps its name: fusions (even at the basic level,
        MatMul+Add becomes Gemm) would attribute a layer's time to a fused node with another name.

        Raises:
            BuildError: ORT cannot create a session for the model or run it (an operator it lacks, bad shapes).
        """
        import onnxruntime as ort

        options = self._session_options({})
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_profiling = True
        with tempfile.TemporaryDirectory() as tmp:
            options.profile_file_prefix = os.path.join(tmp, "profile")
            try:
                session = ort.InferenceSession(
                    model.proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
                )
                for _ in range(5):
                    session.run(None, dict(feeds))
            except Exception as error:  # noqa: BLE001 - ORT raises its own exception types for a bad graph
                raise BuildError(f"ONNX Runtime could not run the model: {error}") from error
            events = json.loads(Path(session.end_profiling()).read_text())
        per_node: dict[str, float] = {}
        for event in events:
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                node = event["name"][: -len("_kernel_time")]
                per_node[node] = per_node.get(node, 0.0) + float(event.get("dur", 0))
        total = sum(per_node.values())
        if total <= 0:
            return None
        return {name: per_node.get(name, 0.0) / total for name in model.layer_names}
