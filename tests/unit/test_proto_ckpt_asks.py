"""Checkpoints on demand (``ckpt_want``) when things go wrong: a checkpoint cannot be
fetched, an upload keeps failing. Each failed on the first version of the asks (1f07364);
so did the dead closer's case, now in test_proto_peer (only one other holder uploads)."""

from __future__ import annotations

from ttpeer.proto import Failed, Fetched, FetchState, PublishCheckpoint

from .test_proto_peer import Cluster, check_finished, without_the_last_peer


class FailingFetch(Cluster):
    """Every fetch of a checkpoint (not the initial state) is refused (corrupt / blob gone)."""

    def handle(self, me, effects):  # type: ignore[override]
        rest = []
        for e in effects:
            if isinstance(e, FetchState) and e.state != e.job.init and me == self.order[-1]:
                self.fetches.append((me, e))
                m = self.machines[me]
                self.later(0.1, me, lambda now, s=e.state, m=m: m.report(Fetched(s, False), now))
            else:
                rest.append(e)
        super().handle(me, rest)


def test_a_late_peer_whose_checkpoint_cannot_be_fetched_still_finishes() -> None:
    """A checkpoint that does not fetch or import is not fetched again: the late peer replays
    the deltas instead (once it fetched the same bad checkpoint every RETRY_AFTER, forever)."""
    c = FailingFetch(3)
    late, job, _first = without_the_last_peer(c, 25, rounds=30, lease=20)
    c.dead.discard(late)
    c.run(until=c.now + 2_000)
    tries = [f for me, f in c.fetches if me == late and f.state != job["init"]]
    assert len(tries) < 20, f"{len(tries)} downloads of the same checkpoint"
    check_finished(c, job)


class FailingPublish(Cluster):
    """Every PublishCheckpoint of ``bad`` fails (its state file pruned, no worker: JobError)."""

    bad: str = ""
    attempts: int = 0

    def handle(self, me, effects):  # type: ignore[override]
        rest = []
        for e in effects:
            if isinstance(e, PublishCheckpoint) and me == self.bad:
                self.attempts += 1
                m = self.machines[me]
                self.later(0.1, me, lambda now, e=e, m=m: m.report(Failed(e), now))
            else:
                rest.append(e)
        super().handle(me, rest)


def test_a_holder_whose_upload_keeps_failing_does_not_retry_forever() -> None:
    """An upload that keeps failing is tried ``CKPT_TRIES`` times for an ask, then left: the
    asker replays (once the holder retried every 2 s for the daemon's lifetime)."""
    c = FailingPublish(2)
    late, job, first = without_the_last_peer(c, None, rounds=30, lease=20)
    c.bad = first.chain(job).closes[-1].author  # the one asked first
    c.dead.discard(late)
    c.run(until=c.now + 3_000, stop=lambda: False)
    check_finished(c, job)
    assert c.attempts < 10, f"{c.attempts} uploads tried for one ask"

