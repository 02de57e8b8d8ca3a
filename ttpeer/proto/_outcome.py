"""How a job ends other than by finishing: pure views over the records.

Theory of operation. Besides its chain reaching the last round, a job ends in one
of two ways, each decided by signed records alone, so every peer holding the same
records says the same thing, whatever order they came in (I1):

- **cancelled**: a ``cancel`` record for the job, signed by its submitter or by a
  member with the admin role (anyone else's is ignored; one kept by a revocation
  still counts). Several: the one with the smallest id names who cancelled.
- **failed for the pool**: no member can still train it. A member *can still train*
  a job unless a decline of it by that member *stands*:
    - a decline with code "failed" (the task's code failed on that peer) stands for
      good: that peer never trains the job again, even after a restart;
    - any other decline ("fit", "task", "data", or none: older records) stands while
      the member has contributed nothing to the job (a peer restarted with more
      memory and trained after all no longer sits it out).
  The job has failed for the pool when the pool has members and every member's
  decline stands. A member that never answers (its machine is off) keeps the job
  open until it comes back and answers; ``ttpeer cancel`` ends it meanwhile.

Monotone in declines and cancels: more of them never revive a job. A member that
joins later can revive a failed job (it can still train it); the peers that failed
it do not try again. A job whose chain finished is done, whatever came later;
callers check that first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttpeer_wire import Record

from ._ledger import RecordSet

# Codes on the wire, words for people: what a decline's ``code`` means.
DECLINE_CODES = {
    "fit": "the model does not fit this peer's memory",
    "task": "this peer's copy of the task differs from the submitter's",
    "data": "this peer's copy of the task's data differs from the submitter's",
    "failed": "the task's code failed on this peer (for good: it does not try again)",
    "refused": "this peer refused the task file (not signed by the pool's admin)",
}
FOR_GOOD = frozenset({"failed"})


@dataclass(frozen=True)
class Ended:
    """A job that ended for the whole pool: ``how`` is "cancelled" (``by``: who) or
    "failed" (``reasons``: (member, reason) for every member, sorted by member id)."""

    how: str
    by: str = ""
    reasons: tuple[tuple[str, str], ...] = ()


def for_good(decline: Record) -> bool:
    return decline.body.get("code") in FOR_GOOD


def standing_declines(rs: RecordSet, job: Record) -> dict[str, Record]:
    """Each author's standing decline of ``job`` (see the module docstring), by author;
    of several, one for good comes first, then the smallest id."""
    contributed = {c.author for c in rs.of_job(job.id, "contrib")}
    out: dict[str, Record] = {}
    for d in sorted(rs.of_job(job.id, "decline"), key=lambda r: (not for_good(r), r.id)):
        if d.author not in out and (for_good(d) or d.author not in contributed):
            out[d.author] = d
    return out


def failed_here(rs: RecordSet, job: Record, node: str) -> Record | None:
    """``node``'s decline for good of ``job`` (its task failed there), if any."""
    return next((d for d in sorted(rs.of_job(job.id, "decline"), key=lambda r: r.id)
                 if d.author == node and for_good(d)), None)


def took_part(rs: RecordSet, job: Record, node: str) -> bool:
    """Whether ``node`` submitted ``job`` or wrote any record of it (a claim, contribution,
    decline, checkpoint...)."""
    return job.author == node or any(
        r.author == node for kind, recs in rs.by_job.get(job.id, {}).items() if kind != "job" for r in recs)


def joined_after(rs: RecordSet, job: Record, node: str) -> bool:
    """Whether ``node`` joined the pool after ``job`` was submitted and took no part in it:
    a finished job holds nothing of it. The times are the joiner's and the submitter's own
    clocks; a skew can only make a newcomer look older (it then finishes the job, as a
    member that missed it does)."""
    member = rs.members.get(node)
    join = rs.by_id.get(member.join) if member is not None else None
    submitted = job.body.get("at")
    return (join is not None and isinstance(submitted, int) and join["at"] > submitted
            and not took_part(rs, job, node))


def may_cancel(rs: RecordSet, job: Record, node: str) -> bool:
    """Whether ``node`` may cancel ``job``: its submitter, or a member with the admin role."""
    member = rs.members.get(node)
    return node == job.author or (member is not None and member.role == "admin")


def cancel_of(rs: RecordSet, job: Record) -> Record | None:
    """The cancel that ended ``job``, if any: from its submitter or an admin member, or one
    a revocation kept (the admin kept it because it was valid)."""
    valid = [c for c in rs.of_job(job.id, "cancel")
             if may_cancel(rs, job, c.author) or c.author not in rs.members]
    return min(valid, key=lambda r: r.id, default=None)


def job_ended(rs: RecordSet, job: Record) -> Ended | None:
    """How ``job`` ended for the pool, or None while some member can still train it."""
    held = rs.by_job.get(job.id, {})  # the common case, cheap (every step asks): neither kind held
    cancel = cancel_of(rs, job) if held.get("cancel") else None
    if cancel is not None:
        return Ended("cancelled", by=cancel.author)
    if not held.get("decline"):
        return None
    members = rs.members
    standing = standing_declines(rs, job)
    if not members or any(m not in standing for m in members):
        return None
    return Ended("failed", reasons=tuple((m, standing[m]["reason"]) for m in sorted(members)))
