"""Tests for autotune.docgen: the reference pages say what the code does, and every config key says what it is."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pydantic import BaseModel, Field

from autotune.config.schema import TuneConfig
from autotune.docgen import REFERENCES, cli_reference, config_keys, config_reference, main, missing_descriptions

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_what_the_code_writes_now():
    for page, render in REFERENCES.items():
        assert (ROOT / page).read_text() == render(), f"{page} is stale: run python -m autotune.docgen"


def test_every_config_key_has_a_description_and_a_row_in_the_reference():
    assert missing_descriptions() == []
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    keys = [key for key, *_ in config_keys()]
    assert {"name", "data.calibration.start", "inputs[].shape", "backend.options.quantized_gemm"} <= set(keys)
    assert {"ppo.gamma", "planner.bold_places", "reward.failure"} <= set(keys)  # the sections of searchconfig too
    assert [key for key in keys if f"| `{key}` |" not in page] == []


def test_a_key_without_a_description_is_named():
    class Section(BaseModel):
        """A section."""

        documented: int = Field(1, description="Says what it is.")
        bare: int = 2

    class Top(BaseModel):
        section: Section = Section()
        silent: str = "x"

    assert missing_descriptions(Top) == ["section.bare", "silent"]  # a section's docstring stands for its key


def test_the_cli_page_has_every_subcommand_and_flag():
    from autotune.cli import build_parser

    page = cli_reference()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        assert f"## `autotune {name}`" in page
        for action in sub._actions:
            for option in action.option_strings:
                assert option == "-h" or option == "--help" or f"`{option}" in page, (name, option)


def test_check_fails_on_a_stale_page_and_passes_once_written(tmp_path, capsys):
    for page in REFERENCES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    assert main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "docs/reference/config.md").write_text(config_reference().replace("`seed`", "`sead`"))
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/reference/config.md is stale" in capsys.readouterr().err
    assert main(["--root", str(tmp_path)]) == 0
    assert main(["--check", "--root", str(tmp_path)]) == 0
    assert TuneConfig.model_fields["seed"].description in (tmp_path / "docs/reference/config.md").read_text()
