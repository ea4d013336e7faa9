"""Files that readers see whole: the one atomic write every module uses."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, content: str | bytes | Callable[[Path], None]) -> Path:
    """Writes ``path`` so that a reader, or a crash mid-write, sees the old file or the new one, never half of one.

    The content goes to a unique temporary file beside ``path`` (so runs side by side never share one), is
    flushed, and replaces ``path`` in one rename.

    Args:
        path: The file to write; its folder is created.
        content: Text, bytes, or a function that writes the temporary path it is given (``torch.save``,
            ``onnx.save``); the temporary name keeps ``path``'s suffix, which some writers check.

    Returns:
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f"{path.suffix}.tmp")
    tmp = Path(name)
    try:
        if callable(content):
            os.close(descriptor)
            # Writers such as torch.export.save check the suffix: give them one that ends like the target.
            named = tmp.with_name(tmp.name[: -len(".tmp")])
            tmp.rename(named)
            tmp = named
            content(tmp)
        else:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(content.encode() if isinstance(content, str) else content)
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: Any) -> Path:
    """Writes JSON atomically (``atomic_write``)."""
    return atomic_write(path, json.dumps(data, indent=2, default=str) + "\n")
