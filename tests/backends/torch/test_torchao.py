"""torchao's static INT8/FP8 configs as the torch backend's quantized Linears (``quantized_gemm: torchao``).

torchao runs its static configs on the CPU too (eager), so the rewrite, the numbers against our own wrappers, the
backend option and the export are tested here; ``-m gpu`` builds them compiled with a CUDA graph.
"""

import sys

import numpy as np
import pytest
import torch

from autotune.backends import BackendUnavailable, BuildError
from autotune.backends.torch import ModuleChoice, TorchBackend, load_exported, rewrite_module
from autotune.backends.torch import torchao_linear as ao
from autotune.config.schema import BackendConfig, TorchOptions
from autotune.harness import TrialRunner
from autotune.testing import tiny_torch_config, tiny_torch_mlp

pytest.importorskip("torchao")

RANGE = (-4.0, 4.0)


def _run(module, x):
    with torch.no_grad():
        return module(x).float()


def test_torchao_int8_quantizes_with_our_activation_scale_and_errs_like_our_wrapper():
    module, x = tiny_torch_mlp(), torch.randn(3, 5, 32)  # 3-D input: torchao needs the 2-D view
    choices = {"fc1": ModuleChoice("int8", RANGE), "fc2": ModuleChoice("int8", (-3.0, 3.0))}
    ours = rewrite_module(module, choices)
    theirs = rewrite_module(module, choices, quantized_gemm="torchao")
    assert type(theirs.fc1).__name__ == "TorchaoLinear" and type(ours.fc1).__name__ == "Int8Linear"
    weight = theirs.fc1.linear.weight
    assert type(weight).__name__ == "Int8Tensor"
    assert float(weight.act_quant_scale) == pytest.approx(float(ours.fc1.act_scale))
    # torchao's symmetric weight scale is amax / 127.5 (codes -128..127), ours amax / 127: the same per row
    # up to that factor.
    ratio = weight.scale.flatten() / ours.fc1.weight_scale
    assert torch.allclose(ratio, torch.full_like(ratio, 127 / 127.5), rtol=1e-5)
    reference = _run(module, x)
    error_theirs = (_run(theirs, x) - reference).abs().mean()
    error_ours = (_run(ours, x) - reference).abs().mean()
    assert 1e-4 < error_theirs < 1.5 * error_ours  # quantized (not FP32 passed through), and as close


def test_torchao_per_tensor_weights_have_one_scale():
    module, x = tiny_torch_mlp(), torch.randn(16, 32)
    choices = {"fc1": ModuleChoice("int8", RANGE)}
    per_row = rewrite_module(module, choices, per_channel=True, quantized_gemm="torchao")
    per_tensor = rewrite_module(module, choices, per_channel=False, quantized_gemm="torchao")
    assert per_row.fc1.linear.weight.scale.numel() == 64 and per_tensor.fc1.linear.weight.scale.numel() == 1
    assert not torch.allclose(_run(per_row, x), _run(per_tensor, x))


def test_the_static_activation_scale_is_the_calibrated_one():
    module, x = tiny_torch_mlp(), 3 * torch.randn(16, 32)
    narrow = _run(rewrite_module(module, {"fc1": ModuleChoice("int8", (-0.5, 0.5))}, quantized_gemm="torchao"), x)
    wide = _run(rewrite_module(module, {"fc1": ModuleChoice("int8", (-20.0, 20.0))}, quantized_gemm="torchao"), x)
    reference = _run(module, x)
    # A range far narrower than the data clips it: a static scale, not one measured per call.
    assert (narrow - reference).abs().mean() > 3 * (wide - reference).abs().mean()


@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_torchao_fp8_runs_in_the_base_precision(base):
    module, x = tiny_torch_mlp(), torch.randn(4, 32)
    rewritten = rewrite_module(module, {"fc2": ModuleChoice("fp8", RANGE)}, base=base, quantized_gemm="torchao")
    inner = rewritten.model.fc2 if base != "fp32" else rewritten.fc2
    assert type(inner.linear.weight).__name__ == "PrototypeFloat8Tensor"
    assert inner.compute_dtype == (torch.bfloat16 if base == "bf16" else torch.float32)
    got, reference = _run(rewritten, x), _run(module, x)
    assert got.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(got.ravel(), reference.ravel(), dim=0)
    assert 0.99 < cosine < 1.0


def test_the_wrappers_stay_the_default_and_the_option_is_validated():
    assert TorchOptions().quantized_gemm == "autotune"
    config = BackendConfig.model_validate({"name": "torch", "options": {"device": "cpu", "quantized_gemm": "torchao"}})
    assert config.options.quantized_gemm == "torchao"
    with pytest.raises(ValueError, match="quantized_gemm"):
        BackendConfig.model_validate({"name": "torch", "options": {"quantized_gemm": "cutlass"}})


def test_a_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # found and imported as if not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(BackendUnavailable, match=r"'torchao' extra: pip install 'autotune\[torchao\]'"):
        TorchBackend("autotune.testing:tiny_torch_mlp", TorchOptions(device="cpu", quantized_gemm="torchao"))
    TorchBackend("autotune.testing:tiny_torch_mlp", TorchOptions(device="cpu"))  # the wrappers need no torchao


def test_torchao_is_for_linear_only():
    with pytest.raises(BuildError, match="nn.Linear only"):
        ao.wrap_for_torchao(torch.nn.Conv2d(3, 3, 1), torch.float32)


def test_a_plan_builds_measures_and_exports_with_torchao(tmp_path):
    config = tiny_torch_config(tmp_path / "data")
    options = TorchOptions(device="cpu", quantized_gemm="torchao")
    config = config.model_copy(update={"backend": config.backend.model_copy(update={"options": options})})
    runner = TrialRunner(config)
    plan = runner.space.uniform("int8")
    result = runner.run(plan)
    assert result.status == "ok", result.error
    artifact = runner.build(plan, tmp_path / "build")
    assert {type(m).__name__ for m in artifact.module.modules()} >= {"TorchaoLinear"}
    out = tmp_path / "export"
    runner.backend.export(artifact, plan, out)
    rebuilt = load_exported(out, "cpu")
    x = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    expected = runner.backend.run(artifact, {"x": x})[0]
    got = _run(rebuilt, torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_torchao_plans_build_compiled_with_a_cuda_graph(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU and a CUDA torch)")
    config = tiny_torch_config(tmp_path / "data", device="cuda")
    options = TorchOptions(device="cuda", quantized_gemm="torchao")
    config = config.model_copy(update={"backend": config.backend.model_copy(update={"options": options})})
    runner = TrialRunner(config)
    for precision in ("int8", "fp8"):
        if precision not in runner.space.choices[0]:
            continue
        plan = runner.space.uniform(precision).with_knobs(mode="compile", cuda_graphs=True, base_precision="bf16")
        result = runner.run(plan)
        assert result.status == "ok", f"{precision}: {result.error}"
        assert result.accuracy_drop is not None and result.accuracy_drop <= 0.05
