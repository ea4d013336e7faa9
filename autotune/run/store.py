"""The trial store: every measured plan, keyed by plan hash, in SQLite with write-ahead logging."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from autotune.run.trial import TrialResult

# ``measured`` counts the writes of a plan: above 1, it was measured twice (the tests read it to check none is).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    plan_hash TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    measured INTEGER NOT NULL DEFAULT 1,
    status TEXT NOT NULL,
    result TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS confirmations (
    plan_hash TEXT PRIMARY KEY,
    result TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reference_results (
    name TEXT PRIMARY KEY,
    result TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS imported (
    plan_hash TEXT PRIMARY KEY,
    source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class StoreError(RuntimeError):
    """The store cannot be opened or written; the message says where and why."""


_WRITE_HINT = "free disk space or make the folder writable, then continue the run with `autotune resume`"


class TrialStore:
    """Trials of one run. Each put is its own transaction, so a killed run loses no committed trial.

    Args:
        path: The SQLite file (created if missing).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as error:
            raise StoreError(f"cannot open the trial store {self.path}: {error}") from error

    def close(self) -> None:
        """Closes the database."""
        self._db.close()

    def __enter__(self) -> TrialStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, plan_hash: str) -> TrialResult | None:
        """The stored trial of a plan, or None."""
        row = self._db.execute("SELECT result FROM trials WHERE plan_hash = ?", (plan_hash,)).fetchone()
        if row is None:
            return None
        result = TrialResult.from_dict(json.loads(row[0]))
        result.from_store = True
        return result

    def put(self, result: TrialResult) -> None:
        """Commits one trial; a plan measured again replaces its row (and keeps its position).

        Raises:
            StoreError: The write failed (disk full, read-only directory).
        """
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                row = self._db.execute(
                    "SELECT seq, measured FROM trials WHERE plan_hash = ?", (result.plan_hash,)
                ).fetchone()
                if row:
                    seq, measured = row[0], row[1] + 1
                else:
                    seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM trials").fetchone()[0]
                    measured = 1
                self._db.execute(
                    "INSERT OR REPLACE INTO trials (plan_hash, seq, measured, status, result) VALUES (?, ?, ?, ?, ?)",
                    (result.plan_hash, seq, measured, result.status, json.dumps(result.to_dict())),
                )
        except sqlite3.Error as error:
            raise StoreError(f"cannot write trial {result.plan_hash} to {self.path}: {error}; {_WRITE_HINT}") from error

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM trials").fetchone()[0]

    def builds(self) -> int:
        """Trials built by this run: every trial but those imported from earlier runs."""
        return self._db.execute(
            "SELECT COUNT(*) FROM trials WHERE plan_hash NOT IN (SELECT plan_hash FROM imported)"
        ).fetchone()[0]

    def put_imported(self, result: TrialResult, source: str) -> bool:
        """Commits a trial measured by an earlier run, marked as imported: it costs this run no build.

        A plan this run already holds keeps its own result.

        Returns:
            Whether the trial was added.

        Raises:
            StoreError: The write failed (disk full, read-only directory).
        """
        if result.plan_hash in self:
            return False
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM trials").fetchone()[0]
                self._db.execute(
                    "INSERT INTO trials (plan_hash, seq, measured, status, result) VALUES (?, ?, 1, ?, ?)",
                    (result.plan_hash, seq, result.status, json.dumps(result.to_dict())),
                )
                self._db.execute(
                    "INSERT OR REPLACE INTO imported (plan_hash, source) VALUES (?, ?)", (result.plan_hash, source)
                )
        except sqlite3.Error as error:
            raise StoreError(
                f"cannot import trial {result.plan_hash} to {self.path}: {error}; {_WRITE_HINT}"
            ) from error
        return True

    def imported(self) -> dict[str, str]:
        """Plan hash to the run it was imported from, for every imported trial."""
        return dict(self._db.execute("SELECT plan_hash, source FROM imported").fetchall())

    def __contains__(self, plan_hash: str) -> bool:
        return self._db.execute("SELECT 1 FROM trials WHERE plan_hash = ?", (plan_hash,)).fetchone() is not None

    def trials(self) -> Iterator[TrialResult]:
        """Every trial in the order it was first measured."""
        for (text,) in self._db.execute("SELECT result FROM trials ORDER BY seq").fetchall():
            yield TrialResult.from_dict(json.loads(text))

    def put_confirmation(self, result: TrialResult) -> None:
        """Commits the confirmation (held-out, more repeats) of a plan.

        Raises:
            StoreError: The write failed (disk full, read-only directory).
        """
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO confirmations (plan_hash, result) VALUES (?, ?)",
                    (result.plan_hash, json.dumps(result.to_dict())),
                )
        except sqlite3.Error as error:
            raise StoreError(
                f"cannot write the confirmation of {result.plan_hash} to {self.path}: {error}; {_WRITE_HINT}"
            ) from error

    def confirmations(self) -> dict[str, TrialResult]:
        """Confirmation results by plan hash."""
        rows = self._db.execute("SELECT plan_hash, result FROM confirmations").fetchall()
        return {key: TrialResult.from_dict(json.loads(text)) for key, text in rows}

    def put_reference(self, result: TrialResult) -> None:
        """Commits the measurement (held-out, confirmation protocol) of one of the platform's one-liners.

        Kept apart from the trials and the confirmations: a one-liner is no build of the search and never a
        candidate for export, only the yardstick beside it.

        Raises:
            ValueError: The result is not of a reference plan.
            StoreError: The write failed (disk full, read-only directory).
        """
        name = result.plan.reference
        if name is None:
            raise ValueError(f"plan {result.plan_hash} is not a reference plan")
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO reference_results (name, result) VALUES (?, ?)",
                    (name, json.dumps(result.to_dict())),
                )
        except sqlite3.Error as error:
            raise StoreError(f"cannot write the reference {name} to {self.path}: {error}; {_WRITE_HINT}") from error

    def references(self) -> dict[str, TrialResult]:
        """The one-liners measured in this run, by name, in the order they were stored."""
        rows = self._db.execute("SELECT name, result FROM reference_results ORDER BY rowid").fetchall()
        return {name: TrialResult.from_dict(json.loads(text)) for name, text in rows}

    def set_meta(self, key: str, value: object) -> None:
        """Stores one JSON value of run metadata.

        Raises:
            StoreError: The write failed (disk full, read-only directory).
        """
        try:
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))
        except sqlite3.Error as error:
            raise StoreError(f"cannot write run metadata {key!r} to {self.path}: {error}; {_WRITE_HINT}") from error

    def get_meta(self, key: str, default: object = None) -> object:
        """Reads run metadata."""
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default
