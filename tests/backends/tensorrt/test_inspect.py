"""Engine-inspector parsing and precision verification, on JSON fixtures written by hand in both layouts.

The fixtures describe the tiny MLP built from a plan fc1=int8, fc2=fp16, fc3=int8, head=fp32 in which fc3's
dequantize did not fuse, so TensorRT runs fc3 in FP32: the check must report exactly that layer.
"""

from __future__ import annotations

import json
import logging

import pytest

from autotune.backends import BuildError
from autotune.backends.tensorrt import TensorRTBackend
from autotune.backends.tensorrt.inspect import (
    InspectorFormatError,
    check_precisions,
    normalize_dtype,
    onnx_nodes,
    parse_engine_info,
    summarize,
)
from autotune.config.schema import TensorRTOptions

REQUESTED = {"fc1": "int8", "fc2": "fp16", "fc3": "int8", "head": "fp32"}
US = "\x1f"  # TensorRT joins the ONNX nodes of a fused layer with the ASCII unit separator


def _tensor10(name, dtype_text):
    return {"Name": name, "Location": "Device", "Dimensions": [16, 64], "Format/Datatype": dtype_text}


def _tensor11(name, dtype, key="DataType"):
    return {"Name": name, "Location": "Device", "Dimensions": [16, 64], "Format": "Row major linear", key: dtype}


ENGINE_10X = {
    "Layers": [
        {
            "Name": "Reformatting CopyNode for Input Tensor 0 to fc1__x__Q",
            "LayerType": "Reformat",
            "Inputs": [_tensor10("x", "Row major linear FP32")],
            "Outputs": [_tensor10("x_r", "Channel major FP32 format where channel % 4 == 0")],
            "Metadata": "[ONNX Layer: fc1]",  # reformats can carry the consumer's metadata: never a precision
        },
        {
            "Name": "fc1__x__Q",
            "LayerType": "Scale",
            "Inputs": [_tensor10("x_r", "Row major linear FP32")],
            "Outputs": [_tensor10("x__q__fc1", "Row major Int8 format")],
            "Metadata": "[ONNX Layer: fc1__x__Q]",
        },
        {
            "Name": "fc1__x__DQ + fc1__w__DQ + fc1 + fc1_bias + relu1",
            "LayerType": "CaskGemmMatrixMultiply",
            "Inputs": [_tensor10("x__q__fc1", "Four wide channel vectorized row major Int8 format")],
            "Outputs": [_tensor10("a1", "Row major linear FP32")],
            "Weights": {"Type": "Int8", "Count": 2048},
            "Bias": {"Type": "Float", "Count": 64},
            "TacticName": "sm90_xmma_gemm_i8f32_i8i32_f32_tn_n",
            "Metadata": US.join(f"[ONNX Layer: {n}]" for n in ("fc1__x__DQ", "fc1__w__DQ", "fc1", "fc1_bias", "relu1")),
        },
        {
            "Name": "fc2__a1__Cast",
            "LayerType": "Cast",
            "Inputs": [_tensor10("a1", "Row major linear FP32")],
            "Outputs": [_tensor10("a1__fp16__fc2", "Row major linear FP16 format")],
            "Metadata": "[ONNX Layer: fc2__a1__Cast]",
        },
        {
            "Name": "fc2",
            "LayerType": "MatrixMultiply",
            "Inputs": [_tensor10("a1__fp16__fc2", "Channel major FP16 format where channel % 8 == 0")],
            "Outputs": [_tensor10("h2__fp16", "Row major linear FP16 format")],
            "Weights": {"Type": "Half", "Count": 4096},
            "Metadata": "[ONNX Layer: fc2]",
        },
        {
            "Name": "fc3__a2__DQ",
            "LayerType": "Scale",
            "Inputs": [_tensor10("a2__q", "Row major Int8 format")],
            "Outputs": [_tensor10("a2__dq", "Row major linear FP32")],
            "Metadata": "[ONNX Layer: fc3__a2__DQ]",
        },
        {
            "Name": "fc3",
            "LayerType": "MatrixMultiply",
            "Inputs": [_tensor10("a2__dq", "Row major linear FP32"), _tensor10("w3__dq", "Row major linear FP32")],
            "Outputs": [_tensor10("h3", "Row major linear FP32")],
            "Metadata": "[ONNX Layer: fc3]",
        },
        {
            "Name": "head + residual + relu3",
            "LayerType": "CaskGemmConvolution",
            "Inputs": [_tensor10("r3", "Row major linear FP32")],
            "Outputs": [_tensor10("logits", "Row major linear FP32")],
            "Weights": {"Type": "Float", "Count": 640},
            "Metadata": f"[ONNX Layer: head]{US}[ONNX Layer: residual]\x1e[ONNX Layer: relu3]",
        },
    ],
    "Bindings": ["x", "logits"],
}


def _to_11x(engine10: dict) -> dict:
    """The same engine in the 11.x layout: split Format / DataType fields and an I/O Tensors list."""
    spellings = {"Int8": "INT8", "FP16": "FP16", "FP32": "FP32"}
    layers = []
    for index, layer in enumerate(engine10["Layers"]):
        new = {k: v for k, v in layer.items() if k not in ("Inputs", "Outputs")}
        for side in ("Inputs", "Outputs"):
            new[side] = []
            for tensor in layer[side]:
                dtype = next(v for k, v in spellings.items() if k in tensor["Format/Datatype"])
                key = "Datatype" if index % 2 else "DataType"  # both spellings are seen in 11.x output
                new[side].append(_tensor11(tensor["Name"], dtype, key))
        if "Weights" in layer:
            new["Weights"] = {"Type": {"Int8": "INT8", "Half": "FP16", "Float": "FP32"}[layer["Weights"]["Type"]]}
        layers.append(new)
    return {
        "Layers": layers,
        "I/O Tensors": [
            {"Name": "x", "IOMode": "INPUT", "DataType": "FP32", "Dimensions": [16, 32], "Location": "DEVICE"},
            {"Name": "logits", "IOMode": "Output", "Datatype": "FP32", "Dimensions": [16, 10], "Location": "DEVICE"},
        ],
    }


ENGINE_11X = _to_11x(ENGINE_10X)


@pytest.mark.parametrize(("engine", "layout"), [(ENGINE_10X, "10.x"), (ENGINE_11X, "11.x")])
def test_both_layouts_map_layers_and_find_the_fp32_fallback(engine, layout):
    info = parse_engine_info(json.dumps(engine))
    assert info.layout == layout and info.detailed
    assert [t.name for t in info.io_tensors] == ["x", "logits"]
    if layout == "11.x":
        assert [(t.mode, t.dtype) for t in info.io_tensors] == [("input", "fp32"), ("output", "fp32")]
    assert [layer.name for layer in info.layers_of("fc1")][-1].startswith("fc1__x__DQ + fc1__w__DQ + fc1")
    report = check_precisions(info, REQUESTED)
    observed = {check.node: check.observed for check in report.checks}
    assert observed == {"fc1": "int8", "fc2": "fp16", "fc3": "fp32", "head": "fp32"}
    assert [check.node for check in report.mismatches] == ["fc3"]
    assert report.unverified == []
    message = report.mismatches[0].describe()
    assert message.startswith("requested int8 for layer 'fc3', engine runs it in fp32")
    assert "MatrixMultiply inputs [fp32, fp32]" in message


def test_metadata_splitting():
    assert onnx_nodes(f"[ONNX Layer: a]{US}[ONNX Layer: /b/MatMul]\x1e[ONNX Layer: c]") == ("a", "/b/MatMul", "c")
    assert onnx_nodes("[ONNX Layer: a][ONNX Layer: b]") == ("a", "b")
    assert onnx_nodes("[ONNX Layer: a]\x1f[ONNX Layer: a]") == ("a",)
    assert onnx_nodes("[ONNX Layer: x[0]/MatMul]") == ("x[0]/MatMul",)  # a "]" inside a node name
    assert onnx_nodes("") == () and onnx_nodes(None) == () and onnx_nodes("fc1 + relu1") == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Row major linear FP32", "fp32"),
        ("Float", "fp32"),
        ("Channel major FP16 format where channel % 8 == 0", "fp16"),
        ("Half", "fp16"),
        ("Row major linear BFloat16", "bf16"),
        ("BF16", "bf16"),
        ("Thirty-two wide channel vectorized row major Int8 format", "int8"),
        ("INT8", "int8"),
        ("DataType.FP8", "fp8"),
        ("Float8E4M3", "fp8"),
        ("UInt8", "uint8"),
        ("Int64", "index"),
        ("Row major linear", None),
        (7, None),
    ],
)
def test_dtype_spellings(text, expected):
    assert normalize_dtype(text) == expected


def test_names_only_verbosity_and_foreign_nodes_are_unverified_not_mismatched():
    names_only = parse_engine_info({"Layers": ["fc1 + relu1", "fc2"], "Bindings": ["x", "logits"]})
    assert not names_only.detailed
    report = check_precisions(names_only, {"fc1": "int8"})
    assert report.mismatches == [] and report.unverified[0].note.startswith("the engine was not built with")

    myelin = {
        "Layers": [
            {
                "Name": "{ForeignNode[fc1...head]}",
                "LayerType": "Myelin",
                "Inputs": [_tensor11("x", "FP32")],
                "Outputs": [_tensor11("logits", "FP32")],
                "Metadata": US.join(f"[ONNX Layer: {n}]" for n in ("fc1", "fc2", "head")),
            }
        ],
        "I/O Tensors": [],
    }
    report = check_precisions(parse_engine_info(myelin), {"fc1": "int8", "fc3": "int8"})
    notes = {check.node: check.note for check in report.unverified}
    assert report.mismatches == []
    assert "ForeignNode" in notes["fc1"] and "no engine layer carries" in notes["fc3"]
    assert "not verifiable" in summarize(report)


def test_bad_inspector_output_raises():
    with pytest.raises(InspectorFormatError, match="not JSON"):
        parse_engine_info("Layers: nope")
    with pytest.raises(InspectorFormatError, match="no 'Layers'"):
        parse_engine_info({"Bindings": []})


def _bare_backend(strict: bool) -> TensorRTBackend:
    backend = object.__new__(TensorRTBackend)  # the verification step needs only the options, not TensorRT
    backend.options = TensorRTOptions(strict_precision=strict)
    return backend


def test_strict_precision_fails_the_build_loudly():
    with pytest.raises(BuildError, match=r"requested int8 for layer 'fc3', engine runs it in fp32") as raised:
        _bare_backend(strict=True)._verify(json.dumps(ENGINE_11X), REQUESTED)
    assert "strict_precision: false" in str(raised.value)


def test_non_strict_precision_only_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="autotune.backends.tensorrt"):
        report = _bare_backend(strict=False)._verify(json.dumps(ENGINE_10X), REQUESTED)
    assert [c.node for c in report.mismatches] == ["fc3"]
    assert "requested int8 for layer 'fc3', engine runs it in fp32" in caplog.text
    assert report.to_dict()["fc1"] == {
        "requested": "int8",
        "observed": "int8",
        "engine_layers": ["fc1__x__DQ + fc1__w__DQ + fc1 + fc1_bias + relu1"],
        "note": "CaskGemmMatrixMultiply inputs [int8], weights int8",
    }


def test_unparsable_inspector_output_fails_strict_builds_with_low_precision_layers():
    with pytest.raises(BuildError, match="cannot verify layer precisions"):
        _bare_backend(strict=True)._verify("not json", REQUESTED)
    assert _bare_backend(strict=True)._verify("not json", {"head": "fp32"}).checks == ()
