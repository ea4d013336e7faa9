"""Layerwise calibration: per-layer ranges in the rewriter, the per-layer choice, its cache, the evaluator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.evaluate import TrialRunner
from autotune.metrics import snr_db
from autotune.model import prepare_model
from autotune.plan import Plan
from autotune.quant import layerwise
from autotune.quant.calibrate import DEFAULT_SETTINGS, Calibration, TensorStats
from autotune.quant.layerwise import LayerwiseChoices, choose_layer_methods, choose_methods
from autotune.quant.qparams import activation_qparams
from autotune.quant.recipe import ORT_X86
from autotune.quant.rewrite import RewriteError, rewrite, smooth_weight
from autotune.testing import tiny_config


def _fanout_model() -> onnx.ModelProto:
    """X feeds two weight MatMuls (like q and k reading one LayerNorm output); their sum is the output."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.normal(size=(16, 16)) * 0.3).astype(np.float32), name) for name in ("Wa", "Wb")
    ]
    nodes = [
        helper.make_node("MatMul", ["X", "Wa"], ["a"], "a"),
        helper.make_node("MatMul", ["X", "Wb"], ["b"], "b"),
        helper.make_node("Add", ["a", "b"], ["Y"], "sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "fanout",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [512, 16])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [512, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _calibration(batches) -> Calibration:
    stats = TensorStats.from_batch(batches[0]["X"])
    for batch in batches[1:]:
        stats.update(batch["X"])
    return Calibration({"X": stats}, DEFAULT_SETTINGS)


def _q_scale(model: onnx.ModelProto, layer: str) -> float:
    """The scale of the QuantizeLinear dedicated to ``layer``'s activation input."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.name.startswith(f"{layer}__"))
    return float(inits[node.input[1]])


def _batches(seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(2):
        x = rng.normal(size=(512, 16)).astype(np.float32)
        x[0, 0] = 40.0  # an outlier: max keeps it, entropy clips it
        batches.append({"X": x})
    return batches


def test_choose_methods_takes_the_smallest_error_and_the_first_of_equals():
    errors = {("l1", "max"): 3.0, ("l1", "percentile"): 1.0, ("l1", "entropy"): 2.0}
    errors |= {("l2", "max"): 1.0, ("l2", "percentile"): 1.0, ("l2", "entropy"): 1.0}
    choices = choose_methods(["l1", "l2"], ["max", "percentile", "entropy"], lambda *key: errors[key])
    assert choices == {"l1": "percentile", "l2": "max"}
    with pytest.raises(ValueError, match="at least one"):
        choose_methods(["l1"], [], lambda *key: 0.0)


def test_rewrite_gives_two_readers_of_one_tensor_their_own_ranges():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    plan = Plan.make({"a": "int8", "b": "int8"})
    wide, narrow = {"X": (-8.0, 8.0)}, {"X": (-1.0, 1.0)}
    out = rewrite(loaded.proto, loaded.layers, plan, wide, ORT_X86, layer_ranges={"b": narrow})
    onnx.checker.check_model(out, full_check=True)
    assert _q_scale(out, "a") == pytest.approx(float(activation_qparams(-8.0, 8.0, "uint8")[0]))
    assert _q_scale(out, "b") == pytest.approx(float(activation_qparams(-1.0, 1.0, "uint8")[0]))


def test_choices_minimise_the_measured_output_error_and_come_back_from_the_cache(tmp_path, monkeypatch):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _batches()
    calibration = _calibration(batches)
    methods = ("max", "entropy")
    chosen = choose_layer_methods(
        loaded.proto, loaded.layers, ORT_X86, calibration, batches, cache_dir=tmp_path, model_hash="m", methods=methods
    )
    assert set(chosen.methods) == {"a", "b"}
    for layer, method in chosen.methods.items():
        assert chosen.errors[layer][method] == min(chosen.errors[layer].values())
    # The recorded error is the model's noise-to-signal power with only that layer in INT8.
    session = ort.InferenceSession(loaded.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = [session.run(None, b)[0] for b in batches]
    typed = rewrite(loaded.proto, loaded.layers, Plan.make({"a": "int8"}), calibration.ranges("entropy"), ORT_X86)
    session = ort.InferenceSession(typed.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = [session.run(None, b)[0] for b in batches]
    assert chosen.errors["a"]["entropy"] == pytest.approx(10 ** (-snr_db(outputs, reference) / 10), rel=1e-3)
    assert chosen.errors["a"]["max"] != pytest.approx(chosen.errors["a"]["entropy"], rel=1e-3)

    def no_rewrite(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(layerwise, "rewrite", no_rewrite)
    again = choose_layer_methods(
        loaded.proto, loaded.layers, ORT_X86, calibration, batches, cache_dir=tmp_path, model_hash="m", methods=methods
    )
    assert again == chosen
    # Other data is another key: the cache does not answer it.
    with pytest.raises(AssertionError, match="cache should have answered"):
        choose_layer_methods(
            loaded.proto, loaded.layers, ORT_X86, calibration, _batches(seed=2), cache_dir=tmp_path, model_hash="m"
        )


def test_a_corrupt_cache_is_chosen_again(tmp_path):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _batches()
    calibration = _calibration(batches)
    first = choose_layer_methods(loaded.proto, loaded.layers, ORT_X86, calibration, batches, cache_dir=tmp_path)
    (cache,) = tmp_path.glob("layerwise-*.json")
    cache.write_text("{not json")
    assert choose_layer_methods(loaded.proto, loaded.layers, ORT_X86, calibration, batches, cache_dir=tmp_path) == first
    assert cache.read_text().startswith("{")


def test_the_evaluator_builds_layerwise_plans_with_each_layers_chosen_ranges(tmp_path):
    runner = TrialRunner(tiny_config(tmp_path))
    pairs = zip(runner.space.layers, runner.space.choices, strict=True)
    int8_layers = [layer.name for layer, options in pairs if "int8" in options]
    assert runner.layerwise is not None and set(runner.layerwise.methods) == set(int8_layers)
    # Give the two layers different methods, then check each one's Q/DQ reads its own method's range.
    first, second = int8_layers[:2]
    runner.use_layerwise(LayerwiseChoices({first: "max", second: "percentile"}, {}))
    plan = runner.space.uniform("int8", {"calibration": "layerwise"})
    typed = runner.typed_model(plan)
    for layer_name, method in ((first, "max"), (second, "percentile")):
        layer = next(layer for layer in runner.model.layers if layer.name == layer_name)
        lo, hi = runner.calibration.ranges(method)[layer.activation_inputs[0]]
        assert _q_scale(typed, layer_name) == pytest.approx(float(activation_qparams(lo, hi, "uint8")[0]))
    assert runner.run(plan).ok


def test_without_layerwise_in_the_space_nothing_is_chosen_and_the_plan_is_refused(tmp_path):
    runner = TrialRunner(tiny_config(tmp_path, search={"calibration_methods": ["max"]}))
    assert runner.layerwise is None
    result = runner.run(runner.space.uniform("int8").with_knobs(calibration="layerwise"))
    assert not result.ok and "calibration" in result.error


# ---- SmoothQuant ------------------------------------------------------------------------------------------


def _channel_outlier_batches(seed: int = 3) -> list[dict[str, np.ndarray]]:
    """Activations whose channel 3 runs 50x larger than the rest, as LayerNorm outputs of transformers do."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(2):
        x = rng.normal(size=(512, 16)).astype(np.float32)
        x[:, 3] *= 50.0
        batches.append({"X": x})
    return batches


def _channel_range(batches) -> tuple[np.ndarray, np.ndarray]:
    stacked = np.concatenate([b["X"] for b in batches])
    return stacked.min(axis=0), stacked.max(axis=0)


def test_smoothing_factors_follow_smoothquant_and_leave_dead_channels_alone():
    lo, hi = np.array([-4.0, 0.0, -1.0]), np.array([2.0, 0.0, 9.0])
    weight = np.array([[0.5, -1.0], [3.0, 1.0], [0.25, 0.1]])
    factors = layerwise.smoothing_factors(lo, hi, weight, 0.75)
    assert factors[0] == pytest.approx(4.0**0.75 / 1.0**0.25)
    assert factors[1] == 1.0  # an input channel that is always 0
    assert factors[2] == pytest.approx(9.0**0.75 / 0.25**0.25)


def test_smoothed_range_is_the_range_of_the_divided_tensor():
    batches = _channel_outlier_batches()
    lo, hi = _channel_range(batches)
    factors = np.linspace(0.5, 3.0, 16).astype(np.float32)
    divided = np.concatenate([b["X"] for b in batches]) / factors
    assert layerwise.smoothed_range(lo, hi, factors) == pytest.approx((float(divided.min()), float(divided.max())))


def test_a_smoothed_int8_layer_computes_the_same_product_with_less_error():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _channel_outlier_batches()
    calibration = _calibration(batches)
    choices = LayerwiseChoices({"a": "smooth-0.5"}, {}, {"X": tuple(v.tolist() for v in _channel_range(batches))})
    smoothing = choices.smoothing(loaded.proto, loaded.layers)
    layer_ranges = choices.layer_ranges(calibration, smoothing, loaded.layers)
    plan = Plan.make({"a": "int8"})
    smoothed = rewrite(loaded.proto, loaded.layers, plan, calibration.ranges("max"), ORT_X86, layer_ranges, smoothing)
    plain = rewrite(loaded.proto, loaded.layers, plan, calibration.ranges("max"), ORT_X86)
    onnx.checker.check_model(smoothed, full_check=True)
    mul = next(n for n in smoothed.graph.node if n.op_type == "Mul")
    quantize = next(n for n in smoothed.graph.node if n.op_type == "QuantizeLinear" and n.name.startswith("a__"))
    assert quantize.input[0] == mul.output[0]  # the layer quantizes x / s, not x
    assert not any(n.op_type == "Mul" for n in plain.graph.node)

    def error(model):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        reference = ort.InferenceSession(loaded.proto.SerializeToString(), providers=["CPUExecutionProvider"])
        outputs = [session.run(None, b)[0] for b in batches]
        return 10 ** (-snr_db(outputs, [reference.run(None, b)[0] for b in batches]) / 10)

    # The 50x channel squeezes every other channel into a few INT8 levels; smoothing moves it into the weight.
    assert error(smoothed) < error(plain) / 4


def test_layerwise_choice_smooths_a_layer_with_an_outlier_channel():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _channel_outlier_batches()
    chosen = choose_layer_methods(loaded.proto, loaded.layers, ORT_X86, _calibration(batches), batches)
    assert chosen.methods["a"].startswith("smooth-") and chosen.methods["b"].startswith("smooth-")
    assert len(chosen.channel_ranges["X"][0]) == 16


def test_smooth_weight_refuses_factors_that_do_not_fit():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    layer = next(layer for layer in loaded.layers if layer.name == "a")
    with pytest.raises(RewriteError, match="one factor per input channel"):
        smooth_weight(np.ones((16, 16), np.float32), np.ones(8, np.float32), layer)
