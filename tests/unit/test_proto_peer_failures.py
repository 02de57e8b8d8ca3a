"""PeerMachine when the task fails on this peer (``JobFailed``) and when a job ends for
the pool: its claim is released at once, it signs a decline for good, it trains nothing
more of the job, and a machine restored from the same records does not prepare it again."""

from __future__ import annotations

from ttpeer.proto import (
    Cancel,
    Holds,
    JobFailed,
    PeerMachine,
    Persist,
    Prepared,
    PrepareJob,
    Record,
    Train,
    public_hex,
    sign,
)

from .proto_helpers import Pool, job_body, key

P = Pool("peer-failures")
ME, OTHER = key("pf-me"), key("pf-other")
MEMBERSHIP = P.admit([ME, OTHER])


def _machine(*recs: Record) -> PeerMachine:
    m = PeerMachine(P.id, ME, now=0.0)
    m.load([r.raw for r in [*MEMBERSHIP, *recs]], 0.0)
    return m


def _persisted(effects, kind: str) -> list[Record]:  # noqa: ANN001
    return [e.record for e in effects if isinstance(e, Persist) and e.record.kind == kind]


def _training(job: Record) -> tuple[PeerMachine, Train]:
    m = _machine()
    assert any(isinstance(e, PrepareJob) for e in m.add_local(job, 1.0))
    m.report(Prepared(job.id), 1.0)
    [train] = [e for e in m.report(Holds(job["init"]), 1.0) if isinstance(e, Train)]
    return m, train


def test_a_failure_releases_the_claim_declines_for_good_and_trains_nothing_more():
    job = sign("job", P.id, job_body(shards=4), OTHER)
    m, train = _training(job)
    out = m.report(JobFailed(job.id, "my_task.py:3 in loss: RuntimeError: boom"), 2.0)
    [release] = _persisted(out, "release")
    assert (release["shard"], release["attempt"]) == (train.shard, train.attempt)
    [decline] = _persisted(out, "decline")
    assert (decline["code"], decline["reason"]) == ("failed", "my_task.py:3 in loss: RuntimeError: boom")
    assert m.training is None and m.declined[job.id] == decline["reason"]
    assert not [e for e in m.tick(100.0) if isinstance(e, Train)]
    assert not _persisted(m.report(JobFailed(job.id, "again"), 3.0), "decline")  # published once

    # Restored from its records (a restart), the machine does not prepare the job again.
    again = _machine(job, decline, release)
    assert again.declined[job.id] == decline["reason"]
    assert not [e for e in again.tick(1.0) if isinstance(e, PrepareJob | Train)]


def test_a_cancel_stops_the_shard_in_training_at_once():
    job = sign("job", P.id, job_body(shards=4), OTHER)
    m, train = _training(job)
    cancel = sign("cancel", P.id, {"job": job.id, "at": 5}, OTHER)  # by the submitter
    payload_effects = m.add_local(cancel, 2.0)
    assert Cancel(job.id, train.round, train.shard) in payload_effects
    assert m.active_job() is None and m.training is None
    assert public_hex(OTHER) == job.author
