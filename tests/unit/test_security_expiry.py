"""A token used after its invite expired gets no pool key, whatever time its join
claims: the join's time is the joiner's own word, so membership rules alone cannot
tell; the members who hand out the key judge it by their own calendar clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ttpeer.daemon import Home, Node, new_invite
from ttpeer.net import MemoryRelay
from ttpeer.proto import EXPIRY_GRACE, Token, encode, sign
from ttpeer.testing import FakeDisk, FakeExecutor

T0 = 1_800_000_000.0
TTL = 3600


def _pool(root: Path) -> tuple[Home, Home]:
    admin = Home(root / "admin")
    cfg = admin.create_pool("https://relay.invalid", "sha256:" + "0" * 64, "admin", T0)
    invite, key = new_invite(admin.root_key(), cfg.pool, ttl=TTL, uses=1, role="member", now=T0)
    member = Home(root / "member")
    # The join says it was made 10 s after the invite, whenever it really was.
    member.enroll(Token(("https://relay.invalid",), "sha256:" + "0" * 64, cfg.pool, invite,
                        key.private_bytes_raw()), "member", T0 + 10)
    return admin, member


def _handed_key(admin_home: Home, member_home: Home, wall: float, *, took_part: bool = False) -> tuple[bool, int]:
    """Whether the admin's node answers the member's hello with the pool key when its
    calendar clock reads ``wall``; and how many hellos it refused as expired."""

    async def main() -> tuple[bool, int]:
        relay = MemoryRelay()
        cfg = admin_home.config()
        admin = Node(admin_home, relay.client(cfg.pool, admin_home.node_key(), cfg.proof),
                     FakeExecutor("admin", FakeDisk()), durable=False, wall=lambda: wall)
        member = member_home.config()
        if took_part:  # a record the member signed (any kind but its join): it has taken part
            rec = sign("decline", cfg.pool, {"job": "ab" * 32, "reason": "busy", "need": 0, "have": 0},
                       member_home.node_key())
            admin.machine.add_local(rec, 0.0)
        async with trio.open_nursery() as nursery:
            admin.life.nursery = nursery
            sender = member_home.node_key().public_key().public_bytes_raw().hex()
            admin._on_message(sender, b"H" + encode({"proof": [p.hex() for p in member.proof]}))
            nursery.cancel_scope.cancel()
        queued = []
        while True:
            try:
                queued.append(admin.link.outbox_recv.receive_nowait())
            except trio.WouldBlock:
                break
        keys = [data for to, data in queued if to == sender and data[:1] == b"K"]
        return bool(keys), admin.counters.rejected.get("hello: invite expired", 0)

    return trio.run(main)


@pytest.mark.parametrize(("after", "handed"), [
    (-TTL + 100, True),  # well before expiry
    (EXPIRY_GRACE - 60, True),  # just past it, within the grace for clock skew
    (EXPIRY_GRACE + 60, False),  # past the grace: a token used late
    (30 * 86_400, False),  # a month later
])
def test_a_hello_after_the_invite_expired_gets_no_key(tmp_path, after, handed):
    admin, member = _pool(tmp_path)
    got, refused = _handed_key(admin, member, wall=T0 + TTL + after)
    assert (got, refused) == (handed, 0 if handed else 1)


def test_a_member_that_took_part_still_gets_keys_after_its_invite_expired(tmp_path):
    # After a key rotation, a member that missed it says hello again, long after its invite.
    admin, member = _pool(tmp_path)
    assert _handed_key(admin, member, wall=T0 + 30 * 86_400, took_part=True) == (True, 0)
