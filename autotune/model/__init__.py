"""The model: intake of ONNX files and PyTorch modules, shapes, op types and the table of tunable layers."""
