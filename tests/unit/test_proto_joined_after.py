"""Which finished jobs a peer skips (``proto.joined_after``): one submitted before it
joined the pool, in which it wrote nothing. A pure function of the records; the times
are the joiner's and the submitter's own clocks, each in its record."""

from __future__ import annotations

from ttpeer.proto import RecordSet, joined_after, public_hex, sign
from ttpeer.proto._outcome import took_part

from .proto_helpers import Pool, job_body, key

P = Pool("joined-after")
IK = key("ja-ik")
INV = P.invite(IK)
OLD, SUBMITTER, NEW, STRANGER = key("ja-old"), key("ja-submitter"), key("ja-new"), key("ja-stranger")
OLD_ID, SUB_ID, NEW_ID, STRANGER_ID = (public_hex(k) for k in (OLD, SUBMITTER, NEW, STRANGER))
JOB = sign("job", P.id, job_body(at=1000), SUBMITTER)


def records(*extra, new_at: int = 2000):  # type: ignore[no-untyped-def]
    rs = RecordSet(P.id)
    for rec in (INV, P.join(INV, OLD, signer=IK, at=500, name="old"),
                P.join(INV, SUBMITTER, signer=IK, at=600, name="sub"),
                P.join(INV, NEW, signer=IK, at=new_at, name="new"), JOB, *extra):
        rs.add(rec)
    return rs


def claim(author) -> object:  # type: ignore[no-untyped-def]
    return sign("claim", P.id, {"job": JOB.id, "round": 0, "shard": 0, "attempt": 1, "n": 1, "done": 0,
                                "rate": 1.0, "backup": False}, author)


def test_a_member_that_joined_after_the_submission_and_wrote_nothing_skips_the_job():
    assert joined_after(records(), JOB, NEW_ID)


def test_a_member_that_joined_before_the_submission_does_not_skip_it_even_if_it_missed_it():
    assert not joined_after(records(), JOB, OLD_ID)  # down for the whole job: it catches up instead


def test_joining_at_the_very_second_of_the_submission_is_not_after_it():
    assert not joined_after(records(new_at=1000), JOB, NEW_ID)
    assert joined_after(records(new_at=1001), JOB, NEW_ID)


def test_a_newcomer_that_took_any_part_does_not_skip_it():
    rs = records(claim(NEW))
    assert took_part(rs, JOB, NEW_ID) and not joined_after(rs, JOB, NEW_ID)
    declined = sign("decline", P.id, {"job": JOB.id, "reason": "too small", "need": 0, "have": 0}, NEW)
    assert not joined_after(records(declined), JOB, NEW_ID)


def test_the_submitter_took_part_and_another_members_records_are_not_ours():
    rs = records(claim(OLD))
    assert took_part(rs, JOB, SUB_ID)  # it submitted it
    assert took_part(rs, JOB, OLD_ID) and not took_part(rs, JOB, NEW_ID)


def test_a_node_that_is_no_member_skips_nothing():
    assert not joined_after(records(), JOB, STRANGER_ID)
