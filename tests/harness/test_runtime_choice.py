"""``backend.name: auto``: the runtime chosen from the seeds' timings, and ONNX Runtime where OpenVINO is missing."""

from __future__ import annotations

import importlib.util

import pytest

from autotune import api
from autotune.api import choose_runtime, seed_timings, with_backend
from autotune.harness import runtime_choice
from autotune.harness.runtime_choice import TIE_MARGIN, decide
from autotune.testing import tiny_config
from autotune.tune import tune


def _scripted(speedups, failed=None):
    """A ``measure`` that returns the given timings and records the runtimes it was asked to time."""
    asked = []

    def measure(config, runtimes):
        asked.append(list(runtimes))
        return {r: speedups[r] for r in runtimes if r in speedups}, dict(failed or {})

    return measure, asked


@pytest.fixture()
def both_installed(monkeypatch):
    monkeypatch.setattr(runtime_choice, "installed_runtimes", lambda: (["onnxruntime", "openvino"], {}))


def test_openvino_is_chosen_where_its_int8_seed_is_fastest(tmp_path, both_installed):
    config = tiny_config(tmp_path, backend={"name": "auto"})
    lines = []
    measure, asked = _scripted({"onnxruntime": {"fp32": 1.0, "int8": 0.9}, "openvino": {"fp32": 0.95, "int8": 1.7}})
    chosen, choice = choose_runtime(config, measure, say=lines.append)
    assert asked == [["onnxruntime", "openvino"]]
    assert chosen.backend.name == "openvino" and choice.runtime == "openvino"
    assert chosen.backend.options.reference_runtimes == ["onnxruntime"]
    assert chosen.model_dump(exclude={"backend"}) == config.model_dump(exclude={"backend"})
    assert lines == [choice.line] and "OpenVINO, whose INT8 seed ran 1.70x" in choice.line
    assert "ONNX Runtime's best FP32 1.00x" in choice.line
    assert choice.to_dict()["speedups"]["openvino"] == {"fp32": 0.95, "int8": 1.7}


def test_onnx_runtime_is_chosen_where_its_seeds_are_fastest(tmp_path, both_installed):
    config = tiny_config(tmp_path, backend={"name": "auto"})
    measure, _ = _scripted({"onnxruntime": {"fp32": 1.0, "int8": 1.9}, "openvino": {"fp32": 1.02, "int8": 1.5}})
    chosen, choice = choose_runtime(config, measure)
    assert chosen.backend.name == "onnxruntime"
    assert "ONNX Runtime, whose INT8 seed ran 1.90x" in choice.line and "OpenVINO's best INT8 1.50x" in choice.line


def test_a_tie_within_the_margin_keeps_onnx_runtime_and_a_clear_win_does_not():
    within = 1.0 + TIE_MARGIN / 2
    assert decide({"onnxruntime": {"fp32": 1.0}, "openvino": {"fp32": within}}).runtime == "onnxruntime"
    beyond = 1.0 + TIE_MARGIN * 2
    assert decide({"onnxruntime": {"fp32": 1.0}, "openvino": {"fp32": beyond}}).runtime == "openvino"


def test_a_config_that_names_a_backend_is_not_timed(tmp_path):
    measure, asked = _scripted({})
    for name in ("onnxruntime", "openvino"):
        config = tiny_config(tmp_path, backend={"name": name})
        assert choose_runtime(config, measure) == (config, None)
    assert asked == []


def test_without_openvino_onnx_runtime_is_chosen_in_one_line_without_timing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    measure, asked = _scripted({})
    lines = []
    chosen, choice = choose_runtime(tiny_config(tmp_path, backend={"name": "auto"}), measure, say=lines.append)
    assert chosen.backend.name == "onnxruntime" and asked == []
    assert lines == [
        "backend auto: ONNX Runtime (OpenVINO is not installed (pip install 'autotune[openvino]' to compare it))"
    ]


def test_openvino_that_cannot_build_the_seeds_leaves_onnx_runtime_with_the_reason(tmp_path, both_installed):
    measure, _ = _scripted({"onnxruntime": {"fp32": 1.0, "int8": 1.2}}, {"openvino": "OpenVINO could not build"})
    chosen, choice = choose_runtime(tiny_config(tmp_path, backend={"name": "auto"}), measure)
    assert chosen.backend.name == "onnxruntime" and "OpenVINO could not build" in choice.line


def test_the_seeds_of_both_runtimes_are_timed_against_onnx_runtime_fp32(tmp_path):
    pytest.importorskip("openvino")
    config = tiny_config(tmp_path, backend={"name": "auto"})
    speedups, skipped = seed_timings(config, ["onnxruntime", "openvino"])
    assert skipped == {}
    assert set(speedups) == {"onnxruntime", "openvino"}
    assert all({"fp32", "int8"} <= set(seeds) for seeds in speedups.values())  # all-BF16 too on a BF16 CPU
    assert speedups["onnxruntime"]["fp32"] == 1.0  # the clock
    assert all(0.05 < value < 20 for seeds in speedups.values() for value in seeds.values())


def test_a_run_with_auto_records_the_choice_and_runs_on_the_chosen_runtime(tmp_path, monkeypatch, both_installed):
    def measure(config, runtimes):
        return {"onnxruntime": {"fp32": 1.0, "int8": 1.1}, "openvino": {"fp32": 1.0, "int8": 1.4}}, {}

    monkeypatch.setattr(api, "seed_timings", lambda config, runtimes, splits=None: measure(config, runtimes))
    pytest.importorskip("openvino")
    references = ["ov-default", "ort-static", "ort-dynamic"]  # not NNCF's: its accuracy control takes a while
    config = tiny_config(
        tmp_path, backend={"name": "auto"}, confirm={"top_k": 1, "rounds": 1, "references": references}
    )
    summary = tune(config, strategy="int8", isolate=False, progress=False)
    assert summary["backend_choice"]["runtime"] == "openvino"
    assert summary["backend_choice"]["speedups"]["openvino"]["int8"] == 1.4
    assert summary["int8_arithmetic"]["scheme"] in ("u8s8", "u8s7")  # OpenVINO's probe, not ONNX Runtime's
    run_config = (tmp_path / "runs" / "tiny" / "config.yaml").read_text()
    assert "name: openvino" in run_config  # a resume runs on the chosen runtime
    assert {"ov-default", "ort-static", "ort-dynamic"} <= set(summary["references"])  # both runtimes' one-liners
    assert summary["references"]["ort-static"]["status"] == "ok"


def test_with_backend_changes_only_the_name(tmp_path):
    config = tiny_config(tmp_path, backend={"name": "auto", "intra_op_threads": 1})
    changed = with_backend(config, "openvino", ["onnxruntime"])
    assert changed.backend.name == "openvino" and changed.backend.intra_op_threads == 1
    assert changed.backend.options.reference_runtimes == ["onnxruntime"]
    assert changed.model_dump(exclude={"backend"}) == config.model_dump(exclude={"backend"})


def test_a_model_onnx_runtime_cannot_set_up_stops_the_choice_with_the_runs_own_error(tmp_path):
    from autotune.harness.prepare import SetupError

    config = tiny_config(tmp_path, backend={"name": "auto"})
    broken = config.model_copy(update={"model": config.model.model_copy(update={"onnx": tmp_path / "absent.onnx"})})
    with pytest.raises(SetupError, match="absent.onnx"):
        seed_timings(broken, ["onnxruntime", "openvino"])


def test_a_dumped_cpu_config_switched_to_another_backend_still_validates(tmp_path):
    import yaml

    from autotune.config.schema import ConfigError, dump_config, parse_config

    data = yaml.safe_load(dump_config(tiny_config(tmp_path)))
    assert data["backend"]["options"] == {"reference_runtimes": []}
    data["backend"]["name"] = "tensorrt"
    assert parse_config(data).backend.name == "tensorrt"
    data["backend"]["options"] = {"reference_runtimes": ["openvino"]}  # asked for: TensorRT has no such option
    with pytest.raises(ConfigError, match="reference_runtimes"):
        parse_config(data)


def test_a_lead_clear_in_every_early_round_decides_and_a_narrower_one_does_not():
    ort, ov = "onnxruntime", "openvino"
    minilm_on_avx2 = {(ort, "int8-dynamic"): [1.58, 1.61, 1.60], (ov, "fp32"): [1.04, 1.10, 1.05]}
    assert runtime_choice.clear_leader(minilm_on_avx2) == ort
    cnn_on_avx2 = {(ort, "int8"): [1.00, 1.02, 0.99], (ov, "fp32"): [0.98, 1.0, 1.0], (ov, "int8"): [1.7, 1.75, 1.72]}
    assert runtime_choice.clear_leader(cnn_on_avx2) == ov
    # 18 % ahead by the medians, but one slow round of the leader comes within 15 % of the other's fastest.
    assert runtime_choice.clear_leader({(ort, "int8"): [1.07, 1.10, 1.05], (ov, "int8"): [1.26, 1.20, 1.30]}) is None
    # ONNX Runtime's FP32 model is the clock, 1.0 in every round: OpenVINO's FP32 must lead it too.
    assert runtime_choice.clear_leader({(ov, "fp32"): [1.10, 1.12, 1.10]}) is None
    assert runtime_choice.clear_leader({(ov, "fp32"): [1.20, 1.25, 1.30]}) == ov
    # Fewer rounds than EARLY_ROUNDS decide nothing, however clear.
    assert runtime_choice.clear_leader({(ov, "int8"): [2.0, 2.1][: runtime_choice.EARLY_ROUNDS - 1]}) is None


def _timed_seeds(monkeypatch, round_speedups):
    """``time_seeds`` on two scripted runtimes: each call of the timing returns the next of ``round_speedups``."""
    from autotune.measure.timing import Latency

    calls = []

    def timing(runners, reference, protocol, **timing):
        rounds = round_speedups[len(calls)]
        calls.append(protocol)
        return [Latency(1.0, 0.0, 1.0, 0.0, tuple(rounds[i])) for i in range(len(runners))]

    monkeypatch.setattr(runtime_choice, "side_by_side", timing)
    monkeypatch.setattr(runtime_choice, "seed_runners", lambda runtime: {"fp32": object, "int8": object})
    speedups, _ = runtime_choice.time_seeds(["onnxruntime", "openvino"], lambda runtime: runtime)
    return speedups, calls


def test_a_clear_early_lead_times_only_the_early_rounds(monkeypatch):
    # Runners in order: ONNX Runtime's INT8, OpenVINO's FP32, OpenVINO's INT8 (ONNX Runtime's FP32 is the clock).
    early = [[1.0, 1.02, 0.99], [1.0, 0.98, 1.0], [1.7, 1.75, 1.72]]
    speedups, calls = _timed_seeds(monkeypatch, [early])
    assert len(calls) == 1 and calls[0].rounds == runtime_choice.EARLY_ROUNDS
    assert speedups == {"onnxruntime": {"fp32": 1.0, "int8": 1.0}, "openvino": {"fp32": 1.0, "int8": 1.72}}
    assert decide(speedups).runtime == "openvino"


def test_without_a_clear_early_lead_the_rest_of_the_rounds_are_timed_and_all_of_them_count(monkeypatch):
    early = [[1.07, 1.10, 1.05], [0.95, 0.97, 0.96], [1.26, 1.20, 1.30]]
    rest = [[1.12, 1.11], [0.90, 0.91], [1.31, 1.32]]
    speedups, calls = _timed_seeds(monkeypatch, [early, rest])
    assert [protocol.rounds for protocol in calls] == [runtime_choice.EARLY_ROUNDS, 2]
    # The medians of all five rounds, not of the first three (1.07, 0.96, 1.26).
    assert speedups == {"onnxruntime": {"fp32": 1.0, "int8": 1.10}, "openvino": {"fp32": 0.95, "int8": 1.30}}


def test_each_seed_is_also_built_and_timed_with_the_fusion_knobs_the_models_ops_invite(tmp_path):
    fusion = "skip_layer_norm_fusion"
    plain = tiny_config(tmp_path / "plain")  # an MLP: no LayerNormalization, so the space has no fusion knob
    speedups, _ = seed_timings(plain, ["onnxruntime"])
    assert set(speedups["onnxruntime"]) == {"fp32", "int8"}
    # A config that names the knob keeps it in the space, as a model with a LayerNormalization would.
    named = tiny_config(tmp_path / "named", search={"knobs": {fusion: [True, False]}})
    speedups, _ = seed_timings(named, ["onnxruntime"])
    seeds = {name for name in speedups["onnxruntime"] if " " not in name}
    assert {"fp32", "int8"} <= seeds
    assert set(speedups["onnxruntime"]) - seeds == {f"{seed} ({fusion}=False)" for seed in seeds}
    assert all(0.05 < value < 20 for value in speedups["onnxruntime"].values())


def test_a_variant_seed_is_named_by_its_precision_and_its_knobs_in_the_line():
    ort, ov = "onnxruntime", "openvino"
    variant = runtime_choice.variant_name("int8-dynamic", {"skip_layer_norm_fusion": False})
    assert variant == "int8-dynamic (skip_layer_norm_fusion=False)"
    choice = decide({ort: {"fp32": 1.0, "int8-dynamic": 1.6, variant: 1.9}, ov: {"fp32": 1.1, "int8": 1.8}})
    # The fused kernel's seed alone would have lost to OpenVINO's INT8 (1.6x against 1.8x).
    assert choice.runtime == ort
    assert "whose INT8-DYNAMIC (skip_layer_norm_fusion=False) seed ran 1.90x" in choice.line
    assert "OpenVINO's best INT8 1.80x" in choice.line


def test_the_fusion_variants_are_the_free_knobs_that_need_the_models_ops(tmp_path):
    from dataclasses import replace

    from autotune.capabilities import Knob
    from autotune.testing import tiny_space

    knobs = (
        Knob("fuse", (True, False), free=True, needs_ops=("LayerNormalization",)),
        Knob("pinning", (True, False), free=True),  # every model has it: left to the run
        Knob("level", ("all", "basic")),  # not free: searched
    )
    assert runtime_choice.fusion_variants(replace(tiny_space(), knobs=knobs)) == [{"fuse": False}]
