"""A tuning run from start to export: search, confirm the finalists on held-out data, export the winner."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.api import analyze, check_data, references
from autotune.config import ConfigError, TuneConfig
from autotune.files import write_json
from autotune.harness import Evaluator
from autotune.harness.memory import (
    KEY_META,
    check_comparable,
    check_resumable,
    comparability_key,
    import_runs,
    prior_inputs,
    store_prior_inputs,
)
from autotune.harness.selfcheck import (
    check_confirmation_timing,
    check_search_timing,
    confirmation_noise,
    confirmation_rounds,
    summary_fields,
    with_measured_noise,
)
from autotune.monitor import RunMonitor
from autotune.plan import PRECISIONS, KnobValue, Plan
from autotune.rundir import RunDir
from autotune.search.estimate import ACCURACY_KNOBS, RefittedEstimates, fit_surrogate
from autotune.search.reward import meets_budget
from autotune.search.select import confirmation_order, expected_speedups, profile_speedups, ranking
from autotune.search.space import SearchSpace
from autotune.search.strategies import INDEPENDENT_SEARCHES, SEARCHES, SearchContext, search_fixed
from autotune.store import TrialStore
from autotune.trial import TrialResult


def confirm(evaluator: Evaluator, store: TrialStore, plans: list[Plan], rounds: int | None = None) -> list[TrialResult]:
    """Confirms each plan once per run (a resumed run reuses earlier confirmations); the new ones side by side."""
    done = {**store.confirmations(), **{r.plan_hash: r for r in store.references().values()}}
    fresh = [plan for plan in plans if plan.hash not in done]
    if fresh:
        done.update((result.plan_hash, result) for result in evaluator.confirm_side_by_side(fresh, rounds))
    return [done[plan.hash] for plan in plans]


def finalist_order(
    trials: Sequence[TrialResult], config: TuneConfig, fp32: Plan, runtime_shares: Mapping[str, float] | None = None
) -> tuple[list[Plan], dict[str, float]]:
    """A run's measured plans in the order they are confirmed (the first ``confirm.top_k`` are the finalists).

    Ranked by what the plans are expected to hold, not by one short measurement each: with the FP32 profile's
    runtime shares, by the additive model whose per-layer savings are the profile's (``PROFILE_WEIGHT``), alone;
    without them, by the mean of each plan's measurement and a model fitted from zero
    (:func:`autotune.search.select.expected_speedups`). FP32 is left out (it is confirmed as the reference).

    Args:
        trials: The run's trials.
        config: The run's config.
        fp32: The FP32 plan (its knobs are the defaults, which the model gives no term).
        runtime_shares: Layer name to its share of FP32 runtime (layers the profile did not time left out).

    Returns:
        The plans in order, and each measured plan's expected speedup by hash.
    """
    expected = (
        profile_speedups(trials, dict(fp32.knobs), runtime_shares, tuple(fp32.precision_map))
        if runtime_shares
        else None
    )
    if expected is None:
        expected = expected_speedups(trials, fit_surrogate(trials, dict(fp32.knobs), ACCURACY_KNOBS))
    order = [r.plan for r in confirmation_order(trials, config, expected) if r.plan_hash != fp32.hash]
    return order, expected


def confirm_finalists(
    evaluator: Evaluator,
    store: TrialStore,
    config: TuneConfig,
    fp32: Plan,
    one_liners: Sequence[Plan] = (),
    runtime_shares: Mapping[str, float] | None = None,
    rounds: int | None = None,
) -> list[TrialResult]:
    """Confirms the ``confirm.top_k`` best bets, FP32 and the backend's one-liners side by side, in the same rounds.

    The winner is the fastest finalist, so the finalists are timed together: machine drift between passes then
    falls on all of them alike instead of deciding which one wins; the one-liners are timed beside them by the
    same harness. While no finalist meets the budget on held-out data, goes on down the list, up to ``top_k``
    more (each confirmed alone). A one-liner is stored apart from the finalists and never exported.

    Returns:
        The finalists' and FP32's confirmations (not the one-liners').
    """
    order, _ = finalist_order(list(store.trials()), config, fp32, runtime_shares)
    top_k = config.confirm.top_k
    finalists = [*order[:top_k], fp32]
    confirmed = confirm(evaluator, store, [*finalists, *one_liners], rounds)[: len(finalists)]
    confirmed = check_confirmation_timing(evaluator, store, config, confirmed, fp32, list(one_liners), rounds)
    for plan in order[top_k : 2 * top_k]:
        if any(meets_budget(r, config.accuracy_budget) for r in confirmed if r.plan_hash != fp32.hash):
            break
        confirmed += confirm(evaluator, store, [plan], rounds)
    return confirmed


def one_liner_plans(evaluator: Evaluator, layers: list[str]) -> list[Plan]:
    """The reference plans of the backend's one-liners that ``confirm.references`` asks for (default all)."""
    wanted = evaluator.config.confirm.references  # None: every one the backend offers
    return [Plan.reference_plan(layers, name) for name in evaluator.references() if wanted is None or name in wanted]


def reference_rows(store: TrialStore, winner: TrialResult, accuracy_budget: float) -> dict[str, Any]:
    """The one-liners measured in a run beside its winner, for the summary.

    Returns:
        ``references`` (name to metrics, status and error), ``best_reference`` (the fastest one-liner within the
        accuracy budget, or None), ``winner_over_best_reference`` (the winner's speedup over FP32 divided by that
        one-liner's: one launch at a time), ``winner_over_best_reference_back_to_back`` (the fastest one-liner
        within the budget back to back, its latency per launch over the winner's; None where the backend has no
        such timer) and ``reference_note``: one line when a one-liner within the budget is faster than the
        winner, else None. The winner is exported either way: the user decides.
    """
    references = store.references()
    rows = {
        name: {"plan_hash": r.plan.hash, "status": r.status, "error": r.error, **_metrics(r)}
        for name, r in references.items()
    }
    within = [(name, r) for name, r in references.items() if meets_budget(r, accuracy_budget) and r.speedup]
    best = max(within, key=lambda item: item[1].speedup, default=None)
    note = None
    ratio = None
    if best is not None:
        name, result = best
        ratio = (winner.speedup or 0.0) / result.speedup
        if result.speedup > (winner.speedup or 0.0):
            note = (
                f"the one-liner {name} beats the winner within the accuracy budget ({result.speedup:.2f}x against "
                f"{winner.speedup or 0.0:.2f}x over FP32, held-out data); the winner is exported as ranked: "
                f"compare them with `autotune evaluate CONFIG --plan {name}`"
            )
    back_to_back = [r.back_to_back_ms for _, r in within if r.back_to_back_ms]
    back_to_back_ratio = min(back_to_back) / winner.back_to_back_ms if back_to_back and winner.back_to_back_ms else None
    return {
        "references": rows,
        "best_reference": best[0] if best else None,
        "winner_over_best_reference": ratio,
        "winner_over_best_reference_back_to_back": back_to_back_ratio,
        "reference_note": note,
    }


def export_ranked(
    run: RunDir, config: TuneConfig, evaluator: Evaluator, store: TrialStore, rank: int = 1, out_dir: Path | None = None
) -> dict[str, Any]:
    """Writes the plan of a given confirmation rank: deployable model, ``plan.json`` and ``summary.json``.

    The summary's ``ranking`` lists every confirmed plan of the store, best first.

    Raises:
        ConfigError: No confirmed plan has that rank.
    """
    confirmed = ranking(list(store.confirmations().values()), config.accuracy_budget, confirmation_noise(store))
    within = [r for r in confirmed if meets_budget(r, config.accuracy_budget)]
    if not 1 <= rank <= len(within):
        raise ConfigError(f"rank {rank} does not exist: {len(within)} confirmed plans meet the accuracy budget")
    chosen = within[rank - 1]
    out_dir = out_dir or run.best
    files = evaluator.export(chosen.plan, out_dir)
    write_json(out_dir / "plan.json", chosen.plan.to_dict())
    reference = store.confirmations().get(str(store.get_meta("fp32_plan_hash", "")))
    summary = {
        "rank": rank,
        "plan_hash": chosen.plan.hash,
        "plan": chosen.plan.describe(),
        "files": files,
        "winner": _metrics(chosen),
        "fp32_reference": _metrics(reference) if reference else None,
        **reference_rows(store, chosen, config.accuracy_budget),
        "accuracy_budget": config.accuracy_budget,
        "metric": config.metric.name,
        "builds": store.builds(),
        "imported_trials": len(store.imported()),
        "cache_hits": int(store.get_meta("cache_hits", 0)),
        "free_knobs": store.get_meta("free_knobs", {}),
        "wall_s": float(store.get_meta("wall_s", 0.0)),
        "machine": (store.get_meta(KEY_META, {}) or {}).get("machine"),
        "int8_arithmetic": evaluator.int8_arithmetic(),
        "ranking": [{"plan_hash": r.plan.hash, "plan": r.plan.describe(), **_metrics(r)} for r in confirmed],
        **summary_fields(store),
    }
    write_json(out_dir / "summary.json", summary)
    return summary


def _metrics(result: TrialResult) -> dict[str, Any]:
    return {
        "split": result.split,
        "speedup": result.speedup,
        "latency_ms": result.latency_ms,
        "latency_iqr_ms": result.latency_iqr_ms,
        "reference_latency_ms": result.reference_latency_ms,
        "accuracy": result.accuracy,
        "reference_accuracy": result.reference_accuracy,
        "accuracy_drop": result.accuracy_drop,
        "fidelity": result.fidelity,
        "protocol": result.protocol,
        "back_to_back_ms": result.back_to_back_ms,
        "reference_back_to_back_ms": result.reference_back_to_back_ms,
    }


STRATEGIES: tuple[str, ...] = ("ppo", *SEARCHES, *PRECISIONS)
"""Every strategy ``tune`` runs, and so ``autotune baseline --strategy`` offers: the agent, the searches, and one
uniform plan per precision (the usual "build with INT8 enabled")."""


def _uniform_seeds(space: SearchSpace) -> list[str]:
    """The lower precisions some layer of the space offers, INT8 first: each becomes one all-that-precision trial."""
    return [p for p in ("int8", "fp8", "fp16", "bf16") if any(p in choices for choices in space.choices)]


def _uniform_seed_rounds(space: SearchSpace) -> tuple[list[Plan], list[str]]:
    """The whole-model float seeds to build first, and the quantized precisions to seed on the faster one's base.

    Where a knob follows the precision (the torch and TensorRT backends' ``base_precision``), the all-FP16 and
    all-BF16 seeds run the whole model in that type, and an all-INT8 or all-FP8 seed on the default FP32 base
    measures its GEMMs where the FP32 rest of the model sets the latency: on an H200 the BERT-large-shaped encoder
    ran all-FP8 at 7.34x FP32 on an FP32 base, below all-FP16 (7.78x), while on a BF16 base with SDPA all-FP8 is
    1.34x BF16 (docs/benchmarks.md). So the quantized seeds are built on the faster float seed's base, the base a
    user would deploy them on. Without such a knob every seed is built in one round.
    """
    precisions = _uniform_seeds(space)
    bases = [knob for knob in space.knobs if knob.follows_precision]
    floats = [p for p in precisions if p in ("fp16", "bf16") and any(p in knob.values for knob in bases)]
    if not floats:
        return [space.uniform(p) for p in precisions], []
    return [space.uniform(p) for p in floats], [p for p in precisions if p not in floats]


FREE_KNOB_MARGIN = 0.01
"""How much faster (relative speedup) another value of a free knob must measure than the seed's to replace it:
within it the two are a tie, and the seed's value (the users' default) stays."""


def fix_free_knobs(space: SearchSpace, seed: TrialResult, build: Any) -> dict[str, KnobValue]:
    """Measures each free knob's other values on ``seed`` and returns the fastest value of each knob measured.

    Free knobs (``Knob.free``) change the outputs at rounding level only, so one measurement on one plan says which
    value is fastest for every plan: one knob at a time, each other value is built on the best plan so far and
    replaces the current one only when it is faster by more than ``FREE_KNOB_MARGIN``. A knob whose builds did not
    all fit the build budget is left out (it stays searched); a value whose build failed is not chosen.

    Args:
        space: The search space.
        seed: The fastest uniform seed's result.
        build: Plans to their results (fewer when the budget runs out), as ``_build_uniform_seeds`` builds them.

    Returns:
        Knob name to its fixed value, for ``SearchSpace.with_fixed_knobs``.
    """
    best, fixed = seed, {}
    for knob in space.free_knobs:
        current = best.plan.knob(knob.name, knob.default)
        others = [best.plan.with_knobs(**{knob.name: value}) for value in knob.values if value != current]
        results = build(others)
        if len(results) < len(others):
            break  # the budget ran out: this knob and the rest stay in the search
        for result in results:
            if result.ok and result.speedup and result.speedup > (best.speedup or 0.0) * (1 + FREE_KNOB_MARGIN):
                best = result
        fixed[knob.name] = best.plan.knob(knob.name, knob.default)
    return fixed


def _build_uniform_seeds(
    space: SearchSpace, evaluator: Evaluator, evaluate: Any, evaluate_many: Any
) -> dict[str, KnobValue]:
    """Builds the uniform plans of ``_uniform_seeds`` within the budget: side by side with several workers.

    Between the float seeds and the quantized ones, the free knobs are measured on the fastest float seed and
    fixed (``fix_free_knobs``); the quantized seeds are built with the fixed values.

    Returns:
        The free knobs fixed, name to value (empty when the space has none or the budget ran out first).
    """
    budget = evaluator.config.budget.builds

    def build(plans: list[Plan]) -> list[TrialResult]:
        if evaluator.workers > 1:
            return list(evaluate_many(plans, max(0, budget - evaluator.builds)))
        results = []
        for plan in plans:
            if evaluator.builds >= budget:
                break
            results.append(evaluate(plan))
        return results

    first, quantized = _uniform_seed_rounds(space)
    measured = [r for r in build(first) if r.ok and r.speedup]
    fastest_result = max(measured, key=lambda r: r.speedup) if measured else None
    fastest = fastest_result.plan if fastest_result is not None else None
    fixed = fix_free_knobs(space, fastest_result, build) if fastest_result is not None else {}
    following = {
        knob.name: fastest.knob(knob.name)
        for knob in space.knobs
        if fastest is not None and knob.follows_precision and fastest.knob(knob.name) is not None
    }
    build([space.uniform(precision, {**following, **fixed}) for precision in quantized])
    return fixed


def _seeds_ahead(space: SearchSpace, strategy: str, workers: int) -> list[Plan]:
    """The uniform seeds that head the search's first batch instead of being built in rounds of their own.

    Only with several workers and a search of ``INDEPENDENT_SEARCHES`` (its proposals depend on no result): the
    workers then take the seeds and the first searched plans in one stream, where a round of seeds alone would
    leave all but a few of them idle (one all-INT8 plan on the ONNX Runtime CPU backend). None with one worker
    (the seeds are built first, then the search, as always), for the searches that use the seeds' results, or where
    the quantized seeds wait for the float seeds' results (``_uniform_seed_rounds``), nor where free knobs wait
    for them (``fix_free_knobs``).
    """
    if workers <= 1 or strategy not in INDEPENDENT_SEARCHES or space.free_knobs:
        return []
    first, quantized = _uniform_seed_rounds(space)
    return first if not quantized else []


def search_with_seeds(
    config: TuneConfig,
    space: SearchSpace,
    evaluate: Any,
    evaluator: Evaluator,
    run: RunDir,
    strategy: str,
    resume: bool,
    evaluate_many: Any = None,
) -> dict[str, KnobValue]:
    """The uniform seeds (``_uniform_seeds``), then the search, until the build budget is spent.

    The usual "build with INT8 enabled" (and, where the backend has them, all-FP8/FP16/BF16) are the first trials
    of every search: the references a user compares against, and data points for the per-layer estimates. They are
    built in rounds of their own before the search, or, where ``_seeds_ahead`` says so, at the head of its first
    batch. A precision strategy is its one uniform plan, with no seed.

    The free knobs the seeds fixed (``fix_free_knobs``) are fixed for the search: every strategy searches a space
    where they have their one value.

    Returns:
        The free knobs fixed, name to value.
    """
    ahead = _seeds_ahead(space, strategy, evaluator.workers)
    fixed: dict[str, KnobValue] = {}
    if strategy not in PRECISIONS and not ahead:
        fixed = _build_uniform_seeds(space, evaluator, evaluate, evaluate_many)
        space = space.with_fixed_knobs(fixed)
    if evaluator.builds < config.budget.builds:
        run_search(config, space, evaluate, evaluator, run, strategy, resume, evaluate_many, ahead)
    return fixed


def run_search(
    config: TuneConfig,
    space: SearchSpace,
    evaluate: Any,
    evaluator: Evaluator,
    run: RunDir,
    strategy: str,
    resume: bool,
    evaluate_many: Any = None,
    ahead: list[Plan] | None = None,
) -> None:
    """Runs one search strategy until the build budget is spent.

    ``evaluate_many`` (plans and a build limit to results in completion order) lets the searches keep
    ``evaluator.workers`` builds running at once; ``ahead`` are plans a search of ``INDEPENDENT_SEARCHES`` builds
    in the same stream as its first plans, ahead of them.

    Raises:
        ConfigError: The strategy is unknown.
        ValueError: ``ahead`` is given to a strategy that would not build it.
    """
    if ahead and strategy not in INDEPENDENT_SEARCHES:
        raise ValueError(f"strategy {strategy!r} builds the seeds in a round of their own, not ahead of its plans")
    if strategy == "ppo":
        from autotune.agent import train

        inputs = prior_inputs(config, space, evaluator) if config.planner.priors else None
        if inputs is not None:
            store_prior_inputs(evaluator.store, inputs)
        fitted = RefittedEstimates(
            lambda: list(evaluator.store.trials()),
            space.layer_names,
            {knob.name: knob.default for knob in space.knobs},
            count=lambda: len(evaluator.store),
            prior_inputs=inputs,
            prior_weight=config.planner.prior_weight,
        )
        train(
            config,
            space,
            evaluate,
            lambda: evaluator.builds,
            run.tensorboard,
            run.checkpoints,
            resume,
            fitted.estimates,
            fitted.surrogate,
            fitted.measured,
            evaluate_many=evaluate_many if evaluator.workers > 1 else None,
            workers=evaluator.workers,
            prior=fitted.prior if inputs is not None else None,
        )
        return
    context = SearchContext(
        config,
        space,
        evaluate,
        lambda: evaluator.builds,
        seed=config.seed,
        stall=config.budget.stall_episodes,
        evaluate_many=evaluate_many,
        workers=evaluator.workers,
        ahead=list(ahead or []),
    )
    if strategy in PRECISIONS:
        search_fixed(context, strategy)
    elif strategy in SEARCHES:
        SEARCHES[strategy](context)
    else:
        raise ConfigError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")


def tune(
    config: TuneConfig | None = None,
    *,
    resume_dir: Path | None = None,
    strategy: str = "ppo",
    isolate: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """A whole tuning run, or the rest of an interrupted one.

    Args:
        config: The run's config (not needed with ``resume_dir``).
        resume_dir: A run directory to continue; its trials are reused, none is measured twice.
        strategy: One of ``STRATEGIES``: ``ppo`` (the agent), a search, or a precision (one uniform plan).
        isolate: Run trials in a child process.
        progress: Show a progress bar.

    Returns:
        The summary written to ``summary.json``.
    """
    if resume_dir is not None:
        run, config = RunDir.open(resume_dir)
    elif config is None:
        raise ConfigError("tune() needs a config, or resume_dir to continue a run")
    started = time.time()
    # Model, backend, search space and data are checked before the run directory exists: a run that cannot start
    # leaves nothing behind that a resume would trust.
    model, space = analyze(config)
    check_data(config, model)
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
    if strategy in PRECISIONS and strategy != "fp32" and space.uniform(strategy) == space.uniform("fp32"):
        raise ConfigError(f"strategy {strategy}: the {config.backend.name} backend offers no {strategy} layer here")
    if config.confirm.references:
        offered = references(config)
        unknown = sorted(set(config.confirm.references) - set(offered))
        if unknown:
            raise ConfigError(
                f"confirm.references: {unknown} not offered by the {config.backend.name} backend; "
                f"it offers {list(offered)}"
            )
    key = comparability_key(config, model)
    if resume_dir is None:
        check_comparable(config.from_runs, key)
        run = RunDir.create(config)
    with TrialStore(run.store) as store:
        if resume_dir is not None:
            check_resumable(store, key, resume_dir)
            strategy = str(store.get_meta("strategy", strategy))
        else:
            store.set_meta("strategy", strategy)
            store.set_meta(KEY_META, key)
            store.set_meta("imported_from", import_runs(store, config.from_runs, key))
        wall_before = float(store.get_meta("wall_s", 0.0))
        monitor = RunMonitor(config, run.tensorboard, builds_done=store.builds(), progress=progress)
        monitor.seed(list(store.trials()))
        try:
            with Evaluator(config, store, isolate=isolate) as evaluator:

                def evaluate(plan: Plan) -> TrialResult:
                    result = evaluator.evaluate(plan)
                    monitor.record(result)
                    store.set_meta("cache_hits", int(store.get_meta("cache_hits", 0)) + int(result.from_store))
                    return result

                def evaluate_many(plans: list[Plan], limit: int | None = None) -> Iterator[TrialResult]:
                    for result in evaluator.evaluate_many(plans, limit):
                        monitor.record(result)
                        hits = int(store.get_meta("cache_hits", 0)) + int(result.from_store)
                        store.set_meta("cache_hits", hits)
                        yield result

                fp32 = space.uniform("fp32")
                search_check = check_search_timing(evaluator, store, fp32)
                searched = with_measured_noise(config, search_check)
                try:
                    fixed = search_with_seeds(
                        searched, space, evaluate, evaluator, run, strategy, resume_dir is not None, evaluate_many
                    )
                    store.set_meta("free_knobs", fixed)
                except KeyboardInterrupt:  # keep the time spent, so a resumed run reports the sum of its parts
                    store.set_meta("wall_s", wall_before + time.time() - started)
                    raise
                store.set_meta("wall_s", wall_before + time.time() - started)
                store.set_meta("fp32_plan_hash", fp32.hash)
                shares = {layer.name: layer.runtime_share for layer in space.layers if layer.runtime_share is not None}
                one_liners = one_liner_plans(evaluator, space.layer_names)
                rounds = confirmation_rounds(config, search_check)
                confirm_finalists(evaluator, store, config, fp32, one_liners, shares, rounds)
                # Ranked over every confirmation in the store: an earlier run's (imported with --from, or
                # confirmed before a resume) can outrank this run's finalists.
                summary = export_ranked(run, config, evaluator, store)
                winner = store.confirmations()[summary["plan_hash"]].plan
                monitor.text("winner", _winner_markdown(summary, space, winner))
        finally:
            monitor.close()
    write_json(run.summary, summary)
    return summary


def _winner_markdown(summary: dict[str, Any], space: SearchSpace, winner: Plan) -> str:
    lines = ["| layer | op | precision |", "|---|---|---|"]
    precisions = winner.precision_map
    lines += [f"| {layer.name} | {layer.op_type} | {precisions.get(layer.name)} |" for layer in space.layers]
    head = (
        f"winner: {summary['winner']['speedup']:.2f}x, drop {summary['winner']['accuracy_drop']:.4g} "
        f"on held-out data; knobs: {winner.knob_map}"
    )
    return head + "\n\n" + "\n".join(lines)
