"""What a run prepares once: the model file, runtime shares, the space, calibration and the quantization per plan."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.backends import get_backend
from autotune.data import load_dataset
from autotune.harness import prepare
from autotune.harness.deadline import layerwise_allowance_s
from autotune.harness.prepare import (
    LayerwiseBounds,
    Quantizations,
    SetupError,
    calibrate_ranges,
    choose_layerwise,
    config_inputs,
    load_model,
    model_file,
    prepare_backend,
    search_space,
    with_runtime_shares,
)
from autotune.model.layers import InputSpec
from autotune.plan import CALIBRATION_KNOB, Plan
from autotune.testing import tiny_config


def _bounds(config):
    """The layerwise bounds a runner passes for ``config``."""
    return LayerwiseBounds(config.cache_dir, layerwise_allowance_s(config.budget.minutes))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("prepare"))
    backend = get_backend(config.backend, config.model)
    model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
    data = load_dataset(config.data.calibration, model.inputs, "calibration", config.seed)
    return config, backend, model, data


def test_an_onnx_model_is_its_file_and_a_torch_factory_is_exported_once_per_shapes(tmp_path, monkeypatch):
    config = tiny_config(tmp_path)
    ort, cache = config.backend.name, config.cache_dir
    assert model_file(config.model, config.inputs, ort, cache) == config.model.onnx
    assert config_inputs(config.inputs) == [InputSpec("x", (16, 32), "float32")]
    exports = []

    def export(factory, inputs, path, opset, batch_free):
        exports.append((factory, tuple(inputs), opset, batch_free))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"exported")

    monkeypatch.setattr(prepare, "export_torch", export)
    torch_model = config.model.model_copy(update={"onnx": None, "torch": "autotune.testing:tiny_torch_mlp"})
    path = model_file(torch_model, config.inputs, ort, cache)
    assert path.parent == config.cache_dir / "models" and path.name.startswith("autotune.testing.tiny_torch_mlp-")
    assert (
        model_file(torch_model, config.inputs, ort, cache) == path and len(exports) == 1
    )  # cached: not exported again
    wider = [config.inputs[0].model_copy(update={"shape": [8, 32]})]
    assert model_file(torch_model, wider, ort, cache) != path and len(exports) == 2  # other shapes, another file
    assert not exports[0][3]  # ONNX Runtime runs the graph: exported at its shapes
    on_torch = model_file(torch_model, config.inputs, "torch", cache)
    assert (
        on_torch not in (path, model_file(torch_model, wider, ort, cache)) and exports[-1][3]
    )  # the torch backend's: batch-free
    with pytest.raises(SetupError, match="model.torch needs inputs"):
        model_file(torch_model, [], ort, cache)


class _Profiler:
    def __init__(self, shares):
        self.shares = shares

    def profile(self, model, feeds):
        return self.shares


def test_runtime_shares_fill_the_layers_the_backend_timed(run):
    _, _, model, _ = run
    names = [layer.name for layer in model.layers]
    assert with_runtime_shares(model, _Profiler(None), {}).layers == model.layers  # a backend that cannot profile
    shared = with_runtime_shares(
        load_model(run[0].model, run[0].inputs, run[0].backend.name, run[0].cache_dir),
        _Profiler({names[0]: 0.6, names[2]: 0.1}),
        {},
    )
    assert [layer.runtime_share for layer in shared.layers] == [0.6, None, 0.1, None]


class _Refusing:
    def __init__(self, backend):
        self.backend = backend
        self.searched = None

    def capabilities(self):
        return self.backend.capabilities()

    def prepare(self, model, searched):
        self.searched = list(searched)
        raise ValueError(f"cannot build {searched[0]} in INT8: set search.exclude_layers")


def test_space_and_backend_problems_are_setup_errors_naming_the_fix(run):
    config, backend, model, _ = run
    space = search_space(config.search, model, backend)
    assert space.layer_names == [layer.name for layer in model.layers]
    bad = config.model_copy(update={"search": config.search.model_copy(update={"knobs": {"no_such_knob": [1]}})})
    with pytest.raises(SetupError, match="no_such_knob"):
        search_space(bad.search, model, backend)
    refusing = _Refusing(backend)
    with pytest.raises(SetupError, match="cannot build fc1 in INT8: set search.exclude_layers"):
        prepare_backend(refusing, model, space)
    assert refusing.searched == space.layer_names  # every searchable layer is handed over
    prepare_backend(backend, model, space)


class _Calibration:
    def ranges(self, method):
        return {"x": {"max": (-4.0, 4.0), "percentile": (-3.0, 3.0)}[method]}


def test_the_max_calibration_is_the_range_of_the_calibration_data(run):
    config, backend, model, data = run
    ranges = calibrate_ranges(config.calibration, config.cache_dir, model, backend, data).ranges("max")
    x = np.concatenate([batch["x"] for batch in data.batches])
    assert ranges["x"] == pytest.approx((float(x.min()), float(x.max())))
    assert set(ranges) == {"x", "a1", "a2", "a3"}  # the inputs of the INT8-capable layers
    assert (config.cache_dir / "calibration").is_dir()  # cached per model and data


def test_each_plan_gets_the_ranges_of_its_calibration_method(run):
    _, _, model, _ = run
    quantizations = Quantizations(model, _Calibration(), None)
    maxed = quantizations(Plan.make({"fc1": "int8"}))  # no knob: max
    assert maxed.ranges == {"x": (-4.0, 4.0)} and not maxed.layer_ranges and not maxed.smoothing
    assert quantizations(Plan.make({"fc1": "int8"}, {CALIBRATION_KNOB: "percentile"})).ranges == {"x": (-3.0, 3.0)}
    with pytest.raises(ValueError, match="layerwise is not offered"):
        quantizations(Plan.make({"fc1": "int8"}, {CALIBRATION_KNOB: "layerwise"}))


def test_layerwise_runs_only_where_offered_and_its_failure_says_how_to_do_without(run, monkeypatch):
    config, backend, model, data = run
    calibration = calibrate_ranges(config.calibration, config.cache_dir, model, backend, data)
    only_max = config.model_copy(update={"search": config.search.model_copy(update={"calibration_methods": ["max"]})})
    space = search_space(only_max.search, model, backend)
    assert choose_layerwise(_bounds(only_max), model, backend, space, calibration, data, 0) is None

    def fail(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL")

    monkeypatch.setattr(prepare, "choose_layer_methods", fail)
    space = search_space(config.search, model, backend)
    with pytest.raises(SetupError, match="layerwise calibration failed: .*FAIL; leave 'layerwise' out of"):
        choose_layerwise(_bounds(config), model, backend, space, calibration, data, 0)


def test_calibration_errors_are_setup_errors(run, monkeypatch):
    config, backend, model, data = run

    def fail(*args, **kwargs):
        raise ValueError("tensor h1 is not finite")

    monkeypatch.setattr(prepare, "calibrate", fail)
    with pytest.raises(SetupError, match="calibration failed: tensor h1 is not finite"):
        calibrate_ranges(config.calibration, config.cache_dir, model, backend, data)


def test_layerwise_may_take_a_quarter_of_the_budget_minutes(run, monkeypatch):
    config, backend, model, data = run
    calibration = calibrate_ranges(config.calibration, config.cache_dir, model, backend, data)
    space = search_space(config.search, model, backend)
    seen = {}
    monkeypatch.setattr(prepare, "choose_layer_methods", lambda *args, **options: seen.update(options))
    choose_layerwise(_bounds(config), model, backend, space, calibration, data, 0)
    assert seen["allowance_s"] is None  # no minutes: no limit
    timed = config.model_copy(update={"budget": config.budget.model_copy(update={"minutes": 4.0})})
    choose_layerwise(_bounds(timed), model, backend, space, calibration, data, 0)
    assert seen["allowance_s"] == 60.0
