"""Small durable-file helpers: atomic replace, secret files, fsync of directories."""

from __future__ import annotations

import os
from pathlib import Path

from ttpeer.errors import DiskError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, never
    a torn one. Raises ``DiskError`` (with the path) when the disk is full or read-only."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
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
