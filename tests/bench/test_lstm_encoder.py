"""bench/lstm_encoder.py: its exported encoder has three LSTM layers that lower to DynamicQuantizeLSTM."""

import sys
from pathlib import Path

import numpy as np
import onnx

from autotune.backends.onnxruntime import OnnxRuntimeCPU
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import prepare_model
from autotune.quant.lowering import Quantization, lower
from autotune.search.space import build_space

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import lstm_encoder  # noqa: E402


def test_the_encoder_has_three_int8_lstms_and_its_samples_fit(tmp_path):
    path = tmp_path / "encoder.onnx"
    lstm_encoder.export_encoder(path, frames=5, hidden=8, batch=2)
    lstm_encoder.write_samples(tmp_path / "samples.npz", samples=4, frames=5)
    model = prepare_model(onnx.load(str(path)), path, None)
    assert [layer.op_type for layer in model.layers] == ["LSTM", "LSTM", "LSTM", "Gemm"]
    space = build_space(model.layers, OnnxRuntimeCPU().capabilities(), SearchSpaceConfig())
    plan = space.uniform("int8")
    lstms = {layer.name for layer in model.layers if layer.op_type == "LSTM"}
    lowered = lower(
        model, plan, Quantization(ranges={model.layers[-1].activation_inputs[0]: (-1.0, 1.0)}), OnnxRuntimeCPU().recipe
    )
    assert {node.name for node in lowered.graph.node if node.op_type == "DynamicQuantizeLSTM"} == lstms
    assert np.load(tmp_path / "samples.npz")["x"].shape == (4, 5, lstm_encoder.FEATURES)
