"""TorchBackend: options and errors, knobs, builds on the CPU, and on CUDA (``-m gpu``, skipped without CUDA)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import autotune.backends.torch.backend as backend_module
from autotune.api import analyze
from autotune.backends import BackendUnavailable, BuildError, get_backend
from autotune.backends.torch import DeviceInfo, TorchBackend, runtime_flags
from autotune.config.schema import BackendConfig, ConfigError, ModelConfig
from autotune.quant.lowering import Quantization
from autotune.testing import tiny_torch_config

FACTORY = "autotune.testing:tiny_torch_mlp"


# ---- options and errors -------------------------------------------------------------------------------------


def test_onnx_only_configs_get_a_clear_error():
    with pytest.raises(BackendUnavailable, match="needs model.torch.*onnxruntime or tensorrt"):
        get_backend(BackendConfig(name="torch", options={"device": "cpu"}), ModelConfig(onnx=Path("model.onnx")))
    with pytest.raises(BackendUnavailable, match="needs model.torch"):
        get_backend(BackendConfig(name="torch"))


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"(?s)options\.devcie.*Extra inputs are not permitted"):
        BackendConfig(name="torch", options={"devcie": "cpu"})
    with pytest.raises(ValueError, match=r"(?s)options\.device.*should match pattern"):
        BackendConfig(name="torch", options={"device": "tpu"})
    with pytest.raises(TypeError, match="takes autotune.config.schema.TorchOptions, got dict"):
        TorchBackend(FACTORY, {"device": "cpu"})
    backend = get_backend(BackendConfig(name="torch", options={"device": "cpu"}), ModelConfig(torch=FACTORY))
    assert isinstance(backend, TorchBackend) and backend.device == "cpu"


def test_a_bad_device_is_rejected_by_the_config_with_its_key_path(tmp_path):
    with pytest.raises(ConfigError, match=r"backend\.options\.device: String should match pattern"):
        tiny_torch_config(tmp_path, device="gpu")


def test_no_cuda_says_how_to_run_on_the_cpu_when_the_probe_answers(monkeypatch):
    from concurrent.futures import Future

    probe: Future = Future()  # TorchBackend probes through the name its module imported, in the background
    monkeypatch.setattr(backend_module, "probe_in_background", lambda device: probe)
    backend = TorchBackend(FACTORY)  # does not wait for the probe: the run exports the model meanwhile
    probe.set_result(DeviceInfo("cuda", "2.13.0+cpu", available=False))
    with pytest.raises(BackendUnavailable, match="CPU-only build.*device: cpu"):
        backend.capabilities()


def test_loading_ahead_makes_the_factorys_module_and_reads_the_capabilities(monkeypatch):
    from concurrent.futures import Future

    probe: Future = Future()
    probe.set_result(DeviceInfo("cpu", "2.13.0+cpu", ops=frozenset({"fp16"})))
    monkeypatch.setattr(backend_module, "probe_in_background", lambda device: probe)
    backend = TorchBackend(FACTORY, backend_module.TorchOptions(device="cpu"))
    assert backend._fp32 is None and backend._capabilities is None  # the run's process makes them when asked
    backend.load_ahead()
    assert backend._fp32 is not None and backend._capabilities is not None


# ---- a trial end to end on the CPU --------------------------------------------------------------------------


def test_knobs_are_validated(runner):
    backend = runner.backend
    assert backend.knob_values({"calibration": "max", "weight_granularity": "per_tensor"})["mode"] == "eager"
    with pytest.raises(BuildError, match="knob mode='compile' is not offered"):
        backend.knob_values({"mode": "compile"})
    with pytest.raises(BuildError, match="unknown knob 'tf32'"):
        backend.knob_values({"tf32": True})
    bad = runner.space.uniform("int8").with_knobs(mode="max-autotune")
    assert "not allowed" in runner.run(bad).error


def test_per_tensor_bf16_and_mixed_plans_build(runner):
    layers = runner.space.layer_names
    mixed = runner.space.plan({layers[0]: "bf16", layers[1]: "int8"}, {"weight_granularity": "per_tensor"})
    artifact = runner.build(mixed, runner.config.run_dir)
    assert artifact.choices == {"fc1": "bf16", "fc2": "int8"}
    feeds = runner.datasets["evaluation"].batches[0]
    assert runner.backend.time_run(artifact, feeds) > 0 and artifact.staged is feeds
    out = runner.backend.run(artifact, feeds)[0]
    assert out.dtype == np.float32 and out.shape == (32, 16)


def test_builds_need_prepare_and_smooth_their_quantized_linears(runner, tmp_path):
    plan = runner.space.uniform("int8")
    fresh = TorchBackend(FACTORY, runner.config.backend.options)
    with pytest.raises(BuildError, match=r"only after prepare\(model, searched\)"):
        fresh.build(plan, Quantization(), tmp_path)
    ranges = runner.calibration.ranges("max")
    plain = runner.backend.build(plan, Quantization(ranges=ranges), tmp_path)
    assert plain.choices == {"fc1": "int8", "fc2": "int8"}
    # Factors of 2 with the range of x / 2: the same int8 values and scales times powers of two, so the same
    # outputs to the last bit, from a module that does smooth fc1 (the model input: no producer to fold into).
    first = runner.space.layer_names[0]
    tensor = runner.model.layer(first).activation_inputs[0]
    halved = {first: {**ranges, tensor: (ranges[tensor][0] / 2, ranges[tensor][1] / 2)}}
    factors = {first: np.full(32, 2.0, dtype=np.float32)}
    smoothed = runner.backend.build(plan, Quantization(ranges, halved, factors), tmp_path)
    assert "SmoothedInput" in repr(smoothed.module)
    feeds = runner.datasets["evaluation"].batches[0]
    np.testing.assert_array_equal(runner.backend.run(smoothed, feeds)[0], runner.backend.run(plain, feeds)[0])
    # A layer in a float precision is not smoothed: a multiply there would only cost time.
    floats = runner.backend.build(runner.space.uniform("bf16"), Quantization(ranges, halved, factors), tmp_path)
    assert "SmoothedInput" not in repr(floats.module)


# ---- the GPU (skipped without CUDA) -------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")


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
    # the FP32 reference is the eager module replayed from one CUDA graph (TorchBackend.fp32_reference_knobs)
    assert reference.graph is not None and reference.knobs["mode"] == "eager"
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
def test_gpu_tf32_and_cudnn_flags_follow_each_artifact(cuda_runner):
    backend, space = cuda_runner.backend, cuda_runner.space
    if "tf32" not in {k.name for k in space.knobs}:
        pytest.skip("no TF32 on this GPU")
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    on = cuda_runner.build(space.uniform("fp32", {"tf32": True, "cudnn_benchmark": False}), cuda_runner.config.run_dir)
    off = cuda_runner.reference
    backend.run(on, feeds)
    assert runtime_flags() == {"matmul_tf32": True, "cudnn_tf32": True, "cudnn_benchmark": False}
    backend.time_run(off, feeds)
    assert runtime_flags() == {"matmul_tf32": False, "cudnn_tf32": False, "cudnn_benchmark": True}
    backend.time_run(on, feeds)
    assert runtime_flags()["matmul_tf32"] is True


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


# ---- a search -----------------------------------------------------------------------------------------------


def test_a_search_on_the_torch_backend_seeds_whole_model_floats_then_quantized_plans_on_the_faster_base(tmp_path):
    from autotune.run.store import TrialStore
    from autotune.tune import tune

    config = tiny_torch_config(tmp_path, budget={"builds": 6})
    summary = tune(config, strategy="random", isolate=False, progress=False)
    with TrialStore(config.run_dir / "trials.sqlite") as store:
        trials = list(store.trials())
    space = analyze(config, profile=False)[1]
    offered = [p for p in ("int8", "fp8", "fp16", "bf16") if any(p in c for c in space.choices)]
    assert len(offered) >= 3  # int8, fp16 and bf16 run on every CPU torch
    floats = [space.uniform(p) for p in offered if p in ("fp16", "bf16")]
    assert [t.plan for t in trials[: len(floats)]] == floats
    fastest = max(trials[: len(floats)], key=lambda t: t.speedup).plan.knob("base_precision")
    assert fastest in ("fp16", "bf16")
    quantized = [space.uniform(p, {"base_precision": fastest}) for p in offered if p in ("int8", "fp8")]
    assert [t.plan for t in trials[len(floats) : len(offered)]] == quantized
    assert len(trials) == 6 and summary["builds"] == 6
    # the confirmation times the winner, FP32 and the one-liners back to back too; the search does not
    assert not any(t.back_to_back_ms for t in trials)
    rows = [summary["winner"], *summary["references"].values()]
    assert all(row["back_to_back_ms"] > 0 and row["reference_back_to_back_ms"] > 0 for row in rows)
    assert summary["winner_over_best_reference_back_to_back"] is None or summary["best_reference"] is not None
