"""Single-layer probes for the layerwise calibration: one layer's candidates, run from cached FP32 activations.

Quantizing one layer changes only that layer's output, so the model output of a single-layer INT8 model is the
FP32 model up to the layer, the Q/DQ'd layer, and then the part of the model downstream of the layer's output.
The first part is the same for every candidate: one FP32 run of the whole model (with the needed intermediate
tensors as extra outputs) serves them all. A *probe* runs every candidate of one layer on those cached inputs in
one session, and the layer's *downstream* model turns each candidate's output into the model output; both are
plain ONNX Runtime sessions, so the numbers are those of the rewritten whole model
(``autotune/quant/layerwise.py`` measures with them). :func:`race` decides which candidate runs which batch: every
candidate the first, the best all of them, the others until they clearly lose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from autotune.model.layers import Layer
from autotune.plan import Plan
from autotune.quant.calibrate import session_with_outputs
from autotune.quant.recipe import QuantRecipe
from autotune.quant.rewrite import _output_tail, _quantizes_output, rewrite


@dataclass(frozen=True)
class Cut:
    """Where one layer's quantization error enters the rest of the model.

    Attributes:
        target: The tensor the quantized layer changes: its output, or the output of the activation it folds.
        nodes: The layer's node (and that activation's): what a probe runs.
        inputs: Tensors the probe reads that are not initializers (the FP32 activations it is fed).
        downstream: The nodes between ``target`` and the scored output, in graph order; empty when ``target``
            is the scored output or does not reach it.
        downstream_inputs: Tensors the downstream nodes read besides ``target`` that are not initializers.
        reaches_output: Whether ``target`` reaches the scored output at all.
    """

    target: str
    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[str, ...]
    downstream: tuple[onnx.NodeProto, ...]
    downstream_inputs: tuple[str, ...]
    reaches_output: bool

    @property
    def fetched(self) -> tuple[str, ...]:
        """Every tensor the probe and the downstream model are fed, each once."""
        return tuple(dict.fromkeys((*self.inputs, *self.downstream_inputs)))


def _reads(node: onnx.NodeProto) -> list[str]:
    """The tensors a node reads, including those its subgraphs (If, Loop, Scan) capture from the outer graph."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for graph in (*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])):
            local = {*(i.name for i in graph.input), *(i.name for i in graph.initializer)}
            for inner in graph.node:
                local.update(inner.output)
                names.extend(name for name in _reads(inner) if name not in local)
    return list(dict.fromkeys(names))


def _static_producers(graph: onnx.GraphProto, constants: set[str]) -> dict[str, int]:
    """Tensor name to the index of its producer, for tensors computed from initializers alone (no random ops)."""
    static: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        if node.op_type.startswith("Random") or node.op_type == "Multinomial":
            continue
        if all(name in constants or name in static for name in _reads(node)):
            static.update((name, i) for name in node.output if name)
    return static


def find_cut(model: onnx.ModelProto, layer: Layer, recipe: QuantRecipe, output: str) -> Cut:
    """The probe and downstream nodes of ``layer`` for the model output named ``output``. Pure.

    Args:
        model: The FP32 model (its nodes are in topological order, as ONNX requires).
        layer: The layer to quantize alone.
        recipe: The backend's recipe (decides whether the layer's output Q/DQ folds into a Relu).
        output: The name of the scored model output.

    Raises:
        ValueError: No node of the model has the layer's name.
    """
    graph = model.graph
    constants = {init.name for init in graph.initializer}
    index = next((i for i, node in enumerate(graph.node) if node.name == layer.name), None)
    if index is None:
        raise ValueError(f"layer {layer.name!r} is not a node of the model; rebuild the layer table")
    own = [index]
    target = layer.output
    if _quantizes_output(layer.op_type, recipe):
        tail, target = _output_tail(graph, layer.output, recipe)
        own.extend(tail)
    nodes = [graph.node[i] for i in own]
    # A folded Clip reads its bounds too (from Constant nodes in PyTorch's legacy export): the probe is fed them.
    inside = {name for node in nodes for name in node.output}
    inputs = list(dict.fromkeys(n for node in nodes for n in _reads(node) if n not in constants and n not in inside))
    downstream = _downstream_nodes(graph, own, target, output, constants)
    ordered = [graph.node[i] for i in sorted(downstream)]
    produced = {name for node in ordered for name in node.output}
    cut = [
        name
        for node in ordered
        for name in _reads(node)
        if name not in produced and name not in constants and name != target
    ]
    return Cut(
        target,
        tuple(nodes),
        tuple(inputs),
        tuple(ordered),
        tuple(dict.fromkeys(cut)),
        reaches_output=output == target or output in produced,
    )


def _downstream_nodes(
    graph: onnx.GraphProto, own: Sequence[int], target: str, output: str, constants: set[str]
) -> set[int]:
    """The indices of the nodes after the layer's ``own`` nodes that compute ``output`` from ``target``.

    Forward, every node that reads something the target changes; backward, only those the output needs; and the
    nodes that compute the constants they read.
    """
    changed, cone = {target}, []
    for i in range(own[0] + 1, len(graph.node)):
        if i not in own and any(name in changed for name in _reads(graph.node[i])):
            cone.append(i)
            changed.update(graph.node[i].output)
    needed, downstream = {output}, set()
    for i in reversed(cone):
        if any(name in needed for name in graph.node[i].output):
            downstream.add(i)
            needed.update(_reads(graph.node[i]))
    # Constants computed by nodes (Constant, shape arithmetic) are recomputed, not fed: they cost nothing to run,
    # while caching them per batch would double the tensors the FP32 run keeps (MiniLM: 50 more).
    static = _static_producers(graph, constants)
    pending = [name for name in needed if name in static]
    while pending:
        i = static[pending.pop()]
        if i not in downstream:
            downstream.add(i)
            pending.extend(name for name in _reads(graph.node[i]) if name in static)
    return downstream


def _value_info(name: str, arrays: Sequence[np.ndarray]) -> onnx.ValueInfoProto:
    """Type and shape of a tensor that takes the values ``arrays``: a dimension they disagree on stays unknown.

    Batches of other sizes still run; ORT checks the fed values against the known dimensions.
    """
    elem_type = helper.np_dtype_to_tensor_dtype(np.asarray(arrays[0]).dtype)
    shapes = {np.shape(array) for array in arrays}
    if len({len(shape) for shape in shapes}) != 1:
        return helper.make_tensor_value_info(name, elem_type, None)
    dims = [sizes.pop() if len(sizes) == 1 else None for sizes in map(set, zip(*shapes, strict=True))]
    return helper.make_tensor_value_info(name, elem_type, dims)


def _submodel(
    model: onnx.ModelProto,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
) -> onnx.ModelProto:
    """A model of ``nodes`` of ``model`` and the initializers they read, with the given inputs and outputs."""
    read = {name for node in nodes for name in _reads(node)}
    initializers = [init for init in model.graph.initializer if init.name in read]
    graph = helper.make_graph(list(nodes), model.graph.name, list(inputs), list(outputs), initializers)
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    sub.functions.extend(model.functions)
    return sub


def _typed_only(name: str, like: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """A value of ``like``'s element type and any shape (MatMul, Gemm, Conv and Relu output their input's type)."""
    return helper.make_tensor_value_info(name, like.type.tensor_type.elem_type, None)


def _prefixed(graph: onnx.GraphProto, prefix: str, keep: set[str]) -> tuple[list, list]:
    """The graph's nodes and initializers with every name outside ``keep`` prefixed (candidates share one graph)."""

    def name(tensor: str) -> str:
        return tensor if not tensor or tensor in keep else prefix + tensor

    nodes = []
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        copy.input[:] = [name(t) for t in node.input]
        copy.output[:] = [name(t) for t in node.output]
        nodes.append(copy)
    initializers = []
    for init in graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = name(init.name)
        initializers.append(copy)
    return nodes, initializers


def single_layer_model(
    model: onnx.ModelProto, cut: Cut, examples: Mapping[str, Sequence[np.ndarray]]
) -> onnx.ModelProto:
    """The layer's own nodes as a model: fed ``cut.inputs``, computing ``cut.target`` (what ``rewrite`` quantizes).

    Args:
        model: The FP32 model.
        cut: ``find_cut`` of the layer.
        examples: The values (one per batch) of every tensor in ``cut.inputs``: their types and shapes.
    """
    inputs = [_value_info(name, examples[name]) for name in cut.inputs]
    return _submodel(model, cut.nodes, inputs, [_typed_only(cut.target, inputs[0])])


def side_by_side(typed: Sequence[onnx.ModelProto], cut: Cut) -> onnx.ModelProto:
    """One model that runs several rewritten versions of one layer on the same inputs.

    Each of ``typed`` is ``rewrite``'s version of :func:`single_layer_model`; they share the inputs and keep their
    own nodes and initializers, so output ``i`` is exactly what version ``i`` computes for ``cut.target``.
    """
    keep = set(cut.inputs)
    nodes, initializers, outputs, opsets = [], [], [], {}
    for i, version in enumerate(typed):
        more_nodes, more_inits = _prefixed(version.graph, f"c{i}/", keep)
        nodes += more_nodes
        initializers += more_inits
        outputs.append(_typed_only(f"c{i}/{cut.target}", version.graph.input[0]))
        opsets.update({op.domain: max(op.version, opsets.get(op.domain, 0)) for op in version.opset_import})
    graph = helper.make_graph(nodes, "side_by_side", list(typed[0].graph.input), outputs, initializers)
    merged = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets.items()],
        ir_version=max(version.ir_version for version in typed),
    )
    merged.functions.extend(typed[0].functions)
    return merged


def downstream_model(
    model: onnx.ModelProto, cut: Cut, output: str, examples: Mapping[str, Sequence[np.ndarray]]
) -> onnx.ModelProto | None:
    """The part of the model from ``cut.target`` to the scored output, fed the target and ``cut.downstream_inputs``.

    Args:
        model: The FP32 model.
        cut: ``find_cut`` of the layer.
        output: The scored output.
        examples: The values (one per batch) of the target, of ``cut.downstream_inputs`` and of ``output``.

    Returns:
        The model, or None when the target is the scored output itself or does not reach it (nothing to run).
    """
    if not cut.downstream:
        return None
    inputs = [_value_info(name, examples[name]) for name in (cut.target, *cut.downstream_inputs)]
    return _submodel(model, cut.downstream, inputs, [_value_info(output, examples[output])])


def session(model: onnx.ModelProto, threads: int = 2, optimize: bool = False) -> ort.InferenceSession:
    """A CPU session that runs the nodes as written, or, with ``optimize``, as ONNX Runtime optimizes FP32 graphs.

    A probe runs its Q/DQ'd layer as written, as in the whole-model runs it stands for: fusions would round the
    quantized layer differently. The downstream part is plain FP32, where ONNX Runtime's full optimization (its
    blocked NCHWc convolution layout among them) changes the output by float rounding alone, orders of magnitude
    below an INT8 layer's noise, and runs the FP32 part faster (docs/method.md#measurements-behind-the-codes-choices).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


MARGIN = 1.25
"""A candidate whose error, extrapolated from the batches it ran, exceeds the best total by this factor stops.
Most losing candidates are several times worse than the best, and the batches agree: on MiniLM this cut the
downstream runs from 424 (with only the exact bound, a noise above the best total) to 339, with the same 36
choices."""


@dataclass(frozen=True)
class Fp32Run:
    """What one FP32 run over the calibration data left for the per-layer probes.

    Attributes:
        output: The name of the scored model output.
        reference: The scored output per batch.
        values: Per batch, every tensor a layer or the model after it reads.
        channels: Per smoothable input tensor, its per-channel ``(min, max)``.
    """

    output: str
    reference: Sequence[np.ndarray]
    values: Sequence[Mapping[str, np.ndarray]]
    channels: dict[str, tuple[list[float], list[float]]]

    @cached_property
    def powers(self) -> list[np.ndarray]:
        """Per batch, each sample's output power (:func:`sample_powers`): once per run, not once per layer."""
        return [sample_powers(out) for out in self.reference]


def sample_powers(output: np.ndarray) -> np.ndarray:
    """Each sample's FP32 output power (samples on the first axis), floored at a billionth of their mean.

    A layer's error is its samples' mean noise-to-signal, as the metrics weigh samples (the mean cosine, top-1):
    summed over the batches instead, the samples with the largest outputs decide, and the YOLO-like detector's
    photographs differ 60x in output power between batches. The floor keeps an all-zero sample from dividing by 0.
    """
    power = np.square(np.asarray(output, np.float64).reshape(len(output), -1)).sum(axis=1)
    return np.maximum(power, 1e-9 * float(power.mean()) or 1e-30)


def fp32_pass(
    model: onnx.ModelProto,
    tensors: Sequence[str],
    channel_tensors: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    output_index: int,
) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]], dict[str, tuple[list[float], list[float]]]]:
    """One FP32 run over the data: the scored output and ``tensors`` per batch, and per-channel ranges.

    Returns:
        The scored output per batch; per batch, the value of every tensor in ``tensors`` (graph inputs straight
        from the batch); per tensor of ``channel_tensors``, its per-channel (last axis) min and max.
    """
    fed = {value.name for value in model.graph.input}
    extra = [name for name in dict.fromkeys((*tensors, *channel_tensors)) if name not in fed]
    session = session_with_outputs(model, extra)
    names = [output.name for output in session.get_outputs()]
    required = [value.name for value in session.get_inputs()]
    outputs, values, lows, highs = [], [], {}, {}
    for batch in batches:
        run = dict(zip(names, session.run(None, {name: batch[name] for name in required}), strict=True))
        outputs.append(run[names[output_index]])
        run.update({name: np.asarray(batch[name]) for name in fed if name in batch})
        values.append({name: run[name] for name in tensors})
        for tensor in channel_tensors:
            flat = run[tensor].reshape(-1, run[tensor].shape[-1])
            lows[tensor] = np.minimum(lows.get(tensor, np.inf), flat.min(axis=0))
            highs[tensor] = np.maximum(highs.get(tensor, -np.inf), flat.max(axis=0))
    return outputs, values, {t: (lows[t].tolist(), highs[t].tolist()) for t in channel_tensors}


def candidate_outputs(
    model: onnx.ModelProto,
    layer: Layer,
    cut: Cut,
    recipe: QuantRecipe,
    candidates: Sequence[tuple[Mapping[str, tuple[float, float]], np.ndarray | None]],
    fp32: Fp32Run,
    forms: Sequence[tuple[str, QuantRecipe]] | None = None,
) -> tuple[list[list[np.ndarray]], ort.InferenceSession | None]:
    """Per batch, every candidate's version of the layer's target tensor, and the session downstream of it.

    The target tensor is the only value that differs from FP32, so one probe session computes it for all the
    candidates side by side; the downstream session (None where the target is the scored output) turns it into
    the model output. ``forms`` gives each candidate its own precision and recipe (another INT8 scheme,
    ``int8-dynamic``: ``autotune.quant.forms``); None: every candidate is ``int8`` with ``recipe``.
    """
    examples = {name: [batch[name] for batch in fp32.values] for name in cut.fetched}
    single = single_layer_model(model, cut, examples)
    forms = forms or [("int8", recipe)] * len(candidates)
    typed = [
        rewrite(
            single,
            [layer],
            Plan.make({layer.name: precision}),
            ranges,
            form_recipe,
            smoothing=None if factors is None else {layer.name: factors},
        )
        for (ranges, factors), (precision, form_recipe) in zip(candidates, forms, strict=True)
    ]
    probes = session(side_by_side(typed, cut))
    changed = [probes.run(None, {name: batch[name] for name in cut.inputs}) for batch in fp32.values]
    downstream = None
    if cut.downstream:
        examples[cut.target] = [outs[0] for outs in changed]
        examples[fp32.output] = list(fp32.reference)
        downstream = session(downstream_model(model, cut, fp32.output, examples), optimize=True)
    return changed, downstream


def race(count: int, noise_of: Callable[[int, int], float], weights: Sequence[float], exhaustive: bool) -> list[float]:
    """Each candidate's total noise over the batches, or its extrapolation once it clearly cannot win.

    The batches that weigh most run first (``weights``: what each batch holds of the total, e.g. its samples).
    Every candidate runs the first; the best of them then runs them all, and each other candidate stops once its
    noise exceeds the best's total (it cannot win) or its noise per weight so far exceeds the best's by
    :data:`MARGIN`; it then holds that estimate, which stays above the best.

    Args:
        count: How many candidates.
        noise_of: The noise of candidate ``i`` on batch ``b``: ``noise_of(i, b)``.
        weights: Each batch's share of the total; an estimate extrapolates by them.
        exhaustive: Run every candidate on every batch (every total exact).
    """
    order = sorted(range(len(weights)), key=lambda b: -weights[b])
    weight = [weights[b] for b in order]
    noise: list[list[float]] = [[noise_of(i, order[0])] for i in range(count)]

    def estimate(i: int) -> float:
        """The total noise of candidate ``i`` at its noise per weight so far (exact once complete)."""
        return sum(noise[i]) * sum(weight) / max(sum(weight[: len(noise[i])]), 1e-30)

    best = math.inf
    for i in sorted(range(count), key=lambda i: noise[i][0]):  # the likely winner sets the bound
        while len(noise[i]) < len(weight):
            if not exhaustive and (sum(noise[i]) > best or estimate(i) > MARGIN * best):
                break
            noise[i].append(noise_of(i, order[len(noise[i])]))
        if len(noise[i]) == len(weight):
            best = min(best, sum(noise[i]))
    return [estimate(i) for i in range(count)]
