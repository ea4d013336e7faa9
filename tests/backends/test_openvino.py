"""The OpenVINO backend: FP32, BF16, INT8 layers against ONNX Runtime, its one-liners, export, a missing extra."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("openvino")

from autotune import api  # noqa: E402 - after the skip: every test here needs OpenVINO
from autotune.backends import (  # noqa: E402
    BuildError,
    backend_class,  # noqa: E402
    get_backend,
)
from autotune.backends.int8_kernels import scheme_name  # noqa: E402
from autotune.backends.onnxruntime import OnnxRuntimeCPU, int8_verdicts  # noqa: E402
from autotune.backends.openvino import INFERENCE_PRECISION_KNOB, OpenVINOCPU  # noqa: E402
from autotune.backends.openvino import backend as ov_backend  # noqa: E402
from autotune.backends.openvino import properties as ov_properties  # noqa: E402
from autotune.backends.openvino import references as ov_references  # noqa: E402
from autotune.config.schema import BackendConfig  # noqa: E402
from autotune.extras import MissingExtra  # noqa: E402
from autotune.harness.identity import machine_identity  # noqa: E402
from autotune.model.layers import InputSpec, prepare_model  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.quant.lowering import NONE, Quantization, lower  # noqa: E402
from autotune.testing import tiny_config, tiny_mlp  # noqa: E402

BF16_UNIT_ROUNDOFF = 2.0**-8
"""bfloat16 keeps 8 significant bits (7 stored and the implicit one): round to nearest errs by at most 2^-8."""

HAS_BF16 = bool(ov_properties.bf16_features())
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512_BF16 or AMX-BF16")


def _prepared(model, backend, shape):
    loaded = prepare_model(model, Path("tiny.onnx"), [InputSpec("x", shape, "float32")])
    backend.prepare(loaded, loaded.layer_names)
    return loaded


@pytest.fixture()
def tiny():
    backend = OpenVINOCPU(intra_op_threads=2, accuracy_budget=0.02, metric="top1")
    return backend, _prepared(tiny_mlp(), backend, (16, 32))


@pytest.fixture()
def feeds():
    return {"x": np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)}


def _ort(model, plan, quantization, feeds, recipe=None):
    """ONNX Runtime's outputs of the plan; with ``recipe``, of the Q/DQ graph that scheme lowers to.

    Where ONNX Runtime's own kernels saturate with that scheme's int8 weights (u8s8 on AVX2), the graph carries the
    same integers as uint8 weights, which its U8U8 kernels compute exactly.
    """
    ort = OnnxRuntimeCPU(intra_op_threads=2)
    ort.prepare(model, model.layer_names)
    if recipe is None:
        return ort.run(ort.build(plan, quantization, Path(".")), feeds)[0]
    if not int8_verdicts()[scheme_name(recipe)].exact:
        recipe = dataclasses.replace(recipe, weight_dtype="uint8")
    return ort.run_engine(ort.build_graph(lower(model, plan, quantization, recipe), {}), feeds)[0]


def _matmul(features=256, outputs=64, seed=0):
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((features, outputs)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, outputs])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_fp32_plan_gives_onnx_runtimes_outputs(tiny, feeds):
    backend, model = tiny
    plan = Plan.uniform(model.layer_names, "fp32")
    artifact = backend.build(plan, NONE, Path("."))
    expected = _ort(model, plan, NONE, feeds)
    np.testing.assert_allclose(backend.run(artifact, feeds)[0], expected, rtol=1e-5, atol=1e-5)
    assert "bf16" not in set(backend.runtime_precisions(artifact).values())  # the hint is f32 for the reference


@pytest.mark.int8_numeric
def test_int8_plan_computes_what_onnx_runtime_computes_on_the_same_qdq_graph(tiny, feeds):
    backend, model = tiny
    ranges = Quantization(ranges={name: (-8.0, 8.0) for name in ("x", "a1", "a2", "a3", "h1b")})
    plan = Plan.uniform(model.layer_names, "int8")
    artifact = backend.build(plan, ranges, Path("."))
    # Both run the same integers (u8 activations, the probed scheme's weights, int32 sums) on kernels the probe
    # found exact; only the float rescale may round apart.
    expected = _ort(model, plan, ranges, feeds, backend.recipe)
    np.testing.assert_allclose(backend.run(artifact, feeds)[0], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert backend.runtime_precisions(artifact)["fc2"] == "u8"  # the integer kernel, not a dequantized float one


@needs_bf16
def test_a_bf16_layer_runs_in_bf16_within_the_bound_of_its_8_bit_mantissa():
    backend = OpenVINOCPU()
    model = _prepared(_matmul(), backend, (8, 256))
    x = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    artifact = backend.build(
        Plan.uniform(model.layer_names, "bf16", {INFERENCE_PRECISION_KNOB: "fp32"}), NONE, Path(".")
    )
    assert backend.runtime_precisions(artifact)["mm"] == "bf16"
    weight = numpy_helper.to_array(model.proto.graph.initializer[0])
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    # x and w each round by at most u, so each product errs by at most (2u + u^2) of |x_i w_i| (the sum is in f32);
    # the output rounds to bf16 once more before its Cast to float: u of |y|.
    u = BF16_UNIT_ROUNDOFF
    bound = (2 * u + u * u) * (np.abs(x).astype(np.float64) @ np.abs(weight)) + u * np.abs(exact) + 1e-4
    error = np.abs(backend.run(artifact, {"x": x})[0] - exact)
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 1e-4  # it is bf16: f32 would be ~1e-6 off here


@needs_bf16
def test_bf16_base_keeps_the_plans_fp32_layers_in_f32(tiny, feeds):
    backend, model = tiny
    plan = Plan.make(
        {name: "fp32" if name == "fc2" else "bf16" for name in model.layer_names}, {"inference_precision": "bf16"}
    )
    artifact = backend.build(plan, NONE, Path("."))
    runtime = backend.runtime_precisions(artifact)
    assert runtime["fc2"] == "f32"
    assert runtime["fc3"] == "bf16" and runtime["logits"] == "bf16"
    assert artifact.engine.pinned == ("fc2",)


@needs_bf16
def test_a_bf16_cpu_offers_bf16_and_the_inference_precision(tiny):
    backend, _ = tiny
    capabilities = backend.capabilities()
    assert capabilities.precisions_for("MatMul") == ("fp32", "bf16", "int8")
    assert capabilities.precisions_for("Add") == ("fp32", "int8")  # a weightless layer joins INT8 or not
    knobs = {knob.name: knob for knob in capabilities.knobs}
    assert (
        knobs[INFERENCE_PRECISION_KNOB].values == ("fp32", "bf16") and knobs[INFERENCE_PRECISION_KNOB].follows_precision
    )


def test_a_cpu_without_bf16_gets_no_bf16_choice_and_no_error(tiny, feeds, monkeypatch):
    backend, model = tiny
    monkeypatch.setattr(ov_backend, "bf16_features", lambda: ())
    capabilities = backend.capabilities()
    assert all("bf16" not in capabilities.precisions_for(op) for op in ("MatMul", "Gemm", "Conv"))
    knobs = {knob.name: knob for knob in capabilities.knobs}
    assert INFERENCE_PRECISION_KNOB not in knobs
    assert {"cpu_pinning", "cpu_denormals_optimization", "scheduling_core_type"} <= {
        n for n, k in knobs.items() if k.free
    }
    backend.run(backend.build(Plan.uniform(model.layer_names, "fp32"), NONE, Path(".")), feeds)  # builds as before
    with pytest.raises(BuildError, match="no BF16"):  # a plan from a BF16 machine fails as a trial, not the run
        backend.build(Plan.uniform(model.layer_names, "bf16"), NONE, Path("."))


def test_free_knobs_set_the_cpu_plugins_properties(tiny):
    backend, model = tiny
    plan = Plan.uniform(model.layer_names, "fp32", {"cpu_pinning": False, "cpu_denormals_optimization": True})
    compiled = backend.build(plan, NONE, Path(".")).engine.compiled
    assert compiled.get_property("ENABLE_CPU_PINNING") is False
    assert compiled.get_property("CPU_DENORMALS_OPTIMIZATION") is True
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 2
    assert str(compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"


def test_the_references_build_and_run(tiny, feeds):
    pytest.importorskip("nncf")
    backend, model = tiny
    assert backend.references() == ("ov-default", "nncf-quantize", "nncf-accuracy-control")
    expected = _ort(model, Plan.uniform(model.layer_names, "fp32"), NONE, feeds)
    calibration = [feeds] * 4
    for name in backend.references():
        outputs = backend.run(backend.build_reference(name, calibration, Path(".")), feeds)[0]
        cosine = (outputs * expected).sum() / np.linalg.norm(outputs) / np.linalg.norm(expected)
        assert cosine > 0.95, name  # a quantized MLP, not noise
    quantized = backend.build_reference("nncf-quantize", calibration, Path("."))
    assert "u8" in set(backend.runtime_precisions(quantized).values()) | {"i8"} and quantized.graph is None
    with pytest.raises(BuildError, match="no reference 'ort-static'"):
        backend.build_reference("ort-static", calibration, Path("."))


def test_without_nncf_only_the_model_as_is_is_a_reference(monkeypatch, caplog):
    monkeypatch.setattr(ov_references.importlib.util, "find_spec", lambda name: None)
    ov_references.available_references.cache_clear()
    try:
        assert ov_references.available_references() == ("ov-default",)
        lines = [record.getMessage() for record in caplog.records]
        assert len(lines) == 1 and "pip install 'autotune[nncf]'" in lines[0]
    finally:
        ov_references.available_references.cache_clear()


def test_the_export_loads_in_one_call_and_runs_as_measured(tiny, feeds, tmp_path):
    backend, model = tiny
    plan = Plan.make({name: "int8" if name == "fc2" else "fp32" for name in model.layer_names})
    ranges = Quantization(ranges={name: (-8.0, 8.0) for name in ("x", "a1", "a2", "a3", "h1b")})
    artifact = backend.build(plan, ranges, tmp_path)
    files = backend.export(artifact, plan, tmp_path / "best")
    assert [path.name for path in files][:3] == ["model.xml", "model.bin", "openvino.json"]
    loaded = api.load(tmp_path / "best")
    np.testing.assert_array_equal(loaded(feeds)[0], backend.run(artifact, feeds)[0])


def test_a_config_naming_openvino_without_the_package_stops_with_one_line(monkeypatch, tmp_path, capsys):
    from autotune.cli import main

    monkeypatch.setitem(sys.modules, "openvino", None)  # its import fails as if it were not installed
    with pytest.raises(
        MissingExtra, match=r"^backend.name: openvino needs the 'openvino' extra: pip install 'autotune\[openvino\]'$"
    ):
        get_backend(BackendConfig(name="openvino"))
    config = tiny_config(tmp_path, backend={"name": "openvino"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert main(["evaluate", str(path), "--plan", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'autotune[openvino]'" in err[0], err


def test_the_machine_identity_of_an_openvino_run_has_the_cpus_bf16(tmp_path):
    identity = machine_identity(backend_class("openvino"))
    assert identity["bf16_isa"] == list(ov_properties.bf16_features())
    assert "bf16_isa" not in machine_identity(backend_class("onnxruntime"))  # other backends' keys stay as they were


def test_a_graph_openvino_cannot_read_is_a_build_error(tiny):
    backend, model = tiny
    broken = onnx.ModelProto()
    broken.CopyFrom(model.proto)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BuildError, match="OpenVINO could not compile"):
        backend.build_graph(broken, {})


def test_accuracy_control_judges_the_items_nncf_passes_against_their_own_fp32_outputs(tiny, monkeypatch):
    nncf = pytest.importorskip("nncf")
    import openvino as ov

    backend, _ = tiny
    seen = {}

    def accuracy_control(model, calibration_dataset, validation_dataset, validation_fn, max_drop, drop_type, **options):
        items = list(validation_dataset.get_data())
        compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        seen["subset"] = validation_fn(compiled, items[::-1][:2])  # NNCF ranks on subsets, in its own order
        seen["max_drop"] = max_drop
        return model

    monkeypatch.setattr(nncf, "quantize_with_accuracy_control", accuracy_control)
    rng = np.random.default_rng(3)
    calibration = [{"x": rng.standard_normal((16, 32)).astype(np.float32)} for _ in range(3)]
    backend.build_reference("nncf-accuracy-control", calibration, Path("."))
    metric, each = seen["subset"]
    assert metric == 1.0 and each == [1.0, 1.0]  # the FP32 model agrees with itself on whichever items it gets
    assert seen["max_drop"] == 0.02  # the run's budget


# Not int8_numeric: under qemu -cpu Haswell OpenVINO's FP32 LSTM and GRU already differ from ONNX Runtime's (by
# as much as the outputs themselves, the FP32 plan too); natively on AVX2 and VNNI CPUs both agree.
def test_a_model_with_lstm_and_gru_keeps_them_fp32_and_builds_its_int8_plan():
    from autotune.config.schema import SearchSpaceConfig
    from autotune.search.space import build_space
    from autotune.testing import tiny_recurrent_model

    backend = OpenVINOCPU(intra_op_threads=2, accuracy_budget=0.02, metric="top1")
    model = _prepared(tiny_recurrent_model(), backend, (8, 12, 16))
    space = build_space(model.layers, backend.capabilities(), SearchSpaceConfig())
    plan = space.uniform("int8")
    assert plan.precision_map == {"lstm": "fp32", "gru": "fp32", "head": "int8"}  # DynamicQuantizeLSTM is ORT's
    feeds = {"x": np.random.default_rng(3).standard_normal((8, 12, 16)).astype(np.float32)}
    ranges = Quantization(ranges={"state": (-1.0, 1.0)})
    expected = _ort(model, plan, ranges, feeds, backend.recipe)
    got = backend.run(backend.build(plan, ranges, Path(".")), feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
