"""SmoothQuant on the torch backend: exact folds in FP32, FP8/INT8 lowering on the CPU, and the layerwise choice."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional

from autotune.backends.torch import ModuleChoice, load_exported, probe_device, rewrite_module
from autotune.backends.torch.layer_probe import TorchLayerProbe
from autotune.backends.torch.modules import ModuleSmoothing, activation_scale
from autotune.backends.torch.smoothing import (
    FoldFinder,
    fold_inverse,
    outputs_match,
    sample_inputs,
    smooth_module,
    smoothed_input,
)
from autotune.harness import TrialRunner
from autotune.model.layers import InputSpec
from autotune.quant.layerwise import SMOOTHING, choose_layer_methods, smoothed_range, smoothing_factors
from autotune.quant.lowering import Quantization
from autotune.testing import tiny_torch_config

CPU_OPS = probe_device("cpu").ops
needs_cpu_fp8 = pytest.mark.skipif("fp8_rowwise" not in CPU_OPS, reason="this torch has no FP8 GEMM on the CPU")


class Folds(nn.Module):
    """Every kind of producer: a LayerNorm read by one Linear, a GELU, a LayerNorm that also feeds a residual,
    a Linear read only by the next Linear (an attention's value and output projections), and a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.value = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(x + self.down(functional.gelu(self.up(self.ln(x)))))
        return self.head(self.out(self.value(hidden)) + hidden)


def _folds() -> nn.Module:
    torch.manual_seed(0)
    module = Folds().eval()
    with torch.no_grad():  # affine LayerNorms that are not the identity, so a wrong fold shows
        for norm in (module.ln, module.norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return module


def test_the_fold_finder_folds_exactly_where_the_producer_feeds_the_layer_alone():
    module = _folds()
    finder = FoldFinder(module, [torch.randn(2, 5, 16)])
    found = {path: finder.producer(path) for path in ("up", "down", "value", "out", "head")}
    # up reads the LayerNorm alone; out reads value alone; down is behind a GELU, value's LayerNorm also feeds the
    # residual, and head reads a sum: those get SmoothedInput.
    assert found == {"up": "ln", "down": None, "value": None, "out": "value", "head": None}


def test_smoothed_and_folded_fp32_module_equals_the_original():
    module = _folds()
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        expected = module(x)
    rng = np.random.default_rng(1)
    widths = {"up": 16, "down": 32, "value": 16, "out": 16, "head": 16}
    factors = {path: np.exp(rng.uniform(-2, 2, width)).astype(np.float32) for path, width in widths.items()}
    smoothed = _folds()
    folded, unfolded = smooth_module(smoothed, factors, FoldFinder(_folds(), [torch.randn(1, 4, 16)]))
    assert folded == {"up": "ln", "out": "value"} and set(unfolded) == {"down", "value", "head"}
    for path, path_factors in unfolded.items():
        parent, _, name = path.rpartition(".")
        setattr(
            smoothed.get_submodule(parent) if parent else smoothed,
            name,
            smoothed_input(getattr(smoothed, name), path_factors),
        )
    with torch.no_grad():
        got = smoothed(x)
    assert outputs_match([got], [expected], 1e-5)
    assert not torch.equal(smoothed.up.weight, module.up.weight)  # it did change the weights
    # A fold into a producer that feeds something else is not exact: the check that rejects it can fail.
    wrong = _folds()
    fold_inverse(wrong.norm, factors["value"])
    with torch.no_grad():
        assert not outputs_match([wrong(x)], [expected], 1e-5)


def test_sample_inputs_are_one_row_of_ones_for_ids_and_normal_floats():
    ids, features = sample_inputs([InputSpec("ids", (8, 128), "int64"), InputSpec("x", (4, 3), "float32")])
    assert ids.shape == (1, 128) and ids.dtype == torch.int64 and bool((ids == 1).all())
    assert features.shape == (1, 3) and features.dtype == torch.float32


def _outlier_input(rows: int = 64, outlier: float = 3e4, seed: int = 0) -> np.ndarray:
    """Activations with channel 3 ``outlier`` times the others (SmoothQuant's case)."""
    x = np.random.default_rng(seed).standard_normal((rows, 6, 32)).astype(np.float32)
    x[..., 3] *= outlier
    return x


def _linear_for(outlier: float) -> nn.Linear:
    """A Linear whose weight column 3 is ``1 / outlier`` of the others: the outlier channel adds as much as any."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 24)
    with torch.no_grad():
        linear.weight[:, 3] /= outlier
    return linear.eval()


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))


@needs_cpu_fp8
@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_smoothed_quantized_linear_stays_within_its_error_bound_on_the_cpu(precision):
    x = _outlier_input()
    linear = _linear_for(3e4)
    with torch.no_grad():
        expected = linear(torch.from_numpy(x))
    lo, hi = x.reshape(-1, 32).min(axis=0), x.reshape(-1, 32).max(axis=0)
    factors = smoothing_factors(lo, hi, linear.weight.detach().numpy().T, 0.5)
    smoothed_span = smoothed_range(lo, hi, factors)
    plain_span = (float(lo.min()), float(hi.max()))
    module = nn.Sequential(linear)
    smoothed = rewrite_module(
        module,
        {"0": ModuleChoice(precision, smoothed_span)},
        fp8_scaling="rowwise",
        smoothing=ModuleSmoothing({"0": factors}),
    )
    plain = rewrite_module(module, {"0": ModuleChoice(precision, plain_span)}, fp8_scaling="rowwise")
    assert type(smoothed[0]).__name__ == "SmoothedInput"  # the model input has no producer to fold into
    with torch.no_grad():
        smoothed_error = _relative_error(smoothed(torch.from_numpy(x)), expected)
        plain_error = _relative_error(plain(torch.from_numpy(x)), expected)
    # e4m3 rounds each operand to 3 mantissa bits (<= 2^-4 relative), int8 to half a step of amax / 127: the
    # product's relative error stays below the sum of the operands' bounds.
    bound = 2 * 2.0**-4 if precision == "fp8" else 2 * 0.5 / 127 * 4
    assert smoothed_error < bound
    assert plain_error > 2 * smoothed_error  # the outlier channel is what smoothing fixes
    assert activation_scale(*smoothed_span, precision) < activation_scale(*plain_span, precision)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")
def test_gpu_smoothed_fp8_linear_compiled_stays_within_its_error_bound():
    info = probe_device("cuda")
    if info.fp8_scaling is None or (info.capability or (0, 0)) < (8, 9):
        pytest.skip("needs a GPU with FP8")
    x = torch.from_numpy(_outlier_input(rows=40)).cuda()
    linear = _linear_for(3e4)
    expected = linear.cuda()(x).detach()
    flat = x.reshape(-1, 32).cpu().numpy()
    lo, hi = flat.min(axis=0), flat.max(axis=0)
    factors = smoothing_factors(lo, hi, linear.weight.detach().cpu().numpy().T, 0.5)
    smoothed = rewrite_module(
        nn.Sequential(linear.cpu()),
        {"0": ModuleChoice("fp8", smoothed_range(lo, hi, factors))},
        fp8_scaling=info.fp8_scaling,
        base="bf16",
        smoothing=ModuleSmoothing({"0": factors}),
    ).cuda()
    with torch.no_grad():
        got = torch.compile(smoothed)(x)
    assert _relative_error(got.float(), expected) < 2 * 2.0**-4


def outlier_factory() -> nn.Module:
    """``model.torch`` of the calibration test: a gain that makes input channel 3 an outlier, then two Linears."""
    return _gained(3e4)


def plain_factory() -> nn.Module:
    """The same module without the outlier."""
    return _gained(1.0)


def _gained(outlier: float) -> nn.Module:
    class Gained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gain = torch.ones(32)
            gain[3] = outlier
            self.register_buffer("gain", gain)
            self.fc1 = _linear_for(outlier)
            self.fc2 = nn.Linear(24, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x * self.gain)))

    torch.manual_seed(1)
    return Gained().eval()


def _choices(tmp_path, factory: str) -> dict[str, str]:
    rng = np.random.default_rng(0)
    root = tmp_path / factory
    root.mkdir()
    for split in ("calibration", "evaluation", "holdout"):
        x = rng.standard_normal((32, 6, 32)).astype(np.float32)
        np.savez(root / f"{split}.npz", x=x, labels=np.zeros((32, 6, 16), np.float32))
    config = tiny_torch_config(
        root,
        model={"torch": f"tests.backends.torch.test_smoothing:{factory}"},
        inputs=[{"name": "x", "shape": [8, 6, 32], "dtype": "float32"}],
        metric={"name": "cosine"},
    )
    runner = TrialRunner(config)
    backend = runner.backend
    layers = [layer for layer in runner.model.layers if backend._bindings.get(layer.name) == "fc1"]
    probe = TorchLayerProbe(
        backend.fp32_module(), backend._bindings, ["x"], "cpu", precision="fp8", fp8_scaling="rowwise"
    )
    chosen = choose_layer_methods(
        runner.model.proto,
        layers,
        backend.recipe,
        runner.calibration,
        runner.calibration_batches,
        progress=False,
        layer_probe=probe,
    )
    assert set(chosen.errors[layers[0].name]) >= set(SMOOTHING)  # the probe measured the smoothed candidates
    return {backend._bindings[name]: method for name, method in chosen.methods.items()}, chosen


@needs_cpu_fp8
def test_the_torch_probe_chooses_smoothing_where_an_outlier_channel_hurts_fp8(tmp_path):
    outlier, outlier_chosen = _choices(tmp_path, "outlier_factory")
    plain, plain_chosen = _choices(tmp_path, "plain_factory")
    assert outlier["fc1"] in SMOOTHING
    assert plain["fc1"] not in SMOOTHING
    errors = next(iter(outlier_chosen.errors.values()))
    assert min(errors[m] for m in SMOOTHING) < 0.5 * errors["max"]


def test_a_smoothed_build_exports_and_loads_back(runner, tmp_path):
    plan = runner.space.uniform("int8")
    ranges = runner.calibration.ranges("max")
    first = runner.space.layer_names[0]
    factors = {first: np.exp(np.random.default_rng(0).uniform(-1, 1, 32)).astype(np.float32)}
    artifact = runner.backend.build(plan, Quantization(ranges, {}, factors), tmp_path)
    runner.backend.export(artifact, plan, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["smoothed"] == {"fc1": 32}
    module = load_exported(tmp_path / "export", "cpu")
    assert type(module.fc1).__name__ == "SmoothedInput"
    feeds = runner.datasets["evaluation"].batches[0]
    expected = runner.backend.run(artifact, feeds)[0]
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(feeds["x"])).numpy(), expected)
