"""A run checks its own timing: FP32 against FP32 at the start of the search and in the confirmation.

A protocol that is true reads 1 for a plan against itself. Whatever makes it read otherwise (another session's
threads on the cores, a slow spell of the machine, a place in the round) makes every other ratio of the run that
much less certain, so the run stores the figure, says so in one line when it leaves ``SELF_CHECK_BAND``, times its
confirmation in more rounds, and treats speedups closer than the measured noise as ties.
"""

from __future__ import annotations

import sys
from typing import Any

from autotune.config import ConfirmConfig, TuneConfig
from autotune.harness.evaluator import Evaluator
from autotune.interference import Busy
from autotune.noise import SELF_CHECK_BAND, SelfCheck
from autotune.plan import Plan
from autotune.store import TrialStore
from autotune.trial import TrialResult

SELF_CHECK_META = "self_check"
"""Run metadata: ``{"search": SelfCheck dict, "confirmation": SelfCheck dict, "widened_rounds": int | None}``."""

WIDENING = 2
"""How many times ``confirm.rounds`` a confirmation times when a self-check left the band."""


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


def check_search_timing(evaluator: Evaluator, store: TrialStore, fp32: Plan) -> SelfCheck | None:
    """FP32 timed against the FP32 reference before the search, by the search's protocol; once per run.

    The measurement is no build of the search (it is not stored as a trial). A resumed run reuses the stored one.

    Returns:
        The self-check, or None when FP32 could not be measured (the search then has no noise figure).
    """
    if not evaluator.config.confirm.self_check:
        return None
    stored = stored_checks(store).get("search")
    if stored:
        return SelfCheck.from_dict(stored)
    result = evaluator.measure(fp32, "evaluation")
    if not result.ok or not result.speedup:
        return None
    check = SelfCheck.of(result.speedup, result.round_speedups)
    _store(store, search=check.to_dict())
    if not check.within_band:
        rounds = WIDENING * evaluator.config.confirm.rounds
        consequence = f"ratios closer than {check.noise:.1%} are ties; the confirmation times {rounds} rounds"
        say(note(check, "search", consequence))
    return check


def with_measured_noise(config: TuneConfig, check: SelfCheck | None) -> TuneConfig:
    """The config with ``reward.tie_within`` set to the measured noise where the user left it unset."""
    if check is None or config.reward.tie_within is not None:
        return config
    reward = config.reward.model_copy(update={"tie_within": check.noise})
    return config.model_copy(update={"reward": reward})


def confirmation_rounds(confirm: ConfirmConfig, check: SelfCheck | None) -> int | None:
    """Rounds for the confirmation: widened when the search's self-check left the band, else None (the config's)."""
    if check is None or check.within_band:
        return None
    return WIDENING * confirm.rounds


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
