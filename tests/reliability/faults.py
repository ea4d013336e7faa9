"""Fault injection for the reliability tests, through a seam the package already has: a custom metric.

A ``metric: {name: custom, function: tests.reliability.faults:fault_metric}`` config runs ``fault_metric`` inside
the trial process, after the plan was built and run, exactly where a crashing or hanging backend would take the
process down. No test hook lives in the package.

The metric reads ``AUTOTUNE_TEST_FAULTS``: a folder holding ``plan.json``, ``{"<call number>": action}`` with an
optional ``"*"`` for every other call. Calls are counted across trial processes (a crash restarts the process) in
``<folder>/count``. The call that scores the FP32 reference while the trial process prepares the run (its
outputs are the reference itself) is not counted; the plan's ``"setup"`` action applies to it.

Actions: ``ok``; ``kill`` (SIGKILL itself, as the OOM killer would); ``exit`` (``os._exit(3)``); ``segv`` (a null
pointer read in C); ``abort`` (a C++ runtime's failed assertion: :data:`ASSERTION` on file descriptor 2,
then ``os.abort()``); ``raise`` (a Python exception); ``slow`` (sleep a second); ``hang`` (sleep for an hour, after
writing ``<folder>/hanging`` with the process id); ``leak`` (keep an open file and 3 MB, for the soak test's
self-check); ``kill-once`` (SIGKILL itself if no process did so before: the first trial process to get there
creates ``<folder>/killed``, atomically, so exactly one trial dies even with workers side by side).

After each counted call's action the process appends ``<call number> <pid> <VmRSS kB> <open fds>`` to
``<folder>/samples`` (:func:`samples`): one sample per trial, whatever the machine's load, for the soak test.

The count is written atomically, so workers side by side never read half a number (a count may then be lost).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ENV = "AUTOTUNE_TEST_FAULTS"
METRIC = "tests.reliability.faults:fault_metric"
ASSERTION = "stl_vector.h:1130: reference std::vector::operator[](size_type): Assertion '__n < this->size()' failed."
"""What the ``abort`` action writes before it aborts, as ONNX Runtime did on a real graph (issue 49)."""
_LEAKED: list = []


def write_plan(folder: Path, plan: dict[str, str]) -> Path:
    """Writes a fault plan into ``folder`` and returns the folder (set it as ``AUTOTUNE_TEST_FAULTS``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(json.dumps(plan))
    (folder / "count").write_text("0")
    return folder


def calls(folder: Path) -> int:
    """How many trial calls the metric has counted."""
    return int((folder / "count").read_text())


def samples(folder: Path) -> list[tuple[int, int, int, int]]:
    """The trial processes' own samples, one per counted call: ``(call number, pid, VmRSS kB, open fds)``."""
    path = folder / "samples"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(int(field) for field in line.split()) for line in lines]


def _sample_self(count: int, folder: Path) -> None:
    """Appends this process's resident memory and open files after a call (one short write: lines never mix)."""
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    fds = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir holds
    with open(folder / "samples", "a") as out:
        out.write(f"{count} {os.getpid()} {rss} {fds}\n")


def _act(action: str, folder: Path) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill-once":
        try:
            os.close(os.open(folder / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(3)
    elif action == "segv":
        ctypes.string_at(0)
    elif action == "abort":  # written by C++, past Python's sys.stderr
        os.write(2, f"python: {ASSERTION}\n".encode())
        os.abort()
    elif action == "raise":
        raise RuntimeError("injected metric failure")
    elif action == "hang":
        # Written aside and renamed: a test that polls for the file must never read it half written (empty).
        (folder / "hanging.tmp").write_text(str(os.getpid()))
        os.replace(folder / "hanging.tmp", folder / "hanging")
        time.sleep(3600)
    elif action == "slow":
        time.sleep(1.0)
    elif action == "leak":  # a file descriptor and 3 MB that are never released
        _LEAKED.append((open(os.devnull), bytearray(b"\x01") * (3 << 20)))  # noqa: SIM115 - the leak is the point


def fault_metric(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray], labels: object) -> float:
    """Top-1 agreement with the reference, after the fault planned for this call."""
    folder = os.environ.get(ENV)
    if folder:
        path = Path(folder)
        plan = json.loads((path / "plan.json").read_text())
        if outputs is reference:  # the trial process scores the FP32 reference while it prepares the run
            _act(plan.get("setup", "ok"), path)
        else:
            count = int((path / "count").read_text()) + 1
            temporary = path / f"count.{os.getpid()}"
            temporary.write_text(str(count))
            os.replace(temporary, path / "count")
            _act(plan.get(str(count), plan.get("*", "ok")), path)
            if sys.platform.startswith("linux"):
                _sample_self(count, path)
    predictions = np.concatenate([np.asarray(o).reshape(len(o), -1).argmax(axis=1) for o in outputs])
    expected = np.concatenate([np.asarray(r).reshape(len(r), -1).argmax(axis=1) for r in reference])
    return float(np.mean(predictions == expected))
