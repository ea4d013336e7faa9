"""Layerwise calibration: per-layer ranges in the rewriter, the per-layer choice, its cache, the evaluator."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from autotune.backends.onnxruntime import int8_recipe
from autotune.harness import TrialRunner
from autotune.metrics import SNR_CAP_DB, snr_db
from autotune.model.layers import InputSpec, prepare_model
from autotune.plan import Plan
from autotune.quant import layerwise, probe
from autotune.quant.calibrate import DEFAULT_SETTINGS, Calibration, calibrate
from autotune.quant.histogram import TensorStats
from autotune.quant.layerwise import LayerwiseChoices, choose_layer_methods, choose_methods
from autotune.quant.probe import find_cut
from autotune.quant.qparams import activation_qparams
from autotune.quant.rewrite import RewriteError, required_ranges, rewrite, smooth_weight
from autotune.testing import tiny_config, tiny_mlp, typed_model

ORT = int8_recipe()
"""The ORT backend's recipe on this CPU: its layerwise error estimates run with the weights that will run."""


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
    out = rewrite(loaded.proto, loaded.layers, plan, wide, ORT, layer_ranges={"b": narrow})
    onnx.checker.check_model(out, full_check=True)
    assert _q_scale(out, "a") == pytest.approx(float(activation_qparams(-8.0, 8.0, "uint8")[0]))
    assert _q_scale(out, "b") == pytest.approx(float(activation_qparams(-1.0, 1.0, "uint8")[0]))


@pytest.mark.int8_numeric
def test_choices_minimise_the_measured_output_error_and_come_back_from_the_cache(tmp_path, monkeypatch):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _batches()
    calibration = _calibration(batches)
    methods = ("max", "entropy")
    # exhaustive: every candidate runs on all the data, so even the loser's recorded error is exact.
    chosen = choose_layer_methods(
        loaded.proto,
        loaded.layers,
        ORT,
        calibration,
        batches,
        cache_dir=tmp_path,
        model_hash="m",
        methods=methods,
        exhaustive=True,
    )
    assert set(chosen.methods) == {"a", "b"}
    for layer, method in chosen.methods.items():
        assert chosen.errors[layer][method] == min(chosen.errors[layer].values())
    # The recorded error is the model's noise-to-signal power with only that layer in INT8, the samples' mean.
    session = ort.InferenceSession(loaded.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = [session.run(None, b)[0] for b in batches]
    typed = rewrite(loaded.proto, loaded.layers, Plan.make({"a": "int8"}), calibration.ranges("entropy"), ORT)
    session = ort.InferenceSession(typed.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = [session.run(None, b)[0] for b in batches]
    assert chosen.errors["a"]["entropy"] == pytest.approx(_mean_noise_to_signal(outputs, reference), rel=1e-3)
    assert chosen.errors["a"]["max"] != pytest.approx(chosen.errors["a"]["entropy"], rel=1e-3)

    def no_rewrite(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(probe, "rewrite", no_rewrite)
    again = choose_layer_methods(
        loaded.proto,
        loaded.layers,
        ORT,
        calibration,
        batches,
        cache_dir=tmp_path,
        model_hash="m",
        methods=methods,
        exhaustive=True,
    )
    assert again == chosen
    # Other data is another key: the cache does not answer it.
    with pytest.raises(AssertionError, match="cache should have answered"):
        choose_layer_methods(
            loaded.proto, loaded.layers, ORT, calibration, _batches(seed=2), cache_dir=tmp_path, model_hash="m"
        )


def test_a_corrupt_cache_is_chosen_again(tmp_path):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _batches()
    calibration = _calibration(batches)
    first = choose_layer_methods(loaded.proto, loaded.layers, ORT, calibration, batches, cache_dir=tmp_path)
    (cache,) = tmp_path.glob("layerwise-*.json")
    cache.write_text("{not json")
    assert choose_layer_methods(loaded.proto, loaded.layers, ORT, calibration, batches, cache_dir=tmp_path) == first
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
    typed = typed_model(runner, plan)
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


@pytest.mark.int8_numeric
def test_a_smoothed_int8_layer_computes_the_same_product_with_less_error():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _channel_outlier_batches()
    calibration = _calibration(batches)
    choices = LayerwiseChoices({"a": "smooth-0.5"}, {}, {"X": tuple(v.tolist() for v in _channel_range(batches))})
    smoothing = choices.smoothing(loaded.proto, loaded.layers)
    layer_ranges = choices.layer_ranges(calibration, smoothing, loaded.layers)
    plan = Plan.make({"a": "int8"})
    smoothed = rewrite(loaded.proto, loaded.layers, plan, calibration.ranges("max"), ORT, layer_ranges, smoothing)
    plain = rewrite(loaded.proto, loaded.layers, plan, calibration.ranges("max"), ORT)
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
    chosen = choose_layer_methods(loaded.proto, loaded.layers, ORT, _calibration(batches), batches)
    assert chosen.methods["a"].startswith("smooth-") and chosen.methods["b"].startswith("smooth-")
    assert len(chosen.channel_ranges["X"][0]) == 16


def test_smooth_weight_refuses_factors_that_do_not_fit():
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    layer = next(layer for layer in loaded.layers if layer.name == "a")
    with pytest.raises(RewriteError, match="one factor per input channel"):
        smooth_weight(np.ones((16, 16), np.float32), np.ones(8, np.float32), layer)


# ---- How the choice is measured: probes on cached FP32 activations, the model downstream of the layer ----------


def _disabled_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A session that runs the Q/DQ nodes as written (ORT's fusions would turn them into integer kernels)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _whole_model_error(loaded, name, method, calibration, batches, channels, output_index=0) -> float:
    """The error as it was first computed: the whole model rewritten with only ``name`` in INT8, run, compared."""
    plan = Plan.make({name: "int8"})
    if method in layerwise.SMOOTHING:
        alone = LayerwiseChoices({name: method}, {}, channels)
        layer = [layer for layer in loaded.layers if layer.name == name]
        smoothing = alone.smoothing(loaded.proto, layer)
        ranges = alone.layer_ranges(calibration, smoothing, layer)[name]
        typed = rewrite(loaded.proto, loaded.layers, plan, ranges, ORT, smoothing=smoothing)
    else:
        typed = rewrite(loaded.proto, loaded.layers, plan, calibration.ranges(method), ORT)
    reference = [_disabled_session(loaded.proto).run(None, b)[output_index] for b in batches]
    outputs = [_disabled_session(typed).run(None, b)[output_index] for b in batches]
    return _mean_noise_to_signal(outputs, reference)


def _mean_noise_to_signal(outputs, reference) -> float:
    """The samples' mean noise-to-signal power, by hand (the metrics weigh samples alike), at the SNR cap's floor."""
    per_sample = []
    for output, expected in zip(outputs, reference, strict=True):
        a = output.reshape(len(output), -1).astype(np.float64)
        b = expected.reshape(len(expected), -1).astype(np.float64)
        per_sample.extend(np.square(a - b).sum(axis=1) / np.square(b).sum(axis=1))
    return max(float(np.mean(per_sample)), 10 ** (-SNR_CAP_DB / 10))


_MLP_INPUTS = [InputSpec("x", (16, 32), "float32")]


def _calibrated(model: onnx.ModelProto, batches) -> tuple:
    inputs = _MLP_INPUTS if model.graph.input[0].name == "x" else None
    loaded = prepare_model(model, Path("model.onnx"), inputs)
    tensors = required_ranges(loaded.layers, ORT, loaded.proto)
    return loaded, calibrate(loaded.proto, tensors, batches, None, "")


def _mlp_batches(features: int = 32, seed: int = 5) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(3):
        x = rng.normal(size=(16, features)).astype(np.float32)
        x[:, 2] *= 30.0  # an outlier channel, so smoothing and clipping both have something to do
        batches.append({"x": x})
    return batches


def _conv_model() -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> output ``y``, and a Gemm head on the first Relu that only feeds ``side``."""
    rng = np.random.default_rng(4)
    inits = [
        numpy_helper.from_array((rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.normal(size=4) * 0.1).astype(np.float32), "B1"),
        numpy_helper.from_array((rng.normal(size=(2, 4, 3, 3)) * 0.3).astype(np.float32), "W2"),
        numpy_helper.from_array((rng.normal(size=2) * 0.1).astype(np.float32), "B2"),
        numpy_helper.from_array((rng.normal(size=(5, 64)) * 0.2).astype(np.float32), "W3"),
        numpy_helper.from_array(np.array([2, 64], dtype=np.int64), "flat_shape"),
    ]
    nodes = [
        helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["y"], "relu2"),
        helper.make_node("Reshape", ["r1", "flat_shape"], ["flat"], "flatten"),
        helper.make_node("Gemm", ["flat", "W3"], ["side"], "head", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "convs",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3, 4, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 4, 4]),
            helper.make_tensor_value_info("side", TensorProto.FLOAT, [2, 5]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_cut_of_a_layer_is_its_nodes_the_rest_of_the_model_and_what_that_reads():
    loaded = prepare_model(tiny_mlp(), Path("mlp.onnx"), _MLP_INPUTS)
    fc3 = next(layer for layer in loaded.layers if layer.name == "fc3")
    cut = find_cut(loaded.proto, fc3, ORT, "logits")
    assert cut.target == "h3" and [n.name for n in cut.nodes] == ["fc3"] and cut.inputs == ("a2",)
    assert [n.name for n in cut.downstream] == ["residual", "relu3", "head"]
    assert cut.downstream_inputs == ("a2",)  # the residual branch: FP32, fed from the cached activations
    # An output Q/DQ that folds into a sole Relu changes the Relu's output: the probe runs the Relu too.
    convs = prepare_model(_conv_model(), Path("convs.onnx"), None)
    conv1 = next(layer for layer in convs.layers if layer.name == "conv1")
    cut = find_cut(convs.proto, conv1, ORT, "y")
    assert cut.target == "r1" and [n.name for n in cut.nodes] == ["conv1", "relu1"]
    assert [n.name for n in cut.downstream] == ["conv2", "relu2"] and cut.reaches_output
    head = next(layer for layer in convs.layers if layer.name == "head")
    assert not find_cut(convs.proto, head, ORT, "y").reaches_output


@pytest.mark.parametrize(("make", "batches", "output_index"), [(tiny_mlp, _mlp_batches, 0), (_conv_model, None, 0)])
def test_every_error_equals_that_of_the_whole_model_with_only_that_layer_in_int8(make, batches, output_index):
    if batches is None:
        rng = np.random.default_rng(6)
        data = [{"X": rng.normal(size=(2, 3, 4, 4)).astype(np.float32)} for _ in range(3)]
    else:
        data = batches()
    loaded, calibration = _calibrated(make(), data)
    chosen = choose_layer_methods(
        loaded.proto, loaded.layers, ORT, calibration, data, output_index, progress=False, exhaustive=True
    )
    assert set(chosen.errors) == {layer.name for layer in loaded.layers}
    measured = 0
    for name, errors in chosen.errors.items():
        for method, error in errors.items():
            expected = _whole_model_error(loaded, name, method, calibration, data, chosen.channel_ranges, output_index)
            # The part after the layer runs optimized (FP32 rounding: a few parts per million of the error).
            assert error == pytest.approx(expected, rel=1e-4), (name, method)
            measured += 1
    assert measured >= 2 * len(loaded.layers)


def test_the_other_outputs_layers_cannot_move_the_scored_one_and_keep_the_first_method():
    rng = np.random.default_rng(6)
    data = [{"X": rng.normal(size=(2, 3, 4, 4)).astype(np.float32)} for _ in range(2)]
    loaded, calibration = _calibrated(_conv_model(), data)
    chosen = choose_layer_methods(loaded.proto, loaded.layers, ORT, calibration, data, 0, progress=False)
    assert chosen.methods["head"] == "max"
    assert chosen.errors["head"] == pytest.approx({m: 1e-10 for m in ("max", "percentile", "entropy")})  # SNR cap
    # Scoring ``side`` instead, the head's candidates differ, and conv2 cannot move it.
    side = choose_layer_methods(loaded.proto, loaded.layers, ORT, calibration, data, 1, progress=False)
    assert side.errors["head"]["max"] > 1e-9 and max(side.errors["conv2"].values()) == pytest.approx(1e-10)


def _counting_sessions(monkeypatch) -> list[int]:
    """Counts every run of a probe or downstream session."""
    runs = [0]
    make = probe.session

    class Counting:
        def __init__(self, session):
            self.session = session

        def run(self, *args, **kwargs):
            runs[0] += 1
            return self.session.run(*args, **kwargs)

    monkeypatch.setattr(probe, "session", lambda model, **options: Counting(make(model, **options)))
    return runs


def test_candidates_that_cannot_win_stop_early_and_the_choice_stays_the_same(monkeypatch):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = [*_batches(), *_batches(seed=7)]
    calibration = _calibration(batches)
    runs = _counting_sessions(monkeypatch)
    args = (loaded.proto, loaded.layers, ORT, calibration, batches)
    exact = choose_layer_methods(*args, progress=False, exhaustive=True)
    exhaustive_runs, runs[0] = runs[0], 0
    quick = choose_layer_methods(*args, progress=False)
    assert runs[0] < exhaustive_runs
    assert quick.methods == exact.methods
    for layer, method in quick.methods.items():
        assert quick.errors[layer][method] == pytest.approx(exact.errors[layer][method], rel=1e-9)
        # A candidate stopped early holds an estimate, still above the winner's error.
        assert all(error > quick.errors[layer][method] for m, error in quick.errors[layer].items() if m != method)
    stopped = [(layer, m) for layer, e in quick.errors.items() for m in e if e[m] != exact.errors[layer][m]]
    assert stopped  # entropy clips the outlier: far worse than max after a single batch


def test_progress_goes_to_stderr_only_when_asked_and_the_time_is_logged(tmp_path, capsys, caplog):
    loaded = prepare_model(_fanout_model(), Path("fanout.onnx"), None)
    batches = _batches()
    calibration = _calibration(batches)
    args = (loaded.proto, loaded.layers, ORT, calibration, batches)
    with caplog.at_level(logging.INFO, logger="autotune.quant.layerwise"):
        quiet = choose_layer_methods(*args, cache_dir=tmp_path / "quiet", progress=False)
    assert capsys.readouterr() == ("", "")
    assert quiet.seconds > 0
    assert f"layerwise calibration: 2 layers in {quiet.seconds:.1f} s" in caplog.text
    loud = choose_layer_methods(*args, cache_dir=tmp_path / "loud")
    captured = capsys.readouterr()
    assert captured.out == "" and "layerwise calibration" in captured.err and "3/3" in captured.err
    # A cache hit: no bar, no time spent choosing, and the same choices.
    again = choose_layer_methods(*args, cache_dir=tmp_path / "loud")
    assert capsys.readouterr() == ("", "") and again.seconds == 0.0 and again == loud


# ---- single-layer evaluations on the backend's device (the torch backend's probe) ----------------------------


def _torch_setup(tmp_path, **overrides):
    """A CPU TrialRunner of the tiny torch MLP, the layers layerwise chooses for, and its calibration data."""
    from autotune.testing import tiny_torch_config

    runner = TrialRunner(tiny_torch_config(tmp_path, **overrides))
    layers = [
        layer for layer, options in zip(runner.space.layers, runner.space.choices, strict=True) if "int8" in options
    ]
    return runner, layers, runner.calibration_batches


def _torch_probe(runner, device="cpu"):
    from autotune.backends.torch.layer_probe import TorchLayerProbe

    backend = runner.backend
    names = [spec.name for spec in runner.model.inputs]
    return TorchLayerProbe(backend.fp32_module(), backend._bindings, names, device)


def test_the_torch_probe_measures_what_the_onnx_probes_measure_on_its_device(tmp_path):
    runner, layers, batches = _torch_setup(tmp_path)
    args = (runner.model.proto, layers, runner.backend.recipe, runner.calibration, batches)
    onnx_side = choose_layer_methods(*args, progress=False, exhaustive=True)
    layer_probe = _torch_probe(runner)
    on_device = choose_layer_methods(*args, progress=False, layer_probe=layer_probe)
    assert layer_probe.forwards > 0 and next(layer_probe.module.parameters()).device.type == "cpu"
    # The torch probe runs the backend's Int8Linear (an int32 accumulator), the ONNX probes Q/DQ in float:
    # the same quantization, so the same errors up to float rounding, and the same choices.
    assert set(on_device.errors) == {layer.name for layer in layers} == set(onnx_side.errors)
    for name, errors in on_device.errors.items():
        assert errors.keys() == onnx_side.errors[name].keys()
        for method, error in errors.items():
            assert error == pytest.approx(onnx_side.errors[name][method], rel=1e-3), (name, method)
    assert on_device.methods == onnx_side.methods
    assert isinstance(on_device.errors[layers[0].name]["max"], float)  # the format other tools read


def test_a_probe_skips_the_onnx_runs_and_keeps_its_own_cache_entry(tmp_path, monkeypatch):
    runner, layers, batches = _torch_setup(tmp_path)
    args = (runner.model.proto, layers, runner.backend.recipe, runner.calibration, batches)
    runs = _counting_sessions(monkeypatch)
    monkeypatch.setattr(probe, "fp32_pass", lambda *a, **k: pytest.fail("the ONNX FP32 pass ran"))
    cache = tmp_path / "layerwise-cache"
    first = choose_layer_methods(*args, cache_dir=cache, progress=False, layer_probe=_torch_probe(runner))
    assert runs[0] == 0  # no ONNX Runtime probe session ran
    # The probe's choices are cached under a key of their own: a probe-less run does not read them back.
    again_probe = _torch_probe(runner)
    assert choose_layer_methods(*args, cache_dir=cache, progress=False, layer_probe=again_probe) == first
    assert again_probe.forwards == 0
    assert len(list(cache.glob("layerwise-*.json"))) == 1
    monkeypatch.undo()
    choose_layer_methods(*args, cache_dir=cache, progress=False)
    assert len(list(cache.glob("layerwise-*.json"))) == 2


def test_the_runner_uses_the_backends_probe_where_it_offers_one(tmp_path, monkeypatch):
    from autotune.backends.torch import TorchBackend

    made = []

    def cpu_probe(backend):
        # A CPU stand-in for the CUDA probe a GPU machine gets: the harness cannot tell the two apart.
        from autotune.backends.torch.layer_probe import TorchLayerProbe

        names = [spec.name for spec in backend.model.inputs]
        made.append(TorchLayerProbe(backend.fp32_module(), backend._bindings, names, "cpu"))
        return made[-1]

    monkeypatch.setattr(TorchBackend, "layer_probe", cpu_probe)
    runner, layers, _ = _torch_setup(tmp_path)
    assert made and made[0].forwards > 0
    assert set(runner.layerwise.methods) == {layer.name for layer in layers}


def test_the_torch_backend_keeps_the_onnx_probes_on_the_cpu(tmp_path):
    runner, _, _ = _torch_setup(tmp_path)
    assert runner.backend.layer_probe() is None  # CPU results stay exactly what they were


@pytest.mark.gpu
def test_the_torch_backend_probes_on_cuda_with_the_cpu_choices(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU and a CUDA torch)")
    runner, layers, batches = _torch_setup(tmp_path, backend={"name": "torch", "options": {"device": "cuda"}})
    layer_probe = runner.backend.layer_probe()
    assert layer_probe is not None and next(layer_probe.module.parameters()).device.type == "cuda"
    # Where a Linear may take fp8 the backend's probe measures FP8 (a cache key of its own), else INT8.
    fp8 = any("fp8" in choices for choices in runner.backend.capabilities().precisions.values())
    assert (layer_probe.precision, layer_probe.name) == (("fp8", "torch:cuda:fp8") if fp8 else ("int8", "torch:cuda"))
    # Its INT8 probe measures what the ONNX probes measure.
    int8_probe = _torch_probe(runner, "cuda")
    args = (runner.model.proto, layers, runner.backend.recipe, runner.calibration, batches)
    on_gpu = choose_layer_methods(*args, progress=False, layer_probe=int8_probe)
    on_cpu = choose_layer_methods(*args, progress=False, exhaustive=True)
    assert on_gpu.methods == on_cpu.methods
    for name, errors in on_gpu.errors.items():
        for method, error in errors.items():
            assert error == pytest.approx(on_cpu.errors[name][method], rel=1e-2), (name, method)


# ---- the time allowance ----------------------------------------------------------------------------------------


def test_the_allowance_defaults_the_layers_it_did_not_reach_and_a_later_call_measures_them(tmp_path, caplog):
    data = _mlp_batches()
    loaded, calibration = _calibrated(tiny_mlp(), data)
    args = (loaded.proto, loaded.layers, ORT, calibration, data)
    with caplog.at_level(logging.INFO, logger="autotune.quant.layerwise"):
        cut = choose_layer_methods(*args, progress=False, cache_dir=tmp_path, allowance_s=0.0)
    names = [layer.name for layer in loaded.layers]
    assert cut.defaulted == tuple(names) and cut.errors == {}
    assert set(cut.methods.values()) == {"max"}  # nothing measured: the first range method
    assert f"0 chosen, {len(names)} defaulted to 'max'" in caplog.text
    # The same cache, no allowance: the defaulted layers are measured now, as a call without the cache would.
    full = choose_layer_methods(*args, progress=False, cache_dir=tmp_path)
    assert full.defaulted == () and full == choose_layer_methods(*args, progress=False)
    # With some layers measured, the others take the range method chosen most often.
    errors = {"a": {"max": 2.0, "percentile": 1.0}, "b": {"max": 2.0, "percentile": 1.0}, "c": {"max": 1.0}}
    partial = layerwise._with_defaults(["a", "b", "c", "d"], errors, {}, ("max", "percentile", "smooth-0.5"), 1.0)
    assert partial.methods == {"a": "percentile", "b": "percentile", "c": "max", "d": "percentile"}
    assert partial.defaulted == ("d",)


def test_sample_powers_are_per_sample_and_an_all_zero_sample_is_floored():
    output = np.zeros((3, 2, 2), np.float32)
    output[0] = 1.0
    output[1] = 2.0
    powers = probe.sample_powers(output)
    assert powers[:2].tolist() == [4.0, 16.0]
    assert 0 < powers[2] <= 1e-8 * 20.0 / 3
