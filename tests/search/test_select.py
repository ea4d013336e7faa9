from autotune.plan import Plan
from autotune.search.select import confirmation_order, pareto_front
from autotune.testing import tiny_config
from autotune.trial import TrialResult


def _result(name, speedup, drop, status="ok"):
    return TrialResult(plan=Plan.make({name: "int8"}), status=status, speedup=speedup, accuracy_drop=drop)


def test_pareto_front_keeps_only_undominated_points_fastest_first():
    results = [
        _result(f"p{i}", s, d)
        for i, (s, d) in enumerate([(1.0, 0.0), (2.0, 0.01), (1.5, 0.02), (3.0, 0.05), (2.5, 0.05)])
    ]
    results.append(_result("failed", 9.0, 0.0, status="failed"))
    assert [(r.speedup, r.accuracy_drop) for r in pareto_front(results)] == [(3.0, 0.05), (2.0, 0.01), (1.0, 0.0)]


def test_confirmation_order_walks_the_within_budget_front_then_the_rest_by_reward(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01)
    results = [
        _result("edge", 2.0, 0.0099),
        _result("safe", 1.5, 0.002),
        _result("dominated", 1.4, 0.005),
        _result("over", 2.5, 0.012),
        _result("far_over", 3.0, 0.05),
    ]
    order = [r.plan.precisions[0][0] for r in confirmation_order(results, config)]
    assert order[:2] == ["edge", "safe"]
    assert order.index("over") < order.index("far_over")
    assert set(order) == {"edge", "safe", "dominated", "over", "far_over"}


def test_headroom_makes_the_search_aim_below_the_budget(tmp_path):
    config = tiny_config(tmp_path, accuracy_budget=0.01, search={"budget_headroom": 0.2})
    assert config.search_budget == 0.008
    results = [_result("edge", 2.0, 0.0099), _result("safe", 1.5, 0.007)]
    # the plan at the edge of the full budget is no longer on the within-budget front the search confirms first
    assert [r.plan.precisions[0][0] for r in confirmation_order(results, config)][0] == "safe"
