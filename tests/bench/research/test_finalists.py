"""bench/research/finalists.py: a finished run's finalists by today's rule, as plan files `autotune evaluate` reads."""

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "research"))

from finalists import main  # noqa: E402

from autotune.harness.priors import store_prior_inputs  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.run.store import TrialStore  # noqa: E402
from autotune.run.trial import TrialResult  # noqa: E402
from autotune.search.prior import PriorInputs  # noqa: E402
from autotune.testing import tiny_config  # noqa: E402


def _config_file(tmp_path: Path) -> Path:
    config = tiny_config(tmp_path, accuracy_budget=0.01, confirm={"top_k": 2})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def _store(path: Path, confirm_fp32: bool = True) -> dict[str, Plan]:
    plans = {
        "fp32": Plan.make({"a": "fp32", "b": "fp32"}),
        "one": Plan.make({"a": "int8", "b": "fp32"}),
        "both": Plan.make({"a": "int8", "b": "int8"}),
        "over": Plan.make({"a": "fp32", "b": "int8"}),
    }
    measured = {"fp32": (1.0, 0.0), "one": (1.3, 0.004), "both": (1.6, 0.009), "over": (1.4, 0.02)}
    with TrialStore(path) as store:
        for name, plan in plans.items():
            speedup, drop = measured[name]
            store.put(TrialResult(plan=plan, speedup=speedup, accuracy_drop=drop))
        store.set_meta("fp32_plan_hash", plans["fp32"].hash)
        if confirm_fp32:
            store.put_confirmation(TrialResult(plan=plans["fp32"], speedup=1.0, accuracy_drop=0.0, split="holdout"))
    return plans


def test_finalists_are_written_as_plan_files_fastest_first_without_fp32(tmp_path):
    plans = _store(tmp_path / "run.sqlite")
    out = tmp_path / "out"
    assert main([str(_config_file(tmp_path)), "--stores", f"mine={tmp_path / 'run.sqlite'}", "--out", str(out)]) == 0
    written = [Plan.from_dict(json.loads((out / f"mine-{k}.json").read_text())).hash for k in range(2)]
    assert written == [plans["both"].hash, plans["one"].hash]  # top_k = 2; "over" is past the budget
    assert not (out / "mine-2.json").exists()
    table = json.loads((out / "finalists.json").read_text())
    assert [row["hash"] for row in table["mine"]] == written
    assert table["mine"][0]["speedup"] == 1.6


def test_a_run_that_never_confirmed_fp32_is_named_and_told_to_finish(tmp_path):
    _store(tmp_path / "trials.sqlite", confirm_fp32=False)
    with pytest.raises(SystemExit, match="has not confirmed FP32 yet; finish it first"):
        main([str(_config_file(tmp_path)), "--stores", str(tmp_path / "trials.sqlite"), "--out", str(tmp_path)])


def _shares_store(path: Path, shares: dict[str, float]) -> None:
    """An agent run's store as far as the shares go: its prior inputs in the meta."""
    with TrialStore(path) as store:
        store_prior_inputs(store, PriorInputs(tuple(shares), tuple(shares.values()), {}, {}, "cosine"))


def test_a_store_without_a_profile_borrows_one_with_shares_and_is_ranked_by_it(tmp_path):
    plans = _store(tmp_path / "run.sqlite")
    out = tmp_path / "out"
    config = str(_config_file(tmp_path))
    # by the profile, "b" alone holds nearly all of the runtime: "over" (b in INT8) beats "one" (a in INT8)...
    _shares_store(tmp_path / "agent.sqlite", {"a": 0.01, "b": 0.9})
    args = [config, "--stores", f"mine={tmp_path / 'run.sqlite'}", "--out", str(out)]
    assert main([*args, "--shares", str(tmp_path / "agent.sqlite")]) == 0
    table = json.loads((out / "finalists.json").read_text())
    # ... but "over" is past the budget: within it, "both" (a and b) and then "one", whose expected speedup is now
    # near 1 (a holds 1 % of the runtime) although it measured 1.3x
    assert [row["hash"] for row in table["mine"]] == [plans["both"].hash, plans["one"].hash]
    assert table["mine"][1]["expected"] < 1.05
    with pytest.raises(SystemExit):  # a store that keeps no shares cannot lend them
        main([*args, "--shares", str(tmp_path / "run.sqlite")])
