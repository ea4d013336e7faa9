"""Trial runners shared by the torch backend's tests: eager on the CPU, and on CUDA where there is one."""

import pytest
import torch

from autotune.harness import TrialRunner
from autotune.testing import tiny_torch_config


@pytest.fixture(scope="package")
def runner(tmp_path_factory):
    return TrialRunner(tiny_torch_config(tmp_path_factory.mktemp("torch-cpu")))


@pytest.fixture(scope="package")
def cuda_runner(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU and a CUDA torch)")
    return TrialRunner(tiny_torch_config(tmp_path_factory.mktemp("torch-cuda"), device="cuda"))
