"""A round's work: which round this peer trains, when it publishes, when it closes.

Theory of operation. It holds no state of its own: each step it reads the chain, the
round's contributions (``Views``) and what the local worker holds, and asks the worker to
cancel, renew, claim or publish and the closer to aggregate. Without overlap the peer
works on the chain's round: it trains shards until the round is covered, then stops
training and closes. With overlap, round r trains on the base of round r-1, so once this
peer has nothing left to do in round r it trains round r+1 on the chain's head while
round r's deltas travel and its close is made; round r comes first whenever it has work
(a requeued shard), since round r+1 cannot close before it. Moving the worker to a later
round forgets leases and covers of rounds before the chain's.

What it promises: the local model holds unpublished work of one round at a time (the
driver keeps one local model); no shard is trained for a round already covered; the
covered round is offered to the closer on every step. What breaks it: a caller that
steps it while the peer does not hold the chain's head (``PeerMachine`` syncs first).
"""

from __future__ import annotations

from ttpeer_wire import Record

from ._closer import Closer
from ._effects import Effect, Sign
from ._jobspec import JobSpec
from ._leases import LeaseTable
from ._ledger import Chain, RecordSet, train_base
from ._local import Local, LocalWorker
from ._outer import round_outer
from ._slicer import Slicer
from ._slices import plan
from ._views import Views


class Rounds:
    def __init__(self, local: LocalWorker, leases: LeaseTable, closer: Closer, slicer: Slicer, views: Views,
                 records: RecordSet, held: set[str], heard: dict[str, float]) -> None:
        self.local, self.leases, self.closer, self.slicer, self.views = local, leases, closer, slicer, views
        self.records, self.held, self.heard = records, held, heard

    def work(self, job: JobSpec, chain: Chain, now: float) -> list[Effect | Sign]:
        """This peer holds the chain's head and the job has rounds left: work on them."""
        if job.overlap:
            return self._overlapped(job, chain, now)
        rnd, base = chain.round, chain.head
        out = self.local.cancel((job.id, rnd))
        if (self.local.work.job, self.local.work.round, self.local.work.base) != (job.id, rnd, base):
            self._new_work(job, rnd, base)
        _contribs, cover, done = self.views.round_contribs(job, rnd, base)
        if cover is not None:
            return out + self.local.cancel(None) + self._maybe_close(job, rnd, base, cover, now)
        return out + self._train(job, rnd, base, done, now)[0]

    def _overlapped(self, job: JobSpec, chain: Chain, now: float) -> list[Effect | Sign]:
        """Overlap: round r (the chain's) first whenever it has work, then round r+1."""
        rnd, head, local = chain.round, chain.head, self.local
        tbase = train_base(job.record, chain, rnd)
        has_next = self.views.plan(job.record).has_round(rnd + 1)
        w = local.work
        on_next = has_next and (w.job, w.round, w.base) == (job.id, rnd + 1, head)
        if not on_next and (w.job, w.round, w.base) != (job.id, rnd, tbase):
            self._new_work(job, rnd, tbase)
        out: list[Effect | Sign] = [*local.cancel((job.id, rnd + 1 if on_next else rnd))]
        _contribs, cover, done = self.views.round_contribs(job, rnd, tbase)
        if cover is not None:
            out += self._maybe_close(job, rnd, head, cover, now)
        busy = local.busy
        if on_next and busy:
            return out + self._train(job, rnd + 1, head, self.views.round_contribs(job, rnd + 1, head)[2], now)[0]
        if not on_next and busy and cover is None:
            return out + self._train(job, rnd, tbase, done, now, ahead=head)[0]
        if not on_next and busy:
            # Round r is covered: what this peer still trains or holds of it is not needed.
            out += local.cancel(None)
            if local.state is not Local.IDLE:
                return out  # wait for the driver to report back
            self._new_work(job, rnd, tbase)
        # Free: round r first (if this peer holds its training base), then round r+1.
        if cover is None and tbase in self.held:
            if local.work.round != rnd:
                self._new_work(job, rnd, tbase)
            effects, idle = self._train(job, rnd, tbase, done, now, ahead=head)
            if not idle or not has_next:
                return out + effects
            out += effects
        if not has_next:
            return out
        if (local.work.round, local.work.base) != (rnd + 1, head):
            self._new_work(job, rnd + 1, head)
        return out + self._train(job, rnd + 1, head, self.views.round_contribs(job, rnd + 1, head)[2], now)[0]

    def _new_work(self, job: JobSpec, rnd: int, base: str) -> None:
        """Start this peer's work on round ``rnd``; forget leases and covers of rounds
        before the chain's (they no longer matter)."""
        if self.local.new_work(job.id, rnd, base):
            current = self.views.chain(job.record).round
            self.leases.forget_before(job.id, current)
            self.closer.forget_before(job.id, current)
            self.slicer.forget_before(job.id, current)

    def _train(self, job: JobSpec, rnd: int, base: str, done: set[int], now: float,
               ahead: str | None = None) -> tuple[list, bool]:
        """Train in round ``rnd`` on ``base``; ``ahead``, with overlap, the round's own base
        when this peer holds it (the chain's round: its head), so a fresh shard starts there."""
        plan = self.views.plan(job.record)
        return self.local.round_train(job, rnd, base, done, now, self.leases, self.records, plan.inner_steps(rnd),
                                      plan.first_step(rnd), ahead)

    def _maybe_close(self, job: JobSpec, rnd: int, base: str, cover: list[Record], now: float) -> list[Effect | Sign]:
        """Offer the covered round to the closer; a sliced round (``_slicer.plan``) first
        has its slices reduced and checked, and closes once they all have a result."""
        outer = None
        if job.outer_auto:
            outer = round_outer(job, rnd, len(cover), self.views.plan(job.record), self.views.chain(job.record).closes,
                                self.records.by_id)
        slices = plan(job, cover)
        if slices is None:
            return [*self.closer.fetch_ahead(job, rnd, cover),
                    *self.closer.maybe_close(job, rnd, base, cover, now, self.heard, outer=outer)]
        covered_at = self.closer.covered(job.id, rnd, base, now)
        work, results = self.slicer.step(job, rnd, cover, slices, covered_at, now, self.records)
        if results is None:
            return list(work)
        ready = self.slicer.ready_at(job.id, rnd, cover[0]["base"], cover)
        return [*work, *self.closer.maybe_close(job, rnd, base, cover, now, self.heard, results, ready, outer)]
