"""How a job ends other than by finishing (``proto._outcome``): a pure function of the
set of records, whatever their order or duplication (I1), and monotone in declines and
cancels: more of them never revive a job."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import (
    Ended,
    Record,
    RecordSet,
    cancel_of,
    failed_here,
    job_ended,
    may_cancel,
    public_hex,
    sign,
    standing_declines,
)

from .proto_helpers import Pool, contrib, job_body, key, state

P = Pool("outcome")
ADMIN, SUBMITTER, OTHER = key("oc-admin"), key("oc-submitter"), key("oc-other")
OUTSIDER = key("oc-outsider")
AID, SID, OID = (public_hex(k) for k in (ADMIN, SUBMITTER, OTHER))
_admin_ik, _member_ik = key("oc-admin-ik"), key("oc-member-ik")
_admin_invite = P.invite(_admin_ik, role="admin")
_member_invite = P.invite(_member_ik)
MEMBERSHIP = [_admin_invite, _member_invite, P.join(_admin_invite, ADMIN, name="admin", signer=_admin_ik),
              P.join(_member_invite, SUBMITTER, name="sub", signer=_member_ik),
              P.join(_member_invite, OTHER, name="other", signer=_member_ik)]
JOB = sign("job", P.id, job_body(), SUBMITTER)


def decline(author, reason: str = "too small", code: str | None = None, job: Record = JOB) -> Record:  # noqa: ANN001
    body = {"job": job.id, "reason": reason, "need": 0, "have": 0}
    return sign("decline", P.id, {**body, "code": code} if code else body, author)


def cancel(author, at: int = 1) -> Record:  # noqa: ANN001
    return sign("cancel", P.id, {"job": JOB.id, "at": at}, author)


def records(*recs: Record) -> RecordSet:
    rs = RecordSet(P.id)
    for r in [*MEMBERSHIP, JOB, *recs]:
        rs.add(r)
    return rs


def test_nobody_declined_or_some_can_still_train_it():
    assert job_ended(records(), JOB) is None
    assert job_ended(records(decline(ADMIN), decline(OTHER, code="failed")), JOB) is None


def test_every_member_declined_fails_it_for_the_pool_with_each_reason():
    rs = records(decline(ADMIN, "fits nowhere", code="fit"), decline(SUBMITTER, "a.py:3 in loss: boom", code="failed"),
                 decline(OTHER, "old record, no code"), decline(OUTSIDER, "not a member"))
    end = job_ended(rs, JOB)
    assert end == Ended("failed", reasons=tuple(sorted(
        [(AID, "fits nowhere"), (SID, "a.py:3 in loss: boom"), (OID, "old record, no code")])))


def test_a_decline_other_than_a_failure_no_longer_stands_once_its_author_trained():
    trained = contrib(P.id, OTHER, JOB, 0, state("init"), [0])
    rs = records(decline(ADMIN, code="failed"), decline(SUBMITTER, code="failed"), decline(OTHER, code="fit"), trained)
    assert job_ended(rs, JOB) is None and set(standing_declines(rs, JOB)) == {AID, SID}
    # A failure of the task stands for good, whatever its author trained before it failed.
    rs.add(decline(OTHER, "b.py:9 in model: boom", code="failed"))
    assert job_ended(rs, JOB).how == "failed"
    assert failed_here(rs, JOB, OID)["reason"] == "b.py:9 in model: boom"
    assert failed_here(rs, JOB, AID) is not None and failed_here(rs, JOB, public_hex(OUTSIDER)) is None


def test_a_failure_for_good_stands_over_an_earlier_soft_decline_by_the_same_member():
    """A member that first declined softly (say the model did not fit) and later failed the
    task for good stands declined *for good*, whatever the two records' ids: the failure is
    what keeps it out even once it trains, and what ``job_ended`` (and the status, from
    ``standing_declines``) reports as its reason. Here the soft decline has the smaller id,
    so an order by id alone would report the soft one."""
    failure = decline(OTHER, "c.py:7 in step: boom", code="failed")
    soft = next(d for d in (decline(OTHER, f"needs more memory ({i})", code="fit") for i in range(1000))
                if d.id < failure.id)
    rs = records(decline(ADMIN, "a.py:1 in init: boom", code="failed"),
                 decline(SUBMITTER, "s.py:2 in data: boom", code="failed"), soft, failure)
    assert standing_declines(rs, JOB)[OID] == failure, "an earlier soft decline stood over a failure for good"
    assert job_ended(rs, JOB) == Ended("failed", reasons=tuple(sorted(
        [(AID, "a.py:1 in init: boom"), (SID, "s.py:2 in data: boom"), (OID, "c.py:7 in step: boom")])))


def test_only_the_submitter_or_an_admin_cancels():
    assert may_cancel(records(), JOB, SID) and may_cancel(records(), JOB, AID)
    assert not may_cancel(records(), JOB, OID) and not may_cancel(records(), JOB, public_hex(OUTSIDER))
    assert job_ended(records(cancel(OTHER), cancel(OUTSIDER)), JOB) is None
    both = [cancel(SUBMITTER), cancel(ADMIN)]
    end = job_ended(records(*both), JOB)
    assert end is not None and end.how == "cancelled"
    assert end.by == min(both, key=lambda r: r.id).author  # of several, the smallest id names who
    # A cancel wins over a failure: it says who ended the job.
    assert job_ended(records(cancel(ADMIN), *(decline(k, code="failed") for k in (ADMIN, SUBMITTER, OTHER))),
                     JOB) == Ended("cancelled", by=AID)


def test_a_cancel_kept_by_the_revocation_of_its_author_still_counts():
    c = cancel(ADMIN)
    revoke = sign("revoke", P.id, {"node": AID, "keep": sorted([c.id]), "at": 5}, P.root)
    assert cancel_of(records(c, revoke), JOB) == c
    dropped = sign("revoke", P.id, {"node": AID, "keep": [], "at": 5}, P.root)
    assert cancel_of(records(c, dropped), JOB) is None


def test_a_member_that_joins_later_can_still_train_a_failed_job():
    rs = records(*(decline(k, code="failed") for k in (ADMIN, SUBMITTER, OTHER)))
    assert job_ended(rs, JOB).how == "failed"
    late = key("oc-late")
    rs.add(P.join(_member_invite, late, name="late", signer=_member_ik))
    assert job_ended(rs, JOB) is None


CANDIDATES = [
    decline(ADMIN, code="failed"), decline(ADMIN, "fit", code="fit"), decline(SUBMITTER, code="failed"),
    decline(SUBMITTER), decline(OTHER, code="data"), decline(OTHER, code="failed"), decline(OUTSIDER),
    cancel(SUBMITTER), cancel(ADMIN, at=2), cancel(OTHER), cancel(OUTSIDER),
    contrib(P.id, OTHER, JOB, 0, state("init"), [1]), contrib(P.id, SUBMITTER, JOB, 0, state("init"), [2]),
]
ENDINGS = [r for r in CANDIDATES if r.kind in ("decline", "cancel")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CANDIDATES), max_size=20), st.randoms(use_true_random=False))
def test_the_outcome_is_a_function_of_the_set(picked, rng):
    shuffled = [*MEMBERSHIP, JOB, *picked, *picked[: len(picked) // 2]]
    rng.shuffle(shuffled)
    rs = RecordSet(P.id)
    for r in shuffled:
        rs.add(r)
    assert job_ended(rs, JOB) == job_ended(records(*set(picked)), JOB)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CANDIDATES), max_size=12), st.lists(st.sampled_from(ENDINGS), max_size=6))
def test_more_declines_and_cancels_never_revive_a_job(base, more):
    before = job_ended(records(*base), JOB)
    after = job_ended(records(*base, *more), JOB)
    if before is not None:
        assert after is not None
        assert before.how == "failed" or after.how == "cancelled"
