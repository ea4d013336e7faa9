"""Tests for autotune.config.schema: validation messages, loading, overrides, path resolution, dumping."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from autotune.config.schema import (
    ConfigError,
    DataSource,
    ModelConfig,
    TuneConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_config,
)


def _raw(**updates: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "run1",
        "model": {"onnx": "/abs/model.onnx"},
        "data": {"calibration": {"random": 2}, "evaluation": {"random": 3}},
    }
    data.update(updates)
    return data


def _error(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def _error_lines(data: Any) -> dict[str, str]:
    """Maps each ``  key.path: message`` line of a ConfigError to its message."""
    lines = {}
    for line in _error(data).splitlines()[1:]:
        key, _, message = line.strip().partition(": ")
        lines[key] = message
    return lines


def test_minimal_config_parses_with_defaults():
    config = parse_config(_raw())
    assert isinstance(config, TuneConfig)
    assert config.name == "run1"
    assert config.model.onnx == Path("/abs/model.onnx")
    assert config.backend.name == "onnxruntime"
    assert config.budget.builds == 150
    assert config.accuracy_budget == 0.01
    assert config.run_dir == Path("runs") / "run1"


def test_unknown_nested_key_names_full_path():
    data = _raw()
    data["data"]["evaluation"]["bogus"] = 1
    lines = _error_lines(data)
    assert "data.evaluation.bogus" in lines
    assert "unknown key" in lines["data.evaluation.bogus"]


def test_unknown_top_level_key():
    lines = _error_lines(_raw(bogus_section={"a": 1}))
    assert "unknown key" in lines["bogus_section"]


def test_wrong_type_names_key():
    lines = _error_lines(_raw(budget={"builds": "many"}))
    assert list(lines) == ["budget.builds"]
    assert "integer" in lines["budget.builds"]


@pytest.mark.parametrize(
    ("updates", "key", "fragment"),
    [
        ({"budget": {"builds": -1}}, "budget.builds", "greater than 0"),
        ({"budget": {"builds": 0}}, "budget.builds", "greater than 0"),
        ({"accuracy_budget": -0.1}, "accuracy_budget", "greater than or equal to 0"),
        ({"measure": {"warmup": 0}}, "measure.warmup", "greater than or equal to 1"),
        ({"ppo": {"gamma": 1.5}}, "ppo.gamma", "less than or equal to 1"),
        ({"search": {"group_size": 0}}, "search.group_size", "greater than 0"),
    ],
)
def test_out_of_range_values(updates, key, fragment):
    lines = _error_lines(_raw(**updates))
    assert key in lines
    assert fragment in lines[key]


def test_multiple_errors_all_reported():
    data = _raw(accuracy_budget=-0.1, budget={"builds": -1})
    data["data"]["evaluation"]["bogus"] = 1
    lines = _error_lines(data)
    assert {"accuracy_budget", "budget.builds", "data.evaluation.bogus"} <= set(lines)


def test_backend_typo_lists_allowed_values_and_input():
    lines = _error_lines(_raw(backend={"name": "onnxrutime"}))
    message = lines["backend.name"]
    for allowed in ("onnxruntime", "tensorrt", "torch"):
        assert allowed in message
    assert "'onnxrutime'" in message


def test_metric_name_typo_lists_allowed_values():
    message = _error_lines(_raw(metric={"name": "cosin"}))["metric.name"]
    assert "'cosine'" in message and "'top1'" in message and "'cosin'" in message


@pytest.mark.parametrize("name", ["a/b", "../escape", "a..b", "..", "/abs", "a\\b", "", ".hidden", "a b"])
def test_unsafe_run_names_rejected(name):
    lines = _error_lines(_raw(name=name))
    assert "name" in lines
    assert "path separator" in lines["name"]


@pytest.mark.parametrize("name", ["run1", "my-run_2", "v1.2", "A"])
def test_safe_run_names_accepted(name):
    assert parse_config(_raw(name=name)).name == name


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"onnx": "m.onnx", "torch": "pkg.mod:fn"},
    ],
)
def test_model_needs_exactly_one_source(model):
    lines = _error_lines(_raw(model=model))
    assert "model" in lines
    assert "exactly one of model.onnx" in lines["model"]


def test_model_torch_needs_colon():
    lines = _error_lines(_raw(model={"torch": "pkg.mod.fn"}))
    assert "package.module:function" in lines["model"]


def test_model_torch_source_accepted():
    config = parse_config(_raw(model={"torch": "pkg.mod:fn"}))
    assert config.model.torch == "pkg.mod:fn" and config.model.onnx is None
    with pytest.raises(ValueError):
        ModelConfig()


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ({}, "got none"),
        ({"npz": "a.npz", "random": 2}, "['npz', 'random']"),
        ({"generator": "m:f", "random": 2}, "['generator', 'random']"),
        ({"npz": "a.npz", "generator": "m:f", "random": 1}, "['npz', 'generator', 'random']"),
    ],
)
def test_data_source_exactly_one(source, fragment):
    data = _raw()
    data["data"]["calibration"] = source
    lines = _error_lines(data)
    assert "data.calibration" in lines
    assert "exactly one of npz, generator or random" in lines["data.calibration"]
    assert fragment in lines["data.calibration"]


def test_data_source_start_and_stop_need_an_npz_and_an_order():
    assert DataSource(npz="a.npz", start=8, stop=16).stop == 16
    with pytest.raises(ValidationError, match="start and stop select samples of an npz"):
        DataSource(random=2, start=4)
    with pytest.raises(ValidationError, match="stop \\(8\\) must be greater than start \\(8\\)"):
        DataSource(npz="a.npz", start=8, stop=8)


def test_data_source_single_sources_ok():
    assert DataSource(npz="a.npz").npz == Path("a.npz")
    assert DataSource(generator="m:f", kwargs={"n": 2}).kwargs == {"n": 2}
    assert DataSource(random=4).random == 4


def test_custom_metric_needs_function():
    assert "metric" in _error_lines(_raw(metric={"name": "custom"}))
    assert "metric" in _error_lines(_raw(metric={"name": "cosine", "function": "m:f"}))
    assert parse_config(_raw(metric={"name": "custom", "function": "m:f"})).metric.function == "m:f"


def test_bad_regex_rejected():
    lines = _error_lines(_raw(search={"include_layers": "fc[1"}))
    assert "search.include_layers" in lines
    assert "regular expression" in lines["search.include_layers"]


def test_config_is_frozen():
    config = parse_config(_raw())
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError for frozen models
        config.seed = 3


@pytest.mark.parametrize("data", [[1, 2], "text", 3, None])
def test_parse_config_rejects_non_mapping(data):
    message = _error(data)
    assert "top level must be a mapping" in message
    assert type(data).__name__ in message


# ---------------------------------------------------------------------------------------------
# load_config
# ---------------------------------------------------------------------------------------------


def _write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_load_config_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_load_config_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError):
        load_config(tmp_path)


def test_load_config_invalid_yaml(tmp_path):
    path = _write(tmp_path / "bad.yaml", "name: [unclosed\nmodel: {onnx: x\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "", "42\n"])
def test_load_config_non_mapping_top_level(tmp_path, text):
    path = _write(tmp_path / "list.yaml", text)
    with pytest.raises(ConfigError, match="top level must be a mapping") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_load_config_validation_error_names_file(tmp_path):
    path = _write(tmp_path / "c.yaml", _raw(budget={"builds": -1}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "budget.builds" in str(info.value)


def test_load_config_uses_safe_loader(tmp_path):
    marker = tmp_path / "pwned"
    text = yaml.safe_dump(_raw()) + f"seed: !!python/object/apply:os.mkdir [{str(marker)!r}]\n"
    path = _write(tmp_path / "evil.yaml", text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    assert not marker.exists()


def test_load_config_rejects_python_object_tag(tmp_path):
    text = "!!python/object:autotune.config.schema.TuneConfig\nname: x\n"
    path = _write(tmp_path / "obj.yaml", text)
    with pytest.raises(ConfigError):
        load_config(path)


def test_load_config_resolves_relative_paths_against_config_folder(tmp_path):
    folder = tmp_path / "configs" / "sub"
    data = _raw(model={"onnx": "models/m.onnx"})
    data["data"] = {
        "calibration": {"npz": "data/cal.npz"},
        "evaluation": {"npz": "../eval.npz"},
        "holdout": {"npz": "hold.npz"},
    }
    config = load_config(_write(folder / "c.yaml", data))
    assert config.model.onnx == folder / "models/m.onnx"
    assert config.data.calibration.npz == folder / "data/cal.npz"
    assert config.data.evaluation.npz == (folder / "../eval.npz").resolve()
    assert config.model.onnx.is_absolute()
    assert config.data.holdout.npz == folder / "hold.npz"


def test_load_config_keeps_absolute_paths(tmp_path):
    data = _raw(model={"onnx": str(tmp_path / "elsewhere" / "m.onnx")})
    data["data"]["holdout"] = {"npz": "/abs/hold.npz"}
    config = load_config(_write(tmp_path / "cfg" / "c.yaml", data))
    assert config.model.onnx == tmp_path / "elsewhere" / "m.onnx"
    assert config.data.holdout.npz == Path("/abs/hold.npz")


def test_load_config_does_not_touch_generator_or_torch_specs(tmp_path):
    data = _raw(model={"torch": "pkg.mod:fn"})
    data["data"]["calibration"] = {"generator": "pkg.mod:gen", "kwargs": {"path": "rel/x"}}
    config = load_config(_write(tmp_path / "c.yaml", data))
    assert config.model.torch == "pkg.mod:fn"
    assert config.data.calibration.generator == "pkg.mod:gen"
    assert config.data.calibration.kwargs == {"path": "rel/x"}


def test_load_config_with_overrides(tmp_path):
    path = _write(tmp_path / "c.yaml", _raw())
    config = load_config(path, ["budget.builds=7", "backend.intra_op_threads=4", "search.knobs.allow_spinning=[false]"])
    assert config.budget.builds == 7
    assert config.backend.intra_op_threads == 4
    assert config.search.knobs == {"allow_spinning": [False]}


def test_load_config_override_exponent_float(tmp_path):
    # PyYAML reads "1e-4" as a string (YAML 1.1); the typed config still takes it as a float
    path = _write(tmp_path / "c.yaml", _raw())
    config = load_config(path, ["ppo.learning_rate=1e-4"])
    assert config.ppo.learning_rate == pytest.approx(1e-4)


def test_load_config_override_path_is_resolved(tmp_path):
    path = _write(tmp_path / "cfg" / "c.yaml", _raw())
    config = load_config(path, ["model.onnx=other.onnx"])
    assert config.model.onnx == tmp_path / "cfg" / "other.onnx"


def test_load_config_bad_override_value_reports_key(tmp_path):
    path = _write(tmp_path / "c.yaml", _raw())
    with pytest.raises(ConfigError, match="budget.builds"):
        load_config(path, ["budget.builds=-3"])


# ---------------------------------------------------------------------------------------------
# apply_overrides
# ---------------------------------------------------------------------------------------------


def test_overrides_create_nested_sections():
    data: dict[str, Any] = {}
    apply_overrides(data, ["a.b.c=1", "a.b.d=x", "top=2"])
    assert data == {"a": {"b": {"c": 1, "d": "x"}}, "top": 2}


def test_overrides_keep_sibling_keys():
    data = {"budget": {"builds": 5, "other": 1}}
    apply_overrides(data, ["budget.builds=9"])
    assert data == {"budget": {"builds": 9, "other": 1}}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("false", False),
        ("3", 3),
        ("1.5", 1.5),
        ("1.0e-3", 1e-3),
        ("null", None),
        ("hello", "hello"),
        ("'7'", "7"),
        ("[1, two, 3.0]", [1, "two", 3.0]),
        ("{a: 1}", {"a": 1}),
        ("a=b", "a=b"),
    ],
)
def test_override_values_are_yaml_typed(raw, expected):
    data = apply_overrides({}, [f"key={raw}"])
    assert data["key"] == expected
    assert type(data["key"]) is type(expected)


def test_override_without_equals_is_error():
    with pytest.raises(ConfigError, match="key.subkey=value"):
        apply_overrides({}, ["budget.builds"])


def test_override_through_non_section_is_error():
    with pytest.raises(ConfigError, match="'budget' is not a section"):
        apply_overrides({"budget": 3}, ["budget.builds=2"])


def test_override_is_not_executed_as_python():
    with pytest.raises(Exception):  # noqa: B017 - safe_load refuses python tags
        apply_overrides({}, ["x=!!python/object/apply:os.getcwd []"])


# ---------------------------------------------------------------------------------------------
# dump_config
# ---------------------------------------------------------------------------------------------


def test_dump_config_round_trips():
    data = _raw(
        seed=7,
        inputs=[{"name": "x", "shape": [4, 8], "dtype": "int64"}],
        metric={"name": "custom", "function": "m:f", "output": "logits"},
        backend={"name": "tensorrt", "options": {"workspace_ladder_mib": [64, 128]}},
        search={
            "precisions": ["int8", "fp16"],
            "include_layers": "fc.*",
            "knobs": {"allow_spinning": [True], "graph_optimization_level": ["all", "basic"], "x": [1, 2.5]},
            "group_size": 2,
        },
        accuracy_budget=0.05,
        runs_dir="/tmp/runs",
    )
    data["data"]["holdout"] = {"generator": "m:g", "kwargs": {"n": 3, "flag": True}, "limit": 2}
    config = parse_config(copy.deepcopy(data))
    text = dump_config(config)
    again = parse_config(yaml.safe_load(text))
    assert again == config
    assert dump_config(again) == text
    assert again.search.knobs["allow_spinning"] == [True]
    assert type(again.search.knobs["x"][0]) is int and type(again.search.knobs["x"][1]) is float


def test_dump_config_is_plain_yaml():
    text = dump_config(parse_config(_raw()))
    assert "!!" not in text
    loaded = yaml.safe_load(text)
    assert loaded["name"] == "run1"
    assert loaded["model"]["onnx"] == "/abs/model.onnx"


@pytest.mark.parametrize(
    ("section", "key"),
    [("ppo", "probe_plans"), ("ppo", "imitation"), ("ppo", "prior_weight"), ("confirm", "bold_places")],
)
def test_a_planner_key_in_its_old_section_gets_one_line_naming_the_new_key(section, key):
    data = _raw(**{section: {key: 1}})
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert "\n" not in str(error.value)
    assert f"{section}.{key} is now planner.{key}" in str(error.value)


def test_the_planner_section_is_its_own():
    config = parse_config(_raw(planner={"probe_plans": False, "bold_places": 1}, ppo={"gamma": 0.9}))
    assert (config.planner.probe_plans, config.planner.bold_places, config.ppo.gamma) == (False, 1, 0.9)
    assert not hasattr(config.ppo, "probe_plans") and not hasattr(config.confirm, "bold_places")
