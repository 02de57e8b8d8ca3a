"""``dataset_samples(name)``: a pool dataset read sample by sample, so a peer fetches only
the pieces of the shards it trains.

Theory of operation. ``ttpeer data add PATH --format F`` records, beside the pieces, a
sample index (``samples`` in the dataset record, ttpeer_wire/_dataset.py): for every piece
the number of samples that start in it, and how far the last of them reaches. That is
enough to find sample ``i`` without holding the other pieces: its piece is found from the
counts, and inside it a line is found by the piece's own newlines (``lines``), a record by
arithmetic (``records``, ``npy``), a row from its row group and its file's footer
(``parquet``, ``_parquet.py``). ``Samples`` is a map-style dataset over a range of a
dataset's samples; ``split`` cuts a test range off its end. Items are what the task's
``transform`` makes of each raw sample (``bytes`` for lines and records, a numpy row for
npy, ``{extension: bytes}`` of a tar sample's members, ``{column: value}`` of a parquet
row); the default returns the raw
sample, which suits a task that wraps it itself.

Pieces arrive in ``HOME/datasets/<id>.part/files`` while a peer fetches them (``done.json``
lists those verified) and the folder becomes ``<id>`` once all are in; a sample is read only
from pieces listed as verified. Reading one whose pieces are not here raises
``DatasetMissing`` naming them: the daemon fetches those and asks again. Before a shard
trains, the daemon asks which pieces its batches read (``pieces_for``) and fetches them,
so training itself does not wait on that.

What breaks it: an index that does not describe the files (a member's bug or malice): then
every peer reads the same wrong samples, and the job's data fingerprint (which names the
index) at least keeps peers reading two indexes apart.
"""

from __future__ import annotations

import bisect
import json
import os
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from ttpeer_wire import tar_key

from ._errors import DatasetMissing, TaskError
from ._parquet import RowGroups
from ._schedule import piece_shard_indices, shard_indices
from ._spec import LoadedTask

_READ = 1 << 16

_OFFSETS_KEPT = 16  # pieces whose line offsets are kept (each an int64 per line)
_FDS_KEPT = 64


@dataclass
class SampleIndex:
    """A dataset's sample index as its record holds it, and where its files lie here."""

    name: str
    dataset: str
    digest: str  # ttpeer_wire.samples_hash of ``samples``
    root: Path  # HOME/datasets
    piece_size: int
    files: list[tuple[str, int]]  # (relative path, size)
    samples: dict[str, Any]
    _pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (file, offset, size)
    _starts: list[int] = field(default_factory=list)  # first sample of each piece
    _file_first: list[int] = field(default_factory=list)  # first sample of each file
    _file_piece: list[int] = field(default_factory=list)  # first piece of each file

    def __post_init__(self) -> None:
        n = 0
        for f, (_path, size) in enumerate(self.files):
            self._file_piece.append(len(self._pieces))
            for offset in range(0, size, self.piece_size):
                self._pieces.append((f, offset, min(self.piece_size, size - offset)))
        counts = self.samples["counts"]
        if len(counts) != len(self._pieces) or any(
                k + spill >= len(self._pieces) or self._pieces[k + spill][0] != self._pieces[k][0]
                for k, spill in enumerate(self.samples["spill"])):
            raise TaskError(f"dataset {self.name!r}: its sample index does not match its files (a piece's "
                            "samples reach past its file)")
        piece = 0
        for f in range(len(self.files)):
            self._file_first.append(n)
            end = self._file_piece[f + 1] if f + 1 < len(self.files) else len(self._pieces)
            while piece < end:
                self._starts.append(n)
                n += counts[piece]
                piece += 1
        self.total = n

    @property
    def format(self) -> str:
        return str(self.samples["format"])

    def piece_of(self, i: int) -> int:
        """The piece sample ``i`` starts in."""
        return bisect.bisect_right(self._starts, i) - 1

    def pieces_of(self, i: int) -> Sequence[int]:
        """Every piece sample ``i`` reads."""
        k = self.piece_of(i)
        if self.format == "parquet":  # the row groups starting in its piece, and its file's footer
            f = self._pieces[k][0]
            footer = self._file_piece[f] + self.samples["footer"][f] // self.piece_size
            return sorted({*range(k, k + 1 + self.samples["spill"][k]), *range(footer, self._file_end(f))})
        if self.format == "tar":  # a piece's samples are found together, from its first header
            return range(k, k + 1 + self.samples["spill"][k])
        if self.format == "lines":  # a line ends inside its piece unless it is the piece's last
            last = i == self._starts[k] + self.samples["counts"][k] - 1
            return range(k, k + 1 + (self.samples["spill"][k] if last else 0))
        f, offset = self._record_at(i)
        first = self._file_piece[f]
        return range(first + offset // self.piece_size,
                     first + (offset + self.samples["record"] - 1) // self.piece_size + 1)

    def _file_end(self, f: int) -> int:
        """The piece after file ``f``'s last."""
        return self._file_piece[f + 1] if f + 1 < len(self.files) else len(self._pieces)

    def reach_end(self, k: int) -> int:
        """The file offset where the last piece that piece ``k``'s samples read ends."""
        end = self._pieces[k + self.samples["spill"][k]]
        return end[1] + end[2]

    def _record_at(self, i: int) -> tuple[int, int]:
        """(file, byte offset in it) of fixed-size sample ``i``."""
        f = bisect.bisect_right(self._file_first, i) - 1
        return f, self.samples["skip"][f] + (i - self._file_first[f]) * self.samples["record"]

    def piece_counts(self, lo: int, hi: int) -> list[int]:
        """Per piece, how many of the samples ``[lo, hi)`` start in it."""
        ends = self._starts[1:] + [self.total]
        return [max(0, min(e, hi) - max(s, lo)) for s, e in zip(self._starts, ends, strict=True)]


class _Reader:
    """Reads samples of one index from the files here (one per process, shared by views)."""

    def __init__(self, index: SampleIndex) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._complete = False
        self._fds: OrderedDict[tuple[bool, int], int] = OrderedDict()
        self._offsets: OrderedDict[int, Any] = OrderedDict()  # per piece: line starts, or tar samples
        self._groups: RowGroups | None = None  # parquet's, made at the first read

    def _folder(self, complete: bool) -> Path:
        d = self.index.dataset
        return self.index.root / (d if complete else f"{d}.part") / "files"

    def lacking(self, pieces: Iterable[int]) -> list[int]:
        """Of ``pieces``, those not verified here yet (looked up again when one is missing)."""
        wanted = [k for k in pieces if k not in self._held]
        if not wanted or self._complete:
            return []
        if (self.index.root / self.index.dataset / "meta.json").is_file():
            self._complete = True
            return []
        try:
            done = json.loads((self.index.root / f"{self.index.dataset}.part" / "done.json").read_text())
            self._held = set(done)
        except (OSError, ValueError):
            pass
        return [k for k in wanted if k not in self._held]

    def need(self, pieces: Iterable[int]) -> None:
        missing = self.lacking(pieces)
        if missing:
            raise DatasetMissing(self.index.name, dataset=self.index.dataset, pieces=missing)

    def _pread(self, f: int, offset: int, size: int) -> bytes:
        fd = self._fd(f)
        out = bytearray()
        while len(out) < size:
            chunk = os.pread(fd, size - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def _fd(self, f: int) -> int:
        """A descriptor of file ``f``, in the folder it is in now (kept, a few at a time)."""
        key = (self._complete, f)
        fd = self._fds.get(key)
        if fd is None:
            try:
                fd = os.open(self._folder(self._complete) / self.index.files[f][0], os.O_RDONLY)
            except FileNotFoundError:
                if self._complete:
                    raise
                # The fetch finished meanwhile: the assembly was renamed to the dataset.
                self._complete, key = True, (True, f)
                fd = os.open(self._folder(True) / self.index.files[f][0], os.O_RDONLY)
            self._fds[key] = fd
            while len(self._fds) > _FDS_KEPT:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(key)
        return fd

    def read(self, i: int) -> Any:
        index = self.index
        with self._lock:
            self.need(index.pieces_of(i))
            if index.format == "lines":
                return self._line(i)
            if index.format == "tar":
                return self._tar(i)
            if index.format == "parquet":
                return self._row(i)
            f, offset = index._record_at(i)
            raw = self._pread(f, offset, index.samples["record"])
        if index.format == "npy":
            return np.frombuffer(raw, dtype=np.dtype(index.samples["dtype"])).reshape(index.samples["shape"])
        return raw

    def _line(self, i: int) -> bytes:
        index = self.index
        k = index.piece_of(i)
        starts = self._line_starts(k)
        j = i - index._starts[k]
        f, offset, size = index._pieces[k]
        if j + 1 < len(starts):
            begin, end = int(starts[j]), int(starts[j + 1]) - 1  # the newline before the next line
            return self._pread(f, offset + begin, end - begin)
        # The piece's last line: read on to its newline, in this piece or the next ones its
        # index says it reaches (verified here), never further: every peer reads the same.
        at, out = offset + int(starts[j]), bytearray()
        end, file_size = index.reach_end(k), index.files[f][1]
        while at < end:
            chunk = self._pread(f, at, min(_READ, end - at))
            cut = chunk.find(b"\n")
            if cut >= 0:
                return bytes(out + chunk[:cut])
            out += chunk
            at += len(chunk)
        if end < file_size:
            raise TaskError(f"dataset {index.name!r}: line {i} goes on past the pieces its index says it reads")
        return bytes(out)

    def _row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of a parquet file, as ``{column: value}``."""
        index = self.index
        if self._groups is None:
            self._groups = RowGroups(index.name, index.files, index.piece_size, index.samples["footer"], self._pread)
        k = index.piece_of(i)
        f = index._pieces[k][0]
        first = index._file_piece[f]
        return self._groups.row(f, index.samples["groups"][k], i - index._starts[k],
                                {p - first for p in index.pieces_of(i)})

    def _tar(self, i: int) -> dict[str, bytes]:
        """Sample ``i`` of a tar shard: its members' bytes by extension (``{"jpg": ..., "cls": ...}``)."""
        index = self.index
        k = index.piece_of(i)
        groups = self._offsets.get(k)
        if groups is None:
            groups = self._tar_groups(k)
        else:
            self._offsets.move_to_end(k)
        f = index._pieces[k][0]
        return {ext: self._pread(f, offset, size) for ext, offset, size in groups[i - index._starts[k]]}

    def _tar_groups(self, k: int) -> Any:
        """The samples starting in piece ``k`` of a tar shard: (extension, data offset, size) of
        each member, read from the headers onwards of the piece's first sample."""
        index = self.index
        f = index._pieces[k][0]
        count = index.samples["counts"][k]
        fd = self._fd(f)
        groups: list[list[tuple[str, int, int]]] = []
        key = None
        end = index.reach_end(k)  # what is verified here of the piece's samples
        with os.fdopen(os.dup(fd), "rb") as fh:
            fh.seek(index.samples["first"][k])
            try:
                tar = tarfile.open(fileobj=fh, mode="r:")
                for member in tar:
                    if member.offset >= end:
                        break
                    if not member.isfile():
                        continue
                    name = member.name.rsplit("/", 1)[-1]
                    k_, ext = tar_key(member.name), name.split(".", 1)[1] if "." in name else ""
                    if k_ != key:
                        if len(groups) == count:
                            break
                        groups.append([])
                        key = k_
                    if member.offset_data + member.size > end:
                        raise TaskError(f"dataset {index.name!r}: a tar member of piece {k} goes on past the "
                                        "pieces its index says it reads")
                    groups[-1].append((ext, member.offset_data, member.size))
            except tarfile.TarError:
                pass  # the end of the archive, or a header cut at the verified end: counted below
        if len(groups) != count:
            raise TaskError(f"dataset {index.name!r}: piece {k} does not hold the tar samples its index counts")
        self._offsets[k] = groups  # type: ignore[assignment]
        while len(self._offsets) > _OFFSETS_KEPT:
            self._offsets.popitem(last=False)
        return groups

    def _line_starts(self, k: int) -> np.ndarray:
        """Offsets, in piece ``k``, of the lines that start in it."""
        hit = self._offsets.get(k)
        if hit is not None:
            self._offsets.move_to_end(k)
            return hit
        f, offset, size = self.index._pieces[k]
        data = np.frombuffer(self._pread(f, offset, size), dtype=np.uint8)
        inner = np.flatnonzero(data[:-1] == 10) + 1  # a newline's next byte, inside this piece
        count = self.index.samples["counts"][k]
        first = count - len(inner)  # 1 when the piece's first byte starts a line
        starts = np.concatenate([np.zeros(1, dtype=np.int64), inner]) if first == 1 else inner.astype(np.int64)
        if len(starts) != count:
            raise TaskError(f"dataset {self.index.name!r}: piece {k} does not hold the lines its index counts")
        self._offsets[k] = starts
        while len(self._offsets) > _OFFSETS_KEPT:
            self._offsets.popitem(last=False)
        return starts


class Samples(Dataset[Any]):
    """Samples ``[lo, hi)`` of a pool dataset, each passed through ``transform``."""

    def __init__(self, reader: _Reader, lo: int, hi: int, transform: Callable[[Any], Any] | None) -> None:
        self._reader, self.lo, self.hi, self.transform = reader, lo, hi, transform

    @property
    def index(self) -> SampleIndex:
        return self._reader.index

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        raw = self._reader.read(self.lo + i)
        return raw if self.transform is None else self.transform(raw)

    def split(self, test: int) -> tuple[Samples, Samples]:
        """(the samples but the last ``test``, the last ``test``): a held-out test set that
        sits in the dataset's last pieces, so every peer fetches only those for it."""
        if not 0 < test < len(self):
            raise TaskError(f"split(test={test}) needs 0 < test < {len(self)} (the samples of "
                            f"dataset {self.index.name!r})")
        cut = self.hi - test
        return Samples(self._reader, self.lo, cut, self.transform), Samples(self._reader, cut, self.hi, self.transform)

    def piece_counts(self) -> list[int]:
        """Per piece of the dataset, how many of these samples start in it."""
        return self.index.piece_counts(self.lo, self.hi)

    def pieces_for(self, indices: Iterable[int]) -> list[int]:
        """Every piece that reading these samples (numbered in this view) reads."""
        out: set[int] = set()
        for i in indices:
            out.update(self.index.pieces_of(self.lo + i))
        return sorted(out)

    def missing(self, pieces: Iterable[int]) -> list[int]:
        """Of ``pieces``, those not verified here yet."""
        return self._reader.lacking(pieces)

    def identity(self) -> str:
        """What these samples are, for the job's data fingerprint: the dataset, its index and the range."""
        return f"{self.index.dataset}:{self.index.digest}:{self.lo}:{self.hi}"


def open_samples(index: SampleIndex, transform: Callable[[Any], Any] | None) -> Samples:
    return Samples(_Reader(index), 0, index.total, transform)


def shard_batches(task: LoadedTask, seed: int, round: int, shard: int, shards: int, steps: int, batch_size: int,
                  *, first_step: int | None = None) -> list[list[int]]:
    """The batches a fused job's ``shard`` of ``round`` trains: by pieces when the task's
    training set is ``dataset_samples`` (``piece_shard_indices``), else ``shard_indices``."""
    if isinstance(task.train, Samples):
        return piece_shard_indices(task.train.piece_counts(), seed, round, shard, shards, steps, batch_size,
                                   first_step=first_step)
    return shard_indices(task.n_train, seed, round, shard, shards, steps, batch_size, first_step=first_step)
