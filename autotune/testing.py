"""Tiny models and configs for tests and examples, built with onnx.helper (as SB3 ships its test envs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autotune.config.schema import TuneConfig, parse_config


def tiny_mlp(
    batch: int = 16, features: int = 32, hidden: int = 64, classes: int = 10, seed: int = 0
) -> onnx.ModelProto:
    """A 4-layer MLP (MatMul+Add, MatMul, MatMul, Gemm) whose second layer has an outlier weight column.

    The outlier makes per-tensor INT8 weights visibly worse than per-channel, so searches have something to find.
    """
    rng = np.random.default_rng(seed)

    def weight(name: str, shape: tuple[int, ...], scale: float = 1.0) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(np.float32), name
        )

    w2 = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    w2[:, 0] *= 40.0
    initializers = [
        weight("w1", (features, hidden)),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        weight("w3", (hidden, hidden)),
        weight("w4", (classes, hidden)),
        numpy_helper.from_array(np.zeros(classes, np.float32), "b4"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        helper.make_node("Relu", ["h1b"], ["a1"], name="relu1"),
        helper.make_node("MatMul", ["a1", "w2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["a2"], name="relu2"),
        helper.make_node("MatMul", ["a2", "w3"], ["h3"], name="fc3"),
        helper.make_node("Add", ["h3", "a2"], ["r3"], name="residual"),
        helper.make_node("Relu", ["r3"], ["a3"], name="relu3"),
        helper.make_node("Gemm", ["a3", "w4", "b4"], ["logits"], name="head", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tiny_sequence_model(features: int = 16, hidden: int = 8, seed: int = 0) -> onnx.ModelProto:
    """A token model with two inputs whose batch and sequence dimensions the graph leaves dynamic.

    ``x`` (float32, ``[batch, seq, features]``) is masked by ``mask`` (int64, ``[batch, seq]``) and projected by
    one MatMul into ``y`` (``[batch, seq, hidden]``): what a model exported with dynamic axes looks like to
    ``autotune tune model.onnx --data samples.npz``.
    """
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["mask"], ["mask_f"], name="mask_cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_3d"], name="mask_unsqueeze"),
        helper.make_node("Mul", ["x", "mask_3d"], ["masked"], name="apply_mask"),
        helper.make_node("MatMul", ["masked", "w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_sequence",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", features]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array([-1], np.int64), "last_axis")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def data_propagated_reshape_model() -> onnx.ModelProto:
    """X [4, 256] @ W [256, 128] (128 KiB, above the shape stub threshold), reshaped by a shape computed from x's.

    Its output shape is known only through data propagation: what shape inference without weight bytes must keep.
    """
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "W")
    minus_one = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    index = numpy_helper.from_array(np.array([0], np.int64), "index")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
        helper.make_node("Shape", ["x"], ["x_shape"], name="shape"),
        helper.make_node("Gather", ["x_shape", "index"], ["rows"], name="rows"),
        helper.make_node("Concat", ["rows", "minus_one"], ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["y", "target"], ["z"], name="reshape"),
        helper.make_node("Relu", ["z"], ["out"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "stubbed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [weight, minus_one, index],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")


def tiny_recurrent_model(
    batch: int = 8, seq: int = 12, features: int = 16, hidden: int = 32, classes: int = 10, seed: int = 0
) -> onnx.ModelProto:
    """A speech-style encoder: an ONNX ``LSTM``, then a ``GRU``, then a ``Gemm`` classifier on the last state.

    ``x`` is ``[batch, seq, features]`` (samples first, as a batch-first PyTorch export), transposed to the
    time-major layout ONNX's recurrent ops read. The LSTM has ``hidden`` units, the GRU ``hidden // 2`` (with
    ``linear_before_reset``, as PyTorch exports it); both carry biases. Output ``logits`` is ``[batch, classes]``.
    """
    rng = np.random.default_rng(seed)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), name)

    gru_hidden = hidden // 2
    initializers = [
        weight("lstm_w", (1, 4 * hidden, features)),
        weight("lstm_r", (1, 4 * hidden, hidden)),
        weight("lstm_b", (1, 8 * hidden)),
        weight("gru_w", (1, 3 * gru_hidden, hidden)),
        weight("gru_r", (1, 3 * gru_hidden, gru_hidden)),
        weight("gru_b", (1, 6 * gru_hidden)),
        weight("head_w", (classes, gru_hidden)),
        numpy_helper.from_array(np.zeros(classes, np.float32), "head_b"),
        numpy_helper.from_array(np.array([1], np.int64), "axis_direction"),
        numpy_helper.from_array(np.array([0], np.int64), "axis_first"),
    ]
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_time_major"], name="to_time_major", perm=[1, 0, 2]),
        helper.make_node(
            "LSTM", ["x_time_major", "lstm_w", "lstm_r", "lstm_b"], ["lstm_y"], name="lstm", hidden_size=hidden
        ),
        helper.make_node("Squeeze", ["lstm_y", "axis_direction"], ["lstm_out"], name="lstm_squeeze"),
        helper.make_node(
            "GRU",
            ["lstm_out", "gru_w", "gru_r", "gru_b"],
            ["gru_y", "gru_h"],
            name="gru",
            hidden_size=gru_hidden,
            linear_before_reset=1,
        ),
        helper.make_node("Squeeze", ["gru_h", "axis_first"], ["state"], name="state_squeeze"),
        helper.make_node("Gemm", ["state", "head_w", "head_b"], ["logits"], name="head", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_recurrent",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_recurrent_project(root: Path, batch: int = 8, seq: int = 12, features: int = 16, seed: int = 0) -> dict:
    """Writes ``tiny_recurrent_model`` and labelled calibration / evaluation / holdout data into ``root``.

    Labels are the FP32 model's predictions on clean inputs, scored on noisy ones (as ``write_tiny_project``).

    Returns:
        Paths of ``model``, ``calibration``, ``evaluation`` and ``holdout``; ``inputs``, the config's input list.
    """
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_recurrent_model(batch=batch, seq=seq, features=features, seed=seed)
    paths: dict[str, Any] = {"model": root / "recurrent.onnx"}
    onnx.save(model, str(paths["model"]))
    rng = np.random.default_rng(seed + 1)
    for split, samples in (("calibration", 2 * batch), ("evaluation", 8 * batch), ("holdout", 8 * batch)):
        clean = rng.standard_normal((samples, seq, features)).astype(np.float32)
        labels = np.concatenate([_forward(model, part) for part in np.split(clean, samples // batch)]).argmax(axis=1)
        noisy = (clean + 0.3 * rng.standard_normal(clean.shape)).astype(np.float32)
        paths[split] = root / f"{split}.npz"
        np.savez(paths[split], x=noisy, labels=labels.astype(np.int64))
    paths["inputs"] = [{"name": "x", "shape": [batch, seq, features], "dtype": "float32"}]
    return paths


def write_sequence_samples(path: Path, samples: int = 40, seq: int = 12, features: int = 16, seed: int = 0) -> Path:
    """Writes samples of ``tiny_sequence_model`` (``x`` and ``mask``, samples first) into one ``.npz`` at ``path``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, seq, features)).astype(np.float32)
    mask = (rng.uniform(size=(samples, seq)) < 0.9).astype(np.int64)
    np.savez(path, x=x, mask=mask)
    return path


def constant_weight_twins(batch: int = 2, seed: int = 0) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """One small CNN written twice: with every weight and bias a ``Constant`` chain, and with initializers.

    The first is how several non-PyTorch exporters write a model: no initializer at all. The Conv's weight is a
    Constant's ``value`` and its bias ``value_floats``; the MatMul's weight a ``Transpose`` of a Constant; the
    Gemm's weight an FP16 Constant ``Cast`` to float and ``Reshape``d by a Constant ``value_ints``. The Reshape of
    the activations and the Add of the MatMul's bias read Constants too, as such exporters write them. The second
    holds the same values (the Gemm's weight rounded to FP16 as the cast does) as initializers of the same names.

    Returns:
        ``(with_constants, with_initializers)``, input ``x`` of shape ``[batch, 3, 8, 8]``, output ``y``.
    """
    weights = _TwinWeights.draw(batch, seed)
    layers = [
        helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat_shape"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc.wt"], ["h"], name="fc"),
        helper.make_node("Add", ["h", "fc.b"], ["hb"], name="fc_bias"),
        helper.make_node("Gemm", ["hb", "head.w", "head.b"], ["y"], name="head", transB=1),
    ]
    with_constants = _twin_model([*weights.constant_chains(), *layers], [], batch)
    return with_constants, _twin_model(layers, weights.initializers(), batch)


@dataclass(frozen=True)
class _TwinWeights:
    """The weights :func:`constant_weight_twins` writes twice; ``fc_w`` is ``[out, in]``, as a Linear stores it."""

    conv_w: np.ndarray
    conv_b: np.ndarray
    fc_w: np.ndarray
    fc_b: np.ndarray
    head_w: np.ndarray  # float16: the Constant chain casts it to float
    head_b: np.ndarray
    flat_shape: np.ndarray

    @classmethod
    def draw(cls, batch: int, seed: int) -> _TwinWeights:
        """Seeded random weights for a batch of ``batch`` (the flatten's target shape)."""
        rng = np.random.default_rng(seed)
        return cls(
            conv_w=(rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32),
            conv_b=(rng.standard_normal(4) * 0.1).astype(np.float32),
            fc_w=(rng.standard_normal((16, 256)) / 16).astype(np.float32),
            fc_b=(rng.standard_normal(16) * 0.1).astype(np.float32),
            head_w=(rng.standard_normal((10, 16)) / 4).astype(np.float16),
            head_b=np.zeros(10, np.float32),
            flat_shape=np.array([batch, 256], np.int64),
        )

    def constant_chains(self) -> list[onnx.NodeProto]:
        """Every weight as the nodes that compute it from Constants, as exporters without initializers write it."""

        def const(name: str, **value: Any) -> onnx.NodeProto:
            return helper.make_node("Constant", [], [name], name=f"{name}.const", **value)

        return [
            const("conv.w", value=numpy_helper.from_array(self.conv_w, "conv.w")),
            const("conv.b", value_floats=self.conv_b.tolist()),
            const("flat_shape", value_ints=self.flat_shape.tolist()),
            const("fc.w", value=numpy_helper.from_array(self.fc_w, "fc.w")),
            helper.make_node("Transpose", ["fc.w"], ["fc.wt"], name="fc.transpose", perm=[1, 0]),
            const("fc.b", value=numpy_helper.from_array(self.fc_b, "fc.b")),
            const("head.w16", value=numpy_helper.from_array(self.head_w.reshape(-1), "head.w16")),
            helper.make_node("Cast", ["head.w16"], ["head.w32"], name="head.cast", to=TensorProto.FLOAT),
            const("head.shape", value_ints=[10, 16]),
            helper.make_node("Reshape", ["head.w32", "head.shape"], ["head.w"], name="head.reshape"),
            const("head.b", value=numpy_helper.from_array(self.head_b, "head.b")),
        ]

    def initializers(self) -> list[onnx.TensorProto]:
        """The same values as initializers named as the chains' outputs (the head's weight rounded to FP16)."""
        return [
            numpy_helper.from_array(self.conv_w, "conv.w"),
            numpy_helper.from_array(np.array(self.conv_b.tolist(), np.float32), "conv.b"),
            numpy_helper.from_array(self.flat_shape, "flat_shape"),
            numpy_helper.from_array(np.ascontiguousarray(self.fc_w.T), "fc.wt"),
            numpy_helper.from_array(self.fc_b, "fc.b"),
            numpy_helper.from_array(self.head_w.astype(np.float32), "head.w"),
            numpy_helper.from_array(self.head_b, "head.b"),
        ]


def _twin_model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], batch: int) -> onnx.ModelProto:
    """One of the twins: ``nodes`` and ``inits`` between input ``x`` [batch, 3, 8, 8] and output ``y`` [batch, 10]."""
    graph = helper.make_graph(
        nodes,
        "twin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])],
        inits,
    )
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built.ir_version = 8
    onnx.checker.check_model(built)
    return built


def _forward(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def write_tiny_project(root: Path, batch: int = 16, features: int = 32, seed: int = 0) -> dict[str, Path]:
    """Writes the tiny MLP and labelled calibration / evaluation / holdout data into ``root``.

    Labels are the FP32 model's own predictions on clean inputs, scored on noisy inputs, so the reference
    accuracy is below 1 and quantization can move it.

    Returns:
        Paths of ``model``, ``calibration``, ``evaluation`` and ``holdout``.
    """
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_mlp(batch=batch, features=features, seed=seed)
    paths = {"model": root / "tiny.onnx"}
    onnx.save(model, str(paths["model"]))
    rng = np.random.default_rng(seed + 1)
    for split, samples in (("calibration", 4 * batch), ("evaluation", 8 * batch), ("holdout", 8 * batch)):
        clean = rng.standard_normal((samples, features)).astype(np.float32)
        labels = _forward(model, clean).argmax(axis=1).astype(np.int64)
        noisy = (clean + 0.3 * rng.standard_normal(clean.shape)).astype(np.float32)
        paths[split] = root / f"{split}.npz"
        np.savez(paths[split], x=noisy, labels=labels)
    return paths


TINY_MEASURE: dict[str, Any] = {
    "warmup": 1,
    "repeats": 3,
    "rounds": 1,
    "settle_s": 0,
    # no patience: a tiny run neither waits out another process nor a slow spell
    "busy_patience_s": 0,
    "spell_patience_s": 0,
    # off: a tiny plan's measurement lasts less than the half second a share of the cores needs
    "busy_others": None,
}
"""The ``measure`` section of the tiny configs."""

TINY_CONFIRM: dict[str, Any] = {"top_k": 2, "repeats": 3, "rounds": 1, "self_check": False}
"""The ``confirm`` section of the tiny configs. No self-check: a model timed in microseconds reads FP32 against
itself far from 1 in one round; the self-check is tested on its own (tests/measure/test_selfcheck.py)."""


def tiny_config(root: Path, name: str = "tiny", **overrides: Any) -> TuneConfig:
    """A config for the tiny project in ``root`` (written if missing); ``overrides`` replace top-level sections."""
    if not (root / "tiny.onnx").exists():
        write_tiny_project(root)
    data: dict[str, Any] = {
        "name": name,
        "model": {"onnx": str(root / "tiny.onnx")},
        "inputs": [{"name": "x", "shape": [16, 32], "dtype": "float32"}],
        "data": {
            "calibration": {"npz": str(root / "calibration.npz")},
            "evaluation": {"npz": str(root / "evaluation.npz")},
            "holdout": {"npz": str(root / "holdout.npz")},
        },
        "metric": {"name": "top1"},
        "measure": dict(TINY_MEASURE),
        "confirm": dict(TINY_CONFIRM),
        "accuracy_budget": 0.02,
        "budget": {"builds": 10},
        "runs_dir": str(root / "runs"),
        "cache_dir": str(root / "cache"),
        "backend": {"timeout_s": 120},
    }
    # A tiny model builds in a fraction of a second: keep the agent's rehearsals and updates as short as its builds
    # (with PPO's default 10 epochs, gradient steps took 42 of a 10-build run's 57 s).
    # No compute pacing: the agent's tests check what it does, which would then hang on how fast this machine is.
    data["ppo"] = {"imagined_episodes": 16, "n_epochs": 2, "compute_share": 0, **overrides.pop("ppo", {})}
    if "confirm" in overrides:
        overrides["confirm"] = {"self_check": False, **overrides["confirm"]}
    if "search" not in overrides and overrides.get("backend", {}).get("name", "onnxruntime") == "onnxruntime":
        data["search"] = _cpu_independent_search()
    data.update(overrides)
    return parse_config(data, "tiny_config")


def _cpu_independent_search() -> dict[str, Any]:
    """The search section that gives a tiny run the same space on every CPU: FP32 and INT8 in the default scheme.

    ``int8-dynamic`` and a searched ``int8_scheme`` depend on what this CPU's kernels compute exactly (the probe):
    their own tests ask for them (``search=`` in ``tiny_config``, ``forms=True`` in ``tiny_space``).
    """
    from autotune.backends.onnxruntime import OnnxRuntimeCPU
    from autotune.plan import INT8_SCHEME_KNOB

    knob = next(knob for knob in OnnxRuntimeCPU().capabilities().knobs if knob.name == INT8_SCHEME_KNOB)
    searched = {} if knob.opt_in else {"knobs": {INT8_SCHEME_KNOB: [knob.default]}}  # narrowed where searched
    return {"precisions": ["int8"], **searched}


def synthetic_evaluator(
    space: Any,
    seed: int = 0,
    fail_knob: tuple[str, Any] | None = None,
    knob_latency: Mapping[tuple[str, Any], float] | None = None,
):
    """A fake evaluator with additive per-layer savings and drops, for env and strategy tests without builds.

    Args:
        space: The ``SearchSpace``.
        seed: Seed of the per-layer savings and sensitivities.
        fail_knob: ``(knob, value)`` whose plans fail to build, to exercise the failure path.
        knob_latency: ``(knob, value)`` to the factor a plan with that value multiplies its latency by (a knob
            that costs no accuracy, such as a free knob); values left out multiply by 1.

    Returns:
        ``evaluate(plan) -> TrialResult`` with an attribute ``calls`` counting evaluations.
    """
    from autotune.run.trial import TrialResult

    rng = np.random.default_rng(seed)
    savings = dict(zip(space.layer_names, rng.uniform(0.02, 0.2, len(space.layer_names)), strict=True))
    drops = dict(zip(space.layer_names, rng.exponential(0.004, len(space.layer_names)), strict=True))

    def evaluate(plan):
        evaluate.calls += 1
        if fail_knob is not None and plan.knob(fail_knob[0]) == fail_knob[1]:
            return TrialResult.failure(plan, "BuildError: synthetic failure")
        quantized = [name for name, p in plan.precisions if p != "fp32"]
        latency = 10.0 * max(0.2, 1.0 - sum(savings[n] for n in quantized) / max(1.0, len(savings) / 3))
        for (knob, value), factor in (knob_latency or {}).items():
            if plan.knob(knob) == value:
                latency *= factor
        drop = float(sum(drops[n] for n in quantized))
        return TrialResult(
            plan=plan,
            latency_ms=latency,
            reference_latency_ms=10.0,
            speedup=10.0 / latency,
            accuracy=1.0 - drop,
            reference_accuracy=1.0,
            accuracy_drop=drop,
            build_s=0.01,
        )

    evaluate.calls = 0
    return evaluate


def tiny_space(capabilities: Any = None, forms: bool = False, **search: Any) -> Any:
    """The search space of ``tiny_mlp`` at batch 16 (ORT CPU capabilities unless given).

    Args:
        capabilities: The backend's capabilities; None: ONNX Runtime's on this CPU.
        forms: Keep the INT8 forms that depend on this CPU's probe as a run gets them (``int8-dynamic``, the
            ``int8_scheme`` knob searched where several schemes are exact). Off (default): FP32 and INT8 only and
            the knob only where ``search`` names it, so a test's space is the same on every CPU.
        search: ``SearchSpaceConfig`` fields.
    """
    import dataclasses

    from autotune.backends.onnxruntime import OnnxRuntimeCPU
    from autotune.config.schema import SearchSpaceConfig
    from autotune.model.layers import InputSpec, prepare_model
    from autotune.plan import INT8_SCHEME_KNOB
    from autotune.search.space import build_space

    model = prepare_model(tiny_mlp(), Path("tiny.onnx"), [InputSpec("x", (16, 32), "float32")])
    if capabilities is None:
        capabilities = OnnxRuntimeCPU().capabilities()
        if not forms:
            knobs = tuple(
                dataclasses.replace(knob, opt_in=True) if knob.name == INT8_SCHEME_KNOB else knob
                for knob in capabilities.knobs
            )
            capabilities = dataclasses.replace(capabilities, knobs=knobs)
            search.setdefault("precisions", ["int8"])
    op_types = {node.op_type for node in model.proto.graph.node}
    return build_space(model.layers, capabilities, SearchSpaceConfig(**search), op_types)


def typed_model(runner: Any, plan: Any) -> onnx.ModelProto:
    """The explicitly typed ONNX graph a plan lowers to on a ``TrialRunner`` (what graph backends build)."""
    from autotune.quant.lowering import lower

    return lower(runner.model, plan, runner.quantizations(plan), runner.backend.recipe_for(plan))


def tiny_torch_mlp(features: int = 32, hidden: int = 64, classes: int = 16, seed: int = 0) -> Any:
    """A PyTorch MLP, ``fc1`` Linear(32, 64) -> ReLU -> ``fc2`` Linear(64, 16), with fixed weights.

    A ``model.torch`` factory for the torch backend's tests (``autotune.testing:tiny_torch_mlp``). The weights
    come from a private generator, so every call returns the same module and the global RNG is left alone.
    """
    import torch
    from torch import nn

    class TinyTorchMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(features, hidden)
            self.fc2 = nn.Linear(hidden, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    return _seeded(TinyTorchMLP, seed)


def tiny_torch_cnn(seed: int = 0) -> Any:
    """A PyTorch CNN on 3 x 16 x 16 images: two convolutions (``stem.0``, ``conv2``), pooling, a Linear ``head``."""
    import torch
    from torch import nn

    class TinyTorchCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
            self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
            self.head = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.conv2(self.stem(x))).mean(dim=(2, 3)))

    return _seeded(TinyTorchCNN, seed)


def _seeded(cls: Any, seed: int) -> Any:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls().eval()


def tiny_torch_config(root: Path, name: str = "tiny-torch", device: str = "cpu", **overrides: Any) -> TuneConfig:
    """A config for ``tiny_torch_mlp`` on the torch backend, with labelled data written into ``root`` if missing.

    Labels are the FP32 module's predictions on clean inputs, scored on noisy ones (as ``write_tiny_project``).
    """
    import torch

    root.mkdir(parents=True, exist_ok=True)
    if not (root / "evaluation.npz").exists():
        module = tiny_torch_mlp()
        rng = np.random.default_rng(1)
        for split, samples in (("calibration", 64), ("evaluation", 128), ("holdout", 128)):
            clean = rng.standard_normal((samples, 32)).astype(np.float32)
            with torch.no_grad():
                labels = module(torch.from_numpy(clean)).argmax(dim=1).numpy().astype(np.int64)
            noisy = (clean + 0.3 * rng.standard_normal(clean.shape)).astype(np.float32)
            np.savez(root / f"{split}.npz", x=noisy, labels=labels)
    data: dict[str, Any] = {
        "name": name,
        "model": {"torch": "autotune.testing:tiny_torch_mlp"},
        "inputs": [{"name": "x", "shape": [32, 32], "dtype": "float32"}],
        "data": {split: {"npz": str(root / f"{split}.npz")} for split in ("calibration", "evaluation", "holdout")},
        "metric": {"name": "top1"},
        "measure": dict(TINY_MEASURE),
        "confirm": dict(TINY_CONFIRM),
        "accuracy_budget": 0.02,
        "budget": {"builds": 6},
        "runs_dir": str(root / "runs"),
        "cache_dir": str(root / "cache"),
        "backend": {"name": "torch", "timeout_s": 600, "options": {"device": device}},
    }
    data.update(overrides)
    return parse_config(data, "tiny_torch_config")
