"""OpenVINO on the CPU: per-layer FP32, BF16 (where the CPU has it) and INT8, and OpenVINO's own one-liners.

``backend.name: openvino`` (the ``openvino`` extra; the NNCF references need the ``nncf`` extra).
"""

from __future__ import annotations

from autotune.backends.openvino.backend import OpenVINOArtifact, OpenVINOCPU, load_compiled
from autotune.backends.openvino.properties import (
    INFERENCE_PRECISION_KNOB,
    OPENVINO_RECIPE,
    OPENVINO_SCHEMES,
    bf16_features,
)
from autotune.backends.openvino.references import REFERENCES

__all__ = [
    "INFERENCE_PRECISION_KNOB",
    "OPENVINO_RECIPE",
    "OPENVINO_SCHEMES",
    "REFERENCES",
    "OpenVINOArtifact",
    "OpenVINOCPU",
    "bf16_features",
    "load_compiled",
]
