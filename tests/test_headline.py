import json

import pytest

from autotune.cli import _print_summary
from autotune.headline import headline_fields, headline_lines
from autotune.plan import Plan
from autotune.run.trial import TrialResult
from autotune.testing import tiny_config
from autotune.tune import tune

LAYERS = ["fc1", "fc2"]
BUDGET = 0.01


def result(plan, speedup, drop=0.0, back_to_back=None, status="ok"):
    return TrialResult(
        plan=plan, status=status, speedup=speedup, accuracy_drop=drop, back_to_back_ms=back_to_back, split="holdout"
    )


def one_liner(name, speedup, drop=0.0, back_to_back=None):
    return result(Plan.reference_plan(LAYERS, name), speedup, drop, back_to_back)


FP32 = result(Plan.uniform(LAYERS, "fp32"), 1.0)


def summary_of(winner, fp32, references, timing_note=None):
    summary = {
        **headline_fields(winner, fp32, references, BUDGET),
        "accuracy_budget": BUDGET,
        "timing_note": timing_note,
    }
    return {**summary, "headline": headline_lines(summary)}


def test_the_winner_is_set_against_the_fastest_one_liner_within_the_budget_not_a_slow_one():
    winner = result(Plan.uniform(LAYERS, "int8"), 2.1, drop=0.004)
    references = {
        "ort-static": one_liner("ort-static", 1.4, drop=0.002),
        "ort-dynamic": one_liner("ort-dynamic", 0.13),
        "fast-but-wrong": one_liner("fast-but-wrong", 3.0, drop=0.5),
    }
    summary = summary_of(winner, FP32, references)
    assert summary["best_alternative"] == "ort-static"
    assert summary["winner_over_best_alternative"] == pytest.approx(2.1 / 1.4)
    assert summary["fp32_beaten"] is True
    assert summary["best_alternative_back_to_back"] is None  # no back-to-back timer: no such comparison
    assert summary["fastest_over_budget"]["name"] == "fast-but-wrong"
    assert summary["headline"] == [
        "winner against the fastest engine within the budget without autotune: 1.50x one launch (ort-static)"
    ]


def test_fp32_is_the_alternative_where_every_one_liner_within_the_budget_is_slower():
    # the demo's case: ort-dynamic (0.13x FP32) is within the budget, ort-static (1.40x) over it
    winner = result(Plan.uniform(LAYERS, "int8"), 1.3, drop=0.008)
    references = {"ort-static": one_liner("ort-static", 1.4, drop=0.02), "ort-dynamic": one_liner("ort-dynamic", 0.13)}
    summary = summary_of(winner, FP32, references, timing_note="the machine was busy")
    assert summary["best_alternative"] == "fp32" and summary["winner_over_best_alternative"] == pytest.approx(1.3)
    assert summary["headline"] == [
        "winner against the fastest engine within the budget without autotune: 1.30x one launch (fp32); "
        "the timing note below applies"
    ]


def test_where_nothing_beats_fp32_the_headline_says_so_and_names_the_fastest_one_liner_over_the_budget():
    winner = FP32  # the run exported FP32
    references = {"ort-static": one_liner("ort-static", 1.4, drop=0.023), "ort-dynamic": one_liner("ort-dynamic", 0.13)}
    summary = summary_of(winner, FP32, references)
    assert summary["best_alternative"] == "fp32" and summary["winner_over_best_alternative"] == pytest.approx(1.0)
    assert summary["fp32_beaten"] is False
    assert summary["fastest_over_budget"] == {
        "name": "ort-static",
        "speedup": 1.4,
        "accuracy_drop": 0.023,
        "back_to_back_ms": None,
    }
    assert summary["headline"] == [
        "no engine within the budget beats FP32 here (one launch)",
        "the fastest one-liner, ort-static, runs 1.40x FP32 one launch at a time with a drop of 0.023, "
        "over the budget (0.01)",
    ]
    # a plan slower than FP32 that was exported anyway beats nothing either
    slower = result(Plan.uniform(LAYERS, "int8"), 0.97, drop=0.001)
    assert (
        summary_of(slower, FP32, references)["headline"][0]
        == "no engine within the budget beats FP32 here (one launch)"
    )


def test_a_one_liner_within_the_budget_that_beats_fp32_is_what_an_fp32_winner_is_set_against():
    references = {"ort-static": one_liner("ort-static", 1.4, drop=0.002)}
    summary = summary_of(FP32, FP32, references)
    assert summary["fp32_beaten"] is True and summary["best_alternative"] == "ort-static"
    assert summary["headline"] == [
        "winner against the fastest engine within the budget without autotune: 0.71x one launch (ort-static)"
    ]


def test_both_timings_are_compared_apart_where_the_backend_times_back_to_back():
    fp32 = result(Plan.uniform(LAYERS, "fp32"), 1.0, back_to_back=9.5)
    winner = result(Plan.uniform(LAYERS, "fp8"), 2.0, drop=0.001, back_to_back=4.0)
    references = {
        "torch-bf16": one_liner("torch-bf16", 1.6, back_to_back=5.0),
        "torch-fp16": one_liner("torch-fp16", 1.5, back_to_back=4.8),
        "torchao-fp8": one_liner("torchao-fp8", 2.2, drop=0.5, back_to_back=3.0),  # over the budget
    }
    summary = summary_of(winner, fp32, references)
    assert summary["best_alternative"] == "torch-bf16"
    assert summary["winner_over_best_alternative"] == pytest.approx(2.0 / 1.6)
    assert summary["best_alternative_back_to_back"] == "torch-fp16"
    assert summary["winner_over_best_alternative_back_to_back"] == pytest.approx(4.8 / 4.0)
    assert summary["headline"] == [
        "winner against the fastest engine within the budget without autotune: 1.25x one launch (torch-bf16), "
        "1.20x back to back (torch-fp16)"
    ]
    # back to back FP32 is the fastest: that timing gets its own line
    slow = {"torch-bf16": one_liner("torch-bf16", 1.6, back_to_back=11.0)}
    winner.back_to_back_ms = 9.8
    lines = summary_of(winner, fp32, slow)["headline"]
    assert lines == [
        "winner against the fastest engine within the budget without autotune: 1.25x one launch (torch-bf16)",
        "no engine within the budget beats FP32 here (back to back)",
    ]


def test_the_cli_prints_the_headline_as_its_last_comparison(capsys):
    references = {"ort-static": one_liner("ort-static", 1.4, drop=0.023), "ort-dynamic": one_liner("ort-dynamic", 0.13)}
    summary = summary_of(FP32, FP32, references)
    row = {"speedup": 1.0, "latency_ms": 1.0, "accuracy": 0.9, "accuracy_drop": 0.0, "status": "ok"}
    summary.update(
        rank=1, plan="fp32 x2", winner=row, fp32_reference=row, references={}, builds=1, cache_hits=0, files=[]
    )
    summary["metric"] = "top1"
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "no engine within the budget beats FP32 here (one launch)\nthe fastest one-liner, ort-static" in out
    assert "ort-dynamic" not in out


def test_a_run_writes_the_headline_fields_and_lines_into_its_summary(tmp_path):
    confirm = {"top_k": 1, "repeats": 3, "rounds": 1}
    config = tiny_config(tmp_path, budget={"builds": 1}, confirm=confirm)
    summary = tune(config, strategy="fp32", isolate=False, progress=False)  # the winner is FP32 itself
    written = json.loads((config.run_dir / "best" / "summary.json").read_text())
    assert written["headline"] == summary["headline"] == headline_lines(summary) != []
    within = {
        name: row["speedup"]
        for name, row in summary["references"].items()
        if row["status"] == "ok" and row["accuracy_drop"] <= config.accuracy_budget
    }
    fastest = max(within.values(), default=0.0)
    fp32_speedup = summary["fp32_reference"]["speedup"]
    assert summary["fp32_beaten"] is (fastest > fp32_speedup)
    if summary["fp32_beaten"]:
        assert summary["best_alternative"] == max(within, key=within.get)
        assert summary["headline"][0].startswith("winner against the fastest engine within the budget")
    else:
        assert summary["best_alternative"] == "fp32" and summary["winner_over_best_alternative"] == pytest.approx(1)
        assert summary["headline"][0].startswith("no engine within the budget beats FP32 here (one launch)")
