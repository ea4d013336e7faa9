import math

import pytest

from autotune.harness.deadline import (
    EXPORT_SHARE,
    MIN_CONFIRM_ROUNDS,
    UNKNOWN_RESERVE_SHARE,
    ConfirmationSize,
    RunDeadline,
    TrialCosts,
)
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.testing import tiny_config
from autotune.tune import tune

PLAN = Plan.uniform(["a", "b"], "int8")
PROTOCOL = {"warmup": 2, "repeats": 5, "rounds": 4}


def _trial(total_s: float, latency_ms: float, reference_ms: float, rounds_timed: int = 4) -> TrialResult:
    return TrialResult(
        PLAN,
        latency_ms=latency_ms,
        reference_latency_ms=reference_ms,
        speedup=reference_ms / latency_ms,
        total_s=total_s,
        protocol=PROTOCOL,
        busy={"rounds": rounds_timed},
    )


def _clock(start: float = 1000.0) -> tuple[list[float], RunDeadline]:
    now = [start]
    return now, RunDeadline(1.0, start, clock=lambda: now[0])


def test_trial_costs_separate_building_and_scoring_from_timing():
    # 4 rounds x 7 runs x (10 + 20) ms = 0.84 s of timing in a 3.84 s trial: 3 s to build and score
    costs = TrialCosts.of([_trial(3.84, 10.0, 20.0)], limit_factor=4.0, patience_s=5.0)
    assert costs.prepare_s == pytest.approx(3.0)
    # the confirmation is costed at half again the rounds its trials needed (at least 1.5 per round), and the
    # patience on top: each plan counts its own rounds, so several plans need about the rounds one does
    assert (costs.run_ms, costs.reference_ms, costs.rounds_inflation, costs.patience_s) == (10.0, 20.0, 1.5, 5.0)
    assert TrialCosts.of([_trial(6.72, 10.0, 20.0, rounds_timed=8)], limit_factor=4.0).rounds_inflation == 3.0
    assert TrialCosts.of([_trial(6.72, 10.0, 20.0, rounds_timed=12)], limit_factor=4.0).rounds_inflation == 4.0
    # a busy machine whose trials timed 24 rounds to keep 4 (back-offs) costs more than the limit
    assert TrialCosts.of([_trial(6.72, 10.0, 20.0, rounds_timed=24)], limit_factor=4.0).rounds_inflation == 6.0


def test_store_hits_and_failures_say_nothing_about_cost():
    failed = TrialResult.failure(PLAN, "boom", total_s=50.0)
    hit = TrialResult(**{**_trial(50.0, 1.0, 1.0).__dict__, "from_store": True})
    assert TrialCosts.of([failed, hit]) is None


def test_a_confirmation_costs_a_build_per_plan_and_every_plan_in_every_round():
    costs = TrialCosts(prepare_s=2.0, run_ms=10.0, reference_ms=20.0, rounds_inflation=1.0)
    # 3 plans + FP32 + the export built; 8 rounds of 12 runs of 3 x 10 ms, FP32's plan and the reference at 20 ms
    expected = (3 + 1 + 0.6) * 2.0 + 8 * 12 * (3 * 10.0 + 2 * 20.0) / 1e3
    assert costs.confirmation_s(3, 8, 12) == pytest.approx(expected)
    slower = TrialCosts(prepare_s=2.0, run_ms=10.0, reference_ms=20.0, rounds_inflation=1.0, overhead=1.5)
    assert slower.confirmation_s(3, 8, 12) == pytest.approx((3 + 1 + 0.6) * 2.0 + 1.5 * 8 * 12 * 70.0 / 1e3)


def test_a_slow_models_confirmation_is_costed_at_its_cut_turns():
    # 200 ms a run: 12 runs a turn would take 2.4 s, the 0.6 s turn takes 3 (1 warm-up, 2 timed); a 1 ms model's
    # whole turn fits.
    slow = TrialCosts(prepare_s=2.0, run_ms=200.0, reference_ms=200.0, rounds_inflation=1.0, turn_s=0.6)
    assert slow.confirmation_s(3, 8, 12) == pytest.approx((3 + 1 + 0.6) * 2.0 + 8 * 5 * 0.6)
    fast = TrialCosts(prepare_s=2.0, run_ms=1.0, reference_ms=1.0, rounds_inflation=1.0, turn_s=0.6)
    assert fast.confirmation_s(3, 8, 12) == pytest.approx((3 + 1 + 0.6) * 2.0 + 8 * 5 * 12 * 1.0 / 1e3)


def test_a_trial_that_times_slower_than_its_latencies_makes_the_confirmation_cost_more():
    # 4 rounds x 7 runs x 30 ms = 0.84 s of latency; the trial built in 1 s, scored in 2 s and timed for 1.26 s
    trial = TrialResult(**{**_trial(4.26, 10.0, 20.0).__dict__, "build_s": 1.0, "score_s": 2.0})
    costs = TrialCosts.of([trial])
    assert costs.prepare_s == pytest.approx(3.0) and costs.overhead == pytest.approx(1.5)
    faster = TrialResult(**{**trial.__dict__, "total_s": 3.5})  # timed in less than its latencies: never below 1
    assert TrialCosts.of([faster]).overhead == 1.0


def test_without_a_limit_the_search_and_the_confirmation_are_never_cut():
    deadline = RunDeadline(None, 0.0, clock=lambda: 1e9)
    costs = TrialCosts(100.0, 1.0, 1.0, 1.0)
    assert math.isinf(deadline.search_left_s(costs, 5, 8, 12))
    assert deadline.size_confirmation(costs, 5, 2, 8, 12) == ConfirmationSize(5, 2, 8, spare=True)


def test_the_search_leaves_the_confirmation_its_time():
    now, deadline = _clock()
    now[0] += 10.0  # set-up took 10 s of the 60
    assert deadline.search_left_s(None, 7, 8, 12) == pytest.approx(50.0 - UNKNOWN_RESERVE_SHARE * 60.0)
    costs = TrialCosts(prepare_s=2.0, run_ms=10.0, reference_ms=20.0, rounds_inflation=1.0)
    expected = 50.0 - costs.confirmation_s(3, 8, 12) - costs.prepare_s  # and one more build runs to its end
    assert deadline.search_left_s(costs, 3, 8, 12) == pytest.approx(expected)


def test_a_confirmation_gives_up_finalists_first_then_one_liners_then_rounds():
    costs = TrialCosts(prepare_s=2.0, run_ms=10.0, reference_ms=10.0, rounds_inflation=1.0)
    now, deadline = _clock()
    full = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (full.finalists, full.references, full.rounds, full.note) == (5, 2, 8, None)
    now[0] += 60.0 - costs.confirmation_s(3 + 2, 8, 12) - 0.01  # time for 3 finalists and both one-liners
    cut = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (cut.finalists, cut.references, cut.rounds, cut.spare) == (3, 2, 8, False)
    assert "3 of 5 finalists" in cut.note and "one-liners" not in cut.note
    now[0] = 1000.0 + 60.0 - costs.confirmation_s(2, 6, 12) - 0.01  # one finalist and one one-liner, 6 rounds
    kept = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (kept.finalists, kept.references, kept.rounds) == (1, 1, 6)  # rounds go before the last one-liner
    now[0] = 1000.0 + 60.0 - costs.confirmation_s(1, 8, 12) - 0.01  # one finalist alone
    alone = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (alone.finalists, alone.references, alone.rounds) == (1, 0, 8)
    now[0] = 1000.0 + 60.0 - costs.confirmation_s(1, MIN_CONFIRM_ROUNDS, 12) - 0.01
    fewest = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (fewest.finalists, fewest.references, fewest.rounds) == (1, 0, MIN_CONFIRM_ROUNDS)
    assert "3 of 8 rounds" in fewest.note


def test_the_confirmation_stops_timing_at_the_runs_end_less_the_export():
    costs = TrialCosts(prepare_s=2.0, run_ms=10.0, reference_ms=10.0, rounds_inflation=1.0)
    now, deadline = _clock()
    now[0] += 20.0
    size = deadline.size_confirmation(costs, 5, 2, 8, 12)
    # The run started at 1000 with 60 s: its timing stops at 1060 less the export's share of a build.
    assert size.stop_at == pytest.approx(1060.0 - EXPORT_SHARE * 2.0)


def test_with_no_time_for_one_finalist_fp32_alone_is_confirmed_and_the_run_says_why():
    costs = TrialCosts(prepare_s=30.0, run_ms=10.0, reference_ms=10.0, rounds_inflation=1.0)
    now, deadline = _clock()
    now[0] += 55.0
    size = deadline.size_confirmation(costs, 5, 2, 8, 12)
    assert (size.finalists, size.references, size.spare) == (0, 0, False)
    assert "FP32 alone is confirmed and exported" in size.note and "leaves 5 s" in size.note
    now[0] += 100.0  # past the deadline: no estimate needed
    assert deadline.size_confirmation(None, 5, 2, 8, 12).finalists == 0


def test_a_run_out_of_minutes_exports_within_them_and_says_where_the_time_went(tmp_path, capsys):
    # Builds take a fraction of a second here: the time runs out long before the builds or the distinct plans.
    config = tiny_config(tmp_path, budget={"builds": 100_000, "minutes": 0.2, "stall_episodes": 100_000})
    summary = tune(config, strategy="random", isolate=False, progress=False)
    assert summary["wall_s"] <= 12.0 * 1.1, summary["time_s"]
    assert set(summary["time_s"]) == {"setup", "search", "confirmation", "export"}
    assert sum(summary["time_s"].values()) == pytest.approx(summary["wall_s"], rel=0.05)
    assert summary["builds"] < 100_000 and summary["time_budget_s"] == 12.0
    assert "the search stopped at budget.minutes=0.2 " in capsys.readouterr().err


class _OpenVINOEvaluator:
    def __init__(self, config):
        self.config = config

    def references(self):
        return ("ov-default", "nncf-quantize", "nncf-accuracy-control")


@pytest.mark.parametrize(
    ("minutes", "asked", "timed"),
    [
        (None, None, ["ov-default", "nncf-quantize", "nncf-accuracy-control"]),
        (5.0, None, ["ov-default", "nncf-quantize"]),
        (5.0, ["nncf-accuracy-control"], ["nncf-accuracy-control"]),
    ],
)
def test_a_run_with_minutes_leaves_out_the_one_liners_that_search_unless_asked(tmp_path, capsys, minutes, asked, timed):
    from autotune.confirm import one_liner_plans

    config = tiny_config(tmp_path, budget={"builds": 5, "minutes": minutes}, backend={"name": "openvino"})
    config = config.model_copy(update={"confirm": config.confirm.model_copy(update={"references": asked})})
    plans = one_liner_plans(_OpenVINOEvaluator(config), ["a"])
    assert [plan.reference for plan in plans] == timed
    said = capsys.readouterr().err
    assert ("nncf-accuracy-control (a search of its own" in said) == (len(timed) == 2)


def test_the_search_leaves_time_for_the_finalists_it_can_have_not_for_top_k():
    from autotune.tune import _ConfirmationShape

    shape = _ConfirmationShape(finalists=5, references=1, rounds=8, runs_per_round=12, limit_factor=4.0)
    plans = [Plan.uniform(["a", "b"], p) for p in ("int8", "fp16")]
    one = [_trial(10.0, 50.0, 70.0)]
    two = [TrialResult(**{**_trial(10.0, 50.0, 70.0).__dict__, "plan": plan}) for plan in plans] + one
    failed = [TrialResult.failure(Plan.uniform(["a", "b"], "bf16"), "build failed")]
    assert shape.finalists_of([], searching=True) == 1
    assert shape.finalists_of(one + failed, searching=True) == 2  # the next build may be a second finalist
    assert shape.finalists_of(one + failed, searching=False) == 1
    assert shape.finalists_of(two, searching=False) == 2  # two distinct plans, one measured twice
    many = [TrialResult(**{**one[0].__dict__, "plan": Plan.uniform(["a", f"b{i}"], "int8")}) for i in range(9)]
    assert shape.finalists_of(many, searching=True) == shape.finalists_of(many, searching=False) == 5
    # Costed for what it can have, a search with one trial keeps far less time than for five finalists.
    costs = TrialCosts.of(one)
    assert costs.confirmation_s(2 + 1, 8, 12) < costs.confirmation_s(5 + 1, 8, 12) - 5


def test_the_search_keeps_at_most_a_share_of_the_budget_for_the_confirmation_unless_one_finalist_needs_more():
    from autotune.harness.deadline import CONFIRMATION_SHARE

    now, deadline = _clock()  # a 60 s budget
    cheap = TrialCosts(prepare_s=0.5, run_ms=10.0, reference_ms=20.0, rounds_inflation=1.0)
    assert cheap.confirmation_s(5, 8, 12) < CONFIRMATION_SHARE * 60.0  # all of it is kept
    assert deadline.search_left_s(cheap, 5, 8, 12) == pytest.approx(60.0 - cheap.confirmation_s(5, 8, 12) - 0.5)
    costly = TrialCosts(prepare_s=0.5, run_ms=30.0, reference_ms=30.0, rounds_inflation=4.0)
    assert costly.confirmation_s(5, 8, 12) > 60.0  # a search keeping it all would stop at once
    assert deadline.search_left_s(costly, 5, 8, 12) == pytest.approx(60.0 - CONFIRMATION_SHARE * 60.0 - 0.5)
    heavy = TrialCosts(prepare_s=0.5, run_ms=1000.0, reference_ms=1000.0, rounds_inflation=4.0)
    fewest = heavy.confirmation_s(1, MIN_CONFIRM_ROUNDS, 12)
    assert fewest > CONFIRMATION_SHARE * 60.0  # one finalist in the fewest rounds is the least it keeps
    assert deadline.search_left_s(heavy, 5, 8, 12) == pytest.approx(60.0 - fewest - 0.5)


def test_the_search_stops_a_trial_and_the_policys_work_after_it_before_the_confirmations_time():
    trials = [_trial(3.84, 10.0, 20.0), _trial(12.0, 10.0, 20.0), _trial(4.0, 10.0, 20.0)]
    costs = TrialCosts.of(trials, limit_factor=1.0)
    assert costs.trial_s == pytest.approx(4.0)  # the median trial, end to end
    now, deadline = _clock()
    expected = 60.0 - costs.confirmation_s(3, 8, 12) - 2 * 4.0
    assert deadline.search_left_s(costs, 3, 8, 12) == pytest.approx(expected)


def test_without_minutes_the_confirmation_gets_a_share_of_the_searchs_seconds():
    from autotune.harness.deadline import CONFIRMATION_MIN_S, CONFIRMATION_SEARCH_SHARE

    now = [1000.0]
    bound = RunDeadline.for_confirmation(180.0, lambda: now[0])
    assert bound.left_s() == pytest.approx(max(CONFIRMATION_MIN_S, CONFIRMATION_SEARCH_SHARE * 180.0))
    costs = TrialCosts(prepare_s=1.0, run_ms=200.0, reference_ms=200.0, rounds_inflation=1.5)
    size = bound.size_confirmation(costs, 5, 2, 8, 12)
    assert costs.confirmation_s(size.finalists + size.references, size.rounds, 12) <= bound.left_s()
    assert size.note.startswith("the confirmation's share (1x the search's 180 s) leaves 180 s")
    assert size.stop_at == pytest.approx(1000.0 + 180.0 - EXPORT_SHARE * 1.0)
    assert RunDeadline.for_confirmation(5.0, lambda: now[0]).left_s() == pytest.approx(CONFIRMATION_MIN_S)
