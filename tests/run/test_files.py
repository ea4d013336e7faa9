"""The atomic write: text, bytes or a writer function; a failed write leaves the old file and no temporary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.run.files import atomic_write, write_json


def test_text_and_bytes_replace_the_file_and_its_folder_is_made(tmp_path):
    path = tmp_path / "deep" / "er" / "notes.txt"
    assert atomic_write(path, "first ☃") == path
    assert path.read_text(encoding="utf-8") == "first ☃"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["notes.txt"]


def test_a_writer_function_gets_a_temporary_path_beside_the_target_with_its_suffix(tmp_path):
    seen = []

    def writer(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("model")

    path = tmp_path / "model.onnx"
    atomic_write(path, writer)
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.suffix == ".onnx" and tmp != path and not tmp.exists()
    assert path.read_text() == "model"


@pytest.mark.parametrize("failing", ["writer", "interrupt"])
def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path, failing):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def writer(tmp: Path) -> None:
        tmp.write_text("half")
        raise (OSError("disk full") if failing == "writer" else KeyboardInterrupt())

    with pytest.raises(OSError if failing == "writer" else KeyboardInterrupt):
        atomic_write(path, writer)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_content_that_is_neither_text_bytes_nor_a_writer_fails_and_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "x.txt", 3)
    assert list(tmp_path.iterdir()) == []


def test_write_json_is_indented_ends_in_a_newline_and_writes_paths_as_text(tmp_path):
    path = write_json(tmp_path / "s.json", {"run": tmp_path, "n": [1, 2]})
    text = path.read_text()
    assert text.endswith("}\n") and '\n  "n": [' in text
    assert json.loads(text) == {"run": str(tmp_path), "n": [1, 2]}
