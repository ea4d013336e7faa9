import json

import pytest

from autotune.cli import main
from autotune.config import dump_config
from autotune.testing import tiny_config


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
