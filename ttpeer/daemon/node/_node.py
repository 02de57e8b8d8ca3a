"""The daemon: one trio nursery that drives a ``PeerMachine`` with real I/O.

Theory of operation. The machine decides; the node executes. Every call into the
machine happens on the trio thread, and its effects are handled at once: cheap
ones inline (persist a record, queue a message), long ones (train, upload,
aggregate, download) as tasks in the node's nursery that report back into the
machine when done. A tick task wakes at the machine's next deadline. Four tasks
talk to the relay: the receiver (long-poll, cursor acknowledgement), the outbox
(sends with retry), the hello loop (until this peer holds the pool key) and the pin
(``Datasets.keep_pinned``: the TTL of running jobs' dataset pieces, restarted).

Envelopes on the wire (the relay sees the first byte, sizes and timing only):

    H + canonical {"proof": [invite, join]}      a member announcing itself (public)
    K + direct-sealed key handover               every epoch's pool key, sealed to one member
    L + direct-sealed {"to", "records"}          to a node that is no member: the signed records
                                                 that show it (its revocation, or the joins that
                                                 took its invite's last use)
    P + pool-sealed (counter + gossip payload)   records and digests; the sender's id is
                                                 bound in as associated data, the counter
                                                 feeds the receiver's replay window (_replay)
    W + pool-sealed (counter + want)             a want of dataset pieces (``_data``), sealed
                                                 as P is under a purpose of its own; one counter

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

The node composes one part per concern: ``_effects`` (the effect table and its
handlers), ``_link`` (the relay and the protocol clock), ``_keys`` (key epochs,
envelopes, sealed blobs), ``_membership`` (hello, handover, rotation, an ended
membership), ``_relays`` (the pool's relays, followed), ``data`` (datasets) and
``_admin`` (submit, revoke, cancel). It builds each part with the collaborators that
part uses (the machine, the keys, the blobs, another part; callables such as
``process``, ``now`` and ``wall``), never with itself, and wires in ``__init__`` the
parts that need each other. The nursery, which it has only once it runs, reaches the
parts through the ``Lifetime`` each is given (``run`` opens it), as does the fatal
error that stops the daemon. The node keeps the lifecycle, the ticker, message
dispatch, liveness, and the methods the control socket calls.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from cryptography.exceptions import InvalidSignature

from ttpeer.errors import (
    DiskError,
    TtpeerError,
)
from ttpeer.net import PoolTransport, RelayRejected
from ttpeer.proto import (
    Effect,
    PeerMachine,
    ProofError,
    Record,
    RecordError,
    RevokeError,
    Timing,
)

from .._counters import Counters
from .._executor import Executor
from .._home import Home, PoolConfig
from .._lifetime import Lifetime
from ..data._data import Datasets
from ..sealed._blobs import BLOB as BLOB
from ..sealed._blobs import Blobs
from ..sealed._keys import GOSSIP as GOSSIP
from ..sealed._keys import SEALED, PoolKeys, SealError
from . import _admin
from ._effects import Effects
from ._link import Link, revoked_by_relay, token_used_at_relay
from ._membership import ENDED, Credentials, Membership
from ._recordlog import RecordLog
from ._relays import Follower
from ._replay import ReplayGuard

log = logging.getLogger("ttpeer.daemon")

SUSPECT_BEATS = 3  # heartbeats missed before a peer is suspected
DEAD_BEATS = 8  # ... and before it is reported dead (leases, not this, requeue its work)


class Node:
    def __init__(
        self,
        home: Home,
        transport: PoolTransport,
        executor: Executor,
        *,
        timing: Timing = Timing(),
        seed: int | None = None,
        durable: bool = True,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.home = home
        cfg = home.config()
        self.transport = transport
        self.executor = executor
        self.node_key = home.node_key()
        self.seal_key = home.seal_key()
        self.keys = PoolKeys(home)
        self.counters = Counters()
        self._rng = random.Random(seed)
        self._wake = trio.Event()
        self.link = Link(transport, self.counters, self._rng, lambda: self._wake.set())
        self.machine = PeerMachine(cfg.pool, self.node_key, now=self.now(), timing=timing)
        self.me = self.machine.me
        self.relays = Follower(self.machine, transport, home, cfg)  # the newest root ``relays`` record, applied
        self.log = RecordLog(home.records_log, fsync=durable)
        self.replay = ReplayGuard(home.path, durable=durable)
        self.blobs = Blobs(self.keys, transport, home, self.counters.reject)
        self.wall = wall  # calendar time: the `at` of records signed here, invites' expiry
        self.outbox_send = self.link.outbox_send
        self.life = Lifetime(on_stop=partial(self.replay.maybe_save, 0.0, force=True))  # its nursery: ``run``
        self.key_event = trio.Event()  # set once a pool key is held
        self.is_admin = (home.path / "root.key").exists()
        self.finished: dict[str, str] = {}  # job -> the state whose final files this peer wrote (status, data)
        me = Credentials(cfg.name, cfg.proof, self.node_key, self.seal_key, self.is_admin)
        self.membership = Membership(me, self.machine, self.keys, transport, home, self.counters, self.life,
                                     key_event=self.key_event, outbox=self.outbox_send, now=self.now,
                                     wall=self.wall, process=self.process)
        self.data = Datasets(home, self.machine, self.blobs, self.keys, self.counters, self.life,
                             node_key=self.node_key, key_event=self.key_event, now=self.now, wall=self.wall,
                             process=self.process, want=self.broadcast_want, finished=self.finished)
        self.effects = Effects(self.machine, executor, self.blobs, self.data, home, self.counters, self.life,
                               records=self.log, relays=self.relays, keys=self.keys, replay=self.replay,
                               outbox=self.outbox_send, transport=transport, finished=self.finished, now=self.now,
                               process=self.process)
        self.phases = self.effects.phases.by_job  # read by status
        self.blobs.direct = self.data.fetch_blob  # deltas and states from their uploaders, on a LAN
        self.blobs.direct_range = self.data.fetch_blob_range  # a slice's chunks of them
        executor.on_missing = self.effects.task_data.fetch_missing  # a task reading dataset pieces not here yet
        if self.pool_key is not None:
            self.key_event.set()

    @property
    def fatal(self) -> TtpeerError | None:
        """The error the daemon stopped for (a full disk, a membership that ended), if one."""
        return self.life.fatal

    @property
    def cfg(self) -> PoolConfig:
        """The pool's config as this peer uses it: its relays follow the newest ``relays``
        record (``Follower``)."""
        return self.relays.cfg

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
        now = self.now()
        self.counters.started = trio.current_time()
        logged = self.log.load()
        for raw in self.cfg.proof:
            if raw not in logged:
                self.log.append(raw)
        self.machine.load(logged + self.cfg.proof, now)
        self.membership.loaded()
        self.relays.loaded()  # before the first connection: the pool's relays may have moved
        for job in self.machine.records.jobs():
            for state in self.executor.held_states(job.id):
                self.machine.held.add(state)
        async with trio.open_nursery() as nursery:
            self.life.nursery = nursery
            await self._connect()
            await nursery.start(self.transport.run)  # revive relays that go down (net/_multi.py)
            nursery.start_soon(self.link.receiver, self._on_message, self._settle, self._revoked_by_relay)
            nursery.start_soon(self.link.outbox)
            nursery.start_soon(self.membership.hello_loop)
            nursery.start_soon(self._ticker)
            nursery.start_soon(self.data.keep_pinned)
            task_status.started()

    def stop(self) -> None:
        self.life.stop()

    async def _connect(self) -> None:
        try:
            await self.link.connect()
        except RelayRejected as exc:
            if revoked_by_relay(exc):
                self.membership.end(ENDED["revoked"], mark=False)
                raise self.fatal from None  # type: ignore[misc]
            if token_used_at_relay(exc):
                self.membership.token_used(exc.records, exc.message)
                raise self.fatal from None  # type: ignore[misc]
            raise
        for rec in [r for r in self.machine.records if r.kind in ("revoke", "admit")]:
            await self.membership.hand_relay(rec)  # a relay that lost its disk relearns them

    def _revoked_by_relay(self) -> None:
        self.membership.end(ENDED["revoked"], mark=False)

    # -- time and liveness -----------------------------------------------------------

    def now(self) -> float:
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
        return self.effects.done_event(job)

    # -- effects: one handler per effect type -------------------------------------------

    def process(self, effects: list[Effect], *, wake: bool = True) -> None:
        """Execute effects; ``wake`` the ticker, since the next deadline may have moved."""
        for eff in effects:
            try:
                self.effects.execute(eff)
            except DiskError as exc:
                self.disk_full(exc)
                return
        if wake:
            self._wake.set()

    def disk_full(self, exc: DiskError) -> None:
        self.life.halt(exc)

    def broadcast_want(self, payload: bytes) -> None:
        """Send a want of dataset pieces to every peer, sealed (a ``W`` message, ``_data``)."""
        self.effects.queue(None, payload, b"W")

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
            for progress in self.effects.training.reports(trio.current_time()):
                self.machine.report(progress, self.now())
            # Protocol time is trio time less the outages: the subtraction can land a hair
            # before the deadline that just fired, which must not leave it unfired.
            self.process(self.machine.tick(max(self.now(), deadline)), wake=False)

    def _settle(self) -> None:
        """After a batch of messages: one decision for the whole batch, not one per message."""
        self.process(self.machine.settle(self.now()))
        self.membership.check_admits()  # before the races: an acknowledgement decides them
        self.membership.check_lost_races()
        self.effects.release_ended()
        self.membership.check_standing()
        self.replay.maybe_save(trio.current_time())

    def _on_message(self, sender: str, data: bytes) -> None:
        kind, body = data[:1], data[1:]
        try:
            if kind in SEALED and self.pool_key is not None:
                opened = self.keys.open_gossip(sender, body, kind)
                if opened is None or not self.replay.accept(sender, opened[0]):
                    log.debug("dropped a replayed or stale message from %s", sender[:12])
                    return
                if kind == b"W":  # a peer asks holders for dataset pieces (``_data``)
                    self.data.on_want(sender, opened[1])
                    return
                self.process(self.machine.receive(sender, opened[1], self.now(), settle=False), wake=False)
            elif kind in SEALED:
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
            if kind in SEALED:
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

    def rotate_key(self) -> None:
        self.membership.rotate()

    def release_job(self, job: str) -> None:
        self.effects.release(job)

    # -- the pool's relays -------------------------------------------------------------------

    def relay_change(self, *, add: tuple[str, str] | None = None,
                     remove: str | None = None) -> tuple[Record | None, str]:
        """``ttpeer relay add/rm`` (admin): sign and publish the pool's new list of relays
        (``Follower.change``); returns the record (None when nothing changed) and what
        happened, in words. Raises ``RevokeError`` (not the admin), ``UsageError``."""
        if not self.is_admin:
            raise RevokeError("only the pool admin (the machine that ran 'ttpeer pool create') can change the "
                              "pool's relays")
        rec, said = self.relays.change(int(self.wall()), add=add, remove=remove)
        if rec is not None:
            self.process(self.machine.add_local(rec, self.now()))  # persisted: the follower applies it here too
        return rec, said

    def relay_list(self) -> list[dict[str, Any]]:
        """The pool's relays, in order, with this peer's view of each when the transport has one."""
        seen = {d["url"]: d for d in self.transport.describe()}
        return [{"url": url, "fingerprint": fp, "state": seen.get(url, {}).get("state"),
                 "error": seen.get(url, {}).get("error"), "primary": seen.get(url, {}).get("primary", False)}
                for url, fp in self.relays.current()]

    # -- datasets -------------------------------------------------------------------------

    async def data_add(self, path: str, name: str | None, piece_size: int | None, fmt: str | None = None, *,
                       urls: list[str] | None = None, relay: bool = True) -> tuple[Record, bool]:
        """``ttpeer data add``: see ``_data.Datasets.add``. Raises ``DataError``, ``DiskError``
        (which also stops the daemon, as a full disk does everywhere)."""
        try:
            return await self.data.add(path, name, piece_size, fmt, urls=urls, relay=relay)
        except DiskError as exc:
            self.disk_full(exc)
            raise

    async def data_remove(self, text: str, withdraw: bool) -> dict[str, Any]:
        """``ttpeer data rm``: see ``_data.Datasets.remove``. Raises ``DataError``."""
        return await self.data.remove(text, withdraw)

    def job_data(self, job: Record) -> list[dict[str, Any]] | None:
        return self.data.job_data(job)

    # -- status ---------------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        return self.transport.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.transport.bytes_received

    def status(self) -> dict[str, Any]:
        from ._status import snapshot

        return snapshot(self)
