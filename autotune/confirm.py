"""Confirming a run's finalists and exporting the winner.

The finalists, FP32 and the one-liners are timed side by side on held-out data; the winner is exported with its
plan and a summary that ranks every confirmation and sets the one-liners beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.backends import searching_references
from autotune.config.schema import ConfigError, ConfirmConfig, FinalistRule
from autotune.harness import Evaluator
from autotune.harness.deadline import MIN_CONFIRM_ROUNDS, ConfirmationSize
from autotune.harness.identity import KEY_META
from autotune.harness.runner import SLOW_PLAN_FACTOR
from autotune.harness.sequential import scoring_counts
from autotune.headline import headline_fields, headline_lines
from autotune.measure.selfcheck import (
    check_confirmation_timing,
    confirmation_noise,
    say,
    summary_fields,
)
from autotune.plan import INT8_SCHEME_KNOB, KnobValue, Plan
from autotune.run.directory import RunDir
from autotune.run.files import write_json
from autotune.run.meta import RunMeta
from autotune.run.store import TrialStore
from autotune.run.trial import BACK_TO_BACK, ONE_LAUNCH, TrialResult, ratio
from autotune.search.estimate import ACCURACY_KNOBS, fit_surrogate
from autotune.search.reward import meets_budget
from autotune.search.select import confirmation_order, expected_speedups, profile_speedups, ranking


def confirm(
    evaluator: Evaluator, store: TrialStore, plans: list[Plan], rounds: int | None = None, stop_at: float | None = None
) -> list[TrialResult]:
    """Confirms each plan once per run (a resumed run reuses earlier confirmations); the new ones side by side.

    ``stop_at``: the wall time by which the timing stops (``Protocol.stop_at``), None: none.
    """
    done = {**store.confirmations(), **{r.plan_hash: r for r in store.references().values()}}
    fresh = [plan for plan in plans if plan.hash not in done]
    if fresh:
        done.update((r.plan_hash, r) for r in evaluator.confirm_side_by_side(fresh, rounds, stop_at))
    return [done[plan.hash] for plan in plans]


def finalist_order(
    trials: Sequence[TrialResult],
    rule: FinalistRule,
    fp32: Plan,
    runtime_shares: Mapping[str, float] | None = None,
    knob_defaults: Mapping[str, KnobValue] | None = None,
) -> tuple[list[Plan], dict[str, float]]:
    """A run's measured plans in the order they are confirmed (the first ``confirm.top_k`` are the finalists).

    Ranked by what the plans are expected to hold, not by one short measurement each: with the FP32 profile's
    runtime shares, by the additive model whose per-layer savings are the profile's (``PROFILE_WEIGHT``), alone;
    without them, by the mean of each plan's measurement and a model fitted from zero
    (:func:`autotune.search.select.expected_speedups`). FP32 is left out (it is confirmed as the reference).

    Args:
        trials: The run's trials.
        rule: The run's budgets, reward and places (``TuneConfig.finalists``).
        fp32: The FP32 reference's plan.
        runtime_shares: Layer name to its share of FP32 runtime (layers the profile did not time left out).
        knob_defaults: Each knob's default, which the model gives no term, as in the search; None: ``fp32``'s knobs
            (a backend that builds its reference at other values says so in ``fp32_reference_knobs``).

    Returns:
        The plans in order, and each measured plan's expected speedup by hash.
    """
    defaults = dict(fp32.knobs) if knob_defaults is None else dict(knob_defaults)
    expected = profile_speedups(trials, defaults, runtime_shares, tuple(fp32.precision_map)) if runtime_shares else None
    if expected is None:
        expected = expected_speedups(trials, fit_surrogate(trials, defaults, ACCURACY_KNOBS))
    order = [r.plan for r in confirmation_order(trials, rule, expected) if r.plan_hash != fp32.hash]
    return order, expected


def confirm_finalists(
    evaluator: Evaluator,
    rule: FinalistRule,
    confirm_config: ConfirmConfig,
    fp32: Plan,
    one_liners: Sequence[Plan] = (),
    runtime_shares: Mapping[str, float] | None = None,
    size: ConfirmationSize | None = None,
    knob_defaults: Mapping[str, KnobValue] | None = None,
) -> list[TrialResult]:
    """Confirms the best bets, FP32 and the backend's one-liners side by side, in the same rounds.

    The winner is the fastest finalist, so the finalists are timed together: machine drift between passes then
    falls on all of them alike instead of deciding which one wins; the one-liners are timed beside them by the
    same harness. While no finalist meets the budget on held-out data, and time is left for it, goes on down the
    list, up to as many more (each confirmed alone). A one-liner is stored apart from the finalists and never
    exported.

    Args:
        evaluator: The run's evaluator (and its store).
        rule: What orders the measured plans (``TuneConfig.finalists``), the accuracy budget among it.
        confirm_config: The ``confirm`` section.
        fp32: The FP32 reference's plan, confirmed beside the finalists.
        one_liners: The backend's one-liners to time beside them.
        runtime_shares: Layer name to its share of FP32 runtime (``finalist_order``).
        size: How many finalists and one-liners, in how many rounds (``RunDeadline.size_confirmation``); None:
            ``confirm.top_k`` finalists, every one-liner given, ``confirm.rounds``, with time for more.
        knob_defaults: Each knob's default (``finalist_order``).

    Returns:
        The finalists' and FP32's confirmations (not the one-liners').
    """
    store = evaluator.store
    order, _ = finalist_order(list(store.trials()), rule, fp32, runtime_shares, knob_defaults)
    size = size or ConfirmationSize(confirm_config.top_k, len(one_liners), confirm_config.rounds, spare=True)
    if size.finalists == 0:  # no time for any finalist: FP32 alone, the fewest rounds, is what gets exported
        return confirm(evaluator, store, [fp32], MIN_CONFIRM_ROUNDS)
    rounds = None if size.rounds == confirm_config.rounds else size.rounds
    finalists = [*order[: size.finalists], fp32]
    one_liners = list(one_liners)[: size.references]
    confirmed = confirm(evaluator, store, [*finalists, *one_liners], rounds, size.stop_at)[: len(finalists)]
    confirmed = check_confirmation_timing(
        evaluator, store, confirm_config, confirmed, fp32, one_liners, rounds, size.spare
    )
    for plan in order[size.finalists : 2 * size.finalists] if size.spare else ():
        if any(meets_budget(r, rule.accuracy_budget) for r in confirmed if r.plan_hash != fp32.hash):
            break
        confirmed += confirm(evaluator, store, [plan], rounds)
    for name, result in store.references().items():
        if (note := slow_timing_note(result)) is not None:
            say(f"{name}: {note}")
    return confirmed


def slow_timing_note(result: TrialResult) -> str | None:
    """One line for a plan timed in one round because it runs ``SLOW_PLAN_FACTOR`` times slower than FP32, else None."""
    if result.protocol.get("rounds") != 1 or not result.speedup or result.speedup * SLOW_PLAN_FACTOR > 1.0:
        return None
    return f"runs {1.0 / result.speedup:.1f}x slower than FP32: timed in one round, not ranked by its speed"


def one_liner_plans(evaluator: Evaluator, layers: list[str]) -> list[Plan]:
    """The reference plans of the backend's one-liners that ``confirm.references`` asks for (default all).

    By default a run bounded by ``budget.minutes`` leaves out the one-liners whose build is a search of its own
    (``Backend.searching_references``), saying so in one line: one of them took longer than the whole run.
    """
    config = evaluator.config
    wanted = config.confirm.references  # None: every one the backend offers
    names = [name for name in evaluator.references() if wanted is None or name in wanted]
    slow = [
        n for n in names if wanted is None and config.budget.minutes and n in searching_references(config.backend.name)
    ]
    if slow:
        say(
            f"budget.minutes is set: {', '.join(slow)} (a search of its own, minutes to build) is not timed beside "
            "the finalists; name it in confirm.references to time it"
        )
    return [Plan.reference_plan(layers, name) for name in names if name not in slow]


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
        name: {
            "plan_hash": r.plan.hash,
            "status": r.status,
            "error": r.error,
            "note": slow_timing_note(r),
            **_metrics(r),
        }
        for name, r in references.items()
    }
    within = [(name, r) for name, r in references.items() if meets_budget(r, accuracy_budget) and r.speedup]
    best = max(within, key=lambda item: item[1].speedup, default=None)
    note = None
    one_launch = None
    if best is not None:
        name, result = best
        one_launch = ratio(result, winner, ONE_LAUNCH) or 0.0
        if result.speedup > (winner.speedup or 0.0):
            note = (
                f"the one-liner {name} beats the winner within the accuracy budget ({result.speedup:.2f}x against "
                f"{winner.speedup or 0.0:.2f}x over FP32, held-out data); the winner is exported as ranked: "
                f"compare them with `autotune evaluate CONFIG --plan {name}`"
            )
    # Back to back the fastest one-liner within the budget may be another than one launch at a time.
    back_to_back = [ratio(r, winner, BACK_TO_BACK) for _, r in within]
    back_to_back = [value for value in back_to_back if value is not None]
    return {
        "references": rows,
        "best_reference": best[0] if best else None,
        "winner_over_best_reference": one_launch,
        "winner_over_best_reference_back_to_back": min(back_to_back, default=None),
        "reference_note": note,
    }


def export_ranked(
    run: RunDir,
    evaluator: Evaluator,
    accuracy_budget: float,
    metric: str,
    rank: int = 1,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Writes the plan of a given confirmation rank: deployable model, ``plan.json`` and ``summary.json``.

    The summary's ``ranking`` lists every confirmed plan of the evaluator's store, best first, by ``accuracy_budget``;
    ``metric`` names the metric the drops are in.

    Raises:
        ConfigError: No confirmed plan has that rank.
    """
    store = evaluator.store
    confirmed = ranking(list(store.confirmations().values()), accuracy_budget, confirmation_noise(store))
    within = [r for r in confirmed if meets_budget(r, accuracy_budget)]
    if not 1 <= rank <= len(within):
        raise ConfigError(f"rank {rank} does not exist: {len(within)} confirmed plans meet the accuracy budget")
    chosen = within[rank - 1]
    out_dir = out_dir or run.best
    files = evaluator.export(chosen.plan, out_dir)
    write_json(out_dir / "plan.json", chosen.plan.to_dict())
    meta = RunMeta.read(store)
    reference = store.confirmations().get(str(meta.fp32_plan_hash or ""))
    summary = {
        "rank": rank,
        "plan_hash": chosen.plan.hash,
        "plan": chosen.plan.describe(),
        "files": files,
        "winner": _metrics(chosen),
        "fp32_reference": _metrics(reference) if reference else None,
        **reference_rows(store, chosen, accuracy_budget),
        **headline_fields(chosen, reference, store.references(), accuracy_budget),
        "accuracy_budget": accuracy_budget,
        "metric": metric,
        "builds": store.builds(),
        "imported_trials": len(store.imported()),
        "cache_hits": int(meta.cache_hits),
        "scoring": scoring_counts(list(store.trials())),  # the sequential early stop's share (metric.early_stop_alpha)
        "free_knobs": meta.free_knobs,
        "wall_s": float(meta.wall_s),
        "setup_s": meta.setup_s,
        "setup_stages_s": meta.setup_stages_s,
        "machine": (store.get_meta(KEY_META, {}) or {}).get("machine"),
        "int8_arithmetic": _int8_arithmetic(evaluator, chosen.plan),
        "ranking": [{"plan_hash": r.plan.hash, "plan": r.plan.describe(), **_metrics(r)} for r in confirmed],
        **summary_fields(store),
    }
    summary["headline"] = headline_lines(summary)  # the run's closing lines, printed by the CLI and the report
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
        # A one-liner's build is the plain compile of the users' module, beside which a trial build's cost reads
        "build_s": result.build_s,
        "build_stages_s": result.build_stages_s,
    }


def _int8_arithmetic(evaluator: Evaluator, winner: Plan) -> dict[str, Any] | None:
    """The backend's INT8 scheme and probe (``Evaluator.int8_arithmetic``), and the scheme the winner was built with.

    Where a config searches ``int8_scheme`` the winner may run another exact scheme than the default.
    """
    arithmetic = evaluator.int8_arithmetic()
    if arithmetic is None:
        return None
    return {**arithmetic, "winner_scheme": winner.knob(INT8_SCHEME_KNOB, arithmetic["scheme"])}
