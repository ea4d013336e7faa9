"""Recurrent layers: ONNX LSTM and GRU in the layer table, the LSTM lowered to ORT's DynamicQuantizeLSTM.

The all-INT8 plan's tolerance: its logits within 3 % of the FP32 logits' largest magnitude (int8 weights per gate
row, activations quantized per step by the kernel; the tiny model reads 0.5-1.5 % here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from autotune import api
from autotune.backends.int8_kernels import probe_scheme
from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import prepare_model
from autotune.plan import Plan
from autotune.quant.lowering import Quantization, lower
from autotune.quant.recipe import ORT_X86, ORT_X86_7BIT_WEIGHTS
from autotune.quant.rewrite import RewriteError, required_ranges
from autotune.search.space import build_space
from autotune.testing import tiny_config, tiny_recurrent_model, write_recurrent_project
from autotune.tune import tune

TOLERANCE = 0.03  # of the FP32 logits' largest magnitude


@pytest.fixture(scope="module")
def loaded():
    return prepare_model(tiny_recurrent_model(), Path("recurrent.onnx"), None)


@pytest.fixture(scope="module")
def feeds():
    return {"x": np.random.default_rng(7).standard_normal((8, 12, 16)).astype(np.float32)}


def run(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def calibrated(loaded, feeds) -> Quantization:
    """Max ranges of every tensor an all-INT8 plan needs, from the FP32 model with those tensors as outputs."""
    names = required_ranges(loaded.layers, ORT_X86, loaded.proto)
    probe = onnx.ModelProto.FromString(loaded.proto.SerializeToString())
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names)
    values = run(probe, feeds, names)
    return Quantization(
        ranges={n: (min(float(v.min()), 0.0), max(float(v.max()), 0.0)) for n, v in zip(names, values, strict=True)}
    )


def nodes_by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {node.name: node for node in model.graph.node}


def test_lstm_and_gru_are_layers_with_their_macs_and_params(loaded):
    by_name = {layer.name: layer for layer in loaded.layers}
    assert [layer.op_type for layer in loaded.layers] == ["LSTM", "GRU", "Gemm"]
    lstm, gru = by_name["lstm"], by_name["gru"]
    # steps x batch x directions x gate rows x (input + hidden): 12 x 8 x 1 x 4*32 x (16 + 32)
    assert lstm.macs == 12 * 8 * 128 * (16 + 32)
    assert gru.macs == 12 * 8 * 48 * (32 + 16)
    assert lstm.params == 128 * 16 + 128 * 32 + 256  # W, R and B
    assert gru.params == 48 * 32 + 48 * 16 + 96
    assert (lstm.weight, lstm.bias, lstm.activation_inputs) == ("lstm_w", "lstm_b", ())  # quantized at run time
    assert required_ranges([lstm, gru], ORT_X86, loaded.proto) == []


def test_onnxruntime_offers_int8_for_the_lstm_and_keeps_the_gru_fp32(loaded):
    space = build_space(loaded.layers, OnnxRuntimeCPU().capabilities(), SearchSpaceConfig())
    choices = dict(zip(space.layer_names, space.choices, strict=True))
    assert choices["lstm"] == ("fp32", "int8")
    assert choices["gru"] == ("fp32",)  # no quantized GRU kernel in ONNX Runtime
    assert space.uniform("int8").precision_map == {"lstm": "int8", "gru": "fp32", "head": "int8"}


@pytest.mark.int8_numeric
@pytest.mark.parametrize("recipe", [ORT_X86, ORT_X86_7BIT_WEIGHTS], ids=["int8-weights", "7bit-weights"])
def test_all_int8_plan_runs_the_quantized_lstm_within_tolerance(loaded, feeds, recipe):
    # DynamicQuantizeLSTM multiplies u8 x s8 like the other INT8 kernels: on AVX2 without VNNI (qemu -cpu Haswell)
    # 8-bit weights saturate (0.31 of the largest logit), which is why a run lowers with the probe's exact scheme.
    if (
        recipe is ORT_X86
        and not probe_scheme(ORT_X86, lambda model: ort.InferenceSession(model.SerializeToString())).exact
    ):
        pytest.skip("this CPU's u8 x s8 kernels saturate: a run uses the probe's exact scheme (7-bit weights)")
    plan = Plan.uniform(["lstm", "head"], "int8", {})
    lowered = lower(loaded, plan, calibrated(loaded, feeds), recipe)
    nodes = nodes_by_name(lowered)
    assert (nodes["lstm"].op_type, nodes["lstm"].domain) == ("DynamicQuantizeLSTM", "com.microsoft")
    assert nodes["gru"].op_type == "GRU"
    inits = {init.name: numpy_helper.to_array(init) for init in lowered.graph.initializer}
    assert inits[nodes["lstm"].input[1]].dtype == np.int8 and inits[nodes["lstm"].input[1]].shape == (1, 16, 128)
    assert "lstm_w" not in inits and "lstm_r" not in inits  # the float weights are gone
    reference, quantized = run(loaded.proto, feeds)[0], run(lowered, feeds)[0]
    error = np.abs(quantized - reference).max() / np.abs(reference).max()
    assert 0 < error < TOLERANCE


def test_the_int8_lstm_is_what_quantize_dynamic_writes(loaded, feeds, tmp_path):
    onnx.save(loaded.proto, str(tmp_path / "fp32.onnx"))
    quantize_dynamic(
        tmp_path / "fp32.onnx", tmp_path / "ort.onnx", op_types_to_quantize=["LSTM"], weight_type=QuantType.QInt8
    )
    ours = lower(loaded, Plan.uniform(["lstm"], "int8", {"weight_granularity": "per_tensor"}), Quantization(), ORT_X86)
    theirs = onnx.load(str(tmp_path / "ort.onnx"))
    np.testing.assert_array_equal(run(ours, feeds)[0], run(theirs, feeds)[0])


def test_granularity_and_seven_bit_weights_follow_the_plan_and_recipe(loaded):
    def lstm_weights(plan: Plan, recipe) -> tuple[np.ndarray, np.ndarray]:
        lowered = lower(loaded, plan, Quantization(), recipe)
        inputs = nodes_by_name(lowered)["lstm"].input
        inits = {init.name: numpy_helper.to_array(init) for init in lowered.graph.initializer}
        return inits[inputs[1]], inits[inputs[8]]  # W and its scales

    per_row = Plan.uniform(["lstm"], "int8", {"weight_granularity": "per_channel"})
    weight, scales = lstm_weights(per_row, ORT_X86)
    assert scales.size == 128 and np.abs(weight).max() == 127
    _, scales = lstm_weights(Plan.uniform(["lstm"], "int8", {"weight_granularity": "per_tensor"}), ORT_X86)
    assert scales.size == 1
    weight, _ = lstm_weights(per_row, ORT_X86_7BIT_WEIGHTS)
    assert np.abs(weight).max() == 64  # ORT's reduce_range, where u8 x s8 kernels saturate


def test_an_int8_gru_is_refused_as_fp32_only(loaded):
    with pytest.raises(RewriteError, match="GRU has no INT8 form"):
        lower(loaded, Plan.uniform(["gru"], "int8", {}), Quantization(), ORT_X86)
    with pytest.raises(RewriteError, match="fp32 or int8"):
        lower(loaded, Plan.uniform(["lstm"], "fp16", {}), Quantization(), ORT_X86)


def _recurrent_config(root: Path, **overrides):
    paths = write_recurrent_project(root / "recurrent")  # beside the tiny project tiny_config writes
    data = {split: {"npz": str(paths[split])} for split in ("calibration", "evaluation", "holdout")}
    return tiny_config(
        root, name="recurrent", model={"onnx": str(paths["model"])}, inputs=paths["inputs"], data=data, **overrides
    )


def test_evaluate_builds_the_all_int8_plan_with_a_quantized_lstm(tmp_path):
    result = api.evaluate(_recurrent_config(tmp_path), "int8", isolate=False)
    assert result["status"] == "ok", result["error"]
    built = onnx.load(result["artifact"])
    assert nodes_by_name(built)["lstm"].op_type == "DynamicQuantizeLSTM"
    assert result["fidelity"]["cosine"] > 0.99  # the model's outputs, against FP32's on the evaluation split


def test_a_short_tune_on_the_recurrent_model_completes(tmp_path):
    config = _recurrent_config(tmp_path, budget={"builds": 6})
    summary = tune(config, isolate=False, progress=False)
    assert summary["builds"] == 6
    plan = (config.run_dir / "best" / "plan.json").read_text()
    assert '"lstm"' in plan and '"gru": "fp32"' in plan
