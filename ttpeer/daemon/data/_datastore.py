"""The dataset cache on this machine's disk (``HOME/datasets/``), and a record's pieces.

Theory of operation. Everything here is synchronous file work; the daemon runs it in
worker threads (``_data.py`` and its parts).

- **Pieces** (``Piece``, ``pieces_of``, ``piece_blobs``): piece ``k`` of a dataset is
  numbered over all its files in order; a record names each piece's hash and blob.
  ``piece_ok`` checks a file holds exactly one piece (size, then sha256).
- **The cache** (``DataStore``): ``<id>/files/...`` is a complete, verified dataset laid
  out as it was added, ``<id>/meta.json`` what this peer knows of it (its name, where it
  came from, bytes fetched, pieces refused, when a job last used it). A fetch assembles
  into ``<id>.part/`` (files made at their full size, pieces written at their offsets,
  ``done.json`` the pieces verified so far, so a restarted daemon resumes) and is renamed
  to ``<id>`` when every piece is in. ``evict`` removes the least recently used fetched
  datasets (and assemblies) past a byte limit, never one it is told to keep (a running
  job's) and never one added here (the user's own copy: ``ttpeer data rm`` removes that).

What breaks it: a ``files/`` tree edited by hand is no longer what its id says (a peer
fetching from this one would refuse its pieces, by hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer_wire import piece_sizes, record_files, samples_hash

from .._files import write_atomic

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

    def find_partial(self, name: str) -> str | None:
        """A dataset called ``name`` being fetched here (its pieces in part), if any."""
        if not self.root.is_dir():
            return None
        for d in sorted(self.root.glob("*.part")):
            try:
                meta = json.loads((d / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if name == meta.get("name") or name in meta.get("names", ()):
                return d.name.removesuffix(".part")
        return None

    def save_index(self, dataset: str, body: Any, *, part: bool) -> str:
        """Keep the sample index of the dataset record ``body`` beside its files (for the
        worker's ``dataset_samples``); returns its hash."""
        digest = samples_hash(body["samples"])
        folder = self.root / (f"{dataset}.part" if part else dataset) / "samples"
        path = folder / f"{digest}.json"
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            spec = {"piece_size": body["piece_size"], "files": [[f["path"], f["size"]] for f in body["files"]],
                    "samples": body["samples"]}
            write_atomic(path, json.dumps(spec, sort_keys=True).encode())
        return digest

    def index(self, dataset: str, digest: str | None = None) -> tuple[str, dict[str, Any]] | None:
        """(hash, spec) of a sample index kept here for ``dataset``: the one named, else the
        one its ``data add`` made (``meta["samples"]``), else the only one."""
        for folder in (self.root / dataset, self.root / f"{dataset}.part"):
            kept = sorted((folder / "samples").glob("*.json")) if (folder / "samples").is_dir() else []
            if digest is None:
                try:
                    digest = json.loads((folder / "meta.json").read_text()).get("samples")
                except (OSError, ValueError):
                    pass
            pick = [p for p in kept if p.stem == digest] if digest else kept[:1] if len(kept) == 1 else []
            if pick:
                try:
                    return pick[0].stem, json.loads(pick[0].read_text())
                except (OSError, ValueError):
                    return None
        return None

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
        try:
            return set(json.loads((part / "done.json").read_text()))
        except (OSError, ValueError):
            pass
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
        write_atomic(part / "meta.json", json.dumps(meta, sort_keys=True).encode())
        os.replace(part, self.root / dataset)  # a reader sees the assembly or the dataset, never neither
        (self.root / dataset / "done.json").unlink(missing_ok=True)

    # -- eviction --------------------------------------------------------------------------

    def evict(self, limit: int, keep: set[str]) -> list[str]:
        """Remove fetched datasets, least recently used first, until what is held is at most
        ``limit`` bytes; never one in ``keep`` nor one added here. Returns the ids removed."""
        held = {d: (int(m.get("bytes", 0)), m) for d, m in self.held().items()}
        parts = {d: (_disk_bytes(self.root / f"{d}.part"), m) for d, m in self.partial().items() if d not in held}
        total = sum(b for b, _m in (*held.values(), *parts.values()))
        gone = []
        for dataset, (size, meta) in sorted({**parts, **held}.items(), key=lambda kv: (kv[1][1].get("used", 0), kv[0])):
            if total <= limit:
                break
            if dataset in keep or meta.get("origin") == "added":
                continue
            self.remove(dataset)
            total -= size
            gone.append(dataset)
        return gone

    def partial(self) -> dict[str, dict[str, Any]]:
        """Every assembly here (a dataset fetched in part, e.g. read sample by sample): id -> metadata."""
        out: dict[str, dict[str, Any]] = {}
        if self.root.is_dir():
            for d in self.root.glob("*.part"):
                dataset = d.name.removesuffix(".part")
                try:
                    if _ID.match(dataset):
                        out[dataset] = json.loads((d / "meta.json").read_text())
                except (OSError, ValueError):
                    out[dataset] = {}  # no metadata yet: used longest ago
        return out


def _disk_bytes(folder: Path) -> int:
    """Bytes ``folder`` takes on disk (an assembly's files are sparse until their pieces land)."""
    total = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(parent, name)).st_blocks * 512
            except OSError:
                continue
    return total
