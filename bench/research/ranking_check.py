"""How well each way of ranking a run's measured plans foretells their confirmation: the finalist rule's evidence.

For every store, its confirmed finalists (the store's own confirmations, or ``--confirmed NAME=FILE``: the output of
``autotune evaluate --json`` on the same plans, e.g. on another machine) against estimates of the same plans from
the search: the search measurement, the additive model of all the run's trials, the mean of their logs
(:func:`autotune.search.select.expected_speedups`), and, where the store keeps the FP32 profile's runtime shares
(agent runs do; ``--shares STORE`` lends them to the others), the profile-anchored model
(:func:`autotune.search.select.profile_speedups`). Per store and pooled over the stores: the correlation of the
logs (each store's centred on their mean, so only the ranking within a run counts) and the mean |log error|.
For a store with runtime shares, also how well each model predicts trials it was not fitted on (5 folds: the RMS
error of the log speedup); this needs no confirmation, so it serves a run that stopped before confirming, given the
config (``--config``) for the knobs' defaults.

Usage:
    python bench/research/ranking_check.py --stores greedy=greedy.sqlite ppo-s0=b48/stores/ppo-s0.sqlite \
        --confirmed greedy=confirmed-greedy.json ppo-s0=confirmed-ppo-s0.json
    python bench/research/ranking_check.py --config configs/cnn-cpu.yaml --stores cnn-host/stores/ppo-s*.sqlite
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.harness.priors import lent_runtime_shares, stored_runtime_shares  # noqa: E402
from autotune.run.store import TrialStore  # noqa: E402
from autotune.run.trial import TrialResult  # noqa: E402
from autotune.search.estimate import ACCURACY_KNOBS, fit_surrogate  # noqa: E402
from autotune.search.select import expected_speedups, profile_model, profile_speedups  # noqa: E402

RULES = ("measured", "model", "mean of both", "profile model")


def estimates(
    trials: Sequence[TrialResult],
    knob_defaults: Mapping[str, object],
    runtime_shares: Mapping[str, float] | None = None,
    layer_names: Sequence[str] = (),
) -> dict[str, dict[str, float]]:
    """Per rule, plan hash to the speedup that rule expects of it (the profile model only with runtime shares)."""
    model = fit_surrogate(trials, dict(knob_defaults), ACCURACY_KNOBS)
    ok = [t for t in trials if t.ok and t.speedup]
    rules = {
        "measured": {t.plan_hash: float(t.speedup) for t in ok},
        "model": {t.plan_hash: model.predict(t.plan)[0] for t in ok} if model else {},
        "mean of both": expected_speedups(ok, model),
    }
    if runtime_shares:
        rules["profile model"] = profile_speedups(ok, knob_defaults, runtime_shares, layer_names) or {}
    return rules


FOLDS = 5


def cross_validated(
    trials: Sequence[TrialResult],
    knob_defaults: Mapping[str, object],
    runtime_shares: Mapping[str, float],
    layer_names: Sequence[str],
) -> dict[str, float]:
    """Per model, the RMS error of the log speedup it predicts for trials it was not fitted on (``FOLDS`` folds)."""
    ok = [t for t in trials if t.ok and t.speedup]
    order = np.random.default_rng(0).permutation(len(ok))
    errors: dict[str, list[float]] = {"model": [], "profile model": []}
    for fold in range(FOLDS):
        held_out = set(order[fold::FOLDS].tolist())
        fitted_on = [t for i, t in enumerate(ok) if i not in held_out]
        models = {
            "model": fit_surrogate(fitted_on, dict(knob_defaults), ACCURACY_KNOBS),
            "profile model": profile_model(fitted_on, knob_defaults, runtime_shares, layer_names),
        }
        for name, model in models.items():
            if model is not None:
                errors[name] += [math.log(model.predict(ok[i].plan)[0] / ok[i].speedup) for i in held_out]
    return {name: float(np.sqrt(np.mean(np.square(e)))) for name, e in errors.items() if e}


def agreement(expected: Mapping[str, float], confirmed: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """The logs of the expected and confirmed speedups of the plans both hold, in one order."""
    common = sorted(set(expected) & set(confirmed))
    return np.log([expected[h] for h in common]), np.log([confirmed[h] for h in common])


def _named(argument: str) -> tuple[str, Path]:
    name, _, path = argument.rpartition("=")
    return name or Path(path).stem, Path(path)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", type=_named, nargs="+", required=True, help="[NAME=]PATH of a trials store")
    parser.add_argument("--confirmed", type=_named, nargs="*", default=[], help="NAME=FILE (autotune evaluate --json)")
    parser.add_argument("--shares", type=Path, help="a store whose FP32 profile serves the stores that keep none")
    parser.add_argument("--config", type=Path, help="the runs' config: the knobs' defaults where FP32 is unconfirmed")
    args = parser.parse_args(argv)
    try:
        fallback = lent_runtime_shares(args.shares) if args.shares is not None else None
    except ValueError as error:
        parser.error(f"--shares {error}")
    confirmed_files = dict(args.confirmed)
    unknown = sorted(set(confirmed_files) - {name for name, _ in args.stores})
    if unknown:
        parser.error(f"--confirmed names no store: {unknown}")
    pooled: dict[str, tuple[list[float], list[float], list[float]]] = {rule: ([], [], []) for rule in RULES}
    defaults_from_config = None
    if args.config is not None:
        from autotune.api import analyze
        from autotune.config.schema import load_config

        _, space = analyze(load_config(args.config), profile=False)
        defaults_from_config = {knob.name: knob.default for knob in space.knobs}
    compared = False
    for name, path in args.stores:
        with TrialStore(path) as store:
            trials = list(store.trials())
            fp32_hash = store.get_meta("fp32_plan_hash")
            confirmations = store.confirmations()
            shares = stored_runtime_shares(store) or fallback
        fp32 = confirmations[fp32_hash].plan if fp32_hash in confirmations else None
        defaults = dict(fp32.knobs) if fp32 is not None else defaults_from_config
        if defaults is None:
            parser.error(f"{path}: the run has not confirmed FP32; finish it (autotune resume) or give --config")
        layer_names = tuple(n for n, _ in trials[0].plan.precisions) if trials else ()
        if shares:
            checked = cross_validated(trials, defaults, shares, layer_names)
            compared = compared or bool(checked)
            print(f"{name}: {len(trials)} trials, cross-validated log-speedup RMSE: ", end="")
            print(", ".join(f"{model} {rmse:.3f}" for model, rmse in checked.items()))
        if fp32 is None:
            continue
        if name in confirmed_files:
            rows = json.loads(confirmed_files[name].read_text())
            confirmed = {r["plan_hash"]: r["speedup"] for r in rows if r.get("speedup")}
        else:
            confirmed = {h: r.speedup for h, r in confirmations.items() if r.speedup}
        confirmed.pop(fp32.hash, None)
        line = []
        for rule, expected in estimates(trials, defaults, shares, layer_names).items():
            guess, truth = agreement(expected, confirmed)
            if len(guess) < 3:
                line.append(f"{rule}: fewer than 3 confirmed plans")
                continue
            errors, centred_guess, centred_truth = pooled[rule]
            errors += list(np.abs(guess - truth))
            centred_guess += list(guess - guess.mean())
            centred_truth += list(truth - truth.mean())
            line.append(f"{rule} {np.corrcoef(guess, truth)[0, 1]:.2f}")
        print(f"{name}: {len(confirmed)} confirmed; correlation: " + ", ".join(line))
    for rule, (errors, guess, truth) in pooled.items():
        if errors:
            correlation = np.corrcoef(guess, truth)[0, 1]
            print(f"pooled, {rule}: {len(errors)} plans, correlation {correlation:.2f}, ", end="")
            print(f"mean |log error| {float(np.mean(errors)):.3f}")
    return 0 if compared or any(errors for errors, _, _ in pooled.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
