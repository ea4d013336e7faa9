"""Bad configs: refused with exit code 2, the key path and what is allowed, and nothing written. Also: no input is
ever unpickled or loaded with an unsafe YAML loader. Validation details live in tests/config/test_schema.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autotune.testing import tiny_config
from tests.reliability.helpers import REPO, cli, write_config

CASES = {
    "unknown top-level key": (["budgett=3"], ["budgett: unknown key (check the spelling; see configs/ for examples)"]),
    "unknown nested key": (["search.precision=[int8]"], ["search.precision: unknown key"]),
    "wrong type": (["budget.builds=many"], ["budget.builds: Input should be a valid integer"]),
    "negative build budget": (["budget.builds=-5"], ["budget.builds: Input should be greater than 0"]),
    "negative accuracy budget": (
        ["accuracy_budget=-0.1"],
        ["accuracy_budget: Input should be greater than or equal to 0"],
    ),
    "zero timeout": (["backend.timeout_s=0"], ["backend.timeout_s: Input should be greater than 0"]),
    "unknown backend": (
        ["backend.name=onnxrutime"],
        ["backend.name: Input should be 'auto', 'onnxruntime', 'openvino', 'tensorrt' or"],
    ),
    "unknown precision": (["search.precisions=[int4]"], ["search.precisions.0: Input should be 'fp32'"]),
    "bad layer regex": (["search.include_layers=fc[1"], ["search.include_layers: Value error, not a valid regular"]),
    "run name with a path separator": (["name=a/b"], ["name: Value error, must be letters", "no path separator"]),
    "run name escaping runs_dir": (["name=../escape"], ["name: Value error", "no '..'"]),
    "run name '..'": (["name=.."], ["name: Value error", "no '..'"]),
    "override without '='": (["budget.builds"], ["override 'budget.builds' must look like key.subkey=value"]),
    "TensorRT not installed": (
        ["backend.name=tensorrt"],
        ["TensorRT is not installed", "pip install tensorrt-cu13 cuda-python"],
    ),
    "torch backend for an ONNX-only model": (
        ["backend.name=torch"],
        ["the torch backend needs model.torch", "ONNX-only models run on onnxruntime or tensorrt"],
    ),
    "knob value the backend does not offer": (
        ["search.knobs={graph_optimization_level: [turbo]}"],
        ["search.knobs.graph_optimization_level: none of ['turbo'] is offered; allowed ['all', 'extended', 'basic']"],
    ),
    "knob the backend does not have": (
        ["search.knobs={fast_math: [true]}"],
        ["search.knobs names unknown knobs ['fast_math']"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_is_refused_and_nothing_is_written(tmp_path, capsys, nothing_built, case):
    overrides, fragments = CASES[case]
    config = tiny_config(tmp_path)
    path = write_config(tmp_path, config)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = cli(capsys, "tune", path, "--no-progress", *[arg for o in overrides for arg in ("--set", o)])

    assert code == 2, err
    assert err.startswith("autotune: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    assert not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing next to the config either


def test_yaml_tags_are_not_executed(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\n')
    code, err = cli(capsys, "inspect", path)
    assert code == 2 and "is not valid YAML" in err
    assert not marker.exists()


def test_the_run_name_never_leaves_runs_dir(tmp_path, capsys):
    config = tiny_config(tmp_path / "project")
    path = write_config(tmp_path / "project", config)
    for name in ("../escape", "..", "/abs", "a/../../b"):
        code, _ = cli(capsys, "tune", path, "--no-progress", "--set", f"name={name}")
        assert code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]
    assert not (tmp_path / "project" / "runs").exists()


# ---- no unsafe deserialization of anything a user or a run directory hands in ------------------------------

_FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def _package_sources() -> list[Path]:
    return sorted([*(REPO / "autotune").rglob("*.py"), *(REPO / "envs").rglob("*.py")])


def _calls(tree: ast.AST, module_names: set[str], attribute: str) -> list[ast.Call]:
    """Calls like ``np.load(...)`` for ``module_names={'np', 'numpy'}``, ``attribute='load'``."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attribute
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in module_names
    ]


def _keyword(call: ast.Call, name: str) -> object:
    for keyword in call.keywords:
        if keyword.arg == name and isinstance(keyword.value, ast.Constant):
            return keyword.value.value
    return None


def test_sources_never_unpickle_and_load_yaml_safely():
    numpy_loads = 0
    problems = []
    for path in _package_sources():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{where}: imports {a.name}" for a in node.names if a.name in _FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module in _FORBIDDEN_MODULES:
                problems.append(f"{where}: imports from {node.module}")
        for call in _calls(tree, {"np", "numpy"}, "load"):
            numpy_loads += 1
            if _keyword(call, "allow_pickle") is not False:
                problems.append(f"{where}:{call.lineno}: np.load without allow_pickle=False")
        for call in _calls(tree, {"torch", "th"}, "load"):
            if _keyword(call, "weights_only") is not True:
                problems.append(f"{where}:{call.lineno}: torch.load without weights_only=True")
        for attribute in ("load", "load_all", "unsafe_load", "full_load", "unsafe_load_all", "full_load_all"):
            for call in _calls(tree, {"yaml"}, attribute):
                problems.append(f"{where}:{call.lineno}: yaml.{attribute} (use yaml.safe_load)")
    assert not problems, "\n".join(problems)
    assert numpy_loads >= 2, "the scan found too few np.load calls: it no longer sees the code"


def test_the_scan_catches_an_unsafe_load():
    """The scanner itself: it must flag the patterns it is there to forbid."""
    tree = ast.parse("import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=True)\nnp.load(p, allow_pickle=False)\n")
    flagged = [c.lineno for c in _calls(tree, {"np"}, "load") if _keyword(c, "allow_pickle") is not False]
    assert flagged == [2, 3]
    tree = ast.parse("import torch\ntorch.load(f)\ntorch.load(f, weights_only=True)\nyaml.load(s)\n")
    assert [c.lineno for c in _calls(tree, {"torch"}, "load") if _keyword(c, "weights_only") is not True] == [2]
    assert [c.lineno for c in _calls(tree, {"yaml"}, "load")] == [4]
