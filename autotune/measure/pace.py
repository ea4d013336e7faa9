"""The FP32 reference's quiet pace on this machine, remembered from one process to the next.

A trial process learns the machine's quiet pace from its own fastest reference rounds (``ReferencePace``). A slow
spell of the machine can outlast a whole process: on a 2-vCPU VM FP32 ran slower, and all-INT8 more, for seconds
at a time (``bench/research/timing_trace.py``), some as long as ``autotune evaluate`` times, and a process
that lay inside one read all-INT8 far below its quiet figure, with FP32 against itself at 1.00 and nothing to say
it was slow (docs/method.md#measurements-behind-the-codes-choices). So every trial process writes its pace now
(its fastest reference round of the last minute, ``ReferencePace.recent_ms``) under a key of what sets that pace
to one file of the cache folder, stamped with the time; the next process with the same key starts from the
median of the last ``KEEP_PROCESSES`` (``ReferencePace.remembered_ms``), the pace a process trusts within its
first minute (``autotune.measure.quiet_rounds.PACE_WINDOW_S``). An idle machine's pace drifts over minutes, so a
pace counts for ``MAX_AGE_S`` only.

Why by hand: the pace belongs to the machine, not to a run, so no run's trial store holds it, and no library keeps a
cross-process timing baseline of this kind (pyperf and asv compare whole benchmark runs after the fact).

A machine that became slower for good (a power setting, a busier host) is taken at its new pace within
``MAX_AGE_S``.
The file is a cache: one that cannot be read is started afresh, one that cannot be written is left as it is.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PACE_FILE = "reference_pace.json"
"""The file, in ``cache_dir``, that holds every key's remembered paces."""

KEEP_PROCESSES = 8
"""Processes per key whose pace (their last minute's fastest reference round) is kept."""

MAX_AGE_S = 120.0
"""Entries older than this are dropped: an idle VM's pace drifted by more than ``quiet_rounds.SPELL_BAND`` within
ten minutes, and a remembered pace that old made its confirmations say the machine ran slow
(docs/measurement.md#quiet-rounds)."""

REFRESH_S = 10.0
"""A process rewrites its entry at least this often while it times, so that the entry's time says the pace is recent."""

_FORMAT = 1


class RememberedPace:
    """One key's entries in the cache's pace file: read once, rewritten with this process's entry.

    Args:
        cache_dir: The run's ``cache_dir``.
        key: What sets the reference's pace (``autotune.harness.identity.pace_key``).
        clock: Wall seconds since the epoch; injectable for tests.
    """

    def __init__(self, cache_dir: Path, key: str, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(cache_dir) / PACE_FILE
        self.key = key
        self.clock = clock
        self.process = f"{os.getpid()}-{time.time_ns()}"  # this process's entry, rewritten as its pace changes
        self._written_ms = math.inf
        self._written_at = -math.inf

    def typical_ms(self) -> float | None:
        """The machine's pace as the last processes timed it under this key; None: none known.

        The median of their last minute's fastest reference rounds (the lower one of an even count): one process
        that met the machine at its fastest moment does not make every later one read as slow, and one that lay in a
        spell is outvoted.
        """
        entries = self._entries(self._read())
        others = sorted(entry["fastest_ms"] for entry in entries if entry["process"] != self.process)
        return others[(len(others) - 1) // 2] if others else None

    def record(self, pace_ms: float) -> None:
        """Keeps this process's pace now (``ReferencePace.recent_ms``), stamped now.

        Written where it changed, or ``REFRESH_S`` after the last write; a no-op otherwise.
        """
        now = self.clock()
        if not math.isfinite(pace_ms) or pace_ms <= 0:
            return
        if pace_ms == self._written_ms and now - self._written_at < REFRESH_S:
            return
        data = self._read()
        entries = [entry for entry in self._entries(data) if entry["process"] != self.process]
        entries.append({"process": self.process, "at": now, "fastest_ms": pace_ms})
        data["paces"][self.key] = sorted(entries, key=lambda entry: entry["at"])[-KEEP_PROCESSES:]
        if self._write(data):
            self._written_ms, self._written_at = pace_ms, now

    def _entries(self, data: dict) -> list[dict]:
        oldest = self.clock() - MAX_AGE_S
        entries = data["paces"].get(self.key, [])
        return [e for e in entries if isinstance(e, dict) and _valid(e) and e["at"] >= oldest]

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {"format": _FORMAT, "paces": {}}
        if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("paces"), dict):
            return {"format": _FORMAT, "paces": {}}
        return data

    def _write(self, data: dict) -> bool:
        """Replaces the file whole, so a process that reads it meanwhile sees the old or the new one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".pace-", suffix=".json")
        except OSError:
            return False
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(data, out)
            os.replace(temporary, self.path)
        except OSError:
            Path(temporary).unlink(missing_ok=True)
            return False
        return True


def _valid(entry: dict) -> bool:
    fastest, at = entry.get("fastest_ms"), entry.get("at")
    return (
        isinstance(entry.get("process"), str)
        and isinstance(fastest, int | float)
        and isinstance(at, int | float)
        and math.isfinite(fastest)
        and fastest > 0
    )
