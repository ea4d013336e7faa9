"""The per-layer priors' inputs: what a run knows of each layer before its first build, and where they are kept."""

from __future__ import annotations

from pathlib import Path

from autotune.harness.evaluator import Evaluator
from autotune.plan import GRANULARITY_KNOB
from autotune.run.store import TrialStore
from autotune.search.prior import PriorInputs
from autotune.search.space import SearchSpace

PRIOR_META = "prior_inputs"
"""The store meta key holding the run's prior inputs (single-layer errors, runtime shares), for the replay."""


def prior_inputs(metric: str, space: SearchSpace, evaluator: Evaluator) -> PriorInputs:
    """The run's per-layer prior inputs: the layerwise calibration's single-layer errors and FP32 runtime shares.

    ``metric`` is the run's metric name. Layers the profile did not time get their share of MACs instead (the best
    guess before any build), as do all layers where the backend cannot profile.
    """
    layers = space.layers
    shares: list[float | None] = [layer.runtime_share for layer in layers]
    if any(share is None for share in shares):
        profiled = sum(share or 0.0 for share in shares)
        rest = max(0.0, 1.0 - profiled) if profiled else 1.0
        unprofiled_macs = sum(layer.macs for layer, share in zip(layers, shares, strict=True) if share is None) or 1
        shares = [
            share if share is not None else rest * layer.macs / unprofiled_macs
            for layer, share in zip(layers, shares, strict=True)
        ]
    layerwise = evaluator.layerwise_errors() or {"methods": {}, "errors": {}}
    granularity = next((knob.default for knob in space.knobs if knob.name == GRANULARITY_KNOB), None)
    return PriorInputs(
        tuple(space.layer_names),
        tuple(shares),
        layerwise["errors"],
        layerwise["methods"],
        metric,
        None if granularity is None else str(granularity),
        layerwise.get("forms") or {},
    )


def store_prior_inputs(store: TrialStore, inputs: PriorInputs) -> None:
    """Keeps the prior inputs in the run's meta (the replay reads them)."""
    store.set_meta(PRIOR_META, inputs.to_dict())


def stored_runtime_shares(store: TrialStore) -> dict[str, float] | None:
    """The FP32 profile's share of each layer kept in a run's meta (agent runs with priors keep it), or None."""
    meta = store.get_meta(PRIOR_META)
    if meta is None:
        return None
    return PriorInputs.from_dict(meta).share_map()


def lent_runtime_shares(path: Path) -> dict[str, float]:
    """The runtime shares kept in another run's store, lent to a store that keeps none (a search's).

    Raises:
        ValueError: The store keeps none.
    """
    with TrialStore(path) as store:
        shares = stored_runtime_shares(store)
    if shares is None:
        raise ValueError(f"{path}: the store keeps no runtime shares (an agent run's store does)")
    return shares
