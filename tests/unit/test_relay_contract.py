"""One relay contract, three relays. Every test here runs against the in-memory relay (the
simulator's and most tests'), the real HTTPS relay on loopback (TLS, hypercorn,
``RelayClient``) and a pool of one relay through ``MultiRelay``, through the ``Transport``
each hands a peer: what a peer can observe, errors and their codes included, must not
depend on which relay it talks to.

What only one relay has stays with it: TLS, pinning, raw HTTP, disks and restarts in
``test_relay*.py`` and ``test_security_relay.py``; faults and the ``available`` switch
in ``test_net_memory.py``. Waits are bounded with ``trio.fail_after``; nothing sleeps.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_relay import RelayConfig, RelayRunning, serve
from ttpeer_wire import ErrorCode

from ttpeer.net import (
    BlobCorrupt,
    BlobMissing,
    MemoryRelay,
    Message,
    RelayClient,
    RelayLimit,
    RelayRejected,
    Transport,
)
from ttpeer.net._multi import MultiRelay
from ttpeer.proto import Record, public_hex, sign

from .test_net_memory import make_pool
from .test_relay import Pool

Proof = list[bytes]
MakeClient = Callable[[str, Ed25519PrivateKey, Proof], Transport]


@dataclass
class Relay:
    kind: str  # "memory" or "https"
    client: MakeClient  # a peer's Transport to this relay, not yet connected

    @asynccontextmanager
    async def member(self, pool: Pool, name: str,
                     identity: tuple[Ed25519PrivateKey, Proof] | None = None) -> AsyncIterator[Transport]:
        key, proof = identity or pool.member(name)
        transport = self.client(pool.id, key, proof)
        try:
            await transport.connect()
            yield transport
        finally:
            await transport.aclose()


StartRelay = Callable[..., Awaitable[Relay]]


@pytest.fixture(params=["memory", "https", "multi"])
def relay_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def start(relay_kind: str, nursery: trio.Nursery, tmp_path: Path) -> StartRelay:
    """Start a relay of the kind under test with the given caps (names both relays take:
    max_message_bytes, mailbox_messages, mailbox_bytes, max_blob_bytes, pool_quota)."""

    async def start(**limits: int) -> Relay:
        if relay_kind == "memory":
            return Relay("memory", MemoryRelay(**limits).client)
        if relay_kind == "multi":  # a pool of one relay, through MultiRelay: that relay, error for error
            memory = MemoryRelay(**limits)

            def one(pool: str, key: Ed25519PrivateKey, proof: Proof) -> Transport:
                return MultiRelay([("https://relay.example", "sha256:" + "0" * 64)],
                                  lambda _url, _fp: memory.client(pool, key, proof))

            return Relay("multi", one)
        config = RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0", **limits)  # type: ignore[arg-type]
        running: RelayRunning = await nursery.start(serve, config)

        def client(pool: str, key: Ed25519PrivateKey, proof: Proof) -> Transport:
            return RelayClient(running.url, running.fingerprint, pool=pool, peer_key=key, proof=proof)

        return Relay("https", client)

    return start


# -- admission ------------------------------------------------------------------------


async def test_a_proof_for_another_node_or_pool_is_refused(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    key, _ = pool.member("a")
    _, other_proof = pool.member("b")
    _, foreign_proof = Pool.create().member("x")
    # Someone else's proof, a proof from another pool: the relay names the broken link.
    for wrong, words in ((other_proof, "another node"), (foreign_proof, "another pool")):
        client = relay.client(pool.id, key, wrong)
        with pytest.raises(RelayRejected) as info:
            await client.connect()
        assert info.value.status == 403 and words in info.value.message
        assert info.value.code == ErrorCode.BAD_PROOF
        await client.aclose()


async def test_a_revoked_peer_is_refused_at_once_and_at_every_login(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    assert pool.root is not None
    bob_key, bob_proof = pool.member("bob")
    bob_id = public_hex(bob_key)
    revoke = sign("revoke", pool.id, {"node": bob_id, "keep": [], "at": 1}, pool.root)
    forged = sign("revoke", pool.id, {"node": bob_id, "keep": [], "at": 1}, bob_key)
    async with relay.member(pool, "alice") as alice, relay.member(pool, "bob", (bob_key, bob_proof)) as bob:
        assert len(await alice.roster()) == 2
        with pytest.raises(RelayRejected, match="bad revocation") as refused:
            await alice.revoke(forged.raw)  # signed by a member, not the root
        assert refused.value.status == 403 and refused.value.code == ErrorCode.BAD_REVOCATION
        await bob.send(bob_id, b"still in")  # the forged one changed nothing
        await alice.revoke(revoke.raw)
        with pytest.raises(RelayRejected, match="revoked") as refused:
            await bob.send(bob_id, b"x")  # its open session is refused at once
        assert refused.value.status == 403 and refused.value.code == ErrorCode.REVOKED
        assert bob_proof not in await alice.roster()
    fresh = relay.client(pool.id, bob_key, bob_proof)
    with pytest.raises(RelayRejected, match="revoked") as refused:
        await fresh.connect()  # a new login too
    assert refused.value.status == 403 and refused.value.code == ErrorCode.REVOKED
    await fresh.aclose()


def _one_use(pool: Pool, names: tuple[str, ...]) -> list[tuple[Ed25519PrivateKey, Proof, Record]]:
    """A single-use invite of ``pool`` and a join of it for each name: (key, proof, join)."""
    assert pool.root is not None
    invite_key = Ed25519PrivateKey.generate()
    invite = sign("invite", pool.id, {"key": public_hex(invite_key), "expires": 2**40, "uses": 1,
                                      "role": "member"}, pool.root)
    out = []
    for i, name in enumerate(names):
        key = Ed25519PrivateKey.generate()
        body = {"invite": invite.id, "node": public_hex(key), "seal": "ab" * 32, "name": name, "at": 1_700_000_000 + i}
        join = sign("join", pool.id, body, invite_key)
        out.append((key, [invite.raw, join.raw], join))
    return out


async def test_once_every_use_is_acknowledged_other_joins_of_the_token_are_refused(start: StartRelay,
                                                                                    pool: Pool) -> None:
    relay = await start()
    assert pool.root is not None
    (lap_key, lap_proof, lap_join), (thief_key, thief_proof, _) = _one_use(pool, ("laptop", "thief"))
    body = {"invite": lap_join["invite"], "join": lap_join.id, "node": lap_join["node"], "name": "laptop",
            "at": lap_join["at"]}
    admit, forged = sign("admit", pool.id, body, pool.root), sign("admit", pool.id, body, lap_key)
    async with relay.member(pool, "alice") as alice:
        with pytest.raises(RelayRejected, match="bad acknowledgement") as refused:
            await alice.admit(forged.raw)  # signed by a member, not the root
        assert refused.value.status == 403 and refused.value.code == ErrorCode.BAD_ADMIT
        async with relay.member(pool, "thief", (thief_key, thief_proof)):
            pass  # before the acknowledgement the relay cannot know: peers' views decide
        await alice.admit(admit.raw)
        async with relay.member(pool, "laptop", (lap_key, lap_proof)):
            pass  # the acknowledged machine logs in as before
    fresh = relay.client(pool.id, thief_key, thief_proof)
    with pytest.raises(RelayRejected) as refused:
        await fresh.connect()
    assert refused.value.status == 403 and refused.value.code == ErrorCode.TOKEN_USED
    assert refused.value.message.startswith("this token was already used by laptop at 2023-11-14 22:13 UTC; "
                                            "ask the pool admin for a new one")
    await fresh.aclose()


# -- mailboxes ------------------------------------------------------------------------


async def test_send_recv_ack_and_prompt_long_poll(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    async with relay.member(pool, "a") as a, relay.member(pool, "b") as b:
        b_id, a_id = public_hex_of(b), public_hex_of(a)
        for i in range(3):
            await a.send(b_id, b"m%d" % i)
        messages, cursor = await b.recv(0, 0)
        assert [m.data for m in messages] == [b"m0", b"m1", b"m2"]
        assert {m.sender for m in messages} == {a_id}
        assert [m.seq for m in messages] == sorted({m.seq for m in messages})
        assert cursor == messages[-1].seq
        # Not acknowledged yet: asking again with an older cursor gets them again.
        again, _ = await b.recv(messages[0].seq, 0)
        assert [m.data for m in again] == [b"m1", b"m2"]
        # Acknowledged: gone, and seqs are never reused.
        assert await b.recv(cursor, 0) == ([], cursor)
        assert await b.recv(0, 0) == ([], 0)

        got: list[bytes] = []

        async def long_poll() -> None:
            new, _ = await b.recv(cursor, 30)
            got.extend(m.data for m in new)

        with trio.fail_after(5):  # far below the 30 s wait: the put wakes the poll
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_poll)
                await trio.testing.wait_all_tasks_blocked()
                await a.send(b_id, b"wake")
        assert got == [b"wake"]
        later, _ = await b.recv(cursor, 0)
        assert later[0].seq > cursor
        assert bytes_counted(a, "sent") > 0 and bytes_counted(b, "received") > 0


async def test_a_negative_cursor_is_a_bad_request(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    async with relay.member(pool, "a") as a:
        with pytest.raises(RelayRejected) as info:
            await a.recv(-1, 0)
        assert info.value.status == 400 and info.value.code == ErrorCode.BAD_REQUEST


async def test_broadcast_excludes_sender(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    async with relay.member(pool, "a") as a, relay.member(pool, "b") as b, relay.member(pool, "c") as c:
        assert await a.broadcast(b"hello") == 2
        for peer in (b, c):
            messages, _ = await peer.recv(0, 0)
            assert [(m.sender, m.data) for m in messages] == [(public_hex_of(a), b"hello")]
        assert await a.recv(0, 0) == ([], 0)


async def test_mailbox_and_message_limits(start: StartRelay, pool: Pool) -> None:
    relay = await start(mailbox_messages=2)
    async with relay.member(pool, "a") as a, relay.member(pool, "b") as b:
        b_id = public_hex_of(b)
        await a.send(b_id, b"1")
        await a.send(b_id, b"2")
        with pytest.raises(RelayLimit) as info:
            await a.send(b_id, b"3")
        assert info.value.status == 507 and info.value.retry_after is not None
        assert info.value.code == ErrorCode.MAILBOX_FULL
        with pytest.raises(RelayLimit) as info:
            await a.send(b_id, b"x" * (256 * 1024 + 1))
        assert info.value.status == 413 and info.value.retry_after is None
        assert info.value.code == ErrorCode.TOO_LARGE
        _, cursor = await b.recv(0, 0)
        await b.recv(cursor, 0)  # acknowledging frees room
        await a.send(b_id, b"3")


# -- blobs ----------------------------------------------------------------------------


async def test_blobs_are_named_by_their_hash_and_kept_per_pool(start: StartRelay, pool: Pool) -> None:
    relay = await start()
    data = os.urandom(700_000)
    async with relay.member(pool, "a") as a, relay.member(pool, "b") as b:
        blob = await a.put_blob(data)
        assert blob == hashlib.sha256(data).hexdigest()
        sent = bytes_counted(a, "sent")
        assert await a.put_blob(data) == blob and bytes_counted(a, "sent") == sent  # there already
        assert await b.has_blob(blob)
        assert await b.get_blob(blob, max_size=len(data)) == data
        with pytest.raises(BlobCorrupt):
            await b.get_blob(blob, max_size=len(data) - 1)
        missing = hashlib.sha256(b"nothing").hexdigest()
        assert not await b.has_blob(missing)
        with pytest.raises(BlobMissing):
            await b.get_blob(missing, max_size=10)
        # Blobs belong to a pool: another pool's member cannot see them.
        async with relay.member(Pool.create(), "z") as z:
            assert not await z.has_blob(blob)


async def test_blob_size_cap_and_pool_quota(start: StartRelay, pool: Pool) -> None:
    relay = await start(pool_quota=100_000, max_blob_bytes=80_000)
    async with relay.member(pool, "a") as a:
        with pytest.raises(RelayLimit) as info:
            await a.put_blob(os.urandom(80_001))
        assert info.value.status == 413 and info.value.retry_after is None
        assert info.value.code == ErrorCode.TOO_LARGE
        await a.put_blob(os.urandom(60_000))
        with pytest.raises(RelayLimit) as info:
            await a.put_blob(os.urandom(60_000))
        assert info.value.status == 507 and info.value.message == "pool quota exceeded"
        assert info.value.code == ErrorCode.POOL_QUOTA and info.value.retry_after is None


async def test_a_touch_restarts_what_the_pool_holds_and_names_the_rest(start: StartRelay, pool: Pool) -> None:
    relay = await start(blob_ttl=3600.0)
    async with relay.member(pool, "a") as a, relay.member(pool, "b") as b:
        assert a.blob_ttl == 3600.0  # told at login: peers pace their touches by it
        held = [await a.put_blob(b"piece %d" % i) for i in range(3)]
        never = [hashlib.sha256(b"never %d" % i).hexdigest() for i in range(2)]
        # Any member's touch; the missing ones in the order asked, each once.
        assert await b.touch_blobs([never[0], *held, never[1], never[0]]) == never
        assert [await b.has_blob(h) for h in held] == [True] * 3
        assert await a.touch_blobs(held * 170 + held[:2]) == []  # 512 names: one touch's worth
        for bad in (held * 171, ["0" * 63], [held[0].upper()]):  # a caller's bug: refused before sending
            with pytest.raises(ValueError):
                await a.touch_blobs(bad)
        async with relay.member(Pool.create(), "z") as z:
            assert await z.touch_blobs(held[:1]) == held[:1]  # another pool's blobs are not its own


# -- one scenario, both transcripts ---------------------------------------------------


async def scenario(make: MakeClient) -> list[Any]:
    """Drive three peers through every Transport method; return what they observed."""
    pool, members = make_pool(3)
    log: list[Any] = []
    async with AsyncExitStack() as stack:
        a, b, c = (make(pool, key, proof) for key, proof in members)
        for t in (a, b, c):
            await t.connect()
            stack.push_async_callback(t.aclose)
        peer = {public_hex(key): name for (key, _), name in zip(members, "abc", strict=True)}
        b_id = public_hex(members[1][0])
        base: dict[str, int] = {}

        def show(who: str, messages: list[Message], cursor: int) -> None:
            first = base.setdefault(who, messages[0].seq if messages else cursor)
            log.append((who, [(m.seq - first, peer[m.sender], m.data) for m in messages],
                        cursor - first if messages else "unchanged"))

        for i in range(3):
            await a.send(b_id, b"m%d" % i)
        messages, cursor = await b.recv(0, 0)
        show("b", messages, cursor)
        show("b", *(await b.recv(messages[0].seq, 0)))  # unacknowledged: delivered again
        log.append(await b.recv(cursor, 0) == ([], cursor))  # acknowledged: gone
        log.append(await a.broadcast(b"all"))
        for who, t in (("b", b), ("c", c)):
            show(who, *(await t.recv(cursor if who == "b" else 0, 0)))
        log.append(await a.recv(0, 0))

        got: list[bytes] = []
        _, cursor = await b.recv(cursor, 0)
        _, cursor = await b.recv(cursor, 0)

        async def poll() -> None:
            new, _ = await b.recv(cursor, 30)
            got.extend(m.data for m in new)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(poll)
                await trio.testing.wait_all_tasks_blocked()
                await c.send(b_id, b"wake")
        log.append(got)

        data = bytes(range(256)) * 100
        blob = await a.put_blob(data)
        log.append((blob == hashlib.sha256(data).hexdigest(), await b.has_blob(blob),
                    await c.get_blob(blob, max_size=len(data)) == data))
        for call in (c.get_blob(blob, max_size=10), c.get_blob("0" * 64, max_size=10)):
            try:
                await call
            except (BlobCorrupt, BlobMissing) as exc:
                log.append(type(exc).__name__)
        log.append(await c.has_blob("0" * 64))
        try:
            await a.send(b_id, b"x" * (256 * 1024 + 1))
        except RelayLimit as exc:
            log.append((exc.status, exc.retry_after, exc.code))
        log.append(sorted(await c.roster()) == sorted(proof for _, proof in members))
    return log


async def test_memory_relay_matches_the_https_relay(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with MemoryRelay() as memory:
        in_memory = await scenario(memory.client)
    running: RelayRunning = await nursery.start(
        serve, RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0")
    )

    def https(pool: str, key: Ed25519PrivateKey, proof: Proof) -> Transport:
        return RelayClient(running.url, running.fingerprint, pool=pool, peer_key=key, proof=proof)

    over_https = await scenario(https)
    assert in_memory == over_https
    assert in_memory[0] == ("b", [(0, "a", b"m0"), (1, "a", b"m1"), (2, "a", b"m2")], 2)
    assert in_memory[3] == 2 and in_memory[6] == ([], 0)  # broadcast skipped its sender
    assert "BlobCorrupt" in in_memory and "BlobMissing" in in_memory
    assert (413, None, ErrorCode.TOO_LARGE) in in_memory


# -- helpers --------------------------------------------------------------------------


def public_hex_of(transport: Transport) -> str:
    """The peer id a transport logged in as (both kinds name it ``peer``)."""
    peer: str = transport.peer  # type: ignore[attr-defined]
    return peer


def bytes_counted(transport: Transport, way: str) -> int:
    """``bytes_sent`` or ``bytes_received``: both kinds count payload bytes."""
    return int(getattr(transport, f"bytes_{way}"))
