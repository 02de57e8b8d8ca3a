"""``ttpeer status`` lists who declined a job and why, from the signed records."""

from __future__ import annotations

from ttpeer.daemon._status import declines
from ttpeer.proto import RecordSet, sign

from .proto_helpers import Pool, contrib, job_body, key, state


def _decline(pool: Pool, author, job, reason: str, need: int = 0, have: int = 0):  # type: ignore[no-untyped-def]
    return sign("decline", pool.id, {"job": job.id, "reason": reason, "need": need, "have": have}, author)


def test_declines_of_members_are_listed_by_name_until_they_train_after_all():
    pool = Pool("declines")
    nodes = [key(f"d{i}") for i in range(3)]
    outsider = key("outsider")
    rs = RecordSet(pool.id)
    for rec in pool.admit(nodes):
        rs.add(rec)
    job = sign("job", pool.id, job_body(), nodes[0])
    other_job = sign("job", pool.id, job_body(seed=2), nodes[0])
    for rec in (job, other_job,
                _decline(pool, nodes[2], job, "too small", need=2**31, have=2**30),
                _decline(pool, outsider, job, "not a member"),
                _decline(pool, nodes[1], job, "restarted with more memory later"),
                contrib(pool.id, nodes[1], job, 0, state("init"), [0]),
                _decline(pool, nodes[0], other_job, "another job")):
        rs.add(rec)
    [shown] = declines(rs, job)
    assert shown == {"peer": nodes[2].public_key().public_bytes_raw().hex(), "name": "n2", "reason": "too small",
                     "need_bytes": 2**31, "have_bytes": 2**30, "code": None}
    assert [d["reason"] for d in declines(rs, other_job)] == ["another job"]
