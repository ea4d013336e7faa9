"""Module rewrites and their numerics: the wrappers against fake-quant references, and the static scales.

The GPU test (``-m gpu``) skips without CUDA.
"""

import numpy as np
import pytest
import torch
from torch import nn

from autotune.backends import BuildError
from autotune.backends.torch import (
    ModuleChoice,
    activation_scale,
    module_choices,
    probe_device,
    rewrite_module,
)
from autotune.model.layers import Layer
from autotune.plan import Plan
from autotune.quant.qparams import activation_qparams, fake_quant, fp8_activation_scale
from autotune.testing import tiny_torch_cnn, tiny_torch_mlp

CPU_OPS = probe_device("cpu").ops


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_rewrite_replaces_the_chosen_modules_and_leaves_the_original_alone():
    module = tiny_torch_mlp()
    before = _state(module)
    rewritten = rewrite_module(module, {"fc1": ModuleChoice("int8", (-3.0, 3.0)), "fc2": ModuleChoice("bf16")})
    assert type(rewritten.fc1).__name__ == "Int8Linear" and type(rewritten.fc2).__name__ == "CastLayer"
    assert rewritten.fc2.layer.weight.dtype == torch.bfloat16
    assert type(module.fc1) is nn.Linear and type(module.fc2) is nn.Linear
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    partial = rewrite_module(module, {"fc2": ModuleChoice("fp16")})
    assert type(partial.fc1) is nn.Linear and torch.equal(partial.fc1.weight, module.fc1.weight)
    cnn = rewrite_module(tiny_torch_cnn(), {"stem.0": ModuleChoice("fp16"), "head": ModuleChoice("int8", (-1, 1))})
    assert type(cnn.stem[0]).__name__ == "CastLayer" and type(cnn.conv2) is nn.Conv2d
    out = cnn(torch.randn(2, 3, 16, 16))
    assert out.dtype == torch.float32 and out.shape == (2, 16)
    with pytest.raises(BuildError, match="nn.Linear only"):
        rewrite_module(tiny_torch_cnn(), {"conv2": ModuleChoice("int8", (-1.0, 1.0))})


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_unaligned_features_are_zero_padded_and_exact(precision):
    if precision == "fp8" and "fp8_tensorwise" not in CPU_OPS:
        pytest.skip(f"torch._scaled_mm does not run on this CPU (torch {torch.__version__})")
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(30, 10))  # neither 30 nor 10 is a multiple of 8 (int8 GEMM) or 16 (fp8 GEMM)
    x = torch.randn(5, 30).numpy()
    rewritten = rewrite_module(odd, {"0": ModuleChoice(precision, (-3.0, 3.0))}, fp8_scaling="tensorwise")
    wrapper = rewritten[0]
    assert tuple(wrapper.weight_q.shape) == ((16, 32) if precision == "int8" else (16, 32))
    assert not wrapper.weight_q.float()[10:].any() and not wrapper.weight_q.float()[:, 30:].any()
    scale = activation_scale(-3.0, 3.0, precision)
    expected = _fake_quant_linear(odd[0], x, scale, "int8" if precision == "int8" else "float8e4m3fn", True)
    got = rewritten(torch.from_numpy(x)).detach().numpy()
    assert got.shape == (5, 10)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def _fake_quant_linear(linear, x, act_scale, dtype, per_channel):
    w = linear.weight.detach().numpy()
    limit = 127.0 if dtype == "int8" else 448.0
    amax = np.abs(w).max(axis=1) if per_channel else np.full(w.shape[0], np.abs(w).max())
    w_scale = (amax / np.float32(limit)).astype(np.float32)
    xq = fake_quant(x, act_scale, 0, dtype)
    wq = fake_quant(w, w_scale, 0, dtype, axis=0)
    return xq @ wq.T + linear.bias.detach().numpy()


def _linear_and_input(seed=0):
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(32, 64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 32, generator=generator) * 0.2)
        linear.weight[:, 0] *= 10  # an outlier input channel: per-tensor scales lose against per-channel
    x = (torch.randn(2, 5, 32, generator=generator) * 1.5).numpy()
    return linear, x


@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_wrapper_matches_fake_quant_reference(per_channel):
    linear, x = _linear_and_input()
    lo, hi = -4.0, 3.0
    wrapped = rewrite_module(nn.Sequential(linear), {"0": ModuleChoice("int8", (lo, hi))}, per_channel)[0]
    scale = activation_qparams(lo, hi, "int8")[0]
    assert wrapped.act_scale.item() == pytest.approx(float(scale), rel=1e-7)  # 4 / 127
    got = wrapped(torch.from_numpy(x)).detach().numpy()
    expected = _fake_quant_linear(linear, x, scale, "int8", per_channel)
    assert got.shape == (2, 5, 64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - x @ linear.weight.detach().numpy().T - linear.bias.detach().numpy()).max() > 1e-3


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_fp8_wrapper_matches_fake_quant_reference(scaling):
    if f"fp8_{scaling}" not in CPU_OPS:
        pytest.skip(f"torch._scaled_mm with {scaling} scales does not run on this CPU (torch {torch.__version__})")
    linear, x = _linear_and_input(1)
    lo, hi = -5.0, 4.0
    choice = {"0": ModuleChoice("fp8", (lo, hi))}
    wrapped = rewrite_module(nn.Sequential(linear), choice, per_channel=True, fp8_scaling=scaling)[0]
    scale = fp8_activation_scale(lo, hi)
    assert wrapped.act_scale.item() == pytest.approx(float(scale), rel=1e-7)  # 5 / 448
    got = wrapped(torch.from_numpy(x)).detach().numpy()
    expected = _fake_quant_linear(linear, x, scale, "float8e4m3fn", True)
    # rowwise kernels write bfloat16 (8 bits of mantissa); tensorwise writes float32
    rtol, atol = (1e-2, 2e-2) if scaling == "rowwise" else (1e-5, 1e-4)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_wrappers_stay_close_to_fp32(precision):
    if precision not in CPU_OPS:
        pytest.skip(f"{precision} does not run on this CPU")
    module = tiny_torch_cnn()
    x = torch.randn(2, 3, 16, 16)
    choices = {path: ModuleChoice(precision) for path in ("stem.0", "conv2", "head")}
    rewritten = rewrite_module(module, choices)
    expected, got = module(x).detach(), rewritten(x).detach()
    assert got.dtype == torch.float32
    tolerance = 2e-2 if precision == "bf16" else 2e-3
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def _layer(name, tensor, op_type="Gemm"):
    return Layer(name, op_type, 0, (tensor,), "w", 0, None, "y", ((4, 32),), (4, 32), 0, 0, 1)


def test_static_scales_come_from_the_calibrated_ranges():
    assert activation_scale(-2.0, 6.0, "int8") == pytest.approx(6 / 127, rel=1e-6)
    assert activation_scale(-2.0, 6.0, "fp8") == pytest.approx(6 / 448, rel=1e-6)
    assert activation_scale(0.0, 0.0, "int8") == 1.0  # a constant-zero input keeps a positive scale
    layers = [_layer("/shared/Gemm", "a"), _layer("/shared_1/Gemm", "b"), _layer("/fc/Gemm", "c")]
    bindings = {"/shared/Gemm": "shared", "/shared_1/Gemm": "shared", "/fc/Gemm": "fc"}
    ranges = {"a": (-1.0, 2.0), "b": (-3.0, 1.0), "c": (0.0, 5.0)}
    plan = Plan.make({"/shared/Gemm": "int8", "/shared_1/Gemm": "int8", "/fc/Gemm": "fp16"})
    choices = module_choices(plan, layers, bindings, ranges)
    assert choices == {"shared": ModuleChoice("int8", (-3.0, 2.0)), "fc": ModuleChoice("fp16")}  # the union
    assert module_choices(Plan.make({"/fc/Gemm": "fp32"}), layers, bindings, ranges) == {}
    with pytest.raises(BuildError, match="need one precision"):
        module_choices(Plan.make({"/shared/Gemm": "int8", "/shared_1/Gemm": "fp16"}), layers, bindings, ranges)
    with pytest.raises(BuildError, match="no calibrated range for 'c'"):
        module_choices(Plan.make({"/fc/Gemm": "int8"}), layers, bindings, {})
    with pytest.raises(BuildError, match="has no module"):
        module_choices(Plan.make({"/fc/Gemm": "int8"}), layers, {}, ranges)


# ---- the GPU (skipped without CUDA) -------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [8, 32])  # 8 rows: padded for torch._int_mm (> 16) and torch._scaled_mm (x 16)
@pytest.mark.parametrize("features", [(32, 64), (30, 10)])  # (30, 10): zero-padded to the GEMMs' multiples
def test_gpu_int8_and_fp8_numerics(rows, features):
    info = probe_device("cuda")
    torch.manual_seed(0)
    linear = nn.Linear(*features)
    x = np.random.default_rng(0).standard_normal((rows, features[0])).astype(np.float32)
    lo, hi = -3.0, 3.0
    precisions = ["int8"] + (["fp8"] if info.capability >= (8, 9) and info.fp8_scaling else [])
    for precision in precisions:
        choice = {"0": ModuleChoice(precision, (lo, hi))}
        wrapped = rewrite_module(nn.Sequential(linear), choice, True, info.fp8_scaling)[0].cuda()
        with torch.no_grad():
            got = wrapped(torch.from_numpy(x).cuda()).cpu().numpy()
        assert got.shape == (rows, features[1])
        dtype = "int8" if precision == "int8" else "float8e4m3fn"
        expected = _fake_quant_linear(linear, x, activation_scale(lo, hi, precision), dtype, True)
        rtol, atol = (1e-4, 1e-4) if precision == "int8" else (1e-2, 2e-2)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=precision)
