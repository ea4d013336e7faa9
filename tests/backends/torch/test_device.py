"""The torch backend's device probe and what it offers: precisions per op type, knobs, no SmoothQuant."""

import json
import subprocess
import sys

import pytest
import torch

from autotune.backends.torch import DeviceInfo, probe_device, probe_isolated, torch_capabilities

CPU_OPS = probe_device("cpu").ops
ALL_OPS = frozenset({"fp16", "bf16", "int8", "fp8_rowwise", "fp8_tensorwise", "compile", "gemm_backends"})


def _cuda(capability, ops=ALL_OPS):
    return DeviceInfo("cuda", "2.11.0", True, capability, "gpu", frozenset(ops))


def test_importing_autotune_and_the_backend_does_not_import_torch():
    code = "import sys, autotune, autotune.backends.torch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


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
    assert list(knobs) == ["mode", "cuda_graphs", "gemm_backends", "tf32", "cudnn_benchmark", "base_precision"]
    assert knobs["base_precision"].values == ("fp32", "fp16", "bf16")  # FP32 first: the reference's default
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
    assert [(k.name, k.values) for k in capabilities.knobs] == [
        ("mode", ("eager",)),
        ("base_precision", ("fp32", "fp16", "bf16")),
    ]
    assert capabilities.precisions_for("MatMul") == ("fp32", "fp16", "bf16", "int8")
    assert capabilities.precisions_for("Conv") == ("fp32", "fp16", "bf16")
    assert "int8" in CPU_OPS  # torch._int_mm runs on the CPU


def test_the_torch_backend_offers_smoothquant():
    # It smooths the int8/fp8 Linears it rewrites (smoothing.py), on every device.
    for info in (_cuda((9, 0)), _cuda((7, 5)), DeviceInfo("cpu", "2.13.0+cpu", ops=CPU_OPS)):
        assert torch_capabilities(info).smoothing is True


def test_cuda_probe_runs_in_a_child_process():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tests cover the probe")
    info = probe_isolated("cuda")
    assert not info.available and info.torch_version == torch.__version__
    assert DeviceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


def test_only_a_trial_process_probes_cuda_itself(monkeypatch):
    from autotune.backends.base import DEVICE_OWNER_ENV
    from autotune.backends.torch import device

    calls = []
    monkeypatch.setattr(device, "probe_isolated", lambda name: calls.append(("child", name)) or "isolated")
    monkeypatch.setattr(device, "probe_here", lambda name: calls.append(("here", name)) or "here")
    monkeypatch.delenv(DEVICE_OWNER_ENV, raising=False)
    probe = device.probe_device.__wrapped__  # the uncached function: the cache would answer the second call
    assert probe("cuda") == "isolated" and probe("cpu") == "here"
    monkeypatch.setenv(DEVICE_OWNER_ENV, "1")  # a trial process: it starts CUDA to build anyway
    assert probe("cuda:0") == "here"
    assert calls == [("child", "cuda"), ("here", "cpu"), ("here", "cuda:0")]
