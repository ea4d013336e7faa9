"""What a run knows before its first build: comparability keys, imports of earlier runs, prior inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from autotune.backends import backend_class
from autotune.config.schema import ConfigError
from autotune.data import Splits
from autotune.harness.earlier_runs import import_runs
from autotune.harness.identity import (
    KEY_META,
    check_comparable,
    check_resumable,
    comparability_key,
    data_fingerprint,
    key_differences,
    machine_identity,
)
from autotune.harness.prepare import load_model
from autotune.harness.priors import lent_runtime_shares, prior_inputs, store_prior_inputs, stored_runtime_shares
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.prior import PriorInputs
from autotune.testing import tiny_config, tiny_space

KEY = {"model": "abc", "machine": {"cpu": "EPYC", "isa": ["avx2"], "cores": 2}, "libraries": {"onnx": "1.17"}}


def _result(precision: str, speedup: float) -> TrialResult:
    return TrialResult(Plan.make({"fc1": precision}), latency_ms=1 / speedup, speedup=speedup, accuracy_drop=0.0)


def _run(root: Path, key, trials=(), confirmations=(), references=()) -> Path:
    root.mkdir(parents=True)
    with TrialStore(root / "trials.sqlite") as store:
        if key is not None:
            store.set_meta(KEY_META, key)
        for result in trials:
            store.put(result)
        for result in confirmations:
            store.put_confirmation(result)
        for result in references:
            store.put_reference(result)
    return root


def test_key_differences_are_the_top_level_fields_that_differ_or_one_side_lacks():
    theirs = {**KEY, "machine": {**KEY["machine"], "isa": ["avx2", "avx512_vnni"]}, "extra": 1}
    assert key_differences(KEY, theirs) == ["extra", "machine"]
    assert key_differences(KEY, dict(reversed(list(KEY.items())))) == []  # order of keys is no difference


def test_earlier_runs_are_checked_before_anything_is_imported(tmp_path):
    check_comparable([_run(tmp_path / "same", KEY)], KEY)
    with pytest.raises(ConfigError, match="has no trials.sqlite"):
        check_comparable([tmp_path / "nowhere"], KEY)
    with pytest.raises(ConfigError, match="before runs kept a comparability key"):
        check_comparable([_run(tmp_path / "old", None)], KEY)
    other = _run(tmp_path / "other", {**KEY, "model": "def", "libraries": {"onnx": "1.18"}})
    with pytest.raises(ConfigError, match=r"not comparable with this run \(libraries, model differ\)"):
        check_comparable([other], KEY)


def test_a_run_resumed_on_another_machine_is_refused_in_one_line_naming_what_differs(tmp_path):
    theirs = {**KEY, "model": "def", "machine": {**KEY["machine"], "cpu": "Xeon", "cores": 8}}
    with TrialStore(tmp_path / "trials.sqlite") as store:
        check_resumable(store, KEY, tmp_path)  # a run from before keys: nothing to check
        store.set_meta(KEY_META, KEY)
        check_resumable(store, KEY, tmp_path)
        store.set_meta(KEY_META, theirs)
        with pytest.raises(ConfigError) as raised:
            check_resumable(store, KEY, tmp_path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"resume: {tmp_path} was measured elsewhere")
    assert "machine.cores: 2 here, 8 in the run; machine.cpu: 'EPYC' here, 'Xeon' in the run; model differs" in message


def test_imports_add_trials_confirmations_and_one_liners_and_keep_what_the_run_has(tmp_path):
    int8, fp16 = _result("int8", 3.0), _result("fp16", 2.0)
    one_liner = TrialResult(Plan.reference_plan(["fc1"], "ort-static"), speedup=2.5, split="holdout")
    earlier = _run(tmp_path / "earlier", KEY, [int8, fp16], [int8], [one_liner])
    with TrialStore(tmp_path / "new.sqlite") as store:
        mine = _result("int8", 9.0)
        store.put(mine)
        assert import_runs(store, [earlier], KEY) == {str(earlier): 1}
        assert store.get(int8.plan_hash).speedup == 9.0  # measured here: the earlier result is not taken
        assert store.imported() == {fp16.plan_hash: str(earlier)} and store.builds() == 1
        assert list(store.confirmations()) == [int8.plan_hash]
        assert store.references()["ort-static"].speedup == 2.5
        assert import_runs(store, [earlier], KEY) == {str(earlier): 0}  # a second import adds nothing
        with pytest.raises(ConfigError, match="not comparable"):
            import_runs(store, [earlier], {**KEY, "model": "other"})


class _Evaluator:
    def __init__(self, layerwise):
        self.layerwise = layerwise

    def layerwise_errors(self):
        return self.layerwise


def test_prior_inputs_fill_the_unprofiled_layers_shares_by_their_macs():
    space = tiny_space()
    config = _config_of_metric()
    macs = np.array([layer.macs for layer in space.layers], float)
    inputs = prior_inputs(config.metric.name, space, _Evaluator(None))
    assert inputs.layer_names == tuple(space.layer_names) and inputs.metric == "top1"
    np.testing.assert_allclose(inputs.runtime_shares, macs / macs.sum())
    assert inputs.errors == {} and inputs.chosen == {} and inputs.default_granularity == "per_channel"
    # Two layers profiled at 0.5 and 0.2: the other two share the 0.3 left by their MACs.
    profiled = dataclasses.replace(
        space,
        layers=tuple(
            dataclasses.replace(layer, runtime_share=share)
            for layer, share in zip(space.layers, (0.5, None, 0.2, None), strict=True)
        ),
    )
    errors = {"fc1": {"max": 0.1}}
    inputs = prior_inputs(config.metric.name, profiled, _Evaluator({"methods": {"fc1": "max"}, "errors": errors}))
    rest = 0.3 * macs[[1, 3]] / macs[[1, 3]].sum()
    np.testing.assert_allclose(inputs.runtime_shares, [0.5, rest[0], 0.2, rest[1]])
    assert inputs.errors == errors and inputs.chosen == {"fc1": "max"}


def _config_of_metric():
    """Only ``metric.name`` is read from the config."""
    return type("Config", (), {"metric": type("Metric", (), {"name": "top1"})()})()


def test_prior_inputs_round_trip_through_the_store_and_lend_their_shares(tmp_path):
    inputs = PriorInputs(("fc1", "fc2"), (0.7, None), {"fc1": {"max": 0.1}}, {"fc1": "max"}, "top1")
    with TrialStore(tmp_path / "trials.sqlite") as store:
        assert stored_runtime_shares(store) is None
        store_prior_inputs(store, inputs)
        assert stored_runtime_shares(store) == {"fc1": 0.7}
    assert lent_runtime_shares(tmp_path / "trials.sqlite") == {"fc1": 0.7}
    with pytest.raises(ValueError, match="keeps no runtime shares"):
        lent_runtime_shares(tmp_path / "search.sqlite")


def test_the_comparability_key_follows_the_data_and_machine_not_the_budget(tmp_path):
    config = tiny_config(tmp_path)
    model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)

    def key_of(config):
        data = data_fingerprint(Splits(config.data, config.seed), model.inputs)
        return comparability_key(model.hash, data, config.metric, config.calibration, config.backend, config.measure)

    key = key_of(config)
    assert set(key) == {"model", "data", "metric", "calibration", "backend", "measure", "machine", "libraries"}
    assert key["machine"] == machine_identity(backend_class(config.backend.name)) and key["machine"]["gpu"] is None
    assert set(key["libraries"]) == {"onnxruntime", "onnx", "numpy"} and key["model"] == model.hash
    assert key_of(config.model_copy(update={"accuracy_budget": 0.5})) == key
    data = np.load(config.data.holdout.npz)
    np.savez(tmp_path / "other.npz", x=data["x"] + 1, labels=data["labels"])
    holdout = config.data.holdout.model_copy(update={"npz": tmp_path / "other.npz"})
    moved = config.model_copy(update={"data": config.data.model_copy(update={"holdout": holdout})})
    assert key_differences(key, key_of(moved)) == ["data"]
