"""The data half of ``hf_causal_lm``: local files -> documents -> token ids -> windows.

Files are read with ``datasets`` (``text``: one document per file; ``json`` lines and
``parquet``: one document per row, from ``text_field``), in sorted path order, with a
throw-away cache folder (``keep_in_memory``), so nothing lands in the user's cache and
nothing is fetched. Each document is tokenized on its own, without special tokens,
and followed by the end-of-text id: the tokenizer's ``eos_token_id``, or for the
byte-level fallback (token id = UTF-8 byte, 0-255) the NUL byte, id 0. The ids are
concatenated into one tensor; the last ``val_fraction`` of it validates, the rest
trains; samples are non-overlapping ``block_size`` windows with the target shifted by
one token, as in charlm. The hash of the token stream (and so of the files, the
tokenizer and these rules) goes into the task's hash.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ttpeer.train import TaskError

from ._hf_chat import row_kind, rows, tokenize_rows
from ._hf_model import offline, visible_files

FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
           ".parquet": "parquet"}
BYTES = "bytes"  # the byte-level fallback's name, for ``tokenizer=``
BYTE_EOT = 0
IGNORE = -100  # a target the loss does not count (cross_entropy's ignore_index)
_VERSION_TAG = b"ttpeer-hf-data-v1"


@dataclass(frozen=True)
class Tokens:
    """The packed token stream of a dataset and what it was made from."""

    ids: Tensor  # int32, one dimension
    sha256: str
    files: tuple[Path, ...]
    documents: int
    mask: Tensor | None = None  # uint8 like ids, 1 where the loss counts the id (chat data); None: all
    rows: str = "text"  # what a document is: text, or chat rows (_hf_chat: messages, prompt/completion)


def data_files(data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], extensions: Sequence[str] = ()
               ) -> tuple[str, tuple[Path, ...]]:
    """The format and the sorted files of ``data`` (a file, a folder of files (hidden ones
    skipped), or a list of both). A file named explicitly is read by its suffix, and as
    text (one document) when the suffix is not a data format (``.py``, ``.rs``, ...); a
    folder's files are those with a data format's suffix or one of ``extensions`` (text).
    Raises TaskError for a missing path, no files or a mix of formats."""
    items = [data] if isinstance(data, str | os.PathLike) else list(data)
    extra = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions}
    files: dict[Path, str] = {}
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            files |= {p.resolve(): _kind(p) for p in visible_files(path)
                      if p.suffix.lower() in FORMATS or p.suffix.lower() in extra}
        elif path.is_file():
            files[path.resolve()] = _kind(path)
        else:
            raise TaskError(f"hf_causal_lm: data path {os.fspath(item)!r} does not exist on this machine; "
                            "every peer needs the same files at the same path, or add them to the pool once "
                            "('ttpeer data add PATH --name NAME' where they are) and give data=dataset_path(NAME)")
    if not files:
        raise TaskError(f"hf_causal_lm: no data files ({', '.join(sorted(FORMATS))}) in {items}; for other text "
                        "files in a folder (source code, say), pass extensions=['.py', ...]")
    kinds = set(files.values())
    if len(kinds) > 1:
        raise TaskError(f"hf_causal_lm: data mixes formats {sorted(kinds)}; give files of one format")
    return kinds.pop(), tuple(sorted(files))


def _kind(path: Path) -> str:
    return FORMATS.get(path.suffix.lower(), "text")


def documents(kind: str, files: tuple[Path, ...], text_field: str) -> list[str]:
    """Every document of ``files``, in order."""
    offline()
    try:
        import datasets
    except ImportError:
        raise TaskError("hf_causal_lm needs the Hugging Face extra: pip install 'ttpeer[hf]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    options: dict[str, Any] = {"sample_by": "document"} if kind == "text" else {}
    with tempfile.TemporaryDirectory(prefix="ttpeer-hf-") as cache:
        try:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", cache_dir=cache,
                                       keep_in_memory=True, **options)
        except Exception as exc:  # datasets' own errors, pyarrow's, a bad JSON line...
            raise TaskError(f"hf_causal_lm: reading the {kind} files failed: {type(exc).__name__}: {exc}") from None
    field = "text" if kind == "text" else text_field
    if field not in ds.column_names:
        raise TaskError(f"hf_causal_lm: the {kind} data has no column {field!r} (found {ds.column_names}); "
                        "pass text_field=")
    docs = list(ds[field])
    bad = next((i for i, d in enumerate(docs) if not isinstance(d, str)), None)
    if bad is not None:
        raise TaskError(f"hf_causal_lm: document {bad} of the {kind} data is a {type(docs[bad]).__name__}, "
                        f"not text (column {field!r})")
    return docs


def tokenize(docs: list[str], tokenizer: Any | None, vocab_size: int) -> np.ndarray:
    """All documents' ids, each document followed by its end-of-text id, as int32."""
    if tokenizer is None:
        eot = BYTE_EOT
        if vocab_size < 256:
            raise TaskError(f"hf_causal_lm: the byte-level tokenizer needs vocab_size >= 256; the model has "
                            f"{vocab_size}")
        parts = [np.frombuffer(d.encode("utf-8") + bytes([eot]), dtype=np.uint8) for d in docs]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    eot = tokenizer.eos_token_id
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    tail = [eot] if eot is not None else []
    ids = np.fromiter((i for doc in encoded for i in (*doc, *tail)), dtype=np.int64)
    check_vocab(ids, tokenizer, vocab_size)
    return ids.astype(np.int32)


def check_vocab(ids: np.ndarray, tokenizer: Any | None, vocab_size: int) -> None:
    """Raises TaskError if an id does not fit the model's vocabulary."""
    top = int(ids.max()) if len(ids) else 0
    if top >= vocab_size:
        need = len(tokenizer) if tokenizer is not None else 256
        raise TaskError(f"hf_causal_lm: the tokenizer gives id {top}, but the model's vocab_size is "
                        f"{vocab_size}; make vocab_size at least {need}")


def load_tokens(data: Any, text_field: str, tokenizer: Any | None, tokenizer_id: str, vocab_size: int,
                extensions: Sequence[str] = ()) -> Tokens:
    """Read, tokenize and hash ``data`` (``extensions``: as ``data_files``). ``tokenizer_id``
    names the tokenizer in the cache key (its folder's hash, or ``bytes``)."""
    kind, files = data_files(data, extensions)
    stamp = tuple((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _cached_tokens(kind, stamp, text_field, tokenizer_id, vocab_size, _Opaque(tokenizer))


class _Opaque:
    """Hands the tokenizer to the cached function without being part of its key (the
    tokenizer's folder hash is)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)


@lru_cache(maxsize=4)
def _cached_tokens(kind: str, stamp: tuple[tuple[Path, int, int], ...], text_field: str, tokenizer_id: str,
                   vocab_size: int, tokenizer: _Opaque) -> Tokens:
    # Cached per process by every file's (path, size, mtime): the peers of a test share a
    # process, and one daemon loads a task several times (submit, prepare, export).
    files = tuple(f for f, _size, _mtime in stamp)
    chat = row_kind(files, text_field) if kind == "json" else None
    digest = hashlib.sha256(_VERSION_TAG + b"\0" + tokenizer_id.encode() + b"\0")
    if chat is None:
        docs = documents(kind, files, text_field)
        ids = tokenize(docs, tokenizer.value, vocab_size)
        digest.update(ids.astype("<i4", copy=False).tobytes())
        return Tokens(torch.from_numpy(ids), digest.hexdigest(), files, len(docs))
    found = rows(files, chat)
    eot = BYTE_EOT if tokenizer.value is None else tokenizer.value.eos_token_id
    ids, mask = tokenize_rows(found, chat, tokenizer.value, eot)
    check_vocab(ids, tokenizer.value, vocab_size)
    digest.update(f"rows={chat}".encode() + b"\0" + ids.astype("<i4", copy=False).tobytes() + mask.tobytes())
    return Tokens(torch.from_numpy(ids), digest.hexdigest(), files, len(found), torch.from_numpy(mask), chat)


def split_windows(ids: Tensor, block: int, val_fraction: float, val_windows: int, mask: Tensor | None = None
                  ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Train and validation ``(x, y)`` windows (views of ``ids``; with ``mask``, the
    targets the loss does not count are ``IGNORE``). Raises TaskError when the data is
    too short for one window on each side."""
    if mask is not None:
        ids = torch.stack([ids, torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE))])
        train, test = split_windows(ids, block, val_fraction, val_windows)
        return (train[0][0], train[1][1]), (test[0][0], test[1][1])
    length = ids.shape[-1]
    split = int(length * (1 - val_fraction))
    need = 2 * (block + 1)
    if length - split < block + 1 or split < block + 1:
        raise TaskError(f"hf_causal_lm: the data is {length} tokens; block_size {block} with val_fraction "
                        f"{val_fraction} needs at least {need} tokens in all and {block + 1} in each part "
                        "(add data, or lower block_size)")
    return _windows(ids[..., :split], block, None), _windows(ids[..., split:], block, val_windows)


def _windows(data: Tensor, block: int, count: int | None) -> tuple[Tensor, Tensor]:
    # ``data``: the ids, or (stacked) the ids and the targets: windows of both, cut alike.
    n = (data.shape[-1] - 1) // block
    x = data[..., : n * block].unflatten(-1, (n, block))
    y = data[..., 1: n * block + 1].unflatten(-1, (n, block))
    if count is not None and count < n:
        pick = torch.linspace(0, n - 1, count).long()
        x, y = x[..., pick, :], y[..., pick, :]
    return x, y
