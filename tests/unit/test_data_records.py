"""Datasets (issue 17), the wire and the views: the ``dataset`` record's schema and id
rules, a job's ``datasets``, and which dataset records stand and what a name means."""

from __future__ import annotations

import json

import pytest
from ttpeer_wire import path_problem, piece_sizes

from ttpeer.proto import (
    MAX_RECORD_BYTES,
    RecordError,
    RecordSet,
    dataset_sources,
    live_datasets,
    parse,
    resolve_dataset,
    sign,
)

from .proto_helpers import Pool, dataset_body, hex64, job_body, key


def test_piece_sizes_cover_the_file_exactly():
    assert piece_sizes(0, 10) == [] and piece_sizes(10, 10) == [10] and piece_sizes(11, 10) == [10, 1]
    assert sum(piece_sizes(12345, 100)) == 12345


def test_paths_that_could_leave_the_folder_are_refused():
    for bad in ("/etc/passwd", "../x", "a/../b", "a//b", "a\\b", "./a", "", "x" * 513):
        assert path_problem(bad) is not None, bad
    assert path_problem("a/b.c") is None


# -- the record ---------------------------------------------------------------------------

POOL = Pool("data")
AUTHOR = key("data-author")


def test_a_dataset_record_round_trips():
    rec = sign("dataset", POOL.id, dataset_body(), AUTHOR)
    assert parse(rec.raw) == rec
    assert [len(f["pieces"]) for f in rec["files"]] == [2, 1]


@pytest.mark.parametrize(("change", "why"), [
    (lambda b: b.update(id=hex64("another")), "id is not the hash"),
    (lambda b: b["files"][0]["pieces"].pop(), "one piece per"),
    (lambda b: b["files"].reverse(), "sorted by path"),
    (lambda b: b["files"][0].update(path="../a.txt"), "invalid 'files'"),
    (lambda b: b["files"][0].update(path="/a.txt"), "invalid 'files'"),
    (lambda b: b["files"][0]["pieces"][0].append(hex64(1)), "invalid 'files'"),
    (lambda b: b.update(files=[]), "invalid 'files'"),
    (lambda b: b.update(piece_size=100), "invalid 'piece_size'"),
    (lambda b: b.update(name="has space"), "invalid 'name'"),
])
def test_a_malformed_dataset_record_is_refused(change, why):
    body = json.loads(json.dumps(dataset_body()))
    change(body)
    with pytest.raises(RecordError, match=why):
        sign("dataset", POOL.id, body, AUTHOR)


def test_a_file_and_a_folder_of_one_name_are_refused():
    body = dataset_body(files=[("a", 10), ("a-b", 5), ("a/b", 3)])
    with pytest.raises(RecordError, match="another file's folder"):
        sign("dataset", POOL.id, body, AUTHOR)


def test_a_tampered_or_oversized_dataset_record_is_refused():
    rec = sign("dataset", POOL.id, dataset_body(), AUTHOR)
    tampered = rec.raw.replace(b'"corpus"', b'"corpse"')
    with pytest.raises(RecordError, match="signature"):
        parse(tampered)
    # Too many pieces for one record: sign refuses it, and so does parse (the size cap first).
    big = dataset_body(files=[(f"f{i:04d}", 4096 * 4) for i in range(200)])
    with pytest.raises(RecordError, match="over the cap"):
        sign("dataset", POOL.id, big, AUTHOR)
    assert len(json.dumps(big)) > MAX_RECORD_BYTES


def test_a_dataset_record_may_name_https_addresses_only():
    """``urls`` (``data add --url``): 1 to 4 distinct https addresses; a record without
    them stays as it was, and one with a bad list is refused (by the record's check, which
    ``parse`` runs too)."""
    plain = sign("dataset", POOL.id, dataset_body(), AUTHOR)
    assert "urls" not in plain.body
    urls = ["https://bucket.example.com/corpus", "https://mirror.example.org/c?sig=abc"]
    rec = sign("dataset", POOL.id, {**dataset_body(), "urls": urls}, AUTHOR)
    assert parse(rec.raw)["urls"] == urls and rec["id"] == plain["id"]  # where it lies is not what it is
    for bad in (["http://bucket.example.com/corpus"], ["ftp://x.example/y"], ["https://"], [],
                ["https://a.example/x"] * 2, [f"https://{i}.example/x" for i in range(5)],
                ["https://a.example/x y"], ["https://a.example/" + "x" * 600], "https://a.example/x", [7]):
        with pytest.raises(RecordError, match="url"):
            sign("dataset", POOL.id, {**dataset_body(), "urls": bad}, AUTHOR)


def test_a_job_records_its_datasets_by_name():
    ok = sign("job", POOL.id, job_body(datasets={"corpus": hex64("d")}), AUTHOR)
    assert parse(ok.raw)["datasets"] == {"corpus": hex64("d")}
    for bad in ({}, {"bad name": hex64("d")}, {"corpus": "nothex"}):
        with pytest.raises(RecordError, match="datasets"):
            sign("job", POOL.id, job_body(datasets=bad), AUTHOR)


# -- which records stand ------------------------------------------------------------------------


def _pool_records(admin_role: str = "admin"):
    a, b, boss = key("a"), key("b"), key("boss")
    ik, bk = key("ik"), key("bk")
    invite = POOL.invite(ik, uses=2)
    boss_invite = POOL.invite(bk, uses=1, role=admin_role)
    joins = [POOL.join(invite, a, name="a", signer=ik), POOL.join(invite, b, name="b", signer=ik),
             POOL.join(boss_invite, boss, name="boss", signer=bk)]
    return (a, b, boss), [invite, boss_invite, *joins]


def _set(records) -> RecordSet:
    rs = RecordSet(POOL.id)
    for r in records:
        rs.add(r)
    return rs


def test_a_dataset_record_is_withdrawn_by_its_author_or_an_admin_only():
    (a, b, boss), members = _pool_records()
    rec = sign("dataset", POOL.id, dataset_body(), a)
    assert [r.id for r in live_datasets(_set([*members, rec]))] == [rec.id]
    by_b = sign("dataset_rm", POOL.id, {"dataset": rec.id, "at": 1}, b)
    assert [r.id for r in live_datasets(_set([*members, rec, by_b]))] == [rec.id]  # not b's to withdraw
    for who in (a, boss):
        rm = sign("dataset_rm", POOL.id, {"dataset": rec.id, "at": 1}, who)
        assert live_datasets(_set([*members, rec, rm, by_b])) == []
    outsider = key("outsider")
    assert live_datasets(_set([*members, sign("dataset", POOL.id, dataset_body(), outsider)])) == []


def test_a_name_means_what_this_peer_holds_then_the_newest():
    (a, b, _), members = _pool_records()
    old = sign("dataset", POOL.id, dataset_body("old", at=10), a)
    new = sign("dataset", POOL.id, dataset_body("new", at=20), b)
    same_as_new = sign("dataset", POOL.id, dataset_body("new", at=5), a)  # the same files added by a
    rs = _set([*members, old, new, same_as_new])
    assert resolve_dataset(rs, "corpus") == new
    assert resolve_dataset(rs, "corpus", held={old["id"]}) == old
    assert resolve_dataset(rs, "nothing") is None
    assert {r.id for r in dataset_sources(rs, new["id"])} == {new.id, same_as_new.id}
