"""How well each way of ranking a run's measured plans foretells their confirmation: the finalist rule's evidence.

For every store, its confirmed finalists (the store's own confirmations, or ``--confirmed NAME=FILE``: the output of
``autotune evaluate --json`` on the same plans, e.g. on another machine) against estimates of the same plans from
the search: the search measurement, the additive model of all the run's trials, the mean of their logs
(:func:`autotune.search.select.expected_speedups`), and, where the store keeps the FP32 profile's runtime shares
(agent runs do; ``--shares STORE`` lends them to the others), the profile-anchored model
(:func:`autotune.search.select.profile_speedups`). Per store and pooled over the stores: the correlation of the
logs (each store's centred on their mean, so only the ranking within a run counts) and the mean |log error|.

Usage:
    python bench/ranking_check.py --stores greedy=greedy.sqlite ppo-s0=b48/stores/ppo-s0.sqlite \
        --confirmed greedy=confirmed-greedy.json ppo-s0=confirmed-ppo-s0.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.harness.memory import lent_runtime_shares, stored_runtime_shares  # noqa: E402
from autotune.search.estimate import ACCURACY_KNOBS, fit_surrogate  # noqa: E402
from autotune.search.select import expected_speedups, profile_speedups  # noqa: E402
from autotune.store import TrialStore  # noqa: E402
from autotune.trial import TrialResult  # noqa: E402

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
    for name, path in args.stores:
        with TrialStore(path) as store:
            trials = list(store.trials())
            fp32_hash = store.get_meta("fp32_plan_hash")
            confirmations = store.confirmations()
            shares = stored_runtime_shares(store) or fallback
        if fp32_hash is None or fp32_hash not in confirmations:
            parser.error(f"{path}: the run has not confirmed FP32 yet; finish it first (autotune resume)")
        if name in confirmed_files:
            rows = json.loads(confirmed_files[name].read_text())
            confirmed = {r["plan_hash"]: r["speedup"] for r in rows if r.get("speedup")}
        else:
            confirmed = {h: r.speedup for h, r in confirmations.items() if r.speedup}
        confirmed.pop(fp32_hash, None)
        line = []
        fp32 = confirmations[fp32_hash].plan
        for rule, expected in estimates(trials, dict(fp32.knobs), shares, tuple(fp32.precision_map)).items():
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
    return 0 if any(errors for errors, _, _ in pooled.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
