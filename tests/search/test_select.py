import itertools

import pytest

from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.search.estimate import fit_surrogate
from autotune.search.select import confirmation_order, expected_speedups, pareto_front, profile_speedups
from autotune.testing import tiny_config


def _result(name, speedup, drop, status="ok"):
    return TrialResult(plan=Plan.make({name: "int8"}), status=status, speedup=speedup, accuracy_drop=drop)


def _order(config, *points):
    """The confirmation order of plans given as ``(name, speedup, drop)``, by name."""
    return [
        r.plan.precisions[0][0] for r in confirmation_order([_result(*point) for point in points], config.finalists)
    ]


def test_pareto_front_keeps_only_undominated_points_fastest_first():
    results = [
        _result(f"p{i}", s, d)
        for i, (s, d) in enumerate([(1.0, 0.0), (2.0, 0.01), (1.5, 0.02), (3.0, 0.05), (2.5, 0.05)])
    ]
    results.append(_result("failed", 9.0, 0.0, status="failed"))
    assert [(r.speedup, r.accuracy_drop) for r in pareto_front(results)] == [(3.0, 0.05), (2.0, 0.01), (1.0, 0.0)]


def test_confirmation_order_puts_the_fastest_within_budget_first_then_the_rest_by_reward(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01)
    points = [("edge", 2.0, 0.0099), ("safe", 1.5, 0.002), ("dominated", 1.4, 0.005)]
    order = _order(config, *points, ("over", 2.5, 0.012), ("far_over", 3.0, 0.05))
    assert order[:2] == ["edge", "safe"]
    assert order.index("over") < order.index("far_over")
    assert set(order) == {"edge", "safe", "dominated", "over", "far_over"}


def test_headroom_makes_the_search_aim_below_the_budget(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, search={"budget_headroom": 0.2})
    assert config.search_budget == 0.008
    # the plan at the edge of the full budget is past the search budget: the plan within it is confirmed first
    assert _order(config, ("edge", 2.0, 0.0099), ("safe", 1.5, 0.007))[0] == "safe"


def test_one_finalist_place_goes_to_a_faster_plan_between_the_search_budget_and_the_accuracy_budget(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, search={"budget_headroom": 0.2}, confirm={"top_k": 3})
    within = [("fast", 1.5, 0.007), ("next", 1.4, 0.006), ("safer", 1.2, 0.001), ("slow_safe", 1.1, 0.0005)]
    order = _order(config, *within, ("bold", 2.0, 0.009), ("bold_but_slower", 1.45, 0.0095), ("over", 3.0, 0.02))
    # top_k - 1 fastest within the search budget, the bold bet, then the front of the rest within it, then reward
    assert order[:5] == ["fast", "next", "bold", "safer", "slow_safe"]
    assert set(order[5:]) == {"bold_but_slower", "over"}


@pytest.mark.parametrize(("bold_places", "bold"), [(2, ["bolder", "bold"]), (1, ["bolder"]), (0, [])])
def test_up_to_bold_places_finalist_places_go_to_faster_plans_between_the_budgets(tmp_path, bold_places, bold):
    config = tiny_config(
        tmp_path,
        accuracy_budget=0.01,
        search={"budget_headroom": 0.2},
        confirm={"top_k": 4},
        planner={"bold_places": bold_places},
    )
    within = [("fast", 1.5, 0.007), ("next", 1.4, 0.006), ("third", 1.3, 0.005), ("fourth", 1.2, 0.004)]
    zone = [("bold", 1.9, 0.0085), ("bolder", 2.0, 0.0095), ("slower_zone", 1.45, 0.009)]
    order = _order(config, *within, *zone)
    # the bold bets fastest first, after as many of the fastest within the search budget as the other places hold
    assert order[:4] == ["fast", "next", "third", "fourth"][: 4 - len(bold)] + bold
    assert "slower_zone" not in order[:4]


def test_with_nothing_within_the_search_budget_a_single_place_goes_to_the_bold_plan(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, search={"budget_headroom": 0.2}, confirm={"top_k": 1})
    # "over" is faster and, by reward, first: the place goes to the plan held-out data may find within the budget
    assert _order(config, ("bold", 1.5, 0.009), ("over", 6.0, 0.0101))[0] == "bold"


def test_no_bold_place_when_no_plan_between_the_budgets_is_faster_than_the_search_budget_s_best(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, search={"budget_headroom": 0.2}, confirm={"top_k": 3})
    within = [("fast", 1.5, 0.007), ("next", 1.4, 0.006), ("third", 1.3, 0.005)]
    assert _order(config, *within, ("slower_zone", 1.45, 0.009))[:3] == ["fast", "next", "third"]


def _subset_trials(lucky: float, best_measured: float) -> list[TrialResult]:
    """Every subset of four layers in INT8, each saving 10 % of the FP32 time; two of them measured off the truth."""
    layers = [f"l{i}" for i in range(4)]
    trials = []
    for mask in itertools.product([False, True], repeat=4):
        plan = Plan.make({name: "int8" if on else "fp32" for name, on in zip(layers, mask, strict=True)})
        speedup = 1.0 / (1.0 - 0.1 * sum(mask))
        if mask == (True, False, False, False):
            speedup = lucky  # one short measurement that caught a quiet spell
        elif all(mask):
            speedup = best_measured
        trials.append(TrialResult(plan=plan, speedup=speedup, accuracy_drop=0.001 * sum(mask)))
    return trials


def test_expected_speedups_keep_one_lucky_measurement_from_outranking_the_plan_that_is_fastest(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01)
    trials = _subset_trials(lucky=1.75, best_measured=1.6)
    lucky, best = (t for t in trials if sum(p == "int8" for _, p in t.plan.precisions) in (1, 4) and t.speedup > 1.5)
    assert confirmation_order(trials, config.finalists)[0].plan_hash == lucky.plan_hash  # by the measurements alone
    expected = expected_speedups(trials, fit_surrogate(trials, {}))
    assert confirmation_order(trials, config.finalists, expected)[0].plan_hash == best.plan_hash
    assert 1.11 < expected[lucky.plan_hash] < lucky.speedup


def test_expected_speedups_are_the_measurements_without_a_model():
    trials = _subset_trials(lucky=1.75, best_measured=1.6)
    trials.append(TrialResult.failure(trials[0].plan, "build failed"))
    expected = expected_speedups(trials, None)
    assert expected == {t.plan_hash: t.speedup for t in trials if t.ok}


SHARES = {"l0": 0.1, "l1": 0.4, "l2": 0.2, "l3": 0.3}


def _profile_trials(noise: dict[frozenset, float]) -> list[TrialResult]:
    """Every subset of four layers in INT8, saving 0.6 of each one's runtime share; some measured off by a factor."""
    trials = []
    for mask in itertools.product([False, True], repeat=4):
        quantized = frozenset(name for name, on in zip(SHARES, mask, strict=True) if on)
        plan = Plan.make({name: "int8" if name in quantized else "fp32" for name in SHARES})
        speedup = 1.0 / (1.0 - 0.6 * sum(SHARES[n] for n in quantized)) * noise.get(quantized, 1.0)
        trials.append(TrialResult(plan=plan, speedup=speedup, accuracy_drop=0.001 * len(quantized)))
    return trials


def test_the_profile_model_ranks_plans_by_their_runtime_share_not_by_one_lucky_measurement():
    # l1 alone (share 0.4) measured 15 % slow, l0 + l2 (share 0.3) 15 % fast, l1 + l3 (0.7) 20 % slow
    noise = {frozenset({"l1"}): 0.85, frozenset({"l0", "l2"}): 1.15, frozenset({"l1", "l3"}): 0.8}
    trials = _profile_trials(noise)
    by_set = {frozenset(n for n, p in t.plan.precisions if p == "int8"): t.plan_hash for t in trials}
    profile = profile_speedups(trials, {}, SHARES, list(SHARES))
    mean = expected_speedups(trials, fit_surrogate(trials, {}))
    one, pair = by_set[frozenset({"l1"})], by_set[frozenset({"l0", "l2"})]
    assert mean[pair] > mean[one]  # the noisy measurements, averaged with a model fitted on them, misrank
    assert profile[one] > profile[pair]
    assert profile[one] == pytest.approx(1 / (1 - 0.6 * 0.4), rel=0.03)
    assert profile[by_set[frozenset({"l1", "l3"})]] > profile[by_set[frozenset({"l0", "l2", "l3"})]]


def test_the_profile_model_needs_a_successful_trial():
    assert (
        profile_speedups([TrialResult.failure(Plan.make(dict.fromkeys(SHARES, "int8")), "x")], {}, SHARES, []) is None
    )


def test_ranking_gives_a_tie_within_the_measured_noise_to_the_more_accurate_plan():
    from autotune.search.select import ranking

    fast, close, slow, over = (
        _result("a", 1.52, 0.008),
        _result("b", 1.50, 0.002),
        _result("c", 1.30, 0.0),
        _result("d", 2.0, 0.05),
    )
    assert [r.plan.precisions[0][0] for r in ranking([fast, close, slow, over], 0.01)] == ["a", "b", "c", "d"]
    # 1.52 and 1.50 differ by 1.3 %, inside a 2 % noise: the measurement cannot order them, the drop can
    assert [r.plan.precisions[0][0] for r in ranking([fast, close, slow, over], 0.01, noise=0.02)] == [
        "b",
        "a",
        "c",
        "d",
    ]
    assert [r.plan.precisions[0][0] for r in ranking([fast, slow], 0.01, noise=0.02)] == ["a", "c"]


def test_the_profile_model_ranks_int8_dynamic_by_what_its_own_plans_saved():
    # The AVX2 quick start: static INT8 in the default scheme (u8u8) saves little, int8-dynamic much more, static INT8
    # in the other scheme (u8s7, a knob) in between. Held at static INT8's saving, the dynamic plan ranked last.
    from autotune.plan import DYNAMIC, INT8_SCHEME_KNOB

    defaults = {INT8_SCHEME_KNOB: "u8u8"}
    every = dict.fromkeys(SHARES, "int8")
    static = TrialResult(plan=Plan.make(every, defaults), speedup=1.21, accuracy_drop=0.002)
    dynamic = TrialResult(plan=Plan.make(dict.fromkeys(SHARES, DYNAMIC), defaults), speedup=1.60, accuracy_drop=0.008)
    other = TrialResult(plan=Plan.make(every, {INT8_SCHEME_KNOB: "u8s7"}), speedup=1.51, accuracy_drop=0.003)
    profile = profile_speedups([static, dynamic, other], defaults, SHARES, list(SHARES))
    assert profile[dynamic.plan_hash] == pytest.approx(1.60, rel=0.02)
    assert profile[dynamic.plan_hash] > profile[other.plan_hash] > profile[static.plan_hash]
