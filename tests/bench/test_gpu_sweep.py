"""bench/gpu_sweep.py's CPU-side pieces: arguments, shapes, the time budget, results written as they come."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_sweep  # noqa: E402


def test_the_default_arguments_plan_every_stage_model_and_variant():
    args = gpu_sweep.parse_args(["--out", "x"])
    assert args.stages == ["gemm", "setup", "e2e"]
    assert args.models[0] == ("bert-large", 128) and ("minilm", 64) in args.models
    assert args.variants[0] == "bf16" and set(args.variants) == set(gpu_sweep.VARIANTS)
    assert args.setup_config == "configs/minilm-gpu-b64.yaml" and (ROOT / args.setup_config).is_file()


def test_model_entries_are_name_and_batch(capsys):
    assert gpu_sweep.parse_model("minilm:256") == ("minilm", 256)
    for bad in ("minilm", "gpt:8", "minilm:0", "minilm:x"):
        with pytest.raises(ValueError, match="NAME:BATCH"):
            gpu_sweep.parse_model(bad)
    with pytest.raises(SystemExit):
        gpu_sweep.parse_args(["--out", "x", "--models", "minilm:eight"])
    assert "NAME:BATCH" in capsys.readouterr().err


def test_gemm_shapes_cover_384_to_4096_for_every_batch():
    shapes = gpu_sweep.gemm_shapes()
    assert len(shapes) == len(gpu_sweep.GEMM_M) * len(gpu_sweep.GEMM_KN) == len(set(shapes))
    assert {m for m, _, _ in shapes} == {8 * 128, 64 * 128, 256 * 128}
    dims = {d for _, k, n in shapes for d in (k, n)}
    assert min(dims) == 384 and max(dims) == 4096 and {1024, 1536} <= dims
    assert gpu_sweep.gemm_shapes([16], [(8, 32)]) == [(16, 8, 32)]


def test_the_clock_refuses_work_that_would_end_after_the_limit():
    now = [100.0]
    clock = gpu_sweep.Clock(time_limit=50, compile_reserve=20, now=lambda: now[0])
    assert clock.can_start(clock.compile_reserve)
    now[0] = 135.0
    assert clock.elapsed() == 35.0 and clock.can_start() and not clock.can_start(clock.compile_reserve)
    now[0] = 151.0
    assert not clock.can_start()


def test_results_are_written_whole_with_every_stage_in_the_markdown(tmp_path):
    results = gpu_sweep.new_results(["--out", str(tmp_path)])
    results["environment"] = {"device": "NVIDIA H200", "torch": "2.11"}
    results["gemm"].append(
        {"m": 8192, "k": 1024, "n": 4096, "ms": {"bf16": 0.2, "fp8_rowwise_gemm": 0.1}, "errors": {"int8_gemm": "x"}}
    )
    results["setup"].append({"config": "configs/minilm-gpu-b64.yaml", "status": "ok", "seconds": 41.25})
    results["e2e"] += [
        {"model": "minilm", "batch": 64, "variant": "oneliner-bf16", "status": "ok", "ms": 1.0, "iqr_ms": 0.01},
        {
            "model": "minilm",
            "batch": 64,
            "variant": "fp8",
            "status": "ok",
            "ms": 0.8,
            "oneliner_ms": 1.0,
            "ratio": 1.25,
        },
        {"model": "minilm", "batch": 64, "variant": "int8", "status": "error", "error": "Traceback\nBuildError: a|b"},
    ]
    gpu_sweep.write(results, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "sweep.json").read_text()) == json.loads(json.dumps(results))
    text = (tmp_path / "out" / "sweep.md").read_text()
    assert "| 8192 | 1024 | 4096 | 0.2000 | 0.1000 (2.00x) |" in text
    assert "int8_gemm: x" in text and "41.2" in text
    assert "| minilm | 64 | fp8 | ok | 0.8000 (-) | 1.0000 | 1.250 |" in text
    assert "BuildError: a\\|b" in text  # the error's last line, escaped for the table
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_call_without_cuda_still_writes_results_with_every_failure_recorded(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    out = tmp_path / "sweep"
    code = gpu_sweep.main(
        ["--out", str(out), "--stages", "gemm", "e2e", "--models", "bert-large:2", "--variants", "bf16"]
        + ["--time-limit", "300", "--compile-reserve", "0", "--rounds", "1", "--repeats", "1"]
    )
    assert code == 0
    results = json.loads((out / "sweep.json").read_text())
    assert len(results["gemm"]) == len(gpu_sweep.gemm_shapes())
    assert all(row["errors"] for row in results["gemm"])  # no CUDA: each shape says why
    stage_errors = [error["stage"] for error in results["errors"]]
    rows = results["e2e"]
    # Either the model stage failed as a whole (recorded), or each variant is a row with its error.
    assert "e2e bert-large:2" in stage_errors or all(row["status"] == "error" for row in rows)
    assert "wall_s" in results and (out / "sweep.md").is_file()


def test_linear_ranges_are_each_linear_inputs_max(tmp_path):
    import torch

    from autotune.testing import tiny_torch_mlp

    module = tiny_torch_mlp()
    x = torch.randn(8, 32)
    ranges = gpu_sweep.linear_ranges(module, [x])
    assert set(ranges) == {"fc1", "fc2"}
    assert ranges["fc1"] == pytest.approx((-float(x.abs().max()), float(x.abs().max())))
    hidden = torch.relu(module.fc1(x))
    assert ranges["fc2"][1] == pytest.approx(float(hidden.abs().max()), rel=1e-6)
