"""What a backend can build: precisions per op type (FP32 for the rest) and knobs with their defaults."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.capabilities import Capabilities, Knob


def test_a_knob_defaults_to_its_first_value_and_is_neither_free_nor_following_unless_said():
    knob = Knob("threads", (4, 1, 2), "intra-op threads")
    assert knob.default == 4 and not knob.free and not knob.follows_precision
    assert Knob("base_precision", ("fp16", "fp32"), follows_precision=True).default == "fp16"


def test_an_op_type_the_backend_does_not_list_takes_fp32_alone():
    capabilities = Capabilities({"MatMul": ("fp32", "int8", "fp16"), "Add": ("fp32",)})
    assert capabilities.precisions_for("MatMul") == ("fp32", "int8", "fp16")
    assert capabilities.precisions_for("Add") == ("fp32",)
    assert capabilities.precisions_for("LSTM") == ("fp32",)
    assert capabilities.knobs == () and capabilities.smoothing


def test_capabilities_are_values():
    capabilities = Capabilities({"MatMul": ("fp32", "int8")}, (Knob("a", (1, 2)),), smoothing=False)
    assert capabilities == Capabilities({"MatMul": ("fp32", "int8")}, (Knob("a", (1, 2)),), smoothing=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.smoothing = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.knobs[0].values = (3,)
