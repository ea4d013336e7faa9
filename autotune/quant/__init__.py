"""Quantization: our calibration, the backend recipes, and the plan-to-typed-ONNX rewriter."""
