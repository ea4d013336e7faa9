"""The GPU configs (backend torch) validate and agree with their data; no GPU or torch backend is needed."""

from pathlib import Path

import numpy as np
import pytest

from autotune.config.schema import load_config
from autotune.model.layers import resolve_callable

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPU_CONFIGS = {
    "minilm-gpu.yaml": 8,
    "minilm-gpu-b1.yaml": 1,
    "minilm-gpu-b64.yaml": 64,
    "minilm-gpu-b256.yaml": 256,
    "cnn-gpu.yaml": 1,
}


@pytest.mark.parametrize(("name", "batch"), GPU_CONFIGS.items())
def test_gpu_configs_validate_with_the_torch_backend_and_a_short_search(name, batch):
    config = load_config(CONFIGS / name)
    assert config.name == name.removesuffix(".yaml")
    assert config.backend.name == "torch"
    assert config.backend.options.model_dump() == {"device": "cuda", "quantized_gemm": "autotune"}
    assert config.backend.timeout_s == 300
    assert config.search.knobs == {"mode": ["compile"], "cuda_graphs": [True]}
    assert config.budget.builds == 24 and config.confirm.top_k == 3
    assert {spec.shape[0] for spec in config.inputs} == {batch}
    for split in (config.data.calibration, config.data.evaluation, config.data.holdout):
        assert split.kwargs["batch_size"] == batch  # the generator's batches fit the declared input shapes
    resolve_callable(config.model.torch)  # the factory and the generator exist (imports are cheap)
    resolve_callable(config.data.evaluation.generator)


def test_gpu_configs_accept_overrides_of_the_run_folder(tmp_path):
    config = load_config(CONFIGS / "cnn-gpu.yaml", [f"runs_dir={tmp_path}"])
    assert config.run_dir == tmp_path / "cnn-gpu"


def test_cnn_gpu_data_comes_in_single_images_of_the_declared_shape():
    config = load_config(CONFIGS / "cnn-gpu.yaml")
    batches = resolve_callable(config.data.evaluation.generator)(**config.data.evaluation.kwargs)
    assert len(batches) == 2048
    assert batches[0]["image"].shape == tuple(config.inputs[0].shape) and batches[0]["image"].dtype == np.float32
