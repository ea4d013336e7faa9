import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.config.schema import dump_config
from autotune.testing import TINY_MEASURE, tiny_config


@pytest.fixture()
def config_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config(tmp_path)))
    return path


def test_inspect_prints_the_layer_table(config_file, capsys):
    assert main(["inspect", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert "4 tunable layers" in out
    for name in ("fc1", "fc2", "fc3", "head"):
        assert name in out
    assert main(["inspect", str(config_file), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows] == ["fc1", "fc2", "fc3", "head"]
    assert rows[0]["macs"] == 16 * 32 * 64


def test_evaluate_prints_a_measured_result(config_file, capsys, tmp_path):
    assert main(["evaluate", str(config_file), "--plan", "int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "ok"
    assert result["speedup"] == pytest.approx(result["reference_latency_ms"] / result["latency_ms"])
    assert result["accuracy_drop"] == pytest.approx(result["reference_accuracy"] - result["accuracy"])
    assert (tmp_path / "runs" / "tiny" / "evaluate" / result["plan_hash"] / "model.onnx").exists()
    assert set(result["plan"]["precisions"].values()) == {"int8"}


def test_evaluate_takes_a_plan_file_and_rejects_a_bad_one(config_file, capsys, tmp_path):
    plan = {"precisions": {"fc1": "int8", "fc2": "fp32", "fc3": "fp32", "head": "fp32"}, "knobs": {}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["evaluate", str(config_file), "--plan", str(tmp_path / "plan.json")]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["precisions"]["fc1"] == "int8"
    (tmp_path / "bad.json").write_text(json.dumps({"precisions": {"fc1": "fp16"}}))
    assert main(["evaluate", str(config_file), "--plan", str(tmp_path / "bad.json")]) == 2
    assert "fp16 not allowed" in capsys.readouterr().err


def test_config_errors_exit_2_and_name_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nmodel: {onnx: m.onnx}\ndata: {calibration: {random: 1}, evaluation: {random: 1}}\nbudgett: 3\n"
    )
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "budgett" in err and "unknown key" in err


def test_a_backend_that_is_not_available_fails_at_once(config_file, capsys):
    assert main(["tune", str(config_file), "--set", "backend.name=tensorrt", "--no-progress"]) == 2
    assert "tensorrt" in capsys.readouterr().err
    assert not (config_file.parent / "runs" / "tiny").exists()


def test_evaluate_measures_the_backends_one_liners(config_file, capsys, tmp_path):
    import onnx

    from autotune.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    plan_help = next(a for a in commands["evaluate"]._actions if a.dest == "plan").help
    assert "ort-static" in plan_help and "ort-dynamic" in plan_help

    assert main(["evaluate", str(config_file), "--plan", "ort-static", "--split", "holdout"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "ok" and result["split"] == "holdout"
    assert result["plan"]["knobs"] == {"reference": "ort-static"}
    assert result["plan_summary"] == "reference ort-static (the backend's one-liner)"
    assert result["speedup"] == pytest.approx(result["reference_latency_ms"] / result["latency_ms"])
    exported = onnx.load(result["artifact"])
    assert any(node.op_type == "QuantizeLinear" for node in exported.graph.node)

    assert main(["evaluate", str(config_file), "--plan", "tflite"]) == 2
    assert "ort-static/ort-dynamic" in capsys.readouterr().err


def test_the_printed_summary_shows_the_one_liners_beside_fp32_and_the_winner(config_file, capsys):
    assert main(["baseline", str(config_file), "--strategy", "int8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("(held-out data, confirmed)") :].splitlines()[1:5]
    assert [line.split()[0] for line in table] == ["fp32", "ort-static", "ort-dynamic", "winner"], out
    assert all(float(line.split()[1]) > 0 for line in table), out  # a speedup each, no failure


def test_inspect_shows_each_layers_nodes_and_why_an_op_stays_fp32(tmp_path, capsys):
    """A CNN: the conv's ReLU6 is part of its layer, an Add joining two INT8 branches is a layer, a Tanh is not."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from autotune.config.schema import parse_config

    rng = np.random.default_rng(0)

    def conv(x: str, name: str) -> onnx.NodeProto:
        weight = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.2, f"{name}.w")
        inits.append(weight)
        return helper.make_node("Conv", [x, weight.name], [name], name, pads=[1, 1, 1, 1])

    inits = [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    nodes = [
        conv("x", "conv1"),
        helper.make_node("Clip", ["conv1", "lo", "hi"], ["relu6"], "relu6"),
        conv("relu6", "conv2"),
        helper.make_node("Add", ["conv2", "relu6"], ["sum"], "add"),
        helper.make_node("Tanh", ["sum"], ["tanh"], "tanh"),
        conv("tanh", "conv3"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
        [helper.make_tensor_value_info("conv3", TensorProto.FLOAT, [2, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "cnn.onnx"))
    config = parse_config(
        {
            "name": "cnn",
            "model": {"onnx": str(tmp_path / "cnn.onnx")},
            "data": {"calibration": {"random": 1}, "evaluation": {"random": 1}},
            "metric": {"name": "cosine"},
            "runs_dir": str(tmp_path / "runs"),
            "cache_dir": str(tmp_path / "cache"),
        },
        "cnn",
    )
    path = tmp_path / "cnn.yaml"
    path.write_text(dump_config(config))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Conv+Clip" in out and "4 tunable layers" in out
    assert "left in FP32 (1):" in out and "Tanh tanh: no INT8 kernel" in out
    assert main(["inspect", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["name"], row["unit"]) for row in rows] == [
        ("conv1", "Conv+Clip"),
        ("conv2", "Conv"),
        ("add", "Add"),
        ("conv3", "Conv"),
    ]
    assert rows[2]["choices"] == ["fp32", "int8"] and rows[2]["nodes"] == ["add"]


def test_evaluate_measures_several_plans_side_by_side_in_one_process(config_file, capsys, tmp_path):
    assert main(["evaluate", str(config_file), "--plan", "int8", "--plan", "ort-static", "--plan", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["plan", "speedup"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == ["int8", "ort-static", "fp32"]
    assert rows["int8"][6:] == ["-"]  # the first plan is what the others are compared with, round by round
    for row in (rows["ort-static"], rows["fp32"]):  # tiny_config: one round
        assert row[6].endswith("x,") and row[7:9] == ["faster", "in"] and row[9] in ("0/1", "1/1")
        ratio, faster = float(row[6][:-2]), row[9] == "1/1"
        if ratio != 1.0:  # printed to two decimals: a ratio of 1.003 reads 1.00 and was faster
            assert faster == (ratio > 1)

    assert main(["evaluate", str(config_file), "--plan", "int8", "--plan", "ort-static", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["plan_summary"] for r in results][1] == "reference ort-static (the backend's one-liner)"
    assert results[0]["plan"]["knobs"] != results[1]["plan"]["knobs"]
    for result in results:
        assert result["speedup"] == pytest.approx(result["reference_latency_ms"] / result["latency_ms"])
        assert len(result["round_speedups"]) == 1
        assert Path(result["artifact"]).exists()

    # every spec is checked before the first build
    assert main(["evaluate", str(config_file), "--plan", "int8", "--plan", "tflite"]) == 2
    assert "tflite" in capsys.readouterr().err


def test_a_constant_weight_model_inspects_and_evaluates_as_its_initializer_twin(tmp_path, capsys):
    """A model whose weights are all Constant nodes: the table and the all-INT8 result of its initializer twin."""
    import onnx

    from autotune.config.schema import parse_config
    from autotune.testing import constant_weight_twins

    rows, texts, results = {}, {}, {}
    for name, model in zip(("constants", "initializers"), constant_weight_twins(), strict=True):
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
        config = parse_config(
            {
                "name": name,
                "model": {"onnx": str(tmp_path / f"{name}.onnx")},
                "data": {"calibration": {"random": 2}, "evaluation": {"random": 2}},
                "metric": {"name": "cosine"},
                "measure": dict(TINY_MEASURE),
                "runs_dir": str(tmp_path / name / "runs"),
                "cache_dir": str(tmp_path / name / "cache"),
            },
            name,
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_config(config))
        assert main(["inspect", str(path), "--json"]) == 0
        rows[name] = json.loads(capsys.readouterr().out)
        assert main(["inspect", str(path)]) == 0
        texts[name] = capsys.readouterr().out
        assert main(["evaluate", str(path), "--plan", "int8"]) == 0
        results[name] = json.loads(capsys.readouterr().out)

    def table(name: str) -> list[dict]:  # the FP32 shares are timings, which differ from run to run
        return [{k: v for k, v in row.items() if k not in ("runtime_share", "weight_source")} for row in rows[name]]

    assert [row["name"] for row in rows["constants"]] == ["conv", "fc", "head"]
    assert table("constants") == table("initializers")
    assert [row["weight_source"] for row in rows["constants"]] == [
        "Constant",
        "Constant+Transpose",
        "Constant+Cast+Reshape",
    ]
    assert [row["weight_source"] for row in rows["initializers"]] == ["initializer"] * 3
    assert "weight from" in texts["constants"] and " Constant+Transpose " in texts["constants"]
    constants, initializers = results["constants"], results["initializers"]
    assert constants["status"] == initializers["status"] == "ok"
    assert constants["plan"] == initializers["plan"] and set(constants["plan"]["precisions"].values()) == {"int8"}
    for key in ("accuracy", "reference_accuracy", "accuracy_drop"):
        assert constants[key] == initializers[key], key


def test_evaluate_in_process_runs_the_trial_in_this_process(config_file, monkeypatch):
    """Under qemu-user a child process started by exec runs natively: --in-process keeps the trial emulated."""
    from autotune import api

    seen = []
    monkeypatch.setattr(
        api, "evaluate_side_by_side", lambda *args, **kwargs: seen.append(kwargs["isolate"]) or [{"status": "ok"}]
    )
    main(["evaluate", str(config_file), "--plan", "int8", "--in-process"])
    main(["evaluate", str(config_file), "--plan", "int8"])
    assert seen == [False, True]


def test_the_printed_summary_shows_both_timings_and_both_ratios_where_the_backend_has_them(capsys):
    from autotune.cli import _print_summary

    def row(speedup, latency, back_to_back):
        return {"speedup": speedup, "latency_ms": latency, "accuracy": 0.99, "accuracy_drop": 0.001,
                "back_to_back_ms": back_to_back, "status": "ok"}  # fmt: skip

    summary = {
        "rank": 1, "plan": "fp8 x30", "winner": row(2.0, 5.0, 4.0), "fp32_reference": row(1.0, 10.0, 9.5),
        "references": {"torch-bf16": row(1.6, 6.2, 5.0)}, "best_alternative": "torch-bf16",
        "winner_over_best_alternative": 1.25, "fp32_beaten": True, "best_alternative_back_to_back": "torch-bf16",
        "winner_over_best_alternative_back_to_back": 1.25, "fp32_beaten_back_to_back": True,
        "accuracy_budget": 0.002, "metric": "cosine", "builds": 5, "cache_hits": 0, "files": [],
    }  # fmt: skip
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "ms b2b" in out and "      4.000" in out
    assert "without autotune: 1.25x one launch (torch-bf16), 1.25x back to back (torch-bf16)" in out
    summary["winner"]["back_to_back_ms"] = summary["winner_over_best_alternative_back_to_back"] = None
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "ms b2b" not in out and "without autotune: 1.25x one launch (torch-bf16)\n" in out


def test_the_printed_summarys_columns_stay_aligned_beside_a_long_one_liner_name(capsys):
    from autotune.cli import _print_summary

    row = {"speedup": 2.0, "latency_ms": 5.0, "accuracy": 0.99, "accuracy_drop": 0.001, "status": "ok"}
    summary = {
        "rank": 1, "plan": "int8 x10", "winner": row, "fp32_reference": row,
        "references": {"nncf-accuracy-control": row, "ov-default": row}, "headline": [],
        "accuracy_budget": 0.002, "metric": "cosine", "builds": 5, "cache_hits": 0, "files": [],
    }  # fmt: skip
    _print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if "(held-out data, confirmed)" in line)) :][:5]
    # every row's speedup ends where the header's does
    assert (
        len(
            {line.index("speedup") + len("speedup") for line in table[:1]}
            | {line.index("2.00") + 4 for line in table[1:]}
        )
        == 1
    )


def test_resume_set_continues_a_finished_run_to_a_larger_budget_and_refuses_other_keys(
    config_file, capsys, monkeypatch
):
    import functools

    import yaml

    import autotune.cli

    monkeypatch.setattr(autotune.cli, "tune", functools.partial(autotune.cli.tune, isolate=False))  # no child process
    assert main(["baseline", str(config_file), "--strategy", "random", "--budget", "2", "--no-progress"]) == 0
    run_dir = config_file.parent / "runs" / "tiny-random-s0"
    assert "builds 2," in capsys.readouterr().out

    assert main(["resume", str(run_dir), "--set", "model.onnx=other.onnx", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.onnx" in err and "budget.*" in err and f"--from {run_dir}" in err
    assert main(["resume", str(run_dir), "--set", "budget.builds=0", "--no-progress"]) == 2
    assert "budget.builds" in capsys.readouterr().err
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["budget"]["builds"] == 2  # refused: unchanged

    assert main(["resume", str(run_dir), "--set", "budget.builds=3", "--no-progress"]) == 0
    assert "builds 3," in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["builds"] == 3
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["budget"]["builds"] == 3  # a later resume keeps it


def test_evaluate_says_in_one_line_when_other_work_got_in_the_way_of_its_timing(capsys):
    from autotune.cli import _say_busy

    busy = {"rounds": 9, "counted": 4, "contended": 5, "others": 0.46, "waited": 0.3, "cpus": "0-1", "quiet": True}
    _say_busy([{"status": "ok", "busy": busy}, {"status": "ok", "busy": busy}])
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "autotune: note: the machine was busy (other processes took 46% of cores 0-1; other work got in the way of "
        "the timed threads in 5 of 9 rounds); timings extended to 4 quiet rounds"
    ]
    _say_busy([{"status": "ok", "busy": {**busy, "contended": 0}}, {"status": "failed", "busy": None}])
    assert capsys.readouterr().err == ""


@pytest.fixture()
def model_and_samples(tmp_path, monkeypatch):
    """``tiny_sequence_model`` and 40 samples of it in ``tmp_path``, the working directory (runs/ goes there)."""
    import onnx

    from autotune.testing import tiny_sequence_model, write_sequence_samples

    monkeypatch.chdir(tmp_path)
    onnx.save(tiny_sequence_model(), "model.onnx")
    write_sequence_samples(tmp_path / "samples.npz", samples=40, seq=12)
    return "model.onnx", "samples.npz"


QUICK = ["--set", "measure.settle_s=0", "--set", "measure.rounds=1", "--set", "confirm.rounds=1"]
QUICK += ["--set", "confirm.top_k=2", "--set", "confirm.self_check=false", "--set", "ppo.imagined_episodes=16"]
"""A few builds of a tiny model timed in one round: what the tests need, not what a user would run."""


def test_init_writes_the_config_that_tune_takes_unchanged(model_and_samples, capsys, tmp_path):
    from autotune.config.auto import draft_config
    from autotune.config.schema import load_config, parse_config

    model, samples = model_and_samples
    assert main(["init", model, "--data", samples]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# autotune config for model.onnx") and "\n# Read from the graph" in out
    (tmp_path / "my.yaml").write_text(out)
    assert load_config(tmp_path / "my.yaml") == parse_config(draft_config(model, samples).data)
    assert main(["inspect", "my.yaml"]) == 0
    assert main(["inspect", model, "--data", samples]) == 0
    assert capsys.readouterr().out.count("1 tunable layers") == 2
    assert main(["init", model, "--data", samples, "--set", "budget.builds=7"]) == 0
    (tmp_path / "seven.yaml").write_text(capsys.readouterr().out)
    assert load_config(tmp_path / "seven.yaml").budget.builds == 7


def test_a_model_file_and_its_samples_evaluate_tune_resume_export_and_report(model_and_samples, capsys, monkeypatch):
    import functools

    import autotune.cli
    from autotune.config.schema import load_config

    monkeypatch.setattr(autotune.cli, "tune", functools.partial(autotune.cli.tune, isolate=False))  # no child process
    model, samples = model_and_samples
    assert main(["evaluate", model, "--data", samples, "--plan", "int8", "--in-process", *QUICK]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "ok" and result["plan"]["precisions"] == {"proj": "int8"}
    assert main(["tune", model, "--data", samples, "--set", "budget.builds=2", *QUICK, "--no-progress"]) == 0
    assert "builds 2," in capsys.readouterr().out
    run = load_config("runs/model/config.yaml")  # the resolved config: the run's own from now on
    assert run.data.evaluation.start == 8 and run.inputs[0].shape == [8, 12, 16]
    assert main(["resume", "runs/model", "--set", "budget.builds=3", "--no-progress"]) == 0
    assert "builds 3," in capsys.readouterr().out
    assert main(["export", "runs/model", "--out", "exported"]) == 0
    assert json.loads(capsys.readouterr().out)["files"]
    assert main(["report", "runs/model"]) == 0
    assert "report: runs/model/report.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["tune", "model.onnx"], "give its samples with --data SAMPLES.npz"),
        (["tune", "model.onnx", "--data", "absent.npz"], "absent.npz does not exist"),
        (["evaluate", "model.onnx", "--data", "samples.npz", "--shape", "x=8x12x17"], "does not fit the model's"),
        (["init", "other.onnx", "--data", "samples.npz"], "other.onnx does not exist: check the path"),
        (["init", "configs.yaml", "--data", "samples.npz"], "autotune init takes an ONNX model file"),
        (["inspect", "configs.yaml", "--data", "samples.npz"], "--data, --shape and --metric go with a model file"),
    ],
)
def test_bad_input_for_a_model_file_is_one_line_naming_the_fix(model_and_samples, capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
