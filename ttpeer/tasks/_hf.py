"""``hf_causal_lm``: a ttpeer task from a Hugging Face causal LM and local text data.

See ``_hf_model`` (where the model comes from, the wrapper, the checks) and
``_hf_data`` (files, tokens, windows). This module ties them into a ``TaskSpec``
whose ``data_hash`` covers everything the task reads besides its own file: the
token stream, the model folder's files and the settings, so a peer with other
data, another tokenizer or another checkpoint declines the job as a different task.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from ttpeer.train import LoRA, TaskError, TaskSpec

from ._hf_data import BYTES, IGNORE, load_tokens, split_windows
from ._hf_model import builder, config_json, folder_hash, hf_modules, resolve_config

_VERSION_TAG = "ttpeer-hf-causal-lm-v1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def hf_causal_lm(
    model: str | os.PathLike[str] | Mapping[str, Any] | Any,
    data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    block_size: int = 128,
    tokenizer: str | os.PathLike[str] | None = None,
    text_field: str = "text",
    batch_size: int = 8,
    val_fraction: float = 0.1,
    val_windows: int = 64,
    lora: LoRA | None = None,
    extensions: Sequence[str] = (),
) -> TaskSpec:
    """A ``TaskSpec`` that trains a ``transformers`` causal LM on local text, for a task file::

        from transformers import GPT2Config
        from ttpeer.tasks import hf_causal_lm

        def task():
            return hf_causal_lm(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256),
                                data="/data/corpus/", block_size=64)

    ``model``: a local folder written by ``save_pretrained`` (its weights are the start:
    fine-tuning), or a config (a ``transformers`` config object, or a dict with
    ``model_type``) for random weights drawn from the generator the trainer seeds.
    ``data``: a file, a folder (its ``.txt``/``.md``/``.json``/``.jsonl``/``.parquet``
    files) or a list of them, one format: a text file is one document; JSON lines and
    parquet rows are documents, from the column ``text_field``. JSON lines without that
    field are chat data (``_hf_chat``): rows of ``messages`` (``[{"role", "content"}]``,
    rendered with the tokenizer's chat template, the loss counting the assistant's
    tokens only) or of ``prompt`` and ``completion`` (the loss counting the completion).
    Every peer must have the same files at the same paths. A file named explicitly with
    any other suffix is text (source code, say); ``extensions`` (e.g. ``[".py", ".rs"]``)
    adds such files of a folder. ``tokenizer``: a folder with a tokenizer, ``"bytes"``
    for the byte-level fallback (ids = UTF-8 bytes, NUL ends a document; vocab_size >=
    256), or None: the model folder's tokenizer if it has one, else bytes.

    The model sees ``(batch, block_size)`` token ids and returns logits; the loss is the
    mean cross-entropy per (counted) token (nats), the metric perplexity. The last ``val_fraction``
    of the token stream validates: ``val_windows`` windows spread over it, one evaluation
    batch (so perplexity is exact). Nothing is downloaded.

    ``lora``: train low-rank adapters (``ttpeer.train.LoRA``) over the frozen model instead
    of every parameter: the way a 7-8B model fits a 24 GB GPU. The base stays at the dtype
    its folder stores (fp32 on a peer without CUDA), or 4-bit with ``LoRA(base_bits=4)``;
    only the adapters are trained, averaged, sent and exported, and the task's hash
    covers the base's files, so every peer needs the same folder.

    Raises TaskError when transformers or datasets are missing (``pip install
    'ttpeer[hf]'``), ``model`` is not a local folder or config of a decoder-only causal LM
    (it says what was found), the data is missing, mixed, malformed or too short, a token
    id does not fit the model's vocabulary, or a setting is out of range.
    """
    _check_settings(block_size, batch_size, val_fraction, val_windows)
    config, folder = resolve_config(model)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and block_size > limit:
        raise TaskError(f"hf_causal_lm: block_size {block_size} is longer than the model's {limit} positions")
    if lora is not None and folder is None:
        raise TaskError("hf_causal_lm: lora= adapts a trained model, and a config has no weights to keep: give "
                        "the model's folder (save_pretrained); to train from scratch, leave lora out")
    tok, tok_folder = _tokenizer(tokenizer, folder)
    tok_id = BYTES if tok_folder is None else folder_hash(tok_folder)
    if isinstance(extensions, str) or not all(isinstance(e, str) and e.strip(".") for e in extensions):
        raise TaskError(f"hf_causal_lm: extensions must be a list of file suffixes such as ['.py'], got "
                        f"{extensions!r}")
    tokens = load_tokens(data, text_field, tok, tok_id, int(config.vocab_size), extensions)
    train, test = split_windows(tokens.ids, block_size, val_fraction, val_windows, tokens.mask)
    model_hash = folder_hash(folder) if folder is not None else ""
    settings = f"block_size={block_size},text_field={text_field},val_fraction={val_fraction},val_windows={val_windows}"
    # (not extensions: the files it adds change the token stream, whose hash is data_hash's)
    data_hash = hashlib.sha256("\n".join([_VERSION_TAG, tokens.sha256, model_hash, tok_id, settings,
                                          config_json(config)]).encode()).hexdigest()
    info = {
        "hf": "causal_lm", "hf_model_type": str(config.model_type), "hf_config": config_json(config),
        "hf_model_folder": str(folder or ""), "hf_model_sha256": model_hash,
        "hf_tokenizer": str(tok_folder or BYTES), "hf_tokenizer_sha256": "" if tok_folder is None else tok_id,
        "data_sha256": tokens.sha256, "data_files": str(len(tokens.files)), "documents": str(tokens.documents),
        "tokens": str(len(tokens.ids)), "block_size": str(block_size),
    }
    if tokens.mask is not None:
        info.update(rows=tokens.rows, trained_tokens=str(int(tokens.mask.sum())))
    if lora is not None:
        info["lora"] = lora.key()
    return TaskSpec(model=builder(config, folder, lora), lora=lora, train=train, test=test, loss=lm_loss,
                    metric=perplexity, metric_name="perplexity", batch_size=batch_size, info=info, data_hash=data_hash)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy per counted token, in nats: a target of ``IGNORE`` (a chat
    row's prompt) is not counted; a batch with none counted has loss 0 (and no gradient)."""
    target = target.reshape(-1).long()
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=IGNORE, reduction="sum")
    return total / (target != IGNORE).sum().clamp(min=1)


def perplexity(logits: Tensor, target: Tensor) -> float:
    """``exp`` of the batch's mean loss (exact over a one-batch validation set). A loss
    past 700 nats (a diverged model) is capped there: ``math.exp`` would overflow, and
    the metric would fail the job instead of showing it diverged."""
    return math.exp(min(lm_loss(logits, target).item(), 700.0))


def _check_settings(block_size: int, batch_size: int, val_fraction: float, val_windows: int) -> None:
    for name, value in (("block_size", block_size), ("batch_size", batch_size), ("val_windows", val_windows)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise TaskError(f"hf_causal_lm: {name} must be an int from 1 to {1 << 20}, got {value!r}")
    if not isinstance(val_fraction, int | float) or not 0 < val_fraction < 1:
        raise TaskError(f"hf_causal_lm: val_fraction must be between 0 and 1, got {val_fraction!r}")


def _tokenizer(choice: str | os.PathLike[str] | None, model_folder: Path | None) -> tuple[Any | None, Path | None]:
    """The tokenizer and its folder; (None, None) for bytes."""
    if choice is not None and os.fspath(choice) == BYTES:
        return None, None
    if choice is None:
        if model_folder is None or not any((model_folder / f).is_file() for f in _TOKENIZER_FILES):
            return None, None
        folder = model_folder
    else:
        folder = Path(choice).expanduser()
        if not folder.is_dir():
            raise TaskError(f"hf_causal_lm: tokenizer {os.fspath(choice)!r} is not a local folder (or 'bytes'); "
                            "ttpeer downloads nothing: save the tokenizer with save_pretrained first")
    tf = hf_modules()
    try:
        tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise TaskError(f"hf_causal_lm: cannot load a tokenizer from {folder}: {exc}") from None
    return tok, folder.resolve()
