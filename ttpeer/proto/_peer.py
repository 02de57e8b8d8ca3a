"""One peer's protocol state machine for a pool running fused (DiLoCo) jobs.

Theory of operation. The machine holds the pool's verified records, the local
times it last saw each claim (leases are judged on this peer's own monotonic
clock, never on anyone's wall clock), the set of model states its driver holds,
and what work it has in flight. Every input (``receive``, a report, ``tick``)
ends in ``_step``, which compares the ledger with what this peer is doing and
emits the effects that move it forward:

1. sync: reach the head of the canonical chain from the newest state it holds,
   applying closes one by one, or fetching a checkpoint when it holds none;
2. train: claim a shard no live lease covers and train it; keep claiming while
   shards remain, then publish one contribution for the shards trained (an
   ensemble job publishes after every shard: there a shard is one member, and its
   contribution is that member's checkpoint rather than a delta);
3. close: once contributions cover every shard, the designated closer (smallest
   node id among the covering set's authors) aggregates and signs the close;
   others do so too if no close appears within one lease (the closer died).

What it promises: records merge by set union, so duplicates, loss and reorder
never change the outcome (I1); a round closes only when every shard is covered
(I2); a close names the resulting state hash, so every peer that follows the
chain holds the same state or repairs (I3); leases expire on their own, so any
live peer finishes the work of dead ones (I4). What breaks it: a driver that
reports a state it does not hold.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import _gossip
from ._effects import (
    Aggregate,
    Apply,
    Broadcast,
    Cancel,
    Effect,
    FetchState,
    JobDone,
    Persist,
    PrepareJob,
    PublishCheckpoint,
    PublishDelta,
    Send,
    Train,
)
from ._errors import RecordError
from ._ledger import (
    Chain,
    RecordSet,
    canonical_chain,
    checkpoints,
    contributions,
    covered,
    overlapped,
    select_cover,
    train_base,
)
from ._outcome import FOR_GOOD, failed_here, job_ended
from ._records import Record, parse, sign

RETRY_AFTER = 2.0  # seconds before retrying a failed download or upload
CHECKPOINT_EVERY = 4  # rounds between the checkpoints a round's closer publishes (ensembles)
# Fused jobs: a checkpoint once the deltas closed since the last one add up to this many
# checkpoints' bytes (see ``_checkpoint_due``).
CHECKPOINT_DELTA_RATIO = 4


@dataclass(frozen=True)
class Timing:
    digest_interval: float = 5.0


@dataclass
class _Training:
    job: str
    round: int
    shard: int
    attempt: int
    n: int
    renewed_at: float
    backup: bool = False
    cancelled: bool = False
    done: int = 0  # batches finished, as last reported by the driver
    rate: float = 0.0


@dataclass
class _Claim:
    """What this peer knows of someone's claim: when it last heard of it (its own clock)."""

    seen: float
    done: int = 0
    rate: float = 0.0
    backup: bool = False

    def projected_finish(self, batches: int, default_rate: float) -> float:
        rate = self.rate if self.rate > 0 else default_rate
        return self.seen + max(0, batches - self.done) / rate


@dataclass
class _RoundWork:
    """What this peer trained into its local model in the current round."""

    job: str = ""
    round: int = -1
    base: str = ""
    shards: list[int] = field(default_factory=list)
    samples: int = 0


class PeerMachine:
    def __init__(
        self,
        pool: str,
        key: Ed25519PrivateKey,
        *,
        now: float,
        timing: Timing = Timing(),
    ) -> None:
        self.pool = pool
        self._key = key
        self.me = key.public_key().public_bytes_raw().hex()
        self.records = RecordSet(pool)
        self.timing = timing
        self.held: set[str] = set()  # states the driver holds
        self.done_jobs: dict[str, str] = {}  # job -> the final state reported
        self.declined: dict[str, str] = {}
        self._prepared: dict[str, bool | None] = {}  # None = asked, not answered
        # Claims by (job, round, shard), then by (author, attempt).
        self._claims: dict[tuple[str, int, int], dict[tuple[str, int], _Claim]] = {}
        self.rate = 0.0  # this peer's measured training speed, batches per second (EMA)
        self.peer_rates: dict[str, float] = {}  # speeds peers published with their claims
        self.wasted_batches = 0  # batches trained that no close used (cancelled copies)
        self._released: set[tuple[str, int, int, str, int]] = set()
        self._heard: dict[str, float] = {}  # when each peer last sent us anything
        self._gossip_index: dict[str, Record] = {}  # id prefix -> record, see _gossiped
        self._live_claim_records: dict[tuple[str, int], list[Record]] = {}  # (job, round) -> claims
        self._stopping = False
        self._covered_at: dict[tuple[str, int, str], float] = {}
        self._contrib_memo: dict[tuple[str, int], tuple] = {}  # see _round_contribs
        # (job, round) -> heap of (seen, shard, author, attempt): others' lease renewals in
        # the order they expire; entries a later renewal superseded are skipped lazily.
        self._lease_heap: dict[tuple[str, int], list[tuple[float, int, str, int]]] = {}
        self._training: _Training | None = None
        self._work = _RoundWork()
        # The PublishDelta in flight whose delta the local model still holds, as (job,
        # round, shards); None when there is none, or its delta is taken (``delta_encoded``).
        self._publishing: tuple[str, int, tuple[int, ...]] | None = None
        # (job, round, shard) whose delta the driver has taken from the local model and is
        # uploading (``delta_encoded``): the next shard may train meanwhile, but these are
        # not this peer's to train again unless the upload fails.
        self._uploading: set[tuple[str, int, int]] = set()
        self._aggregating: tuple[str, int] | None = None
        self._syncing: str | None = None  # target state of the Apply/Fetch in flight
        self._bad_apply: set[str] = set()  # states our own recomputation did not reproduce
        self._ckpt_done: set[tuple[str, int]] = set()
        self._retry_at: float = 0.0
        self._next_digest = now
        self._digests = 0
        self._chains: dict[str, tuple[tuple[int, int], Chain]] = {}
        self._now = now
        self._deadline_cache: tuple[object, float] | None = None

    # -- inputs ----------------------------------------------------------------------

    def load(self, raws: list[bytes], now: float) -> None:
        """Restore records from the durable log (no effects: they are already stored).
        A job whose task failed here before stays declined: no crash loop on restart."""
        for raw in raws:
            try:
                self._admit(parse(raw), now)
            except RecordError:
                continue
        for job in self.records.jobs():
            failed = failed_here(self.records, job, self.me)
            if failed is not None:
                self._prepared[job.id] = False
                self.declined[job.id] = failed["reason"]

    def receive(self, sender: str, payload: bytes, now: float, *, settle: bool = True) -> list[Effect]:
        """A gossip payload from ``sender``. Malformed payloads are dropped.
        ``settle=False``: take it in without deciding what to do next; a driver that
        has a batch of payloads calls ``settle`` once after the last."""
        out: list[Effect] = []
        try:
            kind, value = _gossip.parse_payload(payload)
        except RecordError:
            return out
        self._heard[sender] = now
        if kind == "records":
            for raw in value:
                if hashlib.sha256(raw).hexdigest() in self.records:
                    continue  # already held: skip the signature check
                try:
                    rec = parse(raw)
                except RecordError:
                    continue
                if self._admit(rec, now):
                    out.append(Persist(rec))
        else:
            prefixes, lo, hi = value
            held = self._gossiped()
            missing = held.keys() - prefixes  # set arithmetic in C: digests arrive often
            whole = (lo, hi) == (0, _gossip.WINDOW_SPAN)
            mine = [held[p].raw for p in missing if whole or _gossip.in_window(p, lo, hi)]
            out += [Send(sender, p) for p in _gossip.records_payloads(mine)]
        return out + self._step(now) if settle else out

    def settle(self, now: float) -> list[Effect]:
        """Decide what to do next after inputs taken in with ``settle=False``."""
        return self._step(now)

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if now >= self._next_digest:
            self._next_digest = now + self.timing.digest_interval
            self._digests += 1
            out.append(Broadcast(_gossip.digest_payload(self._gossiped().keys(), self._digests)))
        return out + self._step(now)

    def next_deadline(self) -> float:
        """The next time ``tick`` has something to do."""
        t = self._training
        # Deadlines move only when records arrive, training or retry state changes, or
        # time passes one of them: cache on exactly that.
        key = (len(self.records), t and (t.job, t.round, t.shard, t.attempt, t.renewed_at, t.cancelled),
               len(self._covered_at),
               self._retry_at, self._next_digest)
        if self._deadline_cache is None or self._deadline_cache[0] != key or self._deadline_cache[1] <= self._now:
            future = [d for d in self._deadlines() if d > self._now]
            self._deadline_cache = (key, min(future, default=float("inf")))
        return min(self._next_digest, self._deadline_cache[1])

    def _deadlines(self) -> list[float]:
        deadlines: list[float] = []
        job = self._active_job()
        if job is not None:
            lease = job["lease"]
            chain = self._chain(job)
            rnd, now = chain.round, self._now
            # Only the earliest lease still running matters (with overlap, also the next round's).
            for r in (rnd, rnd + 1) if overlapped(job) else (rnd,):
                expiry = self._earliest_lease_expiry(job.id, r, lease, now)
                if expiry is not None:
                    deadlines.append(expiry)
            if self._training is not None and not self._training.cancelled:
                deadlines.append(self._training.renewed_at + lease / 3)
            for (jid, rnd, _base), at in self._covered_at.items():
                if jid == job.id and rnd == chain.round:
                    deadlines += [at + job["lease"], at + self._close_grace(job)]
            deadlines.append(self._retry_at)
        return deadlines

    def _earliest_lease_expiry(self, job: str, rnd: int, lease: float, now: float) -> float | None:
        """When the first of others' running leases on this round expires: the heap's
        top, once renewals that superseded it and leases already past are popped."""
        heap = self._lease_heap.get((job, rnd))
        while heap:
            seen, shard, author, attempt = heap[0]
            claim = self._claims.get((job, rnd, shard), {}).get((author, attempt))
            if claim is not None and claim.seen == seen and seen + lease > now:
                return seen + lease
            heapq.heappop(heap)
        return None

    def add_local(self, rec: Record, now: float) -> list[Effect]:
        """A record made on this machine outside the machine (a job, an invite)."""
        if not self._admit(rec, now):
            return []
        return [Persist(rec), *self._gossip_out(rec)] + self._step(now)

    # -- reports from the driver ------------------------------------------------------

    def job_prepared(self, job: str, ok: bool, reason: str, now: float, *, need: int = 0,
                     have: int = 0, code: str = "") -> list[Effect]:
        """The driver loaded ``job`` (``ok``) or declines it for ``reason``; ``need`` and
        ``have``: bytes of memory when it does not fit; ``code``: what kind of reason
        (``DECLINE_CODES``). A decline is published once, so the pool sees who sits the
        job out and why; nobody waits for a decliner, since only contributions' authors
        close rounds and leases requeue unfinished work."""
        if code in FOR_GOOD:
            return self.job_failed(job, reason, now)
        self._prepared[job] = ok
        out: list[Effect] = []
        if not ok:
            self.declined[job] = reason
            if not any(r.author == self.me for r in self.records.of_job(job, "decline")):
                body = {"job": job, "reason": reason[:1000], "need": min(need, 2**53), "have": min(have, 2**53)}
                out = self._sign_local("decline", {**body, "code": code} if code else body, now)
        return out + self._step(now)

    def job_failed(self, job: str, reason: str, now: float) -> list[Effect]:
        """The task's code failed on this peer, in any effect of ``job``: sit the job out
        for good with a decline of code "failed" (a restart does not try it again, see
        ``_outcome``). What this peer was doing for the job is dropped, and a claim it
        held is released at once, so others need not wait for its lease to run out."""
        active = self._active_job()
        self._prepared[job] = False
        self.declined[job] = reason
        out: list[Effect] = []
        t = self._training
        if t is not None and t.job == job:
            self._training = None
            if not t.cancelled:
                out += self._sign_local("release", {"job": job, "round": t.round, "shard": t.shard,
                                                    "attempt": t.attempt}, now)
        if self._publishing is not None and self._publishing[0] == job:
            self._publishing = None
        if self._aggregating is not None and self._aggregating[0] == job:
            self._aggregating = None
        if active is not None and active.id == job:
            self._syncing = None  # a sync in flight is this job's: its report changes nothing now
        if self._work.job == job:
            self._work = _RoundWork()
        self._uploading = {k for k in self._uploading if k[0] != job}
        rec = self.records.by_id.get(job)
        if rec is not None and failed_here(self.records, rec, self.me) is None:
            out += self._sign_local("decline", {"job": job, "reason": reason[:1000], "need": 0, "have": 0,
                                                "code": "failed"}, now)
        return out + self._step(now)

    def holds(self, state: str, now: float) -> list[Effect]:
        """The driver holds ``state`` (restored from disk, or given by a test)."""
        self.held.add(state)
        return self._step(now)

    def progress(self, job: str, rnd: int, shard: int, done: int, rate: float) -> None:
        """The driver's report of the shard in training: ``done`` batches at ``rate``/s.
        Carried by the next lease renewal so others can project when it ends."""
        t = self._training
        if t is not None and (t.job, t.round, t.shard) == (job, rnd, shard):
            t.done = done
            if rate > 0:
                t.rate = rate

    def train_done(
        self, job: str, rnd: int, shard: int, samples: int, now: float, *, batches: int = 0, seconds: float = 0.0,
        failed: bool = False,
    ) -> list[Effect]:
        """A ``Train`` ended: ``samples`` trained (0: stopped before one batch), and
        optionally how many ``batches`` took how many ``seconds`` (this peer's speed).
        ``failed``: it could not run; wait a little before claiming again."""
        t = self._training
        self._training = None
        if failed:
            self._retry_at = now + RETRY_AFTER
        if batches > 0 and seconds > 0:
            measured = batches / seconds
            self.rate = measured if self.rate <= 0 else 0.7 * self.rate + 0.3 * measured
        if t is not None and (t.job, t.round, t.shard) == (job, rnd, shard) and samples > 0:
            if (self._work.job, self._work.round) == (job, rnd) and not t.cancelled:
                self._work.shards.append(shard)
                self._work.samples += samples
            elif t.cancelled:
                self.wasted_batches += batches or 1
        return self._step(now)

    def delta_encoded(self, job: Record, rnd: int, base: str, shards: tuple[int, ...], now: float) -> list[Effect]:
        """The driver has taken the delta of ``shards`` from the local model and is
        uploading it: the local model is free, so the next shard (of this round or, with
        overlap, the next) may start while the upload crosses the link. ``delta_published``
        follows; if the upload fails, those shards are trained again (by whoever claims
        them), since the local model has moved on."""
        if self._publishing != (job.id, rnd, tuple(shards)):
            return []
        self._publishing = None
        self._uploading |= {(job.id, rnd, s) for s in shards}
        if (self._work.job, self._work.round, self._work.base) == (job.id, rnd, base):
            self._work.shards, self._work.samples = [], 0
        return self._step(now)

    def delta_published(
        self, job: Record, rnd: int, base: str, shards: tuple[int, ...], samples: int,
        blob: str | None, size: int, metrics: dict[str, float], now: float,
    ) -> list[Effect]:
        if self._publishing == (job.id, rnd, tuple(shards)):
            self._publishing = None
        self._uploading -= {(job.id, rnd, s) for s in shards}
        if blob is None:
            self._retry_at = now + RETRY_AFTER
            return self._step(now)
        w = self._work
        if (w.job, w.round, w.base) == (job.id, rnd, base) and set(shards) <= set(w.shards):
            # Not released by ``delta_encoded``: the published shards leave the work now.
            w.shards, w.samples = [x for x in w.shards if x not in shards], max(0, w.samples - samples)
        rec = sign("contrib", self.pool, {
            "job": job.id, "round": rnd, "base": base, "shards": sorted(shards),
            "samples": samples, "blob": blob, "size": size, "metrics": metrics,
        }, self._key)
        return self.add_local(rec, now)

    def aggregated(
        self, job: Record, rnd: int, base: str, contribs: tuple[str, ...], state: str | None,
        metrics: dict[str, float], now: float,
    ) -> list[Effect]:
        self._aggregating = None
        if state is None:
            self._retry_at = now + RETRY_AFTER
            return self._step(now)
        self.held.add(state)
        body = {
            "job": job.id, "round": rnd, "base": base, "contribs": sorted(contribs),
            "state": state, "metrics": metrics,
        }
        if overlapped(job):
            body["tbase"] = self.records.by_id[contribs[0]]["base"]
        rec = sign("close", self.pool, body, self._key)
        out = self.add_local(rec, now)
        # Checkpoints (and one of the final state) let late joiners and repairing peers
        # skip ahead; between them they replay the closes' deltas.
        if self._checkpoint_due(job, rnd, contribs) and (job.id, rnd + 1) not in self._ckpt_done:
            self._ckpt_done.add((job.id, rnd + 1))
            out.append(PublishCheckpoint(job, rnd + 1, state))
        return out

    def _checkpoint_due(self, job: Record, rnd: int, contribs: tuple[str, ...]) -> bool:
        """Whether the closer of round ``rnd`` publishes a checkpoint of the state it made.

        The final state always. Fused jobs: once the deltas closed since the last
        checkpoint add up to ``CHECKPOINT_DELTA_RATIO`` checkpoints. A peer catching up
        fetches the checkpoint and replays at most that many checkpoints' worth of deltas,
        and checkpoints add at most 1/ratio to the bytes the pool uploads: a fixed "every
        4 rounds" was most of the traffic when deltas are 4-bit (a checkpoint is the fp32
        parameters and outer momentum: 16x a 4-bit delta). Before the first checkpoint its
        size is estimated from the largest delta and the job's bits. Ensembles (whose
        contributions are member checkpoints): every ``CHECKPOINT_EVERY`` rounds."""
        if rnd + 1 == job["rounds"]:
            return True
        if job["mode"] == "ensemble":
            return (rnd + 1) % CHECKPOINT_EVERY == 0
        by_id = self.records.by_id
        ckpts = [c for c in self.records.of_job(job.id, "ckpt") if c["round"] <= rnd]
        since = max((c["round"] for c in ckpts), default=0)
        chain = self._chain(job)
        closed = [tuple(chain.closes[r]["contribs"]) for r in range(since, min(rnd, len(chain.closes)))]
        sizes = [by_id[c]["size"] for ids in [*closed, contribs] for c in ids if c in by_id]
        if not sizes:
            return False
        size = max((c["size"] for c in ckpts if c["round"] == since), default=0) or max(sizes) * 64 // job["bits"]
        return sum(sizes) >= CHECKPOINT_DELTA_RATIO * size

    def local_work_lost(self, job: str, now: float) -> list[Effect]:
        """The driver lost this peer's local model (its worker process died): the shards
        trained into it and not yet published are gone. They become this peer's to claim
        again (with a new attempt), and the next shard starts fresh from the round's base.
        A failure report for the effect that found it lost follows."""
        w = self._work
        if w.job == job:
            w.shards, w.samples = [], 0
        if self._publishing is not None and self._publishing[0] == job:
            self._publishing = None
        return []

    def state_lost(self, state: str, now: float) -> list[Effect]:
        """The driver does not have ``state`` after all (a job that shares a state hash with
        an earlier one, whose file was pruned): stop counting it as held, so the peer
        recomputes it from a close or fetches a checkpoint, instead of retrying forever.
        A failure report for the effect that found it missing follows."""
        self.held.discard(state)
        return []

    def applied(self, target: str, ok: bool, now: float) -> list[Effect]:
        self._syncing = None
        if ok:
            self.held.add(target)
        else:
            self._bad_apply.add(target)
            self._retry_at = now + RETRY_AFTER
        return self._step(now)

    def fetched(self, state: str, ok: bool, now: float) -> list[Effect]:
        """A ``FetchState`` finished; ``ok`` False: the bytes did not hash to ``state``."""
        self._syncing = None
        if ok:
            self.held.add(state)
        else:
            self._retry_at = now + RETRY_AFTER
        return self._step(now)

    def sync_failed(self, now: float) -> list[Effect]:
        """An ``Apply`` or ``FetchState`` could not run (a blob is not reachable yet)."""
        self._syncing = None
        self._retry_at = now + RETRY_AFTER
        return self._step(now)

    def checkpoint_published(
        self, job: Record, rnd: int, state: str, blob: str | None, size: int, now: float
    ) -> list[Effect]:
        if blob is None:
            self._ckpt_done.discard((job.id, rnd))
            return []
        rec = sign("ckpt", self.pool, {
            "job": job.id, "round": rnd, "state": state, "blob": blob, "size": size,
        }, self._key)
        return self.add_local(rec, now)

    def release(self, now: float) -> list[Effect]:
        """This peer is shutting down: stop training, release its claim at once (so
        others need not wait for the lease), and claim nothing more."""
        self._stopping = True
        t = self._training
        if t is None or t.cancelled:
            return []
        out = self._cancel_training(None)
        return out + self._sign_local("release", {
            "job": t.job, "round": t.round, "shard": t.shard, "attempt": t.attempt,
        }, now)

    # -- queries for status ------------------------------------------------------------

    def chain(self, job: Record) -> Chain:
        return self._chain(job)

    def active_job(self) -> Record | None:
        return self._active_job()

    @property
    def training(self) -> tuple[str, int, int] | None:
        """(job, round, shard) this peer is training now, if any."""
        t = self._training
        return None if t is None or t.cancelled else (t.job, t.round, t.shard)

    # -- internals -----------------------------------------------------------------------

    def _admit(self, rec: Record, now: float) -> bool:
        if not self.records.add(rec):
            return False
        self._gossip_index[rec.id[: _gossip.ID_PREFIX]] = rec
        if rec.kind in ("claim", "release"):
            self._live_claim_records.setdefault((rec["job"], rec["round"]), []).append(rec)
            key = (rec["job"], rec["round"], rec["shard"], rec.author, rec["attempt"])
            on_shard = self._claims.setdefault(key[:3], {})
            if rec.kind == "release":
                self._released.add(key)
                on_shard.pop(key[3:], None)
            elif key not in self._released:
                if rec["rate"] > 0:
                    self.peer_rates[rec.author] = rec["rate"]
                old = on_shard.get(key[3:])
                if old is None or rec["done"] >= old.done:
                    on_shard[key[3:]] = _Claim(now, rec["done"], rec["rate"], rec["backup"])
                else:
                    old.seen = now
                if rec.author != self.me:
                    heapq.heappush(self._lease_heap.setdefault(key[:2], []), (now, key[2], key[3], key[4]))
        return True

    def _gossiped(self) -> dict[str, Record]:
        """Records worth comparing in anti-entropy, by id prefix: claims and releases of
        rounds that have closed change nothing any more, and they are most records."""
        for job in self.records.jobs():
            rnd = self._chain(job).round
            for key in [k for k in self._live_claim_records if k[0] == job.id and k[1] < rnd]:
                for r in self._live_claim_records.pop(key):
                    self._gossip_index.pop(r.id[: _gossip.ID_PREFIX], None)
        return self._gossip_index

    def _gossip_out(self, rec: Record) -> list[Effect]:
        return [Broadcast(p) for p in _gossip.records_payloads([rec.raw])]

    def _sign_local(self, kind: str, body: dict, now: float) -> list[Effect]:
        rec = sign(kind, self.pool, body, self._key)
        self._admit(rec, now)
        return [Persist(rec), *self._gossip_out(rec)]

    def _chain(self, job: Record) -> Chain:
        version = (self.records.versions[job.id], self.records.membership_version)
        cached = self._chains.get(job.id)
        if cached is None or cached[0] != version:
            cached = (version, canonical_chain(self.records, job))
            self._chains[job.id] = cached
        return cached[1]

    def _active_job(self) -> Record | None:
        for job in self.records.jobs():
            if self._prepared.get(job.id) is False:
                continue
            if job_ended(self.records, job) is not None:
                continue  # cancelled, or failed for the whole pool: nobody works on it
            # A finished job becomes active again if the chain moved away from the state
            # it finished on (it ended on the losing side of a partition): repair it.
            if job.id in self.done_jobs and self.done_jobs[job.id] == self._chain(job).head:
                continue
            return job
        return None

    def _step(self, now: float) -> list[Effect]:
        self._now = max(self._now, now)
        job = self._active_job()
        t = self._training
        out: list[Effect] = []
        if t is not None and not t.cancelled and (job is None or t.job != job.id):
            # Its job ended for the pool (cancelled, failed everywhere): stop at once.
            out = self._cancel_training(None)
        if job is None:
            return out
        return out + self._step_job(job, now)

    def _step_job(self, job: Record, now: float) -> list[Effect]:
        if job.id not in self._prepared:
            self._prepared[job.id] = None
            return [PrepareJob(job)]
        if self._prepared[job.id] is None:
            return []
        chain = self._chain(job)
        if chain.head not in self.held:
            if not overlapped(job):
                return self._cancel_training(None) + self._sync(job, chain, now)
            # Overlap: a shard of the chain's round trains on the state before the head,
            # so it goes on (and keeps its lease) while the head is applied.
            out = self._cancel_training((job.id, chain.round))
            t = self._training
            if t is not None and not t.cancelled and now >= t.renewed_at + job["lease"] / 3:
                t.n += 1
                t.renewed_at = now
                out += self._claim(job, t.round, t, now)
            return out + self._sync(job, chain, now)
        if chain.round >= job["rounds"]:
            self.done_jobs[job.id] = chain.head
            return [JobDone(job, chain.head)] + self._step(now)
        return self._work_on_round(job, chain, now)

    def _sync(self, job: Record, chain: Chain, now: float) -> list[Effect]:
        if self._syncing is not None or now < self._retry_at:
            return []
        states = chain.states
        ckpts = checkpoints(self.records, job)
        held = max((k for k, s in enumerate(states) if s in self.held), default=None)
        ckpt = max((k for k, s in enumerate(states) if k > 0 and s in ckpts), default=None)
        if held is not None and states[held + 1] not in self._bad_apply:
            # Apply the next close, unless a checkpoint lets us skip several rounds.
            if ckpt is None or ckpt <= held + 1:
                close = chain.closes[held]
                parts = tuple(self.records.by_id[c] for c in close["contribs"])
                self._syncing = states[held + 1]
                return [Apply(job, close, parts)]
        if ckpt is not None and (held is None or ckpt > held):
            self._syncing = states[ckpt]
            return [FetchState(job, states[ckpt], ckpts[states[ckpt]]["blob"])]
        if held is None:
            self._syncing = job["init"]
            return [FetchState(job, job["init"], job["init_blob"])]
        self._retry_at = now + RETRY_AFTER  # our recomputation failed; wait for a checkpoint
        return []

    def _cancel_training(self, keep: tuple[str, int] | None) -> list[Effect]:
        t = self._training
        if t is None or t.cancelled or (t.job, t.round) == keep:
            return []
        t.cancelled = True
        return [Cancel(t.job, t.round, t.shard)]

    def _work_on_round(self, job: Record, chain: Chain, now: float) -> list[Effect]:
        if overlapped(job):
            return self._work_overlapped(job, chain, now)
        rnd, base = chain.round, chain.head
        out = self._cancel_training((job.id, rnd))
        if (self._work.job, self._work.round, self._work.base) != (job.id, rnd, base):
            self._new_work(job, rnd, base)
        _contribs, cover, done = self._round_contribs(job, rnd, base)
        if cover is not None:
            return out + self._cancel_training(None) + self._maybe_close(job, rnd, base, cover, now)
        return out + self._round_train(job, rnd, base, done, now)[0]

    def _work_overlapped(self, job: Record, chain: Chain, now: float) -> list[Effect]:
        """Overlap: round r trains on the base of round r-1, so once this peer has nothing
        left to do in round r (the chain's round) it trains round r+1 on the chain's head
        while round r's deltas travel and its close is made. A peer holds unpublished work
        of one round at a time (the driver keeps one local model); round r comes first
        whenever it has work (a requeued shard), since round r+1 cannot close before it."""
        rnd, head = chain.round, chain.head
        tbase = train_base(job, chain, rnd)
        has_next = rnd + 1 < job["rounds"]
        w = self._work
        on_next = has_next and (w.job, w.round, w.base) == (job.id, rnd + 1, head)
        if not on_next and (w.job, w.round, w.base) != (job.id, rnd, tbase):
            self._new_work(job, rnd, tbase)
        out = self._cancel_training((job.id, rnd + 1 if on_next else rnd))
        _contribs, cover, done = self._round_contribs(job, rnd, tbase)
        if cover is not None:
            out += self._maybe_close(job, rnd, head, cover, now)
        busy = self._training is not None or self._publishing is not None or bool(self._work.shards)
        if on_next and busy:
            return out + self._round_train(job, rnd + 1, head, self._round_contribs(job, rnd + 1, head)[2], now)[0]
        if not on_next and busy and cover is None:
            return out + self._round_train(job, rnd, tbase, done, now)[0]
        if not on_next and busy:
            # Round r is covered: what this peer still trains or holds of it is not needed.
            out += self._cancel_training(None)
            if self._training is not None or self._publishing is not None:
                return out  # wait for the driver to report back
            self._new_work(job, rnd, tbase)
        # Free: round r first (if this peer holds its training base), then round r+1.
        if cover is None and tbase in self.held:
            if self._work.round != rnd:
                self._new_work(job, rnd, tbase)
            effects, idle = self._round_train(job, rnd, tbase, done, now)
            if not idle or not has_next:
                return out + effects
            out += effects
        if not has_next:
            return out
        if (self._work.round, self._work.base) != (rnd + 1, head):
            self._new_work(job, rnd + 1, head)
        return out + self._round_train(job, rnd + 1, head, self._round_contribs(job, rnd + 1, head)[2], now)[0]

    def _new_work(self, job: Record, rnd: int, base: str) -> None:
        """Start this peer's work on round ``rnd`` (trained on ``base``); forget leases and
        releases of rounds before the chain's (they no longer matter)."""
        older = self._work.job != job.id or self._work.round < rnd
        self._work = _RoundWork(job.id, rnd, base)
        if not older:
            return
        current = self._chain(job).round
        for table in (self._claims, self._covered_at, self._lease_heap):
            for key in [k for k in table if k[0] == job.id and k[1] < current]:
                del table[key]
        self._released = {k for k in self._released if not (k[0] == job.id and k[1] < current)}

    def _round_train(self, job: Record, rnd: int, base: str, done: set[int], now: float) -> tuple[list[Effect], bool]:
        """Train in round ``rnd`` (this peer's ``_work``): renew or stop the shard in
        training, else claim the next shard (or back a straggler up), else publish what
        was trained. Returns the effects and whether there was nothing to do at all."""
        out: list[Effect] = []
        if self._uploading:  # shards whose delta is on its way count as done for this peer
            done = done | {s for j, r, s in self._uploading if (j, r) == (job.id, rnd)}
        t = self._training
        if t is not None:
            # A backup copy stops only when the shard is covered; an owner's claim also
            # when another claim wins the shard (a higher attempt, or a lower node id).
            lost = not t.backup and self._owner(job, rnd, t.shard, now) != self.me
            if not t.cancelled and (t.shard in done or lost):
                out += self._cancel_training(None)
            elif not t.cancelled and now >= t.renewed_at + job["lease"] / 3:
                t.n += 1
                t.renewed_at = now
                out += self._claim(job, rnd, t, now)
            return out, False
        if self._publishing is not None or self._stopping or now < self._retry_at:
            return out, False
        if self.records.highest_closed_round(job.id) >= rnd:
            # Some branch is longer than ours: we are catching up (just joined, restarted,
            # or missing contributions a close names). Training this round would be wasted.
            return out, not self._work.shards
        if job["mode"] == "ensemble" and self._work.shards:
            # Ensemble: a shard is a member and its contribution is the member's checkpoint,
            # published after every unit, so whoever trains the member next continues it.
            self._publishing = (job.id, rnd, tuple(self._work.shards))
            out.append(PublishDelta(job, rnd, base, tuple(self._work.shards), self._work.samples))
            return out, False
        shard = self._pick_shard(job, rnd, done, now)
        backup = False
        if shard is None and not self._work.shards and job["steal"]:
            shard, backup = self._pick_straggler(job, rnd, done, now), True
        if shard is not None:
            attempt = self._next_attempt(job, rnd, shard) - (1 if backup else 0)
            self._training = _Training(job.id, rnd, shard, attempt, 0, now, backup=backup, rate=self.rate)
            out += self._claim(job, rnd, self._training, now)
            out.append(Train(job, rnd, shard, attempt, base, fresh=not self._work.shards))
        elif self._work.shards:
            self._publishing = (job.id, rnd, tuple(sorted(self._work.shards)))
            out.append(PublishDelta(job, rnd, base, tuple(sorted(self._work.shards)), self._work.samples))
        else:
            return out, True
        return out, False

    def _round_contribs(self, job: Record, rnd: int, base: str) -> tuple[list[Record], list[Record] | None, set[int]]:
        """The round's contributions, its cover and the shards covered. ``_step`` runs on
        every batch of messages; these change only when a contribution arrives or the
        members change, so they are kept until then."""
        members = self.records.members
        key = (base, len(self.records.in_round_all(job.id, "contrib", rnd)))
        memo = self._contrib_memo.get((job.id, rnd))
        if memo is None or memo[0] != key or memo[1] is not members:
            if len(self._contrib_memo) > 8:
                self._contrib_memo.clear()
            contribs = contributions(self.records, job, rnd, base)
            memo = self._contrib_memo[(job.id, rnd)] = (
                key, members, contribs, select_cover(job, contribs), covered(contribs))
        return memo[2], memo[3], memo[4]

    def _claim(self, job: Record, rnd: int, t: _Training, now: float) -> list[Effect]:
        return self._sign_local("claim", {
            "job": job.id, "round": rnd, "shard": t.shard, "attempt": t.attempt, "n": t.n,
            "done": t.done, "rate": round(t.rate, 3), "backup": t.backup,
        }, now)

    def _pick_straggler(self, job: Record, rnd: int, done: set[int], now: float) -> int | None:
        """Stealing: the shard projected to finish last, if this peer, starting now,
        would finish a copy of it clearly sooner. At most one backup per shard."""
        if self.rate <= 0:
            return None  # no measurement of our own speed yet: no basis to compare
        mine = now + job["batches"] / self.rate
        best: tuple[float, int] | None = None
        for s in range(job["shards"]):
            if s in done:
                continue
            live = self._live(job, rnd, s, now)
            if not live or any(c.backup for _, c in live):
                continue
            # A claimer whose speed is unknown is assumed as fast as we are: no steal.
            finish = min(c.projected_finish(job["batches"], self.rate) for _, c in live)
            if best is None or finish > best[0]:
                best = (finish, s)
        if best is None or mine * 1.0 + 0.1 * (mine - now) >= best[0]:
            return None
        return best[1]

    def _live(self, job: Record, rnd: int, shard: int, now: float) -> list[tuple[tuple[int, str], _Claim]]:
        """Live claims on a shard as ((attempt, author), claim); ours only while we train it."""
        lease = job["lease"]
        live = []
        for (author, attempt), claim in self._claims.get((job.id, rnd, shard), {}).items():
            if author == self.me:
                t = self._training
                if t is not None and not t.cancelled and (t.job, t.round, t.shard, t.attempt) == (
                    job.id, rnd, shard, attempt
                ):
                    live.append(((attempt, author), claim))
            elif now < claim.seen + lease and author in self.records.members:
                live.append(((attempt, author), claim))
        return live

    def _owner(self, job: Record, rnd: int, shard: int, now: float) -> str | None:
        """Who owns a shard: among live non-backup claims, the highest attempt, then the
        lowest node id."""
        owners = [key for key, c in self._live(job, rnd, shard, now) if not c.backup]
        if not owners:
            return None
        return min(owners, key=lambda k: (-k[0], k[1]))[1]

    def _next_attempt(self, job: Record, rnd: int, shard: int) -> int:
        attempts = [att for _author, att in self._claims.get((job.id, rnd, shard), {})]
        attempts += [k[4] for k in self._released if k[:3] == (job.id, rnd, shard)]
        return max(attempts) + 1 if attempts else 0

    def _pick_shard(self, job: Record, rnd: int, done: set[int], now: float) -> int | None:
        free = [
            s for s in range(job["shards"])
            if s not in done and s not in self._work.shards and not self._live(job, rnd, s, now)
        ]
        if not free:
            return None
        # A per-peer order spreads concurrent claimers over different shards.
        return min(free, key=lambda s: hashlib.sha256(f"{self.me}:{rnd}:{s}".encode()).digest())

    def _close_grace(self, job: Record, closer: str | None = None, now: float = 0.0) -> float:
        """How long others wait, from the moment the round is covered, for the designated
        closer before closing themselves: nothing once the closer has been silent for a
        lease (it died: every live peer sends a digest each ``digest_interval``, so others
        close at the latest one lease after its last word), else a lease plus two digests,
        time for a close lost on the way to be resent. Waiting a lease from the cover too
        cost a second lease when the closer died before the round was covered (its own
        later shard requeued: the kill in scripts/bench/straggler)."""
        lease = job["lease"]
        if closer is not None and now - self._heard.get(closer, -float("inf")) >= lease:
            return 0.0
        return lease + 2 * self.timing.digest_interval

    def _maybe_close(
        self, job: Record, rnd: int, base: str, cover: list[Record], now: float
    ) -> list[Effect]:
        key = (job.id, rnd, base)
        first = self._covered_at.setdefault(key, now)
        if self._aggregating is not None or now < self._retry_at:
            return []
        closer = min(c.author for c in cover)
        if closer != self.me and now < first + self._close_grace(job, closer, now):
            return []
        self._aggregating = (job.id, rnd)
        return [Aggregate(job, rnd, base, tuple(cover))]

