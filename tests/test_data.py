"""Tests for autotune.data: npz, random and generator sources and every check on them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autotune.config.schema import DataSource
from autotune.data import DataError, Dataset, load_dataset, validate_dataset
from autotune.model.layers import InputSpec

X = InputSpec("x", (16, 32), "float32")
GENERATOR_CALLS: list[dict] = []


def batches(count=3, batch=16, features=32, scale=1.0, labels=True, label_count=None, dtype="float32"):
    """A generator source: referenced as tests.test_data:batches with kwargs."""
    GENERATOR_CALLS.append({"count": count, "batch": batch, "features": features, "scale": scale, "labels": labels})
    rng = np.random.default_rng(0)
    for i in range(count):
        item = {"x": (rng.standard_normal((batch, features)) * scale + i).astype(dtype)}
        if labels:
            item["labels"] = np.arange(label_count if label_count is not None else batch) % 10
        yield item


def endless():
    """An infinite generator: only ``limit`` makes it usable."""
    for i in itertools.count():
        yield {"x": np.full((16, 32), float(i), dtype=np.float32)}


def nothing():
    return iter(())


def some_labelled():
    yield {"x": np.zeros((16, 32), np.float32), "labels": np.zeros(16, np.int64)}
    yield {"x": np.zeros((16, 32), np.float32)}


def nan_batch():
    x = np.zeros((16, 32), np.float32)
    x[3, 4] = np.nan
    yield {"x": x}


def inf_batch():
    x = np.zeros((16, 32), np.float32)
    x[0, 0] = -np.inf
    yield {"x": x}


def extra_input():
    yield {"x": np.zeros((16, 32), np.float32), "y": np.zeros((16, 2), np.float32)}


def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _load_npz(path, inputs=(X,), what="evaluation", limit=None):
    return load_dataset(DataSource(npz=path, limit=limit), list(inputs), what)


def test_npz_splits_into_full_batches_and_pops_labels(tmp_path):
    x = np.arange(40 * 32, dtype=np.float32).reshape(40, 32)
    labels = np.arange(40, dtype=np.int64)
    dataset = _load_npz(_npz(tmp_path, x=x, labels=labels))
    assert dataset.name == "evaluation"
    assert len(dataset.batches) == 2  # 40 samples: two batches of 16, the last 8 dropped
    assert all(set(batch) == {"x"} for batch in dataset.batches)
    np.testing.assert_array_equal(dataset.batches[0]["x"], x[:16])
    np.testing.assert_array_equal(dataset.batches[1]["x"], x[16:32])
    assert dataset.labels is not None and len(dataset.labels) == 2
    np.testing.assert_array_equal(dataset.labels[1], labels[16:32])
    assert dataset.num_samples == 32


def test_npz_without_labels(tmp_path):
    dataset = _load_npz(_npz(tmp_path, x=np.zeros((32, 32), np.float32)))
    assert dataset.labels is None
    assert len(dataset.batches) == 2


def test_npz_limit(tmp_path):
    dataset = _load_npz(_npz(tmp_path, x=np.zeros((80, 32), np.float32)), limit=3)
    assert len(dataset.batches) == 3


def test_npz_start_and_stop_read_one_range_of_samples_with_its_labels(tmp_path):
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = _npz(tmp_path, x=x, labels=np.arange(64, dtype=np.int64))
    dataset = load_dataset(DataSource(npz=path, start=16, stop=48), [X], "evaluation")
    assert len(dataset.batches) == 2
    np.testing.assert_array_equal(dataset.batches[0]["x"], x[16:32])
    np.testing.assert_array_equal(dataset.labels[1], np.arange(32, 48))
    tail = load_dataset(DataSource(npz=path, start=48), [X], "holdout")
    np.testing.assert_array_equal(tail.batches[0]["x"], x[48:])
    with pytest.raises(DataError, match="8 samples in samples 40:48, fewer than one batch of 16"):
        load_dataset(DataSource(npz=path, start=40, stop=48), [X], "calibration")


def test_npz_multiple_inputs(tmp_path):
    ids = InputSpec("ids", (4, 8), "int64")
    mask = InputSpec("mask", (4, 8), "int64")
    path = _npz(tmp_path, ids=np.ones((8, 8), np.int64), mask=np.zeros((8, 8), np.int64))
    dataset = _load_npz(path, inputs=(ids, mask))
    assert len(dataset.batches) == 2
    assert dataset.batches[0]["ids"].shape == (4, 8)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.npz"
    with pytest.raises(DataError, match="does not exist") as info:
        _load_npz(path, what="calibration")
    assert str(path) in str(info.value)
    assert "data.calibration.npz" in str(info.value)


def test_unreadable_file(tmp_path):
    path = tmp_path / "bad.npz"
    path.write_bytes(b"garbage, not a zip" * 20)
    with pytest.raises(DataError, match="not a readable .npz") as info:
        _load_npz(path)
    assert str(path) in str(info.value)


def test_pickled_arrays_refused(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}] * 16, dtype=object))
    with pytest.raises(DataError, match="without pickles"):
        _load_npz(path)


def test_missing_input_array_names_both(tmp_path):
    path = _npz(tmp_path, y=np.zeros((16, 32), np.float32), labels=np.zeros(16, np.int64))
    with pytest.raises(DataError) as info:
        _load_npz(path)
    message = str(info.value)
    assert "['labels', 'y']" in message
    assert "['x']" in message


def test_wrong_shape_gives_expected_and_actual(tmp_path):
    with pytest.raises(DataError) as info:
        _load_npz(_npz(tmp_path, x=np.zeros((32, 31), np.float32)))
    message = str(info.value)
    assert "expected shape [16, 32]" in message
    assert "got [16, 31]" in message
    assert "'x'" in message


def test_wrong_dtype_gives_expected_and_actual(tmp_path):
    with pytest.raises(DataError) as info:
        _load_npz(_npz(tmp_path, x=np.zeros((16, 32), np.float64)))
    assert "expected dtype float32, got float64" in str(info.value)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values(tmp_path, value):
    x = np.zeros((32, 32), np.float32)
    x[20, 5] = value
    with pytest.raises(DataError, match="NaN or Inf") as info:
        _load_npz(_npz(tmp_path, x=x))
    assert "batch 1" in str(info.value) and "'x'" in str(info.value)


def test_fewer_samples_than_a_batch(tmp_path):
    with pytest.raises(DataError) as info:
        _load_npz(_npz(tmp_path, x=np.zeros((8, 32), np.float32)))
    message = str(info.value)
    assert "8 samples" in message and "batch of 16" in message and "'x'" in message


def test_npz_label_count_mismatch(tmp_path):
    path = _npz(tmp_path, x=np.zeros((32, 32), np.float32), labels=np.zeros(30, np.int64))
    with pytest.raises(DataError, match="different sample counts") as info:
        _load_npz(path)
    assert "'x': 32" in str(info.value) and "'labels': 30" in str(info.value)


def test_generator_label_count_mismatch():
    source = DataSource(generator="tests.test_data:batches", kwargs={"count": 2, "label_count": 8})
    with pytest.raises(DataError) as info:
        load_dataset(source, [X], "evaluation")
    assert "expected 16 labels" in str(info.value) and "[8]" in str(info.value)


def test_generator_with_kwargs():
    GENERATOR_CALLS.clear()
    source = DataSource(generator="tests.test_data:batches", kwargs={"count": 4, "scale": 0.5})
    dataset = load_dataset(source, [X], "calibration")
    assert GENERATOR_CALLS == [{"count": 4, "batch": 16, "features": 32, "scale": 0.5, "labels": True}]
    assert dataset.name == "calibration"
    assert len(dataset.batches) == 4
    assert len(dataset.labels) == 4
    assert dataset.batches[2]["x"].mean() == pytest.approx(2.0, abs=0.2)
    assert set(dataset.batches[0]) == {"x"}


def test_generator_limit_on_endless_source():
    dataset = load_dataset(DataSource(generator="tests.test_data:endless", limit=3), [X], "evaluation")
    assert len(dataset.batches) == 3
    assert [float(b["x"][0, 0]) for b in dataset.batches] == [0.0, 1.0, 2.0]
    assert dataset.labels is None


def test_generator_wrong_dtype():
    source = DataSource(generator="tests.test_data:batches", kwargs={"dtype": "float16"})
    with pytest.raises(DataError, match="expected dtype float32, got float16"):
        load_dataset(source, [X], "evaluation")


def test_generator_wrong_shape():
    source = DataSource(generator="tests.test_data:batches", kwargs={"features": 8})
    with pytest.raises(DataError, match=r"expected shape \[16, 32\], got \[16, 8\]"):
        load_dataset(source, [X], "evaluation")


@pytest.mark.parametrize("name", ["nan_batch", "inf_batch"])
def test_generator_non_finite(name):
    with pytest.raises(DataError, match="NaN or Inf"):
        load_dataset(DataSource(generator=f"tests.test_data:{name}"), [X], "evaluation")


def test_empty_generator():
    with pytest.raises(DataError, match="evaluation data is empty"):
        load_dataset(DataSource(generator="tests.test_data:nothing"), [X], "evaluation")


def test_some_batches_labelled():
    with pytest.raises(DataError, match="some batches have labels"):
        load_dataset(DataSource(generator="tests.test_data:some_labelled"), [X], "evaluation")


def test_extra_input_names_both():
    with pytest.raises(DataError) as info:
        load_dataset(DataSource(generator="tests.test_data:extra_input"), [X], "evaluation")
    assert "['x', 'y']" in str(info.value) and "['x']" in str(info.value)


@pytest.mark.parametrize("spec", ["tests.test_data:missing", "no_such_module_xyz:f"])
def test_unresolvable_generator(spec):
    with pytest.raises(DataError, match="data.holdout.generator"):
        load_dataset(DataSource(generator=spec), [X], "holdout")


def test_random_source_shapes_and_dtypes():
    inputs = [
        InputSpec("f", (2, 3), "float32"),
        InputSpec("h", (2, 5), "float16"),
        InputSpec("ids", (2, 7), "int64"),
        InputSpec("small", (2,), "int32"),
        InputSpec("flag", (2, 4), "bool"),
    ]
    dataset = load_dataset(DataSource(random=3), inputs, "calibration", seed=5)
    assert len(dataset.batches) == 3
    assert dataset.labels is None
    for batch in dataset.batches:
        for spec in inputs:
            assert batch[spec.name].shape == spec.shape
            assert batch[spec.name].dtype == np.dtype(spec.dtype)
        assert set(np.unique(batch["ids"])) <= {0, 1}
    assert dataset.batches[0]["f"].std() > 0
    assert not np.array_equal(dataset.batches[0]["f"], dataset.batches[1]["f"])


def test_random_source_seeded():
    a = load_dataset(DataSource(random=2), [X], "evaluation", seed=1)
    b = load_dataset(DataSource(random=2), [X], "evaluation", seed=1)
    c = load_dataset(DataSource(random=2), [X], "evaluation", seed=2)
    assert a.hash == b.hash
    assert a.hash != c.hash
    assert len(load_dataset(DataSource(random=5, limit=2), [X], "evaluation").batches) == 2


def test_dataset_hash_covers_labels_and_values():
    x = np.zeros((16, 32), np.float32)
    base = Dataset([{"x": x}], [np.zeros(16, np.int64)], "e")
    assert base.hash == Dataset([{"x": x.copy()}], [np.zeros(16, np.int64)], "other").hash
    assert base.hash != Dataset([{"x": x}], [np.ones(16, np.int64)], "e").hash
    assert base.hash != Dataset([{"x": x + 1}], [np.zeros(16, np.int64)], "e").hash
    assert base.hash != Dataset([{"x": x}], None, "e").hash
    assert Dataset([], None, "e").num_samples == 0


def test_validate_dataset_directly():
    good = Dataset([{"x": np.zeros((16, 32), np.float32)}], [np.zeros(16)], "holdout")
    validate_dataset(good, [X])
    with pytest.raises(DataError, match="holdout data is empty"):
        validate_dataset(Dataset([], None, "holdout"), [X])
