"""Tests for autotune.measure.selfcheck: the run's FP32-against-FP32 checks, with a scripted evaluator."""

from __future__ import annotations

import pytest

from autotune.harness.deadline import MIN_CONFIRM_ROUNDS
from autotune.measure.selfcheck import (
    WIDENING,
    bar_line,
    bar_order,
    check_confirmation_timing,
    check_search_timing,
    confirmation_noise,
    confirmation_rounds,
    measured_bar,
    stored_checks,
    summary_fields,
    with_measured_noise,
)
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.testing import tiny_config

FP32 = Plan.make({"fc1": "fp32", "fc2": "fp32"})
INT8 = Plan.make({"fc1": "int8", "fc2": "fp32"})
ONE_LINERS = {"ort-static": (1.14, 0.37), "ort-dynamic": (1.48, 0.0225), "quick": (1.2, 0.001)}
"""Scripted one-liners: name to (speedup, drop)."""


def _result(plan: Plan, rounds: list[float], drop: float = 0.0) -> TrialResult:
    ordered = sorted(rounds)
    return TrialResult(plan=plan, speedup=ordered[len(ordered) // 2], round_speedups=rounds, accuracy_drop=drop)


class ScriptedEvaluator:
    """Answers ``measure`` and ``confirm_side_by_side`` with scripted per-round speedups, and logs the calls."""

    def __init__(self, config, fp32_rounds: list[list[float]]):
        self.config = config
        self.fp32_rounds = list(fp32_rounds)
        self.calls: list[tuple[str, int | None]] = []

    def measure(self, plan, split="evaluation", protocol=None):
        self.calls.append(("measure", None))
        return _result(plan, self.fp32_rounds.pop(0))

    def measure_side_by_side(self, plans, split="evaluation", protocol=None):
        """FP32's scripted rounds; a one-liner named in ``ONE_LINERS`` its (speedup, drop), or a failure."""
        self.calls.append(("measure", None))
        fp32 = self.fp32_rounds.pop(0) if FP32 in plans else [1.0]
        results = []
        for plan in plans:
            if plan.reference is None:
                results.append(_result(plan, fp32))
            elif plan.reference in ONE_LINERS:
                speedup, drop = ONE_LINERS[plan.reference]
                results.append(_result(plan, [speedup] * len(fp32), drop))
            else:
                results.append(TrialResult.failure(plan, "BuildError: no such thing"))
        return results

    def confirm_side_by_side(self, plans, rounds=None, stop_at=None):
        self.calls.append(("confirm", rounds))
        fp32 = self.fp32_rounds.pop(0)
        return [_result(p, fp32) if p == FP32 else _result(p, [1.5] * len(fp32), 0.001) for p in plans]


@pytest.fixture()
def config(tmp_path):
    return tiny_config(tmp_path, confirm={"top_k": 2, "repeats": 3, "rounds": 4, "self_check": True})


def test_a_true_search_check_is_stored_once_and_sets_the_reward_s_tie_noise(tmp_path, config, capsys):
    evaluator = ScriptedEvaluator(config, [[0.99, 1.01]])
    with TrialStore(tmp_path / "trials.sqlite") as store:
        check = check_search_timing(evaluator, store, FP32)
        assert check.within_band and check.noise == pytest.approx(0.01)
        assert check_search_timing(evaluator, store, FP32) == check  # a resumed run reuses it
        assert evaluator.calls == [("measure", None)]
        assert stored_checks(store)["search"]["ratio"] == pytest.approx(check.ratio)
    assert confirmation_rounds(config.confirm, check) == MIN_CONFIRM_ROUNDS  # a quiet machine: the fewest rounds
    assert with_measured_noise(config.reward, check).tie_within == pytest.approx(0.01)
    assert capsys.readouterr().err == ""


def test_a_search_check_outside_the_band_says_so_in_one_line_and_widens_the_confirmation(tmp_path, config, capsys):
    evaluator = ScriptedEvaluator(config, [[0.69, 0.72]])
    with TrialStore(tmp_path / "trials.sqlite") as store:
        check = check_search_timing(evaluator, store, FP32)
    assert not check.within_band
    assert confirmation_rounds(config.confirm, check) == 4  # a bias: the configured rounds at least
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "outside [0.97, 1.03]" in lines[0] and f"{WIDENING * 4} rounds" in lines[0]


def test_a_tie_noise_the_user_set_is_kept(tmp_path):
    config = tiny_config(tmp_path, reward={"tie_within": 0.0})
    check = check_search_timing(ScriptedEvaluator(config, [[0.9, 1.1]]), TrialStore(tmp_path / "t.sqlite"), FP32)
    assert with_measured_noise(config.reward, check).tie_within == 0.0


def test_no_check_when_the_config_turns_it_off(tmp_path):
    config = tiny_config(tmp_path)  # the tiny runs keep it off
    evaluator = ScriptedEvaluator(config, [])
    with TrialStore(tmp_path / "trials.sqlite") as store:
        assert check_search_timing(evaluator, store, FP32) is None
        confirmed = [_result(FP32, [0.5])]
        assert check_confirmation_timing(evaluator, store, config.confirm, confirmed, FP32, [], None) == confirmed
        assert stored_checks(store) == {}
    assert evaluator.calls == []


def test_a_confirmation_whose_fp32_row_leaves_the_band_is_confirmed_again_in_wider_rounds(tmp_path, config, capsys):
    evaluator = ScriptedEvaluator(config, [[1.0] * 8])  # the second confirmation reads true
    reference = Plan.reference_plan(["fc1", "fc2"], "ort-static")
    first = [_result(INT8, [1.2] * 4), _result(FP32, [0.9, 0.93, 1.2, 1.25])]
    with TrialStore(tmp_path / "trials.sqlite") as store:
        again = check_confirmation_timing(evaluator, store, config.confirm, first, FP32, [reference], None)
        assert evaluator.calls == [("confirm", WIDENING * 4)]
        assert [r.plan for r in again] == [INT8, FP32]  # the one-liner's row is not a finalist's
        checks = stored_checks(store)
        assert checks["confirmation"]["within_band"] and checks["widened_rounds"] == WIDENING * 4
        assert confirmation_noise(store) == pytest.approx(0.0)
        # a resumed run does not check (or confirm) again
        assert check_confirmation_timing(evaluator, store, config.confirm, again, FP32, [reference], None) == again
        assert len(evaluator.calls) == 1
    assert "confirmed again in 8 rounds" in capsys.readouterr().err


def test_a_confirmation_already_widened_is_not_repeated_and_its_noise_is_kept_for_the_ranking(tmp_path, config):
    evaluator = ScriptedEvaluator(config, [])
    confirmed = [_result(INT8, [1.2] * 8), _result(FP32, [0.9, 0.92, 0.95, 1.1])]
    with TrialStore(tmp_path / "trials.sqlite") as store:
        kept = check_confirmation_timing(evaluator, store, config.confirm, confirmed, FP32, [], WIDENING * 4)
        assert kept == confirmed and evaluator.calls == []
        assert confirmation_noise(store) == pytest.approx(0.05)  # 0.95 from 1, more than half the IQR
        fields = summary_fields(store)
    assert fields["self_check"]["confirmation"]["rounds"] == 4 and fields["self_check"]["band"] == [0.97, 1.03]
    assert "outside [0.97, 1.03]" in fields["timing_note"]


def test_the_summary_has_no_note_when_every_check_was_true(tmp_path, config):
    evaluator = ScriptedEvaluator(config, [[1.0, 1.01]])
    with TrialStore(tmp_path / "trials.sqlite") as store:
        check_search_timing(evaluator, store, FP32)
        check_confirmation_timing(evaluator, store, config.confirm, [_result(FP32, [1.0, 1.0])], FP32, [], None)
        fields = summary_fields(store)
    assert fields["timing_note"] is None and set(fields["self_check"]) >= {"search", "confirmation"}


BUSY = {"rounds": 40, "counted": 4, "contended": 40, "others": 0.5, "waited": 0.9, "cpus": "0-1", "quiet": False}


def test_a_confirmation_the_machine_kept_too_busy_is_confirmed_again_and_said_once(tmp_path, config, capsys):
    import dataclasses

    evaluator = ScriptedEvaluator(config, [[1.0] * 8])
    first = [dataclasses.replace(r, busy=BUSY) for r in (_result(INT8, [1.2] * 4), _result(FP32, [1.0] * 4))]
    with TrialStore(tmp_path / "trials.sqlite") as store:
        again = check_confirmation_timing(evaluator, store, config.confirm, first, FP32, [], None)
    assert evaluator.calls == [("confirm", WIDENING * 4)]  # FP32 read true: only the busy machine asked for it
    assert not any(result.too_busy for result in again)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "too busy to measure" in lines[0] and "confirmed again in 8 rounds" in lines[0]
    assert "in 40 of 40 rounds" in lines[0]  # the two rows' one measurement, counted once


def test_the_summary_counts_the_trials_and_confirmations_other_work_got_in_the_way_of(tmp_path, config):
    import dataclasses

    shared = {**BUSY, "quiet": True, "contended": 3}
    with TrialStore(tmp_path / "trials.sqlite") as store:
        store.put(dataclasses.replace(_result(INT8, [1.2]), busy=shared))
        store.put(_result(FP32, [1.0]))
        store.put_confirmation(dataclasses.replace(_result(FP32, [1.0]), busy={**shared, "contended": 0}))
        fields = summary_fields(store)
        assert fields["busy"] == {
            "search": {"timed": 1, "shared": 1, "too_busy": 0},
            "confirmation": {"timed": 1, "shared": 0, "too_busy": 0},
        }
        assert "the machine was shared: other work slowed 1 of 1 trials" in fields["timing_note"]
        store.put_confirmation(dataclasses.replace(_result(INT8, [1.2]), busy=BUSY))
        assert "no quiet rounds for 1 of 2 confirmations" in summary_fields(store)["timing_note"]


def test_the_confirmation_rounds_grow_with_the_noise_fp32_read_against_itself(config):
    from autotune.measure.confidence import SelfCheck

    quiet = SelfCheck(ratio=1.0, low=0.99, high=1.01, rounds=40, spread=0.002)
    noisy = SelfCheck(ratio=1.0, low=0.9, high=1.1, rounds=40, spread=0.02)
    biased = SelfCheck(ratio=0.9, low=0.88, high=0.92, rounds=40, spread=0.06)
    assert confirmation_rounds(config.confirm, quiet) == MIN_CONFIRM_ROUNDS
    assert confirmation_rounds(config.confirm, noisy) == config.confirm.rounds  # needs 14, capped at 4
    assert confirmation_rounds(config.confirm, biased) == WIDENING * config.confirm.rounds


def test_the_one_liners_are_timed_beside_the_self_check_and_set_the_bar_before_the_search(tmp_path, config, capsys):
    evaluator = ScriptedEvaluator(config, [[0.99, 1.01]])
    names = ["ort-static", "ort-dynamic", "quick", "broken"]
    one_liners = [Plan.reference_plan(["fc1", "fc2"], name) for name in names]
    with TrialStore(tmp_path / "trials.sqlite") as store:
        check = check_search_timing(evaluator, store, FP32, one_liners)
        assert check.within_band and evaluator.calls == [("measure", None)]  # one measurement for all of them
        bar = measured_bar(store)
        assert check_search_timing(evaluator, store, FP32, one_liners) == check and len(evaluator.calls) == 1
    assert bar["quick"] == {"ok": True, "speedup": 1.2, "accuracy_drop": 0.001} and not bar["broken"]["ok"]
    # the fastest within the budget first: a confirmation cut to one one-liner keeps it
    assert [p.reference for p in bar_order(one_liners, bar, 0.01)] == ["quick", "ort-dynamic", "ort-static", "broken"]
    assert [p.reference for p in bar_order(one_liners, bar, 0.05)][:2] == ["ort-dynamic", "quick"]
    line = bar_line(bar, 0.01)
    assert line.startswith("the bar before the search: quick 1.20x FP32 within the budget")
    assert "ort-dynamic 1.48x at drop 0.0225 (over)" in line and "broken failed" in line
    assert bar_line(bar, 0.0001).startswith("the bar before the search: FP32 (no one-liner within the budget")
    assert capsys.readouterr().err == ""


def test_without_the_self_check_the_one_liners_are_still_timed_first(tmp_path):
    config = tiny_config(tmp_path)  # the tiny runs keep the self-check off
    evaluator = ScriptedEvaluator(config, [])
    with TrialStore(tmp_path / "trials.sqlite") as store:
        assert check_search_timing(evaluator, store, FP32, [Plan.reference_plan(["fc1", "fc2"], "quick")]) is None
        assert measured_bar(store)["quick"]["speedup"] == pytest.approx(1.2)
