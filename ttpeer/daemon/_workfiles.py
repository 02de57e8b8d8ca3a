"""Files that carry large values between the daemon and its workers.

Deltas, states and task files never travel in a channel frame: the writer puts
them in ``HOME/work/<job>/`` under a name the reader is told, and the reader
removes the file once it holds the bytes. Writes are atomic (a temporary name,
then a rename) so a reader never sees half a file; they are not fsynced: they are
in flight, and a crash redoes the work that made them (the durable copies live in
``states/``).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from ttpeer.errors import DiskError, JobError

DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


def write_work(path: Path, data: bytes) -> Path:
    """Raises ``DiskError`` when the disk is full or read-only (that stops the daemon, as
    any full disk does), ``JobError`` for any other failure to write."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_or_job(path, exc) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def task_copy(home: Path, source: bytes) -> Path:
    """The home's copy of a task file, ``HOME/tasks/<sha256>.py``, written once (the same
    source is the same file for every job and worker that runs it). Raises as ``write_work``."""
    folder = home / "tasks"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as exc:
        raise disk_or_job(folder, exc) from None
    path = folder / f"{hashlib.sha256(source).hexdigest()}.py"
    return path if path.exists() else write_work(path, source)


def read_and_remove(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise disk_or_job(path, exc) from None
    path.unlink(missing_ok=True)
    return data


def disk_or_job(path: Path, exc: OSError) -> DiskError | JobError:
    """A full or read-only disk stops the daemon (``DiskError``); any other failure of a
    work file fails the job (``JobError``)."""
    if exc.errno in DISK_ERRNOS:
        return DiskError(path, exc)
    return JobError(f"{path}: {exc.strerror or exc}")
