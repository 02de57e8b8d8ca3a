"""The sample index of a dataset (``data add --format``): where each piece's samples start.

Theory of operation. Synchronous file work on the copy ``data add`` made, run in a worker
thread. ``parse_format`` reads ``--format`` (``lines``, ``npy``, ``tar``, ``parquet``,
``records:BYTES``); ``sample_index`` makes the record's ``samples`` field
(``ttpeer_wire/_dataset.py``): per piece, the samples starting in it and how many pieces
after it the last of them reaches into, with what each format needs besides (npy's
header bytes, dtype and row shape; a tar shard's first sample's offset; parquet's row
group numbers and footer). Lines take one pass over the bytes; records and npy are
arithmetic (the npy header parsed without numpy); tar reads its members' headers;
parquet its footer (pyarrow, imported only for it).

What breaks it: a file not of the format named (refused, by name, as ``DataError``); a
parquet file whose row groups do not lie one after another before its footer.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tarfile
from pathlib import Path
from typing import Any

from ttpeer_wire import tar_key

from ttpeer.errors import DataError

from ._datastore import READ, FileEntry

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
