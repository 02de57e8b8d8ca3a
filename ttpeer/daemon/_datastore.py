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
  used fetched datasets (and assemblies) past a byte limit, never one it is told to keep (a running job's)
  and never one added here (the user's own copy: ``ttpeer data rm`` removes that).

What breaks it: a file changed after ``data add`` copied it changes nothing (the copy is
what the pool hashes); a ``files/`` tree edited by hand is no longer what its id says (a
peer fetching from this one would refuse its pieces, by hash).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttpeer_wire import path_problem, piece_sizes, record_files, samples_hash, tar_key

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


# -- the sample index (``data add --format``) ---------------------------------------------------

FORMATS = ("lines", "npy", "tar", "parquet", "records:BYTES")
_NPY_MAGIC = b"\x93NUMPY"
_NPY_TYPE = re.compile(r"^[<>|=]?(?:[biu][1248]|f[248])$")


def parse_format(text: str) -> tuple[str, int]:
    """``lines``, ``npy``, ``tar``, ``parquet`` or ``records:BYTES`` -> (format, record
    bytes; 0 if not fixed). Raises ``DataError`` with the accepted forms, or when parquet's
    reader (pyarrow, optional) is not installed."""
    fmt, _, rest = text.partition(":")
    if fmt == "parquet" and not rest:
        if importlib.util.find_spec("pyarrow") is None:  # found without importing it: this runs on the event loop
            raise DataError(_NO_PYARROW)
        return fmt, 0
    if fmt in ("lines", "npy", "tar") and not rest:
        return fmt, 0
    if fmt == "records" and rest.isdigit() and int(rest) >= 1:
        return fmt, int(rest)
    raise DataError(f"--format {text!r}: use lines (a sample per line: text, JSON lines), npy (the rows of "
                    ".npy arrays), tar (tar shards, a sample per key), parquet (a sample per row) or "
                    "records:BYTES (fixed-size binary samples, e.g. records:2050)")


def sample_index(folder: Path, files: list[FileEntry], piece_size: int, text: str) -> dict[str, Any]:
    """The ``samples`` field of a dataset record (ttpeer_wire/_dataset.py) for the files
    under ``folder``, read as ``text`` (``parse_format``). Raises ``DataError`` naming a
    file that is not of that format."""
    fmt, record = parse_format(text)
    counts: list[int] = []
    spill: list[int] = []
    skip: list[int] = []
    first: list[int] = []
    groups: list[int] = []
    footer: list[int] = []
    dtype: str | None = None
    shape: list[int] | None = None
    for rel, size, _hashes in files:
        path = folder / rel
        if fmt == "lines":
            c, s = _line_index(path, size, piece_size)
            skip.append(0)
        elif fmt == "tar":
            c, s, f0 = _tar_index(path, rel, size, piece_size)
            skip.append(0)
            first += f0
        elif fmt == "parquet":
            c, s, g0, end = _parquet_index(path, rel, size, piece_size)
            skip.append(0)
            groups += g0
            footer.append(end)
        else:
            head, rec, row = 0, record, None
            if fmt == "npy":
                head, rec, descr, row = _npy_header(path)
                if dtype is None:
                    dtype, shape = descr, row
                elif (descr, row) != (dtype, shape):
                    raise DataError(f"{rel}: its rows are {descr} {row}, the first file's {dtype} {shape}; "
                                    "an npy dataset's files share one dtype and row shape")
            if rec > piece_size:
                raise DataError(f"{rel}: a sample of {rec} bytes does not fit a piece of {piece_size}; "
                                "use a larger --piece-size")
            if (size - head) % rec:
                raise DataError(f"{rel}: {size - head} bytes of samples is not a whole number of "
                                f"{rec}-byte records")
            c, s = _record_index(size, head, rec, piece_size)
            skip.append(head)
            record = rec
        counts += c
        spill += s
    if not sum(counts):
        raise DataError(f"the files hold no samples as {text}")
    out: dict[str, Any] = {"format": fmt, "record": record if fmt in ("records", "npy") else 0, "skip": skip,
                           "counts": counts, "spill": spill}
    if fmt == "npy":
        out |= {"dtype": dtype, "shape": shape}
    if fmt == "tar":
        out["first"] = first
    if fmt == "parquet":
        out |= {"groups": groups, "footer": footer}
    return out


_NO_PYARROW = "--format parquet needs pyarrow: pip install pyarrow"


def _parquet_index(path: Path, rel: str, size: int, piece_size: int) -> tuple[list[int], list[int], list[int], int]:
    """Per piece of a parquet file: the rows of the row groups starting in it, how far the
    last of those reaches, the number of the first; and where the file's footer begins.
    A row group lies from its first column chunk's first page to its last chunk's end."""
    try:
        import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no type hints
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise DataError(_NO_PYARROW) from None
    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{rel} is not a parquet file (--format parquet): {exc}") from None
    with open(path, "rb") as f:
        f.seek(size - 8)
        footer = size - 8 - int.from_bytes(f.read(4), "little")
    pieces = -(-size // piece_size)
    counts, spill, groups = [0] * pieces, [0] * pieces, [0] * pieces
    end = 4  # after the magic bytes
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if not group.num_rows:
            continue
        spans = []
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.data_page_offset  # a dictionary page comes first when there is one (as Arrow reads it)
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            spans.append((start, start + chunk.total_compressed_size))
        if not spans or min(spans)[0] < end or max(e for _s, e in spans) > footer:
            raise DataError(f"{rel}: its row groups do not lie one after another before its footer (row group "
                            f"{g}); --format parquet reads files as pyarrow and Spark write them")
        start, end = min(spans)[0], max(e for _s, e in spans)
        k = start // piece_size
        if not counts[k]:
            groups[k] = g
        counts[k] += group.num_rows
        spill[k] = (end - 1) // piece_size - k
    return counts, spill, groups, footer


def _tar_index(path: Path, rel: str, size: int, piece_size: int) -> tuple[list[int], list[int], list[int]]:
    """Per piece of a tar shard: the samples (members sharing a key) starting in it, how
    far the last one reaches, and where the first one starts."""
    pieces = -(-size // piece_size)
    counts, spill, first = [0] * pieces, [0] * pieces, [0] * pieces
    spans: list[list[int]] = []  # [start, end) of each sample, in order
    key = None
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                member_key = tar_key(member.name)
                end = member.offset_data + member.size
                if member_key == key:
                    spans[-1][1] = end
                else:
                    spans.append([member.offset, end])
                    key = member_key
    except tarfile.TarError as exc:
        raise DataError(f"{rel} is not a tar file (--format tar): {exc}") from None
    for start, end in spans:
        k = start // piece_size
        if not counts[k]:
            first[k] = start
        counts[k] += 1
        spill[k] = (max(end, start + 1) - 1) // piece_size - k
    return counts, spill, first


def _record_index(size: int, head: int, record: int, piece_size: int) -> tuple[list[int], list[int]]:
    """Per piece of a file: the records starting in it, and how far the last one reaches."""
    pieces = -(-size // piece_size)
    counts, spill = [0] * pieces, [0] * pieces
    n = (size - head) // record
    for k in range(pieces):
        lo, hi = k * piece_size, (k + 1) * piece_size
        first = max(0, -(-(lo - head) // record))  # the first record starting at or after lo
        last = min(n, -(-(hi - head) // record))  # records starting before hi
        counts[k] = max(0, last - first)
        if counts[k]:
            end = head + last * record - 1  # the last byte of the last record starting here
            spill[k] = end // piece_size - k
    return counts, spill


def _line_index(path: Path, size: int, piece_size: int) -> tuple[list[int], list[int]]:
    """Per piece of a text file: the lines starting in it, and how many pieces after it the
    last of them reaches into (a line ends at its newline, or at the end of the file)."""
    pieces = -(-size // piece_size)
    counts, spill = [0] * pieces, [0] * pieces
    open_piece: int | None = None  # the piece of the latest line whose newline is not read yet
    after_newline = True  # the next byte starts a line
    with open(path, "rb") as f:
        for k in range(pieces):
            got = 0
            while got < min(piece_size, size - k * piece_size):
                chunk = f.read(min(READ, piece_size - got))
                if not chunk:
                    raise DataError(f"{path.name} is shorter than when it was added")
                got += len(chunk)
                first, last = chunk.find(b"\n"), chunk.rfind(b"\n")
                counts[k] += int(after_newline) + chunk.count(b"\n", 0, len(chunk) - 1)
                if after_newline:
                    open_piece = k
                if first >= 0 and open_piece is not None:
                    spill[open_piece] = k - open_piece
                    open_piece = None
                if 0 <= last < len(chunk) - 1:
                    open_piece = k
                after_newline = chunk.endswith(b"\n")
    if open_piece is not None:  # the last line has no newline: it ends with the file
        spill[open_piece] = pieces - 1 - open_piece
    return counts, spill


def _npy_header(path: Path) -> tuple[int, int, str, list[int]]:
    """(header bytes, bytes a row, dtype, row shape) of an ``.npy`` file, read without
    numpy (the daemon does not import it). Raises ``DataError``."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 10 or not head.startswith(_NPY_MAGIC) or head[6] not in (1, 2, 3):
            raise DataError(f"{path.name} is not an .npy file (--format npy)")
        width = 2 if head[6] == 1 else 4
        length = int.from_bytes(head[8:8 + width], "little")
        start = 8 + width
        f.seek(start)
        text = f.read(length).decode("latin1")
    try:
        header = ast.literal_eval(text)
        descr, order, shape = header["descr"], header["fortran_order"], header["shape"]
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise DataError(f"{path.name}: its .npy header does not parse") from None
    if not isinstance(descr, str) or not _NPY_TYPE.match(descr) or order or not isinstance(shape, tuple) \
            or len(shape) < 1 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise DataError(f"{path.name}: --format npy reads C-ordered arrays of numbers (its header says "
                        f"{descr!r}, fortran_order={order!r}, shape={shape!r})")
    row = list(shape[1:])
    count = 1
    for d in row:
        count *= d
    if count < 1:
        raise DataError(f"{path.name}: its rows are empty (shape {shape})")
    return start + length, int(descr[-1]) * count, descr, row
