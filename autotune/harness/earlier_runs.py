"""The trials of earlier comparable runs, imported into a new run's store as trials that cost no build.

A new run whose comparability key (:mod:`autotune.harness.identity`) equals an earlier run's reuses its trials, its
held-out confirmations and its one-liners (``autotune tune --from RUN_DIR``, config key ``from_runs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.harness.identity import check_comparable
from autotune.run.store import TrialStore


def import_runs(store: TrialStore, run_dirs: Sequence[Path], key: dict[str, Any]) -> dict[str, int]:
    """Imports the trials, confirmations and one-liner results of earlier comparable runs into ``store``.

    Args:
        store: The new run's store.
        run_dirs: Earlier run directories.
        key: The new run's comparability key.

    Returns:
        Per run directory, how many trials it added (plans already in the store keep their own result).

    Raises:
        ConfigError: See :func:`check_comparable`.
    """
    check_comparable(run_dirs, key)
    added = {}
    for run_dir in run_dirs:
        source = str(run_dir)
        with TrialStore(Path(run_dir) / "trials.sqlite") as earlier:
            added[source] = sum(store.put_imported(trial, source) for trial in earlier.trials())
            done = store.confirmations()
            for plan_hash, result in earlier.confirmations().items():
                if plan_hash not in done:
                    store.put_confirmation(result)
            references = store.references()
            for name, result in earlier.references().items():
                if name not in references:
                    store.put_reference(result)
    return added
