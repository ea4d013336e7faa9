"""Trials in a child process: a crash or a hang there is a failed trial, never a dead run."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from autotune.config import TuneConfig
from autotune.extras import MissingExtra
from autotune.harness.prepare import SetupError
from autotune.harness.runner import TrialRunner
from autotune.measure import Protocol
from autotune.plan import Plan

LOG_FORMAT = "autotune: %(message)s"
"""How the command and its trial process print progress notes (model export, calibration time) to stderr."""


def _die_with_parent() -> None:
    """Makes the trial process end with the run, even when the run is killed with SIGKILL.

    On Linux the kernel sends this process SIGKILL when the thread that started it exits (``PR_SET_PDEATHSIG``),
    so a killed run leaves no orphan building or hanging on a shared machine. Elsewhere the process still ends
    at its next request, when it reads the end of the pipe.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: keep the end-of-pipe behaviour
            return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(connection: Any, config_data: dict, log_level: int = logging.WARNING) -> None:
    """Serves trials until the parent closes the pipe.

    Ctrl-C in a terminal reaches the whole process group: the trial process ignores SIGINT and leaves the
    interrupt to the run, which stops it after committing what was measured.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)  # a spawned process starts without the run's logging
    _die_with_parent()
    try:
        runner = TrialRunner(TuneConfig.model_validate(config_data))
        reply: tuple[str, Any] = ("ready", None)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        # A user can act on these from their message alone; anything else is a bug, and its traceback says where.
        known = isinstance(error, SetupError | MissingExtra)
        reply = ("setup_error", f"{error}" if known else traceback.format_exc())
    while True:
        try:
            connection.send(reply)
        except OSError:  # the run closed the pipe (it was stopped or interrupted): nobody waits for the answer
            return
        if reply[0] == "setup_error":
            return
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):  # closed, or reset by the run with our answer unread
            return
        try:
            if kind == "trial":
                plan, split, protocol = payload
                result = runner.run(Plan.from_dict(plan), split, Protocol(**protocol) if protocol else None)
                reply = ("result", result.to_dict())
            elif kind == "layerwise":
                choices = runner.layerwise
                reply = ("result", None if choices is None else {"methods": choices.methods, "errors": choices.errors})
            elif kind == "references":
                reply = ("result", list(runner.backend.references()))
            elif kind == "export":
                plan, out_dir = payload
                reply = ("result", runner.export(Plan.from_dict(plan), Path(out_dir)))
            else:
                reply = ("error", f"unknown request {kind!r}")
        except Exception:  # noqa: BLE001
            reply = ("error", traceback.format_exc())


class ChildRunner:
    """A ``TrialRunner`` in a child process, restarted after a crash or a timeout."""

    def __init__(self, config: TuneConfig, setup_timeout_s: float):
        self.config = config
        self.setup_timeout_s = setup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._connection: Any = None

    def start(self) -> None:
        """Starts the child process and waits until it has prepared the run.

        Raises:
            SetupError: Preparing failed, died or took longer than the setup timeout.
        """
        parent, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_worker_main,
            args=(child, self.config.model_dump(mode="json"), logging.getLogger().getEffectiveLevel()),
            daemon=True,
        )
        self._process.start()
        child.close()
        self._connection = parent
        if not parent.poll(self.setup_timeout_s):
            self.stop()
            raise SetupError(f"preparing the run took longer than {self.setup_timeout_s:.0f} s")
        try:
            kind, message = parent.recv()
        except EOFError:
            self._process.join(timeout=5)  # reap it, so the exit code is known
            code = self._process.exitcode
            self.stop()
            raise SetupError(f"the trial process died while preparing the run (exit code {code})") from None
        if kind != "ready":
            self.stop()
            raise SetupError(message)

    def stop(self) -> None:
        """Kills the child process."""
        if self._process is not None:
            if self._connection is not None:
                self._connection.close()
            self._process.join(timeout=2)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = None
        self._connection = None

    def request(self, kind: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """Sends one request; returns ``(status, payload)`` with status result, error, crash or timeout."""
        if self._process is None or not self._process.is_alive():
            self.start()
        self._connection.send((kind, payload))
        if not self._connection.poll(timeout_s):
            self._process.kill()
            self.stop()
            return "timeout", f"no result after {timeout_s:.0f} s; the trial process was killed"
        try:
            return self._connection.recv()
        except EOFError:
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.stop()
            return "crash", f"the trial process died (exit code {code})"
