"""Datasets on this machine's disk: reading what ``data add`` is given, and the home's cache.

Theory of operation. Everything here is synchronous file work; the daemon runs it in
worker threads (``_data.py``). Two halves:

- **Reading a path to add** (``scan``, ``copy_and_hash``): a file, or a folder's files
  (hidden names skipped, sorted), each copied into the home while its pieces are hashed,
  so the copy holds exactly the bytes that were hashed. A file is stat'ed before and after
  (size, modification time, inode); if either moved, or fewer or more bytes came than the
  first stat said, something wrote to it meanwhile and it is refused, by name.
- **The cache** (``DataStore``, ``HOME/datasets/``): ``<id>/files/...`` is a complete,
  verified dataset laid out as it was added, ``<id>/meta.json`` what this peer knows of it
  (its name, where it came from, bytes fetched, pieces refused, when a job last used it).
  A fetch assembles into ``<id>.part/`` (files made at their full size, pieces written at
  their offsets, ``done.json`` the pieces verified so far, so a restarted daemon resumes)
  and is renamed to ``<id>`` when every piece is in. ``evict`` removes the least recently
  used fetched datasets past a byte limit, never one it is told to keep (a running job's)
  and never one added here (the user's own copy: ``ttpeer data rm`` removes that).

What breaks it: a file changed after ``data add`` copied it changes nothing (the copy is
what the pool hashes); a ``files/`` tree edited by hand is no longer what its id says (a
peer fetching from this one would refuse its pieces, by hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer_wire import path_problem, piece_sizes, record_files

from ttpeer.errors import DataError

from ._files import write_atomic

READ = 1 << 20
_ID = re.compile(r"^[0-9a-f]{64}$")
# (relative path, size, piece hashes): one file of a manifest (``ttpeer_wire.dataset_id``)
FileEntry = tuple[str, int, list[str]]


@dataclass(frozen=True)
class Piece:
    """Piece ``index`` of a dataset (numbered over all files in order): where it lies."""

    index: int
    path: str
    offset: int
    size: int
    hash: str


def pieces_of(body: Any) -> list[Piece]:
    """Every piece of a (checked) ``dataset`` record body, in order."""
    return pieces_of_files(body["piece_size"], record_files(body))


def piece_blobs(body: Any) -> list[str]:
    """The blob of every piece of a ``dataset`` record body, in the order of ``pieces_of``."""
    return [p[1] for f in body["files"] for p in f["pieces"]]


def pieces_of_files(piece_size: int, files: Iterable[FileEntry]) -> list[Piece]:
    """Every piece of the files ``(path, size, hashes)``, numbered in order."""
    out: list[Piece] = []
    for path, size, hashes in files:
        offset = 0
        for length, h in zip(piece_sizes(size, piece_size), hashes, strict=True):
            out.append(Piece(len(out), path, offset, length, h))
            offset += length
    return out


# -- reading what is added ---------------------------------------------------------------


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


def piece_ok(path: Path, expect: Piece) -> bool:
    """Whether the file ``path`` holds exactly piece ``expect`` (size, then sha256)."""
    if path.stat().st_size != expect.size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ):
            digest.update(chunk)
    return digest.hexdigest() == expect.hash


# -- the cache ------------------------------------------------------------------------------


class DataStore:
    """``HOME/datasets/``: complete datasets by id, assemblies in progress, their metadata."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self, dataset: str) -> Path:
        return self.root / dataset / "files"

    def held(self) -> dict[str, dict[str, Any]]:
        """Every complete dataset here: id -> its metadata."""
        out: dict[str, dict[str, Any]] = {}
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            if _ID.match(d.name) and (d / "meta.json").is_file():
                try:
                    out[d.name] = json.loads((d / "meta.json").read_text())
                except (OSError, ValueError):
                    continue  # a damaged entry is not held; a fetch makes it again
        return out

    def find(self, name: str) -> tuple[str, dict[str, Any]] | None:
        """The held dataset called ``name`` here (the one used last, if several)."""
        named = [(meta.get("used", 0), i, meta) for i, meta in self.held().items()
                 if name == meta.get("name") or name in meta.get("names", ())]
        return (max(named)[1], max(named)[2]) if named else None

    def save_meta(self, dataset: str, meta: dict[str, Any], *, part: bool = False) -> None:
        folder = self.root / (f"{dataset}.part" if part else dataset)
        write_atomic(folder / "meta.json", json.dumps(meta, sort_keys=True).encode())

    def commit_added(self, tmp: Path, dataset: str, meta: dict[str, Any]) -> bool:
        """Make the copy in ``tmp`` the dataset ``dataset``; False if it was held already
        (then ``tmp`` is removed and the held copy stays, now marked as added here)."""
        final = self.root / dataset
        if (final / "meta.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            old = self.held().get(dataset, {})
            self.save_meta(dataset, {**old, **meta, "origin": "added"})
            return False
        write_atomic(tmp / "meta.json", json.dumps(meta, sort_keys=True).encode())
        for stale in (final, self.root / f"{dataset}.part"):  # a fetch this copy makes needless
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        return True

    def sweep(self) -> None:
        """Remove what a ``data add`` cut short left (``add-*``); assemblies stay, to resume."""
        if self.root.is_dir():
            for d in self.root.glob("add-*"):
                shutil.rmtree(d, ignore_errors=True)

    def remove(self, dataset: str) -> None:
        for d in (self.root / dataset, self.root / f"{dataset}.part"):
            shutil.rmtree(d, ignore_errors=True)

    # -- assembling a fetched dataset ----------------------------------------------------

    def part_done(self, dataset: str) -> set[int]:
        try:
            return set(json.loads((self.root / f"{dataset}.part" / "done.json").read_text()))
        except (OSError, ValueError):
            return set()

    def start(self, dataset: str, files: list[FileEntry]) -> set[int]:
        """Begin (or resume) assembling ``dataset``; returns the pieces already verified."""
        part = self.root / f"{dataset}.part"
        done = self.part_done(dataset)
        if done:
            return done
        shutil.rmtree(part, ignore_errors=True)
        for rel, size, _hashes in files:
            target = part / "files" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.truncate(size)  # sparse until its pieces land
        write_atomic(part / "done.json", b"[]")
        return set()

    def put_piece(self, dataset: str, piece: Piece, plain: Path, done: set[int]) -> None:
        """Write the verified piece in ``plain`` at its place, then record it done."""
        target = self.root / f"{dataset}.part" / "files" / piece.path
        fd = os.open(target, os.O_WRONLY)
        try:
            with open(plain, "rb") as src:
                offset = piece.offset
                while chunk := src.read(READ):
                    view = memoryview(chunk)
                    while view:
                        n = os.pwrite(fd, view, offset)
                        view, offset = view[n:], offset + n
            os.fsync(fd)
        finally:
            os.close(fd)
        done.add(piece.index)
        write_atomic(self.root / f"{dataset}.part" / "done.json", json.dumps(sorted(done)).encode())

    def finish(self, dataset: str, meta: dict[str, Any]) -> None:
        """Every piece is in: the assembly becomes the held dataset."""
        part = self.root / f"{dataset}.part"
        (part / "done.json").unlink(missing_ok=True)
        write_atomic(part / "meta.json", json.dumps(meta, sort_keys=True).encode())
        os.replace(part, self.root / dataset)

    # -- eviction --------------------------------------------------------------------------

    def evict(self, limit: int, keep: set[str]) -> list[str]:
        """Remove fetched datasets, least recently used first, until what is held is at most
        ``limit`` bytes; never one in ``keep`` nor one added here. Returns the ids removed."""
        held = self.held()
        total = sum(int(m.get("bytes", 0)) for m in held.values())
        gone = []
        for dataset, meta in sorted(held.items(), key=lambda kv: (kv[1].get("used", 0), kv[0])):
            if total <= limit:
                break
            if dataset in keep or meta.get("origin") == "added":
                continue
            self.remove(dataset)
            total -= int(meta.get("bytes", 0))
            gone.append(dataset)
        return gone
