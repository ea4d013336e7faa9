"""The whole module in a base precision with per-layer overrides, the attention knob, and the one-liner references.

CPU tests run eager (``device: cpu``); the GPU tests (``-m gpu``) skip without CUDA.
"""

import json

import numpy as np
import pytest
import torch
from torch import nn

from autotune.backends import BuildError
from autotune.backends.torch import (
    DeviceInfo,
    ModuleChoice,
    load_exported,
    module_choices,
    probe_device,
    rewrite_module,
    torch_capabilities,
)
from autotune.backends.torch.attention import attention_implementations, set_attention
from autotune.capabilities import Capabilities, Knob
from autotune.config.schema import SearchSpaceConfig
from autotune.model.layers import Layer
from autotune.plan import Plan
from autotune.search.space import build_space
from autotune.testing import tiny_torch_cnn, tiny_torch_mlp

CPU_OPS = probe_device("cpu").ops
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NVIDIA GPU and a CUDA torch)")


def _dtypes(module):
    return {p.dtype for p in module.parameters()}


def _cosine(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- the rewrite --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["fp16", "bf16"])
def test_a_base_precision_converts_the_whole_module_and_keeps_the_fp32_interface(base):
    if base not in CPU_OPS:
        pytest.skip(f"{base} does not run on this CPU")
    dtype = torch.float16 if base == "fp16" else torch.bfloat16
    module = tiny_torch_cnn()
    rewritten = rewrite_module(module, {}, base=base)
    assert type(rewritten).__name__ == "PrecisionBoundary" and rewritten.compute_dtype == dtype
    assert _dtypes(rewritten) == {dtype} and _dtypes(module) == {torch.float32}  # the original is left alone
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        got, expected = rewritten(x), module(x)  # a float32 input is cast in at the boundary
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got - expected).abs().max() <= 3e-2 * expected.abs().max()
    assert rewrite_module(module, {}) is not module and type(rewrite_module(module, {})) is type(module)


def test_fp32_overrides_in_a_bf16_base_keep_exact_fp32_weights_and_float32_outputs():
    module = tiny_torch_mlp()
    rewritten = rewrite_module(module, {"fc1": ModuleChoice("fp32")}, base="bf16")
    inner = rewritten.model
    assert type(inner.fc1).__name__ == "CastLayer" and inner.fc1.compute_dtype == torch.float32
    # The override's weights are the FP32 ones, bit for bit: the base conversion must not round them.
    assert inner.fc1.layer.weight.dtype == torch.float32 and torch.equal(inner.fc1.layer.weight, module.fc1.weight)
    assert type(inner.fc2) is nn.Linear and inner.fc2.weight.dtype == torch.bfloat16
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = rewritten(x)
        # fc1 in FP32 on the bf16-rounded input, then ReLU and fc2 in bf16
        expected = module.fc1(x.to(torch.bfloat16).float()).to(torch.bfloat16)
        expected = inner.fc2(torch.relu(expected)).float()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_int8_overrides_in_a_half_base_keep_float32_scales_and_biases():
    module = tiny_torch_mlp()
    rewritten = rewrite_module(module, {"fc2": ModuleChoice("int8", (-4.0, 4.0))}, base="bf16")
    wrapper = rewritten.model.fc2
    assert type(wrapper).__name__ == "Int8Linear"
    assert {wrapper.act_scale.dtype, wrapper.out_scale.dtype, wrapper.bias.dtype} == {torch.float32}
    torch.testing.assert_close(wrapper.bias, module.fc2.bias.detach())
    assert rewritten.model.fc1.weight.dtype == torch.bfloat16
    out = rewritten(torch.randn(4, 32))
    assert out.dtype == torch.float32 and out.shape == (4, 16)


def _layer(name, tensor):
    return Layer(name, "Gemm", 0, (tensor,), "w", 0, None, "y", ((4, 32),), (4, 32), 0, 0, 1)


def test_layer_precisions_are_absolute_and_only_those_off_the_base_are_wrapped():
    layers = [_layer("/fc1/Gemm", "a"), _layer("/fc2/Gemm", "b")]
    bindings = {"/fc1/Gemm": "fc1", "/fc2/Gemm": "fc2"}
    ranges = {"a": (-1.0, 1.0), "b": (-2.0, 2.0)}
    plan = Plan.make({"/fc1/Gemm": "fp32", "/fc2/Gemm": "bf16"})
    assert module_choices(plan, layers, bindings, ranges) == {"fc2": ModuleChoice("bf16")}
    assert module_choices(plan, layers, bindings, ranges, base="bf16") == {"fc1": ModuleChoice("fp32")}
    assert module_choices(plan, layers, bindings, ranges, base="fp16") == {
        "fc1": ModuleChoice("fp32"),
        "fc2": ModuleChoice("bf16"),
    }
    with pytest.raises(BuildError, match="no float precision"):
        rewrite_module(tiny_torch_mlp(), {}, base="int8")


# ---- capabilities and the search space ----------------------------------------------------------------------


def _cuda(capability, ops=frozenset({"fp16", "bf16", "int8", "fp8_rowwise", "compile", "gemm_backends"})):
    return DeviceInfo("cuda", "2.11.0", True, capability, "gpu", frozenset(ops))


def test_the_base_precision_knob_offers_what_the_device_runs_fp32_first():
    def base(info, attention=()):
        knobs = {k.name: k for k in torch_capabilities(info, attention).knobs}
        return knobs.get("base_precision")

    assert base(_cuda((9, 0))).values == ("fp32", "fp16", "bf16") and base(_cuda((9, 0))).follows_precision
    assert base(_cuda((7, 5))).values == ("fp32", "fp16")  # no bf16 before Ampere
    assert base(_cuda((9, 0), {"bf16"})).values == ("fp32", "bf16")
    assert base(_cuda((9, 0), {"int8"})) is None  # nothing below FP32: no knob
    cpu = DeviceInfo("cpu", "2.13.0+cpu", ops=CPU_OPS)
    assert base(cpu).values == tuple(p for p in ("fp32", "fp16", "bf16") if p in {"fp32", *CPU_OPS})
    knobs = {k.name: k for k in torch_capabilities(_cuda((9, 0)), ("eager", "sdpa")).knobs}
    assert knobs["attention"].values == ("eager", "sdpa") and not knobs["attention"].follows_precision
    assert "attention" not in {k.name for k in torch_capabilities(_cuda((9, 0)), ("eager",)).knobs}


def test_the_numerically_neutral_knobs_are_free_and_the_others_searched():
    knobs = torch_capabilities(_cuda((9, 0)), ("sdpa", "eager")).knobs
    assert {k.name for k in knobs if k.free} == {"attention", "cuda_graphs", "cudnn_benchmark"}
    # TF32 and the base change the numbers; gemm_backends acts in max-autotune only, which no seed runs
    assert {k.name for k in knobs if not k.free} == {"mode", "gemm_backends", "tf32", "base_precision"}
    without_convolutions = torch_capabilities(_cuda((9, 0)), ("sdpa", "eager"), convolutions=False).knobs
    assert {k.name for k in without_convolutions if k.free} == {"attention", "cuda_graphs"}  # cuDNN tunes nothing
    from autotune.backends.torch.backend import has_convolutions

    assert has_convolutions(tiny_torch_cnn()) and not has_convolutions(tiny_torch_mlp())
    restricted = build_space(
        [_layer("/fc1/Gemm", "a")],
        Capabilities({"Gemm": ("fp32",)}, knobs),
        SearchSpaceConfig(knobs={"cuda_graphs": [True]}),
    )
    assert [k.name for k in restricted.free_knobs] == ["cudnn_benchmark", "attention"]  # one value: nothing to fix


def test_uniform_plans_set_the_knobs_that_follow_the_precision():
    layers = [_layer("/fc1/Gemm", "a"), _layer("/fc2/Gemm", "b")]
    capabilities = Capabilities(
        {"Gemm": ("fp32", "fp16", "bf16", "int8")},
        (Knob("base_precision", ("fp32", "fp16", "bf16"), follows_precision=True), Knob("tf32", (False, True))),
    )
    space = build_space(layers, capabilities, SearchSpaceConfig())
    assert space.uniform("fp16").knob("base_precision") == "fp16"
    assert space.uniform("bf16", {"base_precision": "fp32"}).knob("base_precision") == "fp32"  # explicit wins
    assert space.uniform("int8").knob("base_precision") == "fp32"  # no int8 base: the default
    assert space.uniform("fp32") == space.plan()  # the FP32 reference is unchanged
    without_convolutions = torch_capabilities(_cuda((9, 0)), ("sdpa", "eager"), convolutions=False).knobs
    assert {k.name for k in without_convolutions if k.free} == {"attention", "cuda_graphs"}  # cuDNN tunes nothing
    from autotune.backends.torch.backend import has_convolutions

    assert has_convolutions(tiny_torch_cnn()) and not has_convolutions(tiny_torch_mlp())
    restricted = build_space(layers, capabilities, SearchSpaceConfig(knobs={"base_precision": ["fp32", "bf16"]}))
    assert restricted.uniform("fp16").knob("base_precision") == "fp32"  # not offered: left at the default
    assert restricted.uniform("bf16").knob("base_precision") == "bf16"
    assert not restricted.violations(restricted.uniform("fp16"))


# ---- builds and references on the CPU (eager) ---------------------------------------------------------------


def test_builds_with_a_base_precision_and_overrides(runner):
    space, backend = runner.space, runner.backend
    assert {k.name: k.values for k in space.knobs}["base_precision"][0] == "fp32"
    assert runner.reference.knobs["base_precision"] == "fp32" and _dtypes(runner.reference.module) == {torch.float32}
    feeds = runner.datasets["evaluation"].batches[0]
    expected = backend.run(runner.reference, feeds)[0]
    uniform = space.uniform("bf16")
    assert uniform.knob("base_precision") == "bf16"
    whole = runner.build(uniform, runner.config.run_dir)
    assert whole.choices == {} and _dtypes(whole.module) == {torch.bfloat16}
    layers = space.layer_names
    mixed = space.plan({layers[0]: "fp32", layers[1]: "bf16"}, {"base_precision": "bf16"})
    artifact = runner.build(mixed, runner.config.run_dir)
    assert artifact.choices == {"fc1": "fp32"}
    assert artifact.module.model.fc1.layer.weight.dtype == torch.float32
    for built in (whole, artifact):
        out = backend.run(built, feeds)[0]
        assert out.dtype == np.float32 and out.shape == expected.shape and _cosine(out, expected) > 0.999
    result = runner.run(mixed)
    assert result.ok, result.error


def test_one_liner_references_build_and_run_on_the_cpu(runner, tmp_path):
    backend = runner.backend
    offered = backend.references()
    assert "torch-tf32" not in offered  # no TF32 on the CPU
    assert offered == tuple(f"torch-{p}" for p in ("fp16", "bf16") if p in CPU_OPS)  # torchao-fp8 is CUDA only
    if "torch-bf16" not in offered:
        pytest.skip("bf16 does not run on this CPU")
    with pytest.raises(BuildError, match="no reference 'torch-tf32'"):
        backend.build_reference("torch-tf32", [], tmp_path)
    artifact = backend.build_reference("torch-bf16", runner.datasets["evaluation"].batches[:1], tmp_path)
    assert artifact.reference == "torch-bf16" and artifact.knobs["mode"] == "eager"
    assert _dtypes(artifact.module) == {torch.bfloat16} and artifact.choices == {}
    feeds = runner.datasets["evaluation"].batches[0]
    out = backend.run(artifact, feeds)[0]
    assert out.dtype == np.float32 and _cosine(out, backend.run(runner.reference, feeds)[0]) > 0.999
    assert backend.time_run(artifact, feeds) > 0
    files = backend.export(artifact, runner.space.uniform("bf16"), tmp_path / "export")
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert files[0].name == "module_state.pt"
    assert manifest["reference"] == "torch-bf16" and manifest["base_precision"] == "bf16"
    loaded = load_exported(tmp_path / "export", "cpu")
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(torch.from_numpy(feeds["x"])).numpy(), out)


def test_exported_overrides_in_a_base_rebuild_the_same_module(runner, tmp_path):
    layers = runner.space.layer_names
    plan = runner.space.plan({layers[0]: "fp32", layers[1]: "int8"}, {"base_precision": "bf16"})
    runner.export(plan, tmp_path / "export")
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["modules"] == {"fc1": "fp32", "fc2": "int8"} and manifest["base_precision"] == "bf16"
    feeds = runner.datasets["evaluation"].batches[0]
    expected = runner.backend.run(runner.build(plan, tmp_path), feeds)[0]
    module = load_exported(tmp_path / "export", "cpu")
    assert module.model.fc1.layer.weight.dtype == torch.float32 and module.model.fc2.bias.dtype == torch.float32
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(feeds["x"])).numpy(), expected)


# ---- the attention knob -------------------------------------------------------------------------------------


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.BertModel(config).eval()


def test_attention_is_a_knob_only_where_the_model_can_swap_it():
    assert attention_implementations(tiny_torch_mlp()) == ()
    with pytest.raises(BuildError, match="no transformers model"):
        set_attention(tiny_torch_mlp(), "sdpa")
    bert = _tiny_bert()
    # SDPA first although the factory set eager: it is what from_pretrained gives the model's users by default.
    assert attention_implementations(bert) == ("sdpa", "eager")
    wrapped = nn.Sequential(bert)  # found at any depth, as MiniLM's factory nests its BertModel
    assert attention_implementations(wrapped) == ("sdpa", "eager")
    bert.__class__ = type("NoSdpaBert", (type(bert),), {"_supports_sdpa": False})
    assert attention_implementations(bert) == ()  # eager only: nothing to swap, and eager is the users' default
    bert.__class__ = type(bert).__mro__[1]
    swapped = rewrite_module(wrapped, {}, attention="sdpa")
    assert swapped[0].config._attn_implementation == "sdpa" and bert.config._attn_implementation == "eager"
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        got = swapped[0](input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_one_liners_and_the_default_plan_run_the_users_attention(tmp_path):
    """The references are built on the attention a transformers user has (SDPA), not the factory's eager one."""
    from autotune.backends.torch import TorchBackend
    from autotune.config.schema import TorchOptions

    _tiny_bert()  # skips without transformers
    backend = TorchBackend("tests.backends.torch.test_base_precision:_tiny_bert", TorchOptions(device="cpu"))
    knobs = {k.name: k for k in backend.capabilities().knobs}
    assert knobs["attention"].default == "sdpa"
    assert backend.knob_values({})["attention"] == "sdpa"
    module = rewrite_module(backend.fp32_module(), {}, attention=str(backend.knob_values({})["attention"]))
    assert module.config._attn_implementation == "sdpa"
    assert backend.fp32_module().config._attn_implementation == "eager"  # the export's module is left alone


def test_the_torchao_fp8_one_liner_is_offered_on_fp8_gpus_with_torchao(monkeypatch):
    from autotune.backends.torch import backend as torch_backend

    fake = object.__new__(torch_backend.TorchBackend)
    fake._info = _cuda((9, 0))  # what the probe answered
    fake._capabilities = torch_capabilities(fake.info, ("sdpa", "eager"))
    monkeypatch.setattr(torch_backend, "torchao_installed", lambda: True)
    assert fake.references() == ("torch-tf32", "torch-fp16", "torch-bf16", "torchao-fp8")
    monkeypatch.setattr(torch_backend, "torchao_installed", lambda: False)
    assert "torchao-fp8" not in fake.references()
    monkeypatch.setattr(torch_backend, "torchao_installed", lambda: True)
    fake._info = _cuda((8, 0))  # an A100: no FP8 GEMMs
    fake._capabilities = torch_capabilities(fake.info, ("sdpa", "eager"))
    assert "torchao-fp8" not in fake.references()


def test_the_fp32_reference_runs_eager_in_one_cuda_graph_on_cuda_and_at_the_defaults_on_the_cpu():
    from autotune.backends.torch import backend as torch_backend

    fake = object.__new__(torch_backend.TorchBackend)
    fake._info = _cuda((9, 0))
    fake._capabilities = torch_capabilities(fake.info, ("sdpa", "eager"))
    assert fake.fp32_reference_knobs() == {"mode": "eager", "cuda_graphs": True}
    defaults = {knob.name: knob.default for knob in fake.capabilities().knobs}
    assert defaults["mode"] == "compile"  # the search's FP32 plan compiles; the reference does not
    assert fake.knob_values(fake.fp32_reference_knobs())["mode"] == "eager"  # offered on the device
    fake._info = _cuda((9, 0), {"fp16", "bf16"})  # no torch.compile: eager is the only mode anyway
    fake._capabilities = torch_capabilities(fake.info)
    assert fake.fp32_reference_knobs() == {"mode": "eager", "cuda_graphs": True}
    fake._info = DeviceInfo("cpu", "2.11.0+cpu", True, None, "cpu", frozenset({"fp16", "bf16"}))
    fake._capabilities = torch_capabilities(fake.info)
    assert fake.fp32_reference_knobs() == {"mode": "eager"}  # no CUDA graphs knob on the CPU


# ---- the GPU (skipped without CUDA) -------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_base_precision_plans_and_one_liners(cuda_runner):
    backend, space = cuda_runner.backend, cuda_runner.space
    feeds = cuda_runner.datasets["evaluation"].batches[0]
    expected = backend.run(cuda_runner.reference, feeds)[0]
    if backend.info.capability >= (8, 0):  # TF32 and bf16 from Ampere on
        from autotune.backends.torch.backend import torchao_installed

        fp8 = backend.info.capability >= (8, 9) and torchao_installed()  # torchao's FP8 one-liner from Ada on
        assert backend.references() == ("torch-tf32", "torch-fp16", "torch-bf16", *(("torchao-fp8",) if fp8 else ()))
    layers = space.layer_names
    plans = [space.uniform("fp16"), space.plan({layers[0]: "fp32", layers[1]: "fp16"}, {"base_precision": "fp16"})]
    if "int8" in space.choices[0]:
        plans.append(space.plan({layers[0]: "int8", layers[1]: "bf16"}, {"base_precision": "bf16"}))
    built = []
    for plan in plans:
        artifact = cuda_runner.build(plan, cuda_runner.config.run_dir)
        assert artifact.graph is not None and artifact.knobs["base_precision"] == plan.knob("base_precision")
        got = backend.run(artifact, feeds)[0]
        assert got.dtype == np.float32 and _cosine(got, expected) > 0.99, plan.describe()
        built.append((artifact, got))
    for name in backend.references():
        artifact = backend.build_reference(name, [], cuda_runner.config.run_dir)
        assert artifact.knobs["mode"] == "reduce-overhead" and artifact.graph is None
        assert artifact.knobs["tf32"] is (name == "torch-tf32")
        for _ in range(2):  # inductor's CUDA graphs replay: the outputs stay right across calls
            assert _cosine(backend.run(artifact, feeds)[0], expected) > 0.99, name
        times = [backend.time_run(artifact, feeds) for _ in range(5)]
        assert all(0 < t < 1000 for t in times)
    # Inductor's CUDA graphs free cuBLAS's workspaces when they record: our own graphs, captured before, must not
    # have used them (they replayed freed memory: an illegal memory access on the H200).
    for artifact, got in [(cuda_runner.reference, expected), *built]:
        for _ in range(3):
            np.testing.assert_array_equal(backend.run(artifact, feeds)[0], got)
            assert backend.time_run(artifact, feeds) > 0
