"""The rows of parquet files (``--format parquet``), read from the pieces held here.

Theory of operation. A parquet file is its row groups, each one byte range (its column
chunks), and at its end a footer (the file's metadata) that every read needs. The sample
index names, per file, where the footer begins (``footer[f]``), and per piece the first
row group starting in it (``groups[k]``). ``RowGroups`` parses a file's footer from those
bytes alone and hands pyarrow a file object over the reader's ``pread`` that serves only
the pieces a row's read may touch (its row groups' and the footer's, verified before the
read): a read anywhere else raises ``TaskError`` rather than decode the zeros of a piece
not fetched. Decoded row groups are kept, up to ``_KEPT_BYTES``, as a shard reads the
rows of a few pieces in a shuffled order.

pyarrow is optional (``pip install pyarrow``): imported when a parquet dataset is first
read, and its absence is a ``TaskError`` that says so.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ._errors import TaskError

_KEPT_BYTES = 512 << 20  # decoded row groups kept (the newest always)
_FOOTERS_KEPT = 16

Pread = Callable[[int, int], bytes]  # (offset, size) -> the bytes of one file
FilesPread = Callable[[int, int, int], bytes]  # (file, offset, size) -> its bytes


class _PieceFile(io.RawIOBase):
    """A file as pyarrow reads it: seekable, read only from the pieces in ``pieces``."""

    def __init__(self, pread: Pread, size: int, piece_size: int, pieces: set[int], where: str) -> None:
        super().__init__()
        self._pread, self._size, self._piece_size = pread, size, piece_size
        self._pieces, self._where, self._at = pieces, where, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = (0, self._at, self._size)[whence] + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._size - self._at))
        if not n:
            return 0
        touched = set(range(self._at // self._piece_size, (self._at + n - 1) // self._piece_size + 1))
        if not touched <= self._pieces:
            raise TaskError(f"{self._where}: a row group goes on past the pieces its index says it reads "
                            f"(bytes {self._at}-{self._at + n} of the file)")
        data = self._pread(self._at, n)
        memoryview(buffer)[:len(data)] = data
        self._at += len(data)
        return len(data)


class RowGroups:
    """The row groups of one dataset's parquet files, decoded on demand and kept a while."""

    def __init__(self, name: str, files: list[tuple[str, int]], piece_size: int, footer: list[int],
                 pread: FilesPread) -> None:
        try:
            import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no type hints
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError:
            raise TaskError(f"dataset {name!r} is parquet (--format parquet): reading it needs pyarrow: "
                            "pip install pyarrow") from None
        self._pa, self._pq, self._name = pa, pq, name
        self._files, self._piece_size, self._footer_at, self._pread = files, piece_size, footer, pread
        self._footers: OrderedDict[int, Any] = OrderedDict()
        self._tables: OrderedDict[tuple[int, int], Any] = OrderedDict()

    def row(self, f: int, first: int, j: int, pieces: set[int]) -> dict[str, Any]:
        """Row ``j`` counted from the first row of row group ``first`` of file ``f``, as
        ``{column: value}``, reading only ``pieces`` (the file's, numbered from its first).
        Raises ``TaskError`` when the file does not hold the rows or bytes its index says."""
        path, size = self._files[f]
        where = f"dataset {self._name!r}, file {path!r}"
        meta = self._footer(f, where)
        group = first
        while group < meta.num_row_groups and j >= meta.row_group(group).num_rows:
            j -= meta.row_group(group).num_rows
            group += 1
        if group >= meta.num_row_groups:
            raise TaskError(f"{where}: its row groups from {first} on do not hold the rows its index counts")
        table = self._tables.get((f, group))
        if table is None:
            raw = _PieceFile(lambda at, n: self._pread(f, at, n), size, self._piece_size, pieces, where)
            try:
                table = self._pq.ParquetFile(raw, metadata=meta).read_row_group(group)
            except self._pa.ArrowException as exc:
                raise TaskError(f"{where}: row group {group} does not decode: {exc}") from None
            self._tables[(f, group)] = table
            while len(self._tables) > 1 and sum(t.nbytes for t in self._tables.values()) > _KEPT_BYTES:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end((f, group))
        if not 0 <= j < table.num_rows:
            raise TaskError(f"{where}: row group {group} holds {table.num_rows} rows, not the {j + 1} its index counts")
        return dict(table.slice(j, 1).to_pylist()[0])

    def _footer(self, f: int, where: str) -> Any:
        meta = self._footers.get(f)
        if meta is not None:
            self._footers.move_to_end(f)
            return meta
        at, size = self._footer_at[f], self._files[f][1]
        tail = self._pread(f, size - 8, 8) if size >= 8 else b""
        if len(tail) != 8 or tail[4:] != b"PAR1" or size - 8 - int.from_bytes(tail[:4], "little") != at:
            # An index that puts the footer elsewhere would make this read all of the file.
            raise TaskError(f"{where}: its footer is not where its index says it begins (byte {at})")
        try:  # the footer alone parses: its length and magic bytes end it, as they end the file
            meta = self._pq.read_metadata(self._pa.BufferReader(self._pread(f, at, size - at)))
        except self._pa.ArrowException as exc:
            raise TaskError(f"{where}: its footer, where its index says it begins, does not parse: {exc}") from None
        self._footers[f] = meta
        while len(self._footers) > _FOOTERS_KEPT:
            self._footers.popitem(last=False)
        return meta
