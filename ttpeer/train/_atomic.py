"""Crash-safe file writes: a reader sees the old file or the new one, never half."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def write_atomic(path: Path, data: bytes | Sequence[bytes | memoryview]) -> None:
    """Write ``data`` (bytes, or pieces written one after the other) to ``path``
    through a temporary file in the same folder.

    The temporary file is fsynced before ``os.replace`` so a crash cannot leave
    a renamed but empty file, and the folder is fsynced after so the rename
    itself survives a power loss. Raises OSError if the folder is not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            for piece in [data] if isinstance(data, bytes) else data:
                tmp.write(piece)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # Some platforms (Windows) cannot open a folder; the rename is then as durable as it gets.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
