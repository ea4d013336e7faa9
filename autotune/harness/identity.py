"""A run's comparability key: the machine's identity, the data's fingerprint, and what else its trials depend on.

A trial's speedup and drop depend on the model file, the data, the backend and its options, the machine and the
libraries whose kernels run it; not on the accuracy budget, the reward or the build budget. So a run keeps a
comparability key in its store's meta: a resumed run, or an earlier run whose trials a new one imports
(:mod:`autotune.harness.earlier_runs`), must have an equal key, or it is refused with the fields that differ.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune.backends import Backend, backend_class
from autotune.backends.int8_kernels import isa_features
from autotune.config.schema import (
    BackendConfig,
    CalibrationConfig,
    ConfigError,
    ExecutionConfig,
    MeasureConfig,
    MetricConfig,
)
from autotune.data import Splits
from autotune.model.layers import InputSpec
from autotune.quant.calibrate import data_hash, usable_cores
from autotune.run.store import TrialStore

KEY_META = "comparability"
"""The store meta key holding a run's comparability key."""

_KERNEL_LIBRARIES = {
    "onnxruntime": ("onnxruntime", "onnx", "numpy"),
    "openvino": ("openvino", "nncf", "onnx", "numpy"),
    "tensorrt": ("tensorrt", "onnx", "numpy"),
    "torch": ("torch", "onnx", "numpy"),
}
"""Per backend, the libraries whose versions change what a build computes or how fast."""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _library_versions(backend: str) -> dict[str, str | None]:
    """The versions of the libraries whose kernels run the backend's builds (``_KERNEL_LIBRARIES``)."""
    return {name: _version(name) for name in _KERNEL_LIBRARIES.get(backend, ("onnx", "numpy"))}


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity(backend: type[Backend]) -> dict[str, Any]:
    """CPU model, its INT8 ISA features, cores this process may use, and what identifies the backend's device.

    The backend's device: the GPU's name where it runs on one (``gpu``, None on the CPU), and with the OpenVINO
    backend the CPU's BF16 features (``bf16_isa``; ``Backend.device_identity``). One CPU model name covers CPUs
    with and without VNNI (``AMD EPYC``, a VM's generic name), whose INT8 kernels differ in speed and in what they
    compute: trials of one are no evidence about the other.
    """
    return {
        "cpu": _cpu_model(),
        "isa": list(isa_features()),
        "cores": usable_cores(),
        "system": platform.system(),
        **backend.device_identity(),
    }


def data_fingerprint(splits: Splits, inputs: Sequence[InputSpec]) -> dict[str, str]:
    """A content hash per data split (calibration changes the ranges; evaluation and holdout the measurements).

    Args:
        splits: The run's splits (loaded here where nothing loaded them yet).
        inputs: The model's inputs.
    """
    return {name: data_hash(splits.load(name, inputs).batches) for name in ("calibration", "evaluation", "holdout")}


def comparability_key(
    model_hash: str,
    data: dict[str, str],
    metric: MetricConfig,
    calibration: CalibrationConfig,
    backend: BackendConfig,
    measure: MeasureConfig,
) -> dict[str, Any]:
    """What must be equal for two runs' trials to be comparable.

    Model file, data, metric, calibration settings, backend and its options, measurement protocol, machine and
    kernel library versions. Not the accuracy budget, reward, build budget, search strategy or seed.

    Args:
        model_hash: The model's hash (``LoadedModel.hash``).
        data: The data's fingerprint (``data_fingerprint``).
        metric: The ``metric`` section.
        calibration: The ``calibration`` section.
        backend: The ``backend`` section.
        measure: The ``measure`` section.
    """
    return {
        "model": model_hash,
        "data": data,
        "metric": metric.model_dump(mode="json"),
        "calibration": calibration.model_dump(mode="json"),
        "backend": backend.model_dump(mode="json"),
        "measure": measure.model_dump(mode="json"),
        "machine": machine_identity(backend_class(backend.name)),
        "libraries": _library_versions(backend.name),
    }


def pace_key(
    model_hash: str, feeds_hash: str, backend: BackendConfig, measure: MeasureConfig, execution: ExecutionConfig
) -> str:
    """What sets the FP32 reference's pace on this machine (``autotune.measure.pace``), as 16 hex characters.

    The model, the batch it is timed on (``feeds_hash``), the backend and its options, how a round times it, the
    trial workers beside it, the machine and the kernel libraries.
    """
    fields = {
        "model": model_hash,
        "feeds": feeds_hash,
        "backend": backend.model_dump(mode="json"),
        "round": {"warmup": measure.warmup, "repeats": measure.repeats, "min_sample_ms": measure.min_sample_ms},
        "execution": execution.model_dump(mode="json"),
        "machine": machine_identity(backend_class(backend.name)),
        "libraries": _library_versions(backend.name),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def key_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The top-level fields of two comparability keys that differ, sorted."""
    return sorted(
        k
        for k in {*ours, *theirs}
        if json.dumps(ours.get(k), sort_keys=True) != json.dumps(theirs.get(k), sort_keys=True)
    )


def check_comparable(run_dirs: Sequence[Path], key: dict[str, Any]) -> None:
    """Checks that every earlier run's trials are comparable with a run of ``key``.

    Raises:
        ConfigError: A run directory has no trial store, or its trials are not comparable (one line naming the
            fields that differ).
    """
    for run_dir in run_dirs:
        path = Path(run_dir) / "trials.sqlite"
        if not path.is_file():
            raise ConfigError(f"from_runs: {run_dir} has no trials.sqlite; name the directory of an earlier run")
        with TrialStore(path) as earlier:
            theirs = earlier.get_meta(KEY_META)
        if not isinstance(theirs, dict):
            raise ConfigError(
                f"from_runs: {run_dir} was measured before runs kept a comparability key, so its trials cannot be "
                f"checked and are not reused: drop it from --from"
            )
        differ = key_differences(key, theirs)
        if differ:
            raise ConfigError(
                f"from_runs: {run_dir} is not comparable with this run ({', '.join(differ)} differ), so its "
                f"trials are not reused: drop it from --from"
            )


def _what_differs(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Each differing field of two keys, one level deep where both sides are dicts: ``machine.cpu: A here, B there``."""
    lines = []
    for field in key_differences(ours, theirs):
        here, there = ours.get(field), theirs.get(field)
        if isinstance(here, dict) and isinstance(there, dict):
            lines += [
                f"{field}.{sub}: {here.get(sub)!r} here, {there.get(sub)!r} in the run"
                for sub in key_differences(here, there)
            ]
        else:
            lines.append(f"{field} differs")
    return lines


def check_resumable(store: TrialStore, key: dict[str, Any], run_dir: Path) -> None:
    """Checks that a run is resumed where its trials were measured: the same machine, software, model and data.

    Resumed elsewhere, its new latencies would be ranked with the stored ones of another machine or runtime.

    Raises:
        ConfigError: The stored comparability key differs from this machine's (one line naming what differs).
    """
    theirs = store.get_meta(KEY_META)
    if not isinstance(theirs, dict):
        return  # a run from before comparability keys: nothing to check against
    differ = _what_differs(key, theirs)
    if differ:
        raise ConfigError(
            f"resume: {run_dir} was measured elsewhere ({'; '.join(differ)}), and its latencies cannot be ranked "
            f"with this machine's: resume it where it ran, or start a new run here"
        )
