"""Datasets read sample by sample: the index ``data add --format`` makes, reading samples
from the pieces held, the piece-aware schedule, and the claim preference for held data.

The index is checked against a brute-force reading of the same bytes (hypothesis draws the
texts and the piece sizes), and the reader against the files read whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ttpeer_wire import RecordError, dataset_id, samples_hash, sign

from ttpeer.daemon.data._dataread import copy_and_hash
from ttpeer.daemon.data._datasamples import sample_index
from ttpeer.daemon.data._datastore import DataStore, Piece, pieces_of_files
from ttpeer.errors import DataError
from ttpeer.train import DatasetMissing, piece_shard_indices
from ttpeer.train._samples import SampleIndex, open_samples

ID = "ab" * 32


def _lines(data: bytes) -> list[bytes]:
    """What ``--format lines`` means: a sample per line, its newline left out."""
    if not data:
        return []
    parts = data.split(b"\n")
    return parts[:-1] if data.endswith(b"\n") else parts


def _add(tmp_path: Path, files: dict[str, bytes], piece_size: int, fmt: str, *, complete: bool = True):
    """Files as ``data add`` leaves them in a home: (the index, the store root)."""
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    root = tmp_path / "datasets"
    folder = root / (ID if complete else f"{ID}.part")
    entries = copy_and_hash(sorted((rel, src / rel) for rel in files), folder / "files", piece_size)
    samples = sample_index(folder / "files", entries, piece_size, fmt)
    if complete:
        (folder / "meta.json").write_text("{}")
    else:
        (folder / "done.json").write_text("[]")
    index = SampleIndex("corpus", ID, samples_hash(samples), root, piece_size, [(p, s) for p, s, _h in entries],
                        samples)
    return index, root


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"x")), max_size=30),
       st.booleans(), st.integers(1, 23))
def test_lines_index_and_reader_match_the_files_read_whole(tmp_path_factory, lines, trailing, piece_size):
    data = b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    if not _lines(data):
        return
    index, _root = _add(tmp_path_factory.mktemp("l"), {"a.txt": data}, piece_size, "lines")
    assert index.total == len(_lines(data))
    samples = open_samples(index, None)
    assert [samples[i] for i in range(len(samples))] == _lines(data)
    # Every sample's pieces cover its bytes: a reader holding only them reads it.
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10 and i + 1 < len(data)]
    for i, s in enumerate(starts):
        end = data.find(b"\n", s)
        end = len(data) - 1 if end < 0 else end
        assert set(range(s // piece_size, end // piece_size + 1)) <= set(index.pieces_of(i)), (i, s, end)


def test_lines_over_several_files_are_numbered_in_order(tmp_path):
    files = {"b/2.txt": b"three\nfour", "a.txt": b"one\ntwo\n", "c.txt": b""}
    index, _root = _add(tmp_path, files, 5, "lines")
    samples = open_samples(index, lambda raw: raw.decode().upper())
    assert [samples[i] for i in range(len(samples))] == ["ONE", "TWO", "THREE", "FOUR"]


def test_records_and_npy_read_the_rows(tmp_path):
    rows = np.arange(7 * 3, dtype="<u2").reshape(7, 3)
    (tmp_path / "n").mkdir()
    np.save(tmp_path / "n" / "x.npy", rows)
    np.save(tmp_path / "n" / "y.npy", rows[:2] + 100)
    npy = {"x.npy": (tmp_path / "n" / "x.npy").read_bytes(), "y.npy": (tmp_path / "n" / "y.npy").read_bytes()}
    index, _root = _add(tmp_path / "a", npy, 64, "npy")
    assert index.total == 9 and index.samples["record"] == 6 and index.samples["shape"] == [3]
    samples = open_samples(index, None)
    got = np.stack([samples[i] for i in range(9)])
    assert (got == np.concatenate([rows, rows[:2] + 100])).all()

    index, _root = _add(tmp_path / "b", {"t.bin": rows.tobytes()}, 16, "records:6")
    samples = open_samples(index, lambda raw: np.frombuffer(raw, dtype="<u2"))
    assert (np.stack([samples[i] for i in range(7)]) == rows).all()
    assert list(index.pieces_of(2)) == [0, 1]  # bytes 12..17 straddle the first two 16-byte pieces


@pytest.mark.parametrize("fmt, data, says", [
    ("records:6", b"x" * 13, "not a whole number of 6-byte records"),
    ("npy", b"not an array", "not an .npy file"),
    ("records:99", b"x" * 99, "does not fit a piece"),
    ("csv", b"a\n", "--format 'csv'"),
])
def test_files_not_of_their_format_are_refused_by_name(tmp_path, fmt, data, says):
    with pytest.raises(DataError, match=says):
        _add(tmp_path, {"f.bin": data}, 64, fmt)


def test_a_sample_whose_pieces_are_not_here_names_them_and_reads_once_they_are(tmp_path):
    data = b"".join(b"line %02d\n" % i for i in range(20))  # 8 bytes a line
    index, root = _add(tmp_path, {"a.txt": data}, 16, "lines", complete=False)
    samples = open_samples(index, None)
    with pytest.raises(DatasetMissing) as caught:
        samples[5]
    assert (caught.value.name, caught.value.dataset, caught.value.pieces) == ("corpus", ID, [2])
    (root / f"{ID}.part" / "done.json").write_text(json.dumps([2]))
    assert samples[5] == b"line 05"
    assert samples.missing(range(10)) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    # The assembly becomes the dataset (renamed, as DataStore.finish does): still read.
    (root / f"{ID}.part" / "meta.json").write_text("{}")
    (root / f"{ID}.part").rename(root / ID)
    assert samples[19] == b"line 19" and samples.missing(range(10)) == []


def test_split_holds_the_last_samples_out(tmp_path):
    index, _root = _add(tmp_path, {"a.txt": b"".join(b"%d\n" % i for i in range(10))}, 4, "lines")
    train, test = open_samples(index, None).split(test=3)
    assert (len(train), len(test), test[0], train[6]) == (7, 3, b"7", b"6")
    assert sum(train.piece_counts()) == 7
    assert train.identity() != test.identity()


# -- the schedule -----------------------------------------------------------------------------


def test_piece_schedule_sees_every_sample_once_an_epoch_and_a_shard_reads_few_pieces():
    counts = [50, 0, 37, 64, 64, 12, 64, 40]  # 331 samples
    n, shards, steps, batch = sum(counts), 3, 5, 4
    firsts = np.cumsum([0] + counts)
    per_round = shards * steps * batch
    seen: list[int] = []
    for rnd in range(n // per_round + 1):
        for shard in range(shards):
            batches = piece_shard_indices(counts, 7, rnd, shard, shards, steps, batch)
            assert [len(b) for b in batches] == [batch] * steps
            flat = [i for b in batches for i in b]
            pieces = {int(np.searchsorted(firsts, i, side="right") - 1) for i in flat}
            assert len(pieces) <= -(-steps * batch // 12) + 2  # a span of 20 crosses at most 3 pieces here
            seen += flat
    # The first epoch: each sample once (a shard's samples are shuffled among themselves,
    # so the shard that crosses into the next epoch holds the epoch's last ones).
    span = steps * batch
    whole = n // span * span
    assert len(set(seen[:whole])) == whole and set(seen[:whole + span]) >= set(range(n))
    assert piece_shard_indices(counts, 7, 1, 2, shards, steps, batch) == \
        piece_shard_indices(counts, 7, 1, 2, shards, steps, batch)
    assert piece_shard_indices(counts, 8, 1, 2, shards, steps, batch) != \
        piece_shard_indices(counts, 7, 1, 2, shards, steps, batch)
    with pytest.raises(ValueError, match="samples"):
        piece_shard_indices([0, 0], 7, 0, 0, 1, 1, 1)


# -- the record -------------------------------------------------------------------------------


def _record_body(tmp_path: Path, fmt: str, data: bytes, piece_size: int = 4096):
    (tmp_path / "s").mkdir(exist_ok=True)
    (tmp_path / "s" / "a.txt").write_bytes(data)
    entries = copy_and_hash([("a.txt", tmp_path / "s" / "a.txt")], tmp_path / "copy", piece_size)
    files = [{"path": p, "size": s, "pieces": [[h, "cd" * 32] for h in hashes]} for p, s, hashes in entries]
    body = {"name": "corpus", "id": dataset_id(piece_size, entries), "piece_size": piece_size, "at": 1,
            "files": files, "samples": sample_index(tmp_path / "copy", entries, piece_size, fmt)}
    assert len(pieces_of_files(piece_size, entries)) == len(body["samples"]["counts"])
    return body


def test_a_dataset_record_carries_a_checked_sample_index(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, pool = Ed25519PrivateKey.generate(), "0" * 32
    body = _record_body(tmp_path, "lines", b"a\nb\n" * 3000)
    rec = sign("dataset", pool, body, key)
    assert sum(rec["samples"]["counts"]) == 6000
    for bad, says in [
        ({**body["samples"], "counts": body["samples"]["counts"][:-1]}, "one number per piece"),
        ({**body["samples"], "format": "csv"}, "samples.format"),
        ({**body["samples"], "record": 4}, "samples.record"),
        ({**body["samples"], "counts": [0] * len(body["samples"]["counts"])}, "at least one sample"),
        ({**body["samples"], "dtype": "<u2"}, "dtype"),
    ]:
        with pytest.raises(RecordError, match=says):
            sign("dataset", pool, {**body, "samples": bad}, key)
    for urls, ok in [(["https://example.org/corpus"], True), (["http://example.org/c"], False), ([], False)]:
        if ok:
            sign("dataset", pool, {**body, "urls": urls}, key)
        else:
            with pytest.raises(RecordError, match="url"):
                sign("dataset", pool, {**body, "urls": urls}, key)


def test_store_keeps_indexes_by_hash_and_finds_a_partial_by_name(tmp_path):
    body = _record_body(tmp_path, "lines", b"x\n" * 10)
    store = DataStore(tmp_path / "datasets")
    store.start(body["id"], [(f["path"], f["size"], [p[0] for p in f["pieces"]]) for f in body["files"]])
    store.save_meta(body["id"], {"name": "corpus"}, part=True)
    digest = store.save_index(body["id"], body, part=True)
    assert store.find_partial("corpus") == body["id"] and store.find_partial("other") is None
    found = store.index(body["id"], digest)
    assert found is not None and found[0] == digest and found[1]["samples"] == body["samples"]
    assert store.index(body["id"], "ef" * 32) is None
    # A daemon restarted before any piece came keeps the assembly (and its index).
    assert store.start(body["id"], []) == set() and store.index(body["id"], digest) is not None


# -- the claim preference ---------------------------------------------------------------------


def test_claims_prefer_shards_whose_data_is_here():
    from types import SimpleNamespace

    from ttpeer.proto._leases import LeaseTable

    table = LeaseTable("me")
    job = SimpleNamespace(id="j", shards=4)
    first = table.free_shard(job, 3, set(), 0.0, {})  # type: ignore[arg-type]
    table.prefer[("j", 3)] = {s: 0 if s == (first + 2) % 4 else 5 for s in range(4)}
    assert table.free_shard(job, 3, set(), 0.0, {}) == (first + 2) % 4  # type: ignore[arg-type]
    assert table.free_shard(job, 3, {(first + 2) % 4}, 0.0, {}) == first  # type: ignore[arg-type]
    table.forget_before("j", 4)
    assert table.prefer == {}


def test_assemblies_are_evicted_past_the_cache_bound_unless_a_job_uses_them(tmp_path):
    store = DataStore(tmp_path / "datasets")
    ids = {"old": "01" * 32, "used": "02" * 32, "new": "03" * 32}
    for n, (name, dataset) in enumerate(ids.items()):
        store.start(dataset, [("a.bin", 3 * 4096, ["00" * 32] * 3)])
        store.save_meta(dataset, {"name": name, "used": n}, part=True)
        plain = tmp_path / f"{name}.piece"
        plain.write_bytes(b"x" * 4096)
        store.put_piece(dataset, Piece(0, "a.bin", 0, 4096, "00" * 32), plain, set())
    assert set(store.partial()) == set(ids.values())
    # Sparse files count only the pieces that landed (and the small files beside them).
    from ttpeer.daemon.data._datastore import _disk_bytes
    each = _disk_bytes(store.root / f"{ids['old']}.part")
    assert 4096 <= each < 3 * 4096 + 3 * 4096
    assert store.evict(2 * each, keep={ids["used"]}) == [ids["old"]]
    assert store.evict(0, keep={ids["used"]}) == [ids["new"]]
    assert set(store.partial()) == {ids["used"]}


def _tar(members: list[tuple[str, bytes]], long_names: bool = False) -> bytes:
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT if long_names else tarfile.USTAR_FORMAT) as t:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        t.addfile(d)  # not a file: not part of any sample
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("piece_size", [512, 1536, 4096, 1 << 20])
def test_tar_shards_read_a_sample_per_key_as_webdataset_lays_them_out(tmp_path, piece_size):
    import random

    rng = random.Random(piece_size)
    members, want = [], []
    for n in range(40):
        key = f"dir/{'x' * 120 if n % 7 == 0 else ''}{n:04d}"  # some names need a GNU long-name header
        sample = {"bin": rng.randbytes(rng.randrange(0, 1500)), "cls": b"%d" % (n % 3)}
        members += [(f"{key}.{ext}", data) for ext, data in sample.items()]
        want.append(sample)
    files = {"a.tar": _tar(members[:30], long_names=True), "b.tar": _tar(members[30:], long_names=True)}
    index, _root = _add(tmp_path, files, piece_size, "tar")
    assert index.total == 40
    samples = open_samples(index, None)
    assert [samples[i] for i in range(40)] == want
    # Each sample's pieces cover it: with only those held, it reads the same.
    part = _add(tmp_path / "part", files, piece_size, "tar", complete=False)
    for i in (0, 7, 14, 39):
        need = list(part[0].pieces_of(i))
        (part[1] / f"{ID}.part" / "done.json").write_text(json.dumps(need))
        shutil_copy_pieces(tmp_path / "datasets" / ID / "files", part[1] / f"{ID}.part" / "files", part[0], need)
        assert need and fresh_read(part[0], i) == want[i], (i, need)
        if len(need) > 1:  # one piece fewer than it reads: it says which are missing
            (part[1] / f"{ID}.part" / "done.json").write_text(json.dumps(need[:-1]))
            with pytest.raises(DatasetMissing) as caught:
                fresh_read(part[0], i)
            assert caught.value.pieces == need[-1:]


def fresh_read(index: SampleIndex, i: int):
    return open_samples(index, None)[i]


def shutil_copy_pieces(src: Path, dst: Path, index: SampleIndex, pieces: list[int]) -> None:
    """Make ``dst`` hold only ``pieces`` of the files in ``src`` (zeros elsewhere), as a fetch does."""
    for rel, size in index.files:
        (dst / rel).write_bytes(b"\0" * size)
    for k in pieces:
        f, offset, size = index._pieces[k]
        rel = index.files[f][0]
        with open(src / rel, "rb") as r, open(dst / rel, "r+b") as w:
            r.seek(offset)
            w.seek(offset)
            w.write(r.read(size))


def test_a_file_that_is_not_a_tar_is_refused_by_name(tmp_path):
    with pytest.raises(DataError, match="f.tar is not a tar file"):
        _add(tmp_path, {"f.tar": b"\x01" * 1024}, 512, "tar")


def test_advise_reads_a_tasks_dataset_from_the_home(tmp_path):
    from ttpeer._advise_cmd import _load
    from ttpeer.errors import UsageError

    data = b"".join(b"%d %d\n" % (i, i % 2) for i in range(50))
    index, root = _add(tmp_path / "home", {"a.txt": data}, 64, "lines")
    (root / ID / "meta.json").write_text(json.dumps({"name": "corpus", "id": ID, "origin": "added",
                                                     "samples": index.digest}))
    (root / ID / "samples").mkdir()
    (root / ID / "samples" / f"{index.digest}.json").write_text(json.dumps(
        {"piece_size": 64, "files": [["a.txt", len(data)]], "samples": index.samples}))
    task = tmp_path / "t.py"
    task.write_text("import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
                    "from ttpeer.train import TaskSpec, dataset_samples\n\n"
                    "def parse(raw):\n    a, b = raw.split()\n    return torch.tensor([float(a)]), int(b)\n\n"
                    "def task():\n    train, test = dataset_samples('corpus', transform=parse).split(test=10)\n"
                    "    return TaskSpec(model=lambda: nn.Linear(1, 2), train=train, test=test, loss=F.cross_entropy,\n"
                    "                    metric=lambda o, t: 0.0)\n")
    loaded = _load(str(task), tmp_path / "home")
    assert (loaded.n_train, loaded.n_test) == (40, 10)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="reads dataset 'corpus', which this machine's ttpeer home does not hold"):
        _load(str(task), tmp_path / "empty")


def test_an_index_that_reaches_past_its_files_is_refused_and_a_short_spill_is_not_read_past(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ttpeer.train import TaskError

    body = _record_body(tmp_path, "lines", b"a\nb\n" * 3000)
    key, pool = Ed25519PrivateKey.generate(), "0" * 32
    spill = [0] * (len(body["samples"]["spill"]) - 1) + [1000]
    with pytest.raises(RecordError, match="reach past file"):
        sign("dataset", pool, {**body, "samples": {**body["samples"], "spill": spill}}, key)
    # A line that runs over three pieces, indexed as if it ended in the next one: a peer
    # holding the pieces the index names refuses to read on, rather than read zeros.
    data = b"short\n" + b"L" * 40 + b"\nend\n"
    index, root = _add(tmp_path / "s", {"a.txt": data}, 16, "lines", complete=False)
    assert index.samples["spill"][0] == 2
    index.samples["spill"][0] = 1
    held = list(range(len(index._pieces)))
    (root / f"{ID}.part" / "done.json").write_text(json.dumps(held))
    shutil_copy_pieces(tmp_path / "s" / "src", root / f"{ID}.part" / "files", index, held[:2])
    with pytest.raises(TaskError, match="goes on past the pieces its index says it reads"):
        open_samples(index, None)[1]


def test_a_shard_that_misses_pieces_after_its_steps_is_trained_again_not_retried():
    import trio

    from ttpeer.daemon.worker._procexec import ProcessExecutor
    from ttpeer.errors import LocalWorkLost

    fetched = []

    async def on_missing(job, exc):
        fetched.append(exc.pieces)

    async def call():
        exc = DatasetMissing("corpus", dataset=ID, pieces=[4])
        exc.moved = True
        raise exc

    ex = ProcessExecutor.__new__(ProcessExecutor)  # only its retry rule runs here
    ex.on_missing, ex._jobs = on_missing, {}
    job = type("J", (), {"id": "ab" * 32})()

    async def main():
        with pytest.raises(LocalWorkLost, match="mid-shard"):
            await ex._fetching(job, call)

    trio.run(main)
    assert fetched == [[4]]  # fetched once, then the shards train again from the round's base


def test_peers_share_a_rounds_shards_in_turn_in_an_order_they_all_compute():
    from ttpeer.proto._leases import LeaseTable

    peers = [f"{i:02x}" * 32 for i in range(3)]
    tables = {p: LeaseTable(p) for p in peers}
    shares = {p: t.share("job", 4, 7, peers) for p, t in tables.items()}
    assert sorted(s for share in shares.values() for s in share) == list(range(7))
    assert sorted(len(share) for share in shares.values()) == [2, 2, 3]
    # The third member declined: the other two share every shard between them.
    shares = {p: t.share("job", 4, 7, peers[:2]) for p, t in tables.items() if p != peers[2]}
    assert sorted(s for share in shares.values() for s in share) == list(range(7))
    assert tables[peers[0]].share("job", 5, 7, peers[:2]) != shares[peers[0]]  # it turns with the round


def test_the_default_piece_size_makes_about_256_pieces_and_fits_a_record():
    from ttpeer.daemon.data._dataread import auto_piece_size

    assert auto_piece_size([10 << 20]) == 1 << 20  # small data: the smallest default, 10 pieces
    assert auto_piece_size([1 << 30]) == 4 << 20  # 1 GiB: 256 pieces of 4 MiB
    assert auto_piece_size([20 << 30]) == 64 << 20  # 20 GiB: 320 pieces of 64 MiB
    assert auto_piece_size([100 << 30]) == 256 << 20  # 100 GiB: larger, to fit one record
    assert auto_piece_size([3 << 20] * 300) == 4 << 20  # many files: at most 400 pieces
