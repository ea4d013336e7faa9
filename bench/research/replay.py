"""Offline replay: the agent against a simulator fitted from real trials, to compare agent variants cheaply.

A real MiniLM run costs 20 minutes of builds and one run says little (measurement noise sends the same seed down
another path). The replay fits the additive plan model (:func:`autotune.search.estimate.fit_surrogate`) to every
real trial in the given stores, and trains the agent against it: each "build" returns the model's speedup times
log-normal noise and the model's accuracy drop. A variant is a list of config overrides.

Usage (the stores of earlier real runs; ``--set`` once per override of the variant):
    python bench/research/replay.py configs/minilm-cpu.yaml --stores 'runs/minilm-cpu*/trials.sqlite' --seeds 0 1
    python bench/research/replay.py configs/minilm-cpu.yaml --stores '...' --set planner.probe_plans=false --noise 0.06

Prints the simulator's best plan within the search budget (a local search over plans with default knobs: the ceiling
of what any strategy can find, as far as the simulator knows), how well the same fit predicts trials it has not
seen (the simulator check: 80 % of the trials predict the other 20 %), then,
per seed, the simulator's speedup of the fastest plan within the search budget that the agent built, and the mean
number of quantized layers per 10 builds. The simulator is additive by construction, so it flatters
anything that relies on additivity: treat its results as leads for a real run, not as results.

``--strategies`` compares every strategy on the same simulator instead (``ppo`` is the agent with the config's
settings, ``ppo-noprior`` the agent without per-layer priors, ``planner`` the surrogate planner alone, and the
searches ``greedy``, ``random``, ``optuna``), each through the driver and the strategies a real run ships, the
uniform seeds first as a real run builds them:
    python bench/research/replay.py configs/minilm-cpu.yaml --stores 'runs-bench/*/trials.sqlite' \
        --strategies ppo ppo-noprior greedy random optuna --seeds 0 1 2 3 4 5 6 7 8 9 --set budget.builds=48
It prints, per strategy, the median [min, max] over seeds of the builds until the best plan within the search budget
reaches 98 % of the simulator's greedy result (greedy's median over the seeds), and of the best speedup after 12,
24, 48 and all builds; ``--out FILE`` writes every best-so-far curve as JSON. The agent's priors come from the
stores' run meta (``prior_inputs``), else from the layerwise calibration cache of the config's model and the FP32
profile.

Then the confirmed winners, which is what a real benchmark compares: each run's finalists are chosen by the run's
own rule (``autotune.confirm.finalist_order`` on the noisy trials it built, the bolder place included) and confirmed
as a real run confirms them, on held-out data: the simulator's speedup with ``--confirm-noise``, and its drop
times the held-out-to-search drop ratio of the stores' own confirmations (their median, with their spread per
plan). The winner is the fastest confirmed finalist within the accuracy budget; the table gives its simulated
speedup and its ratio to greedy's, per seed (median [min, max]). Run it once per build budget (48, 150) to
compare with the real winners at those budgets.

``--plans-out DIR`` writes the simulator's best plans as plan files, to measure them on a real machine
(``autotune evaluate CONFIG --plan DIR/within-search-budget.json``): ``within-search-budget.json`` and, with
``--strategies``, ``ceiling.json`` (the best plan whose held-out drop meets the accuracy budget at the median ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from autotune.api import analyze
from autotune.config.schema import load_config
from autotune.config.views import SearchSettings
from autotune.confirm import finalist_order
from autotune.harness.priors import PRIOR_META
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.agent import AgentPaths, TrialModels
from autotune.search.design import model_best_plan
from autotune.search.driver import Driver, OneByOne
from autotune.search.estimate import RefittedEstimates, Surrogate, fit_surrogate
from autotune.search.prior import PriorInputs, layer_prior
from autotune.search.registry import STRATEGIES, SearchInputs, run_strategy
from autotune.search.select import PROFILE_WEIGHT, ranking
from envs.engine_build import EngineBuildEnv

TARGET = 0.98
"""The fraction of the simulator's greedy result a strategy is timed to reach."""

CHECKPOINTS = (12, 24, 48)
"""Builds after which the compared strategies' best plans are reported (the issue's 12 and greedy's 48)."""

SIMULATOR_RIDGE = 0.1
"""The simulator's ridge weight: its fit and the check of that fit must be the same fit."""


def fit_check(
    trials: list[TrialResult], knob_defaults: dict, drop_floor: float, fraction: float = 0.2, seed: int = 0
) -> dict:
    """How well the simulator's model predicts trials it was not fitted on: the trust to put in the replay.

    Fits the same additive model on a random ``1 - fraction`` of the trials and predicts the rest.

    Args:
        trials: The real trials.
        knob_defaults: Each knob's default value.
        drop_floor: Drops at or under this are left out of the relative drop error (a ratio of near-zeros).
        fraction: Share of the trials held out.
        seed: Seeds the split.

    Returns:
        ``held_out`` (trials predicted), ``drop_error_median`` and ``drop_error_p90`` (relative, over held-out
        trials with a drop above ``drop_floor``; None if there are none), ``speedup_ratio_p10`` and
        ``speedup_ratio_p90`` (predicted over measured speedup).
    """
    order = np.random.default_rng(seed).permutation(len(trials))
    cut = max(1, int(round(fraction * len(trials))))
    held_out = [trials[i] for i in order[:cut]]
    model = fit_surrogate([trials[i] for i in order[cut:]], knob_defaults, ridge=SIMULATOR_RIDGE)
    if model is None:
        return {"held_out": 0}
    predictions = [model.predict(t.plan) for t in held_out]
    errors = [
        abs(drop - t.accuracy_drop) / t.accuracy_drop
        for (_, drop), t in zip(predictions, held_out, strict=True)
        if t.accuracy_drop > drop_floor
    ]
    ratios = [speedup / t.speedup for (speedup, _), t in zip(predictions, held_out, strict=True)]
    return {
        "held_out": len(held_out),
        "drop_error_median": float(np.median(errors)) if errors else None,
        "drop_error_p90": float(np.percentile(errors, 90)) if errors else None,
        "speedup_ratio_p10": float(np.percentile(ratios, 10)),
        "speedup_ratio_p90": float(np.percentile(ratios, 90)),
    }


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """How the simulator confirms a plan on held-out data.

    Attributes:
        drop_ratio: A plan's held-out drop over its search drop (the median over the stores' confirmations).
        drop_sigma: The log-normal spread of that ratio from plan to plan.
        noise: Log-normal sigma of a confirmed speedup (a confirmation times many more rounds than a search trial).
    """

    drop_ratio: float = 1.0
    drop_sigma: float = 0.0
    noise: float = 0.02


def held_out_drop_ratios(paths: list[str], drop_floor: float) -> list[float]:
    """Held-out drop over search drop of every confirmed plan in the stores whose search drop exceeds the floor."""
    ratios = []
    for path in paths:
        with TrialStore(Path(path)) as store:
            searched = {t.plan_hash: t for t in store.trials() if t.ok and t.split == "evaluation"}
            for plan_hash, confirmed in store.confirmations().items():
                trial = searched.get(plan_hash)
                if trial is None or not confirmed.ok or trial.accuracy_drop <= drop_floor:
                    continue
                ratios.append(confirmed.accuracy_drop / trial.accuracy_drop)
    return ratios


def confirmed_winner(
    built: list[TrialResult], truth, config, space, shares, held_out: HeldOut, rng: np.random.Generator
) -> dict:
    """The run's winner as a real run picks it: its finalists confirmed on simulated held-out data.

    Follows ``autotune.confirm.confirm_finalists``: the first ``confirm.top_k`` plans of the run's finalist order, then
    down the list (up to ``top_k`` more) while none meets the accuracy budget; the winner is the fastest confirmed
    plan within it.

    Returns:
        ``winner_speedup`` (the simulator's, without noise; 1.0 when nothing confirmed meets the budget, as FP32
        would be exported), ``winner_drop`` (its held-out drop) and ``winner_quantized`` (its quantized layers).
    """
    fp32 = space.uniform("fp32")
    order, _ = finalist_order(built, config.finalists, fp32, shares)
    top_k = config.confirm.top_k

    def confirm(plan) -> TrialResult:
        result = truth.result(plan)  # the simulator's speedup and search drop
        result.speedup *= float(np.exp(rng.normal(0.0, held_out.noise)))
        result.accuracy_drop *= held_out.drop_ratio * float(np.exp(rng.normal(0.0, held_out.drop_sigma)))
        result.split = "holdout"
        return result

    confirmed = [confirm(plan) for plan in order[:top_k]]
    for plan in order[top_k : 2 * top_k]:
        if any(r.accuracy_drop <= config.accuracy_budget for r in confirmed):
            break
        confirmed.append(confirm(plan))
    best = ranking(confirmed, config.accuracy_budget)
    if not best or best[0].accuracy_drop > config.accuracy_budget:
        return {"winner_speedup": 1.0, "winner_drop": 0.0, "winner_quantized": 0}
    winner = best[0]
    return {
        "winner_speedup": round(truth.predict(winner.plan)[0], 4),
        "winner_drop": round(winner.accuracy_drop, 6),
        "winner_quantized": sum(p != "fp32" for _, p in winner.plan.precisions),
    }


def replay(
    config_path: str,
    overrides: list[str],
    truth,
    space,
    seed: int,
    noise: float,
    strategy: str = "ppo",
    prior=None,
    held_out: HeldOut | None = None,
) -> dict:
    """One run of ``strategy`` against the simulator ``truth``; returns what it found.

    Args:
        config_path: The config.
        overrides: Config overrides (the variant).
        truth: The simulator (a fitted ``Surrogate``).
        space: The search space.
        seed: Seeds the strategy and the measurement noise.
        noise: Log-normal sigma of a measured speedup.
        strategy: ``ppo``, ``ppo-noprior``, ``planner`` (the surrogate planner alone) or another of ``STRATEGIES``.
        prior: The agent's prior inputs (``PriorInputs``), or None; its runtime shares also rank the finalists.
        held_out: How finalists are confirmed; None skips the confirmation (no ``winner_*`` keys).
    """
    agent = strategy.startswith("ppo") or strategy == "planner"
    extra = ["planner.priors=false"] if strategy == "ppo-noprior" else []
    # A simulated build takes no time, so a paced agent would never rehearse: the replay runs the rehearsals that
    # builds as slow as MiniLM's pay for in full (ppo.compute_share; an override still wins).
    config = load_config(config_path, [f"seed={seed}", "ppo.compute_share=0", *overrides, *extra])
    built: list[TrialResult] = []
    use_prior = prior if agent and config.planner.priors else None
    fitted = RefittedEstimates(
        lambda: built,
        space.layer_names,
        {knob.name: knob.default for knob in space.knobs},
        prior_inputs=use_prior,
        prior_weight=config.planner.prior_weight,
    )
    answered: dict[str, TrialResult] = {}
    rng = np.random.default_rng(seed)

    def evaluate(plan):
        if plan.hash in answered:  # the store answers a plan built before, for free
            return dataclasses.replace(answered[plan.hash], from_store=True)
        result = truth.result(plan)
        result.speedup *= float(np.exp(rng.normal(0.0, noise)))
        result.from_store = False
        answered[plan.hash] = result
        built.append(result)
        return result

    started = time.time()
    # The driver, the seeds and the strategies a real run ships, over the simulator as the harness.
    driver = Driver.for_budget(OneByOne(evaluate, lambda: len(built)), config.budget)
    models = TrialModels.refitted(fitted, use_prior is not None)
    with tempfile.TemporaryDirectory() as scratch:
        paths = AgentPaths(Path(scratch) / "tb", Path(scratch) / "checkpoints")
        inputs = SearchInputs(
            SearchSettings.of(config), driver.workers, lambda _: models, paths, make_env=EngineBuildEnv
        )
        run_strategy("ppo" if strategy.startswith("ppo") else strategy, driver, space, inputs)
    true = [truth.predict(r.plan) for r in built]
    within = [speedup for speedup, drop in true if drop <= config.search_budget]
    curve, best = [], 1.0
    for speedup, drop in true:
        best = max(best, speedup) if drop <= config.search_budget else best
        curve.append(round(best, 4))
    quantized = [sum(p != "fp32" for _, p in r.plan.precisions) for r in built]
    winner = {}
    if held_out is not None:
        shares = prior.share_map() if prior is not None else None
        winner = confirmed_winner(built, truth, config, space, shares, held_out, rng)
    return {
        "strategy": strategy,
        "seed": seed,
        "best_speedup_within_budget": round(max(within), 3) if within else None,
        **winner,
        "quantized_per_10_builds": [round(float(np.mean(quantized[i : i + 10]))) for i in range(0, len(built), 10)],
        "builds": len(built),
        "best_so_far": curve,
        "seconds": round(time.time() - started),
    }


def stored_prior_inputs(paths: list[str], config, space) -> PriorInputs | None:
    """The prior inputs of the replayed runs: a store's run meta, else the config's layerwise calibration cache.

    The cache holds the single-layer errors of every layerwise calibration of the model; the newest one whose
    layers are the space's INT8 layers is taken (a bench shortcut: a run asks its trial process instead).
    """
    for path in paths:
        with TrialStore(Path(path)) as store:
            data = store.get_meta(PRIOR_META)
        if isinstance(data, dict):
            return PriorInputs.from_dict(data)
    model, profiled = analyze(config)
    int8_layers = {
        layer.name for layer, options in zip(profiled.layers, profiled.choices, strict=True) if "int8" in options
    }
    caches = sorted(
        (config.cache_dir / "calibration").glob(f"layerwise-{model.hash[:16]}-*.json"), key=lambda p: p.stat().st_mtime
    )
    for cache in reversed(caches):
        data = json.loads(cache.read_text())
        if set(data["methods"]) == int8_layers:
            granularity = next((k.default for k in profiled.knobs if k.name == "weight_granularity"), None)
            return PriorInputs(
                tuple(profiled.layer_names),
                tuple(layer.runtime_share for layer in profiled.layers),
                data["errors"],
                data["methods"],
                config.metric.name,
                granularity,
            )
    return None


def _median_cell(values: list) -> str:
    present = [v for v in values if v is not None]
    missed = len(values) - len(present)
    if not present:
        return f"never ({missed})"
    cell = f"{float(np.median(present)):.4g} [{min(present):.4g}, {max(present):.4g}]"
    return cell + (f", {missed} never" if missed else "")


def compare(args: argparse.Namespace, truth, space, prior, held_out: HeldOut | None = None) -> int:
    """Every strategy over every seed on the simulator; prints the tables, writes the curves."""
    runs = []
    for strategy in args.strategies:
        for seed in args.seeds:
            result = replay(args.config, args.set, truth, space, seed, args.noise, strategy, prior, held_out)
            print({k: v for k, v in result.items() if k != "best_so_far"}, flush=True)
            runs.append(result)
    greedy = [r["best_speedup_within_budget"] or 1.0 for r in runs if r["strategy"] == "greedy"]
    if not greedy:
        greedy = [r["best_speedup_within_budget"] or 1.0 for r in replay_greedy(args, truth, space)]
    target = TARGET * float(np.median(greedy))
    print(f"\ntarget: {TARGET:.0%} of the simulator's greedy result ({float(np.median(greedy)):.3f}x) = {target:.3f}x")
    print(
        "| strategy | builds to reach the target | "
        + " | ".join(f"best after {n}" for n in CHECKPOINTS)
        + " | best at the end |"
    )
    print("|---|---|" + "---|" * (len(CHECKPOINTS) + 1))
    for strategy in args.strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        reach = [next((i + 1 for i, v in enumerate(r["best_so_far"]) if v >= target), None) for r in mine]
        at = [[r["best_so_far"][min(n, len(r["best_so_far"])) - 1] for r in mine] for n in (*CHECKPOINTS, 10**9)]
        print(f"| {strategy} | {_median_cell(reach)} | " + " | ".join(_median_cell(a) for a in at) + " |")
    if held_out is not None:
        print_winners(runs, args.strategies)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": target, "runs": runs}, indent=1))
    return 0


def print_winners(runs: list[dict], strategies: list[str]) -> None:
    """The confirmed winners' table: simulated speedup, and over greedy's winner of the same seed where it ran."""
    greedy = {r["seed"]: r["winner_speedup"] for r in runs if r["strategy"] == "greedy"}
    print("\n| strategy | confirmed winner (simulated speedup) | quantized layers | over greedy's, seed by seed |")
    print("|---|---|---|---|")
    for strategy in strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        ratios = [r["winner_speedup"] / greedy[r["seed"]] for r in mine if r["seed"] in greedy]
        speedups = _median_cell([r["winner_speedup"] for r in mine])
        layers = _median_cell([r["winner_quantized"] for r in mine])
        print(f"| {strategy} | {speedups} | {layers} | {_median_cell(ratios) if ratios else '-'} |")


def replay_greedy(args: argparse.Namespace, truth, space) -> list[dict]:
    """Greedy on the simulator over the seeds, for the target when it is not among the compared strategies."""
    return [replay(args.config, args.set, truth, space, seed, args.noise, "greedy") for seed in args.seeds]


def fit_truth(
    real: list[TrialResult],
    defaults: dict,
    layer_names: list[str],
    prior: PriorInputs | None,
    prior_weight: float = 0.0,
    saving_weight: float = 0.0,
) -> Surrogate | None:
    """The simulator: the additive model of the real trials, toward the per-layer priors where a weight is given.

    ``prior_weight`` pulls savings and drops toward the priors; ``saving_weight`` pulls the savings alone (the drops
    then stay the trials' own fit). None with too few trials.
    """
    truth_prior = None
    if (prior_weight or saving_weight) and prior is not None:
        truth_prior = layer_prior(prior, real, defaults)
        if not prior_weight:
            truth_prior = dataclasses.replace(truth_prior, drops={})
    return fit_surrogate(
        real,
        defaults,
        ridge=SIMULATOR_RIDGE,
        prior=truth_prior,
        layer_names=layer_names,
        prior_weight=prior_weight or SIMULATOR_RIDGE,
        saving_prior_weight=saving_weight or None,
    )


def main() -> int:
    """Fits the simulator and replays each seed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--stores", required=True, help="glob of trial stores to fit the simulator on")
    parser.add_argument("--set", action="append", default=[], help="config override: the variant")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--noise", type=float, default=0.03, help="log-normal sigma of a measured speedup")
    parser.add_argument(
        "--strategies", nargs="+", choices=("ppo-noprior", *STRATEGIES), help="compare these strategies"
    )
    parser.add_argument("--out", help="with --strategies: write every best-so-far curve to this JSON file")
    parser.add_argument("--plans-out", type=Path, help="write the simulator's best plans as plan files to this folder")
    parser.add_argument(
        "--confirm-noise",
        type=float,
        default=HeldOut.noise,
        help="with --strategies: log-normal sigma of a confirmed speedup (the same MiniLM winner moved up to 4 %%"
        " between two confirmations, docs/benchmarks.md)",
    )
    parser.add_argument(
        "--truth-prior-weight",
        type=float,
        default=0.0,
        help="fit the simulator toward the per-layer priors with this weight (trials' worth per layer), not toward 0:"
        " stores of one strategy's trials (greedy's, all near all-INT8) leave plans far from them to the prior",
    )
    parser.add_argument(
        "--truth-saving-weight",
        type=float,
        default=0.0,
        help="fit the simulator's savings toward the FP32 profile's shares with this weight (the finalist rule's"
        f" model: {PROFILE_WEIGHT:g}); its drops stay the trials' own fit unless --truth-prior-weight is given",
    )
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    _, space = analyze(config, profile=False)
    paths = sorted(glob.glob(args.stores))
    real = [
        trial for path in paths for trial in TrialStore(Path(path)).trials() if trial.ok and trial.split == "evaluation"
    ]
    defaults = {knob.name: knob.default for knob in space.knobs}
    toward_prior = args.truth_prior_weight or args.truth_saving_weight
    prior = stored_prior_inputs(paths, config, space) if config.planner.priors or toward_prior else None
    truth = fit_truth(real, defaults, space.layer_names, prior, args.truth_prior_weight, args.truth_saving_weight)
    if truth is None:
        raise SystemExit(f"{args.stores}: too few successful trials to fit a simulator")
    print(f"simulator fitted on {len(real)} trials; variant {args.set or 'defaults'}; noise {args.noise}", flush=True)
    best = model_best_plan(truth, space, config.search_budget, iterations=1500)
    optimum, layers = truth.predict(best)[0], sum(p != "fp32" for _, p in best.precisions)
    print(f"simulator's best plan within the search budget: {optimum:.3f}x ({layers} layers quantized)", flush=True)
    if args.plans_out:
        args.plans_out.mkdir(parents=True, exist_ok=True)
        (args.plans_out / "within-search-budget.json").write_text(best.to_json())
    check = fit_check(real, defaults, drop_floor=config.search_budget / 3)
    if check["held_out"] and check["drop_error_median"] is not None:
        print(
            f"simulator check, fitted on 80 % and predicting the other {check['held_out']} trials: drop error "
            f"median {check['drop_error_median']:.1%}, 90th percentile {check['drop_error_p90']:.1%} (drops over a "
            f"third of the search budget); predicted / measured speedup {check['speedup_ratio_p10']:.2f}-"
            f"{check['speedup_ratio_p90']:.2f} (10th-90th percentile)",
            flush=True,
        )
    else:
        print("simulator check: too few trials to hold some out", flush=True)
    if args.strategies:
        print(f"priors: {'single-layer errors and runtime shares' if prior else 'none found'}", flush=True)
        ratios = held_out_drop_ratios(paths, drop_floor=config.search_budget / 3)
        held_out = HeldOut(noise=args.confirm_noise)
        if ratios:
            logs = np.log(ratios)
            held_out = HeldOut(float(np.exp(np.median(logs))), float(np.std(logs)), args.confirm_noise)
        print(
            f"held-out drop / search drop: {held_out.drop_ratio:.3f}, spread {held_out.drop_sigma:.3f} "
            f"(from {len(ratios)} confirmed plans); confirmation noise {held_out.noise}",
            flush=True,
        )
        # The ceiling of a confirmed winner: what the bold place could hold at best, where greedy's winner sits.
        limit = config.accuracy_budget / held_out.drop_ratio
        bold = model_best_plan(truth, space, limit, iterations=1500)
        print(
            f"simulator's best plan whose held-out drop meets the accuracy budget at the median ratio (search drop "
            f"<= {limit:.3g}): {truth.predict(bold)[0]:.3f}x ({sum(p != 'fp32' for _, p in bold.precisions)} layers "
            "quantized)",
            flush=True,
        )
        if args.plans_out:
            (args.plans_out / "ceiling.json").write_text(bold.to_json())
        return compare(args, truth, space, prior, held_out)
    for seed in args.seeds:
        result = replay(args.config, args.set, truth, space, seed, args.noise, prior=prior)
        print({k: v for k, v in result.items() if k not in ("best_so_far", "strategy")}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
