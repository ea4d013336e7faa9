"""A BERT-large-shaped text encoder with random weights: the model factory and random token batches.

The shape (8 layers, hidden 1024, FFN 4096, 16 heads, 128 tokens) is where FP8 GEMMs beat BF16 on an H200 by a
margin that survives the rest of the model (the sweep in ``bench/results/gpu-h200/sweep.md``); MiniLM's hidden size
of 384 is too narrow for that. The weights are random, drawn from a fixed seed, so a config of this model measures
latency: its accuracy (cosine of the hidden states to the FP32 model's) is a fidelity proxy, not the quality of a
trained encoder.
``configs/encoder-fp8-gpu.yaml`` points ``model.torch`` at :func:`build_module` and the data at :func:`batches`.

Importing this module is cheap: torch and transformers load only inside :func:`build_module`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from autotune.extras import require

if TYPE_CHECKING:
    import torch

LAYERS = 8
HIDDEN = 1024
FFN = 4096
HEADS = 16
VOCAB = 30522
"""BERT's WordPiece vocabulary size."""
SEQ_LEN = 128
"""Tokens per row."""
WEIGHT_SEED = 0
"""The seed of the random weights: every call of :func:`build_module` returns the same model."""

PAD, CLS, SEP = 0, 101, 102
"""BERT's special token ids; the other ids of a row are drawn from ``[FIRST_WORD, VOCAB)`` (past the reserved ids)."""
FIRST_WORD = 1000
SPLIT_SEEDS = {"calibration": 1, "evaluation": 2, "holdout": 3}
"""A seed per split, so the splits never share a row."""
SPLIT_ROWS = {"calibration": 128, "evaluation": 256, "holdout": 256}
"""Rows per split before completing the last batch: one batch of 128 to calibrate, two to search, two to confirm."""
MIN_TOKENS = 16
"""The shortest row, [CLS] and [SEP] included; lengths are uniform from here to ``seq_len``, the rest padding."""
WHAT = "the encoder example"
"""The feature named when transformers (the ``minilm`` extra) is missing."""


def build_module(
    layers: int = LAYERS, hidden: int = HIDDEN, ffn: int = FFN, heads: int = HEADS, vocab: int = VOCAB
) -> torch.nn.Module:
    """The encoder as ``forward(input_ids, attention_mask) -> hidden states`` in eval mode, random weights.

    A transformers ``BertModel`` (no pooler) initialised from :data:`WEIGHT_SEED` (the global random state is left
    as it was), with eager attention: it exports to ONNX op by op, which the layer table needs, and the torch
    backend's ``attention`` knob swaps in SDPA on its builds. The output is the last hidden state with the
    padding positions zeroed, ``[batch, tokens, hidden]``, so a cosine metric compares real tokens only.

    The defaults are the documented shape; smaller ones make a model of the same structure for tests.

    Raises:
        MissingExtra: transformers is not installed (the ``minilm`` extra provides it).
    """
    import torch

    transformers = require("transformers", "minilm", WHAT)
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max(512, SEQ_LEN),
    )
    config._attn_implementation = "eager"  # the factory's own; builds may switch to SDPA (backends/torch/attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        bert = transformers.BertModel(config, add_pooling_layer=False)

    class MaskedEncoder(torch.nn.Module):
        """BertModel, then the last hidden state with padding positions set to zero."""

        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """[batch, tokens] token ids and mask to [batch, tokens, hidden] hidden states, zero at padding."""
            hidden_states = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            return hidden_states * attention_mask.unsqueeze(-1).to(hidden_states.dtype)

    return MaskedEncoder(bert).eval()


def batches(
    split: str, batch_size: int = 128, seq_len: int = SEQ_LEN, vocab: int = VOCAB
) -> list[dict[str, np.ndarray]]:
    """Random token rows of one split in full batches of int64 ``input_ids`` and ``attention_mask``.

    Each row is [CLS], random word ids, [SEP], then [PAD] to ``seq_len``; its length is uniform in
    ``[MIN_TOKENS, seq_len]``, like sentences of different lengths padded to a fixed shape. The rows come from
    the split's own seed in order, so a split is the same on every call and its first rows do not depend on
    ``batch_size``; the last batch is completed with further rows of the same split.

    Args:
        split: ``"calibration"`` (128 rows), ``"evaluation"`` (256) or ``"holdout"`` (256).
        batch_size: Rows per batch.
        seq_len: Tokens per row.
        vocab: Vocabulary size of the model the ids are for.

    Returns:
        ``[{"input_ids": int64 [batch_size, seq_len], "attention_mask": int64 [batch_size, seq_len]}, ...]``.

    Raises:
        ValueError: Unknown split, or a batch size, length or vocabulary that cannot hold a row.
    """
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(SPLIT_SEEDS)}")
    if batch_size < 1 or seq_len < MIN_TOKENS or vocab <= FIRST_WORD:
        raise ValueError(
            f"batch_size {batch_size}, seq_len {seq_len}, vocab {vocab}: need batch_size >= 1, "
            f"seq_len >= {MIN_TOKENS} and vocab > {FIRST_WORD}"
        )
    count = math.ceil(SPLIT_ROWS[split] / batch_size)
    rows = count * batch_size
    rng = np.random.default_rng(SPLIT_SEEDS[split])
    ids = np.full((rows, seq_len), PAD, dtype=np.int64)
    mask = np.zeros((rows, seq_len), dtype=np.int64)
    for row in range(rows):  # row by row, so a row's draws do not depend on how many rows follow
        length = int(rng.integers(MIN_TOKENS, seq_len, endpoint=True))
        ids[row, 1 : length - 1] = rng.integers(FIRST_WORD, vocab, size=length - 2)
        ids[row, 0], ids[row, length - 1] = CLS, SEP
        mask[row, :length] = 1
    return [
        {"input_ids": ids[start : start + batch_size], "attention_mask": mask[start : start + batch_size]}
        for start in range(0, rows, batch_size)
    ]
