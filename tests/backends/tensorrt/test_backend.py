"""The TensorRT backend end to end where TensorRT and a GPU exist, and its failure modes where they do not.

- Without TensorRT (this machine, CI): ``import autotune`` does not import it, and asking for the backend exits
  with a message that says how to install it.
- ``@pytest.mark.gpu``: cuda-python plumbing (buffers, stream, events) of the run and timing path, with a fake
  identity execution context, so it runs on any CUDA machine with cuda-python even without TensorRT.
- ``@pytest.mark.tensorrt``: build, inspect, run, time, accuracy and export through the real TensorRT, and a
  short ``tune`` and ``evaluate``. They skip with "TensorRT is not installed" or "no CUDA GPU".
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from autotune.backends import BackendUnavailable, GraphArtifact, get_backend
from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.backends.tensorrt import CudaRuntime, TensorRTBackend, TensorRTEngine, import_cudart
from autotune.backends.tensorrt.engine import _Tensor
from autotune.backends.tensorrt.inspect import PrecisionReport
from autotune.config.schema import BackendConfig, ConfigError, dump_config
from autotune.measure.timing import Protocol, interleaved
from autotune.quant.lowering import NONE
from autotune.testing import tiny_config, typed_model

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
REPO = Path(__file__).resolve().parents[3]


# ---- without TensorRT --------------------------------------------------------------------------------------


def test_importing_autotune_and_the_backend_does_not_import_tensorrt_or_cuda():
    code = (
        "import sys, autotune, autotune.backends, autotune.backends.tensorrt, autotune.backends.tensorrt.backend, "
        "autotune.backends.tensorrt.inspect, autotune.backends.tensorrt.rules, autotune.backends.tensorrt.command, "
        "autotune.backends.tensorrt.options, autotune.backends.tensorrt.cuda, autotune.backends.tensorrt.engine\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'tensorrt_bindings', 'cuda'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here")
def test_get_backend_says_how_to_install_tensorrt():
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed") as raised:
        get_backend(BackendConfig(name="tensorrt"))
    assert "pip install tensorrt-cu13 cuda-python" in str(raised.value)
    assert "NVIDIA GPU" in str(raised.value)


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here")
def test_cli_tune_on_tensorrt_exits_2_with_the_install_hint(tmp_path, capsys):
    from autotune.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config(tmp_path)))
    assert main(["tune", str(path), "--set", "backend.name=tensorrt", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT is not installed" in err and "pip install tensorrt-cu13" in err
    assert not (tmp_path / "runs" / "tiny").exists()  # nothing left behind that a resume would trust


def test_bad_options_fail_before_importing_tensorrt(tmp_path):
    # The config validates backend.options: a typo fails there, before get_backend imports TensorRT.
    with pytest.raises(ConfigError, match=r"backend\.options\.worksapce_ladder_mib: unknown key"):
        tiny_config(tmp_path, backend={"name": "tensorrt", "options": {"worksapce_ladder_mib": [1]}})


# ---- the timing hook (any backend) --------------------------------------------------------------------------


def test_default_time_run_times_run_and_the_protocol_uses_returned_ms():
    backend = OnnxRuntimeCPU(intra_op_threads=1)
    from autotune.testing import tiny_mlp

    graph = tiny_mlp()
    session = GraphArtifact(graph, backend.build_graph(graph, {}))
    assert 0 < backend.time_run(session, {"x": np.zeros((16, 32), np.float32)}) < 10_000

    calls = []

    def clock():
        calls.append(1)
        return 0.0

    samples = iter([9.0, 1.0, 2.0, 3.0, 9.0, 4.0, 5.0, 6.0])  # warm-up values are never used
    protocol = Protocol(warmup=1, repeats=3, rounds=1, quiet_band=None, settle_s=0.0, busy_wait=None)
    latency = interleaved(lambda: next(samples), lambda: next(samples), protocol, clock=clock, self_timed=True)
    assert (latency.reference_median_ms, latency.median_ms) == (2.0, 5.0) and calls == []


# ---- cuda-python plumbing on a real GPU, TensorRT not needed -------------------------------------------------


@pytest.fixture(scope="module")
def cuda() -> CudaRuntime:
    try:
        return CudaRuntime(import_cudart())
    except BackendUnavailable as error:
        pytest.skip(f"{'no CUDA GPU' if 'no CUDA GPU' in str(error) else 'cuda-python is not installed'}: {error}")


class IdentityContext:
    """An IExecutionContext stand-in whose engine copies its input to its output on the given stream."""

    def __init__(self, cuda: CudaRuntime):
        self.cuda = cuda
        self.addresses: dict[str, int] = {}
        self.shape: tuple[int, ...] = ()

    def set_input_shape(self, name, shape):
        self.shape = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self.shape

    def set_tensor_address(self, name, pointer):
        self.addresses[name] = pointer
        return True

    def execute_async_v3(self, stream_handle):
        cudart = self.cuda.cudart
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        nbytes = int(np.prod(self.shape)) * 4
        self.cuda.check(
            cudart.cudaMemcpyAsync(self.addresses["y"], self.addresses["x"], nbytes, kind, stream_handle), "copy"
        )
        return True


@pytest.mark.gpu
def test_cuda_buffers_stream_and_events_run_and_time(cuda):
    assert cuda.compute_capability() >= (5, 0) and cuda.device_name()
    backend = object.__new__(TensorRTBackend)
    backend.cuda = cuda
    artifact = TensorRTEngine(
        engine=None,
        context=IdentityContext(cuda),
        plan=b"",
        layer_info="{}",
        report=PrecisionReport(),
        knobs={},
        cuda=cuda,
        input_names=["x"],
        output_names=["y"],
        tensors={"x": _Tensor("x", np.dtype(np.float32)), "y": _Tensor("y", np.dtype(np.float32))},
        stream=cuda.stream(),
        start=cuda.event(),
        end=cuda.event(),
    )
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    (y,) = backend.run_engine(artifact, {"x": x})
    np.testing.assert_array_equal(y, x)
    elapsed = [backend.time_run(GraphArtifact(onnx.ModelProto(), artifact), {"x": x}) for _ in range(5)]
    assert all(0 < ms < 1000 for ms in elapsed), elapsed
    (y,) = backend.run_engine(artifact, {"x": x[:128]})  # a smaller batch reuses the buffers
    np.testing.assert_array_equal(y, x[:128])
    artifact.close()
    assert artifact.tensors["x"].pointer == 0 and artifact.stream is None


# ---- real TensorRT ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trt_backend() -> TensorRTBackend:
    if not HAS_TENSORRT:
        pytest.skip("TensorRT is not installed (pip install tensorrt-cu13 cuda-python, on an NVIDIA GPU machine)")
    try:
        return TensorRTBackend()
    except BackendUnavailable as error:
        pytest.skip(f"{'no CUDA GPU' if 'no CUDA GPU' in str(error) else 'TensorRT unavailable'}: {error}")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.tensorrt
def test_build_verify_run_time_and_export_on_tensorrt(trt_backend, tmp_path):
    from autotune.harness import TrialRunner

    config = tiny_config(tmp_path, backend={"name": "tensorrt", "timeout_s": 300})
    runner = TrialRunner(config)
    assert isinstance(runner.backend, TensorRTBackend)
    assert (config.run_dir / "tensorrt-timing.cache").is_file()  # the FP32 reference filled the run's cache
    capabilities = runner.backend.capabilities()
    assert capabilities.precisions_for("MatMul")[:2] == ("fp32", "fp16")
    feeds = runner.datasets["evaluation"].batches[0]
    for precision in ("fp32", "fp16", "int8"):
        plan = runner.space.uniform(precision)
        typed = typed_model(runner, plan)
        artifact = GraphArtifact(typed, runner.backend.build_graph(typed, plan.knob_map, config.run_dir))
        report = artifact.engine.report
        assert report.mismatches == [], [c.describe() for c in report.mismatches]
        for check in report.checks:
            assert check.observed in (None, check.requested), check.describe()
        session = ort.InferenceSession(typed.SerializeToString(), providers=["CPUExecutionProvider"])
        expected = session.run(None, {k: v for k, v in feeds.items() if k == "x"})[0]
        got = runner.backend.run(artifact, feeds)[0]
        assert got.shape == expected.shape and _cosine(got, expected) > 0.999, precision
        assert 0 < runner.backend.time_run(artifact, feeds) < 1000
    result = runner.run(runner.space.uniform("int8"))
    assert result.ok, result.error
    assert result.latency_ms > 0 and result.reference_latency_ms > 0 and result.accuracy is not None
    files = runner.export(runner.space.uniform("int8"), tmp_path / "export")
    names = {Path(f).name for f in files}
    assert {"engine.plan", "model.onnx", "trtexec.sh", "layers.json", "precision.json", "timing.cache"} <= names
    script = (tmp_path / "export" / "trtexec.sh").read_text()
    assert "--onnx=model.onnx" in script and "--memPoolSize=workspace:" in script and "M " in script
    assert "--profilingVerbosity=detailed" in script and "--tacticSources=" in script


@pytest.mark.tensorrt
def test_tune_and_evaluate_on_tensorrt(trt_backend, tmp_path):
    from autotune.api import evaluate
    from autotune.tune import tune

    config = tiny_config(
        tmp_path,
        backend={"name": "tensorrt", "timeout_s": 300, "options": {"builder_optimization_levels": [3, 4]}},
        budget={"builds": 6},
        ppo={"episodes_per_update": 2, "checkpoint_every_builds": 3},
    )
    summary = tune(config, isolate=False, progress=False)
    assert summary["builds"] == 6
    assert any(name.endswith("engine.plan") for name in summary["files"])
    result = evaluate(config, "int8", isolate=False)
    assert result["status"] == "ok", result.get("error")
    assert result["artifact"].endswith("engine.plan") and Path(result["artifact"]).is_file()
    assert result["speedup"] > 0 and result["accuracy_drop"] is not None


@pytest.mark.tensorrt
def test_fp16_base_with_overrides_and_the_fp16_reference_on_tensorrt(trt_backend, tmp_path):
    from autotune.harness import TrialRunner

    config = tiny_config(tmp_path, backend={"name": "tensorrt", "timeout_s": 300})
    runner = TrialRunner(config)
    feeds = runner.datasets["evaluation"].batches[0]
    inputs = {k: v for k, v in feeds.items() if k == "x"}
    fp32 = runner.backend.run(runner.backend.build(runner.space.plan(), NONE, config.run_dir), feeds)[0]
    plan = runner.space.plan({"fc1": "int8", "fc2": "fp32", "fc3": "fp16", "head": "fp16"}, {"base_precision": "fp16"})
    typed = typed_model(runner, plan)
    artifact = GraphArtifact(typed, runner.backend.build_graph(typed, plan.knob_map, config.run_dir))
    report = artifact.engine.report
    assert report.mismatches == [], [c.describe() for c in report.mismatches]
    assert {c.node: c.requested for c in report.checks} == {"fc1": "int8", "fc2": "fp32", "fc3": "fp16", "head": "fp16"}
    assert all(t.dtype == np.float32 for t in artifact.engine.tensors.values())  # the engine's I/O is the model's
    expected = ort.InferenceSession(typed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert _cosine(runner.backend.run(artifact, feeds)[0], expected) > 0.999
    assert "trt-fp16" in runner.backend.references()
    reference = runner.backend.build_reference("trt-fp16", [], config.run_dir)
    assert _cosine(runner.backend.run(reference, feeds)[0], fp32) > 0.999
