"""bench/gpu.py on the CPU: its command line, plan specs, tables and ratios, results files, and failures as rows."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402
from gpu import resolve  # noqa: E402

from autotune.api import analyze  # noqa: E402
from autotune.config.schema import dump_config  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.run.store import TrialStore  # noqa: E402
from autotune.run.trial import BACK_TO_BACK, ONE_LAUNCH, TrialResult, ratio  # noqa: E402
from autotune.testing import tiny_torch_config  # noqa: E402

BUDGET = 0.01


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    return analyze(tiny_torch_config(tmp_path_factory.mktemp("torch")), profile=False)[1]


@pytest.fixture
def quiet(monkeypatch):
    """No torch import or nvidia-smi for the environment, and the import path and variables left as they were."""
    monkeypatch.setattr(gpu, "environment", lambda: {"device": "test device"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setenv("AUTOTUNE_OWNS_DEVICES", "")


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny-torch.yaml"
    path.write_text(dump_config(tiny_torch_config(tmp_path / "data", accuracy_budget=0.05)))
    return path


def _entry(speedup, back_to_back_ms, drop, **extra):
    timings = {"speedup": speedup, "latency_ms": 10.0 / speedup, "back_to_back_ms": back_to_back_ms}
    return {**timings, "accuracy_drop": drop, "split": "holdout", **extra}


def fake_summary():
    """The shape of a run's summary.json: torch-fp16 failed, torchao-fp8 is fastest but outside the budget."""
    return {
        "plan": "fp16 x36; attention=sdpa",
        "winner": _entry(6.0, 0.9, 0.002),
        "fp32_reference": _entry(1.0, 9.0, 0.0),
        "references": {
            "torch-tf32": _entry(2.0, 0.95, 0.0, status="ok", error=None, plan_hash="a"),
            "torch-fp16": {"plan_hash": "b", "status": "failed", "error": "Traceback\nBuildError: no|fp16 kernel"},
            "torch-bf16": {**_entry(5.0, 1.0, 0.001, status="ok", error=None, plan_hash="c"), "build_s": 6.25},
            "torchao-fp8": _entry(8.0, 0.5, 0.5, status="ok", error=None, plan_hash="d"),
        },
        "accuracy_budget": BUDGET,
        "builds": 7,
        "wall_s": 127.6,
        "self_check": {"search": {"ratio": 0.9996, "within_band": True}, "band": [0.97, 1.03]},
        "setup_s": 41.3,
        "setup_stages_s": {"analyze": 1.5, "evaluator": 39.8},
    }


def _result(entry, name="x"):
    """What ``ratio`` reads of a summary entry, built here independently of the script."""
    return TrialResult(
        Plan.reference_plan([], name), speedup=entry["speedup"], back_to_back_ms=entry["back_to_back_ms"]
    )


# ---- the command line --------------------------------------------------------------------------------------


def test_tune_splits_its_configs_at_each_double_dash():
    args = gpu.parse_args(
        ["tune", "--out", "o", "--time-limit", "30", "a.yaml", "--set", "x=1"]
        + ["--", "b.yaml", "--set", "y=2", "--set", "z=3", "--", "c.yaml"]
    )
    assert args.command == "tune" and args.out == Path("o") and args.time_limit == 30
    assert args.runs == [("a.yaml", ["x=1"]), ("b.yaml", ["y=2", "z=3"]), ("c.yaml", [])]


def test_a_group_after_double_dash_takes_only_a_config_and_overrides(capsys):
    with pytest.raises(SystemExit):
        gpu.parse_args(["tune", "--out", "o", "a.yaml", "--", "b.yaml", "--time-limit", "5"])
    assert "unrecognized arguments: --time-limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.parse_args(["tune", "--out", "o", "a.yaml", "--"])  # a group without its config
    with pytest.raises(SystemExit):
        gpu.parse_args(["tune", "a.yaml"])  # --out is required


def test_plans_and_gemm_arguments():
    args = gpu.parse_args(
        ["plans", "--out", "o", "c.yaml", "--plans", "fp16", "fp8@ffn:attention=sdpa", "--set", "a=b"]
        + ["--references", "torch-fp16"]
    )
    assert args.command == "plans" and args.runs == [("c.yaml", ["a=b"])]
    assert args.plans == ["fp16", "fp8@ffn:attention=sdpa"] and args.references == ["torch-fp16"]
    assert gpu.parse_args(["plans", "--out", "o", "c.yaml", "--plans", "int8"]).references is None  # all offered
    args = gpu.parse_args(["gemm", "--out", "o", "--repeats", "5", "--time-limit", "100"])
    assert (args.command, args.repeats, args.time_limit, args.runs) == ("gemm", 5, 100, [])
    with pytest.raises(SystemExit):
        gpu.parse_args(["plans", "--out", "o", "c.yaml"])  # --plans is required
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "o"])  # no subcommand


def test_knobs_parse_as_yaml_and_refuse_what_is_not_name_value():
    knobs = gpu.parse_knobs(["tf32=true", "gemm_backends=ATEN,TRITON", " mode =compile"])
    assert knobs == {"tf32": True, "gemm_backends": "ATEN,TRITON", "mode": "compile"}
    with pytest.raises(ValueError, match="name=value"):
        gpu.parse_knobs(["tf32"])


# ---- plan specs (carried over from bench/gpu_oneliners.py) -------------------------------------------------


def test_a_plan_file_resolves_to_the_plan_it_holds(space, tmp_path):
    first = space.layer_names[0]
    plan = space.plan({first: "fp32"}, {"base_precision": "bf16"})
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    resolved = resolve(str(path), space)
    assert resolved.hash == plan.hash
    assert resolved.precision_map[first] == "fp32" and resolved.knob("base_precision") == "bf16"


def test_a_spec_sets_matching_layers_and_the_base_elsewhere(space):
    first = space.layer_names[0]
    plan = resolve(f"fp16@^{first}$:base_precision=bf16", space)
    assert plan.precision_map[first] == "fp16"
    for name, options in list(zip(space.layer_names, space.choices, strict=True))[1:]:
        assert plan.precision_map[name] == ("bf16" if "bf16" in options else "fp32")
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        resolve("fp64", space)


# ---- tune: the table of a run's summary ---------------------------------------------------------------------


def test_the_tune_table_has_every_row_and_the_ratios_of_trial_ratio():
    summary = fake_summary()
    table = gpu.tune_table(summary)
    rows = {row["row"]: row for row in table["rows"]}
    assert list(rows) == ["FP32", "torch-tf32", "torch-fp16", "torch-bf16", "torchao-fp8", "winner"]
    assert rows["torch-fp16"]["status"] == "failed" and "no|fp16" in rows["torch-fp16"]["error"]
    assert rows["winner"]["within_budget"] is True and rows["torchao-fp8"]["within_budget"] is False
    assert rows["winner"]["back_to_back_ms"] == 0.9 and rows["winner"]["latency_ms"] == pytest.approx(10 / 6)
    winner, references = _result(summary["winner"]), summary["references"]
    # One launch the fastest one-liner within the budget is torch-bf16; back to back it is torch-tf32; torchao-fp8
    # is faster than the winner but outside the budget, and torch-fp16 failed.
    one_launch = ratio(_result(references["torch-bf16"]), winner, ONE_LAUNCH)
    back_to_back = ratio(_result(references["torch-tf32"]), winner, BACK_TO_BACK)
    assert table["ratios"][ONE_LAUNCH] == {"ratio": pytest.approx(one_launch), "one_liner": "torch-bf16"}
    assert table["ratios"][BACK_TO_BACK] == {"ratio": pytest.approx(back_to_back), "one_liner": "torch-tf32"}
    assert one_launch == pytest.approx(1.2) and back_to_back == pytest.approx(0.95 / 0.9)

    text = "\n".join(gpu.run_markdown({"kind": "tune", "config": "minilm-gpu-b64", **table}))
    assert "| row | one launch ms | back to back ms | drop | within budget | build s |" in text
    assert "| torch-fp16 | failed: BuildError: no\\|fp16 kernel | - | - | - | - |" in text  # one line, escaped
    assert "| winner | 1.6667 | 0.9000 | 0.002 | yes | - |" in text  # a summary without build times
    assert "| torchao-fp8 | 1.2500 | 0.5000 | 0.5 | NO | - |" in text
    assert "| torch-bf16 | 2.0000 | 1.0000 | 0.001 | yes | 6.2 |" in text
    assert "within the budget (0.01): one launch 1.20x (torch-bf16), back to back 1.06x (torch-tf32)." in text
    assert "Set-up: 41.3 s (analyze 1.5 s, evaluator 39.8 s)." in text and "Builds: 7." in text
    assert "search 1.000 (within the band)" in text


def test_a_summary_without_the_new_fields_or_a_one_liner_within_the_budget():
    summary = fake_summary()
    for key in ("setup_s", "setup_stages_s", "fp32_reference"):
        del summary[key]
    summary["references"] = {"torchao-fp8": summary["references"]["torchao-fp8"]}
    table = gpu.tune_table(summary)
    assert [row["row"] for row in table["rows"]] == ["torchao-fp8", "winner"]
    assert table["ratios"] == {timing: {"ratio": None, "one_liner": None} for timing in (ONE_LAUNCH, BACK_TO_BACK)}
    text = "\n".join(gpu.run_markdown({"kind": "tune", "config": "x", **table}))
    assert "one launch - (none), back to back - (none)" in text and "Set-up" not in text


def test_the_winner_of_plans_is_the_fastest_within_the_budget():
    results = {
        "fast but inaccurate": TrialResult(Plan.make({}), speedup=9.0, accuracy_drop=0.5),
        "failed": TrialResult.failure(Plan.make({}), "BuildError: x"),
        "slower": TrialResult(Plan.make({}), speedup=2.0, accuracy_drop=0.0),
        "fastest within": TrialResult(Plan.make({}), speedup=3.0, accuracy_drop=BUDGET),
    }
    assert gpu.fastest_within(results, BUDGET) == "fastest within"
    assert gpu.fastest_within({"failed": results["failed"]}, BUDGET) is None


def _store_with_builds(path: Path) -> None:
    layers = ["a", "b"]
    with TrialStore(path) as store:
        for precision, build_s, first_call in (("fp16", 10.0, 8.0), ("bf16", 20.0, 12.0)):
            stages = {"rewrite": 0.5, "first_call": first_call, "capture": 1.0}
            store.put(TrialResult(plan=Plan.uniform(layers, precision), build_s=build_s, build_stages_s=stages))
        store.put(TrialResult.failure(Plan.uniform(layers, "int8"), "BuildError: x"))  # no build seconds
        imported = TrialResult(plan=Plan.uniform(layers, "fp8"), build_s=99.0, build_stages_s={"first_call": 99.0})
        store.put_imported(imported, "an earlier run")


def test_build_times_are_the_runs_own_builds_and_their_compile_share_and_the_store_keeps_the_set_up(tmp_path):
    from autotune.run.meta import RunMeta

    _store_with_builds(tmp_path / "trials.sqlite")
    times = gpu.build_times(tmp_path / "trials.sqlite")
    builds = {"trials": 2, "build_min_s": 10.0, "build_max_s": 20.0, "build_median_s": 15.0}
    builds["compile_share"] = pytest.approx(20 / 30)
    assert times == {**builds, "setup_s": None, "setup_stages_s": {}}  # no set-up recorded yet
    with TrialStore(tmp_path / "trials.sqlite") as store:  # a run cut after its set-up, before its summary
        RunMeta.write(store, setup_s=55.0, setup_stages_s={"analyze": 20.0})
    run = {"config": "cut", "kind": "tune", "rows": [], "build_times": gpu.build_times(tmp_path / "trials.sqlite")}
    assert "Set-up: 55.0 s (analyze 20.0 s)." in gpu.run_markdown(run)


def test_tune_runs_each_config_and_writes_its_rows_after_every_run(tmp_path, config_file, quiet, monkeypatch):
    """The child is a stand-in for ``autotune tune`` that writes the summary; the first config does not exist."""
    out = tmp_path / "out"
    run_dir = out / "runs" / "tiny-torch"
    _store_with_builds(run_dir / "trials.sqlite")
    source = tmp_path / "summary.json"
    source.write_text(json.dumps(fake_summary()))
    copy = "import shutil, sys; print('tuning'); shutil.copy(sys.argv[1], sys.argv[2])"
    commands = []

    def fake_tune(config_path, overrides):
        commands.append((config_path, overrides))
        return [sys.executable, "-c", copy, str(source), str(run_dir / "summary.json")]

    monkeypatch.setattr(gpu, "tune_command", fake_tune)
    written, write = [], gpu.write

    def write_and_read(results, folder):
        write(results, folder)
        assert not list(folder.glob("*.tmp"))  # replaced whole
        written.append([len(run["rows"]) for run in json.loads((folder / "gpu.json").read_text())["runs"]])

    monkeypatch.setattr(gpu, "write", write_and_read)
    missing = str(tmp_path / "missing.yaml")
    assert gpu.main(["tune", "--out", str(out), missing, "--", str(config_file), "--set", "budget.builds=3"]) == 0
    assert written[0] == [] and [1] in written and written[-1] == [1, 6]  # the failure was written before the run
    assert commands == [(str(config_file), [f"runs_dir={(out / 'runs').resolve()}", "budget.builds=3"])]
    results = json.loads((out / "gpu.json").read_text())
    failed, tuned = results["runs"]
    assert failed["config"] == "missing" and failed["rows"][0]["status"] == "error"
    assert "missing.yaml" in failed["rows"][0]["error"]
    assert tuned["config"] == "tiny-torch" and tuned["exit_code"] == 0 and not tuned["interrupted"]
    assert tuned["ratios"][ONE_LAUNCH]["ratio"] == pytest.approx(1.2) and tuned["build_times"]["trials"] == 2
    assert (out / "tiny-torch.log").read_text() == "tuning\n"
    text = (out / "gpu.md").read_text()
    assert "### missing (tune)" in text and "### tiny-torch (tune)" in text
    assert "Builds: 7, 10.0-20.0 s (median 15.0 s) each; compile 67 % of the build time." in text
    assert "Run: exit 0, " in text and "(the run's wall_s 128 s)." in text


def test_the_time_limit_interrupts_a_run_and_starts_no_other(tmp_path, config_file, quiet, monkeypatch):
    # The child takes Ctrl-C's default action whatever the test process left SIGINT at (ignored, it is inherited)
    child = (
        "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); print('started', flush=True)"
    )
    sleep = [sys.executable, "-c", child + "; time.sleep(60)"]
    monkeypatch.setattr(gpu, "tune_command", lambda config_path, overrides: sleep)
    out = tmp_path / "out"
    # 6 s: loading the config in a large test process can take over a second
    gpu.main(["tune", "--out", str(out), "--time-limit", "6", str(config_file), "--", str(config_file)])
    results = json.loads((out / "gpu.json").read_text())
    interrupted, skipped = results["runs"]
    assert interrupted["interrupted"] and interrupted["exit_code"] != 0
    assert interrupted["rows"][0]["status"] == "interrupted" and "no summary.json" in interrupted["rows"][0]["error"]
    assert skipped["rows"][0]["status"] == "skipped" and "exit_code" not in skipped
    assert results["wall_s"] < 20
    assert "stopped by --time-limit (SIGINT)" in (out / "gpu.md").read_text()


# ---- plans, end to end on the CPU ---------------------------------------------------------------------------


def test_plans_measures_plans_and_one_liners_side_by_side(tmp_path, config_file, quiet):
    out = tmp_path / "out"
    argv = ["plans", "--out", str(out), str(config_file), "--plans", "fp16", "int8", "fp64"]
    assert gpu.main([*argv, "--references", "torch-fp16", "torch-bf16", "torch-nonesuch"]) == 0
    run = json.loads((out / "gpu.json").read_text())["runs"][0]
    rows = {row["row"]: row for row in run["rows"]}
    assert list(rows) == ["FP32", "torch-fp16", "torch-bf16", "torch-nonesuch", "fp16", "int8", "fp64"]
    assert rows["fp64"]["status"] == "error" and "fp64" in rows["fp64"]["error"]
    assert rows["torch-nonesuch"]["status"] == "failed" and "no reference" in rows["torch-nonesuch"]["error"]
    measured = [rows[name] for name in ("FP32", "torch-fp16", "torch-bf16", "fp16", "int8")]
    assert all(row["status"] == "ok" and row["latency_ms"] > 0 for row in measured)
    assert all(row["back_to_back_ms"] > 0 for row in measured)  # the CPU times back to back by the wall clock
    assert rows["FP32"]["speedup"] == 1.0 and rows["FP32"]["accuracy_drop"] == 0.0
    for row in measured[1:]:  # timed in the same rounds as FP32, one launch and back to back
        assert row["reference_latency_ms"] == rows["FP32"]["latency_ms"]
        assert row["reference_back_to_back_ms"] == rows["FP32"]["back_to_back_ms"]
    within = [name for name in ("fp16", "int8") if rows[name]["within_budget"]]
    winner = max(within, key=lambda name: rows[name]["speedup"])
    assert run["winner_plan"].startswith(f"{winner}: ")
    results = {name: _result(rows[name], name) for name in [*within, "torch-fp16", "torch-bf16"]}
    one_liners = [name for name in ("torch-fp16", "torch-bf16") if rows[name]["within_budget"]]
    for timing in (ONE_LAUNCH, BACK_TO_BACK):
        expected = min(ratio(results[name], results[winner], timing) for name in one_liners)
        assert run["ratios"][timing]["ratio"] == pytest.approx(expected)
    text = (out / "gpu.md").read_text()
    assert "### tiny-torch (plans)" in text and "| fp64 | error: plan fp64: ValueError:" in text
    assert "Winner over the fastest one-liner within the budget (0.05): one launch " in text
    assert f"Set-up: {run['setup_s']:.1f} s." in text


def test_plans_of_a_config_that_does_not_exist_is_a_row(tmp_path, quiet):
    out = tmp_path / "out"
    assert gpu.main(["plans", "--out", str(out), str(tmp_path / "nope.yaml"), "--plans", "fp16"]) == 0
    run = json.loads((out / "gpu.json").read_text())["runs"][0]
    assert run["config"] == "nope" and [row["status"] for row in run["rows"]] == ["error"]
    assert "| nope | error: " in (out / "gpu.md").read_text()


# ---- gemm ---------------------------------------------------------------------------------------------------


def test_the_gemm_table_gives_bf16_over_each_kernel():
    row = {"m": 8192, "k": 1024, "n": 4096, "ms": {"bf16": 0.2, "fp8_rowwise_gemm": 0.1, "int8_quant": 0.4}}
    row.update(over_bf16={"fp8_rowwise_gemm": 2.0, "int8_quant": 0.5}, errors={"int8_gemm": "RuntimeError: a|b"})
    text = "\n".join(gpu.gemm_markdown([row]))
    assert "| 8192 | 1024 | 4096 | 0.2000 | 0.1000 (2.00x) | - | - | - | 0.4000 (0.50x) |" in text
    assert "int8_gemm: RuntimeError: a\\|b" in text


def test_gemm_without_cuda_writes_a_row_with_its_error_per_shape(tmp_path, quiet):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the path without a GPU")
    out = tmp_path / "out"
    assert gpu.main(["gemm", "--out", str(out), "--repeats", "1"]) == 0
    results = json.loads((out / "gpu.json").read_text())
    assert len(results["gemm"]) == len(gpu.GEMM_M) * len(gpu.GEMM_KN)
    assert all(row["errors"]["*"] and not row["ms"] for row in results["gemm"])
    assert "| 1024 | 384 | 384 | - |" in (out / "gpu.md").read_text()


def test_table_renders_runs_already_made_and_a_missing_one_as_a_row(tmp_path):
    summary = tmp_path / "kept_summary.json"
    summary.write_text(json.dumps(fake_summary()))
    assert gpu.main(["table", "--out", str(tmp_path / "out"), str(summary), str(tmp_path / "missing")]) == 0
    runs = json.loads((tmp_path / "out" / "gpu.json").read_text())["runs"]
    assert [run["config"] for run in runs] == ["kept_summary", "missing"]
    assert runs[0]["ratios"] == gpu.tune_table(fake_summary())["ratios"]
    assert runs[1]["rows"][0]["status"] == "error" and "FileNotFoundError" in runs[1]["rows"][0]["error"]
    assert "Builds: 7." in (tmp_path / "out" / "gpu.md").read_text()
