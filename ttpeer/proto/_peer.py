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
   shards remain, then publish one contribution for the shards trained;
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
from ._ledger import Chain, RecordSet, canonical_chain, checkpoints, contributions, covered, select_cover
from ._records import Record, parse, sign

RETRY_AFTER = 2.0  # seconds before retrying a failed download or upload
CHECKPOINT_EVERY = 4  # rounds between the checkpoints a round's closer publishes


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
    cancelled: bool = False


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
        self._claim_seen: dict[tuple[str, int, int, str, int], float] = {}
        self._released: set[tuple[str, int, int, str, int]] = set()
        self._stopping = False
        self._covered_at: dict[tuple[str, int, str], float] = {}
        self._training: _Training | None = None
        self._work = _RoundWork()
        self._publishing = False
        self._aggregating: tuple[str, int] | None = None
        self._syncing: str | None = None  # target state of the Apply/Fetch in flight
        self._bad_apply: set[str] = set()  # states our own recomputation did not reproduce
        self._ckpt_done: set[tuple[str, int]] = set()
        self._retry_at: float = 0.0
        self._next_digest = now
        self._digests = 0
        self._chains: dict[str, tuple[int, Chain]] = {}
        self._now = now

    # -- inputs ----------------------------------------------------------------------

    def load(self, raws: list[bytes], now: float) -> None:
        """Restore records from the durable log (no effects: they are already stored)."""
        for raw in raws:
            try:
                self._admit(parse(raw), now)
            except RecordError:
                continue

    def receive(self, sender: str, payload: bytes, now: float) -> list[Effect]:
        """A gossip payload from ``sender``. Malformed payloads are dropped."""
        out: list[Effect] = []
        try:
            kind, value = _gossip.parse_payload(payload)
        except RecordError:
            return out
        if kind == "records":
            for raw in value:
                try:
                    rec = parse(raw)
                except RecordError:
                    continue
                if self._admit(rec, now):
                    out.append(Persist(rec))
        else:
            prefixes, lo, hi = value
            mine = [
                r.raw for r in self.records
                if _gossip.in_window(r.id, lo, hi) and r.id[: _gossip.ID_PREFIX] not in prefixes
            ]
            out += [Send(sender, p) for p in _gossip.records_payloads(mine)]
        return out + self._step(now)

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if now >= self._next_digest:
            self._next_digest = now + self.timing.digest_interval
            self._digests += 1
            out.append(Broadcast(_gossip.digest_payload((r.id for r in self.records), self._digests)))
        return out + self._step(now)

    def next_deadline(self) -> float:
        """The next time ``tick`` has something to do."""
        deadlines = [self._next_digest] + [d for d in self._deadlines() if d > self._now]
        return min(deadlines)

    def _deadlines(self) -> list[float]:
        deadlines: list[float] = []
        job = self._active_job()
        if job is not None:
            lease = job["lease"]
            chain = self._chain(job)
            for (jid, rnd, _shard, author, _att), seen in self._claim_seen.items():
                if jid == job.id and rnd == chain.round and author != self.me:
                    deadlines.append(seen + lease)
            if self._training is not None and not self._training.cancelled:
                deadlines.append(self._training.renewed_at + lease / 3)
            for (jid, rnd, _base), at in self._covered_at.items():
                if jid == job.id and rnd == chain.round:
                    deadlines.append(at + lease)
            deadlines.append(self._retry_at)
        return deadlines

    def add_local(self, rec: Record, now: float) -> list[Effect]:
        """A record made on this machine outside the machine (a job, an invite)."""
        if not self._admit(rec, now):
            return []
        return [Persist(rec), *self._gossip_out(rec)] + self._step(now)

    # -- reports from the driver ------------------------------------------------------

    def job_prepared(self, job: str, ok: bool, reason: str, now: float) -> list[Effect]:
        self._prepared[job] = ok
        if not ok:
            self.declined[job] = reason
        return self._step(now)

    def holds(self, state: str, now: float) -> list[Effect]:
        """The driver holds ``state`` (restored from disk, or given by a test)."""
        self.held.add(state)
        return self._step(now)

    def train_done(self, job: str, rnd: int, shard: int, samples: int, now: float) -> list[Effect]:
        t = self._training
        self._training = None
        if t is not None and (t.job, t.round, t.shard) == (job, rnd, shard) and samples > 0:
            if (self._work.job, self._work.round) == (job, rnd) and not t.cancelled:
                self._work.shards.append(shard)
                self._work.samples += samples
        return self._step(now)

    def delta_published(
        self, job: Record, rnd: int, base: str, shards: tuple[int, ...], samples: int,
        blob: str | None, size: int, metrics: dict[str, float], now: float,
    ) -> list[Effect]:
        self._publishing = False
        if blob is None:
            self._retry_at = now + RETRY_AFTER
            return self._step(now)
        if (self._work.job, self._work.round, self._work.base) == (job.id, rnd, base):
            self._work.shards, self._work.samples = [], 0
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
        rec = sign("close", self.pool, {
            "job": job.id, "round": rnd, "base": base, "contribs": sorted(contribs),
            "state": state, "metrics": metrics,
        }, self._key)
        out = self.add_local(rec, now)
        # A checkpoint every few rounds (and of the final state) lets late joiners and
        # repairing peers skip ahead; between them they replay the closes' deltas.
        due = (rnd + 1) % CHECKPOINT_EVERY == 0 or rnd + 1 == job["rounds"]
        if due and (job.id, rnd + 1) not in self._ckpt_done:
            self._ckpt_done.add((job.id, rnd + 1))
            out.append(PublishCheckpoint(job, rnd + 1, state))
        return out

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
        if rec.kind in ("claim", "release"):
            key = (rec["job"], rec["round"], rec["shard"], rec.author, rec["attempt"])
            if rec.kind == "release":
                self._released.add(key)
                self._claim_seen.pop(key, None)
            elif key not in self._released:
                self._claim_seen[key] = max(self._claim_seen.get(key, now), now)
        return True

    def _gossip_out(self, rec: Record) -> list[Effect]:
        return [Broadcast(p) for p in _gossip.records_payloads([rec.raw])]

    def _sign_local(self, kind: str, body: dict, now: float) -> list[Effect]:
        rec = sign(kind, self.pool, body, self._key)
        self._admit(rec, now)
        return [Persist(rec), *self._gossip_out(rec)]

    def _chain(self, job: Record) -> Chain:
        cached = self._chains.get(job.id)
        if cached is None or cached[0] != len(self.records):
            cached = (len(self.records), canonical_chain(self.records, job))
            self._chains[job.id] = cached
        return cached[1]

    def _active_job(self) -> Record | None:
        for job in self.records.jobs():
            if self._prepared.get(job.id) is False:
                continue
            # A finished job becomes active again if the chain moved away from the state
            # it finished on (it ended on the losing side of a partition): repair it.
            if job.id in self.done_jobs and self.done_jobs[job.id] == self._chain(job).head:
                continue
            return job
        return None

    def _step(self, now: float) -> list[Effect]:
        self._now = max(self._now, now)
        job = self._active_job()
        if job is None:
            return []
        if job.id not in self._prepared:
            self._prepared[job.id] = None
            return [PrepareJob(job)]
        if self._prepared[job.id] is None:
            return []
        chain = self._chain(job)
        if chain.head not in self.held:
            return self._cancel_training(None) + self._sync(job, chain, now)
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
        rnd, base = chain.round, chain.head
        out = self._cancel_training((job.id, rnd))
        if (self._work.job, self._work.round, self._work.base) != (job.id, rnd, base):
            self._work = _RoundWork(job.id, rnd, base)
            for key in [k for k in self._claim_seen if k[0] == job.id and k[1] < rnd]:
                del self._claim_seen[key]  # leases of closed rounds no longer matter
            self._released = {k for k in self._released if not (k[0] == job.id and k[1] < rnd)}
        contribs = contributions(self.records, job, rnd, base)
        cover = select_cover(job, contribs)
        if cover is not None:
            return out + self._cancel_training(None) + self._maybe_close(job, rnd, base, cover, now)
        done = covered(contribs)
        t = self._training
        if t is not None:
            if not t.cancelled and (t.shard in done or self._owner(job, rnd, t.shard, now) != self.me):
                out += self._cancel_training(None)
            elif not t.cancelled and now >= t.renewed_at + job["lease"] / 3:
                t.n += 1
                t.renewed_at = now
                out += self._sign_local("claim", {
                    "job": job.id, "round": rnd, "shard": t.shard, "attempt": t.attempt, "n": t.n,
                }, now)
            return out
        if self._publishing or self._stopping or now < self._retry_at:
            return out
        shard = self._pick_shard(job, rnd, done, now)
        if shard is not None:
            attempt = self._next_attempt(job, rnd, shard)
            self._training = _Training(job.id, rnd, shard, attempt, 0, now)
            out += self._sign_local("claim", {
                "job": job.id, "round": rnd, "shard": shard, "attempt": attempt, "n": 0,
            }, now)
            out.append(Train(job, rnd, shard, attempt, base, fresh=not self._work.shards))
        elif self._work.shards:
            self._publishing = True
            out.append(PublishDelta(job, rnd, base, tuple(sorted(self._work.shards)), self._work.samples))
        return out

    def _live_claims(self, job: Record, rnd: int, shard: int, now: float) -> list[tuple[int, str]]:
        lease = job["lease"]
        live = []
        for (jid, r, s, author, attempt), seen in self._claim_seen.items():
            if (jid, r, s) != (job.id, rnd, shard):
                continue
            if author == self.me:
                t = self._training
                if t is not None and (t.job, t.round, t.shard, t.attempt) == (jid, r, s, attempt):
                    live.append((attempt, author))
            elif now < seen + lease and author in self.records.members:
                live.append((attempt, author))
        return live

    def _owner(self, job: Record, rnd: int, shard: int, now: float) -> str | None:
        live = self._live_claims(job, rnd, shard, now)
        if not live:
            return None
        return min(live, key=lambda c: (-c[0], c[1]))[1]

    def _next_attempt(self, job: Record, rnd: int, shard: int) -> int:
        attempts = [k[4] for k in (*self._claim_seen, *self._released) if k[:3] == (job.id, rnd, shard)]
        return max(attempts) + 1 if attempts else 0

    def _pick_shard(self, job: Record, rnd: int, done: set[int], now: float) -> int | None:
        free = [
            s for s in range(job["shards"])
            if s not in done and s not in self._work.shards and self._owner(job, rnd, s, now) is None
        ]
        if not free:
            return None
        # A per-peer order spreads concurrent claimers over different shards.
        return min(free, key=lambda s: hashlib.sha256(f"{self.me}:{rnd}:{s}".encode()).digest())

    def _maybe_close(
        self, job: Record, rnd: int, base: str, cover: list[Record], now: float
    ) -> list[Effect]:
        key = (job.id, rnd, base)
        first = self._covered_at.setdefault(key, now)
        if self._aggregating is not None or now < self._retry_at:
            return []
        closer = min(c.author for c in cover)
        if closer != self.me and now < first + job["lease"]:
            return []
        self._aggregating = (job.id, rnd)
        return [Aggregate(job, rnd, base, tuple(cover))]

