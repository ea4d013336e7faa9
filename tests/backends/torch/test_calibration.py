"""autotune.backends.torch.calibration: the calibration's statistics from the module's inputs, as ONNX Runtime's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")

from autotune.backends.torch.calibration import collect_module_statistics, module_inputs  # noqa: E402
from autotune.harness.prepare import calibrate_ranges, statistics_collector  # noqa: E402
from autotune.harness.runner import TrialRunner  # noqa: E402
from autotune.quant.calibrate import StatisticsCollector, collect_statistics  # noqa: E402
from autotune.quant.placement import required_ranges  # noqa: E402
from autotune.testing import tiny_torch_config  # noqa: E402


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return TrialRunner(tiny_torch_config(tmp_path_factory.mktemp("torch-calibration")))


def _tensors(runner):
    return required_ranges(runner.model.layers, runner.backend.recipe, runner.model.proto)


def test_each_tensor_is_the_input_of_the_module_its_layer_is_bound_to(runner):
    backend, layers = runner.backend, runner.model.layers
    sources = module_inputs(layers, backend._bindings, backend._calls, _tensors(runner))
    assert sources == {layer.activation_inputs[0]: backend._bindings[layer.name] for layer in layers}
    assert set(sources.values()) == {"fc1", "fc2"}
    twice = {**backend._calls, "fc2": 2}  # a module called twice sees two tensors' values: no hook tells them apart
    assert module_inputs(layers, backend._bindings, twice, _tensors(runner)) is None
    assert module_inputs(layers, backend._bindings, backend._calls, [*_tensors(runner), "an_output"]) is None


def test_the_module_inputs_statistics_are_onnx_runtimes_to_float32_rounding(runner):
    tensors = _tensors(runner)
    batches = runner.calibration_batches
    sources = module_inputs(runner.model.layers, runner.backend._bindings, runner.backend._calls, tensors)
    got = collect_module_statistics(runner.backend.fp32_module(), sources, ["x"], "cpu", batches, 512)
    expected = collect_statistics(runner.model.proto, tensors, batches, num_bins=512)
    assert list(got) == list(expected) == tensors
    for name in tensors:
        assert got[name].min == pytest.approx(expected[name].min, rel=1e-5, abs=1e-6)
        assert got[name].max == pytest.approx(expected[name].max, rel=1e-5)
        assert got[name].count == expected[name].count > 0
        # float32 rounding moves a value across a bin edge now and then, never far
        moved = np.abs(got[name].hist[: len(expected[name].hist)] - expected[name].hist[: len(got[name].hist)]).sum()
        assert moved <= 0.01 * expected[name].count


def test_a_run_calibrates_on_the_backends_device_after_the_fp32_build_and_caches_it_apart(tmp_path, monkeypatch):
    from autotune.backends.torch.backend import TorchBackend

    config = tiny_torch_config(tmp_path)
    order = []
    build = TorchBackend.build

    def collector(self, tensors):  # the CUDA path, on the CPU
        sources = module_inputs(self.model.layers, self._bindings, self._calls, tensors)

        def collect(batches, num_bins):
            order.append("collect")
            return collect_module_statistics(self.fp32_module(), sources, ["x"], "cpu", batches, num_bins)

        return StatisticsCollector("torch:test", collect)

    def remember_build(self, plan, quantization, workdir):
        order.append("build")
        return build(self, plan, quantization, workdir)

    monkeypatch.setattr(TorchBackend, "statistics_collector", collector)
    monkeypatch.setattr(TorchBackend, "build", remember_build)
    runner = TrialRunner(config)
    assert order[:2] == ["build", "collect"]  # never while the reference is built (a CUDA graph's capture)
    on_ort = calibrate_ranges(
        config.calibration, config.cache_dir, runner.model, runner.backend, runner._calibration_data
    )
    assert set(on_ort.stats) == set(runner.calibration.stats)
    caches = sorted(p.name for p in (config.cache_dir / "calibration").glob("calibration-*.json"))
    assert len(caches) == 2  # one per source: ONNX Runtime's values are not the device's
    for name, stats in runner.calibration.stats.items():
        assert stats.max == pytest.approx(on_ort.stats[name].max, rel=1e-5)


def test_a_collector_that_fails_on_the_device_leaves_the_calibration_to_onnx_runtime(runner, tmp_path, caplog):
    def out_of_memory(batches, num_bins):
        raise RuntimeError("CUDA out of memory")

    config = runner.config.model_copy(update={"cache_dir": tmp_path})
    broken = StatisticsCollector("torch:cuda", out_of_memory)
    calibration = calibrate_ranges(
        config.calibration, config.cache_dir, runner.model, runner.backend, runner._calibration_data, broken
    )
    assert set(calibration.stats) == set(_tensors(runner))
    assert "torch:cuda did not gather the calibration (CUDA out of memory)" in caplog.text
    assert statistics_collector(runner.model, runner.backend) is None  # on the CPU: ONNX Runtime, as before


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_values_binned_on_the_device_give_the_counts_numpy_gives(dtype, monkeypatch):
    import torch

    from autotune.backends.torch import calibration
    from autotune.quant.histogram import TensorStats

    monkeypatch.setattr(calibration, "_CHUNK", 1000)  # a batch spans several chunks, the last one short
    rng = np.random.default_rng(3)
    # the second batch reaches 40x past the first's range: bins appended, then pairs merged past 4096
    batches = [rng.standard_t(3, 4321), rng.standard_t(3, 2500) * 40, np.zeros(7), rng.standard_normal(1234) * 1e3]
    on_device, on_host = TensorStats.empty(64), TensorStats.empty(64)
    monkeypatch.setattr("autotune.quant.histogram._MAX_BINS", 4096)
    for values in batches:
        tensor = torch.from_numpy(values).to(getattr(torch, dtype))
        calibration.update_on_device(on_device, tensor)
        on_host.update(tensor.float().numpy())  # bfloat16 and float16 widen exactly to float32
    assert on_device == on_host
    first = TensorStats.from_batch(torch.from_numpy(batches[0]).to(getattr(torch, dtype)).float().numpy(), 64)
    assert on_host.bin_width >= 2 * first.bin_width and len(on_host.hist) > 64  # pairs merged, bins appended
    with pytest.raises(ValueError, match="NaN or Inf"):
        calibration.update_on_device(on_device, torch.tensor([1.0, float("nan")]))


def test_values_that_are_not_finite_on_the_device_name_their_tensor_and_batch(runner):
    import torch

    tensors = _tensors(runner)
    sources = module_inputs(runner.model.layers, runner.backend._bindings, runner.backend._calls, tensors)
    module = runner.backend.fp32_module()
    batches = [*runner.calibration_batches, {"x": np.full_like(runner.calibration_batches[0]["x"], np.inf)}]
    last = len(batches) - 1
    with pytest.raises(ValueError, match=rf"tensor {tensors[0]!r} has NaN/Inf values on calibration batch {last}"):
        collect_module_statistics(module, sources, ["x"], "cpu", batches, 64)
    assert all(parameter.device == torch.device("cpu") for parameter in module.parameters())  # a copy went


@pytest.mark.gpu
@needs_cuda
def test_gpu_values_binned_on_the_gpu_give_the_counts_numpy_gives():
    # CUDA's float64 division is IEEE's, as numpy's: the same bin for every value, including those on a bin edge
    from autotune.backends.torch.calibration import update_on_device
    from autotune.quant.histogram import TensorStats

    generator = torch.Generator(device="cuda").manual_seed(0)
    on_gpu, on_host = TensorStats.empty(2048), TensorStats.empty(2048)
    for scale in (1.0, 30.0, 0.5):
        values = torch.randn(16384, 1024, device="cuda", generator=generator) * scale
        values[0, :8] = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, 0.25, 3.0, -3.0]) * scale  # edges of round widths
        update_on_device(on_gpu, values)
        on_host.update(values.cpu().numpy())
    assert on_gpu == on_host
