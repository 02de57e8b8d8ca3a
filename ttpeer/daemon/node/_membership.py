"""Membership as the daemon lives it: joining (hello, key handover), rotating the pool
key, and a membership that ends.

Theory of operation. A node that lacks the pool key says hello (its invite and join)
until a member hands it every epoch's key, sealed to it (``_keys.PoolKeys.handover``).
A member answers a hello with the keys if the records show the sender a member whose
invite was not used after it expired; with the records that show why, if the sender is
no member (revoked, or its join lost the race for its invite's last use). The admin
rotates the key on a revocation and when a join lost such a race (it may have been
handed the key first). The admin also acknowledges each member's join as it first sees
it (a root-signed ``admit``, gossiped and handed to the relays): the machine that used a
token first keeps its place, and the relays refuse the token's later joins. A node that
the records show revoked or lost stops for good (``MembershipEnded``) and marks its home.

The decisions are the pure ``proto.KeyRing``'s, which remembers what they need (what it
checked, when it last answered whom). ``Membership`` executes them: it decodes, verifies
and seals, queues what goes out, logs, marks the home, and hands the ring the records and
the clocks (trio time for rate limits, the calendar for invites' expiry).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ttpeer.errors import DiskError, MembershipEnded, TtpeerError
from ttpeer.net import NetError, PoolTransport
from ttpeer.proto import (
    Admit,
    Effect,
    EndMembership,
    HandKeys,
    KeyRing,
    PeerMachine,
    Record,
    Refuse,
    RejectKeys,
    Renamed,
    TellEnded,
    decode,
    encode,
    parse,
    sign,
    token_used_message,
    verify_proof,
)

from .._counters import Counters
from .._home import Home
from .._lifetime import Lifetime
from ..sealed._keys import MAX_ENDED_RECORDS, PoolKeys, ended_message, open_handover, open_to

log = logging.getLogger("ttpeer.daemon")

HELLO_EVERY = 5.0  # until some member hands us the pool key
ENDED = {
    "lost": "this token's uses went to other machines; ask the admin for a new one "
            "(and join with it in a new --home, or after deleting this one)",
    "revoked": "this machine was revoked from the pool by its admin; it can no longer take part "
               "(ask the admin for a new token, and join with it in a new --home)",
}


def _ended_words(ended: EndMembership) -> str:
    """Why this machine's membership ended, for the log and the exit: who used the token up."""
    if ended.where == "lost" and ended.by is not None:
        return token_used_message(ended.by) + " (join with it in a new --home, or after deleting this one)"
    return ENDED[ended.where]


class Process(Protocol):
    """How the node executes the machine's effects (``Node.process``)."""

    def __call__(self, effects: list[Effect], *, wake: bool = True) -> None: ...


@dataclass(frozen=True)
class Credentials:
    """What this peer shows and holds to be a member, as its home keeps it: stable while
    the daemon runs."""

    name: str  # the name it chose (the pool may show it another: ``Renamed``)
    proof: list[bytes]  # its invite and join
    node_key: Ed25519PrivateKey  # signs; its id is the public half
    seal_key: X25519PrivateKey  # opens what is sealed to it (a key handover, an ``L`` message)
    admin: bool  # holds the pool's root key


class Membership:
    """Executes ``proto.KeyRing``'s decisions for ``machine``'s records: ``keys`` are the
    epochs held (``key_event`` is set once there is one), ``outbox`` queues what goes to
    the peers, ``life`` starts tasks and stops the daemon when the membership ends."""

    def __init__(self, me: Credentials, machine: PeerMachine, keys: PoolKeys, transport: PoolTransport,
                 home: Home, counters: Counters, life: Lifetime, *, key_event: trio.Event,
                 outbox: trio.MemorySendChannel[tuple[str | None, bytes]], now: Callable[[], float],
                 wall: Callable[[], float], process: Process) -> None:
        self._me, self._machine, self._keys, self._transport = me, machine, keys, transport
        self._home, self._counters, self._life = home, counters, life
        self._key_event, self._outbox = key_event, outbox
        self._now, self._wall, self._process = now, wall, process
        self.ring = KeyRing(machine.pool, machine.me, me.name, admin=me.admin)

    def loaded(self) -> None:
        """After the log is loaded: stop at once if it shows our membership ended (learnt
        in an earlier life, so before any connection). Raises ``MembershipEnded``."""
        ended = self.ring.loaded(self._machine.records)
        if ended is not None:
            exc = self._life.fatal = MembershipEnded(_ended_words(ended))
            self.mark_ended()
            raise exc

    def rehello(self) -> None:
        """A message sealed under an epoch we lack (we missed a rotation): announce
        ourselves; members answer with every epoch's key if we are still a member."""
        if self.ring.rehello_due(trio.current_time()):
            with contextlib.suppress(trio.WouldBlock):
                self._outbox.send_nowait((None, self.hello()))

    # -- joining: hello and key handover -------------------------------------------------

    def hello(self) -> bytes:
        return b"H" + encode({"proof": [p.hex() for p in self._me.proof]})

    async def hello_loop(self) -> None:
        """Announce ourselves; repeat until some member handed us the pool key."""
        await self._transport.broadcast(self.hello())
        while not self._key_event.is_set():
            with trio.move_on_after(HELLO_EVERY):
                await self._key_event.wait()
            if not self._key_event.is_set():
                try:
                    await self._transport.broadcast(self.hello())
                except NetError:
                    pass

    def on_hello(self, sender: str, body: bytes) -> None:
        obj = decode(body, max_size=200_000)
        proof = [bytes.fromhex(p) for p in obj["proof"]]
        member = verify_proof(self._machine.pool, sender, proof)
        now = self._now()
        for raw in proof:
            self._process(self._machine.add_local(parse(raw), now))
        answer = self.ring.hello(member, parse(proof[0])["expires"], self._machine.records,
                                 has_key=self._keys.newest is not None, now=trio.current_time(), wall=self._wall())
        if isinstance(answer, TellEnded):  # over its invite's use limit or revoked: show it why
            with contextlib.suppress(trio.WouldBlock):
                self._outbox.send_nowait((answer.node, ended_message(answer.node, answer.seal, list(answer.records))))
        elif isinstance(answer, Refuse):
            self._counters.reject(f"hello: {answer.reason}")
            log.warning("not handing the pool key to %s: its invite expired %.0f min ago by this machine's clock "
                        "and it has taken no part yet (a token used after it expired; it needs a new one)",
                        answer.node[:12], answer.late / 60)
        elif isinstance(answer, HandKeys):
            self.hand_keys(answer)

    def hand_keys(self, to: HandKeys) -> None:
        self._outbox.send_nowait((to.node, self._keys.handover(self._me.node_key, self._me.proof, to.node, to.seal)))

    def on_key(self, body: bytes) -> None:
        opened = open_handover(self._me.seal_key, body, self._machine.pool, self._machine.me)
        if opened is None:
            return
        giver, keys, proof = opened
        for rec in proof:  # the giver's membership, so the ring can judge its role
            self._process(self._machine.add_local(rec, self._now()), wake=False)
        taken = self.ring.offer_keys(self._keys.keys, keys, giver, self._machine.records)
        if isinstance(taken, RejectKeys):
            return
        self._keys.set(keys)
        self._key_event.set()
        log.info("received pool key epoch %d from %s", taken.epoch, giver[:12])
        self._process(self._machine.tick(self._now()))

    # -- a membership that ended ----------------------------------------------------------

    def check_standing(self) -> None:
        """Stop for good once the records show that this node is no member and never will
        be: revoked, or its join lost the race for its invite's last use."""
        if self._life.fatal is not None:
            return
        found = self.ring.check_standing(self._machine.records)
        if isinstance(found, EndMembership):
            self.end(_ended_words(found))
        elif isinstance(found, Renamed):
            log.warning("another machine in this pool was named %r first: this one is %r in the pool",
                        found.chose, found.shows)

    def end(self, why: str, *, mark: bool = True) -> None:
        """Stop with ``MembershipEnded(why)``. ``mark`` the home only when our own records show
        it: a relay's 403 is its word, not a signed record, and must not end a home for good."""
        self._life.fatal = MembershipEnded(why)
        log.error("%s", self._life.fatal)
        if mark:
            self.mark_ended()
        self._life.stop()

    def token_used(self, proof: tuple[bytes, ...], said: str) -> None:
        """The relay refused our login: every use of our token is acknowledged for other
        machines, and ``proof`` (its answer's records) should show it. What the signed
        records show ends the membership for good (the home is marked); the relay's word
        alone (``said``) stops this run only."""
        for raw in (*self._me.proof, *proof):
            with contextlib.suppress(TtpeerError):
                self._process(self._machine.add_local(parse(raw), self._now()), wake=False)
        self.check_standing()
        if self._life.fatal is None:
            self.end(f"{said} (join with it in a new --home, or after deleting this one)", mark=False)

    def mark_ended(self) -> None:
        try:
            self._home.mark_ended(str(self._life.fatal))
        except DiskError as exc:  # the exit says it anyway; the mark only saves a later look
            log.warning("%s", exc)

    def on_ended(self, body: bytes) -> None:
        """Records someone says show we are no member: signed, so we just take them (the
        receiver then judges our standing from everything held, not from this claim)."""
        obj = open_to(self._me.seal_key, body, max_size=MAX_ENDED_RECORDS * 140_000)
        if obj["to"] != self._machine.me:
            return
        now = self._now()
        for raw in obj["records"][:MAX_ENDED_RECORDS]:
            self._process(self._machine.add_local(parse(bytes.fromhex(raw)), now), wake=False)

    def rotate(self) -> None:
        """A new pool key, handed (with the old ones) only to who is a member now."""
        self._keys.rotate()
        for to in self.ring.hand_all(self._machine.records):
            self.hand_keys(to)

    def check_admits(self) -> None:
        """Admin only: acknowledge each member's join not acknowledged yet (root-signed),
        gossip it, and hand it to the relays, which then refuse the token's later joins."""
        for admit in self.ring.check_admits(self._machine.records):
            rec = self._admit_record(admit)
            self._process(self._machine.add_local(rec, self._now()))
            log.info("acknowledged %s's join (%s)", admit.member.name, admit.member.node[:12])
            if self._life.running:
                self._life.start_soon(self.hand_relay, rec)

    def _admit_record(self, admit: Admit) -> Record:
        m = admit.member
        # Its name in the pool (a chosen name another machine took first gets a suffix).
        name = m.name if len(m.name) <= 64 else self._machine.records.by_id[m.join]["name"]
        body = {"invite": m.invite, "join": m.join, "node": m.node, "name": name, "at": admit.at}
        return sign("admit", self._machine.pool, body, self._home.root_key())

    async def hand_relay(self, rec: Record) -> None:
        """Hand the relays a root-signed record they enforce (a revocation, an acknowledged
        join). Root-signed, so any member may carry it; a relay that lost its disk relearns
        them from the next peer that starts."""
        try:
            await (self._transport.revoke if rec.kind == "revoke" else self._transport.admit)(rec.raw)
        except NetError as exc:
            log.warning("the relay did not take a %s record: %s", rec.kind, exc)

    def check_lost_races(self) -> None:
        """Admin only: a join that lost the race for an invite's last use may have been
        handed the pool key first; rotate the key so that node reads nothing new."""
        rotation = self.ring.check_lost_races(self._machine.records)
        if rotation is not None:
            self.rotate()
            log.info("rotated the pool key to epoch %d: %d join(s) lost the race for an invite's last use",
                     len(self._keys.keys) - 1, rotation.lost)
