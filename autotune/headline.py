"""A run's closing comparison: the winner against the fastest engine a user deploys without autotune.

The alternatives are FP32 and every one-liner the run timed, within the accuracy budget: a one-liner slower than
FP32 is no engine anyone deploys, so the winner is never set against it alone. Each timing the backend has (one
launch at a time; back to back) is compared apart, since the fastest alternative may differ between them. Where no
engine within the budget beats FP32, the headline says so and names the fastest one-liner over the budget with its
drop: the engine a user would otherwise try first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.run.trial import BACK_TO_BACK, ONE_LAUNCH, TrialResult, ratio
from autotune.search.reward import meets_budget

FP32 = "fp32"
"""The name FP32 goes by among the alternatives."""

_SUFFIX = {ONE_LAUNCH: "", BACK_TO_BACK: "_back_to_back"}


def _timed(result: TrialResult, timing: str) -> bool:
    return bool(result.speedup) if timing == ONE_LAUNCH else bool(result.back_to_back_ms)


def _fastest(results: Mapping[str, TrialResult], timing: str, baseline: TrialResult) -> str | None:
    """The name of the fastest of ``results`` in ``timing`` (compared through ``baseline``), or None."""
    timed = {name: r for name, r in results.items() if _timed(r, timing)}
    return max(timed, key=lambda name: ratio(baseline, timed[name], timing) or 0.0, default=None)


def _compare(
    winner: TrialResult, fp32: TrialResult, within: Mapping[str, TrialResult], winner_is_fp32: bool, timing: str
) -> dict[str, Any] | None:
    """One timing's comparison, or None where the winner or FP32 lacks that timing."""
    if not _timed(winner, timing) or not _timed(fp32, timing):
        return None
    alternatives = {FP32: fp32, **within}
    best = _fastest(alternatives, timing, fp32) or FP32
    engines = {**within, **({} if winner_is_fp32 else {"winner": winner})}
    fastest = _fastest(engines, timing, fp32)
    beaten = fastest is not None and (ratio(fp32, engines[fastest], timing) or 0.0) > 1.0
    return {"best": best, "ratio": ratio(alternatives[best], winner, timing), "fp32_beaten": beaten}


def headline_fields(
    winner: TrialResult,
    fp32: TrialResult | None,
    references: Mapping[str, TrialResult],
    accuracy_budget: float,
) -> dict[str, Any]:
    """The summary's fields that compare the winner with what a user deploys without autotune.

    Args:
        winner: The exported plan's confirmation.
        fp32: FP32's confirmation in the same rounds; None: FP32 as the winner's reference timing (speedup 1).
        references: The one-liners timed beside them, by name.
        accuracy_budget: The run's accuracy budget (a one-liner over it is no alternative).

    Returns:
        ``best_alternative`` (the fastest engine within the budget without autotune, one launch at a time: ``fp32``
        or a one-liner), ``winner_over_best_alternative`` (how many times faster the winner runs than it),
        ``fp32_beaten`` (some engine within the budget, the winner or a one-liner, runs faster than FP32); the same
        three with ``_back_to_back`` for the backend's back-to-back timer (None where it has none);
        ``fastest_over_budget`` (the fastest one-liner over the budget: name, speedup over FP32, drop and
        per-launch ms back to back; None where none is over it).
    """
    winner_is_fp32 = fp32 is not None and winner.plan_hash == fp32.plan_hash
    if fp32 is None:
        fp32 = TrialResult(
            plan=winner.plan, speedup=1.0, accuracy_drop=0.0, back_to_back_ms=winner.reference_back_to_back_ms
        )
    ok = {name: r for name, r in references.items() if r.ok and r.speedup}
    within = {name: r for name, r in ok.items() if meets_budget(r, accuracy_budget)}
    fields: dict[str, Any] = {}
    for timing, suffix in _SUFFIX.items():
        compared = _compare(winner, fp32, within, winner_is_fp32, timing) or {}
        fields[f"best_alternative{suffix}"] = compared.get("best")
        fields[f"winner_over_best_alternative{suffix}"] = compared.get("ratio")
        fields[f"fp32_beaten{suffix}"] = compared.get("fp32_beaten")
    over = {name: r for name, r in ok.items() if name not in within}
    name = max(over, key=lambda n: over[n].speedup or 0.0, default=None)
    fields["fastest_over_budget"] = (
        None
        if name is None
        else {
            "name": name,
            "speedup": over[name].speedup,
            "accuracy_drop": over[name].accuracy_drop,
            "back_to_back_ms": over[name].back_to_back_ms,
        }
    )
    return fields


def _drop(value: float | None) -> str:
    return "unknown" if value is None else format(value, ".4g")


def headline_lines(summary: Mapping[str, Any]) -> list[str]:
    """The run's closing lines from a summary's headline fields (``headline_fields``); [] where it has none.

    One line for the timings in which the winner is set against the fastest alternative within the budget, one
    for those in which no engine within the budget beats FP32, with the fastest one-liner over the budget after it.
    """
    beaten, not_beaten = [], []
    for timing, suffix in _SUFFIX.items():
        best, value = summary.get(f"best_alternative{suffix}"), summary.get(f"winner_over_best_alternative{suffix}")
        if best is None or value is None:
            continue
        if summary.get(f"fp32_beaten{suffix}"):
            beaten.append(f"{value:.2f}x {timing} ({best})")
        else:
            not_beaten.append(timing)
    caveat = "; the timing note below applies" if summary.get("timing_note") else ""
    lines = []
    if beaten:
        lines.append(f"winner against the fastest engine within the budget without autotune: {', '.join(beaten)}")
    if not_beaten:
        lines.append(f"no engine within the budget beats FP32 here ({', '.join(not_beaten)})")
        over = summary.get("fastest_over_budget")
        if over:
            lines.append(
                f"the fastest one-liner, {over['name']}, runs {over['speedup']:.2f}x FP32 one launch at a time with "
                f"a drop of {_drop(over.get('accuracy_drop'))}, over the budget ({summary.get('accuracy_budget')})"
            )
    if lines:
        lines[0] += caveat
    return lines
