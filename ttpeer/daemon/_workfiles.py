"""Files that carry large values between the daemon and its workers.

Deltas, states and task files never travel in a channel frame: the writer puts
them in ``HOME/work/<job>/`` under a name the reader is told, and the reader
removes the file once it holds the bytes. Writes are atomic (a temporary name,
then a rename) so a reader never sees half a file; they are not fsynced: they are
in flight, and a crash redoes the work that made them (the durable copies live in
``states/``).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_work(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_and_remove(path: Path) -> bytes:
    data = path.read_bytes()
    path.unlink(missing_ok=True)
    return data
