"""Replay and forgery at the record level, through the path every gossiped record takes
(``PeerMachine.receive``): a record replayed, duplicated, re-encoded, taken from another
pool or signed by the wrong key is either the same record (harmless) or dropped."""

from __future__ import annotations

import json

from ttpeer.proto import PeerMachine, sign
from ttpeer.proto._gossip import records_payloads

from .proto_helpers import Pool, job_body, key

P, Q = Pool("sec-p"), Pool("sec-q")
A = key("sec-a")
ADMIT_P, ADMIT_Q = P.admit([A]), Q.admit([A])  # the same node is a member of both pools
JOB_P = sign("job", P.id, job_body(), A)
JOB_Q = sign("job", Q.id, job_body(), A)


def _machine() -> PeerMachine:
    m = PeerMachine(P.id, key("sec-me"), now=0.0)
    m.load([r.raw for r in ADMIT_P], 0.0)
    return m


def _send(m: PeerMachine, raws: list[bytes]) -> None:
    for payload in records_payloads(raws):
        m.receive("peer", payload, 1.0)


def test_replayed_and_duplicated_records_are_one_record() -> None:
    m = _machine()
    _send(m, [JOB_P.raw])
    held = len(m.records)
    _send(m, [JOB_P.raw, JOB_P.raw])
    _send(m, [JOB_P.raw])
    assert len(m.records) == held and [j.id for j in m.records.jobs()] == [JOB_P.id]


def test_a_reencoded_record_is_refused_not_a_second_record() -> None:
    m = _machine()
    obj = json.loads(JOB_P.raw)
    respaced = json.dumps(obj, indent=1).encode()  # same content, same signature, other bytes
    reordered = json.dumps(dict(reversed(list(obj.items()))), separators=(",", ":")).encode()
    _send(m, [respaced, reordered])
    assert JOB_P.id not in m.records and m.records.jobs() == []


def test_a_genuine_record_of_another_pool_is_ignored() -> None:
    m = _machine()
    _send(m, [*(r.raw for r in ADMIT_Q), JOB_Q.raw])  # valid signatures, pool Q
    assert JOB_Q.id not in m.records and m.records.jobs() == []
    _send(m, [JOB_P.raw])  # the control: its pool-P twin is taken
    assert m.records.jobs() == [JOB_P]


def test_records_signed_by_the_wrong_key_are_dropped() -> None:
    m = _machine()
    forged = json.loads(JOB_P.raw)
    forged["author"] = sign("job", P.id, job_body(), key("sec-mallory")).author  # re-attributed
    outsider = sign("job", P.id, job_body(seed=9), key("sec-mallory"))  # valid signature, not a member
    _send(m, [json.dumps(forged, sort_keys=True, separators=(",", ":")).encode(), outsider.raw])
    assert m.records.jobs() == []
