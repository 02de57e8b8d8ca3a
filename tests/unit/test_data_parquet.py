"""Parquet datasets read row by row (``data add --format parquet``): the index, reading a row
from its row group's pieces and its file's footer alone, the record's checks, and a clear
refusal where pyarrow is missing or a file is not parquet.

The rows read back are checked against the tables written; the pieces a row needs
against the file's own metadata, read by pyarrow whole."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from ttpeer_wire import RecordError, dataset_id, sign

from ttpeer.daemon.data._dataread import copy_and_hash
from ttpeer.daemon.data._datasamples import parse_format, sample_index
from ttpeer.errors import DataError
from ttpeer.train import DatasetMissing, TaskError
from ttpeer.train._samples import SampleIndex, open_samples

from .test_data_samples import ID, _add, fresh_read, shutil_copy_pieces


def _pq() -> Any:
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    return pq


def _table(n: int, seed: int) -> Any:
    """``n`` rows of several types; the text is random, so a row group's bytes are about its rows'."""
    pa = pytest.importorskip("pyarrow")

    rng = random.Random(seed)
    return pa.table({
        "id": list(range(seed * 1000, seed * 1000 + n)),
        "text": [rng.randbytes(rng.randrange(20, 120)).hex() for _ in range(n)],
        "label": [i % 3 for i in range(n)],  # few values: a dictionary page
        "score": [None if i % 5 == 0 else i / 7 for i in range(n)],
        "tokens": [list(range(i % 4)) for i in range(n)],
    })


def _parquet(table: Any, rows_a_group: int) -> bytes:
    out = io.BytesIO()
    _pq().write_table(table, out, row_group_size=rows_a_group)
    return out.getvalue()


def _spans(data: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """(start, end, rows) of each row group, and where the footer begins, from the file's
    metadata read whole."""
    meta = _pq().read_metadata(io.BytesIO(data))
    spans = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        chunks = [group.column(c) for c in range(group.num_columns)]
        starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
        spans.append((min(starts), max(s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True)),
                      group.num_rows))
    return spans, len(data) - 8 - int.from_bytes(data[-8:-4], "little")


FILES_ROWS = {"a.parquet": (700, 90), "b/empty.parquet": (0, 10), "c.parquet": (130, 1000)}


def _files() -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    tables = {rel: _table(n, seed) for seed, (rel, (n, _g)) in enumerate(sorted(FILES_ROWS.items()))}
    data = {rel: _parquet(tables[rel], g) for rel, (_n, g) in FILES_ROWS.items()}
    rows = [row for rel in sorted(tables) for row in tables[rel].to_pylist()]
    return data, rows


@pytest.mark.parametrize("piece_size", [4096, 8192, 1 << 20])
def test_every_row_reads_back_as_written_over_row_groups_and_pieces_of_any_size(tmp_path, piece_size):
    data, rows = _files()
    index, _root = _add(tmp_path, data, piece_size, "parquet")
    spans, _footer = _spans(data["a.parquet"])
    assert len(spans) == 8 and index.total == len(rows) == 830
    if piece_size == 4096:  # row groups larger than a piece: they reach into the next ones
        assert all(e - s > piece_size for s, e, _n in spans) and max(index.samples["spill"]) >= 1
    if piece_size == 1 << 20:  # a piece holding several row groups: counted together
        assert index.samples["counts"][0] == 700 and index.samples["groups"] == [0, 0, 0]
    samples = open_samples(index, None)
    assert [samples[i] for i in range(len(samples))] == rows
    assert open_samples(index, lambda row: row["id"])[len(rows) - 1] == rows[-1]["id"]


def test_a_row_reads_from_its_row_groups_pieces_and_the_footers_alone(tmp_path):
    data, rows = _files()
    piece_size = 4096
    complete, _root = _add(tmp_path / "whole", data, piece_size, "parquet")
    index, root = _add(tmp_path / "part", data, piece_size, "parquet", complete=False)
    spans, footer = _spans(data["a.parquet"])
    size = len(data["a.parquet"])
    last = -(-size // piece_size) - 1
    for g in (0, 3, 7):
        start, end, _n = spans[g]
        i = sum(n for _s, _e, n in spans[:g]) + 1  # a row of row group g
        need = list(index.pieces_of(i))
        # Its group's pieces (from the first group starting in the same piece) and the footer's.
        k = start // piece_size
        reach = max((e - 1) // piece_size for s, e, _n in spans if s // piece_size == k)
        assert need == sorted({*range(k, reach + 1), *range(footer // piece_size, last + 1)}), (g, need)
        assert len(need) < last + 1  # the others are not read: they stay zeros here
        (root / f"{ID}.part" / "done.json").write_text("[]")
        with pytest.raises(DatasetMissing) as caught:
            fresh_read(index, i)
        assert (caught.value.dataset, caught.value.pieces) == (ID, need)
        shutil_copy_pieces(tmp_path / "whole" / "datasets" / ID / "files", root / f"{ID}.part" / "files", index, need)
        (root / f"{ID}.part" / "done.json").write_text(json.dumps(need))
        assert fresh_read(index, i) == rows[i]
        # Without the footer's last piece, the row is not read: that piece is named.
        (root / f"{ID}.part" / "done.json").write_text(json.dumps(need[:-1]))
        with pytest.raises(DatasetMissing) as caught:
            fresh_read(index, i)
        assert caught.value.pieces == [last]
    assert complete.samples == index.samples


def test_an_index_that_says_a_row_group_ends_sooner_is_not_read_past(tmp_path):
    data, _rows = _files()
    index, root = _add(tmp_path, {"a.parquet": data["a.parquet"]}, 4096, "parquet", complete=False)
    k = next(k for k, s in enumerate(index.samples["spill"]) if s)
    index.samples["spill"][k] = 0  # the row groups starting in k end in k, it says
    held = list(range(len(index._pieces)))
    (root / f"{ID}.part" / "done.json").write_text(json.dumps(held))
    with pytest.raises(TaskError, match="goes on past the pieces its index says it reads"):
        fresh_read(index, index._starts[k])


def test_an_index_that_puts_the_footer_elsewhere_is_refused_before_the_file_is_read(tmp_path):
    data, _rows = _files()
    index, root = _add(tmp_path, {"a.parquet": data["a.parquet"]}, 4096, "parquet", complete=False)
    index.samples["footer"][0] = 4  # the whole file after its magic bytes, it says
    (root / f"{ID}.part" / "done.json").write_text(json.dumps(list(range(len(index._pieces)))))
    with pytest.raises(TaskError, match="its footer is not where its index says it begins"):
        fresh_read(index, 0)


def _body(tmp_path: Path, data: bytes, piece_size: int = 4096) -> dict[str, Any]:
    (tmp_path / "s").mkdir(parents=True, exist_ok=True)
    (tmp_path / "s" / "a.parquet").write_bytes(data)
    entries = copy_and_hash([("a.parquet", tmp_path / "s" / "a.parquet")], tmp_path / "copy", piece_size)
    files = [{"path": p, "size": s, "pieces": [[h, "cd" * 32] for h in hashes]} for p, s, hashes in entries]
    return {"name": "t", "id": dataset_id(piece_size, entries), "piece_size": piece_size, "at": 1, "files": files,
            "samples": sample_index(tmp_path / "copy", entries, piece_size, "parquet")}


def _sketch() -> dict[str, Any]:
    """A record of one 10-piece parquet file whose index is drawn by hand: row groups 0-1
    start in piece 0 (the second reaching into 1), 2-3 in 1 (into 3), 4 in 4, 5 in 5
    (into 8); the footer begins in piece 9."""
    size = 10 * 4096 - 50
    entries = [("a.parquet", size, ["00" * 32] * 10)]
    samples = {"format": "parquet", "record": 0, "skip": [0], "counts": [5, 3, 0, 0, 7, 2, 0, 0, 0, 0],
               "spill": [1, 2, 0, 0, 0, 3, 0, 0, 0, 0], "groups": [0, 2, 0, 0, 4, 5, 0, 0, 0, 0],
               "footer": [9 * 4096 + 100]}
    return {"name": "t", "id": dataset_id(4096, entries), "piece_size": 4096, "at": 1, "samples": samples,
            "files": [{"path": "a.parquet", "size": size, "pieces": [["00" * 32, "cd" * 32]] * 10}]}


def test_a_parquet_index_whose_row_groups_overlap_or_reach_past_their_file_is_refused(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, pool = Ed25519PrivateKey.generate(), "0" * 32
    body = _sketch()
    good = body["samples"]
    sign("dataset", pool, body, key)

    def at(field: str, j: int, v: int) -> list[int]:
        return [v if n == j else x for n, x in enumerate(good[field])]

    size = body["files"][0]["size"]
    for bad, says in [
        ({**good, "spill": at("spill", 0, 2)}, "overlap"),  # over the piece where groups 2-3 start
        ({**good, "counts": at("counts", 2, 1), "groups": at("groups", 2, 3)}, "overlap"),  # inside group 3
        ({**good, "groups": at("groups", 4, 2)}, "overlap"),  # row group 2 again
        ({**good, "footer": [8 * 4096]}, "past the file's row data into its footer"),  # group 5 ends in piece 8
        ({**good, "spill": at("spill", 5, 5)}, "reach past file"),
        ({**good, "footer": [size - 4]}, "samples.footer of file 'a.parquet' must lie inside it"),
        ({**good, "footer": [2]}, "samples.footer of file 'a.parquet' must lie inside it"),
        ({**good, "footer": [100, 200]}, "one offset per file"),
        ({**good, "groups": good["groups"][:-1]}, "one row group number per piece"),
        ({**good, "groups": at("groups", 7, 1)}, "are 0 for a piece where no row group starts"),
        ({**good, "spill": at("spill", 7, 1)}, "are 0 for a piece where no row group starts"),
        ({**good, "skip": [4]}, "samples.skip is 0"),
        ({**good, "record": 8}, "samples.record"),
        ({k: v for k, v in good.items() if k != "footer"}, "samples.groups and samples.footer with parquet only"),
        ({**good, "format": "tar"}, "samples.groups and samples.footer with parquet only"),
        ({**good, "first": [0] * 10}, "samples.first with tar only"),
        ({**good, "counts": [0] * 10, "spill": [0] * 10, "groups": [0] * 10}, "at least one sample"),
    ]:
        with pytest.raises(RecordError, match=says):
            sign("dataset", pool, {**body, "samples": bad}, key)


def test_the_index_of_real_files_passes_the_record_check_even_with_more_rows_than_bytes(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pa = pytest.importorskip("pyarrow")
    key, pool = Ed25519PrivateKey.generate(), "0" * 32
    data, _rows = _files()
    sign("dataset", pool, _body(tmp_path / "a", data["a.parquet"]), key)
    # A parquet row may take less than a byte (one repeated value): more rows than bytes.
    sparse = _body(tmp_path / "z", _parquet(pa.table({"x": [0] * 20000}), 20000))
    assert sparse["samples"]["counts"] == [20000] and sparse["files"][0]["size"] < 4096
    sign("dataset", pool, sparse, key)


def test_a_file_that_is_not_parquet_is_refused_by_name_and_an_empty_one_holds_no_rows(tmp_path):
    _pq()
    with pytest.raises(DataError, match="t.txt is not a parquet file"):
        _add(tmp_path / "a", {"t.txt": b"one\ntwo\n" * 600}, 4096, "parquet")
    data, _rows = _files()
    with pytest.raises(DataError, match="hold no samples"):
        _add(tmp_path / "b", {"e.parquet": data["b/empty.parquet"]}, 4096, "parquet")
    index, _root = _add(tmp_path / "c", {"c.parquet": data["c.parquet"], "e.parquet": data["b/empty.parquet"]},
                        4096, "parquet")
    assert index.total == 130


def test_the_cli_and_the_daemon_take_parquet(tmp_path):
    from ttpeer._data_cmds import sample_format

    _pq()
    assert sample_format("parquet") == "parquet" and parse_format("parquet") == ("parquet", 0)
    with pytest.raises(DataError, match="parquet \\(a sample per row\\)"):
        parse_format("parquet:3")


def test_without_pyarrow_adding_and_reading_parquet_say_what_to_install(tmp_path, monkeypatch):
    index = None
    if importlib.util.find_spec("pyarrow") is not None:  # a dataset added while it was there
        index, _root = _add(tmp_path, {"c.parquet": _files()[0]["c.parquet"]}, 4096, "parquet")
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed: importing it fails
    with pytest.raises(DataError, match=r"--format parquet needs pyarrow: pip install pyarrow"):
        parse_format("parquet")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"--format parquet needs pyarrow: pip install pyarrow"):
        sample_index(tmp_path / "x", [("a.parquet", 4, ["00" * 32])], 4096, "parquet")
    if index is not None:
        reading = SampleIndex(index.name, index.dataset, index.digest, index.root, index.piece_size, index.files,
                              index.samples)
        with pytest.raises(TaskError, match=r"reading it needs pyarrow: pip install pyarrow"):
            open_samples(reading, None)[0]
