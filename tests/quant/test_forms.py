"""Each layer's error in the other INT8 forms (7-bit weights, int8-dynamic), measured as the layerwise errors are."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from autotune.model.layers import InputSpec, prepare_model
from autotune.plan import DYNAMIC, Plan
from autotune.quant import forms as forms_module
from autotune.quant.calibrate import calibrate
from autotune.quant.forms import Form, form_errors
from autotune.quant.layerwise import LayerwiseChoices
from autotune.quant.recipe import ORT_X86, ORT_X86_7BIT_WEIGHTS, ORT_X86_UINT8_WEIGHTS
from autotune.quant.rewrite import required_ranges, rewrite
from autotune.testing import tiny_mlp

DYNAMIC_RECIPE = dataclasses.replace(ORT_X86, dynamic_weight_max=64)
FORMS = (
    Form("u8u8", "int8", ORT_X86_UINT8_WEIGHTS),
    Form("u8s7", "int8", ORT_X86_7BIT_WEIGHTS),
    Form(DYNAMIC, DYNAMIC, DYNAMIC_RECIPE),
)


def _setup():
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(3):
        x = rng.normal(size=(16, 32)).astype(np.float32)
        x[:, 2] *= 30.0
        batches.append({"x": x})
    loaded = prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])
    calibration = calibrate(loaded.proto, required_ranges(loaded.layers, ORT_X86, loaded.proto), batches, None, "")
    choices = LayerwiseChoices(dict.fromkeys(loaded.layer_names, "max"), {})
    return loaded, calibration, choices, batches


def _session(model):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _whole_model_error(loaded, name, form, calibration, batches) -> float:
    """The whole model rewritten with only ``name`` in the form, run, compared with FP32: the samples' mean NSR."""
    typed = rewrite(
        loaded.proto, loaded.layers, Plan.make({name: form.precision}), calibration.ranges("max"), form.recipe
    )
    per_sample = []
    for batch in batches:
        a = _session(typed).run(None, batch)[0].astype(np.float64)
        b = _session(loaded.proto).run(None, batch)[0].astype(np.float64)
        per_sample.extend(np.square(a - b).sum(axis=1) / np.square(b).sum(axis=1))
    return float(np.mean(per_sample))


def test_each_forms_error_is_the_whole_models_with_that_layer_alone_in_it():
    loaded, calibration, choices, batches = _setup()
    errors = form_errors(loaded, FORMS, choices, calibration, batches, 0)
    assert set(errors) == {"u8u8", "u8s7", DYNAMIC}
    for form in FORMS:
        assert set(errors[form.name]) == set(loaded.layer_names)  # tiny_mlp's layers are MatMuls and a Gemm
        for name in loaded.layer_names:
            expected = _whole_model_error(loaded, name, form, calibration, batches)
            assert errors[form.name][name] == pytest.approx(expected, rel=0.02), (form.name, name)
    # 7-bit weights halve the weight resolution: the layers whose error is the weights' err more than with 8 bits
    # (fc1's error is its input's outlier channel, which the weights do not change)
    assert all(errors["u8s7"][name] > 1.2 * errors["u8u8"][name] for name in ("fc2", "fc3", "head")), errors


def test_the_forms_errors_are_cached_and_dynamic_skips_layers_it_does_not_apply_to(tmp_path, monkeypatch):
    loaded, calibration, choices, batches = _setup()
    conv_like = dataclasses.replace(loaded.layers[0], op_type="Conv")
    assert not Form(DYNAMIC, DYNAMIC, DYNAMIC_RECIPE).applies(conv_like)
    cut = form_errors(loaded, FORMS[1:], choices, calibration, batches, 0, cache_dir=tmp_path, allowance_s=0)
    assert cut == {"u8s7": {}, DYNAMIC: {}}  # the allowance ran out before the first layer
    first = form_errors(loaded, FORMS[1:], choices, calibration, batches, 0, cache_dir=tmp_path)
    assert all(set(first[form.name]) == set(loaded.layer_names) for form in FORMS[1:])
    monkeypatch.setattr(forms_module, "_measure", lambda *args: pytest.fail("measured again"))
    assert form_errors(loaded, FORMS[1:], choices, calibration, batches, 0, cache_dir=tmp_path) == first
    other = LayerwiseChoices(dict.fromkeys(loaded.layer_names, "percentile"), {})
    with pytest.raises(pytest.fail.Exception):  # other choices: other numbers, not the cached ones
        form_errors(loaded, FORMS[1:], other, calibration, batches, 0, cache_dir=tmp_path)
