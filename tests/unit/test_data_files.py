"""Datasets (issue 17) on disk: splitting and hashing what ``data add`` is given (and
refusing what it cannot add), the manifest's id, a record's pieces, assembling and
evicting in the home's cache, and ``dataset_path`` inside and
outside a task load."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from ttpeer_wire import dataset_id

from ttpeer.daemon.data._dataread import copy_and_hash, scan
from ttpeer.daemon.data._datastore import DataStore, piece_blobs, piece_ok, pieces_of, pieces_of_files
from ttpeer.errors import DataError

from .proto_helpers import dataset_body, hex64

PIECE = 4096


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


FILES = {"a.bin": bytes(range(256)) * 40, "sub/b.bin": b"x" * PIECE, "sub/deeper/c.txt": b"",
         "d.bin": b"y" * (PIECE + 1)}


# -- splitting and hashing --------------------------------------------------------------


def test_a_folder_is_split_into_pieces_that_hash_to_its_bytes(tmp_path):
    src = _tree(tmp_path / "src", {**FILES, ".hidden": b"no", ".git/x": b"no"})
    sources = scan(src)
    assert [rel for rel, _ in sources] == ["a.bin", "d.bin", "sub/b.bin", "sub/deeper/c.txt"]
    files = copy_and_hash(sources, tmp_path / "copy", PIECE)
    for rel, size, hashes in files:
        data = FILES[rel]
        assert size == len(data) and (tmp_path / "copy" / rel).read_bytes() == data
        assert hashes == [hashlib.sha256(data[i:i + PIECE]).hexdigest() for i in range(0, len(data), PIECE)]
    assert {rel: len(h) for rel, _, h in files} == {"a.bin": 3, "d.bin": 2, "sub/b.bin": 1, "sub/deeper/c.txt": 0}
    pieces = pieces_of_files(PIECE, files)
    assert [p.index for p in pieces] == list(range(6))
    assert [(p.path, p.offset, p.size) for p in pieces[:3]] == [("a.bin", 0, PIECE), ("a.bin", PIECE, PIECE),
                                                                ("a.bin", 2 * PIECE, 10240 - 2 * PIECE)]


def test_a_single_file_is_a_dataset_of_one_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello")
    assert scan(path) == [("corpus.txt", path)]


def test_the_id_is_the_manifest_alone(tmp_path):
    """Same files in two places (two machines): the same id; another byte: another id."""
    one = copy_and_hash(scan(_tree(tmp_path / "one", FILES)), tmp_path / "c1", PIECE)
    two = copy_and_hash(scan(_tree(tmp_path / "two", FILES)), tmp_path / "c2", PIECE)
    assert dataset_id(PIECE, one) == dataset_id(PIECE, two) == dataset_id(PIECE, list(reversed(two)))
    changed = copy_and_hash(scan(_tree(tmp_path / "three", {**FILES, "a.bin": b"z" + FILES["a.bin"][1:]})),
                            tmp_path / "c3", PIECE)
    assert dataset_id(PIECE, changed) != dataset_id(PIECE, one)
    assert dataset_id(2 * PIECE, one) != dataset_id(PIECE, one)  # the piece size is part of what it is
    renamed = [("z.bin" if rel == "a.bin" else rel, s, h) for rel, s, h in one]
    assert dataset_id(PIECE, renamed) != dataset_id(PIECE, one)


def test_a_records_pieces_lie_in_its_files_in_order():
    body = dataset_body()  # a.txt: 5000 bytes, sub/b.txt: 10, in pieces of 4096
    assert [(p.index, p.path, p.offset, p.size) for p in pieces_of(body)] == [
        (0, "a.txt", 0, 4096), (1, "a.txt", 4096, 904), (2, "sub/b.txt", 0, 10)]
    assert piece_blobs(body) == [p[1] for f in body["files"] for p in f["pieces"]]


# -- bad input to data add ------------------------------------------------------------------


def test_a_missing_path_and_an_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan(tmp_path / "nothing")
    (tmp_path / "empty" / ".only-hidden").mkdir(parents=True)
    (tmp_path / "empty" / ".dot").write_text("x")
    with pytest.raises(DataError, match="holds no files to add"):
        scan(tmp_path / "empty")


def test_a_broken_link_in_a_folder_is_named(tmp_path):
    src = _tree(tmp_path / "src", {"ok.txt": b"1"})
    (src / "gone.txt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"gone\.txt cannot be read: it is not a regular file"):
        scan(src)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_named(tmp_path):
    src = _tree(tmp_path / "src", {"ok.txt": b"1", "secret.txt": b"2"})
    (src / "secret.txt").chmod(0)
    try:
        with pytest.raises(DataError, match=r"secret\.txt cannot be read"):
            scan(src)
    finally:
        (src / "secret.txt").chmod(0o600)


def test_a_file_that_changes_while_it_is_read_is_refused_by_name(tmp_path, monkeypatch):
    """Something appends to the file between its first stat and its last read: the second
    stat (and the byte count) tell, and the file is named."""
    import ttpeer.daemon.data._dataread as ds

    src = _tree(tmp_path / "src", {"steady.bin": b"s" * 100, "growing.bin": b"g" * (3 * PIECE)})
    real = ds._read
    grown = []

    def read_then_grow(f, n, path):
        chunk = real(f, n, path)
        if path.name == "growing.bin" and chunk and not grown:  # once: a writer appending mid-read
            grown.append(True)
            with open(path, "ab") as w:
                w.write(b"more")
        return chunk

    monkeypatch.setattr(ds, "_read", read_then_grow)
    with pytest.raises(DataError, match=r"growing\.bin changed while it was read"):
        copy_and_hash(scan(src), tmp_path / "copy", PIECE)


# -- the cache --------------------------------------------------------------------------------


def _held(store: DataStore, dataset: str, used: float, origin: str = "fetched", size: int = 100) -> None:
    (store.root / dataset / "files").mkdir(parents=True)
    store.save_meta(dataset, {"name": dataset[:4], "id": dataset, "origin": origin, "bytes": size, "used": used})


def test_a_fetched_dataset_is_assembled_piece_by_piece_and_resumes(tmp_path):
    data = bytes(range(256)) * 40  # 10240 bytes: 3 pieces
    src = _tree(tmp_path / "src", {"f.bin": data})
    files = copy_and_hash(scan(src), tmp_path / "copy", PIECE)
    dataset = dataset_id(PIECE, files)
    store = DataStore(tmp_path / "datasets")
    pieces = pieces_of_files(PIECE, files)
    assert store.start(dataset, files) == set()
    done: set[int] = set()
    for p in pieces[::2]:  # pieces 0 and 2, then a restart
        plain = tmp_path / f"p{p.index}"
        plain.write_bytes(data[p.offset:p.offset + p.size])
        assert piece_ok(plain, p)
        store.put_piece(dataset, p, plain, done)
    assert DataStore(store.root).start(dataset, files) == {0, 2}  # resumed, not begun again
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"\0" * PIECE)
    assert not piece_ok(wrong, pieces[1])
    plain = tmp_path / "p1"
    plain.write_bytes(data[PIECE:2 * PIECE])
    store.put_piece(dataset, pieces[1], plain, done)
    store.finish(dataset, {"name": "f", "id": dataset, "origin": "fetched", "bytes": len(data)})
    assert (store.files(dataset) / "f.bin").read_bytes() == data
    assert set(store.held()) == {dataset} and store.find("f") is not None


def test_eviction_is_least_recently_used_and_spares_running_jobs_and_added_copies(tmp_path):
    store = DataStore(tmp_path)
    ids = {n: hex64(n) for n in ("old", "running", "mine", "recent")}
    _held(store, ids["old"], used=1)
    _held(store, ids["running"], used=2)
    _held(store, ids["mine"], used=3, origin="added")
    _held(store, ids["recent"], used=4)
    assert store.evict(300, keep={ids["running"]}) == [ids["old"]]
    assert store.evict(0, keep={ids["running"]}) == [ids["recent"]]
    assert set(store.held()) == {ids["running"], ids["mine"]}


# -- dataset_path -----------------------------------------------------------------------------------


def test_dataset_path_answers_only_while_ttpeer_loads_a_task(tmp_path):
    from ttpeer.proto import DatasetMissing
    from ttpeer.train import DatasetResolver, TaskError, dataset_path, resolving

    with pytest.raises(TaskError, match="inside task"):
        dataset_path("corpus")

    def find(name):
        if name == "corpus":
            return hex64("c"), tmp_path
        raise DatasetMissing(name)

    with resolving(DatasetResolver(find)) as resolver:
        assert dataset_path("corpus") == tmp_path
        with pytest.raises(DatasetMissing):
            dataset_path("other")
    assert resolver.used == {"corpus": hex64("c")} and resolver.missing == ["other"]


def test_a_dataset_missing_in_a_worker_reaches_the_daemon_as_itself():
    from ttpeer.daemon.worker._failures import error, failure
    from ttpeer.proto import DatasetMissing

    frame = failure(DatasetMissing("corpus"))
    assert frame["error"] == "dataset"
    back = error(frame)
    assert isinstance(back, DatasetMissing) and back.name == "corpus"


@pytest.mark.slow  # transformers' import and a tokenized corpus: 6-14 s here
def test_an_hf_task_reading_a_dataset_hashes_the_same_from_any_peers_copy(tmp_path):
    """``hf_causal_lm(config, data=dataset_path("corpus"))``: two peers hold the same files in
    different homes; the task's hash and data fingerprint agree, so neither declines."""
    pytest.importorskip("transformers", reason="the Hugging Face extra: pip install 'ttpeer[hf]'")
    from ttpeer import train

    from .hf_helpers import TINY_GPT2, text_files

    task = tmp_path / "hf_task.py"
    task.write_text("from ttpeer.tasks import hf_causal_lm\nfrom ttpeer.train import dataset_path\n\n\n"
                    f"def task():\n    return hf_causal_lm({TINY_GPT2!r}, data=dataset_path('corpus'), "
                    "block_size=32)\n")
    seen = []
    for home in ("alice", "bob"):
        folder = text_files(tmp_path / home / "datasets" / hex64("c") / "files")
        resolver = train.DatasetResolver(lambda name, folder=folder: (hex64("c"), folder))
        with train.resolving(resolver):
            loaded = train.load_task(task, tmp_path / home / "cache")
        assert resolver.used == {"corpus": hex64("c")}
        seen.append((loaded.source_hash, train.data_fingerprint(loaded)))
    assert seen[0] == seen[1]
