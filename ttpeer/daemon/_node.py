"""The daemon: one trio nursery that drives a ``PeerMachine`` with real I/O.

Theory of operation. The machine decides; the node executes. Every call into the
machine happens on the trio thread, and its effects are handled at once: cheap
ones inline (persist a record, queue a message), long ones (train, upload,
aggregate, download) as tasks in the node's nursery that report back into the
machine when done. A tick task wakes at the machine's next deadline. Three tasks
talk to the relay: the receiver (long-poll, cursor acknowledgement), the outbox
(sends with retry) and the hello loop (until this peer holds the pool key).

Envelopes on the wire (the relay sees the first byte, sizes and timing only):

    H + canonical {"proof": [invite, join]}      a member announcing itself (public)
    K + direct-sealed key handover               every epoch's pool key, sealed to one member
    L + direct-sealed {"to", "records"}          to a node that is no member: the signed records
                                                 that show it (its revocation, or the joins that
                                                 took its invite's last use)
    P + pool-sealed (counter + gossip payload)   records and digests; the sender's id is
                                                 bound in as associated data, the counter
                                                 feeds the receiver's replay window (_replay)

Pool key epochs. ``ttpeer revoke`` rotates the pool key: the admin makes a new
key, hands the whole list (oldest first) to each remaining member, and seals
from then on with the newest. Everyone opens with any key it holds (so blobs of
old epochs stay readable) and seals with the newest. A revoked node never gets
the new key, so it cannot open what is sealed after the rotation.

A membership that ends (this node revoked, or its join lost the race for a single-use
invite) ends the daemon at once: as soon as the records that show it are held (through
gossip, another joiner's hello, or an L reply to our own hello), the node logs why,
marks the home (``Home.mark_ended``) and stops with ``MembershipEnded`` (exit 3).

Losing the relay is this peer's problem, not the pool's: the node retries with
backoff and keeps training what it has claimed; leases judge liveness, not the
relay connection.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio
from cryptography.exceptions import InvalidSignature

from ttpeer._trim import trim
from ttpeer.errors import (
    DiskError,
    LocalWorkLost,
    StateMissing,
    TaskFailed,
    TtpeerError,
)
from ttpeer.net import NetError, RelayRejected, Transport
from ttpeer.net._seal import (
    COUNTER,
    SealError,
    gossip_ad,
)
from ttpeer.proto import (
    Aggregate,
    Aggregated,
    Applied,
    Apply,
    Broadcast,
    Cancel,
    CheckpointPublished,
    Declined,
    DeltaEncoded,
    DeltaPublished,
    Effect,
    Failed,
    Fetched,
    FetchState,
    JobDone,
    JobFailed,
    PeerMachine,
    Persist,
    Prepared,
    PrepareJob,
    Progress,
    ProofError,
    PublishCheckpoint,
    PublishDelta,
    Record,
    RecordError,
    Send,
    StateLost,
    TaskSignatureError,
    Timing,
    Train,
    Trained,
    WorkLost,
    job_ended,
    open_task,
)

from . import _admin
from ._counters import Counters, JobStats
from ._executor import Decline, Executor
from ._home import Home, PoolConfig
from ._keys import BLOB as BLOB
from ._keys import GOSSIP, Blobs, PoolKeys
from ._link import Link, revoked_by_relay
from ._membership import EXPIRY_GRACE as EXPIRY_GRACE
from ._membership import Membership
from ._recordlog import RecordLog
from ._replay import ReplayGuard

log = logging.getLogger("ttpeer.daemon")

SUSPECT_BEATS = 3  # heartbeats missed before a peer is suspected
DEAD_BEATS = 8  # ... and before it is reported dead (leases, not this, requeue its work)


@dataclass
class _Progress:
    """Batches done in the shard in training: written by the training thread (one int),
    read on the trio thread, where the times are taken: no lock for a progress hint."""

    started: float  # trio time
    done: int = 0

    def stopper(self, cancelled: Callable[[], bool]) -> Callable[[], bool]:
        calls = 0

        def should_stop() -> bool:  # asked before every batch
            nonlocal calls
            self.done = max(0, calls)
            calls += 1
            return cancelled()

        return should_stop

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if self.done and elapsed > 0 else 0.0


class Node:
    def __init__(
        self,
        home: Home,
        transport: Transport,
        executor: Executor,
        *,
        timing: Timing = Timing(),
        seed: int | None = None,
        durable: bool = True,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.home = home
        self.cfg: PoolConfig = home.config()
        self.transport = transport
        self.executor = executor
        self._key = home.node_key()
        self._seal_key = home.seal_key()
        self.keys = PoolKeys(home)
        self.counters = Counters()
        self._rng = random.Random(seed)
        self._wake = trio.Event()
        self.link = Link(transport, self.counters, self._rng, lambda: self._wake.set())
        self.machine = PeerMachine(self.cfg.pool, self._key, now=self._now(), timing=timing)
        self.me = self.machine.me
        self.log = RecordLog(home.records_log, fsync=durable)
        self.replay = ReplayGuard(home.path, durable=durable)
        self.blobs = Blobs(self.keys, transport, home, self.counters.reject)
        self._wall = wall  # calendar time, only for the `at` of jobs this node submits
        self._outbox_send, self._outbox_recv = self.link.outbox_send, self.link.outbox_recv
        self._cancelled: set[tuple[str, int, int]] = set()
        self._progress: dict[tuple[str, int, int], _Progress] = {}
        self._nursery: trio.Nursery | None = None
        self._job_done: dict[str, trio.Event] = {}
        self._released: set[str] = set()  # jobs whose executor state was freed (ended here)
        self.finished: dict[str, str] = {}  # job -> the state whose final files this peer wrote
        # job -> what this peer is doing before it can train it ("loading the task"...), for status
        self.phases: dict[str, str] = {}
        self._key_event = trio.Event()
        self.fatal: TtpeerError | None = None
        self._is_admin = (home.path / "root.key").exists()
        self.membership = Membership(self)
        if self.pool_key is not None:
            self._key_event.set()

    @property
    def pool_keys(self) -> list[bytes]:
        """Every pool key epoch held here, oldest first; the last one seals."""
        return self.keys.keys

    @property
    def pool_key(self) -> bytes | None:
        return self.keys.newest

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled. Raises the first fatal error (a relay that is not ours,
        a membership the relay refuses, a full disk)."""
        now = self._now()
        self.counters.started = trio.current_time()
        logged = self.log.load()
        for raw in self.cfg.proof:
            if raw not in logged:
                self.log.append(raw)
        self.machine.load(logged + self.cfg.proof, now)
        self.membership.loaded()
        for job in self.machine.records.jobs():
            for state in self.executor.held_states(job):
                self.machine.held.add(state)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._connect()
            nursery.start_soon(self.link.receiver, self._on_message, self._settle, self._revoked_by_relay)
            nursery.start_soon(self.link.outbox)
            nursery.start_soon(self.membership.hello_loop)
            nursery.start_soon(self._ticker)
            task_status.started()

    def stop(self) -> None:
        self.replay.maybe_save(0.0, force=True)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _connect(self) -> None:
        try:
            await self.link.connect()
        except RelayRejected as exc:
            if revoked_by_relay(exc):
                self.membership.end("revoked", mark=False)
                raise self.fatal from None  # type: ignore[misc]
            raise
        await self._repeat_revocations()

    def _revoked_by_relay(self) -> None:
        self.membership.end("revoked", mark=False)

    async def _repeat_revocations(self) -> None:
        """Hand the relay every revocation we hold: a relay that lost its disk relearns
        them from the first peer that starts. Root-signed, so anyone may carry them."""
        for rec in [r for r in self.machine.records if r.kind == "revoke"]:
            try:
                await self.transport.revoke(rec.raw)
            except NetError as exc:
                log.warning("the relay did not take a revocation: %s", exc)

    # -- time and liveness -----------------------------------------------------------

    def _now(self) -> float:
        """Protocol time: it stands still while we are cut off from the relay (``_link``)."""
        return self.link.now()

    def liveness(self, peer: str) -> str:
        """"alive", "suspect" or "dead", from when we last heard from ``peer`` (every peer
        broadcasts a digest each ``digest_interval``: that is its heartbeat)."""
        seen = self.counters.peers_seen.get(peer)
        if peer == self.me:
            return "alive"
        if seen is None:
            return "unknown"
        silent = self.link.trio_now() - seen
        beat = self.machine.timing.digest_interval
        return "alive" if silent <= SUSPECT_BEATS * beat else "suspect" if silent <= DEAD_BEATS * beat else "dead"

    # -- submitting --------------------------------------------------------------------

    async def submit(self, spec: dict[str, Any], task_file: bytes | None) -> Record:
        """Make, seal and publish a new job from ``spec``. ``shards`` or ``lease`` left
        out (None) default from the speeds peers have published. Raises ``TtpeerError``."""
        return await _admin.submit(self, spec, task_file)

    def done_event(self, job: str) -> trio.Event:
        return self._job_done.setdefault(job, trio.Event())

    # -- effects: one handler per effect type -------------------------------------------

    def _process(self, effects: list[Effect], *, wake: bool = True) -> None:
        """Execute effects; ``wake`` the ticker, since the next deadline may have moved."""
        for eff in effects:
            try:
                self._execute(eff)
            except DiskError as exc:
                self._disk_full(exc)
                return
        if wake:
            self._wake.set()

    def _execute(self, eff: Effect) -> None:
        """Cheap effects run here and now; long ones (``_TASKS``) as tasks in the nursery,
        inside ``_guarded``, that report back into the machine when done."""
        assert self._nursery is not None, "effects run only inside Node.run"
        if log.isEnabledFor(logging.DEBUG) and not isinstance(eff, (Broadcast, Send, Persist)):
            log.debug("effect %s", _describe(eff))
        inline = _INLINE.get(type(eff))
        if inline is not None:
            inline(self, eff)
        elif type(eff) in _TASKS:
            self._nursery.start_soon(self._guarded, eff)
        else:
            raise TypeError(f"unknown effect {eff!r}")

    async def _guarded(self, eff: Effect) -> None:
        """Run ``eff``'s handler; the one place its errors are judged. A full disk stops the
        daemon (retrying would only fail again); the task's own failure ends the job here;
        an error of the tree is reported (``Failed``, after ``StateLost``/``WorkLost`` when
        that is what it says), so the machine retries; anything else is a bug that costs
        the job, not the daemon."""
        try:
            await _TASKS[type(eff)](self, eff)
        except DiskError as exc:
            self._disk_full(exc)
        except TaskFailed as exc:
            self._task_failed(_job_of(eff), exc.reason)
        except (NetError, SealError, TtpeerError) as exc:
            log.warning("%s failed: %s", type(eff).__name__, exc)
            if isinstance(exc, StateMissing):  # so the machine recomputes or fetches it
                self._report(StateLost(exc.state))
            if isinstance(exc, LocalWorkLost):  # so the machine trains those shards again
                self._report(WorkLost(exc.job))
            self._report(Failed(eff))
        except Exception as exc:  # noqa: BLE001 - the last resort: a bug fails the job, not the daemon
            self._bug(_job_of(eff), type(eff).__name__, exc)

    def _report(self, result: Any) -> None:
        self._process(self.machine.report(result, self._now()))

    def _disk_full(self, exc: DiskError) -> None:
        self.fatal = exc
        log.error("%s", exc)
        self.stop()

    def _queue(self, peer: str | None, payload: bytes) -> None:
        if self.pool_key is None:
            return  # not a full member yet: gossip will resend once we are
        counter = self.replay.next_counter().to_bytes(COUNTER, "big")
        sealed = self.keys.seal(gossip_ad(GOSSIP, self.me), counter + payload)
        try:
            self._outbox_send.send_nowait((peer, b"P" + sealed))
        except trio.WouldBlock:
            log.warning("outbox full; dropping a gossip payload (anti-entropy resends it)")

    def _on_cancel(self, eff: Cancel) -> None:
        self._cancelled.add((eff.job, eff.round, eff.shard))

    def _on_job_done(self, eff: JobDone) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._finish, eff.job, eff.state)

    async def _prepare(self, eff: PrepareJob) -> None:
        job = eff.job
        try:
            with self._phase(job.id, "fetching the task file"):
                task_file = (open_task(self.cfg.pool, await self.blobs.get(job["task_blob"]))
                             if job["task_blob"] else None)
        except TaskSignatureError as exc:
            log.warning("refusing job %s: %s", job.id[:12], exc)
            self._report(Declined(job.id, str(exc), code="refused"))
            return
        with self._phase(job.id, "loading the task and its data, checking it fits"):
            decline = await self.executor.prepare(job, task_file)
        if isinstance(decline, str):
            decline = Decline(decline)
        if decline is not None:
            log.warning("declining job %s: %s", job.id[:12], decline.reason)
            self._report(Declined(job.id, decline.reason, decline.need, decline.have, decline.code))
        else:
            self._report(Prepared(job.id))

    async def _train(self, eff: Train) -> None:
        job, key = eff.job, (eff.job.id, eff.round, eff.shard)
        self._cancelled.discard(key)
        started = trio.current_time()
        progress = self._progress[key] = _Progress(started)
        try:
            samples = await self.executor.train(eff, progress.stopper(lambda: key in self._cancelled))
        finally:
            self._progress.pop(key, None)
            self._cancelled.discard(key)
        seconds = trio.current_time() - started
        stats = self._stats(job.id)
        stats.shards_trained += 1 if samples else 0
        stats.train_seconds += seconds
        batches = samples // job["batch_size"]
        self._report(Trained(job.id, eff.round, eff.shard, samples, batches, seconds))

    async def _publish_delta(self, eff: PublishDelta) -> None:
        job, rnd, base, shards = eff.job, eff.round, eff.base, eff.shards
        data, metrics = await self.executor.delta(eff)
        # The local model is free: the next shard trains while this delta uploads.
        self._report(DeltaEncoded(job, rnd, base, shards))
        blob = await self.blobs.upload_delta(data)
        if blob is None:
            self._report(Failed(eff))
            return
        stats = self._stats(job.id)
        stats.fp32_bytes += int(metrics.pop("fp32_bytes", 0))
        stats.wire_bytes += len(data)
        self._report(DeltaPublished(job, rnd, base, shards, eff.samples, blob, len(data), metrics))

    async def _aggregate(self, eff: Aggregate) -> None:
        async with self.blobs.deltas(eff.job, eff.contribs) as deltas:
            state, metrics = await self.executor.aggregate(eff.job, eff.base, deltas, rnd=eff.round)
        trim()  # the blobs this close fetched: back to the system
        ids = tuple(c.id for c in eff.contribs)
        self._report(Aggregated(eff.job, eff.round, eff.base, ids, state, metrics))

    async def _apply(self, eff: Apply) -> None:
        job, close = eff.job, eff.close
        async with self.blobs.deltas(job, eff.contribs) as deltas:
            ok = await self.executor.apply(job, close["base"], deltas, close["state"], rnd=close["round"])
        trim()
        if not ok:
            log.warning("round %d of job %s did not reproduce state %s here; fetching a checkpoint instead",
                        close["round"], job.id[:12], close["state"][:19])
        self._report(Applied(close["state"], ok))

    async def _fetch_state(self, eff: FetchState) -> None:
        job, state = eff.job, eff.state
        what = "the initial state" if state == job["init"] else "the latest checkpoint"
        with self._phase(job.id, f"fetching {what}"), self.blobs.work_files(job.id, "fetch") as (sealed, plain):
            await self.blobs.get_file(eff.blob, sealed, plain)
            ok = await self.executor.import_state(job, state, plain)
        self._report(Fetched(state, ok))

    async def _publish_checkpoint(self, eff: PublishCheckpoint) -> None:
        # File to file, a piece at a time: a model-sized state is never in the daemon's
        # memory (it was, three times over: bytes, sealed, in transport).
        with self.blobs.work_files(eff.job.id, "checkpoint") as (plain, sealed):
            await self.executor.export_state(eff.job, eff.state, plain)
            size = plain.stat().st_size
            blob = await self.blobs.put_file(plain, sealed)
        self._report(CheckpointPublished(eff.job, eff.round, eff.state, blob, size))

    def _task_failed(self, job: Record, reason: str) -> None:
        log.error("job %s failed on this peer: %s", job.id[:12], reason)
        self._process(self.machine.report(JobFailed(job.id, reason), self._now()))
        self._release(job.id)

    def _release(self, job: str) -> None:
        """The job ended here: the executor frees its model and worker processes."""
        if job not in self._released and self._nursery is not None:
            self._released.add(job)
            self._nursery.start_soon(self.executor.release, job)

    def _release_ended(self) -> None:
        """Jobs the pool ended (cancelled, failed everywhere) hold nothing here any more."""
        rs = self.machine.records
        for job in rs.jobs():
            if job.id not in self._released and job_ended(rs, job) is not None:
                self._release(job.id)

    def _bug(self, job: Record, what: str, exc: Exception) -> None:
        """An exception outside the error tree escaped ``what``: log its traceback once and
        end the job on this peer, so a bug costs one job, never the daemon."""
        log.error("%s of job %s raised %s: a bug in ttpeer or an executor; the job ends on this peer "
                  "(please report this traceback)", what, job.id[:12], type(exc).__name__, exc_info=exc)
        self._task_failed(job, f"internal error: {type(exc).__name__}: {exc} (a bug; see this peer's log)")

    @contextlib.contextmanager
    def _phase(self, job: str, what: str) -> Iterator[None]:
        """Say in status what this peer is doing for ``job`` before it can train it."""
        self.phases[job] = what
        try:
            yield
        finally:
            if self.phases.get(job) == what:
                del self.phases[job]

    async def _finish(self, job: Record, state: str) -> None:
        try:
            await self._write_final(job, state)
        except DiskError as exc:
            self._disk_full(exc)
        except TaskFailed as exc:
            self._task_failed(job, exc.reason)
        except Exception as exc:  # noqa: BLE001 - as in _guarded: the job, not the daemon
            self._bug(job, "writing the final model", exc)

    async def _write_final(self, job: Record, state: str) -> None:
        chain = self.machine.chain(job)
        metrics = dict(chain.closes[-1]["metrics"]) if chain.closes else {}
        stats = self._stats(job.id)
        summary = {"job": job.id, "task": job["task"], "state": state, "rounds": chain.round,
                   "eval": metrics, "compression_ratio": stats.ratio(),
                   "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}
        await self.executor.finish(job, state, summary)
        self.finished[job.id] = state  # status says "done" from here: the final files exist
        self.done_event(job.id).set()
        log.info("job %s done: state %s", job.id[:12], state)

    async def _put_sealed(self, data: bytes) -> str:
        return await self.blobs.put(data)

    async def _get_sealed(self, blob: str) -> bytes:
        return await self.blobs.get(blob)

    # -- network tasks -------------------------------------------------------------------

    async def _ticker(self) -> None:
        """Tick the machine at its next deadline. A wake-up (new input, so perhaps a new
        deadline) only recomputes the deadline: inputs already ran the machine."""
        while True:
            deadline = self.machine.next_deadline()
            with trio.move_on_at(self.link.to_trio(deadline)) as timer:
                await self._wake.wait()
            self._wake = trio.Event()
            if not timer.cancelled_caught:
                continue
            for (job, rnd, shard), p in list(self._progress.items()):
                self.machine.report(Progress(job, rnd, shard, p.done, p.rate(trio.current_time())), self._now())
            # Protocol time is trio time less the outages: the subtraction can land a hair
            # before the deadline that just fired, which must not leave it unfired.
            self._process(self.machine.tick(max(self._now(), deadline)), wake=False)

    def _settle(self) -> None:
        """After a batch of messages: one decision for the whole batch, not one per message."""
        self._process(self.machine.settle(self._now()))
        self.membership.check_lost_races()
        self._release_ended()
        self.membership.check_standing()
        self.replay.maybe_save(trio.current_time())

    def _on_message(self, sender: str, data: bytes) -> None:
        kind, body = data[:1], data[1:]
        try:
            if kind == b"P" and self.pool_key is not None:
                plain = self.keys.open(gossip_ad(GOSSIP, sender), body)
                if len(plain) < COUNTER or not self.replay.accept(sender, int.from_bytes(plain[:COUNTER], "big")):
                    log.debug("dropped a replayed or stale message from %s", sender[:12])
                    return
                self._process(self.machine.receive(sender, plain[COUNTER:], self._now(), settle=False), wake=False)
            elif kind == b"P":
                return  # no key yet: the hello loop is asking for it
            elif kind == b"H":
                self.membership.on_hello(sender, body)
            elif kind == b"K":
                self.membership.on_key(body)
            elif kind == b"L":
                self.membership.on_ended(body)
            else:
                self.counters.reject("message: unknown kind")
        except SealError as exc:
            self.counters.reject("message: SealError")
            log.debug("dropped a message from %s: %s", sender[:12], exc)
            if kind == b"P":
                self.membership.rehello()
        except (RecordError, ProofError, InvalidSignature, ValueError, TypeError, KeyError) as exc:
            # InvalidSignature: a key handover the relay (or anyone) forged; uncaught it
            # would end the receiver, and so the daemon, of every peer still joining.
            self.counters.reject(f"message: {type(exc).__name__}")
            log.debug("dropped a message from %s: %s", sender[:12], exc)

    # -- revocation (admin) ----------------------------------------------------------------

    async def revoke(self, peer: str) -> Record:
        """Revoke ``peer``: sign a ``revoke`` record with the root key, rotate the pool key
        to the remaining members, and tell the relay to refuse the peer's sessions.
        Raises ``TtpeerError`` (not the admin, unknown peer, too much to keep)."""
        return await _admin.revoke(self, peer)

    # -- cancelling ---------------------------------------------------------------------

    def find_job(self, prefix: str) -> Record:
        """The job whose id starts with ``prefix``. Raises ``JobError``/``UsageError``."""
        return _admin.find_job(self, prefix)

    async def cancel(self, prefix: str) -> tuple[Record, Record, bool]:
        """End a job for the whole pool with a signed ``cancel`` record (see ``_admin.cancel``).
        Raises ``JobError``."""
        return await _admin.cancel(self, prefix)

    def require_admin(self) -> None:
        """Raises ``RevokeError`` unless this is the admin."""
        _admin.require_admin(self)

    def resolve_peer(self, text: str) -> tuple[str, str]:
        """(id, name) of a member or revoked node. Raises ``RevokeError``."""
        return _admin.resolve_peer(self, text)

    def _rotate(self) -> None:
        self.membership.rotate()

    # -- status ---------------------------------------------------------------------------

    def _stats(self, job: str) -> JobStats:
        return self.counters.job(job)

    @property
    def bytes_sent(self) -> int:
        return int(getattr(self.transport, "bytes_sent", 0))

    @property
    def bytes_received(self) -> int:
        return int(getattr(self.transport, "bytes_received", 0))

    def status(self) -> dict[str, Any]:
        from ._status import snapshot

        return snapshot(self)


def _job_of(eff: Effect) -> Record:
    """The job of an effect that ``_guarded`` runs (each of them names one)."""
    job = getattr(eff, "job", None)
    if not isinstance(job, Record):
        raise TypeError(f"{type(eff).__name__} names no job")
    return job


def _describe(eff: Effect) -> str:
    """One line per effect for debug logs: its kind and small fields, never payloads."""
    parts = [type(eff).__name__]
    for name, value in vars(eff).items():
        if isinstance(value, bool | int | float):
            parts.append(f"{name}={value}")
        elif isinstance(value, str):
            parts.append(f"{name}={value[:19]}")
        elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            parts.append(f"{name}={list(value)}")
        elif hasattr(value, "id"):
            parts.append(f"{name}={value.id[:12]}")
    return " ".join(parts)


# The handler of each effect: inline ones run at once on the trio thread, task ones in the
# node's nursery under ``Node._guarded`` (their failure path), reporting back when done.
_INLINE: dict[type, Callable[[Node, Any], None]] = {
    Persist: lambda node, eff: node.log.append(eff.record.raw),
    Broadcast: lambda node, eff: node._queue(None, eff.payload),
    Send: lambda node, eff: node._queue(eff.peer, eff.payload),
    Cancel: Node._on_cancel,
    JobDone: Node._on_job_done,
}
_TASKS: dict[type, Callable[[Node, Any], Awaitable[None]]] = {
    PrepareJob: Node._prepare,
    Train: Node._train,
    PublishDelta: Node._publish_delta,
    Aggregate: Node._aggregate,
    Apply: Node._apply,
    FetchState: Node._fetch_state,
    PublishCheckpoint: Node._publish_checkpoint,
}
