"""A run checks its own timing: FP32 against FP32 at the start of the search and in the confirmation.

A protocol that is true reads 1 for a plan against itself. Whatever makes it read otherwise (another session's
threads on the cores, a slow spell of the machine, a place in the round) makes every other ratio of the run that
much less certain, so the run stores the figure, says so in one line when it leaves ``SELF_CHECK_BAND``, times its
confirmation in more rounds, and treats speedups closer than the measured noise as ties.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from autotune.config.schema import ConfirmConfig, RewardConfig
from autotune.harness.deadline import MIN_CONFIRM_ROUNDS
from autotune.harness.evaluator import Evaluator
from autotune.measure.confidence import SELF_CHECK_BAND, SelfCheck
from autotune.measure.interference import Busy
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult

REFERENCES_META = "references_first"
"""Run metadata: the one-liners measured beside the search's self-check, name to ``{ok, speedup, accuracy_drop}``
or ``{ok: False, error}`` (``check_search_timing``)."""
SELF_CHECK_META = "self_check"
"""Run metadata: ``{"search": SelfCheck dict, "confirmation": SelfCheck dict, "widened_rounds": int | None}``."""

WIDENING = 2
"""How many times ``confirm.rounds`` a confirmation times when a self-check left the band."""
RESOLUTION = 0.01
"""The relative difference the confirmation's median ratio should resolve (``confirmation_rounds``)."""
NORMAL_IQR_SIGMA = 1 / 1.349
"""A normal scatter's standard deviation per unit of its interquartile range."""
MEDIAN_EFFICIENCY = 1.2533
"""The median of ``n`` normal draws scatters by this many times ``sigma / sqrt(n)``."""


def stored_checks(store: TrialStore) -> dict[str, Any]:
    """The run's self-checks as stored (empty before the first)."""
    return dict(store.get_meta(SELF_CHECK_META, {}) or {})


def _store(store: TrialStore, **fields: Any) -> dict[str, Any]:
    checks = {**stored_checks(store), **fields}
    store.set_meta(SELF_CHECK_META, checks)
    return checks


def note(check: SelfCheck, where: str, consequence: str) -> str:
    """The one line a run prints when a self-check leaves the band."""
    return f"timing self-check ({where}): {check.describe()}; {consequence}"


def say(line: str) -> None:
    """Prints one ``autotune: note:`` line on stderr: what a run tells its user while it goes on."""
    print(f"autotune: note: {line}", file=sys.stderr)


def check_search_timing(
    evaluator: Evaluator, store: TrialStore, fp32: Plan, beside: Sequence[Plan] = ()
) -> SelfCheck | None:
    """FP32 timed against the FP32 reference before the search, the one-liners ``beside`` it; once per run.

    The one-liners are the user's fixed alternatives: timed in the same rounds at the start, the bar the search must
    clear is known before it starts (``bar_order``, ``bar_line``), and the confirmation, cut to its time, keeps the
    fastest within the budget. The measurement is no build of the search (it is not stored as a trial). A resumed
    run reuses the stored one.

    Returns:
        The self-check, or None when FP32 could not be measured or ``confirm.self_check`` is off (the search then
        has no noise figure).
    """
    checking = evaluator.config.confirm.self_check
    stored = stored_checks(store).get("search")
    if stored or store.get_meta(REFERENCES_META) is not None:
        return SelfCheck.from_dict(stored) if stored and checking else None
    plans = [fp32] * checking + list(beside)
    if not plans:
        return None
    results = evaluator.measure_side_by_side(plans, "evaluation")
    store.set_meta(
        REFERENCES_META, {p.reference: _bar_row(r) for p, r in zip(plans, results, strict=True) if p.reference}
    )
    result = results[0]
    if not checking or not result.ok or not result.speedup:
        return None
    check = SelfCheck.of(result.speedup, result.round_speedups)
    _store(store, search=check.to_dict())
    if not check.within_band:
        rounds = WIDENING * evaluator.config.confirm.rounds
        consequence = f"ratios closer than {check.noise:.1%} are ties; the confirmation times up to {rounds} rounds"
        say(note(check, "search", consequence))
    return check


def _bar_row(result: TrialResult) -> dict[str, Any]:
    """A one-liner as measured before the search: its speedup and drop, or its error."""
    if not result.ok:
        return {"ok": False, "error": result.error}
    return {"ok": True, "speedup": result.speedup, "accuracy_drop": result.accuracy_drop}


def measured_bar(store: TrialStore) -> dict[str, dict[str, Any]]:
    """The one-liners measured before the search, name to row (empty where none was)."""
    return dict(store.get_meta(REFERENCES_META, {}) or {})


def bar_order(one_liners: Sequence[Plan], bar: dict[str, dict[str, Any]], budget: float) -> list[Plan]:
    """The one-liners, the fastest within the budget first, then the rest by speed, then those not measured.

    A confirmation cut to its time keeps the first ones (``RunDeadline.size_confirmation``).
    """

    def key(plan: Plan) -> tuple[int, float]:
        row = bar.get(plan.reference or "")
        if not row or not row.get("ok"):
            return (2, 0.0)
        return (0 if row["accuracy_drop"] <= budget else 1, -float(row["speedup"] or 0.0))

    return sorted(one_liners, key=key)


def bar_line(bar: dict[str, dict[str, Any]], budget: float) -> str | None:
    """One line before the search: the fastest engine within the budget without autotune, and the one-liners over it."""
    measured = {name: row for name, row in bar.items() if row.get("ok") and row.get("speedup")}
    if not bar:
        return None
    within = {name: row for name, row in measured.items() if row["accuracy_drop"] <= budget}
    best = max(within, key=lambda name: within[name]["speedup"], default=None)
    head = (
        f"the bar before the search: {best} {within[best]['speedup']:.2f}x FP32 within the budget"
        if best is not None and within[best]["speedup"] > 1.0
        else "the bar before the search: FP32 (no one-liner within the budget runs faster)"
    )
    others = [
        f"{name} {row['speedup']:.2f}x at drop {row['accuracy_drop']:.3g}{'' if name in within else ' (over)'}"
        for name, row in sorted(measured.items(), key=lambda item: -item[1]["speedup"])
        if name != best
    ]
    failed = [f"{name} failed" for name, row in bar.items() if name not in measured]
    return "; ".join([head, *others, *failed])


def with_measured_noise(reward: RewardConfig, check: SelfCheck | None) -> RewardConfig:
    """The ``reward`` section with ``tie_within`` set to the measured noise where the user left it unset."""
    if check is None or reward.tie_within is not None:
        return reward
    return reward.model_copy(update={"tie_within": check.noise})


def confirmation_rounds(confirm: ConfirmConfig, check: SelfCheck | None) -> int | None:
    """Rounds for the confirmation, sized from the search's self-check; None without one (``confirm.rounds``).

    Enough rounds for the median of their ratios to resolve ``RESOLUTION`` at the noise FP32 against itself read
    (its rounds' spread, taken as a normal scatter): between ``MIN_CONFIRM_ROUNDS`` and ``confirm.rounds``, or
    between ``confirm.rounds`` and ``WIDENING`` times that where the check left its band. A quiet machine confirms
    in few rounds; a noisy one in more, instead of a fixed count timed again and again.
    """
    if check is None:
        return None
    sigma = NORMAL_IQR_SIGMA * 2.0 * check.spread  # the spread is half the rounds' interquartile range
    needed = math.ceil((MEDIAN_EFFICIENCY * sigma / RESOLUTION) ** 2)
    if not check.within_band:  # a bias, not only a scatter: at least the configured rounds
        return max(confirm.rounds, min(WIDENING * confirm.rounds, needed))
    return max(min(MIN_CONFIRM_ROUNDS, confirm.rounds), min(confirm.rounds, needed))


def check_confirmation_timing(
    evaluator: Evaluator,
    store: TrialStore,
    confirm: ConfirmConfig,
    confirmed: list[TrialResult],
    fp32: Plan,
    one_liners: list[Plan],
    rounds: int | None,
    may_widen: bool = True,
) -> list[TrialResult]:
    """Reads the confirmation's FP32 row as its self-check, and confirms everything once more where it must.

    Outside the band, or where the machine was too busy to measure a row (``TrialResult.too_busy``), the finalists
    are confirmed again in wider rounds, and the run says so in one line; where the run's time allows no second
    confirmation (``may_widen`` False), the check is recorded and said, and the ratios within its noise are ties.

    Args:
        evaluator: The run's evaluator.
        store: The run's store (the check goes into its metadata, a repeated confirmation replaces the first).
        confirm: The run's ``confirm`` section.
        confirmed: The confirmations of the finalists and FP32.
        fp32: The FP32 plan.
        one_liners: The backend's one-liners confirmed beside them.
        rounds: The rounds the confirmation was timed in (None: ``confirm.rounds``).
        may_widen: The run has time for a second, wider confirmation (``RunDeadline.size_confirmation``).

    Returns:
        The confirmations to rank, in the order given.
    """
    row = next((r for r in confirmed if r.plan_hash == fp32.hash), None)
    # Checked before a resume: the stored rows are the checked ones.
    if not confirm.self_check or stored_checks(store).get("confirmation"):
        return confirmed
    if row is None or not row.ok or not row.speedup:
        return confirmed
    check = SelfCheck.of(row.speedup, row.round_speedups)
    used = rounds or confirm.rounds
    too_busy = busy_note(confirmed)
    if (check.within_band and not too_busy) or used >= WIDENING * confirm.rounds or not may_widen:
        _store(store, confirmation=check.to_dict(), widened_rounds=rounds)
        if not check.within_band:
            say(note(check, "confirmation", f"finalists closer than {check.noise:.1%} are ties"))
        if too_busy:
            say(f"confirmation: {too_busy}")
        return confirmed
    wider = WIDENING * confirm.rounds
    if too_busy:
        say(f"confirmation: {too_busy}; the finalists are confirmed again in {wider} rounds")
    else:
        say(note(check, "confirmation", f"the finalists are confirmed again in {wider} rounds"))
    results = evaluator.confirm_side_by_side([*(r.plan for r in confirmed), *one_liners], rounds=wider)
    again = next((r for r in results if r.plan_hash == fp32.hash), None)
    if again is not None and again.ok and again.speedup:
        check = SelfCheck.of(again.speedup, again.round_speedups)
        if not check.within_band:
            say(note(check, "confirmation, widened", f"finalists closer than {check.noise:.1%} are ties"))
    if busy_note(results):
        say(f"confirmation, widened: {busy_note(results)}")
    _store(store, confirmation=check.to_dict(), widened_rounds=wider)
    return results[: len(confirmed)]


def busy_note(results: list[TrialResult]) -> str | None:
    """One line when the machine was too busy for any of these results' ratios to be trusted, else None.

    Results timed side by side share one measurement and so one ``Busy``: each measurement is counted once.
    """
    measurements = {Busy.from_dict(result.busy) for result in results if result.too_busy}
    busy = Busy.merged(sorted(measurements, key=lambda measured: measured.rounds))
    return None if busy is None else busy.describe()


def busy_counts(results: list[TrialResult]) -> dict[str, int]:
    """How many timed results other work got in the way of, and of how many the ratio cannot be trusted."""
    timed = [result for result in results if result.busy]
    return {
        "timed": len(timed),
        "shared": sum(result.shared for result in timed),
        "too_busy": sum(result.too_busy for result in timed),
    }


def confirmation_noise(store: TrialStore) -> float:
    """The noise of the run's confirmation self-check, 0 without one (ties only equal speedups)."""
    stored = stored_checks(store).get("confirmation")
    return SelfCheck.from_dict(stored).noise if stored else 0.0


def summary_fields(store: TrialStore) -> dict[str, Any]:
    """``self_check`` and ``timing_note`` for summary.json: the stored checks, and one line if one left the band."""
    checks = stored_checks(store)
    lines = []
    for where in ("search", "confirmation"):
        if checks.get(where) and not checks[where].get("within_band", True):
            lines.append(note(SelfCheck.from_dict(checks[where]), where, "ratios within its noise are ties"))
    confirmed = list(store.confirmations().values())
    busy = {"search": busy_counts(list(store.trials())), "confirmation": busy_counts(confirmed)}
    if busy["confirmation"]["too_busy"]:
        lines.append(
            f"no quiet rounds for {busy['confirmation']['too_busy']} of {busy['confirmation']['timed']} "
            "confirmations (the machine was busy, or its pace unsteady): their ratios are less certain"
        )
    elif busy["search"]["shared"] or busy["confirmation"]["shared"]:
        lines.append(
            f"the machine was shared: other work slowed {busy['search']['shared']} of {busy['search']['timed']} "
            f"trials and {busy['confirmation']['shared']} of {busy['confirmation']['timed']} confirmations "
            "(their rounds were timed again until quiet)"
        )
    low, high = SELF_CHECK_BAND
    return {
        "self_check": {**checks, "band": [low, high]} if checks else None,
        "busy": busy,
        "timing_note": "; ".join(lines) or None,
    }
