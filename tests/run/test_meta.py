"""autotune.run.meta: the run's metadata, typed, under the keys older stores hold."""

from __future__ import annotations

import pytest

from autotune.run.meta import RunMeta
from autotune.run.store import TrialStore


def test_run_metadata_reads_back_what_was_written_with_defaults_for_the_rest(tmp_path):
    with TrialStore(tmp_path / "trials.sqlite") as store:
        assert RunMeta.read(store) == RunMeta()
        RunMeta.write(store, strategy="greedy", wall_s=1.5, free_knobs={"attention": "sdpa"})
        RunMeta.count_cache_hit(store)
        RunMeta.count_cache_hit(store)
        meta = RunMeta.read(store)
        assert (meta.strategy, meta.wall_s, meta.free_knobs, meta.cache_hits) == (
            "greedy",
            1.5,
            {"attention": "sdpa"},
            2,
        )
        assert store.get_meta("wall_s") == 1.5  # the key the bench scripts and older stores read


def test_a_name_that_is_no_run_metadata_is_refused(tmp_path):
    with TrialStore(tmp_path / "trials.sqlite") as store, pytest.raises(TypeError, match="not run metadata"):
        RunMeta.write(store, wal_s=1.0)
