"""Calibration and evaluation inputs: loaded, batched and checked before the first build."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autotune.config.schema import DataConfig, DataSource
from autotune.model.layers import InputSpec, resolve_callable

LABELS = "labels"

SPLIT_SEED_OFFSETS = {"evaluation": 0, "holdout": 1, "calibration": 2}
"""Each split's random data is drawn with the run's seed plus its offset, so the splits differ; the trial process,
the run's data check and the comparability key's fingerprint draw them alike."""


class DataError(ValueError):
    """The data cannot be used with this model; the message gives expected and actual shapes."""


@dataclass
class Dataset:
    """Full-size batches of model inputs, with labels when the data has them.

    Attributes:
        batches: One ``{input name: array}`` feed per batch.
        labels: One label array per batch, or None.
        name: What the data is for (calibration, evaluation, holdout), for messages.
    """

    batches: list[dict[str, np.ndarray]]
    labels: list[np.ndarray] | None
    name: str

    @property
    def hash(self) -> str:
        """A content hash of the inputs and labels."""
        digest = hashlib.sha256()
        for index, batch in enumerate(self.batches):
            for key in sorted(batch):
                array = np.ascontiguousarray(batch[key])
                digest.update(f"{key}{array.dtype}{array.shape}".encode())
                digest.update(array.tobytes())
            if self.labels is not None:
                digest.update(np.ascontiguousarray(self.labels[index]).tobytes())
        return digest.hexdigest()[:16]

    @property
    def num_samples(self) -> int:
        """Samples over all batches."""
        return sum(next(iter(batch.values())).shape[0] for batch in self.batches) if self.batches else 0


def _split_npz(
    path: Path, inputs: Sequence[InputSpec], what: str, start: int = 0, stop: int | None = None
) -> list[dict[str, np.ndarray]]:
    if not path.is_file():
        raise DataError(f"{what} data file {path} does not exist: fix data.{what}.npz in the config")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
        arrays = {key: array[start:stop] if array.ndim else array for key, array in arrays.items()}
    except (ValueError, OSError) as error:
        raise DataError(f"{what} data file {path} is not a readable .npz without pickles: {error}") from error
    missing = [spec.name for spec in inputs if spec.name not in arrays]
    if missing:
        raise DataError(
            f"{what} data {path} has arrays {sorted(arrays)} but the model needs inputs {missing}; "
            f"name each array after its input"
        )
    batch_size = inputs[0].shape[0]
    counts = {key: array.shape[0] if array.ndim else 0 for key, array in arrays.items()}
    if len(set(counts.values())) != 1:
        raise DataError(f"{what} data {path}: arrays have different sample counts {counts}")
    total = next(iter(counts.values()))
    if total < batch_size:
        rows = f" in samples {start}:{'' if stop is None else stop}" if start or stop is not None else ""
        raise DataError(
            f"{what} data {path} has {total} samples{rows}, fewer than one batch of {batch_size} "
            f"(the first dimension of input {inputs[0].name!r})"
        )
    return [
        {key: array[start : start + batch_size] for key, array in arrays.items()}
        for start in range(0, total - batch_size + 1, batch_size)
    ]


def _random_batches(count: int, inputs: Sequence[InputSpec], seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        batch = {}
        for spec in inputs:
            if "int" in spec.dtype:
                batch[spec.name] = rng.integers(0, 2, size=spec.shape).astype(spec.dtype)
            elif spec.dtype == "bool":
                batch[spec.name] = rng.integers(0, 2, size=spec.shape).astype(bool)
            else:
                batch[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
        batches.append(batch)
    return batches


def load_dataset(source: DataSource, inputs: Sequence[InputSpec], what: str, seed: int = 0) -> Dataset:
    """Loads one data source and checks it against the model's inputs.

    Args:
        source: Where the data comes from.
        inputs: The model's inputs at the configured shapes.
        what: ``calibration``, ``evaluation`` or ``holdout``, for messages.
        seed: Seed for random data.

    Returns:
        The checked dataset.

    Raises:
        DataError: The data is missing, empty, of the wrong shape or dtype, or not finite.
    """
    if source.npz is not None:
        raw: Iterable[Mapping[str, np.ndarray]] = _split_npz(source.npz, inputs, what, source.start, source.stop)
    elif source.random is not None:
        raw = _random_batches(source.random, inputs, seed)
    else:
        try:
            raw = resolve_callable(source.generator)(**source.kwargs)
        except ValueError as error:
            raise DataError(f"data.{what}.generator: {error}") from error
    batches, labels = [], []
    for index, item in enumerate(raw):
        if source.limit is not None and index >= source.limit:
            break
        batch = {key: np.asarray(value) for key, value in item.items()}
        if LABELS in batch:
            labels.append(batch.pop(LABELS))
        batches.append(batch)
    if labels and len(labels) != len(batches):
        raise DataError(f"{what} data: some batches have labels and some do not")
    dataset = Dataset(batches, labels or None, what)
    validate_dataset(dataset, inputs)
    return dataset


class Splits:
    """A run's data splits (calibration, evaluation, holdout), each loaded and checked once per process, on first use.

    The set-up reads them several times (the model's profile, the data check, the comparability key's fingerprint,
    the runtime choice's seeds): one ``Splits`` handed from one to the next loads each once.

    Args:
        data: The ``data`` section.
        seed: The run's seed; each split's random data is drawn with its offset (``SPLIT_SEED_OFFSETS``).
    """

    def __init__(self, data: DataConfig, seed: int):
        self.data = data
        self.seed = seed
        self._loaded: dict[str, Dataset] = {}

    def source(self, split: str) -> DataSource:
        """Where a split comes from; the holdout is the evaluation data where the config names none."""
        if split == "holdout":
            return self.data.holdout or self.data.evaluation
        return self.data.calibration if split == "calibration" else self.data.evaluation

    def load(self, split: str, inputs: Sequence[InputSpec]) -> Dataset:
        """The split, loaded and checked against the model's ``inputs`` the first time (``load_dataset``).

        Raises:
            DataError: The data is missing, empty, of the wrong shape or dtype, or not finite.
        """
        if split not in self._loaded:
            source = self.source(split)
            if split == "holdout" and self.data.holdout is None and source.random is None:
                self._loaded[split] = self.load("evaluation", inputs)  # the same file or generator: the same data
            else:
                self._loaded[split] = load_dataset(source, inputs, split, self.seed + SPLIT_SEED_OFFSETS[split])
        return self._loaded[split]


def validate_dataset(dataset: Dataset, inputs: Sequence[InputSpec]) -> None:
    """Checks every batch against the inputs.

    Raises:
        DataError: Empty data, a missing or extra input, a shape or dtype mismatch, NaN/Inf, or bad labels.
    """
    what = dataset.name
    if not dataset.batches:
        raise DataError(f"{what} data is empty: give at least one full batch")
    expected = {spec.name: spec for spec in inputs}
    for index, batch in enumerate(dataset.batches):
        if set(batch) != set(expected):
            raise DataError(f"{what} batch {index} has inputs {sorted(batch)}, the model takes {sorted(expected)}")
        for name, array in batch.items():
            spec = expected[name]
            if tuple(array.shape) != spec.shape:
                raise DataError(
                    f"{what} batch {index}, input {name!r}: expected shape {list(spec.shape)}, "
                    f"got {list(array.shape)} (fix the data, or inputs[].shape in the config)"
                )
            if array.dtype != np.dtype(spec.dtype):
                raise DataError(f"{what} batch {index}, input {name!r}: expected dtype {spec.dtype}, got {array.dtype}")
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise DataError(f"{what} batch {index}, input {name!r} contains NaN or Inf")
        if dataset.labels is not None:
            labels = dataset.labels[index]
            batch_size = next(iter(batch.values())).shape[0]
            if labels.shape[:1] != (batch_size,):
                raise DataError(
                    f"{what} batch {index}: expected {batch_size} labels (one per sample), "
                    f"got shape {list(labels.shape)}"
                )
