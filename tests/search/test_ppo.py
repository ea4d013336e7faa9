"""Tests for autotune.search.ppo beyond the end-to-end runs: interrupts at awkward moments."""

from __future__ import annotations

import pytest

from autotune.search.ppo import LATEST, train
from autotune.testing import synthetic_evaluator, tiny_config, tiny_space


class _InterruptedRehearsal:
    """A model of the trials whose first imagined build is interrupted, as a Ctrl-C would."""

    def result(self, plan):
        raise KeyboardInterrupt


def test_ctrl_c_during_the_first_rehearsal_still_saves_the_agent(tmp_path):
    # With probe plans the agent rehearses before its first real update, when no callback has seen the model yet.
    space = tiny_space()
    evaluate = synthetic_evaluator(space)
    built = []

    def real(plan):
        built.append(plan)
        return evaluate(plan)

    config = tiny_config(tmp_path, budget={"builds": 24}, ppo={"episodes_per_update": 2, "imagined_episodes": 4})
    with pytest.raises(KeyboardInterrupt):
        train(
            config,
            space,
            real,
            lambda: len(built),
            tmp_path / "tb",
            tmp_path / "ckpt",
            surrogate=lambda: _InterruptedRehearsal(),
        )
    assert len(built) == 8  # the probes (an 8-run design for 4 layers), then the interrupted rehearsal
    assert (tmp_path / "ckpt" / LATEST).exists()
