"""Datasets as records: a content manifest, its id, and the rules a dataset record keeps.

Theory of operation. ``ttpeer data add`` cuts every file of a dataset into pieces of
``piece_size`` bytes (the last piece of a file may be shorter; an empty file has none; a
piece never spans two files) and hashes each (sha256). The *manifest* is what the files
are: for each file in sorted order its relative path, its size and its pieces' hashes,
with the piece size. The dataset *id* is a hash of the manifest alone, so the same files
added on two machines have the same id, whoever added them and whatever the name.

A ``dataset`` record carries the manifest, a name for people and tasks, and beside each
piece hash the blob that holds it sealed on the relay (``[hash, blob]``): the blob names
are where to fetch, not what the data is, so they are left out of the id. A piece's size
follows from its file's size and ``piece_size``. The record's check recomputes the id and
the piece counts, so a record whose id does not match its manifest is refused when it is
parsed, like any other malformed record.

What breaks it: a path that could leave the dataset's folder (absolute, ``..``, empty
parts, a backslash): ``check_path`` refuses those, so no record can name one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from . import _codec

DEFAULT_PIECE_SIZE = 64 * 2**20
MIN_PIECE_SIZE = 4096  # smaller pieces are for tests; a record's size cap bounds their count
MAX_PIECE_SIZE = 1 << 30
MAX_DATASET_FILES = 4096
MAX_PATH = 512
_ID_DOMAIN = b"ttpeer/dataset/v1\n"


def path_problem(rel: str) -> str | None:
    """Why ``rel`` cannot be a dataset file's relative path, or None when it can."""
    if type(rel) is not str or not 0 < len(rel) <= MAX_PATH:
        return f"a path of 1 to {MAX_PATH} characters"
    if rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return "a relative path with '/' separators"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "a path without empty, '.' or '..' parts"
    return None


def piece_count(size: int, piece_size: int) -> int:
    """Pieces of a file of ``size`` bytes: ceil(size / piece_size), 0 for an empty file."""
    return -(-size // piece_size)


def piece_sizes(size: int, piece_size: int) -> list[int]:
    """The size of each piece of a file of ``size`` bytes."""
    n = piece_count(size, piece_size)
    return [piece_size] * (n - 1) + [size - piece_size * (n - 1)] if n else []


def manifest(piece_size: int, files: Sequence[tuple[str, int, Sequence[str]]]) -> dict[str, Any]:
    """The content manifest: ``files`` as (relative path, size, piece hashes), sorted by path."""
    return {"piece_size": piece_size,
            "files": [{"path": p, "size": s, "pieces": list(h)} for p, s, h in sorted(files, key=lambda f: f[0])]}


def dataset_id(piece_size: int, files: Sequence[tuple[str, int, Sequence[str]]]) -> str:
    """The dataset's id: sha256 of its canonical manifest (hex)."""
    return hashlib.sha256(_ID_DOMAIN + _codec.encode(manifest(piece_size, files))).hexdigest()


def record_files(body: Any) -> list[tuple[str, int, list[str]]]:
    """(path, size, piece hashes) of each file of a checked ``dataset`` record body."""
    return [(f["path"], f["size"], [p[0] for p in f["pieces"]]) for f in body["files"]]


def dataset_consistent(body: dict[str, Any]) -> str | None:
    """The record's cross-field rules: sorted unique paths, one piece per ``piece_size``
    bytes of each file, and an id that is the manifest's hash."""
    files = body["files"]
    paths = [f["path"] for f in files]
    if any(a >= b for a, b in zip(paths, paths[1:], strict=False)):
        return "files must be sorted by path, each path once"
    # A folder and a file of one name cannot both exist ("a" and "a/b").
    names = set(paths)
    if any(p[:i] in names for p in paths for i, c in enumerate(p) if c == "/"):
        return "a file's path is another file's folder"
    for f in files:
        if len(f["pieces"]) != piece_count(f["size"], body["piece_size"]):
            return f"file {f['path']!r} must have one piece per {body['piece_size']} bytes"
    if dataset_id(body["piece_size"], record_files(body)) != body["id"]:
        return "id is not the hash of the manifest"
    return None
