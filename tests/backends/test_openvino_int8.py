"""OpenVINO's INT8 probed as ONNX Runtime's is: the scheme its CPU plugin computes exactly, and builds that match it.

The forced-verdict tests hold on any CPU: they replace the probe's verdict and check that the lowering follows it
(7-bit weights where 8-bit ones saturate). The ``int8_numeric`` tests run the real probe and compare the CPU
plugin's INT8 outputs with numpy's exact arithmetic of the chosen scheme; ``make test-haswell`` runs them under
``qemu-x86_64 -cpu Haswell``, where OpenVINO dispatches its AVX2 kernels, whose u8 x s8 pairs saturate int16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

pytest.importorskip("openvino")

from autotune.backends import int8_kernels  # noqa: E402
from autotune.backends.int8_kernels import PATTERNS, isa_features, reduced_range  # noqa: E402
from autotune.backends.openvino import OPENVINO_RECIPE, OPENVINO_SCHEMES, OpenVINOCPU  # noqa: E402
from autotune.model.layers import prepare_model  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.quant.lowering import Quantization  # noqa: E402
from tests.backends.test_int8_kernels import force_verdicts, int8_weights, weight_dtypes  # noqa: E402
from tests.quant.reference import BUILDERS, RNG_SEED, forward, int8_reference, random_feeds  # noqa: E402

VNNI_OR_AMX = {"avx512_vnni", "avx_vnni", "amx_int8"}
OPENVINO_7BIT = reduced_range(OPENVINO_RECIPE)


def _built(kind: str, tmp_path: Path):
    """An all-INT8 plan of a test model built by the OpenVINO backend, its outputs and what the reference needs."""
    rng = np.random.default_rng(RNG_SEED)
    loaded = prepare_model(BUILDERS[kind](rng), Path("x.onnx"), None)
    calib = forward(loaded.proto, random_feeds(loaded.proto, rng))
    ranges = {name: (min(float(v.min()), 0.0), max(float(v.max()), 0.0)) for name, v in calib.items()}
    feeds = random_feeds(loaded.proto, rng)
    backend = OpenVINOCPU(1)
    backend.prepare(loaded, loaded.layer_names)
    plan = Plan.make(dict.fromkeys(loaded.layer_names, "int8"))
    artifact = backend.build(plan, Quantization(ranges), tmp_path)
    got = dict(zip(loaded.output_names, backend.run(artifact, feeds), strict=True))
    return backend, artifact, got, (loaded.proto, loaded.layers, plan, ranges, feeds)


def _assert_matches(got, expected, kind):
    """Equal but for the float rescale; a Conv's requantization may move a rounding tie by one output step."""
    for name, value in got.items():
        magnitude = float(np.abs(expected[name]).max())
        err = np.abs(value - expected[name])
        if kind == "cnn":
            assert np.mean(err > 1e-4 * magnitude) < 0.1 and err.max() < 0.02 * magnitude, (name, err.max())
        else:
            np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-4 * magnitude, err_msg=name)


@pytest.mark.int8_numeric
def test_the_probe_finds_what_the_cpu_features_say_on_openvino():
    """VNNI or AMX: 8-bit int8 weights are exact. AVX2 without them (qemu -cpu Haswell too): MatMul, Gemm and Conv
    saturate. 7-bit weights are exact on every x86 CPU."""
    verdicts = OpenVINOCPU(1).int8_verdicts()
    assert list(verdicts) == ["u8s8", "u8s7"]
    assert verdicts["u8s7"].exact, verdicts["u8s7"].describe()
    features = set(isa_features())
    if features & VNNI_OR_AMX:
        assert verdicts["u8s8"].exact, verdicts["u8s8"].describe()
    elif "avx2" in features:
        wrong = {result.pattern for result in verdicts["u8s8"].results if not result.exact}
        assert {"MatMul", "Gemm", "Conv"} <= wrong, verdicts["u8s8"].describe()
    else:
        pytest.skip(f"no expectation for INT8 ISA features {sorted(features)}")


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm"])
def test_the_probed_scheme_computes_its_exact_reference(tmp_path, kind):
    backend, artifact, got, (model, layers, plan, ranges, feeds) = _built(kind, tmp_path)
    recipe = backend.recipe
    assert backend.int8_verdicts()[backend.int8_arithmetic()["scheme"]].exact
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == recipe.weight_max
    _assert_matches(got, int8_reference(model, layers, plan, ranges, recipe, feeds), kind)


@pytest.mark.int8_numeric
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gemm"])
def test_saturating_8bit_weights_lower_to_7bit_weights_that_compute_the_7bit_reference(monkeypatch, tmp_path, kind):
    force_verdicts(monkeypatch, saturating={"u8s8"})
    backend, artifact, got, (model, layers, plan, ranges, feeds) = _built(kind, tmp_path)
    assert backend.recipe == OPENVINO_7BIT
    assert weight_dtypes(artifact.graph.graph) == {"int8"}
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == 64
    _assert_matches(got, int8_reference(model, layers, plan, ranges, OPENVINO_7BIT, feeds), kind)
    # The 8-bit reference is another result: a lowering that kept 8-bit weights could not pass the check above.
    eight = int8_reference(model, layers, plan, ranges, OPENVINO_RECIPE, feeds)
    assert any(np.abs(got[name] - eight[name]).max() > 1e-3 * np.abs(eight[name]).max() for name in got)
    arithmetic = backend.int8_arithmetic()
    assert arithmetic["scheme"] == "u8s7" and arithmetic["weight_range"] == [-64, 64]
    assert arithmetic["exact"] == ["u8s7"]
    assert arithmetic["verdicts"]["u8s8"].startswith("u8s8: saturating")


def test_no_matmul_of_an_openvino_int8_plan_reads_a_zero_point_of_zero(tmp_path):
    """The mlp's second MatMul reads a Relu's output, whose range starts at 0 (zero point 0 elsewhere)."""
    _, artifact, _, _ = _built("mlp", tmp_path)
    zero_points = {
        init.name: int(numpy_helper.to_array(init))
        for init in artifact.graph.graph.initializer
        if "__zp__" in init.name and numpy_helper.to_array(init).dtype == np.uint8
    }
    assert "r__zp__mm2" in zero_points and min(zero_points.values()) >= 1, zero_points


def test_an_exact_verdict_keeps_8bit_weights(monkeypatch, tmp_path):
    force_verdicts(monkeypatch, saturating=set())
    backend, artifact, _, _ = _built("mlp", tmp_path)
    assert backend.recipe == OPENVINO_RECIPE
    assert max(int(np.abs(w).max()) for w in int8_weights(artifact.graph.graph)) == 127
    assert backend.int8_arithmetic()["scheme"] == "u8s8"


def test_no_exact_scheme_is_an_error_that_names_the_verdicts(monkeypatch):
    force_verdicts(monkeypatch, saturating={"u8s8", "u8s7"})
    with pytest.raises(RuntimeError, match="no INT8 scheme computes exactly.*u8s8: saturating.*u8s7: saturating"):
        _ = OpenVINOCPU(1).recipe


def test_the_verdict_is_probed_once_per_process(monkeypatch):
    force_verdicts(monkeypatch, saturating={"u8s8"})
    calls = []
    forced = int8_kernels.probe_pattern
    monkeypatch.setattr(int8_kernels, "probe_pattern", lambda *args: calls.append(args[0]) or forced(*args))
    assert OpenVINOCPU(1).recipe == OpenVINOCPU(2).recipe == OPENVINO_7BIT
    assert sorted(calls) == sorted(PATTERNS * len(OPENVINO_SCHEMES))
