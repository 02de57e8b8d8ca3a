"""Each activity of PeerMachine waits out its own failures: a checkpoint fetch that did
not hash delays the next fetch, not this peer's next claim; a Train that could not run
delays the next claim, not the close (the machine once kept one retry time for all)."""

from __future__ import annotations

from ttpeer.proto import (
    RETRY_AFTER,
    Aggregate,
    Effect,
    Failed,
    Fetched,
    FetchState,
    Holds,
    JobSpec,
    PeerMachine,
    Prepared,
    PrepareJob,
    Train,
    sign,
)

from .proto_helpers import Pool, close, contrib, hex64, job_body, key, state

P = Pool("retries")
ME, OTHER = key("retries-me"), key("retries-other")
MEMBERSHIP = P.admit([ME, OTHER])


def _of(effects: list[Effect], kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def test_a_failed_checkpoint_fetch_does_not_delay_the_next_claim() -> None:
    # Job A is one round in: a close and a checkpoint of the state it made, both by OTHER.
    a = sign("job", P.id, job_body(shards=1, rounds=3, init=state("a-init"), at=1000), OTHER)
    a_contrib = contrib(P.id, OTHER, a, 0, a["init"], [0])
    a_close = close(P.id, OTHER, a, 0, a["init"], [a_contrib], state("a-1"))
    a_ckpt = sign("ckpt", P.id, {"job": a.id, "round": 1, "state": state("a-1"), "blob": hex64("ck"),
                                 "size": 99}, OTHER)
    b = sign("job", P.id, job_body(shards=2, rounds=1, init=state("b-init"), at=2000, seed=7), OTHER)
    m = PeerMachine(P.id, ME, now=0.0)
    m.load([r.raw for r in [*MEMBERSHIP, a, a_contrib, a_close, a_ckpt, b]], 0.0)
    assert m.report(Holds(b["init"]), 0.0) == [PrepareJob(JobSpec.of(a))]  # B's initial state is on disk already

    # A peer catching up on A fetches its checkpoint; the bytes do not hash.
    [fetch] = _of(m.report(Prepared(a.id), 1.0), FetchState)
    assert fetch.state == state("a-1")
    assert not _of(m.report(Fetched(fetch.state, False), 1.0), FetchState)

    # A is cancelled by its submitter: the peer moves on to B, and claims a shard at once,
    # not when the fetch's retry time comes.
    cancelled = sign("cancel", P.id, {"job": a.id, "at": 5}, OTHER)
    assert _of(m.add_local(cancelled, 1.5), PrepareJob) == [PrepareJob(JobSpec.of(b))]
    trains = _of(m.report(Prepared(b.id), 1.5), Train)
    assert [(t.job.id, t.round, t.base) for t in trains] == [(b.id, 0, b["init"])], (
        f"the claim waited for the failed fetch's retry ({RETRY_AFTER} s)")


def test_a_failed_train_does_not_delay_the_close() -> None:
    job = sign("job", P.id, job_body(shards=2, rounds=1), OTHER)
    m = PeerMachine(P.id, ME, now=0.0)
    m.load([r.raw for r in [*MEMBERSHIP, job]], 0.0)
    m.report(Prepared(job.id), 1.0)
    [train] = _of(m.report(Holds(job["init"]), 1.0), Train)
    assert not _of(m.report(Failed(train), 2.0), Train)  # the worker waits before claiming again

    # OTHER's contribution covers the round; OTHER has been silent for a lease (never heard
    # here), so this peer closes at once rather than when its worker's retry time comes.
    cover = contrib(P.id, OTHER, job, 0, job["init"], [0, 1])
    aggregates = _of(m.add_local(cover, 2.1), Aggregate)
    assert [a.contribs for a in aggregates] == [(cover,)], (
        f"the close waited for the failed Train's retry ({RETRY_AFTER} s)")
