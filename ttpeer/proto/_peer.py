"""One peer's protocol state machine for a pool running fused (DiLoCo) jobs: the facade.

Theory of operation. ``PeerMachine`` holds the pool's verified records and composes the
parts that act on them, each with its own fields and its own next deadline:

- ``_antientropy.AntiEntropy``: digests, answers to others' digests, who was heard when;
- ``_leases.LeaseTable``: the claims heard, judged on this peer's own clock;
- ``_local.LocalWorker``: the one local model (a state table) and the round's work;
- ``_closer.Closer``: aggregating covered rounds, checkpoints;
- ``_follower.Follower``: reaching the chain's head (apply, fetch), the states held;
- ``_lifecycle.Lifecycle``: preparing, declining, finishing jobs; the active job;
- ``_rounds.Rounds``: which round the worker trains (overlap), when the closer closes;
- ``_views.Views``: the chain and round views, cached.

Every input (``receive``, ``report``, ``tick``) ends in ``_step``, which compares the
ledger with what this peer is doing and asks the parts for the effects that move it on:
sync to the chain's head; train (claim a shard no live lease covers, keep claiming while
shards remain, then publish one contribution; an ensemble publishes after every shard);
close once contributions cover every shard. Parts never call the facade: they return
effects, and ``Sign`` requests that the facade alone turns into signed, admitted and
broadcast records.

What it promises: records merge by set union, so duplicates, loss and reorder never
change the outcome (I1); a round closes only when every shard is covered (I2); a close
names the resulting state hash, so every peer that follows the chain holds the same state
or repairs (I3); leases expire on their own, so any live peer finishes the work of dead
ones (I4). A failed effect delays only the activity that asked for it. What breaks it: a
driver that reports a state it does not hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import Record, parse, sign

from . import _gossip
from . import _reports as rp
from ._antientropy import AntiEntropy
from ._cadence import Plan
from ._closer import Closer
from ._effects import (
    Aggregate,
    Apply,
    Effect,
    FetchState,
    Persist,
    PrepareJob,
    PublishCheckpoint,
    PublishDelta,
    ReduceSlice,
    Sign,
    Train,
)
from ._errors import RecordError
from ._follower import CHECKPOINT_DELTA_RATIO, Follower
from ._jobspec import CHECKPOINT_EVERY, JobSpec
from ._leases import LeaseTable, sharers_of
from ._ledger import Chain, RecordSet
from ._lifecycle import Lifecycle
from ._local import LocalWorker
from ._outcome import FOR_GOOD
from ._outer import Outer
from ._reports import RETRY_AFTER, Report
from ._rounds import Rounds
from ._slicer import Slicer
from ._views import Views

__all__ = ["CHECKPOINT_DELTA_RATIO", "CHECKPOINT_EVERY", "RETRY_AFTER", "PeerMachine", "Timing"]


@dataclass(frozen=True)
class Timing:
    digest_interval: float = 5.0


class PeerMachine:
    def __init__(self, pool: str, key: Ed25519PrivateKey, *, now: float, timing: Timing = Timing()) -> None:
        self.pool = pool
        self._key = key
        self.me = key.public_key().public_bytes_raw().hex()
        self.records = RecordSet(pool)
        self.timing = timing
        self._views = Views(self.records)
        self._gossip = AntiEntropy(timing.digest_interval, now, self.me)
        self._leases = LeaseTable(self.me)
        self._local = LocalWorker()
        self._closer = Closer(self.me, timing.digest_interval)
        self._slicer = Slicer(self.me)
        self._follower = Follower(self._slicer.refutes)
        self._jobs = Lifecycle(self.me)
        self._rounds = Rounds(self._local, self._leases, self._closer, self._slicer, self._views, self.records,
                              self._follower.held, self._gossip.heard)
        self._specs: dict[str, JobSpec] = {}
        self._now = now
        self._deadline_cache: tuple[object, float] | None = None
        # What status and the daemon read (the parts own them).
        self.held = self._follower.held  # states the driver holds
        self.done_jobs = self._jobs.done_jobs  # job -> the final state reported
        self.declined = self._jobs.declined
        self.skipped = self._jobs.skipped  # finished before this peer took part: nothing to do
        self.peer_rates = self._leases.peer_rates  # speeds peers published with their claims
        self.gossip_traffic = self._gossip.traffic  # payload bytes by kind (``_antientropy.GOSSIP_TRAFFIC``)

    @property
    def rate(self) -> float:
        """This peer's measured training speed, batches per second (EMA)."""
        return self._local.rate

    @rate.setter
    def rate(self, value: float) -> None:
        self._local.rate = value

    @property
    def wasted_batches(self) -> int:
        """Batches trained that no close used (cancelled copies)."""
        return self._local.wasted_batches

    # -- inputs ----------------------------------------------------------------------

    def load(self, raws: list[bytes], now: float) -> None:
        """Restore records from the durable log (no effects: they are already stored).
        A job whose task failed here before stays declined: no crash loop on restart."""
        for raw in raws:
            try:
                self._admit(parse(raw), now)
            except RecordError:
                continue
        self._jobs.load(self.records)

    def receive(self, sender: str, payload: bytes, now: float, *, settle: bool = True) -> list[Effect]:
        """A gossip payload from ``sender``. Malformed payloads are dropped.
        ``settle=False``: take it in without deciding what to do next; a driver that
        has a batch of payloads calls ``settle`` once after the last."""
        out: list[Effect] = []
        try:
            data, packed = _gossip.unpack(payload)
            kind, value = _gossip.parse_payload(data)
        except RecordError:
            return out
        self._gossip.heard[sender] = now
        if packed:
            self._gossip.packs.add(sender)
        traffic = self._gossip.traffic
        if kind == "records":
            scale = len(payload) / max(1, sum(len(raw) for raw in value))  # the payload's bytes, pro rata
            for raw in value:
                if hashlib.sha256(raw).hexdigest() in self.records:
                    traffic["records_in_held"] += round(len(raw) * scale)
                    continue  # already held: skip the signature check
                traffic["records_in_new"] += round(len(raw) * scale)
                try:
                    rec = parse(raw)
                except RecordError:
                    continue
                if self._admit(rec, now):
                    out.append(Persist(rec))
        else:
            traffic["digests_in"] += len(payload)
            out += self._gossip.answer(sender, value, self._views.rounds(), now)
        return out + self._step(now) if settle else out

    def settle(self, now: float) -> list[Effect]:
        """Decide what to do next after inputs taken in with ``settle=False``."""
        return self._step(now)

    def tick(self, now: float) -> list[Effect]:
        due = now >= self._gossip.next_digest
        return [*(self._gossip.tick(now, self._views.rounds()) if due else []), *self._step(now)]

    def next_deadline(self) -> float:
        """The next time ``tick`` has something to do."""
        # Deadlines move only when records arrive, a part's own deadline state changes, or
        # time passes one of them: cache on exactly that.
        key = (len(self.records), self._local.deadline_key(), self._closer.deadline_key(),
               self._follower.deadline_key(), self._slicer.deadline_key())
        if self._deadline_cache is None or self._deadline_cache[0] != key or self._deadline_cache[1] <= self._now:
            future = [d for d in self._deadlines() if d > self._now]
            self._deadline_cache = (key, min(future, default=float("inf")))
        return min(self._gossip.next_digest, self._deadline_cache[1])

    def _deadlines(self) -> list[float]:
        job = self._active()
        if job is None:
            return self._closer.deadlines_of_asks()
        rnd = self._views.chain(job.record).round
        # Only the earliest lease still running matters (with overlap, also the next round's).
        expiries = [self._leases.earliest_expiry(job.id, r, job.lease, self._now)
                    for r in ((rnd, rnd + 1) if job.overlap else (rnd,))]
        return [*(e for e in expiries if e is not None), *self._local.deadlines(job.lease),
                *self._closer.deadlines(job, rnd), *self._follower.deadlines(), *self._slicer.deadlines()]

    def add_local(self, rec: Record, now: float) -> list[Effect]:
        """A record made on this machine outside the machine (a job, an invite)."""
        if not self._admit(rec, now):
            return []
        return [Persist(rec), *self._gossip_out(rec)] + self._step(now)

    # -- reports from the driver ------------------------------------------------------

    def report(self, report: Report, now: float) -> list[Effect]:
        """What the driver has to say (``_reports``); returns the effects that follow."""
        local, closer, follower = self._local, self._closer, self._follower
        match report:
            case rp.Prepared(job=job):
                self._jobs.answered(job, True, "", self.records)
            case rp.Declined(job=job, reason=reason, code=code) if code in FOR_GOOD:
                return self._job_failed(job, reason, now)
            case rp.Declined(job=job, reason=reason, need=need, have=have, code=code):
                body = self._jobs.answered(job, False, reason, self.records, need=need, have=have, code=code)
                return self._emit([Sign("decline", body)] if body else [], now) + self._step(now)
            case rp.Failed(effect=PrepareJob(job=job)):
                return self.report(rp.Declined(job.id, "could not load the task"), now)
            case rp.JobFailed(job=job, reason=reason):
                return self._job_failed(job, reason, now)
            case rp.Progress(job=job, round=rnd, shard=shard, done=done, rate=rate):
                local.progress(job, rnd, shard, done, rate)
                return []
            case rp.Trained(job=job, round=rnd, shard=shard, samples=samples, batches=batches, seconds=seconds):
                local.trained(job, rnd, shard, samples, now, batches=batches, seconds=seconds)
            case rp.Failed(effect=Train(job=job, round=rnd, shard=shard)):
                local.trained(job.id, rnd, shard, 0, now, failed=True)
            case rp.DeltaEncoded(job=job, round=rnd, base=base, shards=shards):
                if not local.encoded(job.id, rnd, base, shards):
                    return []
            case rp.DeltaPublished(job=job, round=rnd, base=base, shards=shards, samples=samples):
                work_s, up_s = local.published(job.id, rnd, base, shards, samples, now, ok=True)
                metrics = dict(report.metrics)
                if report.chunks is not None:  # a sliced job's reducers leave out slow links (``_slices``)
                    metrics["up_s"] = round(up_s, 4)
                if job.auto:  # the cadence's figures (``_cadence``)
                    metrics["work_s"] = round(work_s, 4)
                    if job.id in local.last_sync:
                        metrics["sync_s"] = round(local.last_sync[job.id], 4)
                body = {"job": job.id, "round": rnd, "base": base, "shards": sorted(shards), "samples": samples,
                        "blob": report.blob, "size": report.size, "metrics": metrics}
                if report.chunks is not None:
                    body["chunks"] = report.chunks
                return self.add_local(self._signed("contrib", body), now)
            case rp.Failed(effect=PublishDelta(job=job, round=rnd, base=base, shards=shards, samples=samples)):
                local.published(job.id, rnd, base, shards, samples, now, ok=False)
            case rp.SliceReduced(effect=eff, sha256=sha, size=size, blob=blob):
                # A check that hashed otherwise publishes its own result: two hashes then
                # wait for a third author (``_slicer``), who makes one of them count.
                self._slicer.reduced(eff)
                if blob is None:  # a check that reproduced ``against``: the same blob
                    assert eff.against is not None
                    blob = eff.against["blob"]
                return self.add_local(self._signed("slice", {
                    "job": eff.job.id, "round": eff.round, "base": eff.base,
                    "contribs": sorted(c.id for c in eff.contribs), "slice": eff.slice, "of": eff.of,
                    "first": eff.first, "stop": eff.stop, "blob": blob, "sha256": sha, "size": size}), now)
            case rp.Failed(effect=ReduceSlice() as eff):
                self._slicer.failed(eff, now)
            case rp.SliceRefused(record=record):
                self._slicer.refused(record)
                return []
            case rp.Aggregated(job=job, round=rnd, base=base, contribs=contribs, state=state, metrics=metrics,
                               slices=slices, weights=weights, outer=outer):
                return self._aggregated(job, rnd, base, contribs, state, metrics, now, slices, weights,
                                        outer)
            case rp.Failed(effect=Aggregate()):
                closer.aggregate_failed(now)
            case rp.Applied(state=state, ok=ok):
                follower.applied(state, ok, now)
            case rp.Fetched(state=state, ok=ok):
                follower.fetched(state, ok, now)
            case rp.Failed(effect=Apply() | FetchState()):
                follower.failed(now)
            case rp.CheckpointPublished(job=job, round=rnd, state=state, blob=blob, size=size):
                closer.checkpoint_published(job.id, rnd, blob)
                return self.add_local(self._signed("ckpt", {
                    "job": job.id, "round": rnd, "state": state, "blob": blob, "size": size}), now)
            case rp.Failed(effect=PublishCheckpoint(job=job, round=rnd)):
                closer.checkpoint_published(job.id, rnd, None, now)
            case rp.Holds(state=state):
                self.held.add(state)
            case rp.StateLost(state=state):
                self.held.discard(state)
                return []
            case rp.WorkLost(job=job):
                local.lost(job)
                return []
            case _:
                raise TypeError(f"unknown report {report!r}")
        return self._step(now)

    def _aggregated(self, job: JobSpec, rnd: int, base: str, contribs: tuple[str, ...], state: str,
                    metrics: dict[str, float], now: float, slices: tuple[str, ...] = (),
                    weights: tuple[int, ...] = (), outer: Outer | None = None) -> list[Effect]:
        body = self._closer.aggregated(job, rnd, base, contribs, state, metrics, self.records,
                                       self._views.chain(job.record), slices, weights, outer)
        self.held.add(state)
        out = self.add_local(self._signed("close", body), now)
        if self._closer.checkpoint(job, rnd, contribs, self.records, self._views.chain(job.record)):
            out.append(PublishCheckpoint(job, rnd + 1, state))
        return out

    def _job_failed(self, job: str, reason: str, now: float) -> list[Effect]:
        active = self._jobs.active(self.records, self._views)
        body = self._jobs.failed(job, reason, self.records)
        out = self._local.failed(job)
        self._closer.failed(job)
        if active is not None and active.id == job:
            self._follower.drop()  # a sync in flight is this job's: its report changes nothing now
        return self._emit(out + ([Sign("decline", body)] if body else []), now) + self._step(now)

    def release(self, now: float) -> list[Effect]:
        """This peer is shutting down: stop training, release its claim at once (so
        others need not wait for the lease), and claim nothing more."""
        return self._emit(self._local.release(), now)

    def prefer(self, job: str, rnd: int, lacking: dict[int, int]) -> None:
        """The driver's word on data locality: for round ``rnd`` of ``job``, how many pieces
        of each shard's data this peer lacks. Its next claim in that round prefers shards
        that lack fewest (``LeaseTable.free_shard``); what each shard trains is unchanged."""
        self._leases.prefer[(job, rnd)] = dict(lacking)

    def share(self, job: str, rnd: int, shards: int) -> list[int]:
        """The shards of round ``rnd`` this peer claims first, all else equal (its share:
        ``LeaseTable.share``), in the order it would claim them."""
        return self._leases.share(job, rnd, shards, sharers_of(self.records, job))

    # -- queries for status ------------------------------------------------------------

    def chain(self, job: Record) -> Chain:
        return self._views.chain(job)

    def plan(self, job: Record) -> Plan:
        """The job's rounds as its chain fixes them: sizes, and whether it is finished."""
        return self._views.plan(job)

    def active_job(self) -> Record | None:
        return self._jobs.active(self.records, self._views)

    @property
    def training(self) -> tuple[str, int, int] | None:
        """(job, round, shard) this peer is training now, if any."""
        own = self._local.own()
        return None if own is None else own[:3]

    # -- internals -----------------------------------------------------------------------

    def _spec(self, job: Record) -> JobSpec:
        spec = self._specs.get(job.id)
        if spec is None:
            spec = self._specs[job.id] = JobSpec.of(job)
        return spec

    def _active(self) -> JobSpec | None:
        job = self._jobs.active(self.records, self._views)
        return None if job is None else self._spec(job)

    def _admit(self, rec: Record, now: float) -> bool:
        if not self.records.add(rec):
            return False
        self._gossip.admit(rec)
        if rec.kind in ("claim", "release"):
            self._leases.admit(rec, now)
        return True

    def _gossip_out(self, rec: Record) -> list[Effect]:
        return list(self._gossip.broadcast([rec.raw], self._now))

    def _signed(self, kind: str, body: dict) -> Record:
        return sign(kind, self.pool, body, self._key)

    def _emit(self, effects: list[Effect | Sign], now: float) -> list[Effect]:
        """The parts' effects, with each ``Sign`` made a record: signed, admitted, persisted
        and broadcast (whether or not it was held already)."""
        out: list[Effect] = []
        for e in effects:
            if isinstance(e, Sign):
                rec = self._signed(e.kind, e.body)
                self._admit(rec, now)
                out += [Persist(rec), *self._gossip_out(rec)]
            else:
                out.append(e)
        return out

    def _step(self, now: float) -> list[Effect]:
        self._now = max(self._now, now)
        job = self._active()
        # Its job ended for the pool (cancelled, failed everywhere): stop at once.
        own = self._local.own()
        out = self._local.cancel(None) if own is not None and (job is None or own[0] != job.id) else []
        out += self._answer_asks(now)
        return out if job is None else out + self._emit(self._step_job(job, now), now)

    def _answer_asks(self, now: float) -> list[Effect]:
        """Checkpoints asked for (``ckpt_want``) that this peer publishes, of any job: a
        finished one's final state too (``Closer.answers``)."""
        out: list[Effect] = []
        for rec in self.records.jobs():
            if self.records.by_job.get(rec.id, {}).get("ckpt_want"):
                out += self._closer.answers(self._spec(rec), self._views.chain(rec), self.records, self.held,
                                            self._gossip.heard, now)
        return out

    def _step_job(self, job: JobSpec, now: float) -> list[Effect | Sign]:
        waiting = self._jobs.prepare(job)
        if waiting is not None:
            return list(waiting)
        chain = self._views.chain(job.record)
        if chain.head not in self.held:
            sync = self._follower.sync(job, chain, self.records, now)
            if not job.overlap:
                return [*self._local.cancel(None), *sync]
            # Overlap: a shard of the chain's round trains on the state before the head,
            # so it goes on (and keeps its lease) while the head is applied.
            return [*self._local.cancel((job.id, chain.round)), *self._local.renew(job.lease, now), *sync]
        self._local.synced(job.id, chain.round, now, self._closer.covered_at)
        if self._views.plan(job.record).finished(chain.round):
            return [self._jobs.finish(job, chain.head), *self._step(now)]
        return self._rounds.work(job, chain, now)
