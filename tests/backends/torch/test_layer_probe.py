"""The torch backend's layer probe: blocks that ran before the probed layer replay their FP32 outputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import autotune.backends.torch.layer_probe as layer_probe
from autotune.backends.torch.layer_probe import TorchLayerProbe


class Block(nn.Module):
    """A residual block with one Linear; ``calls`` counts how often it really ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = torch.relu(self.fc(x))
        out += x  # in place on its own result: the replayed output must not be the recorded tensor itself
        return out


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


PATHS = ["embed", "blocks.0.fc", "blocks.2.fc", "head"]


def _noise(module, batches):
    probe = TorchLayerProbe(module, {path: path for path in PATHS}, ["x"], "cpu")
    errors = {}
    for path in PATHS:
        layer = SimpleNamespace(name=path, activation_inputs=(f"{path}_in",))
        candidates = [{f"{path}_in": (-bound, bound)} for bound in (2.0, 4.0, 8.0)]
        errors[path] = probe.noise(layer, candidates, batches, 0)
    return probe, errors


def test_blocks_before_the_layer_replay_their_outputs_and_the_errors_stay_exact(monkeypatch):
    torch.manual_seed(0)
    module = Stack().eval()
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((6, 8)).astype(np.float32)} for _ in range(2)]
    replayed, errors = _noise(module, batches)
    assert replayed.replay.usable
    assert replayed.replay.finished_before == {"embed": 0, "blocks.0.fc": 0, "blocks.2.fc": 2, "head": 4}
    # Per block, how often it ran: the reference pass and its check, then 3 candidates x 2 batches per layer,
    # except for the layers after it.
    ran = [block.calls for block in replayed.module.blocks]
    assert ran == [2 + 12, 2 + 12, 2 + 18, 2 + 18]
    monkeypatch.setattr(layer_probe, "REPLAY_BYTES", 0)  # too little memory: every forward runs whole
    whole, whole_errors = _noise(module, batches)
    assert not whole.replay.usable and [block.calls for block in whole.module.blocks] == [2 + 24] * 4
    assert errors == whole_errors  # the replay changes no error, to the last bit
    assert all(noise[0] != noise[1] for noise, _ in errors.values())  # the candidates do differ


def test_a_module_whose_blocks_run_twice_is_run_whole():
    class Twice(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(x)
            for block in [*self.blocks, *self.blocks]:
                hidden = block(hidden)
            return self.head(hidden)

    torch.manual_seed(0)
    batches = [{"x": np.ones((2, 8), np.float32)}]
    probe, _ = _noise(Twice().eval(), batches)
    assert not probe.replay.usable and probe.replay.skipped("head") == 0


def test_after_probing_every_block_runs_its_own_forward_and_the_factorys_module_is_unchanged():
    torch.manual_seed(0)
    module = Stack().eval()
    before = {name: value.clone() for name, value in module.state_dict().items()}
    probe, _ = _noise(module, [{"x": np.ones((2, 8), np.float32)}])
    assert not any("forward" in vars(block) for block in probe.module.blocks)
    assert all(torch.equal(before[name], value) for name, value in module.state_dict().items())
