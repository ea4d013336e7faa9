"""bench/research/replay.py: the agent against a simulator fitted from a store of real trials."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.config.schema import dump_config
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space

ROOT = Path(__file__).resolve().parents[3]


def test_replay_trains_the_agent_on_a_simulator_of_the_stored_trials(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(tiny_config(tmp_path, budget={"builds": 14})))
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    rng = np.random.default_rng(0)
    store_path = tmp_path / "old-run" / "trials.sqlite"
    store_path.parent.mkdir()
    with TrialStore(store_path) as store:
        for _ in range(30):
            store.put(evaluate(space.plan({n: "int8" for n in space.layer_names if rng.random() < 0.5})))
    command = [sys.executable, str(ROOT / "bench" / "research" / "replay.py"), str(config), "--stores", str(store_path)]
    command += ["--set", "ppo.episodes_per_update=2", "--set", "ppo.imagined_episodes=4", "--seeds", "0", "1"]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("simulator fitted on")
    optimum = float(lines[1].split(": ")[1].split("x")[0])
    assert lines[1].startswith("simulator's best plan within the search budget") and optimum > 1.0
    assert lines[2].startswith("simulator check")
    results = [ast.literal_eval(line) for line in lines[3:]]
    assert [r["seed"] for r in results] == [0, 1]
    for result in results:
        assert result["builds"] == 14  # the budget, counted as real runs count it
        assert result["best_speedup_within_budget"] > 1.0
        assert len(result["quantized_per_10_builds"]) == 2


def _trials_of(drop_of, count=60, seed=0):
    """Trials of random plans of the tiny space, with the synthetic speedup and the drop ``drop_of(plan)``."""
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    rng = np.random.default_rng(seed)
    trials = []
    for _ in range(count):
        result = evaluate(space.plan({n: "int8" for n in space.layer_names if rng.random() < 0.5}))
        result.accuracy_drop = drop_of(result.plan)
        trials.append(result)
    return space, trials


def test_the_simulator_check_trusts_additive_drops_and_flags_interacting_ones():
    sys.path.insert(0, str(ROOT / "bench" / "research"))
    import replay

    def additive(plan):
        return sum(0.001 * (i + 1) for i, (_, p) in enumerate(plan.precisions) if p == "int8")

    def interacting(plan):  # two layers that together cost ten times what each costs alone
        int8 = [p == "int8" for _, p in plan.precisions]
        return additive(plan) + (0.02 if int8[0] and int8[1] else 0.0)

    space, trials = _trials_of(additive)
    defaults = {knob.name: knob.default for knob in space.knobs}
    exact = replay.fit_check(trials, defaults, drop_floor=0.0)
    assert exact["held_out"] == 12 and exact["drop_error_median"] < 0.05
    _, trials = _trials_of(interacting)
    flagged = replay.fit_check(trials, defaults, drop_floor=0.0)
    assert flagged["drop_error_p90"] > 0.2 and flagged["drop_error_p90"] > 4 * exact["drop_error_p90"]


def test_the_simulator_s_savings_follow_the_profile_with_a_saving_weight_and_its_drops_the_trials():
    sys.path.insert(0, str(ROOT / "bench" / "research"))
    import replay

    from autotune.search.prior import PriorInputs

    def drop_of(plan):
        return sum(0.001 * (i + 1) for i, (_, p) in enumerate(plan.precisions) if p == "int8")

    space, trials = _trials_of(drop_of)
    names = space.layer_names
    defaults = {knob.name: knob.default for knob in space.knobs}
    shares = (*[0.1] * (len(names) - 1), 0.7)
    # single-layer errors that would put every layer's drop at 0.01: a prior the drops must not follow
    errors = {n: {"max": 0.02} for n in names}
    prior = PriorInputs(tuple(names), shares, errors, dict.fromkeys(names, "max"), "cosine")
    plain = replay.fit_truth(trials, defaults, names, prior)
    profiled = replay.fit_truth(trials, defaults, names, prior, saving_weight=1e4)
    first_alone = space.plan({n: ("int8" if n == names[0] else "fp32") for n in names})
    last_alone = space.plan({n: ("int8" if n == names[-1] else "fp32") for n in names})
    # by the profile, the last layer holds 7 times the first one's runtime; the trials' own fit says the opposite
    assert profiled.predict(last_alone)[0] > profiled.predict(first_alone)[0] * 1.05
    assert plain.predict(first_alone)[0] > plain.predict(last_alone)[0] * 1.05
    for plan in (first_alone, last_alone):  # the drops stay the trials' own, with the saving weight alone
        assert profiled.predict(plan)[1] == pytest.approx(drop_of(plan), abs=5e-4)


def test_replay_names_the_fix_when_the_stores_hold_too_few_trials(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(tiny_config(tmp_path)))
    command = [
        sys.executable,
        str(ROOT / "bench" / "research" / "replay.py"),
        str(config),
        "--stores",
        str(tmp_path / "none*"),
    ]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, cwd=tmp_path)
    assert done.returncode != 0 and "too few successful trials" in done.stderr


def test_replay_compares_every_strategy_by_builds_to_reach_greedys_result(tmp_path):
    import json

    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(tiny_config(tmp_path, budget={"builds": 12})))
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    rng = np.random.default_rng(0)
    store_path = tmp_path / "old-run" / "trials.sqlite"
    store_path.parent.mkdir()
    with TrialStore(store_path) as store:
        for _ in range(30):
            store.put(evaluate(space.plan({n: "int8" for n in space.layer_names if rng.random() < 0.5})))
    out = tmp_path / "curves.json"
    command = [sys.executable, str(ROOT / "bench" / "research" / "replay.py"), str(config), "--stores", str(store_path)]
    command += ["--set", "ppo.episodes_per_update=2", "--set", "ppo.imagined_episodes=4", "--seeds", "0", "1"]
    command += ["--strategies", "ppo", "greedy", "random", "--out", str(out), "--plans-out", str(tmp_path / "plans")]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"ppo", "greedy", "random"} <= set(rows)
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert sorted((r["strategy"], r["seed"]) for r in runs) == sorted(
        (s, seed) for s in ("ppo", "greedy", "random") for seed in (0, 1)
    )
    for run in runs:
        curve = run["best_so_far"]
        assert len(curve) == run["builds"] <= 12
        assert all(a <= b for a, b in zip(curve, curve[1:], strict=False))  # best so far never falls
    greedy_best = sorted(r["best_speedup_within_budget"] for r in runs if r["strategy"] == "greedy")
    assert data["target"] == pytest.approx(0.98 * float(np.median(greedy_best)))
    # then every run's confirmed winner, with greedy's as the yardstick of its own table
    assert "held-out drop / search drop: 1.000, spread 0.000 (from 0 confirmed plans)" in done.stdout
    assert "meets the accuracy budget at the median ratio (search drop <= 0.02): " in done.stdout
    winners = done.stdout.split("| confirmed winner (simulated speedup) |")[1]
    assert winners.count("\n| greedy | ") == 1 and "| 1 [1, 1] |" in winners  # greedy over itself, seed by seed
    for run in runs:
        assert run["winner_speedup"] >= 1.0 and run["winner_drop"] <= 0.02  # tiny_config's accuracy budget
    # the simulator's best plans, as plan files `autotune evaluate --plan` measures on a real machine
    for name, printed in (("within-search-budget", "within the search budget: "), ("ceiling", "median ratio")):
        plan = Plan.from_json((tmp_path / "plans" / f"{name}.json").read_text())
        assert [layer for layer, _ in plan.precisions] == space.layer_names
        quantized = sum(p != "fp32" for _, p in plan.precisions)
        line = next(line for line in done.stdout.splitlines() if printed in line)
        assert f"({quantized} layers quantized)" in line


class _Truth:
    """A simulator stub: each plan's speedup and search drop by hash."""

    def __init__(self, evaluate, drops):
        self.evaluate, self.drops = evaluate, drops

    def predict(self, plan):
        return self.evaluate(plan).speedup, self.drops.get(plan.hash, 0.0)

    def result(self, plan):
        result = self.evaluate(plan)
        result.accuracy_drop = self.drops.get(plan.hash, 0.0)
        return result


def test_the_simulated_winner_is_the_bolder_plan_only_while_its_held_out_drop_meets_the_budget(tmp_path):
    sys.path.insert(0, str(ROOT / "bench" / "research"))
    import replay

    config = tiny_config(tmp_path, search={"budget_headroom": 0.2})  # budget 0.02, search budget 0.016
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    names = space.layer_names
    safe = space.plan({names[0]: "int8"})
    bold = space.plan(dict.fromkeys(names, "int8"))
    drops = {safe.hash: 0.005, bold.hash: 0.018}  # the bold plan is past the search budget, within the budget
    truth = _Truth(evaluate, drops)
    assert truth.predict(bold)[0] > truth.predict(safe)[0]
    built = [truth.result(safe), truth.result(bold)]
    rng = np.random.default_rng(0)
    held = replay.confirmed_winner(built, truth, config, space, None, replay.HeldOut(1.0, 0.0, 0.0), rng)
    assert held["winner_quantized"] == len(names) and held["winner_drop"] == pytest.approx(0.018)
    shifted = replay.confirmed_winner(built, truth, config, space, None, replay.HeldOut(1.2, 0.0, 0.0), rng)
    assert shifted["winner_quantized"] == 1 and shifted["winner_drop"] == pytest.approx(0.006)
    assert shifted["winner_speedup"] == pytest.approx(truth.predict(safe)[0], rel=1e-3)
    nothing = replay.confirmed_winner(built, truth, config, space, None, replay.HeldOut(5.0, 0.0, 0.0), rng)
    assert nothing["winner_speedup"] == 1.0 and nothing["winner_quantized"] == 0


def test_held_out_drop_ratios_pair_each_confirmation_with_its_search_trial(tmp_path):
    sys.path.insert(0, str(ROOT / "bench" / "research"))
    import replay

    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    names = space.layer_names
    plans = [space.plan({names[0]: "int8"}), space.plan({names[1]: "int8"}), space.plan(dict.fromkeys(names, "int8"))]
    path = tmp_path / "trials.sqlite"
    with TrialStore(path) as store:
        for plan, search_drop, held_drop in zip(plans, (0.01, 0.0001, 0.02), (0.011, 0.0005, 0.03), strict=True):
            trial = evaluate(plan)
            trial.accuracy_drop = search_drop
            store.put(trial)
            confirmed = evaluate(plan)
            confirmed.accuracy_drop, confirmed.split = held_drop, "holdout"
            store.put_confirmation(confirmed)
    ratios = replay.held_out_drop_ratios([str(path)], drop_floor=0.001)  # the near-zero drop is left out
    assert sorted(ratios) == pytest.approx([1.1, 1.5])
