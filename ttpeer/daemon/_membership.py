"""Membership as the daemon lives it: joining (hello, key handover), rotating the pool
key, and a membership that ends.

Theory of operation. A node that lacks the pool key says hello (its invite and join)
until a member hands it every epoch's key, sealed to it (``_keys.PoolKeys.handover``).
A member answers a hello with the keys if the records show the sender a member whose
invite was not used after it expired; with the records that show why, if the sender is
no member (revoked, or its join lost the race for its invite's last use). The admin
rotates the key on a revocation and when a join lost such a race (it may have been
handed the key first). A node that the records show revoked or lost stops for good
(``MembershipEnded``) and marks its home.

``Membership`` owns what it remembers between messages (what it checked, when it last
answered whom); everything else it reads from the node (``Host``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ttpeer.errors import DiskError, MembershipEnded, TtpeerError
from ttpeer.net import NetError, Transport
from ttpeer.proto import (
    Effect,
    Member,
    PeerMachine,
    decode,
    encode,
    lost_joins,
    parse,
    revocations,
    standing,
    verify_proof,
)

from ._counters import Counters
from ._home import Home, PoolConfig
from ._keys import MAX_ENDED_RECORDS, PoolKeys, ended_message, open_handover, open_to

log = logging.getLogger("ttpeer.daemon")

EXPIRY_GRACE = 15 * 60.0  # clock skew and a slow first hello, past an invite's expiry
REHELLO_EVERY = 30.0  # at most one hello per this many seconds for messages we cannot open
HELLO_EVERY = 5.0  # until some member hands us the pool key
ENDED_EVERY = 5.0  # at most one L reply per this many seconds to one node
ENDED = {
    "lost": "this token enrolled another machine first; ask the admin for a new one "
            "(and join with it in a new --home, or after deleting this one)",
    "revoked": "this machine was revoked from the pool by its admin; it can no longer take part "
               "(ask the admin for a new token, and join with it in a new --home)",
}


class Host(Protocol):
    """What ``Membership`` uses of the running node (``_node.Node`` is one)."""

    machine: PeerMachine
    me: str
    cfg: PoolConfig
    home: Home
    keys: PoolKeys
    transport: Transport
    counters: Counters
    fatal: TtpeerError | None
    node_key: Ed25519PrivateKey
    seal_key: X25519PrivateKey
    key_event: trio.Event
    is_admin: bool
    outbox_send: trio.MemorySendChannel[tuple[str | None, bytes]]

    @property
    def pool_key(self) -> bytes | None: ...
    @property
    def pool_keys(self) -> list[bytes]: ...
    def wall(self) -> float: ...
    def now(self) -> float: ...
    def process(self, effects: list[Effect], *, wake: bool = True) -> None: ...
    def stop(self) -> None: ...


class Membership:
    def __init__(self, node: Host) -> None:
        self._node = node
        self._lost_checked = -1  # membership version last checked for lost join races
        self._lost_seen: set[str] = set()
        self._rehello_at = 0.0
        self._standing_checked = -1  # membership version last checked for our own standing
        self._told_ended: dict[str, float] = {}  # node -> when we last sent it an L reply
        self._renamed = False  # said that our chosen name was taken

    def loaded(self) -> None:
        """After the log is loaded: stop at once if it shows our membership ended (learnt
        in an earlier life, so before any connection). Raises ``MembershipEnded``."""
        node = self._node
        where = standing(node.cfg.pool, node.machine.records, node.me)
        if where in ENDED:
            node.fatal = MembershipEnded(ENDED[where])
            self.mark_ended()
            raise node.fatal
        # Lost join races already in the log were handled (by a rotation) before a restart.
        self._lost_seen = lost_joins(node.cfg.pool, node.machine.records)
        self._lost_checked = node.machine.records.membership_version

    def rehello(self) -> None:
        """A message sealed under an epoch we lack (we missed a rotation): announce
        ourselves; members answer with every epoch's key if we are still a member."""
        if trio.current_time() >= self._rehello_at:
            self._rehello_at = trio.current_time() + REHELLO_EVERY
            with contextlib.suppress(trio.WouldBlock):
                self._node.outbox_send.send_nowait((None, self.hello()))

    # -- joining: hello and key handover -------------------------------------------------

    def hello(self) -> bytes:
        return b"H" + encode({"proof": [p.hex() for p in self._node.cfg.proof]})

    async def hello_loop(self) -> None:
        """Announce ourselves; repeat until some member handed us the pool key."""
        await self._node.transport.broadcast(self.hello())
        while not self._node.key_event.is_set():
            with trio.move_on_after(HELLO_EVERY):
                await self._node.key_event.wait()
            if not self._node.key_event.is_set():
                try:
                    await self._node.transport.broadcast(self.hello())
                except NetError:
                    pass

    def on_hello(self, sender: str, body: bytes) -> None:
        obj = decode(body, max_size=200_000)
        proof = [bytes.fromhex(p) for p in obj["proof"]]
        member = verify_proof(self._node.cfg.pool, sender, proof)
        now = self._node.now()
        for raw in proof:
            self._node.process(self._node.machine.add_local(parse(raw), now))
        if self._node.pool_key is None:
            return
        if member.node not in self._node.machine.records.members:
            self.tell_ended(member)  # over its invite's use limit or revoked: show it why
            return
        late = self.joined_late(member.node, proof)
        if late is not None:
            self._node.counters.reject("hello: invite expired")
            log.warning("not handing the pool key to %s: its invite expired %.0f min ago by this machine's clock "
                        "and it has taken no part yet (a token used after it expired; it needs a new one)",
                        member.node[:12], late / 60)
            return
        self.hand_keys(member.node, member.seal)

    def joined_late(self, node: str, proof: list[bytes]) -> float | None:
        """Seconds past its invite's expiry, by this machine's calendar clock, if ``node``
        asks for the pool key after that (plus ``EXPIRY_GRACE``) and has never signed
        anything but its join; else None. A join's own time is the joiner's claim, so a
        stolen token used late passes the membership rules: this is where it is stopped,
        since without the pool key it can neither read nor send anything. Members who
        took part (a claim, a contribution...) still get keys after a rotation."""
        past = self._node.wall() - parse(proof[0])["expires"]
        if past <= EXPIRY_GRACE:
            return None
        if any(r.author == node and r.kind != "join" for r in self._node.machine.records):
            return None
        return past

    def hand_keys(self, node: str, seal_pub: str) -> None:
        host = self._node
        host.outbox_send.send_nowait((node, host.keys.handover(host.node_key, host.cfg.proof, node, seal_pub)))

    def on_key(self, body: bytes) -> None:
        opened = open_handover(self._node.seal_key, body, self._node.cfg.pool, self._node.me)
        if opened is None:
            return
        giver, keys, proof = opened
        for rec in proof:  # the giver's membership, so we can judge its role below
            self._node.process(self._node.machine.add_local(rec, self._node.now()), wake=False)
        if self._node.pool_keys:
            # A newer epoch: only from a current (unrevoked) member, and only extending the
            # keys we hold. Only the admin makes epochs; members pass them on.
            if (len(keys) <= len(self._node.pool_keys) or keys[: len(self._node.pool_keys)] != self._node.pool_keys
                    or giver not in self._node.machine.records.members):
                return
        self._node.keys.set(keys)
        self._node.key_event.set()
        log.info("received pool key epoch %d from %s", len(keys) - 1, giver[:12])
        self._node.process(self._node.machine.tick(self._node.now()))

    # -- a membership that ended ----------------------------------------------------------

    def check_standing(self) -> None:
        """Stop for good once the records show that this node is no member and never will
        be: revoked, or its join lost the race for its invite's last use."""
        rs = self._node.machine.records
        if self._standing_checked == rs.membership_version or self._node.fatal is not None:
            return
        self._standing_checked = rs.membership_version
        where = standing(self._node.cfg.pool, rs, self._node.me)
        if where in ENDED:
            self.end(where)
        elif where == "member" and rs.members[self._node.me].name != self._node.cfg.name and not self._renamed:
            self._renamed = True
            log.warning("another machine in this pool was named %r first: this one is %r in the pool",
                        self._node.cfg.name, rs.members[self._node.me].name)

    def end(self, where: str, *, mark: bool = True) -> None:
        """Stop with ``MembershipEnded``. ``mark`` the home only when our own records show
        it: a relay's 403 is its word, not a signed record, and must not end a home for good."""
        self._node.fatal = MembershipEnded(ENDED[where])
        log.error("%s", self._node.fatal)
        if mark:
            self.mark_ended()
        self._node.stop()

    def mark_ended(self) -> None:
        try:
            self._node.home.mark_ended(str(self._node.fatal))
        except DiskError as exc:  # the exit says it anyway; the mark only saves a later look
            log.warning("%s", exc)

    def tell_ended(self, member: Member) -> None:
        """Answer the hello of a node that is no member with the records that show why, so
        it stops at once instead of asking for a key forever (or training with an old one).
        The records are signed, so a relay can neither forge nor hide a reason in them."""
        rs, now = self._node.machine.records, trio.current_time()
        if self._node.pool_key is None or now < self._told_ended.get(member.node, -ENDED_EVERY) + ENDED_EVERY:
            return
        where = standing(self._node.cfg.pool, rs, member.node)
        if where == "revoked":
            shown = [r for r in rs if r.kind == "revoke" and r["node"] == member.node]
        elif where == "lost":
            winners = [m.join for m in rs.members.values() if m.invite == member.invite]
            shown = [rs.by_id[member.invite], *(rs.by_id[j] for j in sorted(winners))]
        else:
            return
        self._told_ended[member.node] = now
        with contextlib.suppress(trio.WouldBlock):
            self._node.outbox_send.send_nowait((member.node, ended_message(member.node, member.seal, shown)))

    def on_ended(self, body: bytes) -> None:
        """Records someone says show we are no member: signed, so we just take them (the
        receiver then judges our standing from everything held, not from this claim)."""
        obj = open_to(self._node.seal_key, body, max_size=MAX_ENDED_RECORDS * 140_000)
        if obj["to"] != self._node.me:
            return
        now = self._node.now()
        for raw in obj["records"][:MAX_ENDED_RECORDS]:
            self._node.process(self._node.machine.add_local(parse(bytes.fromhex(raw)), now), wake=False)

    def rotate(self) -> None:
        """A new pool key, handed (with the old ones) only to who is a member now."""
        self._node.keys.rotate()
        for node, member in sorted(self._node.machine.records.members.items()):
            if node != self._node.me:
                self.hand_keys(node, member.seal)

    def check_lost_races(self) -> None:
        """Admin only: a join that lost the race for an invite's last use may have been
        handed the pool key first; rotate the key so that node reads nothing new."""
        rs = self._node.machine.records
        if self._lost_checked == rs.membership_version or not self._node.is_admin:
            return
        self._lost_checked = rs.membership_version
        lost = lost_joins(self._node.cfg.pool, rs) - set(revocations(self._node.cfg.pool, rs)) - self._lost_seen
        if lost:
            self._lost_seen |= lost
            self.rotate()
            log.info("rotated the pool key to epoch %d: %d join(s) lost the race for an invite's last use",
                     len(self._node.pool_keys) - 1, len(lost))
