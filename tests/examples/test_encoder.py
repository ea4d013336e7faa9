"""The random-weight encoder example: its factory's shape, its token batches, its GPU config and layer table."""

import json
from pathlib import Path

import numpy as np
import pytest

from autotune.cli import main
from autotune.config.schema import dump_config, load_config, parse_config
from autotune.examples import encoder
from autotune.model.layers import resolve_callable

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "encoder-fp8-gpu.yaml"
SMALL = {"hidden": 64, "ffn": 128, "heads": 4, "vocab": 2000}
"""A narrow encoder of the same structure (8 layers), fast to build and export on the CPU."""


def small_encoder():
    """The factory of the layer-table test: the encoder's 8 layers at hidden 64."""
    return encoder.build_module(**SMALL)


def bert_parameters(layers: int, hidden: int, ffn: int, vocab: int, positions: int = 512) -> int:
    """Parameters of a pooler-less BertModel, counted from its definition (weights, biases, LayerNorms)."""
    embeddings = (vocab + positions + 2) * hidden + 2 * hidden  # word, position, token type; LayerNorm
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden  # q, k, v, output; LayerNorm
    feed_forward = (hidden * ffn + ffn) + (ffn * hidden + hidden) + 2 * hidden  # up, down; LayerNorm
    return embeddings + layers * (attention + feed_forward)


@pytest.fixture(scope="module")
def full_module():
    return encoder.build_module()  # ~130 M random weights: seconds on the CPU, so built once


def test_the_factory_builds_the_documented_shape(full_module):
    import torch

    bert = full_module.encoder
    assert bert.config.num_hidden_layers == encoder.LAYERS == 8
    assert len(bert.encoder.layer) == 8
    layer = bert.encoder.layer[0]
    assert layer.attention.self.query.weight.shape == (1024, 1024)
    assert layer.intermediate.dense.weight.shape == (4096, 1024) and layer.output.dense.weight.shape == (1024, 4096)
    assert bert.config.num_attention_heads == 16 and bert.config.vocab_size == 30522
    assert bert.config._attn_implementation == "eager"  # exportable; the backend's attention knob offers SDPA
    assert bert.pooler is None
    count = sum(p.numel() for p in full_module.parameters())
    assert count == bert_parameters(8, 1024, 4096, 30522)
    linears = [m for m in full_module.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 48


def test_the_module_returns_hidden_states_zero_at_padding(full_module):
    import torch

    ids = torch.tensor([[encoder.CLS, 2000, 3000, 4000, encoder.SEP, 0, 0, 0]])
    mask = (ids != encoder.PAD).long()
    with torch.no_grad():
        out = full_module(ids, mask)
    assert out.shape == (1, 8, 1024) and out.dtype == torch.float32
    assert torch.all(out[0, 5:] == 0) and torch.all(out[0, :5].abs().sum(dim=-1) > 0)


def test_the_weights_come_from_a_fixed_seed_and_leave_the_global_random_state_alone():
    import torch

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = encoder.build_module(**SMALL)
    assert torch.equal(torch.rand(3), expected_next)
    second = encoder.build_module(**SMALL)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_batches_are_padded_rows_of_the_declared_shape():
    batches = encoder.batches("evaluation")
    assert len(batches) == 2
    lengths = []
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.shape == mask.shape == (128, 128) and ids.dtype == mask.dtype == np.int64
        for row_ids, row_mask in zip(ids, mask, strict=True):
            length = int(row_mask.sum())
            assert np.all(row_mask[:length] == 1) and np.all(row_mask[length:] == 0)  # real tokens, then padding
            assert row_ids[0] == encoder.CLS and row_ids[length - 1] == encoder.SEP
            assert np.all(row_ids[length:] == encoder.PAD)
            words = row_ids[1 : length - 1]
            assert np.all((words >= encoder.FIRST_WORD) & (words < encoder.VOCAB))
            lengths.append(length)
    assert min(lengths) >= encoder.MIN_TOKENS and max(lengths) <= 128
    assert len(set(lengths)) > 50  # varied lengths, not one padded length


def test_batches_are_the_same_on_every_call_and_differ_across_splits():
    splits = {split: encoder.batches(split) for split in ("calibration", "evaluation", "holdout")}
    assert [len(b) for b in splits.values()] == [1, 2, 2]
    again = encoder.batches("holdout")
    for a, b in zip(splits["holdout"], again, strict=True):
        for name in ("input_ids", "attention_mask"):
            assert np.array_equal(a[name], b[name])
    rows = {split: {row.tobytes() for batch in b for row in batch["input_ids"]} for split, b in splits.items()}
    assert not rows["calibration"] & rows["evaluation"]
    assert not rows["calibration"] & rows["holdout"]
    assert not rows["evaluation"] & rows["holdout"]


def test_the_first_rows_of_a_split_do_not_depend_on_the_batch_size():
    large = encoder.batches("calibration", batch_size=128)[0]["input_ids"]
    small = np.concatenate([b["input_ids"] for b in encoder.batches("calibration", batch_size=48)])
    assert small.shape == (144, 128)  # 128 rows completed to three full batches
    assert np.array_equal(small[:128], large)


def test_batches_reject_an_unknown_split_and_shapes_that_cannot_hold_a_row():
    with pytest.raises(ValueError, match="unknown split"):
        encoder.batches("train")
    with pytest.raises(ValueError, match="seq_len"):
        encoder.batches("evaluation", seq_len=8)


def test_the_config_is_torchao_fp8_on_cuda_at_batch_128_and_agrees_with_its_data():
    config = load_config(CONFIG)
    assert config.name == "encoder-fp8-gpu"
    assert config.model.torch == "autotune.examples.encoder:build_module"
    assert config.backend.name == "torch"
    assert config.backend.options.model_dump() == {"device": "cuda", "quantized_gemm": "torchao"}
    assert config.search.op_types == ["MatMul"]
    assert config.search.knobs == {"mode": ["compile"], "cuda_graphs": [True]}
    assert config.confirm.top_k >= 1 and config.budget.builds > 0
    assert [(spec.name, tuple(spec.shape), spec.dtype) for spec in config.inputs] == [
        ("input_ids", (128, 128), "int64"),
        ("attention_mask", (128, 128), "int64"),
    ]
    # An all-FP8 plan drops 1 - 0.99719 in the sweep: the budget must be below it, or per-layer choices do nothing.
    assert 0 < config.accuracy_budget < 1 - 0.99719
    for name, split in (
        ("calibration", config.data.calibration),
        ("evaluation", config.data.evaluation),
        ("holdout", config.data.holdout),
    ):
        assert split.kwargs["split"] == name
        batches = resolve_callable(split.generator)(**split.kwargs)
        for batch in batches:
            for spec in config.inputs:
                assert batch[spec.name].shape == tuple(spec.shape) and batch[spec.name].dtype == np.dtype(spec.dtype)


def test_inspect_lists_the_48_weight_matmuls_of_the_8_layers(tmp_path, capsys):
    # The config's own model exports in minutes on the CPU at batch 128; the layer table depends on the
    # structure (8 layers x 6 Linears), not the width, so a narrow encoder stands in on the CPU backend.
    data = load_config(CONFIG).model_dump(mode="json")
    data["model"]["torch"] = f"{__name__}:small_encoder"
    data["inputs"] = [{**spec, "shape": [2, 16]} for spec in data["inputs"]]
    for split in ("calibration", "evaluation", "holdout"):
        data["data"][split]["kwargs"].update(batch_size=2, seq_len=16, vocab=SMALL["vocab"])
    data["backend"]["options"] = {"device": "cpu"}
    data["search"]["knobs"] = {}
    data.update(runs_dir=str(tmp_path / "runs"), cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "encoder.yaml"
    path.write_text(dump_config(parse_config(data, "encoder")))
    assert main(["inspect", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 48
    assert {row["unit"] for row in rows} == {"MatMul"}
    assert sum(row["params"] for row in rows) == 8 * (4 * 64 * 64 + 2 * 64 * 128)
