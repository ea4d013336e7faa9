import re

import numpy as np
import pytest
from PIL import Image

from autotune.report import layer_sensitivities, load_run, report
from autotune.search.reward import meets_budget
from autotune.testing import tiny_config
from autotune.tune import tune


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    config = tiny_config(root, name="rep", budget={"builds": 12})
    tune(config, strategy="random", isolate=False, progress=False)
    return config


def test_report_writes_figures_and_numbers_that_match_the_store(finished_run, tmp_path):
    other = tiny_config(tmp_path, name="other", budget={"builds": 4})
    tune(other, strategy="random", isolate=False, progress=False)
    paths = report([finished_run.run_dir, other.run_dir])
    for key in ("pareto", "progress", "layers"):
        image = Image.open(paths[key])
        assert image.format == "PNG"
        assert image.size[0] >= 700 and image.size[1] >= 450, image.size
        pixels = np.asarray(image.convert("L"))
        assert pixels.std() > 10  # not a blank canvas

    text = paths["report"].read_text()
    data = load_run(finished_run.run_dir)
    ok = [t for t in data.trials if t.ok]
    within = [t for t in ok if meets_budget(t, finished_run.accuracy_budget)]
    assert f"trials built: {len(data.trials)} ({len(data.trials) - len(ok)} failed)" in text
    assert f"within the accuracy budget: {len(within)}" in text
    winner = data.confirmations[data.summary["plan_hash"]]
    assert f"winner: {winner.speedup:.3f}x, drop {winner.accuracy_drop:.5f}" in text
    rows = re.findall(r"^\| (\d+) \| `([0-9a-f]{16})` \| (-?[\d.]+) \| (-?[\d.]+) \|", text, flags=re.M)
    assert len(rows) == len(data.confirmations)
    for _, plan_hash, speedup, drop in rows:
        confirmed = data.confirmations[plan_hash]
        assert float(speedup) == pytest.approx(confirmed.speedup, abs=1e-3)
        assert float(drop) == pytest.approx(confirmed.accuracy_drop, abs=1e-5)
    assert rows[0][1] == data.summary["plan_hash"]


def test_layer_sensitivities_recover_additive_drops(finished_run):
    from autotune.plan import Plan
    from autotune.run.trial import TrialResult

    data = load_run(finished_run.run_dir)
    truth = {"fc1": 0.001, "fc2": 0.03, "fc3": 0.0, "head": 0.005}
    plans = [Plan.make({n: ("int8" if n == only else "fp32") for n in truth}) for only in truth]
    plans.append(Plan.make(dict.fromkeys(truth, "int8")))
    data.trials = [
        TrialResult(plan=p, speedup=1.0, accuracy_drop=sum(truth[n] for n in p.layers_in("int8"))) for p in plans
    ]
    estimates = layer_sensitivities(data)
    for name, value in truth.items():
        assert estimates[name] == pytest.approx(value, abs=1e-5)


def test_report_shows_the_one_liners_beside_the_winner(finished_run):
    paths = report([finished_run.run_dir], profile=False)
    text = paths["report"].read_text()
    data = load_run(finished_run.run_dir)
    assert list(data.references) == ["ort-static", "ort-dynamic"]
    section = text[text.index("## The platform's one-liners") :]
    rows = re.findall(r"^\| (ort-\w+) \| (-?[\d.]+) \| (-?[\d.]+) \| (yes|no) \| (-?[\d.]+) \|", section, flags=re.M)
    assert [row[0] for row in rows] == ["ort-static", "ort-dynamic"], section
    winner = data.confirmations[data.summary["plan_hash"]]
    for name, speedup, drop, within, ratio in rows:
        measured = data.references[name]
        assert float(speedup) == pytest.approx(measured.speedup, abs=1e-3)
        assert float(drop) == pytest.approx(measured.accuracy_drop, abs=1e-5)
        assert (within == "yes") == meets_budget(measured, finished_run.accuracy_budget)
        assert float(ratio) == pytest.approx(winner.speedup / measured.speedup, rel=1e-3)


def test_report_names_the_cpu_its_int8_isa_and_the_int8_scheme_that_ran(finished_run):
    from autotune.backends.int8_kernels import isa_features
    from autotune.backends.onnxruntime import int8_recipe

    data = load_run(finished_run.run_dir)
    assert data.summary["machine"]["isa"] == list(isa_features())
    scheme = data.summary["int8_arithmetic"]
    weight_max = int8_recipe().weight_max
    assert scheme["weight_range"] == [-weight_max, weight_max] and set(scheme["verdicts"]) == {"u8s8", "u8u8", "u8s7"}
    assert scheme["winner_scheme"] == scheme["scheme"]  # the run did not search int8_scheme: the default ran
    text = report([finished_run.run_dir])["report"].read_text()
    assert f"INT8 ISA features: {', '.join(isa_features())}" in text
    assert f"- INT8 scheme: {scheme['scheme']} (weights in [-{weight_max}, {weight_max}]); kernel probe: u8s8: " in text


def test_the_one_liners_table_gets_the_back_to_back_timing_where_the_backend_has_it(tmp_path):
    from autotune.plan import Plan
    from autotune.report import RunData, _reference_lines
    from autotune.run.trial import TrialResult
    from autotune.testing import tiny_config

    layers = ["fc1", "fc2"]
    winner = TrialResult(
        plan=Plan.uniform(layers, "fp8"), speedup=2.0, accuracy_drop=0.001, latency_ms=5.0, back_to_back_ms=4.0
    )
    bf16 = TrialResult(
        plan=Plan.reference_plan(layers, "torch-bf16"),
        speedup=1.6,
        accuracy_drop=0.0,
        latency_ms=6.2,
        back_to_back_ms=5.0,
    )
    config = tiny_config(tmp_path)
    scoring = (config.name, config.metric.name, config.accuracy_budget, config.reward)
    data = RunData(tmp_path, *scoring, [], {}, {}, {"torch-bf16": bf16})
    lines = _reference_lines(data, winner)
    assert lines[3].endswith("| ms one launch | ms back to back | winner over it back to back |")
    assert lines[4].count("---") == lines[3].count(" | ") + 1 == 8
    assert lines[5] == "| (the winner) | 2.000 | 0.00100 | - | - | 5.000 | 4.000 | - |"
    assert lines[6] == "| torch-bf16 | 1.600 | 0.00000 | yes | 1.250 | 6.200 | 5.000 | 1.250 |"
    one_timing = _reference_lines(data, TrialResult(plan=winner.plan, speedup=2.0, accuracy_drop=0.001))
    assert "back to back" not in "\n".join(one_timing)  # no second timer: the table as before


def test_the_report_names_the_winners_int8_scheme_where_it_is_not_the_default():
    from autotune.report import _machine_lines

    arithmetic = {"scheme": "u8s8", "weight_range": [-127, 127], "verdicts": {"u8s8": "u8s8: exact"}}
    assert not any("winner's" in line for line in _machine_lines({"int8_arithmetic": arithmetic}))
    searched = {"int8_arithmetic": {**arithmetic, "winner_scheme": "u8s7"}}
    assert _machine_lines(searched)[-1] == "- the winner's INT8 scheme: u8s7 (`int8_scheme` searched)"
