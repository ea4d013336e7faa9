"""The INT8 kernel probe: the ISA features it reads, the verdicts it gives, and the scheme the ORT backend lowers to.

The forced-verdict tests hold on any CPU: they replace the probe's verdict and check that the lowering follows it
(uint8 weights, then 7-bit ones, where int8 weights saturate) with numbers that match the chosen scheme's numpy
reference. The ``int8_numeric`` tests run the real probe; CI runs them under ``qemu-x86_64 -cpu Haswell`` too
(``make test-haswell``), where ONNX Runtime picks the saturating AVX2 kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from autotune.api import resolve_plan
from autotune.backends import int8_kernels
from autotune.backends.base import BuildError
from autotune.backends.int8_kernels import (
    PATTERNS,
    PatternResult,
    choose_recipe,
    isa_class,
    isa_features,
    probe_pattern,
    scheme_name,
    scheme_verdicts,
)
from autotune.backends.onnxruntime import INT8_SCHEME_KNOB, INT8_SCHEMES, OnnxRuntimeCPU, _probe_session
from autotune.harness import prepare
from autotune.harness.prepare import SetupError
from autotune.harness.runner import TrialRunner
from autotune.model.layers import prepare_model
from autotune.plan import Plan
from autotune.quant.lowering import Quantization, lower
from autotune.quant.recipe import ORT_X86, ORT_X86_7BIT_WEIGHTS, ORT_X86_UINT8_WEIGHTS
from autotune.testing import tiny_config, tiny_space, typed_model
from tests.quant.reference import BUILDERS, RNG_SEED, forward, int8_reference, random_feeds

VNNI_OR_AMX = {"avx512_vnni", "avx_vnni", "amx_int8"}


def force_verdicts(monkeypatch: pytest.MonkeyPatch, saturating: set[str]) -> None:
    """Makes the probe find the schemes named in ``saturating`` (``u8s8``, ...) wrong, and the others exact."""
    monkeypatch.setattr(int8_kernels, "_VERDICTS", {})

    def forced(pattern, recipe, session):
        wrong = scheme_name(recipe) in saturating
        return PatternResult(pattern, not wrong, 0.494 if wrong else 0.0)

    monkeypatch.setattr(int8_kernels, "probe_pattern", forced)


def int8_weights(graph) -> list[np.ndarray]:
    """The quantized weights, as the integers they stand for (uint8 ones less their zero point of 128)."""
    weights = [numpy_helper.to_array(init) for init in graph.initializer if init.name.endswith("__int8")]
    return [w.astype(np.int16) - (128 if w.dtype == np.uint8 else 0) for w in weights]


def weight_dtypes(graph) -> set[str]:
    return {str(numpy_helper.to_array(init).dtype) for init in graph.initializer if init.name.endswith("__int8")}


# ---- ISA features ----------------------------------------------------------------------------------------------


def test_isa_features_trust_cpuid_as_numpy_sees_it_and_cpuinfo_for_the_rest(monkeypatch):
    # Under qemu -cpu Haswell, /proc/cpuinfo is the host's (AMX) but CPUID, which ORT and numpy read, says AVX2.
    host = {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "sse"}
    monkeypatch.setattr(int8_kernels, "_cpuinfo_flags", lambda: host)
    monkeypatch.setattr(int8_kernels, "_numpy_cpu_features", lambda: {"AVX2": True, "AVX512F": True})
    assert isa_features() == ("amx_int8", "avx2", "avx512_vnni", "avx512f", "avx_vnni")  # no VNNI key: cpuinfo's
    monkeypatch.setattr(int8_kernels, "_numpy_cpu_features", lambda: {"AVX2": True, "AVX512F": False})
    assert isa_features() == ("avx2",)  # CPUID hides AVX-512 the file lists: its AMX and AVX-VNNI are the host's
    monkeypatch.setattr(int8_kernels, "_cpuinfo_flags", lambda: {"avx2", "avx_vnni"})
    assert isa_features() == ("avx2", "avx_vnni")  # nothing hidden: an AVX-VNNI CPU without AVX-512
    monkeypatch.setattr(int8_kernels, "_cpuinfo_flags", lambda: {*host, "avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(int8_kernels, "_numpy_cpu_features", lambda: {"AVX2": True, "AVX512F": False})
    assert int8_kernels.cpu_flags() == {"avx2"}  # the host's BF16 is not this process's either (OpenVINO's bf16)


def test_isa_class_names_the_best_int8_kernel_family():
    assert isa_class(("avx2", "avx512_vnni", "avx512bw", "avx512f")) == "avx512-vnni"
    assert isa_class(("avx2", "avx_vnni")) == "avx-vnni"
    assert isa_class(("avx2", "avx512bw", "avx512f")) == "avx512"
    assert isa_class(("avx2",)) == "avx2"
    assert isa_class(("amx_int8", "avx2", "avx512_vnni")) == "amx"
    assert isa_class(("asimddp",)) == "arm-dotprod"


def test_the_machine_identity_holds_the_isa_features(tmp_path):
    from autotune.backends import backend_class
    from autotune.harness.identity import machine_identity

    identity = machine_identity(backend_class("onnxruntime"))
    assert identity["isa"] == list(isa_features())


# ---- the probe's comparison --------------------------------------------------------------------------------------


class _Halving:
    """A session that returns half of what ONNX Runtime computes: a saturating kernel's worst case."""

    def __init__(self, model):
        self.session = _probe_session(model)

    def run(self, names, feeds):
        return [value / 2 for value in self.session.run(names, feeds)]


@pytest.mark.int8_numeric
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_kernel_off_by_half_is_saturating_and_the_7bit_scheme_is_exact(pattern):
    assert not probe_pattern(pattern, ORT_X86_7BIT_WEIGHTS, _Halving).exact
    # 7-bit weights are exact on every x86 CPU: their u8 x s8 pairs fit int16.
    result = probe_pattern(pattern, ORT_X86_7BIT_WEIGHTS, _probe_session)
    assert result.exact and result.worst_relative_error < 0.01, result


@pytest.mark.int8_numeric
def test_the_probe_finds_what_the_cpu_features_say():
    """VNNI: 8-bit int8 weights are exact. AVX2 without VNNI or AMX (qemu -cpu Haswell): MatMul, Gemm and Conv
    saturate, depthwise Conv (ORT's own int32 kernel) does not. uint8 and 7-bit weights are exact on both."""
    verdicts = scheme_verdicts(INT8_SCHEMES, _probe_session, cache_key="test")
    features = set(isa_features())
    assert verdicts["u8u8"].exact and verdicts["u8s7"].exact
    if "avx512_vnni" in features:
        assert verdicts["u8s8"].exact, verdicts["u8s8"].describe()
    elif "avx2" in features and not features & VNNI_OR_AMX:
        wrong = {result.pattern for result in verdicts["u8s8"].results if not result.exact}
        assert wrong == {"MatMul", "Gemm", "Conv"}, verdicts["u8s8"].describe()
    else:
        pytest.skip(f"no expectation for INT8 ISA features {sorted(features)}")


# ---- the scheme the backend lowers to, by the probe's verdict ----------------------------------------------------


def _prepared(kind: str):
    rng = np.random.default_rng(RNG_SEED)
    loaded = prepare_model(BUILDERS[kind](rng), Path("x.onnx"), None)
    calib = forward(loaded.proto, random_feeds(loaded.proto, rng))
    ranges = {name: (min(float(v.min()), 0.0), max(float(v.max()), 0.0)) for name, v in calib.items()}
    return loaded, ranges, random_feeds(loaded.proto, rng)


def _built(kind: str, tmp_path: Path):
    """An all-INT8 plan of a test model, built by the ORT backend; with its reference inputs."""
    loaded, ranges, feeds = _prepared(kind)
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"))
    artifact = backend.build(plan, Quantization(ranges), tmp_path)
    got = dict(zip(loaded.output_names, backend.run(artifact, feeds), strict=True))
    return backend, artifact, got, (loaded.proto, loaded.layers, plan, ranges, feeds)


def _assert_matches(got, expected, kind):
    for name, value in got.items():
        magnitude = float(np.abs(expected[name]).max())
        err = np.abs(value - expected[name])
        if kind == "cnn":  # QLinearConv's fixed-point requantization may move a rounding tie by one step
            assert np.mean(err > 1e-4 * magnitude) < 0.1 and err.max() < 0.02 * magnitude, (name, err.max())
        else:
            np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-4 * magnitude, err_msg=name)


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm"])
def test_saturating_int8_weights_lower_to_uint8_weights_on_the_same_grid(monkeypatch, tmp_path, kind):
    force_verdicts(monkeypatch, saturating={"u8s8"})
    backend, artifact, got, (model, layers, plan, ranges, feeds) = _built(kind, tmp_path)
    assert backend.recipe == ORT_X86_UINT8_WEIGHTS
    assert weight_dtypes(artifact.graph.graph) == {"uint8"}
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == 127
    # The same integers as int8 weights, so the 8-bit reference; exact U8U8 kernels compute it on every x86 CPU.
    _assert_matches(got, int8_reference(model, layers, plan, ranges, ORT_X86, feeds, ort_bias=True), kind)
    arithmetic = backend.int8_arithmetic()
    assert arithmetic["scheme"] == "u8u8" and arithmetic["weight_range"] == [-127, 127]
    assert arithmetic["exact"] == ["u8u8", "u8s7"]  # the int8_scheme knob's values
    assert arithmetic["verdicts"]["u8s8"].startswith("u8s8: saturating")


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm"])
def test_saturating_8bit_weights_lower_to_7bit_weights_that_compute_the_7bit_reference(monkeypatch, tmp_path, kind):
    force_verdicts(monkeypatch, saturating={"u8s8", "u8u8"})
    backend, artifact, got, (model, layers, plan, ranges, feeds) = _built(kind, tmp_path)
    assert backend.recipe == ORT_X86_7BIT_WEIGHTS
    assert weight_dtypes(artifact.graph.graph) == {"int8"}
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == 64
    _assert_matches(got, int8_reference(model, layers, plan, ranges, backend.recipe, feeds, ort_bias=True), kind)
    # The 8-bit reference is another result: a lowering that kept 8-bit weights could not pass the check above.
    eight = int8_reference(model, layers, plan, ranges, ORT_X86, feeds, ort_bias=True)
    assert any(np.abs(got[name] - eight[name]).max() > 1e-3 * np.abs(eight[name]).max() for name in got)
    arithmetic = backend.int8_arithmetic()
    assert arithmetic["scheme"] == "u8s7" and arithmetic["weight_range"] == [-64, 64]


@pytest.mark.int8_numeric
def test_an_exact_verdict_keeps_8bit_weights(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, saturating=set())
    backend, artifact, got, (model, layers, plan, ranges, feeds) = _built("mlp", tmp_path)
    assert backend.recipe == ORT_X86
    assert weight_dtypes(artifact.graph.graph) == {"int8"}
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == 127
    if not all(probe_pattern(pattern, ORT_X86, _probe_session).exact for pattern in PATTERNS):  # the real probe
        pytest.skip("this CPU's 8-bit kernels saturate: the forced verdict cannot compute the 8-bit reference")
    _assert_matches(got, int8_reference(model, layers, plan, ranges, ORT_X86, feeds, ort_bias=True), "mlp")


def test_no_exact_scheme_is_an_error_that_names_the_verdicts(monkeypatch):
    force_verdicts(monkeypatch, saturating={"u8s8", "u8u8", "u8s7"})
    with pytest.raises(RuntimeError, match="no INT8 scheme computes exactly.*u8s8: saturating.*u8u8: sat.*u8s7: sat"):
        _ = OnnxRuntimeCPU(1).recipe


def test_the_verdict_is_probed_once_per_process(monkeypatch):
    force_verdicts(monkeypatch, saturating={"u8s8", "u8u8"})
    calls = []
    forced = int8_kernels.probe_pattern
    monkeypatch.setattr(int8_kernels, "probe_pattern", lambda *args: calls.append(args[0]) or forced(*args))
    assert OnnxRuntimeCPU(1).recipe == OnnxRuntimeCPU(2).recipe == ORT_X86_7BIT_WEIGHTS
    assert sorted(calls) == sorted(PATTERNS * len(INT8_SCHEMES))
    assert choose_recipe(INT8_SCHEMES, scheme_verdicts(INT8_SCHEMES, _probe_session)) == ORT_X86_7BIT_WEIGHTS


# ---- the int8_scheme knob: the exact schemes, searched where a config names it -----------------------------------

ALL_SCHEMES = {"int8_scheme": ["u8s8", "u8u8", "u8s7"]}
RECIPES = {"u8s8": ORT_X86, "u8u8": ORT_X86_UINT8_WEIGHTS, "u8s7": ORT_X86_7BIT_WEIGHTS}


def _scheme_knob(capabilities):
    return next(knob for knob in capabilities.knobs if knob.name == INT8_SCHEME_KNOB)


@pytest.mark.parametrize(
    ("saturating", "offered"),
    [
        (set(), ("u8s8", "u8u8", "u8s7")),  # VNNI, AMX
        ({"u8s8"}, ("u8u8", "u8s7")),  # AVX2 and AVX-512 without VNNI
        ({"u8s8", "u8u8"}, ("u8s7",)),
        ({"u8u8"}, ("u8s8", "u8s7")),
    ],
)
def test_the_scheme_knob_offers_the_exact_schemes_in_the_probes_order(monkeypatch, saturating, offered):
    force_verdicts(monkeypatch, saturating)
    backend = OnnxRuntimeCPU(1)
    knob = _scheme_knob(backend.capabilities())
    assert knob.values == offered and knob.default == scheme_name(backend.recipe)
    assert [name for name, _ in knob.unavailable] == [name for name in RECIPES if name in saturating]
    assert all(why.startswith("saturating (MatMul 49.4%") for _, why in knob.unavailable)
    assert tuple(backend.int8_schemes()) == offered


def test_the_scheme_knob_is_searched_by_default_where_more_than_one_scheme_is_exact(monkeypatch):
    force_verdicts(monkeypatch, {"u8s8"})
    default = tiny_space(forms=True)
    knob = _scheme_knob(default)
    assert knob.values == ("u8u8", "u8s7") and knob.seeded  # the saturating u8s8 is never offered
    assert default.uniform("int8").knob(INT8_SCHEME_KNOB) == "u8u8"  # the probe's first exact scheme by default
    space = tiny_space(forms=True, knobs={"int8_scheme": ["u8s7"]})
    assert _scheme_knob(space).values == ("u8s7",)  # a config may still narrow it


def test_where_u8s8_is_exact_the_scheme_knob_is_searched_only_where_the_config_names_it(monkeypatch):
    """VNNI, AMX: u8s8's kernels are the fast ones and its numbers the 8-bit ones; no other scheme can win."""
    force_verdicts(monkeypatch, set())
    assert INT8_SCHEME_KNOB not in {knob.name for knob in tiny_space(forms=True).knobs}
    assert _scheme_knob(tiny_space(forms=True, knobs=ALL_SCHEMES)).values == ("u8s8", "u8u8", "u8s7")


def test_the_scheme_knob_is_searched_only_where_the_config_names_it_where_one_scheme_is_exact(monkeypatch):
    force_verdicts(monkeypatch, {"u8s8", "u8u8"})
    default = tiny_space(forms=True)
    assert INT8_SCHEME_KNOB not in {knob.name for knob in default.knobs}
    assert INT8_SCHEME_KNOB not in default.uniform("int8").knob_map  # the plans (and hashes) of before the knob
    space = tiny_space(knobs={"int8_scheme": ["u8s7"]})
    assert _scheme_knob(space).values == ("u8s7",)
    assert space.uniform("int8").knob(INT8_SCHEME_KNOB) == "u8s7"


def test_a_config_naming_a_saturating_scheme_is_one_line_naming_the_exact_ones(monkeypatch):
    force_verdicts(monkeypatch, {"u8s8"})
    with pytest.raises(ValueError) as error:
        tiny_space(knobs={"int8_scheme": ["u8s8", "u8u8"]})
    message = str(error.value)
    assert message.startswith("search.knobs.int8_scheme: 'u8s8' (saturating (MatMul 49.4%")
    assert message.endswith("not offered on this machine; offered ['u8u8', 'u8s7']") and "\n" not in message


def test_a_plan_of_a_saturating_scheme_is_a_build_error_naming_the_exact_ones(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, {"u8s8"})
    loaded, ranges, _ = _prepared("mlp")
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"), {INT8_SCHEME_KNOB: "u8s8"})
    with pytest.raises(BuildError, match=r"int8_scheme='u8s8' does not compute exactly .* \['u8u8', 'u8s7'\]"):
        backend.build(plan, Quantization(ranges), tmp_path)


def test_the_default_scheme_lowers_as_a_plan_without_the_knob(monkeypatch):
    force_verdicts(monkeypatch, {"u8s8"})
    loaded, ranges, _ = _prepared("cnn")
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"))
    at_default = plan.with_knobs(int8_scheme="u8u8")
    assert backend.recipe_for(plan) == backend.recipe_for(at_default) == ORT_X86_UINT8_WEIGHTS
    graphs = [lower(loaded, p, Quantization(ranges), backend.recipe_for(p)) for p in (plan, at_default)]
    assert graphs[0].SerializeToString() == graphs[1].SerializeToString()
    other = lower(loaded, plan, Quantization(ranges), backend.recipe_for(plan.with_knobs(int8_scheme="u8s7")))
    assert other.SerializeToString() != graphs[0].SerializeToString()


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm"])
@pytest.mark.parametrize("scheme", list(RECIPES))
def test_each_exact_scheme_lowers_to_its_weights_and_computes_its_reference(tmp_path, kind, scheme):
    """The real probe decides: a scheme it finds exact computes its own reference; one that saturates is refused."""
    loaded, ranges, feeds = _prepared(kind)
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"), {INT8_SCHEME_KNOB: scheme})
    if scheme not in backend.int8_schemes():
        with pytest.raises(BuildError, match="does not compute exactly"):
            backend.build(plan, Quantization(ranges), tmp_path)
        return
    artifact = backend.build(plan, Quantization(ranges), tmp_path)
    recipe = RECIPES[scheme]
    assert weight_dtypes(artifact.graph.graph) == {recipe.weight_dtype}
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == recipe.weight_max
    got = dict(zip(loaded.output_names, backend.run(artifact, feeds), strict=True))
    # u8u8 holds the 8-bit weights offset by 128: the same integers, so the same reference as u8s8.
    reference = ORT_X86_7BIT_WEIGHTS if recipe.weight_max == 64 else ORT_X86
    _assert_matches(got, int8_reference(loaded.proto, loaded.layers, plan, ranges, reference, feeds, True), kind)


def test_the_export_records_the_plans_scheme(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, set())
    loaded, ranges, _ = _prepared("mlp")
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    for scheme, weight_range in (("u8u8", [-127, 127]), ("u8s7", [-64, 64])):
        plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"), {INT8_SCHEME_KNOB: scheme})
        backend.export(backend.build(plan, Quantization(ranges), tmp_path), plan, tmp_path / scheme)
        session = json.loads((tmp_path / scheme / "session.json").read_text())
        assert session["int8_scheme"] == scheme and session["int8_weight_range"] == weight_range
    fp32 = Plan.make(dict.fromkeys(loaded.layer_names, "fp32"), {INT8_SCHEME_KNOB: "u8s7"})
    backend.export(backend.build(fp32, Quantization(ranges), tmp_path), fp32, tmp_path / "fp32")
    assert "int8_scheme" not in json.loads((tmp_path / "fp32" / "session.json").read_text())


def test_a_plan_file_with_a_knob_the_run_does_not_search_is_refused(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, {"u8s8", "u8u8"})  # one exact scheme: the knob is searched only where named
    space = tiny_space(forms=True)
    path = tmp_path / "plan.json"
    path.write_text(space.uniform("int8").with_knobs(int8_scheme="u8s7").to_json())
    with pytest.raises(SetupError, match=r"lacks; name them in the config's search.knobs .*int8_scheme: \['u8s7'\]"):
        resolve_plan(str(path), space)
    named = tiny_space(forms=True, knobs={"int8_scheme": ["u8s7"]})
    assert resolve_plan(str(path), named).knob(INT8_SCHEME_KNOB) == "u8s7"


def test_layerwise_choices_are_made_with_the_scheme_each_plan_runs(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, set())
    chosen_with = []
    choose = prepare.choose_layer_methods

    def recording(model, layers, recipe, *args, **kwargs):
        chosen_with.append(recipe)
        return choose(model, layers, recipe, *args, **kwargs)

    monkeypatch.setattr(prepare, "choose_layer_methods", recording)
    runner = TrialRunner(tiny_config(tmp_path, search={"knobs": ALL_SCHEMES}))
    assert chosen_with == [ORT_X86]  # the default scheme's, before any build
    plan = runner.space.uniform("int8", {"calibration": "layerwise", "int8_scheme": "u8s7"})
    assert runner.run(plan).ok and runner.run(plan.with_knobs(allow_spinning=False)).ok
    assert runner.run(plan.with_knobs(calibration="max", int8_scheme="u8u8")).ok  # no layerwise: none chosen
    assert chosen_with == [ORT_X86, ORT_X86_7BIT_WEIGHTS]  # once per scheme
    default = runner.quantizations(plan.with_knobs(int8_scheme="u8s8"))
    seven_bit = runner.quantizations(plan)
    assert seven_bit is not default and seven_bit.layer_ranges.keys() == default.layer_ranges.keys()
    typed = typed_model(runner, plan)
    assert max(int(np.abs(w).max()) for w in int8_weights(typed.graph)) == 64


# ---- int8-dynamic: probed as the static schemes are, offered for MatMul/Gemm only ------------------------------


@pytest.mark.int8_numeric
def test_the_dynamic_probe_finds_what_the_cpu_features_say():
    """7-bit dynamic weights are exact on every x86 CPU; 8-bit ones only with VNNI or AMX (U8S8 pairs in int32)."""
    verdicts = int8_kernels.dynamic_verdicts(_probe_session, cache_key="test-dynamic-probe")
    assert verdicts["dynamic-u8s7"].exact, verdicts["dynamic-u8s7"].describe()
    features = set(isa_features())
    if "avx512_vnni" in features:
        assert verdicts["dynamic-u8s8"].exact and int8_kernels.dynamic_weight_max(verdicts) == 127
    elif "avx2" in features and not features & VNNI_OR_AMX:
        assert not verdicts["dynamic-u8s8"].exact, verdicts["dynamic-u8s8"].describe()
        assert int8_kernels.dynamic_weight_max(verdicts) == 64
    else:
        pytest.skip(f"no expectation for INT8 ISA features {sorted(features)}")


@pytest.mark.int8_numeric
@pytest.mark.parametrize("pattern", int8_kernels.DYNAMIC_PATTERNS)
def test_a_dynamic_kernel_off_by_half_is_saturating(pattern):
    assert not int8_kernels.probe_dynamic_pattern(pattern, 64, _Halving).exact
    assert int8_kernels.probe_dynamic_pattern(pattern, 64, _probe_session).exact


def _force_dynamic(monkeypatch: pytest.MonkeyPatch, saturating: set[str]) -> None:
    """Makes the dynamic probe find the forms in ``saturating`` (``dynamic-u8s8``, ...) wrong, the others exact."""

    def forced(pattern, weight_max, session):
        wrong = int8_kernels.dynamic_name(weight_max) in saturating
        return PatternResult(pattern, not wrong, 0.494 if wrong else 0.0)

    monkeypatch.setattr(int8_kernels, "probe_dynamic_pattern", forced)


@pytest.mark.parametrize(
    ("saturating", "weight_max"),
    [(set(), 127), ({"dynamic-u8s8"}, 64), ({"dynamic-u8s8", "dynamic-u8s7"}, None)],
)
def test_dynamic_is_offered_for_matmul_and_gemm_with_the_exact_weight_range(monkeypatch, saturating, weight_max):
    force_verdicts(monkeypatch, {"u8s8"})
    _force_dynamic(monkeypatch, saturating)
    backend = OnnxRuntimeCPU(1)
    capabilities = backend.capabilities()
    offered = {
        op for op in ("MatMul", "Gemm", "Conv", "ConvTranspose") if "int8-dynamic" in capabilities.precisions_for(op)
    }
    assert offered == (set() if weight_max is None else {"MatMul", "Gemm"})
    assert capabilities.precisions_for("Conv") == ("fp32", "int8")
    assert backend.recipe.dynamic_weight_max == (weight_max or 64)
    assert backend.int8_arithmetic()["dynamic"]["dynamic-u8s8"].startswith(
        "dynamic-u8s8: saturating" if saturating else "dynamic-u8s8: exact"
    )


def test_dynamic_is_a_uniform_plan_and_no_other_backend_offers_it(monkeypatch):
    from autotune.config.schema import SearchSpaceConfig
    from autotune.search.space import build_space

    force_verdicts(monkeypatch, {"u8s8"})
    _force_dynamic(monkeypatch, {"dynamic-u8s8"})
    space = tiny_space(forms=True)
    plan = resolve_plan("int8-dynamic", space)
    assert set(plan.precision_map.values()) == {"int8-dynamic"}  # tiny_mlp's layers are all MatMuls
    assert set(resolve_plan("int8", space).precision_map.values()) == {"int8"}
    # Another backend's capabilities (no int8-dynamic): a config asking for it gets FP32 and INT8 only.
    from autotune.capabilities import Capabilities

    other = Capabilities(precisions={"MatMul": ("fp32", "int8"), "Gemm": ("fp32", "int8")})
    layers = space.layers
    assert all(
        "int8-dynamic" not in choices
        for choices in build_space(layers, other, SearchSpaceConfig(precisions=["int8", "int8-dynamic"])).choices
    )


@pytest.mark.int8_numeric
def test_a_dynamic_plan_builds_with_the_probed_weight_range(tmp_path):
    loaded, ranges, feeds = _prepared("mlp")
    backend = OnnxRuntimeCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make({layer.name: "int8-dynamic" for layer in loaded.layers if layer.op_type == "MatMul"})
    artifact = backend.build(plan, Quantization(ranges), tmp_path)
    weights = [numpy_helper.to_array(i) for i in artifact.graph.graph.initializer if i.name.endswith("W_quantized")]
    assert weights and max(int(np.abs(w.astype(np.int16)).max()) for w in weights) == backend.recipe.dynamic_weight_max
    fused = {node.op_type for node in backend.optimized_model(artifact.graph, {}).graph.node}
    assert "DynamicQuantizeMatMul" in fused and "MatMul" not in fused
    backend.export(artifact, plan, tmp_path / "export")
    session = json.loads((tmp_path / "export" / "session.json").read_text())
    weight_max = backend.recipe.dynamic_weight_max
    assert session["int8_dynamic_weight_range"] == [-weight_max, weight_max]
