"""ONNX Runtime on the CPU: the embedded default backend."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from autotune.backends.base import BuildError, GraphArtifact, GraphBackend
from autotune.backends.int8_kernels import (
    SchemeVerdict,
    choose_recipe,
    dynamic_verdicts,
    dynamic_weight_max,
    exact_candidates,
    isa_features,
    scheme_name,
    scheme_verdicts,
)
from autotune.capabilities import Capabilities, Knob
from autotune.model.optypes import TUNABLE_OP_TYPES
from autotune.plan import INT8_SCHEME_KNOB, KnobValue, Plan
from autotune.quant.dynamic import DYNAMIC, DYNAMIC_OP_TYPES
from autotune.quant.recipe import ORT_X86, QuantRecipe
from autotune.run.files import write_json

if TYPE_CHECKING:
    from autotune.model.layers import LoadedModel

_LEVELS = ("all", "extended", "basic")

REFERENCES = ("ort-static", "ort-dynamic")
"""ONNX Runtime's one-liners: ``quantize_static`` (QDQ, calibrated) and ``quantize_dynamic`` (weights only)."""


DISABLED_FOR_QDQ = ("MatMulAddFusion", "WeightBiasQuantization")
"""ONNX Runtime's graph optimizers that undo a plan, turned off for Q/DQ graphs (and named in an export's
``session.json``, since a session of the exported model needs them off too).

- ``MatMulAddFusion`` (basic level, ORT 1.32) turns DQ -> MatMul -> Add into DQ -> float Gemm before the QDQ
  fusions run, so INT8 MatMuls never become MatMulIntegerToFloat and run slower than FP32.
- ``WeightBiasQuantization`` (basic level) quantizes the float weight of any Conv/Gemm whose input comes from a
  DequantizeLinear to per-tensor INT8: an FP32 layer that reads an INT8 neighbour's output becomes an INT8 layer
  with per-tensor weights. On EfficientNet-Lite0, all-INT8 but the first depthwise conv then lost 0.12 of cosine
  instead of 0.013.
"""


SKIP_LAYER_NORM_KNOB = "skip_layer_norm_fusion"
"""The knob that keeps (True, ONNX Runtime's default) or turns off its ``SkipLayerNormFusion``, which fuses a residual
Add (and a bias Add) with the LayerNormalization after it into one ``SkipLayerNormalization`` kernel. That kernel ran
slower than the ops it replaces on an AMX Xeon, in FP32 and more so beside INT8 MatMuls
(docs/method.md#measurements-behind-the-codes-choices), so a run measures both on its FP32 seed, as free knobs are."""


def disabled_optimizers(knobs: Mapping[str, KnobValue], quantized: bool) -> list[str]:
    """ONNX Runtime's graph optimizers a session of a plan turns off.

    ``DISABLED_FOR_QDQ`` for a Q/DQ graph, and ``SkipLayerNormFusion`` where the plan's ``skip_layer_norm_fusion`` is
    False.
    """
    disabled = list(DISABLED_FOR_QDQ) if quantized else []
    if not knobs.get(SKIP_LAYER_NORM_KNOB, True):
        disabled.append("SkipLayerNormFusion")
    return disabled


def spinning_entries(knobs: Mapping[str, KnobValue]) -> dict[str, str]:
    """The session config entries of the ``allow_spinning`` knob.

    With spinning allowed, the intra-op threads spin between the parallel sections of a run (the knob's gain), and
    ``session.force_spinning_stop`` stops them the moment the run returns. Without it they spin on after the run:
    in the interleaved timing loop the FP32 reference's threads then take cores from the candidate being timed
    (and the other way round), and the demo CNN's latencies read one of two values far apart
    (docs/method.md#measurements-behind-the-codes-choices). A deployed session alone keeps the gain within its runs.
    """
    if not knobs.get("allow_spinning", True):
        return {"session.intra_op.allow_spinning": "0"}
    return {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}


INT8_SCHEMES = exact_candidates(ORT_X86)
"""The INT8 schemes the lowering may use, best first (``int8_kernels.exact_candidates``): int8 weights where the
CPU's U8S8 kernels compute them exactly (VNNI, AMX); else uint8 weights on the same 8-bit grid (U8U8 kernels, exact
on AVX2: the same numbers); else 7-bit int8 weights (the U8S8 kernels, whose pairs then fit int16)."""


# INT8_SCHEME_KNOB (in autotune.plan, where the search's accuracy knobs read it) picks a plan's INT8 scheme among
# those this CPU computes exactly (INT8_SCHEMES order, the first exact one the default). Where several are exact
# they differ in speed, not in what they compute correctly: u8s8 and u8u8 give the same numbers on different
# kernels, u8s7 halves the weight resolution. Where u8s8 saturates and more than one is exact (AVX2) the search
# offers the knob by default and times each scheme on the fastest all-INT8 seed (``Knob.seeded``); elsewhere a
# config may still name it.


def _probe_session(model: onnx.ModelProto) -> Any:
    """A one-thread session with every graph optimization and the optimizers of DISABLED_FOR_QDQ off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(DISABLED_FOR_QDQ),
    )


def int8_verdicts(
    session: Callable[[onnx.ModelProto], Any] | None = None, schemes: Sequence[QuantRecipe] = INT8_SCHEMES
) -> dict[str, SchemeVerdict]:
    """Whether each scheme computes exactly in this process's ONNX Runtime, by scheme name.

    Probed once per process and scheme (``autotune.backends.int8_kernels``): well under a second on a normal CPU.

    Args:
        session: Makes a session of a model with the options builds use; None: :func:`_probe_session`.
        schemes: The recipes to probe.
    """
    import onnxruntime as ort

    return scheme_verdicts(schemes, session or _probe_session, cache_key=(ort.__version__, isa_features()))


def int8_recipe(session: Callable[[onnx.ModelProto], Any] | None = None, base: QuantRecipe = ORT_X86) -> QuantRecipe:
    """``base`` where this CPU's ONNX Runtime kernels compute it exactly, else its first exact fallback.

    The fallbacks are ``int8_kernels.exact_candidates``: uint8 weights, then 7-bit weights.

    Raises:
        RuntimeError: None computes exactly (``choose_recipe``).
    """
    schemes = exact_candidates(base)
    verdicts: dict[str, SchemeVerdict] = {}
    for recipe in schemes:  # the first exact one ends the probe: on a VNNI CPU only int8 weights are probed
        verdicts.update(int8_verdicts(session, (recipe,)))
        if verdicts[scheme_name(recipe)].exact:
            return recipe
    return choose_recipe(schemes, verdicts)  # raises, naming every verdict


FP32_ONLY_OP_TYPES: tuple[str, ...] = ("GRU",)
"""Tunable op types this backend runs only in FP32: ONNX Runtime has no quantized GRU kernel (an LSTM's INT8 form is
``DynamicQuantizeLSTM``, ``autotune.quant.recurrent``), so a GRU layer is in the table but not in the search."""


class OnnxRuntimeCPU(GraphBackend):
    """ONNX Runtime with the CPU execution provider.

    FP16 is not offered: x86 CPUs without avx512_fp16 run it as FP32 with extra Casts.
    INT8 uses uint8 activations and int8 per-channel weights, the only recipe that is fast on x86, with 8-bit
    weights where this CPU's kernels compute them exactly, uint8 (or 7-bit) ones where they saturate (``recipe``);
    the ``int8_scheme`` knob picks another exact scheme for a plan (``recipe_for``).

    Args:
        intra_op_threads: Threads per session, fixed by the deployment.
    """

    name = "onnxruntime"
    profiles = True

    def __init__(self, intra_op_threads: int = 2):
        import onnxruntime  # noqa: F401 - fail at construction if missing

        self.intra_op_threads = intra_op_threads
        self._recipe: QuantRecipe | None = None

    @property
    def recipe(self) -> QuantRecipe:  # type: ignore[override] - the base declares an attribute
        """The INT8 scheme of this CPU: probed (once per process) on sessions built as every plan's is."""
        if self._recipe is None:
            self._recipe = self._with_dynamic(int8_recipe(lambda model: self._session(model, {}), INT8_SCHEMES[0]))
        return self._recipe

    def int8_verdicts(self) -> dict[str, SchemeVerdict]:
        """The probe's verdict per INT8 scheme (see :func:`int8_verdicts`), on this backend's sessions."""
        return int8_verdicts(lambda model: self._session(model, {}))

    def dynamic_verdicts(self) -> dict[str, SchemeVerdict]:
        """The probe's verdicts of the ``int8-dynamic`` form with 8 and 7-bit weights, on this backend's sessions."""
        import onnxruntime as ort

        return dynamic_verdicts(lambda model: self._session(model, {}), cache_key=(ort.__version__, isa_features()))

    def _with_dynamic(self, recipe: QuantRecipe) -> QuantRecipe:
        """``recipe`` with the weight range of the exact ``int8-dynamic`` form (8 bits where exact, else 7)."""
        return dataclasses.replace(recipe, dynamic_weight_max=dynamic_weight_max(self.dynamic_verdicts()) or 64)

    def int8_schemes(self) -> dict[str, QuantRecipe]:
        """The INT8 schemes this CPU's kernels compute exactly, by name, in ``INT8_SCHEMES`` order.

        The first is ``recipe``, the default of the ``int8_scheme`` knob; a saturating scheme is never among them.
        """
        verdicts = self.int8_verdicts()
        return {scheme_name(r): self._with_dynamic(r) for r in INT8_SCHEMES if verdicts[scheme_name(r)].exact}

    def recipe_for(self, plan: Plan) -> QuantRecipe:
        """The scheme the plan's ``int8_scheme`` knob names; ``recipe`` (the first exact one) where it names none.

        Raises:
            BuildError: The knob names a scheme that does not compute exactly on this CPU (a plan from another
                machine's run).
        """
        name = plan.knob(INT8_SCHEME_KNOB)
        if name is None:
            return self.recipe
        exact = self.int8_schemes()
        if name not in exact:
            raise BuildError(
                f"{INT8_SCHEME_KNOB}={name!r} does not compute exactly on this CPU; exact here: {list(exact)}"
            )
        return exact[name]

    def int8_arithmetic(self) -> dict[str, Any]:
        """The default scheme here, its weight range, the exact schemes, the CPU's INT8 ISA and the probe's verdicts."""
        recipe = self.recipe
        return {
            "scheme": scheme_name(recipe),
            "weight_range": [-recipe.weight_max, recipe.weight_max],
            "exact": list(self.int8_schemes()),
            "isa": list(isa_features()),
            "verdicts": {name: verdict.describe() for name, verdict in self.int8_verdicts().items()},
            "dynamic": {name: verdict.describe() for name, verdict in self.dynamic_verdicts().items()},
        }

    def capabilities(self) -> Capabilities:
        """INT8 (and ``int8-dynamic`` for MatMul/Gemm) for weight layers; optimization level, spinning, INT8 scheme.

        ``int8_scheme`` offers the schemes the probe found exact on this CPU, the default (today's choice) first;
        the saturating ones are ``unavailable``, so a config that asks for one is refused with the verdict. Where
        u8s8 saturates and more than one scheme is exact (AVX2: u8u8's exact but slower kernels against u8s7's fast
        ones with 7-bit weights) the knob is searched by default (``seeded``: each scheme is timed on the fastest
        all-INT8 seed, and the planner weighs a frame per scheme); elsewhere only where a config names it.
        ``int8-dynamic`` is offered where its probe finds a weight range that computes exactly.

        Raises:
            RuntimeError: No INT8 scheme computes exactly here (the message names every verdict).
        """
        default = scheme_name(self.recipe)  # raises where no scheme is exact
        exact = self.int8_schemes()
        saturating = tuple(
            (name, verdict.describe().split(": ", 1)[1])
            for name, verdict in self.int8_verdicts().items()
            if not verdict.exact
        )
        dynamic = dynamic_weight_max(self.dynamic_verdicts()) is not None
        precisions = {
            op: ("fp32", "int8", DYNAMIC) if dynamic and op in DYNAMIC_OP_TYPES else ("fp32", "int8")
            for op in TUNABLE_OP_TYPES
            if op not in FP32_ONLY_OP_TYPES
        }
        return Capabilities(
            precisions=precisions,
            knobs=(
                Knob(
                    "graph_optimization_level", _LEVELS, "ORT graph optimizations; INT8 needs >= extended to fuse Q/DQ"
                ),
                Knob("allow_spinning", (True, False), "intra-op threads spin while waiting for work"),
                Knob(
                    SKIP_LAYER_NORM_KNOB,
                    (True, False),
                    "fuse each residual Add and LayerNormalization into ORT's SkipLayerNormalization kernel",
                    free=True,  # the same sums and normalization in either form: rounding-level differences
                    # Sqrt: a LayerNorm spelt out in primitive ops (exports below opset 17), which ORT fuses first
                    needs_ops=("LayerNormalization", "Sqrt"),
                ),
                Knob(
                    INT8_SCHEME_KNOB,
                    (default, *(name for name in exact if name != default)),
                    "INT8 activation/weight types and weight range, among those this CPU computes exactly",
                    unavailable=saturating,
                    # Nothing to measure where u8s8 is exact (VNNI, AMX): its kernels are the fast ones and its numbers
                    # the 8-bit ones; nor where one scheme is. There plans keep their hashes unless a config names it.
                    opt_in=default == "u8s8" or len(exact) < 2,
                    seeded=True,
                ),
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
        for key, value in spinning_entries(knobs).items():
            options.add_session_config_entry(key, value)
        options.log_severity_level = 3
        return options

    def _session(
        self, model: onnx.ModelProto, knobs: Mapping[str, KnobValue], optimized_path: str | None = None
    ) -> Any:
        import onnxruntime as ort

        options = self._session_options(knobs)
        if optimized_path is not None:
            options.optimized_model_filepath = optimized_path
        quantized = any(node.op_type == "DequantizeLinear" for node in model.graph.node)
        return ort.InferenceSession(
            model.SerializeToString(),
            options,
            providers=["CPUExecutionProvider"],
            disabled_optimizers=disabled_optimizers(knobs, quantized),
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

    def export(self, artifact: GraphArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes ``model.onnx`` and ``session.json``: the session options the plan was measured with.

        Load the model with those options (``graph_optimization_level``, ``disabled_optimizers`` and the threads),
        or ONNX Runtime's own optimizers may run a different graph from the one measured (``DISABLED_FOR_QDQ``).
        """
        files = super().export(artifact, plan, out_dir)
        knobs = plan.knob_map if plan is not None else {}
        quantized = any(node.op_type == "DequantizeLinear" for node in artifact.graph.graph.node)
        scheme = {}
        if quantized and plan is not None and plan.reference is None:  # a one-liner quantizes by its own scheme
            recipe = self.recipe_for(plan)
            scheme = {
                INT8_SCHEME_KNOB: scheme_name(recipe),
                "int8_weight_range": [-recipe.weight_max, recipe.weight_max],
            }
        if plan is not None and plan.layers_in(DYNAMIC):
            weight_max = self.recipe_for(plan).dynamic_weight_max
            scheme["int8_dynamic_weight_range"] = [-weight_max, weight_max]
        session = {
            "providers": ["CPUExecutionProvider"],
            "graph_optimization_level": str(knobs.get("graph_optimization_level", "all")),
            "intra_op_num_threads": self.intra_op_threads,
            **spinning_entries(knobs),
            "disabled_optimizers": disabled_optimizers(knobs, quantized),
            **scheme,
            "usage": "onnxruntime.InferenceSession('model.onnx', options, providers=..., "
            "disabled_optimizers=...) with options.graph_optimization_level and intra_op_num_threads as above",
        }
        files.append(write_json(out_dir / "session.json", session))
        return files

    def references(self) -> tuple[str, ...]:
        """``ort-static`` and ``ort-dynamic``: ONNX Runtime's ``quantize_static`` and ``quantize_dynamic``."""
        return REFERENCES

    def build_reference(
        self, name: str, calibration: Sequence[Mapping[str, np.ndarray]], workdir: Path
    ) -> GraphArtifact:
        """The session of ONNX Runtime's one-liner ``name`` on the prepared model (see ``reference_graph``).

        The session has the options every plan's has (``intra_op_threads``, all graph optimizations, and
        MatMulAddFusion off for quantized graphs, which keeps DQ -> MatMul on the integer kernels), so the
        comparison is between quantizations, not sessions.

        Raises:
            BuildError: ``name`` is not ``ort-static`` or ``ort-dynamic``, the quantizer failed, or ORT rejected
                what it wrote.
        """
        if name not in REFERENCES:
            return super().build_reference(name, calibration, workdir)
        graph = self.reference_graph(name, calibration)
        return GraphArtifact(graph, self.build_graph(graph, {}, workdir))

    def reference_graph(self, name: str, calibration: Sequence[Mapping[str, np.ndarray]]) -> onnx.ModelProto:
        """The model as ONNX Runtime's one-liner ``name`` quantizes it, restricted to the searched op types.

        ``ort-static`` is ``quantize_static`` as its own docstring advises for x86 (:func:`_quantize_static`),
        ``ort-dynamic`` is ``quantize_dynamic`` (:func:`_quantize_dynamic`).

        Raises:
            BuildError: The model has no searched layer (the one-liner would quantize every op type), or the
                quantizer failed.
        """
        searched = set(self.searched)
        op_types = sorted({layer.op_type for layer in self.model.layers if layer.name in searched})
        if not op_types:
            raise BuildError(f"{name}: no layer is searched, so there is no op type to quantize")
        with tempfile.TemporaryDirectory() as tmp, _quiet_quantizer():
            source, out = os.path.join(tmp, "model.onnx"), os.path.join(tmp, f"{name}.onnx")
            onnx.save(self.model.proto, source)
            try:
                if name == "ort-static":
                    _quantize_static(source, out, op_types, calibration)
                else:
                    _quantize_dynamic(source, out, op_types)
                return onnx.load(out)
            except Exception as error:  # noqa: BLE001 - the quantizer raises anything; a failed one-liner is data
                quantizer = "quantize_static" if name == "ort-static" else "quantize_dynamic"
                message = f"{name}: ONNX Runtime's {quantizer} failed: {type(error).__name__}: {error}"
                raise BuildError(message) from error

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


class _DropQuantizerAdvice(logging.Filter):
    """Drops the quantizer's warnings (advice to pre-process, to exclude a node): the one-liner runs as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Keeps ORT's quantizer quiet below errors while it runs: our user did not call it.

    It advises its caller through the root logger (to pre-process, to exclude a node) and reports progress
    through its own loggers.
    """
    advice = _DropQuantizerAdvice()
    ort_logger = logging.getLogger("onnxruntime")
    level = ort_logger.level
    logging.getLogger().addFilter(advice)
    ort_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(advice)
        ort_logger.setLevel(level)


def _quantize_static(
    source: str, out: str, op_types: Sequence[str], calibration: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """Writes ``ort-static``: ``quantize_static`` of the model at ``source`` on ``op_types``, to ``out``.

    It follows the x86 guidance of ``quantize_static``'s own docstring (ORT 1.32), not its bare defaults: QDQ,
    uint8 activations and int8 weights per output channel, MinMax ranges over the run's calibration batches,
    after ``quant_pre_process``. Each departure from the defaults is what makes the one-liner fast or accurate on
    x86, measured on EfficientNet-Lite0 (docs/method.md#measurements-behind-the-codes-choices): per-channel int8 weights
    make it
    accurate (depthwise weights differ by channel), and uint8 activations fast (the x86 integer kernels take them).
    ``reduce_range`` stays off, as ORT advises for CPUs with VNNI and as a user runs the one-liner: on x86 without
    VNNI its U8S8 kernels then saturate (our lowering uses uint8 weights there, ``recipe``), and the one-liner's
    measured accuracy shows what that costs.

    ``quant_pre_process`` (shape inference and ORT's basic graph optimizations) is what ORT's warning asks for,
    and a PyTorch export needs it: without it the TF-style padding stays a float Pad between Q/DQ pairs and the
    INT8 model runs no faster than FP32. Its optimizations fuse MatMul+Add into Gemm, so Gemm is quantized
    wherever MatMul is searched (the same layers). Relu and Clip (ReLU6) are quantized too: ORT then folds them
    into the range of the output before them; left out, each Conv output is calibrated over its pre-activation
    range (+-90 for a [0, 6] signal) and the accuracy falls as with the bare defaults.
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else dict(batch)

    prepared = os.path.join(os.path.dirname(out), "prepared.onnx")
    quant_pre_process(source, prepared)
    static_types = {*op_types, "Relu", "Clip", *(["Gemm"] if "MatMul" in op_types else [])}
    quantize_static(
        prepared,
        out,
        Batches(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=sorted(static_types),
        per_channel=True,
        reduce_range=False,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )


def _quantize_dynamic(source: str, out: str, op_types: Sequence[str]) -> None:
    """Writes ``ort-dynamic``: ``quantize_dynamic`` of the model at ``source`` on ``op_types``, to ``out``.

    That is int8 weights, uint8 activations quantized at run time, on the searched op types it supports (Conv,
    MatMul; it rewrites every Gemm as a MatMul first, so a searched Gemm is a MatMul to it). It runs without
    pre-processing, which would not change it: it has no calibrated ranges for Clip or Pad to spoil.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dynamic_types = {"MatMul" if op == "Gemm" else op for op in op_types}
    quantize_dynamic(source, out, op_types_to_quantize=sorted(dynamic_types), weight_type=QuantType.QInt8)
