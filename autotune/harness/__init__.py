"""The harness every strategy shares: prepare a run once, run trials in isolation, answer from the store first."""

from __future__ import annotations

from autotune.harness.evaluator import Evaluator
from autotune.harness.prepare import (
    SetupError,
    config_inputs,
    load_model,
    model_file,
    prepare_backend,
    search_space,
    with_runtime_shares,
)
from autotune.harness.runner import TrialRunner

__all__ = [
    "Evaluator",
    "SetupError",
    "TrialRunner",
    "config_inputs",
    "load_model",
    "model_file",
    "prepare_backend",
    "search_space",
    "with_runtime_shares",
]
