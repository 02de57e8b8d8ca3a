"""Datasets as records: a content manifest, its id, and the rules a dataset record keeps.

Theory of operation. ``ttpeer data add`` cuts every file of a dataset into pieces of
``piece_size`` bytes (the last piece of a file may be shorter; an empty file has none; a
piece never spans two files) and hashes each (sha256). The *manifest* is what the files
are: for each file in sorted order its relative path, its size and its pieces' hashes,
with the piece size. The dataset *id* is a hash of the manifest alone, so the same files
added on two machines have the same id, whoever added them and whatever the name.

A ``dataset`` record carries the manifest, a name for people and tasks, and beside each
piece hash the blob that holds it sealed on the relay (``[hash, blob]``): the blob names
are where to fetch, not what the data is, so they are left out of the id. A piece's size
follows from its file's size and ``piece_size``. The record's check recomputes the id and
the piece counts, so a record whose id does not match its manifest is refused when it is
parsed, like any other malformed record.

Two OPTIONAL fields (absent in older records, which stay valid byte for byte):

- ``samples``: where each sample lies, for tasks that read the dataset sample by sample
  (``ttpeer.train.dataset_samples``), so a peer fetches only the pieces of the shards it
  trains. ``format`` is ``lines`` (a sample is a line, its newline left out; text, JSON
  lines), ``records`` (fixed ``record``-byte samples, e.g. token blocks in a ``.bin``) or
  ``npy`` (the rows of 2-D-or-more ``.npy`` arrays of one ``dtype`` and row ``shape``,
  ``record`` bytes a row, after each file's ``skip`` header bytes) or ``tar`` (tar shards,
  a sample being the consecutive members that share a key, as webdataset lays them out;
  ``first[k]`` is the file offset where the first sample starting in piece ``k`` does) or
  ``parquet`` (a sample is a row of a parquet file; a row group's rows all start where the
  group does, its column chunks being one byte range, and end where it ends; ``groups[k]``
  is the number in its file of the first row group with rows starting in piece ``k``, and
  ``footer[f]`` the offset where file ``f``'s footer (its metadata, which every read
  needs) begins, so a reader holds that file's last pieces too). ``counts[k]`` is the
  number of samples that *start* in piece ``k`` and ``spill[k]`` how many pieces after
  ``k`` the last of them reaches into (0 when it ends inside ``k``). Samples are numbered
  over the files in order. These are derived from the bytes and the format: a record whose
  index is wrong trains wrong samples on every peer alike (the job's data fingerprint
  names the index, so peers reading two indexes decline rather than diverge).
- ``urls``: https base addresses that serve the files too (``URL/<path>``, byte ranges):
  peers fetch pieces there, checked by the same hashes, before asking the relay.

What breaks it: a path that could leave the dataset's folder (absolute, ``..``, empty
parts, a backslash): ``check_path`` refuses those, so no record can name one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from . import _codec

DEFAULT_PIECE_SIZE = 64 * 2**20
MIN_PIECE_SIZE = 4096  # smaller pieces are for tests; a record's size cap bounds their count
MAX_PIECE_SIZE = 1 << 30
MAX_DATASET_FILES = 4096
MAX_PATH = 512
SAMPLE_FORMATS = ("lines", "records", "npy", "tar", "parquet")
MAX_URLS = 4
MAX_URL = 512
_ID_DOMAIN = b"ttpeer/dataset/v1\n"


def path_problem(rel: str) -> str | None:
    """Why ``rel`` cannot be a dataset file's relative path, or None when it can."""
    if type(rel) is not str or not 0 < len(rel) <= MAX_PATH:
        return f"a path of 1 to {MAX_PATH} characters"
    if rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return "a relative path with '/' separators"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "a path without empty, '.' or '..' parts"
    return None


def piece_count(size: int, piece_size: int) -> int:
    """Pieces of a file of ``size`` bytes: ceil(size / piece_size), 0 for an empty file."""
    return -(-size // piece_size)


def piece_sizes(size: int, piece_size: int) -> list[int]:
    """The size of each piece of a file of ``size`` bytes."""
    n = piece_count(size, piece_size)
    return [piece_size] * (n - 1) + [size - piece_size * (n - 1)] if n else []


def manifest(piece_size: int, files: Sequence[tuple[str, int, Sequence[str]]]) -> dict[str, Any]:
    """The content manifest: ``files`` as (relative path, size, piece hashes), sorted by path."""
    return {"piece_size": piece_size,
            "files": [{"path": p, "size": s, "pieces": list(h)} for p, s, h in sorted(files, key=lambda f: f[0])]}


def dataset_id(piece_size: int, files: Sequence[tuple[str, int, Sequence[str]]]) -> str:
    """The dataset's id: sha256 of its canonical manifest (hex)."""
    return hashlib.sha256(_ID_DOMAIN + _codec.encode(manifest(piece_size, files))).hexdigest()


def record_files(body: Any) -> list[tuple[str, int, list[str]]]:
    """(path, size, piece hashes) of each file of a checked ``dataset`` record body."""
    return [(f["path"], f["size"], [p[0] for p in f["pieces"]]) for f in body["files"]]


def _count_list(v: Any, hi: int) -> bool:
    return type(v) is list and all(type(x) is int and 0 <= x <= hi for x in v)


def samples_problem(samples: Any, files: list[dict[str, Any]], piece_size: int) -> str | None:
    """Why ``samples`` is not a well-formed sample index of ``files``, or None."""
    keys = {"format", "record", "skip", "counts", "spill"}
    extra = {"npy": {"dtype", "shape"}, "tar": {"first"}, "parquet": {"groups", "footer"}}
    if type(samples) is not dict or not keys <= set(samples) <= keys.union(*extra.values()):
        return (f"samples must have the fields {sorted(keys)} (and dtype, shape for npy; first for tar; "
                "groups, footer for parquet)")
    fmt, record = samples["format"], samples["record"]
    if fmt not in SAMPLE_FORMATS:
        return f"samples.format must be one of {', '.join(SAMPLE_FORMATS)}"
    unfixed = ("lines", "tar", "parquet")  # samples of no fixed size
    if type(record) is not int or not (record == 0 if fmt in unfixed else 1 <= record <= piece_size):
        return "samples.record is 0 for lines, tar and parquet, else the bytes of one sample (at most a piece)"
    if set(samples) - keys != extra.get(fmt, set()):
        return ("samples.dtype and samples.shape come with the npy format only, samples.first with tar only, "
                "samples.groups and samples.footer with parquet only")
    if fmt == "npy" and not (type(samples["dtype"]) is str and 0 < len(samples["dtype"]) <= 32
                             and _count_list(samples["shape"], 2**40) and len(samples["shape"]) <= 8):
        return "samples.dtype is a numpy type string and samples.shape the row's shape"
    pieces = sum(piece_count(f["size"], piece_size) for f in files)
    if not _count_list(samples["skip"], 2**20) or len(samples["skip"]) != len(files):
        return "samples.skip needs one header length per file"
    # Every other sample takes a byte at least; parquet rows compress below one (a column
    # of one repeated value), so a piece may start more of them than it has bytes.
    most = _MOST_ROWS if fmt == "parquet" else piece_size
    if not (_count_list(samples["counts"], most) and _count_list(samples["spill"], 2**20)
            and len(samples["counts"]) == len(samples["spill"]) == pieces):
        return "samples.counts and samples.spill need one number per piece"
    if fmt == "tar" and not (_count_list(samples["first"], 2**50) and len(samples["first"]) == pieces):
        return "samples.first needs one offset per piece"
    # A piece's samples reach at most to its file's last piece.
    k = 0
    for f, skip in zip(files, samples["skip"], strict=True):
        n = piece_count(f["size"], piece_size)
        if skip > f["size"] or any(j + samples["spill"][k + j] >= n for j in range(n)):
            return f"samples.skip or samples.spill reach past file {f['path']!r}"
        if fmt not in unfixed and (f["size"] - skip) % record:
            return f"file {f['path']!r} is not a whole number of samples.record bytes"
        k += n
    if fmt == "parquet" and (problem := _parquet_problem(samples, files, piece_size)):
        return problem
    if sum(samples["counts"]) < 1:
        return "samples.counts must count at least one sample"
    return None


_MOST_ROWS = 2**32  # rows starting in one piece of a parquet file


def _parquet_problem(samples: dict[str, Any], files: list[dict[str, Any]], piece_size: int) -> str | None:
    """Parquet's fields: each file's footer between its magic bytes, and its row groups
    in order, one after another, all before the footer."""
    groups, footer = samples["groups"], samples["footer"]
    if not (_count_list(groups, _MOST_ROWS) and len(groups) == len(samples["counts"])):
        return "samples.groups needs one row group number per piece"
    if not (_count_list(footer, 2**50) and len(footer) == len(files)):
        return "samples.footer needs one offset per file"
    if any(samples["skip"]):
        return "samples.skip is 0 for each parquet file"
    k = 0
    for f, begins in zip(files, footer, strict=True):
        if not 4 <= begins <= f["size"] - 8:  # b"PAR1" ... footer, its length (4 bytes), b"PAR1"
            return f"samples.footer of file {f['path']!r} must lie inside it, after its 4 magic bytes"
        before = (begins - 1) // piece_size  # the last piece a row group may reach into
        free, group = 0, -1  # the first piece not inside the last row group seen; its number
        for j in range(piece_count(f["size"], piece_size)):
            count, spill, first = samples["counts"][k], samples["spill"][k], groups[k]
            k += 1
            if not count:
                if spill or first:
                    return "samples.spill and samples.groups are 0 for a piece where no row group starts"
                continue
            if j < free or first <= group:
                return f"samples of file {f['path']!r}: its row groups overlap"
            if j + spill > before:
                return f"samples of file {f['path']!r}: a row group reaches past the file's row data into its footer"
            free, group = j + spill, first
    return None


def tar_key(name: str) -> str:
    """A tar member's sample key (format ``tar``), as webdataset reads it: its path up to
    the first '.' of its base name (``a/0001.jpg`` and ``a/0001.cls`` are sample ``a/0001``)."""
    folder, _, base = name.rpartition("/")
    return (folder + "/" if folder else "") + base.split(".", 1)[0]


def samples_hash(samples: Any) -> str:
    """The hash a job names a sample index by (``job.samples``): sha256 of its canonical bytes."""
    return hashlib.sha256(b"ttpeer/samples/v1\n" + _codec.encode(samples)).hexdigest()


def urls_problem(urls: Any) -> str | None:
    """Why ``urls`` is not a list of https base addresses, or None."""
    if type(urls) is not list or not 1 <= len(urls) <= MAX_URLS or not all(type(u) is str for u in urls) \
            or len(set(urls)) != len(urls):
        return f"urls must be 1 to {MAX_URLS} distinct addresses"
    for u in urls:
        if not 8 < len(u) <= MAX_URL or not u.startswith("https://") or any(c.isspace() or ord(c) < 32 for c in u):
            return f"each url must be an https:// address of at most {MAX_URL} characters"
        if "@" in u.split("/", 3)[2]:
            return "a url must not carry a user or password (user@host): records are read by every member"
    return None


def dataset_consistent(body: dict[str, Any]) -> str | None:
    """The record's cross-field rules: sorted unique paths, one piece per ``piece_size``
    bytes of each file, an id that is the manifest's hash, and well-formed optional
    ``samples`` and ``urls``."""
    files = body["files"]
    paths = [f["path"] for f in files]
    if any(a >= b for a, b in zip(paths, paths[1:], strict=False)):
        return "files must be sorted by path, each path once"
    # A folder and a file of one name cannot both exist ("a" and "a/b").
    names = set(paths)
    if any(p[:i] in names for p in paths for i, c in enumerate(p) if c == "/"):
        return "a file's path is another file's folder"
    for f in files:
        if len(f["pieces"]) != piece_count(f["size"], body["piece_size"]):
            return f"file {f['path']!r} must have one piece per {body['piece_size']} bytes"
    if dataset_id(body["piece_size"], record_files(body)) != body["id"]:
        return "id is not the hash of the manifest"
    if "samples" in body and (problem := samples_problem(body["samples"], files, body["piece_size"])):
        return problem
    if "urls" in body and (problem := urls_problem(body["urls"])):
        return problem
    return None
