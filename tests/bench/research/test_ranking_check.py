"""bench/research/ranking_check.py: how well each estimate of a plan's speedup foretells its confirmation."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "research"))

from ranking_check import agreement, estimates, main  # noqa: E402

from autotune.harness.priors import store_prior_inputs  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.run.store import TrialStore  # noqa: E402
from autotune.run.trial import TrialResult  # noqa: E402
from autotune.search.prior import PriorInputs  # noqa: E402
from autotune.testing import tiny_config  # noqa: E402

NAMES = ("a", "b", "c", "d")
SAVING = {"a": 0.05, "b": 0.2, "c": 0.1, "d": 0.15}


def _plan(quantized: set[str]) -> Plan:
    return Plan.make({n: ("int8" if n in quantized else "fp32") for n in NAMES})


def _true_speedup(quantized: set[str]) -> float:
    return 1.0 / (1.0 - sum(SAVING[n] for n in quantized))


def _store(path: Path, confirmed: int = 5) -> list[Plan]:
    """A run of 16 plans whose measurements carry a planted error; the first ``confirmed`` confirmed exactly."""
    rng = np.random.default_rng(0)
    plans = [_plan({n for n, bit in zip(NAMES, f"{i:04b}", strict=True) if bit == "1"}) for i in range(16)]
    with TrialStore(path) as store:
        for plan in plans:
            quantized = {n for n, p in plan.precisions if p == "int8"}
            noisy = _true_speedup(quantized) * math.exp(rng.normal(0, 0.1))
            store.put(TrialResult(plan=plan, speedup=noisy, accuracy_drop=0.001 * len(quantized)))
        store.set_meta("fp32_plan_hash", plans[0].hash)
        for plan in [plans[0], *plans[-confirmed:]]:
            quantized = {n for n, p in plan.precisions if p == "int8"}
            exact = TrialResult(plan=plan, speedup=_true_speedup(quantized), accuracy_drop=0.0, split="holdout")
            store.put_confirmation(exact)
    return plans


def test_the_rules_are_the_measurement_the_model_and_their_geometric_mean(tmp_path):
    _store(tmp_path / "run.sqlite")
    with TrialStore(tmp_path / "run.sqlite") as store:
        trials = list(store.trials())
    rules = estimates(trials, {})
    plan = trials[5]
    measured, model = rules["measured"][plan.plan_hash], rules["model"][plan.plan_hash]
    assert measured == plan.speedup
    assert rules["mean of both"][plan.plan_hash] == pytest.approx(math.sqrt(measured * model))
    # the model averages the planted errors out: it is closer to the truth than the measurements
    truth = {t.plan_hash: _true_speedup({n for n, p in t.plan.precisions if p == "int8"}) for t in trials}
    error = {rule: np.mean(np.abs(np.subtract(*agreement(values, truth)))) for rule, values in rules.items()}
    assert error["model"] < error["measured"]


def test_agreement_pairs_the_plans_both_hold():
    guess, truth = agreement({"x": 1.0, "y": math.e, "z": 2.0}, {"y": 1.0, "x": math.e, "w": 3.0})
    assert list(guess) == [0.0, 1.0] and list(truth) == [1.0, 0.0]


def test_the_command_reads_own_or_given_confirmations(tmp_path, capsys):
    plans = _store(tmp_path / "run.sqlite")
    assert main(["--stores", f"run={tmp_path / 'run.sqlite'}"]) == 0
    out = capsys.readouterr().out
    assert "run: 5 confirmed" in out and "pooled, mean of both: 5 plans" in out
    confirmed = tmp_path / "host.json"
    confirmed.write_text(json.dumps([{"plan_hash": p.hash, "speedup": 2.0 + i} for i, p in enumerate(plans[-3:])]))
    assert main(["--stores", f"run={tmp_path / 'run.sqlite'}", "--confirmed", f"run={confirmed}"]) == 0
    assert "pooled, measured: 3 plans" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a confirmation file for no store
        main(["--stores", f"run={tmp_path / 'run.sqlite'}", "--confirmed", f"other={confirmed}"])


def test_too_few_confirmed_plans_compare_nothing(tmp_path, capsys):
    _store(tmp_path / "run.sqlite", confirmed=2)
    assert main(["--stores", str(tmp_path / "run.sqlite")]) == 1
    assert "fewer than 3 confirmed plans" in capsys.readouterr().out


def test_with_runtime_shares_the_profile_model_is_compared_too(tmp_path):
    _store(tmp_path / "run.sqlite")
    with TrialStore(tmp_path / "run.sqlite") as store:
        trials = list(store.trials())
    assert "profile model" not in estimates(trials, {})
    shares = {n: s / 0.6 for n, s in SAVING.items()}  # INT8 saves 0.6 of each layer's share
    profile = estimates(trials, {}, shares, NAMES)["profile model"]
    truth = {t.plan_hash: _true_speedup({n for n, p in t.plan.precisions if p == "int8"}) for t in trials}
    measured = estimates(trials, {})["measured"]
    assert np.mean(np.abs(np.subtract(*agreement(profile, truth)))) < 0.5 * np.mean(
        np.abs(np.subtract(*agreement(measured, truth)))
    )


def test_cross_validation_needs_no_confirmation_given_the_config(tmp_path, capsys):
    config = tiny_config(tmp_path)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    shares = {"a": 0.3, "b": 0.2, "c": 0.1, "d": 0.3}
    rng = np.random.default_rng(1)
    with TrialStore(tmp_path / "cut.sqlite") as store:  # a run cut before its confirmation
        for index in range(16):
            quantized = {n for bit, n in enumerate(shares) if index >> bit & 1}
            plan = Plan.make({n: ("int8" if n in quantized else "fp32") for n in shares})
            speedup = 1 / (1 - 0.5 * sum(shares[n] for n in quantized)) * math.exp(rng.normal(0, 0.05))
            store.put(TrialResult(plan=plan, speedup=speedup, accuracy_drop=0.001))
        store_prior_inputs(store, PriorInputs(tuple(shares), tuple(shares.values()), {}, {}, "cosine"))
    with pytest.raises(SystemExit):  # the knobs' defaults come from FP32's confirmation or the config
        main(["--stores", str(tmp_path / "cut.sqlite")])
    assert main(["--config", str(config_file), "--stores", f"cut={tmp_path / 'cut.sqlite'}"]) == 0
    out = capsys.readouterr().out
    assert "cut: 16 trials, cross-validated log-speedup RMSE: model " in out and "profile model" in out
    assert "confirmed" not in out
