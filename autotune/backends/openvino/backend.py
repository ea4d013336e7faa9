"""OpenVINO's CPU plugin behind the backend contract: typed ONNX graphs compiled with the ``openvino`` Python API.

Precisions per layer:

- **FP32** and **INT8** are what the typed graph says: our Q/DQ pairs, which OpenVINO reads as FakeQuantize and
  runs on its integer kernels (VNNI, AMX; AVX2's saturating ones) where its low-precision transformations fuse
  them. The INT8 scheme is probed as ONNX Runtime's is (``autotune.backends.int8_kernels``): int8 weights where
  the CPU plugin computes them exactly, 7-bit weights where its kernels saturate int16 pairs (AVX2 without VNNI).
- **BF16** only where the CPU has it (AVX512_BF16 or AMX-BF16, and OpenVINO reports BF16 among the CPU's
  ``OPTIMIZATION_CAPABILITIES``). In a plan whose ``inference_precision`` is ``fp32`` a BF16 layer is written as
  our lowering writes it (bfloat16 weights, Casts around the layer) and compiled with
  ``INFERENCE_PRECISION_HINT=f32``: OpenVINO runs that layer's kernel in bf16 and keeps the rest in f32.
  With ``inference_precision: bf16`` the whole model is compiled with ``INFERENCE_PRECISION_HINT=bf16`` (what
  OpenVINO does by default on such a CPU) and each weighted layer the plan keeps in FP32 carries OpenVINO's
  ``ov::DisableFP16Compression`` runtime attribute (serialized as ``precise``), which the CPU plugin honours by
  keeping the node in its original precision.
"""

from __future__ import annotations

import html
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from autotune.backends.base import BuildError, GraphArtifact, GraphBackend
from autotune.backends.int8_kernels import SchemeVerdict, choose_recipe, isa_features, scheme_name, scheme_verdicts
from autotune.backends.openvino.properties import (
    FREE_KNOBS,
    HINTS,
    INFERENCE_PRECISION_KNOB,
    OPENVINO_SCHEMES,
    bf16_features,
    compile_config,
    openvino_module,
)
from autotune.backends.openvino.references import available_references, reference_model
from autotune.capabilities import Capabilities, Knob
from autotune.model.optypes import RECURRENT_OP_TYPES, TUNABLE_OP_TYPES, WEIGHTED_OP_TYPES
from autotune.plan import KnobValue, Plan
from autotune.quant.lowering import Quantization, lower
from autotune.quant.recipe import QuantRecipe
from autotune.run.files import write_json


@dataclass
class OpenVINOEngine:
    """A compiled model with its infer request, and what it was compiled from and with (what ``export`` writes)."""

    model: Any
    compiled: Any
    request: Any
    config: dict[str, Any]
    pinned: tuple[str, ...] = ()


@dataclass
class OpenVINOArtifact(GraphArtifact):
    """An OpenVINO engine; ``graph`` is the typed ONNX graph, or None for an NNCF reference (an ``ov.Model``)."""

    graph: onnx.ModelProto | None  # type: ignore[assignment] - NNCF's references have no ONNX graph
    engine: OpenVINOEngine


def pin_to_f32(model: Any, layers: Sequence[str]) -> Any:
    """A copy of ``model`` whose ops of ``layers`` carry ``ov::DisableFP16Compression`` (kept in f32).

    The attribute is a C++ type that Python cannot construct in ``rt_info``; the IR serializes it as
    ``<attribute name="precise" version="0"/>`` and reading the IR back constructs it, so the copy goes through
    the IR. An op belongs to a layer when its name is the layer's ONNX node name, or that name and ``/``
    (OpenVINO's ONNX reader names the extra ops of one node so: ``head/WithoutBiases``).
    """
    ov = openvino_module()
    names = set(layers)

    def mark(match: re.Match[str]) -> str:
        name = html.unescape(match.group(2))
        if name in names or name.split("/", 1)[0] in names or any(name.startswith(f"{n}/") for n in names):
            return match.group(1) + '<rt_info><attribute name="precise" version="0" /></rt_info>'
        return match.group(1)

    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "model.xml"
        ov.save_model(model, str(xml), compress_to_fp16=False)
        text = re.sub(r'(<layer id="\d+" name="([^"]*)"[^>]*>)', mark, xml.read_text())
        weights = np.fromfile(xml.with_suffix(".bin"), dtype=np.uint8)
    return ov.Core().read_model(text, ov.Tensor(weights))


class OpenVINOCPU(GraphBackend):
    """OpenVINO's CPU plugin: FP32, BF16 (where the CPU has it) and INT8 per layer; its one-liners as references.

    Args:
        intra_op_threads: ``INFERENCE_NUM_THREADS`` of every compiled model, fixed by the deployment.
        accuracy_budget: The run's budget, the ``max_drop`` of the NNCF accuracy-control reference.
        metric: The run's metric name: ``top1`` runs judge the accuracy-control reference by top-1 agreement with
            FP32 (the calibration data has no labels), every other metric by the cosine to FP32.

    Raises:
        MissingExtra: The ``openvino`` package is not installed (one line naming the extra).
    """

    @classmethod
    def device_identity(cls) -> dict[str, Any]:
        """The CPU's BF16 features too.

        Its BF16 layers exist only where they are, and AVX512_BF16 and AMX decide the speed of its float precisions.
        """
        return {**super().device_identity(), "bf16_isa": list(bf16_features())}

    name = "openvino"
    searching_references = ("nncf-accuracy-control",)

    def __init__(self, intra_op_threads: int = 2, accuracy_budget: float | None = None, metric: str = "cosine"):
        self.ov = openvino_module()
        self.core = self.ov.Core()
        self.intra_op_threads = intra_op_threads
        self.accuracy_budget = accuracy_budget
        self.metric = metric
        self._recipe: QuantRecipe | None = None

    @property
    def recipe(self) -> QuantRecipe:  # type: ignore[override] - the base declares an attribute
        """The INT8 scheme of this CPU: the first of ``OPENVINO_SCHEMES`` the probe finds exact here.

        Raises:
            RuntimeError: No scheme computes exactly (``choose_recipe`` names every verdict).
        """
        if self._recipe is None:
            self._recipe = choose_recipe(OPENVINO_SCHEMES, self.int8_verdicts())
        return self._recipe

    def int8_verdicts(self) -> dict[str, SchemeVerdict]:
        """Whether each of ``OPENVINO_SCHEMES`` computes exactly on compiled models as builds compile them.

        The one-node probes of ``autotune.backends.int8_kernels``, once per process, OpenVINO version and ISA.
        """
        version = self.ov.get_version() if hasattr(self.ov, "get_version") else ""
        session = lambda model: _ProbeSession(self, model)  # noqa: E731
        return scheme_verdicts(OPENVINO_SCHEMES, session, cache_key=("openvino", version, isa_features()))

    def int8_arithmetic(self) -> dict[str, Any]:
        """The scheme here, its weight range, the exact schemes, the CPU's INT8 ISA and the probe's verdicts."""
        recipe = self.recipe
        verdicts = self.int8_verdicts()
        return {
            "scheme": scheme_name(recipe),
            "weight_range": [-recipe.weight_max, recipe.weight_max],
            "exact": [name for name, verdict in verdicts.items() if verdict.exact],
            "isa": list(isa_features()),
            "verdicts": {name: verdict.describe() for name, verdict in verdicts.items()},
        }

    def has_bf16(self) -> bool:
        """True where the CPU lists AVX512_BF16 or AMX-BF16 and OpenVINO's CPU plugin reports BF16."""
        if not bf16_features():
            return False
        return "BF16" in self.core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")

    def capabilities(self) -> Capabilities:
        """FP32, INT8 and (where the CPU has it) BF16 per layer; the inference precision and the free knobs.

        A weightless layer (a residual Add, pooling) is FP32 or INT8: it joins the INT8 unit before it or not.
        """
        bf16 = self.has_bf16()
        precisions = {
            op: ("fp32", "bf16", "int8") if bf16 and op in WEIGHTED_OP_TYPES else ("fp32", "int8")
            for op in TUNABLE_OP_TYPES
            if op not in RECURRENT_OP_TYPES  # the INT8 LSTM is ORT's DynamicQuantizeLSTM, which OpenVINO cannot read
        }
        knobs = [Knob(name, values, description, free=True) for name, _, values, description in FREE_KNOBS]
        if bf16:
            knobs.insert(
                0,
                Knob(
                    INFERENCE_PRECISION_KNOB,
                    ("fp32", "bf16"),
                    "INFERENCE_PRECISION_HINT: what every op the plan does not choose runs in",
                    follows_precision=True,
                ),
            )
        return Capabilities(precisions=precisions, knobs=tuple(knobs))

    def _check_precisions(self, plan: Plan) -> str:
        """The plan's inference precision, after checking that the CPU has every precision the plan asks for.

        Raises:
            BuildError: The plan asks for bf16 on a CPU without it, or names an unknown inference precision.
        """
        base = str(plan.knob(INFERENCE_PRECISION_KNOB, "fp32"))
        if base not in HINTS:
            raise BuildError(f"{INFERENCE_PRECISION_KNOB}={base!r} is not one of {list(HINTS)}")
        if (base == "bf16" or plan.layers_in("bf16")) and not self.has_bf16():
            raise BuildError("this CPU has no BF16 (AVX512_BF16 or AMX-BF16) for OpenVINO: the plan asks for bf16")
        return base

    def build(self, plan: Plan, quantization: Quantization, workdir: Path) -> OpenVINOArtifact:
        """Lowers the plan to a typed graph and compiles it (see the module's docstring for BF16).

        Raises:
            BuildError: The plan asks for bf16 where the CPU has none, or OpenVINO rejected the graph.
        """
        base = self._check_precisions(plan)
        pinned: tuple[str, ...] = ()
        lowered = plan
        if base == "bf16":  # the hint makes every op bf16; the plan's FP32 weighted layers are pinned to f32
            precisions = plan.precision_map
            lowered = Plan.make({name: "fp32" if p == "bf16" else p for name, p in precisions.items()})
            weighted = [layer for layer in self.model.layers if layer.op_type in WEIGHTED_OP_TYPES]
            pinned = tuple(layer.name for layer in weighted if precisions.get(layer.name, "fp32") == "fp32")
        graph = lower(self.model, lowered, quantization, self.recipe)
        return OpenVINOArtifact(
            graph, self.compile(graph, compile_config(self.intra_op_threads, plan.knob_map, base), pinned)
        )

    def build_graph(
        self, graph: onnx.ModelProto, knobs: Mapping[str, KnobValue], workdir: Path | None = None
    ) -> OpenVINOEngine:
        """Compiles a typed ONNX graph with the knobs' inference precision and free options."""
        precision = str(knobs.get(INFERENCE_PRECISION_KNOB, "fp32"))
        if precision not in HINTS:
            raise BuildError(f"{INFERENCE_PRECISION_KNOB}={precision!r} is not one of {list(HINTS)}")
        return self.compile(graph, compile_config(self.intra_op_threads, knobs, precision))

    def compile(
        self, source: onnx.ModelProto | Any, config: Mapping[str, Any], pinned: Sequence[str] = ()
    ) -> OpenVINOEngine:
        """Reads (an ONNX graph) or takes (an ``ov.Model``) a model, pins ``pinned`` layers to f32, compiles it.

        Raises:
            BuildError: OpenVINO could not read or compile the model.
        """
        try:
            model = self.core.read_model(source.SerializeToString()) if isinstance(source, onnx.ModelProto) else source
            if pinned:
                model = pin_to_f32(model, pinned)
            compiled = self.core.compile_model(model, "CPU", dict(config))
        except Exception as error:  # noqa: BLE001 - OpenVINO raises RuntimeError and its own types for a bad graph
            raise BuildError(f"OpenVINO could not compile the model: {_first_line(error)}") from error
        return OpenVINOEngine(model, compiled, compiled.create_infer_request(), dict(config), tuple(pinned))

    def run_engine(self, engine: OpenVINOEngine, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs one batch on the engine's infer request; the outputs in graph order, copied out of its tensors."""
        engine.request.infer(dict(feeds))
        return [engine.request.get_output_tensor(i).data.copy() for i in range(len(engine.compiled.outputs))]

    def runtime_precisions(self, artifact: OpenVINOArtifact) -> dict[str, str]:
        """What each node of the compiled model runs in (its ``runtimePrecision``), by name: what a build landed."""
        runtime = artifact.engine.compiled.get_runtime_model()
        return {
            op.get_friendly_name(): op.get_rt_info()["runtimePrecision"].astype(str)
            for op in runtime.get_ordered_ops()
            if "runtimePrecision" in op.get_rt_info()
        }

    def references(self) -> tuple[str, ...]:
        """``ov-default``, and where NNCF is installed ``nncf-quantize`` and ``nncf-accuracy-control``."""
        return available_references()

    def build_reference(
        self, name: str, calibration: Sequence[Mapping[str, np.ndarray]], workdir: Path
    ) -> OpenVINOArtifact:
        """The engine of OpenVINO's one-liner ``name`` (``autotune.backends.openvino.references``).

        Raises:
            BuildError: ``name`` is not offered here, or NNCF or OpenVINO failed.
        """
        if name not in self.references():
            return super().build_reference(name, calibration, workdir)  # raises, naming the offered ones
        model, config = reference_model(self, name, calibration)
        return OpenVINOArtifact(None, self.compile(model, config))

    def export(self, artifact: OpenVINOArtifact, plan: Plan, out_dir: Path) -> list[Path]:
        """Writes ``model.xml``/``model.bin`` (OpenVINO IR, pins included), ``openvino.json`` and ``model.onnx``.

        ``autotune.load(out_dir)`` compiles the IR with the recorded properties in one call; so does
        ``core.compile_model(core.read_model('model.xml'), 'CPU', json.load(open('openvino.json'))['config'])``.
        """
        out_dir.mkdir(parents=True, exist_ok=True)
        xml = out_dir / "model.xml"
        self.ov.save_model(artifact.engine.model, str(xml), compress_to_fp16=False)
        files = [xml, xml.with_suffix(".bin")]
        manifest = {
            "config": {key: value for key, value in artifact.engine.config.items()},
            "pinned_f32": list(artifact.engine.pinned),
            "openvino": self.ov.__version__ if hasattr(self.ov, "__version__") else self.ov.get_version(),
            "usage": "autotune.load(dir), or core.compile_model(core.read_model('model.xml'), 'CPU', config)",
        }
        files.append(write_json(out_dir / "openvino.json", manifest))
        if artifact.graph is not None:
            files.extend(super().export(artifact, plan, out_dir))
        return files


class _ProbeSession:
    """A probe model compiled as builds compile it, run as the probe calls an ONNX Runtime session."""

    def __init__(self, backend: OpenVINOCPU, model: onnx.ModelProto):
        self.backend = backend
        self.engine = backend.build_graph(model, {})

    def run(self, _names: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return self.backend.run_engine(self.engine, feeds)


def load_compiled(out_dir: Path, threads: int | None = None) -> Any:
    """The compiled model of an OpenVINO export: call it with the model's inputs (``compiled(feeds)``).

    Args:
        out_dir: The export directory (``model.xml``, ``openvino.json``).
        threads: ``INFERENCE_NUM_THREADS`` to use instead of the recorded one.
    """
    import json

    ov = openvino_module()
    manifest = json.loads((Path(out_dir) / "openvino.json").read_text())
    config = dict(manifest["config"])
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    return core.compile_model(core.read_model(str(Path(out_dir) / "model.xml")), "CPU", config)


def _first_line(error: BaseException) -> str:
    """OpenVINO's messages nest ``Exception from ...`` lines; the last line with text says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("Exception from")]
    return (useful or lines or [type(error).__name__])[-1]
