"""MemoryRelay's own side: both transports are ``Transport``s, the in-memory relay's
availability switch and tampering, and its faults are deterministic.

That it keeps the HTTPS relay's promises is ``test_relay_contract.py``: one suite run
against both relays, and one scenario whose two transcripts must be equal. Fault
injection runs under trio's MockClock: a seed gives the same drops, duplicates, delays
and order every time.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import ttpeer.net
from ttpeer.net import (
    BlobCorrupt,
    BlobMissing,
    Faults,
    MemoryRelay,
    PoolTransport,
    RelayClient,
    RelayRejected,
    RelayUnavailable,
    Transport,
)
from ttpeer.proto import pool_id_of, public_hex, sign

Proof = list[bytes]


def _key(fixed: str | None, name: str) -> Ed25519PrivateKey:
    if fixed is None:
        return Ed25519PrivateKey.generate()
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{fixed}/{name}".encode()).digest())


def make_pool(n: int, fixed: str | None = None) -> tuple[str, list[tuple[Ed25519PrivateKey, Proof]]]:
    """A pool of ``n`` members; with ``fixed``, the same keys every time."""
    root = _key(fixed, "root")
    pool = pool_id_of(public_hex(root))
    invite_key = _key(fixed, "invite")
    invite = sign("invite", pool, {"key": public_hex(invite_key), "expires": 2**40, "uses": 50,
                                   "role": "member"}, root)
    members = []
    for i in range(n):
        node = _key(fixed, f"node{i}")
        seal = X25519PrivateKey.generate().public_key().public_bytes_raw().hex()
        join = sign("join", pool, {"invite": invite.id, "node": public_hex(node), "seal": seal,
                                   "name": f"p{i}", "at": 1}, invite_key)
        members.append((node, [invite.raw, join.raw]))
    return pool, members


def test_both_transports_satisfy_the_protocol() -> None:
    pool, [(key, proof)] = make_pool(1)
    methods = {"connect", "send", "broadcast", "recv", "roster", "put_blob", "get_blob", "put_blob_file",
               "get_blob_file", "get_blob_range", "has_blob", "aclose", "revoke", "admit", "touch_blobs", "blob_ttl",
               "bytes_sent", "bytes_received"}
    declared = {name for name in vars(Transport) if not name.startswith("_")}
    assert declared == methods
    assert isinstance(MemoryRelay().client(pool, key, proof), Transport)
    assert isinstance(RelayClient("https://127.0.0.1:1", "sha256:" + "0" * 64, pool=pool,
                                  peer_key=key, proof=proof), Transport)
    # What a node drives besides (the pool's relays as one): the memory relay's client too.
    pooled = {"run", "set_relays", "describe", "spooled"}
    assert {name for name in vars(PoolTransport) if not name.startswith("_")} == pooled
    memory = MemoryRelay().client(pool, key, proof)
    assert all(callable(getattr(memory, name)) for name in pooled) and memory.describe() == []


def test_public_surface() -> None:
    assert sorted(ttpeer.net.__all__) == sorted([
        "BlobCorrupt", "BlobMissing", "ErrorCode", "Faults", "MemoryRelay", "MemoryTransport", "Message",
        "MultiRelay", "NetError", "PoolTransport", "RelayClient", "RelayFingerprintMismatch", "RelayLimit",
        "RelayRejected",
        "RelayUnavailable", "Transport", "fetch_certificate", "fingerprint", "fingerprint_of",
        "login_message", "pinned_ssl_context",
    ])
    for name in ttpeer.net.__all__:
        assert getattr(ttpeer.net, name) is not None
    assert issubclass(ttpeer.net.NetError, ttpeer.proto.TtpeerError)
    for name in ("RelayUnavailable", "RelayRejected", "RelayFingerprintMismatch", "RelayLimit",
                 "BlobMissing", "BlobCorrupt"):
        assert issubclass(getattr(ttpeer.net, name), ttpeer.net.NetError)


async def test_memory_admission_availability_and_tampering() -> None:
    pool, [(key_a, proof_a), (key_b, proof_b)] = make_pool(2)
    relay = MemoryRelay()
    with pytest.raises(RelayRejected) as info:
        await relay.client(pool, key_a, proof_b).connect()
    assert info.value.status == 403
    a = relay.client(pool, key_a, proof_a)
    with pytest.raises(RelayUnavailable):
        await a.send(public_hex(key_b), b"before connect")
    await a.connect()
    blob = await a.put_blob(b"payload")
    relay.blobs[pool][blob] = b"tampered"
    with pytest.raises(BlobCorrupt):
        await a.get_blob(blob, max_size=100)
    relay.available = False
    with pytest.raises(RelayUnavailable):
        await a.roster()
    relay.available = True
    assert len(await a.roster()) == 1


async def test_memory_blobs_lapse_with_their_ttl_unless_touched_or_uploaded_again(autojump_clock: object) -> None:
    pool, [(key, proof)] = make_pool(1)
    relay = MemoryRelay(blob_ttl=100.0, pool_quota=2000)
    a = relay.client(pool, key, proof)
    assert a.blob_ttl is None  # not logged in yet
    await a.connect()
    assert a.blob_ttl == 100.0
    touched, again, left = [await a.put_blob(bytes([i]) * 600) for i in range(3)]
    await trio.sleep(90)
    assert await a.touch_blobs([touched]) == []
    await a.put_blob(bytes([1]) * 600)  # a repeated upload restarts the TTL too
    await trio.sleep(20)  # 110 s after the uploads, 20 s after the touch
    await a.put_blob(bytes([3]) * 600)  # the lapsed one's room is free: 3 x 600 bytes fit the quota
    assert [await a.has_blob(b) for b in (touched, again, left)] == [True, True, False]
    assert await a.touch_blobs([left, touched]) == [left] and relay.touches == 2
    await trio.sleep(101)
    assert await a.touch_blobs([touched, again]) == [touched, again]
    with pytest.raises(BlobMissing):
        await a.get_blob(touched, max_size=1000)


@asynccontextmanager
async def faulty_pair(seed: int) -> AsyncIterator[tuple[Transport, Transport, str]]:
    pool, [(key_a, proof_a), (key_b, proof_b)] = make_pool(2, fixed="faults")
    faults = Faults(seed=seed, drop=0.2, duplicate=0.2, delay=0.5, max_delay=1.0)
    async with MemoryRelay(faults=faults) as relay:
        a, b = relay.client(pool, key_a, proof_a), relay.client(pool, key_b, proof_b)
        await a.connect()
        await b.connect()
        yield a, b, public_hex(key_b)


async def faulty_run(seed: int) -> list[Any]:
    """Send 40 numbered messages through a faulty relay; return what arrived, and when."""
    start = trio.current_time()
    arrived: list[tuple[float, int, bytes]] = []
    async with faulty_pair(seed) as (a, b, b_id):

        async def sender() -> None:
            for i in range(40):
                await a.send(b_id, b"%02d" % i)
                await trio.sleep(0.05)

        async def receiver() -> None:
            cursor = 0
            with trio.move_on_after(10):
                while True:
                    messages, cursor = await b.recv(cursor, 5)
                    arrived.extend((round(trio.current_time() - start, 6), m.seq, m.data)
                                   for m in messages)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            nursery.start_soon(receiver)
    return arrived


async def test_faults_are_deterministic_for_a_seed(autojump_clock: trio.testing.MockClock) -> None:
    first, again, other = await faulty_run(7), await faulty_run(7), await faulty_run(8)
    assert first == again
    assert first != other
    payloads = [data for _, _, data in first]
    assert len(set(payloads)) < 40  # some were dropped
    assert len(payloads) > len(set(payloads))  # some were duplicated
    assert payloads != sorted(payloads)  # some were delayed past later ones
    seqs = [seq for _, seq, _ in first]
    assert seqs == sorted(set(seqs))  # the relay's seqs still only increase


async def test_delays_need_the_relay_nursery() -> None:
    pool, [(key_a, proof_a), (key_b, _)] = make_pool(2)
    relay = MemoryRelay(faults=Faults(seed=1, delay=1.0))
    a = relay.client(pool, key_a, proof_a)
    await a.connect()
    with pytest.raises(RuntimeError, match="async with"):
        await a.send(public_hex(key_b), b"x")
