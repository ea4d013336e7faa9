"""Offline replay: the agent against a simulator fitted from real trials, to compare agent variants cheaply.

A real MiniLM run costs 20 minutes of builds and one run says little (measurement noise sends the same seed down
another path). The replay fits the additive plan model (:func:`autotune.search.estimate.fit_surrogate`) to every
real trial in the given stores, and trains the agent against it: each "build" returns the model's speedup times
log-normal noise and the model's accuracy drop. A variant is a list of config overrides.

Usage (the stores of earlier real runs; ``--set`` once per override of the variant):
    python bench/replay.py configs/minilm-cpu.yaml --stores 'runs/minilm-cpu*/trials.sqlite' --seeds 0 1
    python bench/replay.py configs/minilm-cpu.yaml --stores '...' --set ppo.probe_plans=false --noise 0.06

Prints the simulator's best plan within the search budget (a local search over plans with default knobs), then,
per seed, the simulator's speedup of the fastest plan within the search budget that the agent built, and the mean
number of quantized layers per 10 builds. The simulator is additive by construction, so it flatters
anything that relies on additivity: treat its results as leads for a real run, not as results.
"""

from __future__ import annotations

import argparse
import glob
import tempfile
import time
from pathlib import Path

import numpy as np

from autotune.agent import train
from autotune.api import analyze
from autotune.config import load_config
from autotune.search.design import model_best_plan
from autotune.search.estimate import RefittedEstimates, fit_surrogate
from autotune.store import TrialStore
from autotune.trial import TrialResult


def replay(config_path: str, overrides: list[str], truth, space, seed: int, noise: float) -> dict:
    """One agent run against the simulator ``truth``; returns what it found."""
    config = load_config(config_path, [f"seed={seed}", *overrides])
    built: list[TrialResult] = []
    fitted = RefittedEstimates(lambda: built, space.layer_names, {knob.name: knob.default for knob in space.knobs})
    answered: dict[str, TrialResult] = {}
    rng = np.random.default_rng(seed)

    def evaluate(plan):
        if plan.hash in answered:  # the store answers a plan built before, for free
            return answered[plan.hash]
        result = truth.result(plan)
        result.speedup *= float(np.exp(rng.normal(0.0, noise)))
        result.from_store = False
        answered[plan.hash] = result
        built.append(result)
        return result

    started = time.time()
    evaluate(space.uniform("int8"))  # every search starts with the all-INT8 plan
    with tempfile.TemporaryDirectory() as scratch:
        train(
            config,
            space,
            evaluate,
            lambda: len(built),
            Path(scratch) / "tb",
            Path(scratch) / "checkpoints",
            estimates=fitted.estimates,
            surrogate=fitted.surrogate,
            measured=fitted.measured,
        )
    within = [truth.predict(r.plan)[0] for r in built if truth.predict(r.plan)[1] <= config.search_budget]
    quantized = [sum(p != "fp32" for _, p in r.plan.precisions) for r in built]
    return {
        "seed": seed,
        "best_speedup_within_budget": round(max(within), 3) if within else None,
        "quantized_per_10_builds": [round(float(np.mean(quantized[i : i + 10]))) for i in range(0, len(built), 10)],
        "builds": len(built),
        "seconds": round(time.time() - started),
    }


def main() -> int:
    """Fits the simulator and replays each seed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--stores", required=True, help="glob of trial stores to fit the simulator on")
    parser.add_argument("--set", action="append", default=[], help="config override: the variant")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--noise", type=float, default=0.03, help="log-normal sigma of a measured speedup")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    _, space = analyze(config, profile=False)
    real = [
        trial
        for path in sorted(glob.glob(args.stores))
        for trial in TrialStore(Path(path)).trials()
        if trial.ok and trial.split == "evaluation"
    ]
    truth = fit_surrogate(real, {knob.name: knob.default for knob in space.knobs}, ridge=0.1)
    if truth is None:
        raise SystemExit(f"{args.stores}: too few successful trials to fit a simulator")
    print(f"simulator fitted on {len(real)} trials; variant {args.set or 'defaults'}; noise {args.noise}", flush=True)
    best = model_best_plan(truth, space, config.search_budget, iterations=1500)
    optimum, layers = truth.predict(best)[0], sum(p != "fp32" for _, p in best.precisions)
    print(f"simulator's best plan within the search budget: {optimum:.3f}x ({layers} layers quantized)", flush=True)
    for seed in args.seeds:
        print(replay(args.config, args.set, truth, space, seed, args.noise), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
