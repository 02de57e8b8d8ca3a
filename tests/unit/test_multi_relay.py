"""``MultiRelay``: a pool's several relays behind one ``Transport``.

Two (or three) in-memory relays, switched off and on with ``available``; one real HTTPS
relay on loopback for the certificate pin. A pool of one relay through ``MultiRelay`` is
the relay contract's third kind (``test_relay_contract.py``). Waits are bounded.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_relay import RelayConfig, RelayRunning, serve

from ttpeer.net import MemoryRelay, RelayClient, RelayUnavailable, Transport
from ttpeer.net._multi import MultiRelay
from ttpeer.net._relayset import DOWN, LIVE, WRONG_CERT
from ttpeer.proto import public_hex

from .test_relay import Pool

FP = "sha256:" + "ab" * 32


def urls(n: int) -> list[tuple[str, str]]:
    return [(f"https://relay{i}.example", FP) for i in range(n)]


@asynccontextmanager
async def peer(relays: list[MemoryRelay], pool: Pool, name: str, *, spool: Path | None = None,
               identity: tuple[Ed25519PrivateKey, list[bytes]] | None = None,
               run: trio.Nursery | None = None, listed: list[tuple[str, str]] | None = None,
               ) -> AsyncIterator[MultiRelay]:
    """A member's ``MultiRelay`` over ``relays`` (relay i at https://relayi.example)."""
    key, proof = identity or pool.member(name)

    def make(url: str, _fp: str) -> Transport:
        return relays[int(url.removeprefix("https://relay").split(".")[0])].client(pool.id, key, proof)

    multi = MultiRelay(listed or urls(len(relays)), make, spool=spool)
    await multi.connect()
    if run is not None:
        run.start_soon(multi.run)
    try:
        yield multi
    finally:
        await multi.aclose()


async def until(condition, what: str, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Wait (bounded) for ``condition()``, letting the other tasks run."""
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.01)


def mailbox(relay: MemoryRelay, pool: Pool, who: MultiRelay) -> list[bytes]:
    return [m.data for m in relay._box(pool.id, who.peer).messages]


async def test_a_message_goes_through_every_relay_and_arrives_once(pool: Pool) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    async with peer(relays, pool, "alice") as alice, peer(relays, pool, "bob") as bob:
        await alice.send(bob.peer, b"hello")
        assert mailbox(relays[0], pool, bob) == mailbox(relays[1], pool, bob) == [b"hello"]
        got, cursor = await bob.recv(0, 0)
        assert [(m.sender, m.data) for m in got] == [(alice.peer, b"hello")]
        # The copy through the other relay is dropped, and both relays are told it is done.
        again, cursor = await bob.recv(cursor, 0)
        assert again == []
        await bob.recv(cursor, 0)
        assert mailbox(relays[0], pool, bob) == mailbox(relays[1], pool, bob) == []
        # A genuine resend of the same bytes is a new message: it arrives again, once.
        await alice.send(bob.peer, b"hello")
        got, cursor = await bob.recv(cursor, 0)
        more, cursor = await bob.recv(cursor, 0)
        assert [m.data for m in got + more] == [b"hello"]
        # Broadcast: each relay delivers to its roster; the count is the best relay's.
        assert await alice.broadcast(b"all") == 1


async def test_an_unacknowledged_message_comes_again_after_a_crash(pool: Pool) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    bob_identity = pool.member("bob")
    async with peer(relays, pool, "alice") as alice:
        async with peer(relays, pool, "bob", identity=bob_identity) as bob:
            await alice.send(bob.peer, b"once")
            got, _cursor = await bob.recv(0, 0)
            assert [m.data for m in got] == [b"once"]
        # bob "crashed" before acknowledging: a new daemon starts from cursor 0 and gets it.
        async with peer(relays, pool, "bob", identity=bob_identity) as bob:
            got, _cursor = await bob.recv(0, 0)
            assert [m.data for m in got] == [b"once"]


async def test_a_dead_relay_loses_no_message_and_does_not_stop_the_pool(pool: Pool) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    async with peer(relays, pool, "alice") as alice, peer(relays, pool, "bob") as bob:
        relays[0].available = False
        await alice.send(bob.peer, b"still here")  # through relay 1; relay 0 is marked down
        got, _cursor = await bob.recv(0, 1)
        assert [m.data for m in got] == [b"still here"]
        states = {d["url"]: (d["state"], d["primary"]) for d in alice.describe()}
        assert states == {"https://relay0.example": (DOWN, False), "https://relay1.example": (LIVE, True)}
        relays[1].available = False
        with pytest.raises(RelayUnavailable, match="no relay of the pool answers"):
            await alice.send(bob.peer, b"lost")


async def test_a_blob_held_only_by_a_dead_relay_is_sent_again_through_another(
        pool: Pool, tmp_path: Path, nursery: trio.Nursery) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    async with peer(relays, pool, "alice", spool=tmp_path / "spool", run=nursery) as alice, \
            peer(relays, pool, "bob") as bob:
        delta = b"delta " * 1000
        state = tmp_path / "state.sealed"
        state.write_bytes(b"state " * 1000)
        small = await alice.put_blob(delta)
        large = await alice.put_blob_file(state)
        state.unlink()  # the daemon removes its work file; the spool's link keeps the bytes
        assert set(relays[0].blobs[pool.id]) == {small, large}  # the primary only
        assert pool.id not in relays[1].blobs
        relays[0].available = False
        await alice.send(bob.peer, b"x")  # alice notices the relay is gone ...
        await until(lambda: alice.resent == 2, "both sent again")
        assert set(relays[1].blobs[pool.id]) == {small, large}
        # ... and bob, who never uploaded, fetches both from the relay that lives.
        assert await bob.get_blob(small, max_size=10**6) == delta
        out = tmp_path / "fetched"
        await bob.get_blob_file(large, out, max_size=10**6)
        assert out.read_bytes() == b"state " * 1000


async def test_a_relay_that_comes_back_is_used_again(pool: Pool, nursery: trio.Nursery,
                                                     autojump_clock: trio.abc.Clock) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    async with peer(relays, pool, "alice", run=nursery) as alice, peer(relays, pool, "bob") as bob:
        for r in relays:
            r.available = False
        with pytest.raises(RelayUnavailable):
            await alice.send(bob.peer, b"x")
        with pytest.raises(RelayUnavailable):
            await alice.recv(0, 0)
        relays[1].available = True
        await until(lambda: [d["state"] for d in alice.describe()] == [DOWN, LIVE], "revived", 120)
        await alice.send(bob.peer, b"back")
        assert mailbox(relays[1], pool, bob) == [b"back"]


async def test_a_relay_added_later_carries_messages(pool: Pool, nursery: trio.Nursery) -> None:
    relays = [MemoryRelay(), MemoryRelay()]
    async with peer(relays, pool, "alice", run=nursery, listed=urls(1)) as alice, \
            peer(relays, pool, "bob", listed=urls(2)[1:]) as bob:
        # alice knows relay 0 only, bob relay 1 only: they cannot meet ...
        await alice.send(bob.peer, b"unheard")
        assert mailbox(relays[1], pool, bob) == []
        alice.set_relays(urls(2))  # ... until the pool's newest relays record lists both
        await until(lambda: [d["state"] for d in alice.describe()] == [LIVE, LIVE], "connected")
        await alice.send(bob.peer, b"heard")
        got, _cursor = await bob.recv(0, 1)
        assert [m.data for m in got] == [b"heard"]
        alice.set_relays(urls(2)[1:])  # and a relay removed is dropped
        assert [d["url"] for d in alice.describe()] == ["https://relay1.example"]


async def test_a_relay_with_another_certificate_is_skipped_with_a_warning(
        pool: Pool, tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    running: RelayRunning = await nursery.start(serve, RelayConfig(data=tmp_path / "relay", listen="127.0.0.1:0"))
    memory = MemoryRelay()
    key, proof = pool.member("alice")

    def make(url: str, fp: str) -> Transport:
        if url == running.url:
            return RelayClient(url, fp, pool=pool.id, peer_key=key, proof=proof)
        return memory.client(pool.id, key, proof)

    multi = MultiRelay([(running.url, FP), ("https://relay1.example", FP)], make)
    with caplog.at_level(logging.WARNING, logger="ttpeer.net"):
        await multi.connect()
    try:
        assert [d["state"] for d in multi.describe()] == [WRONG_CERT, LIVE]
        warned = [r.getMessage() for r in caplog.records if "presents certificate" in r.getMessage()]
        assert len(warned) == 1 and running.url in warned[0] and running.fingerprint in warned[0]
        assert multi.describe()[1]["primary"]
        blob = await multi.put_blob(b"goes to the relay that is ours")
        assert blob in memory.blobs[pool.id]
    finally:
        await multi.aclose()
    assert public_hex(key) == multi.peer


async def test_a_relay_that_restarted_empty_gets_our_blobs_again(pool: Pool, nursery: trio.Nursery,
                                                                 autojump_clock: trio.abc.Clock) -> None:
    relay = MemoryRelay()
    async with peer([relay], pool, "alice", run=nursery) as alice:
        blob = await alice.put_blob(b"a delta nobody has fetched yet")
        relay.available = False  # the relay restarts ...
        relay.blobs.clear()  # ... with an empty disk
        with pytest.raises(RelayUnavailable):
            await alice.send(alice.peer, b"x")
        relay.available = True
        await until(lambda: alice.resent == 1, "the blob sent again", 120)
        assert blob in relay.blobs[pool.id]
