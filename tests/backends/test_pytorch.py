"""The torch backend: layer mapping, capabilities, module rewrites and their numerics, a CPU trial end to end.

The CPU tests run eager; the GPU tests (``-m gpu``) skip without CUDA.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from autotune.api import analyze
from autotune.backends import BackendUnavailable, BuildError, get_backend
from autotune.backends import pytorch as tb
from autotune.backends.pytorch import (
    DeviceInfo,
    ModuleChoice,
    TorchBackend,
    activation_scale,
    bind_layers,
    load_exported,
    module_choices,
    module_path,
    resolve_module_path,
    rewrite_module,
    torch_capabilities,
)
from autotune.config import BackendConfig, ModelConfig
from autotune.evaluate import SetupError, TrialRunner
from autotune.model import InputSpec, Layer, export_torch, load_onnx, prepare_model, weight_array
from autotune.plan import Plan
from autotune.quant.qparams import activation_qparams, fake_quant, fp8_activation_scale
from autotune.testing import tiny_torch_cnn, tiny_torch_config, tiny_torch_mlp

FACTORY = "autotune.testing:tiny_torch_mlp"
HERE = "tests.backends.test_pytorch"
CPU_OPS = tb.probe_device("cpu").ops


# ---- factories exported through the real TorchScript exporter -------------------------------------------------


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class _Nested(nn.Module):
    """Nested scopes: a ModuleList, nested Sequentials, a module called twice, a Conv and a 2-D Linear."""

    def __init__(self):
        super().__init__()
        self.enc = _Inner()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)))
        self.shared = nn.Linear(16, 16)
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 8)

    def forward(self, x, image):
        y = self.shared(self.shared(self.net(self.enc(x))))
        return y, self.head(self.conv(image).mean((2, 3)))


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        return x @ self.weight


class _Unmappable(nn.Module):
    """A Linear, a weight MatMul that is no nn.Linear, and an activation x activation MatMul."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.custom = _Custom()

    def forward(self, x):
        h = self.fc(x)
        scores = h @ h.transpose(-1, -2)
        return self.custom(scores @ h)


def _seeded(cls, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls().eval()


def nested_net():
    return _seeded(_Nested)


def unmappable_net():
    return _seeded(_Unmappable)


def _exported(tmp_path, factory, inputs, activation_matmuls=False):
    path = export_torch(f"{HERE}:{factory}", inputs, tmp_path / f"{factory}.onnx")
    return prepare_model(load_onnx(path), path, inputs, activation_matmuls)


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    inputs = [InputSpec("x", (2, 5, 32), "float32"), InputSpec("image", (1, 3, 8, 8), "float32")]
    return _exported(tmp_path_factory.mktemp("nested"), "nested_net", inputs)


# ---- importing ----------------------------------------------------------------------------------------------


def test_importing_autotune_and_the_backend_does_not_import_torch():
    code = "import sys, autotune, autotune.backends.pytorch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# ---- ONNX layers -> modules ---------------------------------------------------------------------------------


def test_module_path_reads_the_exporter_scopes():
    assert module_path("/encoder/encoder/layer.0/attention/self/query/MatMul") == (
        "encoder.encoder.layer.0.attention.self.query"
    )
    assert module_path("/fc1/Gemm") == "fc1"
    assert module_path("/stem/conv/Conv") == "stem.conv"
    assert module_path("/MatMul") == ""


def test_resolve_module_path_handles_sequentials_lists_and_reuse():
    names = {"", "enc", "enc.proj", "enc.blocks", "enc.blocks.0", "net", "net.0", "net.2", "net.2.0", "shared"}
    assert resolve_module_path("/enc/proj/MatMul", names) == "enc.proj"
    assert resolve_module_path("/enc/blocks.0/MatMul", names) == "enc.blocks.0"
    assert resolve_module_path("/net/net.0/MatMul", names) == "net.0"
    assert resolve_module_path("/net/net.2/net.2.0/MatMul", names) == "net.2.0"
    assert resolve_module_path("/shared_1/MatMul", names) == "shared"  # a module called twice
    assert resolve_module_path("/missing/MatMul", names) is None
    assert resolve_module_path("fc1", names) is None  # a hand-written ONNX name


def test_every_layer_of_a_real_export_maps_onto_its_module(nested):
    module = nested_net()
    bound = bind_layers(module, nested.layers, set(nested.layer_names), lambda n: weight_array(nested.proto, n))
    assert sorted(bound.values()) == sorted(
        ["enc.proj", "enc.blocks.0", "enc.blocks.1", "net.0", "net.2.0", "shared", "conv", "head"]
    )
    ops = {layer.name: layer.op_type for layer in nested.layers}
    assert {ops[name] for name, path in bound.items() if path == "enc.proj"} == {"MatMul"}  # 3-D input
    assert {ops[name] for name, path in bound.items() if path == "head"} == {"Gemm"}
    # `shared` runs twice; the exporter routes its second call's weight through an Identity, so only the first
    # call is a tunable layer, and one static scale calibrated on it would clip the second call's input.
    calls = tb.count_calls(module, nested.inputs, set(bound.values()))
    assert calls["shared"] == 2 and calls["head"] == 1
    shared = next(name for name, path in bound.items() if path == "shared")
    others = set(nested.layer_names) - {shared}
    assert "shared" not in bind_layers(module, nested.layers, others, calls=calls).values()
    with pytest.raises(ValueError, match="'shared' runs 2 times.*search.exclude_layers"):
        bind_layers(module, nested.layers, {shared}, calls=calls)
    with pytest.raises(ValueError, match="factory must return the same weights"):
        bind_layers(_seeded(_Nested, seed=1), nested.layers, set(), lambda n: weight_array(nested.proto, n))


def test_unmappable_searched_layers_fail_at_setup_naming_exclude_layers(tmp_path):
    model = _exported(tmp_path, "unmappable_net", [InputSpec("x", (4, 32), "float32")], activation_matmuls=True)
    module = unmappable_net()
    unmappable = [layer.name for layer in model.layers if layer.weight is None or "/custom/" in layer.name]
    assert len(unmappable) == 3
    with pytest.raises(ValueError, match="search.exclude_layers") as raised:
        bind_layers(module, model.layers, set(model.layer_names))
    message = str(raised.value)
    assert all(name in message for name in unmappable)
    assert "activation x activation" in message and "not nn.Linear" in message
    # The same layers left out of the search are just skipped.
    assert list(bind_layers(module, model.layers, {"/fc/Gemm"}).values()) == ["fc"]


def test_setup_names_exclude_layers(tmp_path):
    config = tiny_torch_config(
        tmp_path,
        model={"torch": f"{HERE}:unmappable_net", "include_activation_matmuls": True},
        inputs=[{"name": "x", "shape": [4, 32], "dtype": "float32"}],
        data={split: {"random": 1} for split in ("calibration", "evaluation")},
        metric={"name": "cosine"},
    )
    with pytest.raises(SetupError, match="cannot map 3 searched layers.*search.exclude_layers"):
        TrialRunner(config)
    with pytest.raises(SetupError, match="cannot map 3 searched layers"):
        analyze(config)  # `autotune tune` and `inspect` fail before a run directory exists


# ---- capabilities -------------------------------------------------------------------------------------------

ALL_OPS = frozenset({"fp16", "bf16", "int8", "fp8_rowwise", "fp8_tensorwise", "compile", "gemm_backends"})


def _cuda(capability, ops=ALL_OPS):
    return DeviceInfo("cuda", "2.11.0", True, capability, "gpu", frozenset(ops))


def test_fp8_needs_compute_capability_8_9():
    ampere = torch_capabilities(_cuda((8, 0)))
    assert ampere.precisions_for("MatMul") == ("fp32", "fp16", "bf16", "int8")
    assert ampere.precisions_for("Gemm") == ampere.precisions_for("MatMul")
    for capability in ((8, 9), (9, 0)):
        assert torch_capabilities(_cuda(capability)).precisions_for("MatMul")[-1] == "fp8"
    assert "fp8" not in torch_capabilities(_cuda((9, 0), ALL_OPS - {"fp8_rowwise", "fp8_tensorwise"})).precisions_for(
        "MatMul"
    )
    assert "int8" not in torch_capabilities(_cuda((9, 0), ALL_OPS - {"int8"})).precisions_for("MatMul")


def test_conv_takes_floats_only_and_bf16_needs_ampere():
    for capability in ((7, 5), (8, 0), (9, 0)):
        conv = torch_capabilities(_cuda(capability)).precisions_for("Conv")
        assert "int8" not in conv and "fp8" not in conv
    assert torch_capabilities(_cuda((9, 0))).precisions_for("Conv") == ("fp32", "fp16", "bf16")
    turing = torch_capabilities(_cuda((7, 5)))
    assert turing.precisions_for("Conv") == ("fp32", "fp16")
    assert "tf32" not in {k.name for k in turing.knobs}  # no TF32 units before Ampere
    assert turing.precisions_for("ConvTranspose") == ("fp32",)


def test_cuda_knobs_and_their_defaults():
    knobs = {k.name: k for k in torch_capabilities(_cuda((9, 0))).knobs}
    assert list(knobs) == ["mode", "cuda_graphs", "gemm_backends", "tf32", "cudnn_benchmark"]
    assert knobs["mode"].values == ("compile", "eager", "max-autotune")
    assert knobs["cuda_graphs"].values == (True, False)
    assert knobs["gemm_backends"].values == ("ATEN", "ATEN,TRITON", "TRITON")
    assert knobs["tf32"].values == (False, True) and knobs["cudnn_benchmark"].values == (True, False)
    assert all(k.description for k in knobs.values())
    no_triton = {k.name: k for k in torch_capabilities(_cuda((9, 0), ALL_OPS - {"compile"})).knobs}
    assert no_triton["mode"].values == ("eager",) and "gemm_backends" not in no_triton


def test_cpu_has_no_cuda_knobs_and_offers_what_its_probe_found():
    info = DeviceInfo("cpu", "2.13.0+cpu", ops=frozenset({"fp16", "bf16", "int8"}))
    capabilities = torch_capabilities(info)
    assert [(k.name, k.values) for k in capabilities.knobs] == [("mode", ("eager",))]
    assert capabilities.precisions_for("MatMul") == ("fp32", "fp16", "bf16", "int8")
    assert capabilities.precisions_for("Conv") == ("fp32", "fp16", "bf16")
    assert "int8" in CPU_OPS  # torch._int_mm runs on the CPU


def test_cuda_probe_runs_in_a_child_process():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tests cover the probe")
    info = tb.probe_isolated("cuda")
    assert not info.available and info.torch_version == torch.__version__
    assert DeviceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


# ---- options and errors -------------------------------------------------------------------------------------


def test_onnx_only_configs_get_a_clear_error():
    with pytest.raises(BackendUnavailable, match="needs model.torch.*onnxruntime or tensorrt"):
        get_backend(BackendConfig(name="torch", options={"device": "cpu"}), ModelConfig(onnx=Path("model.onnx")))
    with pytest.raises(BackendUnavailable, match="needs model.torch"):
        get_backend(BackendConfig(name="torch"))


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"unknown keys \['devcie'\].*'device'"):
        TorchBackend(FACTORY, {"devcie": "cpu"})
    with pytest.raises(ValueError, match="'cuda', 'cuda:N' or 'cpu'"):
        TorchBackend(FACTORY, {"device": "tpu"})
    backend = get_backend(BackendConfig(name="torch", options={"device": "cpu"}), ModelConfig(torch=FACTORY))
    assert isinstance(backend, TorchBackend) and backend.device == "cpu"


def test_no_cuda_says_how_to_run_on_the_cpu(monkeypatch):
    monkeypatch.setattr(tb, "probe_device", lambda device: DeviceInfo(device, "2.13.0+cpu", available=False))
    with pytest.raises(BackendUnavailable, match="CPU-only build.*device: cpu"):
        TorchBackend(FACTORY)


# ---- rewrites and numerics ----------------------------------------------------------------------------------


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


# ---- a trial end to end on the CPU --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return TrialRunner(tiny_torch_config(tmp_path_factory.mktemp("torch-cpu")))


def test_knobs_are_validated(runner):
    backend = runner.backend
    assert backend.knob_values({"calibration": "max", "weight_granularity": "per_tensor"})["mode"] == "eager"
    with pytest.raises(BuildError, match="knob mode='compile' is not offered"):
        backend.knob_values({"mode": "compile"})
    with pytest.raises(BuildError, match="unknown knob 'tf32'"):
        backend.knob_values({"tf32": True})
    bad = runner.space.uniform("int8").with_knobs(mode="max-autotune")
    assert "not allowed" in runner.run(bad).error


def test_an_int8_trial_runs_and_exports_a_loadable_module(runner, tmp_path):
    plan = runner.space.uniform("int8")
    assert set(plan.precision_map.values()) == {"int8"}
    result = runner.run(plan)
    assert result.ok, result.error
    assert abs(result.accuracy_drop) <= 0.1 and result.fidelity["cosine"] > 0.99
    assert result.latency_ms > 0 and result.reference_latency_ms > 0
    fp32 = runner.backend.fp32_module()
    assert type(fp32.fc1) is nn.Linear and type(fp32.fc2) is nn.Linear  # builds rewrite copies

    files = [Path(f) for f in runner.export(plan, tmp_path / "export")]
    assert [f.name for f in files[:4]] == ["module_state.pt", "rebuild.py", "manifest.json", "plan.json"]
    assert files[4].name in ("exported.pt2", "export_notes.txt")
    assert Plan.from_json((tmp_path / "export" / "plan.json").read_text()) == plan
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["modules"] == {"fc1": "int8", "fc2": "int8"}
    feeds = runner.datasets["evaluation"].batches[0]
    expected = runner.backend.run(runner.build(plan, tmp_path), feeds)[0]
    module = load_exported(tmp_path / "export", "cpu")
    assert type(module.fc1).__name__ == "Int8Linear"
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(feeds["x"])).numpy(), expected)
    if files[4].name == "exported.pt2":
        program = torch.export.load(str(files[4]))
        np.testing.assert_allclose(program.module()(torch.from_numpy(feeds["x"])).detach().numpy(), expected)


def test_per_tensor_bf16_and_mixed_plans_build(runner):
    layers = runner.space.layer_names
    mixed = runner.space.plan({layers[0]: "bf16", layers[1]: "int8"}, {"weight_granularity": "per_tensor"})
    artifact = runner.build(mixed, runner.config.run_dir)
    assert artifact.choices == {"fc1": "bf16", "fc2": "int8"}
    feeds = runner.datasets["evaluation"].batches[0]
    assert runner.backend.time_run(artifact, feeds) > 0 and artifact.staged is feeds
    out = runner.backend.run(artifact, feeds)[0]
    assert out.dtype == np.float32 and out.shape == (32, 16)


# ---- the GPU (skipped without CUDA) -------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")


@pytest.fixture(scope="module")
def cuda_runner(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU and a CUDA torch)")
    return TrialRunner(tiny_torch_config(tmp_path_factory.mktemp("torch-cuda"), device="cuda"))


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.gpu
@needs_cuda
def test_gpu_probe_and_capabilities(cuda_runner):
    info = cuda_runner.backend.info
    assert info.available and info.capability is not None and {"fp16", "int8", "compile"} <= info.ops
    choices = cuda_runner.space.choices[0]
    assert "int8" in choices and ("fp8" in choices) == (info.capability >= (8, 9))
    assert [k.name for k in cuda_runner.space.knobs][2:4] == ["mode", "cuda_graphs"]


@pytest.mark.gpu
@needs_cuda
def test_gpu_compile_and_cuda_graph_builds_time_on_a_side_stream(cuda_runner):
    backend, space = cuda_runner.backend, cuda_runner.space
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    reference = cuda_runner.reference
    assert reference.graph is not None and reference.knobs["mode"] == "compile"
    expected = backend.run(reference, feeds)[0]
    for precision in [p for p in ("fp16", "bf16", "int8", "fp8") if p in space.choices[0]]:
        artifact = cuda_runner.build(space.uniform(precision), cuda_runner.config.run_dir)
        assert artifact.graph is not None and artifact.stream != torch.cuda.default_stream()
        got = backend.run(artifact, feeds)[0]
        assert got.shape == expected.shape and _cosine(got, expected) > 0.99, precision
        times = [backend.time_run(artifact, feeds) for _ in range(5)]
        assert all(0 < t < 1000 for t in times) and artifact.staged is feeds
    eager = cuda_runner.build(
        space.uniform("int8", {"mode": "eager", "cuda_graphs": False}), cuda_runner.config.run_dir
    )
    assert eager.graph is None and _cosine(backend.run(eager, feeds)[0], expected) > 0.99


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [8, 32])  # 8 rows: padded for torch._int_mm (> 16) and torch._scaled_mm (x 16)
@pytest.mark.parametrize("features", [(32, 64), (30, 10)])  # (30, 10): zero-padded to the GEMMs' multiples
def test_gpu_int8_and_fp8_numerics(rows, features):
    info = tb.probe_device("cuda")
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


@pytest.mark.gpu
@needs_cuda
def test_gpu_tf32_and_cudnn_flags_follow_each_artifact(cuda_runner):
    backend, space = cuda_runner.backend, cuda_runner.space
    if "tf32" not in {k.name for k in space.knobs}:
        pytest.skip("no TF32 on this GPU")
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    on = cuda_runner.build(space.uniform("fp32", {"tf32": True, "cudnn_benchmark": False}), cuda_runner.config.run_dir)
    off = cuda_runner.reference
    backend.run(on, feeds)
    assert tb.runtime_flags() == {"matmul_tf32": True, "cudnn_tf32": True, "cudnn_benchmark": False}
    backend.time_run(off, feeds)
    assert tb.runtime_flags() == {"matmul_tf32": False, "cudnn_tf32": False, "cudnn_benchmark": True}
    backend.time_run(on, feeds)
    assert tb.runtime_flags()["matmul_tf32"] is True


@pytest.mark.gpu
@needs_cuda
def test_gpu_trial_and_export(cuda_runner, tmp_path):
    plan = cuda_runner.space.uniform("int8")
    result = cuda_runner.run(plan)
    assert result.ok, result.error
    assert result.fidelity["cosine"] > 0.99 and result.latency_ms > 0
    files = cuda_runner.export(plan, tmp_path / "export")
    assert Path(files[0]).name == "module_state.pt"
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    expected = cuda_runner.backend.run(cuda_runner.build(plan, tmp_path), feeds)[0]
    module = load_exported(tmp_path / "export", "cuda")
    with torch.no_grad():
        got = module(torch.from_numpy(feeds["x"]).cuda()).float().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_gpu_max_autotune_with_gemm_backends(cuda_runner):
    knobs = {"mode": "max-autotune", "gemm_backends": "ATEN,TRITON"}
    artifact = cuda_runner.build(cuda_runner.space.uniform("fp16", knobs), cuda_runner.config.run_dir)
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    expected = cuda_runner.backend.run(cuda_runner.reference, feeds)[0]
    assert _cosine(cuda_runner.backend.run(artifact, feeds)[0], expected) > 0.99
    assert cuda_runner.backend.time_run(artifact, feeds) > 0


def test_a_search_on_the_torch_backend_starts_from_every_uniform_precision(tmp_path):
    from autotune.store import TrialStore
    from autotune.tune import tune

    config = tiny_torch_config(tmp_path, budget={"builds": 6})
    summary = tune(config, strategy="random", isolate=False, progress=False)
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        trials = list(store.trials())
    space = analyze(config, profile=False)[1]
    offered = [p for p in ("int8", "fp8", "fp16", "bf16") if any(p in c for c in space.choices)]
    assert len(offered) >= 3  # int8, fp16 and bf16 run on every CPU torch
    assert [t.plan for t in trials[: len(offered)]] == [space.uniform(p) for p in offered]
    assert len(trials) == 6 and summary["builds"] == 6
