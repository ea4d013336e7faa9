"""A small CNN on raw-sensor digits: the ONNX model and its data splits, shipped in ``data/``.

``train_cnn.py`` makes everything here from scikit-learn's bundled digits (see its docstring for the task
and the model). ``configs/cnn-cpu.yaml`` points ``model.onnx`` at :data:`MODEL_PATH` and the data at
:func:`batches`; ``configs/cnn-gpu.yaml`` points ``model.torch`` at :func:`build_module`, the same network as a
PyTorch module with the weights of ``cnn.onnx``. Importing this module is cheap: torch and onnx load only inside
:func:`build_module`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx
    import torch

DATA_DIR = Path(__file__).parent / "data"
MODEL_PATH = DATA_DIR / "cnn.onnx"
INPUT_NAME = "image"
SPLITS = ("calibration", "evaluation", "holdout")


def split_path(split: str) -> Path:
    """The ``.npz`` file of one split.

    Raises:
        ValueError: Unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    return DATA_DIR / f"cnn_{split}.npz"


def batches(split: str, batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """The images and labels of one split in full batches.

    Args:
        split: ``"calibration"``, ``"evaluation"`` or ``"holdout"``.
        batch_size: Rows per batch; a last partial batch is dropped (the shipped splits are multiples of 32).

    Returns:
        ``[{"image": float32 [batch_size, 1, 16, 16], "labels": int64 [batch_size]}, ...]``.

    Raises:
        ValueError: Unknown split.
        FileNotFoundError: The data files are missing (re-run ``python -m autotune.examples.train_cnn``).
    """
    path = split_path(split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; re-create it with `python -m autotune.examples.train_cnn`")
    with np.load(path, allow_pickle=False) as data:
        images = data[INPUT_NAME].astype(np.float32)
        labels = data["labels"].astype(np.int64)
    return [
        {INPUT_NAME: images[start : start + batch_size], "labels": labels[start : start + batch_size]}
        for start in range(0, len(labels) - batch_size + 1, batch_size)
    ]


# The Conv and Gemm layers of cnn.onnx in graph order, as module paths of build_module()'s network: the same
# paths RawDigitNet has, so a torch.onnx export of it names its nodes like cnn.onnx (/stem/conv/Conv, /fc1/Gemm).
LAYER_PATHS = (
    "stem.conv",
    "expand",
    "block1.conv",
    "down1.conv",
    "block2.conv",
    "depthwise2.conv",
    "pointwise2.conv",
    "down2.conv",
    "pointwise3.conv",
    "fc1",
    "fc2",
)


class OnnxWeightError(ValueError):
    """The ONNX model's weights do not fit the network of :func:`build_module`; the message says where."""


def _attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    import onnx

    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _check(condition: bool, path: Path, message: str) -> None:
    if not condition:
        raise OnnxWeightError(f"{path}: {message}; it is not the network of train_cnn.RawDigitNet")


def _onnx_weights(path: Path) -> tuple[list[tuple[onnx.NodeProto, list[np.ndarray]]], dict[str, Any]]:
    """The Conv/Gemm nodes of an ONNX file with their constant inputs, and the GroupNorm's settings."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = numpy_helper.to_array(_attribute(node, "value"))
    layers = [
        (node, [constants.get(name) for name in node.input[1:] if name])
        for node in graph.node
        if node.op_type in ("Conv", "Gemm")
    ]
    computed = [node.name for node, arrays in layers if any(array is None for array in arrays)]
    _check(not computed, path, f"the weights of {computed} are not constants")

    # torch exports GroupNorm as Reshape -> InstanceNormalization (unit scale) -> Reshape -> Mul -> Add.
    producers = {name: node for node in graph.node for name in node.output}
    consumers = {name: node for node in graph.node for name in node.input}
    norms = [node for node in graph.node if node.op_type == "InstanceNormalization"]
    _check(len(norms) == 1, path, f"expected one GroupNorm (InstanceNormalization), found {len(norms)}")
    norm = norms[0]
    split = producers.get(norm.input[0])
    _check(split is not None and split.op_type == "Reshape", path, "GroupNorm's input is not a Reshape into groups")
    shape = constants.get(split.input[1])
    restore = consumers.get(norm.output[0])
    mul = consumers.get(restore.output[0]) if restore is not None else None
    add = consumers.get(mul.output[0]) if mul is not None else None
    chain = [node.op_type if node is not None else None for node in (restore, mul, add)]
    _check(chain == ["Reshape", "Mul", "Add"], path, f"GroupNorm is followed by {chain}, not Reshape, Mul, Add")
    unit = [constants.get(name) for name in norm.input[1:]]
    _check(
        len(unit) == 2 and all(array is not None for array in unit) and (unit[0] == 1).all() and (unit[1] == 0).all(),
        path,
        "the InstanceNormalization of the GroupNorm has a scale or bias of its own",
    )
    scale = next((constants[name] for name in mul.input if name in constants), None)
    shift = next((constants[name] for name in add.input if name in constants), None)
    _check(shape is not None and scale is not None and shift is not None, path, "GroupNorm constants are missing")
    group_norm = {
        "groups": int(shape[1]),
        "epsilon": float(_attribute(norm, "epsilon", 1e-5)),
        "weight": scale.reshape(-1),
        "bias": shift.reshape(-1),
    }
    return layers, group_norm


def _load_layer(module: torch.nn.Module, node: onnx.NodeProto, arrays: list[np.ndarray], where: str) -> None:
    """Copies one Conv/Gemm node's weight and bias into a Conv2d/Linear after checking it is the same layer."""
    import torch

    expected_op = "Conv" if isinstance(module, torch.nn.Conv2d) else "Gemm"
    if node.op_type != expected_op:
        raise OnnxWeightError(f"{where}: node {node.name!r} is a {node.op_type}, the module needs a {expected_op}")
    if expected_op == "Conv":
        settings = {
            "group": (_attribute(node, "group", 1), module.groups),
            "strides": (list(_attribute(node, "strides", [1, 1])), list(module.stride)),
            "pads": (list(_attribute(node, "pads", [0, 0, 0, 0])), list(module.padding) * 2),
            "dilations": (list(_attribute(node, "dilations", [1, 1])), list(module.dilation)),
        }
    else:  # Linear is y = x W^T + b: only a Gemm with transB=1 and unit alpha and beta
        settings = {
            "transA": (_attribute(node, "transA", 0), 0),
            "transB": (_attribute(node, "transB", 0), 1),
            "alpha": (_attribute(node, "alpha", 1.0), 1.0),
            "beta": (_attribute(node, "beta", 1.0), 1.0),
        }
    wrong = {key: found for key, (found, wanted) in settings.items() if found != wanted}
    if wrong:
        raise OnnxWeightError(f"{where}: node {node.name!r} has {wrong}, the module has {dict(settings)}")
    tensors = [module.weight] + ([module.bias] if module.bias is not None else [])
    found = [tuple(array.shape) for array in arrays]
    wanted = [tuple(tensor.shape) for tensor in tensors]
    if found != wanted:
        raise OnnxWeightError(f"{where}: node {node.name!r} has weight/bias shapes {found}, the module needs {wanted}")
    with torch.no_grad():
        for tensor, array in zip(tensors, arrays, strict=True):
            tensor.copy_(torch.tensor(array, dtype=torch.float32))  # a copy: ONNX arrays are read-only


def build_module(onnx_path: str | Path = MODEL_PATH) -> torch.nn.Module:
    """The shipped CNN as a PyTorch module in eval mode, with the weights of ``cnn.onnx``.

    ``train_cnn.RawDigitNet(folded=True)``: its BatchNorms folded into the Convs as the ONNX export did
    (constant folding), Conv2d with bias, then ReLU. Module paths are RawDigitNet's, so an ONNX export of this
    module names its layers as ``cnn.onnx`` does (``/stem/conv/Conv`` ... ``/fc2/Gemm``). The weights are taken
    from the Conv and Gemm nodes in graph order, and every node's type, attributes and weight shapes are checked
    first.

    Args:
        onnx_path: The ONNX file to take the weights from.

    Returns:
        ``forward(image [N, 1, 16, 16] float32 raw counts) -> logits [N, 10]``.

    Raises:
        OnnxWeightError: The ONNX file's layers do not match the network (count, type, attributes or shapes).
    """
    from autotune.examples.train_cnn import RawDigitNet

    path = Path(onnx_path)
    layers, group_norm = _onnx_weights(path)
    net = RawDigitNet(folded=True, groups=group_norm["groups"], epsilon=group_norm["epsilon"])
    if len(layers) != len(LAYER_PATHS):
        names = [node.name for node, _ in layers]
        raise OnnxWeightError(f"{path}: {len(layers)} Conv/Gemm nodes {names}, the network has {len(LAYER_PATHS)}")
    for module_path, (node, arrays) in zip(LAYER_PATHS, layers, strict=True):
        _load_layer(net.get_submodule(module_path), node, arrays, f"{path}, layer {module_path}")
    _load_group_norm(net.norm, group_norm, path)
    return net.eval()


def _load_group_norm(norm: torch.nn.GroupNorm, group_norm: dict[str, Any], path: Path) -> None:
    """Copies the ONNX GroupNorm's scale and bias into ``norm`` after checking their shapes."""
    import torch

    for name in ("weight", "bias"):
        target = getattr(norm, name)
        values = group_norm[name]
        if values.shape != tuple(target.shape):
            raise OnnxWeightError(f"{path}: GroupNorm {name} has shape {values.shape}, the module needs {target.shape}")
        with torch.no_grad():
            target.copy_(torch.tensor(values, dtype=torch.float32))
