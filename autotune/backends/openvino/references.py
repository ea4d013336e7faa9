"""What a user runs instead of tuning with OpenVINO: the model as is, and NNCF's two post-training quantizers.

- ``ov-default``: the FP32 model compiled with OpenVINO's defaults (its inference precision is bf16 on a CPU with
  BF16), the LATENCY hint and the run's threads.
- ``nncf-quantize``: ``nncf.quantize`` over the run's calibration batches (``model_type=TRANSFORMER`` for a graph
  with attention, a Softmax), compiled with OpenVINO's defaults as its user would.
- ``nncf-accuracy-control``: ``nncf.quantize_with_accuracy_control`` with ``max_drop`` the run's accuracy budget,
  judged on the calibration batches against the FP32 model's outputs (cosine; top-1 agreement for a ``top1`` run),
  which reverts the layers that cost the most until the drop fits.

Every one is built from the run's prepared model and timed beside the finalists by the same protocol. NNCF is the
``nncf`` extra: without it its references are left out, and the run says so in one line.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np

from autotune.backends.base import BuildError
from autotune.backends.openvino.properties import compile_config
from autotune.metrics import cosine, top1_agreement

log = logging.getLogger(__name__)

REFERENCES = ("ov-default", "nncf-quantize", "nncf-accuracy-control")
"""OpenVINO's one-liners, as ``confirm.references`` names them."""

NNCF_REFERENCES = REFERENCES[1:]


@cache
def available_references() -> tuple[str, ...]:
    """The references this installation can build: all three with NNCF, else ``ov-default`` (said once)."""
    if importlib.util.find_spec("nncf") is None:
        log.warning(
            "the NNCF references (%s) need the 'nncf' extra: pip install 'autotune[nncf]'", ", ".join(NNCF_REFERENCES)
        )
        return REFERENCES[:1]
    return REFERENCES


def is_transformer(model: Any) -> bool:
    """A graph with attention (a Softmax): NNCF's ``model_type=TRANSFORMER`` keeps its sensitive ops in float."""
    return any(op.get_type_name() == "Softmax" for op in model.get_ordered_ops())


def reference_model(
    backend: Any, name: str, calibration: Sequence[Mapping[str, np.ndarray]]
) -> tuple[Any, dict[str, Any]]:
    """The ``ov.Model`` of the one-liner ``name`` on the backend's prepared model, and its compile properties.

    ``backend`` is the prepared ``OpenVINOCPU`` (its core, threads, model, budget and metric).

    Raises:
        BuildError: ``name`` is unknown, there is no calibration data, or NNCF failed (its message, one line).
    """
    model = backend.core.read_model(backend.model.proto.SerializeToString())
    config = compile_config(backend.intra_op_threads, {}, None)  # OpenVINO's default inference precision
    if name == "ov-default":
        return model, config
    if name not in NNCF_REFERENCES:
        raise BuildError(f"openvino has no reference {name!r}; its references: {list(available_references())}")
    if not calibration:
        raise BuildError(f"{name}: NNCF needs calibration batches, and the run has none")
    import nncf

    options: dict[str, Any] = {"subset_size": len(calibration)}
    if is_transformer(model):
        options["model_type"] = nncf.ModelType.TRANSFORMER
    batches = [dict(batch) for batch in calibration]
    nncf_logger, level = logging.getLogger("nncf"), logging.getLogger("nncf").level
    nncf_logger.setLevel(logging.WARNING)  # its progress reports are for its own user; ours did not call it
    try:
        if name == "nncf-quantize":
            return nncf.quantize(model, nncf.Dataset(batches), **options), config
        return _accuracy_controlled(backend, model, batches, options), config
    except Exception as error:  # noqa: BLE001 - NNCF raises anything; a failed one-liner is a failed reference
        message = str(error).strip().splitlines()
        raise BuildError(f"{name}: NNCF failed: {type(error).__name__}: {message[-1] if message else ''}") from error
    finally:
        nncf_logger.setLevel(level)


def _accuracy_controlled(
    backend: Any, model: Any, batches: list[dict[str, np.ndarray]], options: dict[str, Any]
) -> Any:
    """``nncf.quantize_with_accuracy_control`` at the run's budget, validated against the FP32 outputs.

    Raises:
        BuildError: The backend has no accuracy budget (it was made outside a run).
    """
    import nncf

    if backend.accuracy_budget is None:
        raise BuildError("nncf-accuracy-control needs the run's accuracy budget (max_drop)")
    fp32 = backend.compile(model, compile_config(backend.intra_op_threads, {}, "fp32"))
    # By the batch's identity: NNCF validates its ranking on subsets of the items, which it hands over as they are.
    expected = {id(batch): backend.run_engine(fp32, batch)[0] for batch in batches}
    agreement = top1_agreement if backend.metric == "top1" else cosine

    def validate(compiled: Any, items: Any) -> tuple[float, list[float]]:
        """NNCF's documented validation: the metric, and the metric of each item (its ranking then uses them)."""
        request = compiled.create_infer_request()
        outputs, reference = [], []
        for item in items:
            outputs.append(request.infer(item)[compiled.outputs[0]].copy())
            reference.append(expected[id(item)])
        each = [float(agreement([output], [fp32])) for output, fp32 in zip(outputs, reference, strict=True)]
        return float(agreement(outputs, reference)), each

    dataset = nncf.Dataset(batches)
    return nncf.quantize_with_accuracy_control(
        model,
        calibration_dataset=dataset,
        validation_dataset=dataset,
        validation_fn=validate,
        max_drop=backend.accuracy_budget,
        drop_type=nncf.DropType.ABSOLUTE,
        **options,
    )
