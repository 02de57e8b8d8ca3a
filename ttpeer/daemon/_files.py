"""Small durable-file helpers: atomic replace, secret files, fsync of directories."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ttpeer.errors import DiskError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | Sequence[bytes | memoryview], mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, never
    a torn one; ``data`` may be pieces to write one after the other (a state's tensors,
    ``train.state_chunks``: no joined copy of them is made). Raises ``DiskError`` (with
    the path) when the disk is full or read-only."""
    pieces = [data] if isinstance(data, bytes) else data
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DiskError(path, exc) from None


def write_secret(path: Path, data: bytes) -> None:
    """Write a key or token file readable by its owner only (0600)."""
    write_atomic(path, data, mode=0o600)
    os.chmod(path, 0o600)


def make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
