"""A trial process's stderr, passed on to the run's, with the lines of its last request kept for a crash's error."""

from __future__ import annotations

import os
import select
import threading

HOLD_S = 0.5
"""How long a line waits for the next before it is passed on: a process that dies meanwhile has it in its error."""


class StderrRelay:
    """Copies a child process's stderr (the read end of a pipe) to this process's stderr, line by line, from a thread.

    Why: a runtime that aborts (a C++ assertion, then SIGABRT) writes its reason to stderr and dies. The run names
    that line in the failed trial's error (``last_line``) instead of leaving it on the terminal without context. The
    newest line is held back until the next one comes, the child answers (``flush``) or ``HOLD_S`` pass: a line
    written just before the process died is reported once, in the error, not printed beside it.

    Args:
        reader: The read end of the pipe the child's file descriptor 2 writes to; the relay owns and closes it.
    """

    def __init__(self, reader: int):
        self._reader = reader
        os.set_blocking(reader, False)
        self._lock = threading.Lock()
        self._partial = b""  # the end of the output that is no line yet
        self._held: bytes | None = None  # the newest complete line, not passed on yet
        self._request_lines: list[bytes] = []  # the lines written since the last request was sent
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="trial-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self._reader], [], [], HOLD_S)
            except (OSError, ValueError):  # the pipe was closed under us (``close``)
                return
            with self._lock:
                if self._closed:
                    return
                if not ready:
                    self._pass_on_held()
                elif not self._read_available():
                    self._closed = True  # the child and everything it started are gone

    def _read_available(self) -> bool:
        """Reads what the pipe holds now, under the lock; False at its end."""
        while True:
            try:
                chunk = os.read(self._reader, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                self._pass_on_held()
                self._held = line + b"\n"
                self._request_lines.append(line)

    def _pass_on_held(self) -> None:
        if self._held is not None:
            _write_stderr(self._held)
            self._held = None

    def mark(self) -> None:
        """Starts a request: the lines written before it are no part of its error."""
        with self._lock:
            self._request_lines = []

    def flush(self) -> None:
        """Passes on everything the child wrote so far (it answered, so nothing it wrote is a crash's reason)."""
        with self._lock:
            if not self._closed and not self._read_available():
                self._closed = True
            self._pass_on_held()

    def last_line(self, wait_s: float = 2.0) -> str | None:
        """The last non-empty line the child wrote since ``mark``, once its end of the pipe is closed (or ``wait_s``).

        The line is not passed on any more: the caller reports it.
        """
        self._thread.join(wait_s)
        with self._lock:
            self._held = None
            lines = [*self._request_lines, self._partial]
            text = next((line for line in reversed(lines) if line.strip()), b"")
        return text.decode(errors="replace").strip() or None

    def close(self) -> None:
        """Passes on what is left and closes the pipe (the thread ends at its next look)."""
        with self._lock:
            if self._reader < 0:
                return
            if not self._closed:
                self._read_available()
            self._closed = True
            self._pass_on_held()
            if self._partial:
                _write_stderr(self._partial + b"\n")
                self._partial = b""
            os.close(self._reader)
            self._reader = -1


def _write_stderr(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:  # no stderr to write to: the line is lost, as it would be for the child itself
        pass
