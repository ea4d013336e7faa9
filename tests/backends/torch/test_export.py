"""Exporting a tuned module: the files, and ``load_exported`` giving back what the build ran.

The GPU test (``-m gpu``) skips without CUDA.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from autotune.backends.torch import load_exported
from autotune.plan import Plan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")


def test_an_int8_trial_runs_and_exports_a_loadable_module(runner, tmp_path):
    plan = runner.space.uniform("int8")
    assert set(plan.precision_map.values()) == {"int8"}
    result = runner.run(plan)
    assert result.ok, result.error
    assert abs(result.accuracy_drop) <= 0.1 and result.fidelity["cosine"] > 0.99
    assert result.latency_ms > 0 and result.reference_latency_ms > 0
    stages = result.build_stages_s  # where the build time went: on the CPU no warm-up and no graph
    assert list(stages) == ["rewrite", "to_device", "first_call"] and all(t >= 0 for t in stages.values())
    assert sum(stages.values()) <= result.build_s
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


@pytest.mark.gpu
@needs_cuda
def test_gpu_trial_and_export(cuda_runner, tmp_path):
    plan = cuda_runner.space.uniform("int8")
    result = cuda_runner.run(plan)
    assert result.ok, result.error
    assert result.fidelity["cosine"] > 0.99 and result.latency_ms > 0
    assert list(result.build_stages_s) == ["rewrite", "to_device", "first_call", "warmup", "capture"]
    files = cuda_runner.export(plan, tmp_path / "export")
    assert Path(files[0]).name == "module_state.pt"
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    expected = cuda_runner.backend.run(cuda_runner.build(plan, tmp_path), feeds)[0]
    module = load_exported(tmp_path / "export", "cuda")
    with torch.no_grad():
        got = module(torch.from_numpy(feeds["x"]).cuda()).float().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_autotune_load_gives_back_a_callable_built_with_the_exported_knobs(runner, tmp_path):
    import autotune

    plan = runner.space.uniform("int8")
    runner.export(plan, tmp_path / "export")
    feeds = runner.datasets["evaluation"].batches[0]
    expected = runner.backend.run(runner.build(plan, tmp_path), feeds)[0]
    engine = autotune.load(tmp_path / "export")
    assert engine.input_names == ["x"] and engine.artifact.knobs["mode"] == "eager"
    assert type(engine.artifact.module.fc1).__name__ == "Int8Linear"
    np.testing.assert_array_equal(engine(feeds["x"]).numpy(), expected)  # by position, a numpy array
    np.testing.assert_array_equal(engine(x=torch.from_numpy(feeds["x"])).numpy(), expected)  # by name, a tensor
    with pytest.raises(TypeError, match=r"takes \['x'\]"):
        engine(y=feeds["x"])
    with pytest.raises(ValueError, match="built for"):
        engine(feeds["x"][:1])
    with pytest.raises(ValueError, match="no manifest.json"):
        autotune.load(tmp_path)


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_loaded_engine_runs_at_the_trials_speed(cuda_runner, tmp_path):
    """``autotune.load`` is compiled and captured as the trial was, and a call adds nothing but the input copies.

    Its launch, timed as trials are, is within 5 % of a fresh trial build's, interleaved; a user's call (events
    around ``engine(x)``) is within 5 % of the least a caller can do: the input copy and one replay, inline.
    """
    import autotune
    from autotune.backends.torch.runtime import time_launch

    plan = cuda_runner.space.uniform("fp16")
    cuda_runner.export(plan, tmp_path / "export")
    engine = autotune.load(tmp_path / "export")
    built = cuda_runner.build(plan, tmp_path)
    assert engine.artifact.graph is not None and engine.artifact.knobs == built.knobs
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    x = torch.from_numpy(feeds["x"]).cuda()
    np.testing.assert_allclose(engine(x).float().cpu().numpy(), cuda_runner.backend.run(built, feeds)[0], 1e-3)
    loaded, trial = [], []
    for _ in range(300):  # interleaved, so drift falls on both alike
        loaded.append(time_launch(engine.artifact, feeds))
        trial.append(time_launch(built, feeds))
    assert np.median(loaded[100:]) <= 1.05 * np.median(trial[100:]), (np.median(loaded), np.median(trial))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph, static = engine.artifact.graph, engine.artifact.inputs[0]

    def inline():
        static.copy_(x, non_blocking=True)
        graph.replay()

    calls, least = [], []
    for _ in range(300):
        for run, times in ((lambda: engine(x), calls), (inline, least)):
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    # the shape checks cost the host a few microseconds, which a model this small shows in full
    assert np.median(calls[100:]) <= 1.05 * np.median(least[100:]) + 0.01, (np.median(calls), np.median(least))
