"""Reading what ``data add`` is given: the files to add, copied into the home while hashed.

Theory of operation. Synchronous file work, run in a worker thread (``_data.Datasets.add``).
``scan`` lists a file, or a folder's files (hidden names skipped, sorted), refusing what
cannot be added; ``copy_and_hash`` copies each into the home while its pieces are hashed,
so the copy holds exactly the bytes that were hashed. A file is stat'ed before and after
(size, modification time, inode); if either moved, or fewer or more bytes came than the
first stat said, something wrote to it meanwhile and it is refused, by name. Errors
reading the user's files are ``DataError``s naming the file; errors writing the copy are
the home's (``OSError``).

What breaks it: nothing the user does later: a file changed after ``data add`` copied it
changes nothing (the copy is what the pool hashes).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ttpeer_wire import path_problem

from ttpeer.errors import DataError

from ._datastore import READ, FileEntry


def scan(path: Path) -> list[tuple[str, Path]]:
    """(relative path, file) of what ``data add PATH`` adds. Raises ``DataError``."""
    if not path.exists():
        raise DataError(f"{path} does not exist")
    if path.is_file():
        found = [(path.name, path)]
    elif path.is_dir():
        found = []
        for folder, dirs, files in os.walk(path, onerror=_walk_error):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                full = Path(folder) / name
                if name.startswith("."):
                    continue
                if not full.is_file():
                    raise DataError(f"{full} cannot be read: it is not a regular file (a broken link, a pipe "
                                    "or a device?); remove it or add the files one by one")
                found.append((full.relative_to(path).as_posix(), full))
        if not found:
            raise DataError(f"{path} holds no files to add (hidden files and folders are skipped)")
    else:
        raise DataError(f"{path} is neither a file nor a folder")
    for rel, full in found:
        problem = path_problem(rel)
        if problem is not None:
            raise DataError(f"{full}: a dataset's file needs {problem}; rename it")
        if not os.access(full, os.R_OK):
            raise DataError(f"{full} cannot be read (permission denied); the daemon reads it as its own user")
    return sorted(found)


def auto_piece_size(sizes: list[int], *, target: int = 256, most: int = 400) -> int:
    """The default ``--piece-size`` for files of ``sizes``: about ``target`` pieces in all
    (so a peer's shards cover many pieces, and it fetches close to its share), a power of
    two from 1 MiB to 64 MiB, then doubled while the pieces would not fit one record."""
    total = sum(sizes)
    size = 1 << 20
    while size < 64 << 20 and size * target < total:
        size *= 2
    while size < 1 << 30 and sum(-(-s // size) for s in sizes) > most:
        size *= 2
    return size


def _walk_error(exc: OSError) -> None:
    raise DataError(f"{exc.filename} cannot be read: {exc.strerror or exc}")


def _fingerprint(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def copy_and_hash(sources: Iterable[tuple[str, Path]], dest: Path, piece_size: int) -> list[FileEntry]:
    """Copy each source to ``dest / rel`` while hashing its pieces. Raises ``DataError``
    naming a file that changed while it was read or could not be read; ``OSError`` writing."""
    out: list[FileEntry] = []
    for rel, src in sources:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # reading the user's file: its errors are theirs (a DataError); writing, the home's
            before = os.stat(src)
            f = open(src, "rb")  # noqa: SIM115 - closed below, after the second stat
        except OSError as exc:
            raise DataError(f"{src} cannot be read: {exc.strerror or exc}") from None
        if not stat.S_ISREG(before.st_mode):
            f.close()
            raise DataError(f"{src} is not a regular file")
        hashes, size = [], 0
        with f, open(target, "wb") as w:
            while True:
                digest, got = hashlib.sha256(), 0
                while got < piece_size and (chunk := _read(f, min(READ, piece_size - got), src)):
                    digest.update(chunk)
                    w.write(chunk)
                    got += len(chunk)
                if not got:
                    break
                hashes.append(digest.hexdigest())
                size += got
            after = os.fstat(f.fileno())
        if _fingerprint(before) != _fingerprint(after) or size != before.st_size:
            raise DataError(f"{src} changed while it was read (its size or modification time moved); "
                            "add it again once nothing writes to it")
        out.append((rel, size, hashes))
    return out


def _read(f: Any, n: int, src: Path) -> bytes:
    try:
        return bytes(f.read(n))
    except OSError as exc:
        raise DataError(f"{src} cannot be read: {exc.strerror or exc}") from None
