"""The front page and the guide: the README stays a front page, its cheap commands run as written, links resolve."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import onnx
import pytest

from autotune.cli import main
from autotune.config.schema import load_config
from autotune.testing import tiny_sequence_model, write_sequence_samples

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHEAP = ("init", "inspect")
"""Subcommands that build nothing: the README's commands with these run here as written."""


def _commands(text: str) -> list[str]:
    """The ``autotune ...`` lines of the bash blocks, comments cut off."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("autotune ")]


def _run_as_written(command: str) -> tuple[int, str]:
    """Runs one ``autotune ...`` line through the CLI in this process; ``> FILE`` writes its output to FILE."""
    words = shlex.split(command)[1:]
    target = None
    if ">" in words:
        words, target = words[: words.index(">")], words[words.index(">") + 1]
    words = [str(ROOT / word) if word.startswith("configs/") else word for word in words]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(words)
    if target:
        Path(target).write_text(out.getvalue())
    return code, out.getvalue()


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 180
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:3] == ["## Set-up", "## Quick start: your own model in five minutes", "## Concepts"]
    assert "make demo" in README.read_text() and "make test" in README.read_text()


def test_the_readmes_cheap_commands_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the user's folder: their model.onnx and samples.npz, and nothing else
    onnx.save(tiny_sequence_model(), "model.onnx")
    write_sequence_samples(tmp_path / "samples.npz", samples=40, seq=12)
    cheap = [command for command in _commands(README.read_text()) if command.split()[1] in CHEAP]
    ran = []
    for command in cheap:
        code, out = _run_as_written(command)
        assert code == 0, command
        ran.append(command.split()[1:3])
    assert ["init", "model.onnx"] in ran and ["inspect", "model.onnx"] in ran
    assert load_config("my.yaml").data.holdout.npz == (tmp_path / "samples.npz").resolve()  # init's file, as written
    code, out = _run_as_written("autotune inspect configs/cnn-cpu.yaml")  # named in the README's running text
    assert code == 0 and "tunable layers" in out
    assert "`autotune inspect configs/cnn-cpu.yaml`" in README.read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


PAGES = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_the_anchor_of_a_heading_is_githubs():
    assert (
        _slug(" Planner alone, planner + PPO: 48 builds (CPU VM (AMD))")
        == "planner-alone-planner--ppo-48-builds-cpu-vm-amd"
    )
    assert _slug(" `measure`") == "measure"
