"""What a run knows before its first build: priors per layer, and the trials of earlier comparable runs.

A trial's speedup and drop depend on the model file, the data, the backend and its options, the machine and the
libraries whose kernels run it; not on the accuracy budget, the reward or the build budget. So a run keeps a
comparability key in its store's meta, and a new run whose key is equal reuses the earlier run's trials (and its
held-out confirmations and one-liners) as imported trials that cost no build (``autotune tune --from RUN_DIR``,
config key ``from_runs``). A run with another key is refused with the fields that differ.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune.backends.int8_kernels import isa_features
from autotune.backends.openvino.properties import bf16_features
from autotune.config import ConfigError, TuneConfig
from autotune.data import load_dataset
from autotune.harness.evaluator import Evaluator
from autotune.model import LoadedModel
from autotune.plan import GRANULARITY_KNOB
from autotune.quant.calibrate import data_hash, usable_cores
from autotune.search.prior import PriorInputs
from autotune.search.space import SearchSpace
from autotune.store import TrialStore

KEY_META = "comparability"
"""The store meta key holding a run's comparability key."""

PRIOR_META = "prior_inputs"
"""The store meta key holding the run's prior inputs (single-layer errors, runtime shares), for the replay."""

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


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name(config: TuneConfig) -> str | None:
    """The GPU's name for the backends that run on one (torch is imported only then)."""
    if config.backend.name not in ("tensorrt", "torch"):
        return None
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def machine_identity(config: TuneConfig) -> dict[str, Any]:
    """CPU model, its INT8 ISA features, cores this process may use, and GPU name where the backend has one.

    With the OpenVINO backend also the CPU's BF16 features (``bf16_isa``): its BF16 layers exist only where they
    are. One CPU model name covers CPUs with and without VNNI (``AMD EPYC``, a VM's generic name), whose INT8 kernels
    differ in speed and in what they compute: trials of one are no evidence about the other.
    """
    identity = {
        "cpu": _cpu_model(),
        "isa": list(isa_features()),
        "cores": usable_cores(),
        "gpu": _gpu_name(config),
        "system": platform.system(),
    }
    if config.backend.name == "openvino":  # BF16 kernels (AVX512_BF16, AMX) decide its float precisions' speed
        identity["bf16_isa"] = list(bf16_features())
    return identity


def data_fingerprint(config: TuneConfig, model: LoadedModel) -> dict[str, str]:
    """A content hash per data split (calibration changes the ranges; evaluation and holdout the measurements)."""
    splits = {"calibration": config.data.calibration, "evaluation": config.data.evaluation}
    splits["holdout"] = config.data.holdout or config.data.evaluation
    seeds = {"evaluation": config.seed, "holdout": config.seed + 1, "calibration": config.seed + 2}
    return {
        name: data_hash(load_dataset(source, model.inputs, name, seeds[name]).batches)
        for name, source in splits.items()
    }


def comparability_key(config: TuneConfig, model: LoadedModel) -> dict[str, Any]:
    """What must be equal for two runs' trials to be comparable.

    Model file, data, metric, calibration settings, backend and its options, measurement protocol, machine and
    kernel library versions. Not the accuracy budget, reward, build budget, search strategy or seed.
    """
    libraries = _KERNEL_LIBRARIES.get(config.backend.name, ("onnx", "numpy"))
    return {
        "model": model.hash,
        "data": data_fingerprint(config, model),
        "metric": config.metric.model_dump(mode="json"),
        "calibration": config.calibration.model_dump(mode="json"),
        "backend": config.backend.model_dump(mode="json"),
        "measure": config.measure.model_dump(mode="json"),
        "machine": machine_identity(config),
        "libraries": {name: _version(name) for name in libraries},
    }


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


def import_runs(store: TrialStore, run_dirs: Sequence[Path], key: dict[str, Any]) -> dict[str, int]:
    """Imports the trials, confirmations and one-liner results of earlier comparable runs into ``store``.

    Args:
        store: The new run's store.
        run_dirs: Earlier run directories.
        key: The new run's comparability key.

    Returns:
        Per run directory, how many trials it added (plans already in the store keep their own result).

    Raises:
        ConfigError: See :func:`check_comparable`.
    """
    check_comparable(run_dirs, key)
    added = {}
    for run_dir in run_dirs:
        source = str(run_dir)
        with TrialStore(Path(run_dir) / "trials.sqlite") as earlier:
            added[source] = sum(store.put_imported(trial, source) for trial in earlier.trials())
            done = store.confirmations()
            for plan_hash, result in earlier.confirmations().items():
                if plan_hash not in done:
                    store.put_confirmation(result)
            references = store.references()
            for name, result in earlier.references().items():
                if name not in references:
                    store.put_reference(result)
    return added


def prior_inputs(config: TuneConfig, space: SearchSpace, evaluator: Evaluator) -> PriorInputs:
    """The run's per-layer prior inputs: the layerwise calibration's single-layer errors and FP32 runtime shares.

    Layers the profile did not time get their share of MACs instead (the best guess before any build), as do all
    layers where the backend cannot profile.
    """
    layers = space.layers
    shares: list[float | None] = [layer.runtime_share for layer in layers]
    if any(share is None for share in shares):
        profiled = sum(share or 0.0 for share in shares)
        rest = max(0.0, 1.0 - profiled) if profiled else 1.0
        unprofiled_macs = sum(layer.macs for layer, share in zip(layers, shares, strict=True) if share is None) or 1
        shares = [
            share if share is not None else rest * layer.macs / unprofiled_macs
            for layer, share in zip(layers, shares, strict=True)
        ]
    layerwise = evaluator.layerwise_errors() or {"methods": {}, "errors": {}}
    granularity = next((knob.default for knob in space.knobs if knob.name == GRANULARITY_KNOB), None)
    return PriorInputs(
        tuple(space.layer_names),
        tuple(shares),
        layerwise["errors"],
        layerwise["methods"],
        config.metric.name,
        None if granularity is None else str(granularity),
    )


def store_prior_inputs(store: TrialStore, inputs: PriorInputs) -> None:
    """Keeps the prior inputs in the run's meta (the replay reads them)."""
    store.set_meta(PRIOR_META, inputs.to_dict())


def stored_runtime_shares(store: TrialStore) -> dict[str, float] | None:
    """The FP32 profile's share of each layer kept in a run's meta (agent runs with priors keep it), or None."""
    meta = store.get_meta(PRIOR_META)
    if meta is None:
        return None
    return PriorInputs.from_dict(meta).share_map()


def lent_runtime_shares(path: Path) -> dict[str, float]:
    """The runtime shares kept in another run's store, lent to a store that keeps none (a search's).

    Raises:
        ValueError: The store keeps none.
    """
    with TrialStore(path) as store:
        shares = stored_runtime_shares(store)
    if shares is None:
        raise ValueError(f"{path}: the store keeps no runtime shares (an agent run's store does)")
    return shares
