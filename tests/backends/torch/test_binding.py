"""ONNX layers -> modules: exporter scope names, real TorchScript exports, and layers that cannot map."""

import pytest
import torch
from torch import nn

from autotune.api import analyze
from autotune.backends.torch import bind_layers, count_calls, module_path, resolve_module_path
from autotune.backends.torch.binding import one_row
from autotune.harness import SetupError, TrialRunner
from autotune.model.layers import InputSpec, load_onnx, prepare_model, weight_array
from autotune.model.torch_export import export_torch
from autotune.testing import tiny_torch_config

HERE = "tests.backends.torch.test_binding"


# ---- factories exported through the real TorchScript exporter -------------------------------------------------


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class _Nested(nn.Module):
    """Nested scopes: a ModuleList, nested Sequentials, a module called twice, a Conv and a 2-D Linear."""

    def __init__(self):
        super().__init__()
        self.enc = _Inner()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)))
        self.shared = nn.Linear(16, 16)
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 8)

    def forward(self, x, image):
        y = self.shared(self.shared(self.net(self.enc(x))))
        return y, self.head(self.conv(image).mean((2, 3)))


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        return x @ self.weight


class _Unmappable(nn.Module):
    """A Linear, a weight MatMul that is no nn.Linear, and an activation x activation MatMul."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.custom = _Custom()

    def forward(self, x):
        h = self.fc(x)
        scores = h @ h.transpose(-1, -2)
        return self.custom(scores @ h)


def _seeded(cls, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls().eval()


def nested_net():
    return _seeded(_Nested)


def unmappable_net():
    return _seeded(_Unmappable)


def _exported(tmp_path, factory, inputs, activation_matmuls=False):
    path = export_torch(f"{HERE}:{factory}", inputs, tmp_path / f"{factory}.onnx")
    return prepare_model(load_onnx(path), path, inputs, activation_matmuls)


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    inputs = [InputSpec("x", (2, 5, 32), "float32"), InputSpec("image", (1, 3, 8, 8), "float32")]
    return _exported(tmp_path_factory.mktemp("nested"), "nested_net", inputs)


# ---- ONNX layers -> modules ---------------------------------------------------------------------------------


def test_module_path_reads_the_exporter_scopes():
    assert module_path("/encoder/encoder/layer.0/attention/self/query/MatMul") == (
        "encoder.encoder.layer.0.attention.self.query"
    )
    assert module_path("/fc1/Gemm") == "fc1"
    assert module_path("/stem/conv/Conv") == "stem.conv"
    assert module_path("/MatMul") == ""


def test_resolve_module_path_handles_sequentials_lists_and_reuse():
    names = {"", "enc", "enc.proj", "enc.blocks", "enc.blocks.0", "net", "net.0", "net.2", "net.2.0", "shared"}
    assert resolve_module_path("/enc/proj/MatMul", names) == "enc.proj"
    assert resolve_module_path("/enc/blocks.0/MatMul", names) == "enc.blocks.0"
    assert resolve_module_path("/net/net.0/MatMul", names) == "net.0"
    assert resolve_module_path("/net/net.2/net.2.0/MatMul", names) == "net.2.0"
    assert resolve_module_path("/shared_1/MatMul", names) == "shared"  # a module called twice
    assert resolve_module_path("/missing/MatMul", names) is None
    assert resolve_module_path("fc1", names) is None  # a hand-written ONNX name


def test_every_layer_of_a_real_export_maps_onto_its_module(nested):
    module = nested_net()
    bound = bind_layers(module, nested.layers, set(nested.layer_names), lambda n: weight_array(nested.proto, n))
    assert sorted(bound.values()) == sorted(
        ["enc.proj", "enc.blocks.0", "enc.blocks.1", "net.0", "net.2.0", "shared", "conv", "head"]
    )
    ops = {layer.name: layer.op_type for layer in nested.layers}
    assert {ops[name] for name, path in bound.items() if path == "enc.proj"} == {"MatMul"}  # 3-D input
    assert {ops[name] for name, path in bound.items() if path == "head"} == {"Gemm"}
    # `shared` runs twice; the exporter routes its second call's weight through an Identity, so only the first
    # call is a tunable layer, and one static scale calibrated on it would clip the second call's input.
    calls = count_calls(module, nested.inputs, set(bound.values()))
    assert calls["shared"] == 2 and calls["head"] == 1
    shared = next(name for name, path in bound.items() if path == "shared")
    others = set(nested.layer_names) - {shared}
    assert "shared" not in bind_layers(module, nested.layers, others, calls=calls).values()
    with pytest.raises(ValueError, match="'shared' runs 2 times.*search.exclude_layers"):
        bind_layers(module, nested.layers, {shared}, calls=calls)
    with pytest.raises(ValueError, match="factory must return the same weights"):
        bind_layers(_seeded(_Nested, seed=1), nested.layers, set(), lambda n: weight_array(nested.proto, n))


def test_unmappable_searched_layers_fail_at_setup_naming_exclude_layers(tmp_path):
    model = _exported(tmp_path, "unmappable_net", [InputSpec("x", (4, 32), "float32")], activation_matmuls=True)
    module = unmappable_net()
    unmappable = [layer.name for layer in model.layers if layer.weight is None or "/custom/" in layer.name]
    assert len(unmappable) == 3
    with pytest.raises(ValueError, match="search.exclude_layers") as raised:
        bind_layers(module, model.layers, set(model.layer_names))
    message = str(raised.value)
    assert all(name in message for name in unmappable)
    assert "activation x activation" in message and "not nn.Linear" in message
    # The same layers left out of the search are just skipped.
    assert list(bind_layers(module, model.layers, {"/fc/Gemm"}).values()) == ["fc"]


def test_setup_names_exclude_layers(tmp_path):
    config = tiny_torch_config(
        tmp_path,
        model={"torch": f"{HERE}:unmappable_net", "include_activation_matmuls": True},
        inputs=[{"name": "x", "shape": [4, 32], "dtype": "float32"}],
        data={split: {"random": 1} for split in ("calibration", "evaluation")},
        metric={"name": "cosine"},
    )
    with pytest.raises(SetupError, match="cannot map 3 searched layers.*search.exclude_layers"):
        TrialRunner(config)
    with pytest.raises(SetupError, match="cannot map 3 searched layers"):
        analyze(config)  # `autotune tune` and `inspect` fail before a run directory exists


class _FixedBatch(torch.nn.Module):
    """A module written for its batch size: a reshape with the batch hard-coded, as some exported models have."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch
        self.fc = torch.nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return self.fc(x.reshape(self.batch, 4))


def test_calls_are_counted_on_one_row_and_on_the_whole_batch_where_one_row_fails():
    inputs = [InputSpec("x", (8, 4), "float32")]
    assert one_row(inputs) == [InputSpec("x", (1, 4), "float32")]
    assert one_row([InputSpec("x", (8, 4), "float32"), InputSpec("m", (2, 4), "int64")]) is None  # no shared batch
    assert one_row([InputSpec("x", (1, 4), "float32")]) is None
    flexible = _FixedBatch(batch=-1)
    assert count_calls(flexible, inputs, {"fc"}) == {"fc": 1} and flexible.seen == [1]
    fixed = _FixedBatch(batch=8)
    assert count_calls(fixed, inputs, {"fc"}) == {"fc": 1} and fixed.seen == [1, 8]
