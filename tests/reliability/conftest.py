"""Fixtures of the reliability tests."""

from __future__ import annotations

import pytest

from autotune.harness import Evaluator


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if a run gets as far as starting its evaluator (the trial process, the FP32 build)."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("the run started building: the bad input was not rejected up front")

    monkeypatch.setattr(Evaluator, "__init__", refuse)
