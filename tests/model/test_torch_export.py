"""Tests for autotune.model.torch_export: a factory's module to ONNX, at its shapes or traced at two rows."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.model.layers import InputSpec, load_onnx, prepare_model
from autotune.model.torch_export import export_torch

pytest.importorskip("torch")


def test_two_exports_of_the_same_cached_model_at_once_both_succeed(tmp_path, monkeypatch):
    # bench/run.py --jobs starts runs together, and each exports the shared cached model if it is missing:
    # here a second export starts and finishes while the first is between writing its file and moving it.
    import torch

    real_export = torch.onnx.export
    target = tmp_path / "cache" / "mlp.onnx"
    inputs = [InputSpec("x", (2, 32), "float32")]
    interleaved = []

    def export_then_let_another_run_export(*args, **kwargs):
        real_export(*args, **kwargs)
        if not interleaved:
            interleaved.append(True)
            export_torch("autotune.testing:tiny_torch_mlp", inputs, target)

    monkeypatch.setattr(torch.onnx, "export", export_then_let_another_run_export)
    assert export_torch("autotune.testing:tiny_torch_mlp", inputs, target) == target
    assert interleaved
    assert load_onnx(target).graph.input[0].name == "x"
    assert [path.name for path in target.parent.iterdir()] == ["mlp.onnx"]  # no temporary file left behind


# ---- exports traced at two rows (the torch backend's) ----------------------------------------------------------

HERE = "tests.model.test_torch_export"


def batch_baking_mlp(how: str = "reshape"):
    """``tiny_torch_mlp`` that reads its batch as a Python int, which the trace keeps as a constant."""
    import torch

    from autotune.testing import tiny_torch_mlp

    class BatchBaking(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = tiny_torch_mlp()

        def forward(self, x):
            rows = int(x.shape[0])
            if how == "reshape":  # fails to run at another batch
                return self.mlp(x).reshape(rows, 4, 4)
            return self.mlp(x), torch.zeros(rows, 1)  # runs, with an output of the traced batch

    return BatchBaking().eval()


def batch_baking_outputs():
    return batch_baking_mlp("outputs")


def _onnx_outputs(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_batch_free_export_traces_two_rows_and_loads_at_the_configured_shapes(tmp_path, monkeypatch):
    import torch

    traced_shapes = []
    real_export = torch.onnx.export

    def recording_export(module, args, *rest, **kwargs):
        traced_shapes.append([tuple(arg.shape) for arg in args])
        return real_export(module, args, *rest, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", recording_export)
    inputs = [InputSpec("x", (16, 32), "float32")]
    free = export_torch("autotune.testing:tiny_torch_mlp", inputs, tmp_path / "free.onnx", batch_free=True)
    fixed = export_torch("autotune.testing:tiny_torch_mlp", inputs, tmp_path / "fixed.onnx")
    assert traced_shapes == [[(2, 32)], [(16, 32)]]
    assert load_onnx(free).graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic in the file
    free_table = prepare_model(load_onnx(free), free, inputs).layers
    fixed_table = prepare_model(load_onnx(fixed), fixed, inputs).layers
    columns = ("name", "op_type", "weight_axis", "input_shapes", "output_shape", "macs", "params")
    assert [[getattr(layer, c) for c in columns] for layer in free_table] == [
        [getattr(layer, c) for c in columns] for layer in fixed_table
    ]
    assert free_table[0].input_shapes == ((16, 32),)
    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    from autotune.testing import tiny_torch_mlp

    with torch.no_grad():
        expected = tiny_torch_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_onnx_outputs(free, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("factory", "symptom"),
    [("batch_baking_mlp", "cannot be reshaped"), ("batch_baking_outputs", "keeps its traced batch: output 1")],
)
def test_a_module_that_keeps_its_traced_batch_is_exported_at_its_configured_shapes(tmp_path, caplog, factory, symptom):
    inputs = [InputSpec("x", (16, 32), "float32")]
    with caplog.at_level("INFO", logger="autotune.model.torch_export"):
        path = export_torch(f"{HERE}:{factory}", inputs, tmp_path / "baked.onnx", batch_free=True)
    assert f"exporting {HERE}:{factory} at its configured batch" in caplog.text and symptom in caplog.text
    assert load_onnx(path).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 16
    outputs = _onnx_outputs(path, {"x": np.ones((16, 32), np.float32)})
    assert outputs[0].shape[0] == 16 and outputs[-1].shape[0] == 16  # the constants hold the configured batch


def test_inputs_without_a_shared_batch_above_two_rows_are_exported_as_configured(tmp_path):
    for name, inputs in (("two", [InputSpec("x", (2, 32), "float32")]), ("one", [InputSpec("x", (1, 32), "float32")])):
        path = export_torch("autotune.testing:tiny_torch_mlp", inputs, tmp_path / f"{name}.onnx", batch_free=True)
        assert load_onnx(path).graph.input[0].type.tensor_type.shape.dim[0].dim_value == inputs[0].shape[0]
