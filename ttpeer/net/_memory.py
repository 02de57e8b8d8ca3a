"""An in-memory relay with the HTTPS relay's semantics, for tests and the simulator.

``MemoryRelay`` holds mailboxes, rosters and blobs in dicts; ``client()`` hands
each peer a ``MemoryTransport`` that implements ``Transport`` exactly as
``RelayClient`` does: admission checks the membership proof, ``recv`` acks by
cursor and long-polls on a ``trio.Event``, broadcast skips the sender, blobs are
checked against their hash and kept ``blob_ttl`` seconds (trio's clock) after their last
upload or touch, and the same limits (``ttpeer_wire``'s) answer with the
same errors and codes. ``tests/unit/test_relay_contract.py`` holds both relays to that.

Faults. A ``Faults`` decides, for each delivery of a message to one recipient,
whether it is dropped, duplicated, or delayed (and so reordered). Each decision
comes from a ``random.Random`` seeded with (seed, sender, recipient, n-th message
between them), so a seed gives the same faults however trio interleaves tasks.
Delays are ``trio.sleep`` calls in a nursery the relay owns (enter it with
``async with``), so they follow trio's clock, including ``MockClock``.
Setting ``relay.available = False`` makes every call fail with
``RelayUnavailable``, as a relay that is down would.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import (
    BLOB_TTL,
    MAILBOX_BYTES,
    MAILBOX_MESSAGES,
    MAX_BLOB_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_WAIT,
    POOL_QUOTA,
    RECV_MAX_BYTES,
    RECV_MAX_COUNT,
    ErrorCode,
    ProofError,
    Record,
    parse,
    public_hex,
    token_used_by,
    token_used_message,
    verify_admit,
    verify_proof,
    verify_revocation,
)

from ._errors import BlobCorrupt, BlobMissing, RelayLimit, RelayRejected, RelayUnavailable
from ._transport import Message, check_blob_name, check_range, check_touch

URL = "memory://relay"


@dataclass
class Faults:
    """Per-delivery fault probabilities; delays are uniform in (0, max_delay] seconds."""

    seed: int = 0
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    max_delay: float = 1.0
    _counts: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)

    def plan(self, sender: str, recipient: str) -> list[float]:
        """Delays of the copies to deliver: [] drops, [0.0] is a clean delivery."""
        n = self._counts.get((sender, recipient), 0)
        self._counts[(sender, recipient)] = n + 1
        rng = random.Random(f"{self.seed}/{sender}/{recipient}/{n}")
        if rng.random() < self.drop:
            return []
        copies = 2 if rng.random() < self.duplicate else 1
        return [rng.uniform(0, self.max_delay) if rng.random() < self.delay else 0.0
                for _ in range(copies)]


@dataclass
class _Mailbox:
    messages: deque[Message] = field(default_factory=deque)
    next_seq: int = 1
    bytes: int = 0
    changed: trio.Event = field(default_factory=trio.Event)


class MemoryRelay:
    """The relay, in memory. ``async with`` it when ``faults`` may delay messages."""

    def __init__(
        self,
        *,
        faults: Faults | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        mailbox_messages: int = MAILBOX_MESSAGES,
        mailbox_bytes: int = MAILBOX_BYTES,
        max_blob_bytes: int = MAX_BLOB_BYTES,
        pool_quota: int = POOL_QUOTA,
        blob_seconds: float = 0.0,
        blob_ttl: float = BLOB_TTL,
    ) -> None:
        self.faults = faults
        # Each blob upload and download takes this long (a link's latency and bandwidth, for
        # simulations of the sync cadence; under trio's MockClock it costs no real time).
        self.blob_seconds = blob_seconds
        # A peer (its node id) whose blob transfers take this long instead: its slow link.
        self.peer_blob_seconds: dict[str, float] = {}
        self.max_message_bytes = max_message_bytes
        self.mailbox_messages = mailbox_messages
        self.mailbox_bytes = mailbox_bytes
        self.max_blob_bytes = max_blob_bytes
        self.pool_quota = pool_quota
        self.blob_ttl = blob_ttl
        self.available = True
        self.rosters: dict[str, dict[str, list[bytes]]] = {}
        self.revoked: dict[str, set[str]] = {}  # pool -> peers whose sessions are refused
        self.admits: dict[str, dict[str, dict[str, Record]]] = {}  # pool -> invite -> join id -> admit
        self.blobs: dict[str, dict[str, bytes]] = {}  # pool -> sha256 hex -> bytes
        # pool -> sha256 hex -> trio time of its last upload or touch (a blob a test put in
        # ``blobs`` itself counts from when the relay first looks at it)
        self.blob_times: dict[str, dict[str, float]] = {}
        self.touches = 0  # touch requests answered, for tests measuring what pinning costs
        self.blob_gets: Counter[tuple[str, str]] = Counter()  # (peer, blob) -> whole GETs
        self._mailboxes: dict[tuple[str, str], _Mailbox] = {}
        self._nursery: trio.Nursery | None = None
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None

    async def __aenter__(self) -> MemoryRelay:
        if self._nursery_manager is not None:
            raise RuntimeError("a MemoryRelay can be entered once")
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._nursery is None or self._nursery_manager is None:
            return None
        self._nursery.cancel_scope.cancel()  # deliveries still in flight are lost
        self._nursery = None
        return await self._nursery_manager.__aexit__(exc_type, exc, tb)

    def client(self, pool: str, peer_key: Ed25519PrivateKey, proof: list[bytes]) -> MemoryTransport:
        return MemoryTransport(self, pool, peer_key, proof)

    # -- used by MemoryTransport ----------------------------------------------------

    def _check_up(self) -> None:
        if not self.available:
            raise RelayUnavailable(URL, "the in-memory relay is marked unavailable")

    def _box(self, pool: str, peer: str) -> _Mailbox:
        return self._mailboxes.setdefault((pool, peer), _Mailbox())

    def _accept(self, pool: str, sender: str, recipient: str, data: bytes) -> None:
        """Check the caps like the relay would, then deliver (through the faults)."""
        box = self._box(pool, recipient)
        if len(box.messages) >= self.mailbox_messages or box.bytes + len(data) > self.mailbox_bytes:
            raise RelayLimit(URL, 507, f"mailbox of peer {recipient[:16]}... is full", 5.0,
                             code=ErrorCode.MAILBOX_FULL)
        delays = [0.0] if self.faults is None else self.faults.plan(sender, recipient)
        for delay in delays:
            if delay == 0:
                self._deliver(box, sender, data)
                continue
            if self._nursery is None:
                raise RuntimeError("delaying faults need `async with MemoryRelay(...)`")
            self._nursery.start_soon(self._deliver_later, delay, box, sender, data)

    async def _deliver_later(self, delay: float, box: _Mailbox, sender: str, data: bytes) -> None:
        await trio.sleep(delay)
        self._deliver(box, sender, data)

    def _serve_blob(self, pool: str, blob: str) -> bytes | None:
        """The bytes the relay answers a fetch with; the transport checks them like a client."""
        return self._held(pool, blob)

    def _held(self, pool: str, blob: str) -> bytes | None:
        """The blob's bytes, or None if missing or past its TTL (then dropped, as the
        relay's sweep would)."""
        blobs = self.blobs.get(pool, {})
        if blob not in blobs:
            return None
        times = self.blob_times.setdefault(pool, {})
        now = trio.current_time()
        if now - times.setdefault(blob, now) > self.blob_ttl:
            del blobs[blob], times[blob]
            return None
        return blobs[blob]

    def _touch(self, pool: str, blobs: list[str]) -> list[str]:
        """Restart the TTL of the held ones of ``blobs``; the others, in order."""
        self.touches += 1
        missing = []
        for blob in dict.fromkeys(blobs):
            if self._held(pool, blob) is None:
                missing.append(blob)
            else:
                self.blob_times[pool][blob] = trio.current_time()
        return missing

    @staticmethod
    def _deliver(box: _Mailbox, sender: str, data: bytes) -> None:
        box.messages.append(Message(box.next_seq, sender, data))
        box.next_seq += 1
        box.bytes += len(data)
        box.changed.set()
        box.changed = trio.Event()


class MemoryTransport:
    """One peer's ``Transport`` to a ``MemoryRelay``."""

    def __init__(
        self, relay: MemoryRelay, pool: str, peer_key: Ed25519PrivateKey, proof: list[bytes]
    ) -> None:
        self.relay = relay
        self.pool = pool
        self.peer = public_hex(peer_key)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._proof = list(proof)
        self._connected = False
        self.blob_ttl: float | None = None  # as the relay's session answer tells it

    # -- as a node's whole pool (PoolTransport): one relay, nothing to revive or spool ------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def set_relays(self, relays: Sequence[tuple[str, str]]) -> None:
        """A test pool has its one memory relay, whatever the records say."""

    def describe(self) -> list[dict[str, Any]]:
        return []

    def spooled(self, name: str) -> Path | None:
        return None

    async def __aenter__(self) -> MemoryTransport:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _ready(self) -> None:
        self.relay._check_up()
        if not self._connected:
            raise RelayUnavailable(URL, "not connected; call connect() first")
        self._check_revoked()

    def _check_revoked(self) -> None:
        if self.peer in self.relay.revoked.get(self.pool, ()):
            raise RelayRejected(URL, 403, "this peer was revoked from the pool", code=ErrorCode.REVOKED)

    async def connect(self) -> None:
        self.relay._check_up()
        self._check_revoked()
        try:
            verify_proof(self.pool, self.peer, self._proof)
        except ProofError as exc:
            raise RelayRejected(URL, 403, f"bad membership proof: {exc}", code=ErrorCode.BAD_PROOF) from None
        invite, join = parse(self._proof[0]), parse(self._proof[1])
        used = token_used_by(self.relay.admits.get(self.pool, {}).get(invite.id, {}), invite, join.id)
        if used is not None:
            acked = self.relay.admits[self.pool][invite.id].values()
            raise RelayRejected(URL, 403, token_used_message(used), code=ErrorCode.TOKEN_USED,
                                records=tuple(r.raw for r in acked))
        self.relay.rosters.setdefault(self.pool, {})[self.peer] = list(self._proof)
        self._connected = True
        self.blob_ttl = self.relay.blob_ttl
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._connected = False
        await trio.lowlevel.checkpoint()

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.relay.max_message_bytes:
            raise RelayLimit(URL, 413, f"body is over the {self.relay.max_message_bytes}-byte cap",
                             None, code=ErrorCode.TOO_LARGE)

    async def send(self, peer: str, data: bytes) -> None:
        self._ready()
        self._check_size(data)
        self.relay._accept(self.pool, self.peer, peer, data)
        self.bytes_sent += len(data)
        await trio.lowlevel.checkpoint()

    async def broadcast(self, data: bytes) -> int:
        self._ready()
        self._check_size(data)
        delivered = 0
        for peer in sorted(self.relay.rosters.get(self.pool, {})):
            if peer == self.peer:
                continue
            try:
                self.relay._accept(self.pool, self.peer, peer, data)
                delivered += 1
            except RelayLimit:
                pass
        self.bytes_sent += len(data)
        await trio.lowlevel.checkpoint()
        return delivered

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        self._ready()
        if after < 0 or wait < 0:
            raise RelayRejected(URL, 400, "after and wait must not be negative", code=ErrorCode.BAD_REQUEST)
        box = self.relay._box(self.pool, self.peer)
        while box.messages and box.messages[0].seq <= after:
            box.bytes -= len(box.messages.popleft().data)
        with trio.move_on_after(min(wait, MAX_WAIT)):
            while not box.messages:
                await box.changed.wait()
        await trio.lowlevel.checkpoint()
        self.relay._check_up()
        messages: list[Message] = []
        size = 0
        for message in box.messages:  # the same answer size caps as the HTTPS relay
            if messages and (len(messages) >= RECV_MAX_COUNT
                             or size + len(message.data) > RECV_MAX_BYTES):
                break
            messages.append(message)
            size += len(message.data)
        self.bytes_received += sum(len(m.data) for m in messages)
        return messages, messages[-1].seq if messages else after

    async def admit(self, record: bytes) -> None:
        self._ready()
        try:
            rec = verify_admit(self.pool, record)
        except ProofError as exc:
            raise RelayRejected(URL, 403, f"bad acknowledgement: {exc}", code=ErrorCode.BAD_ADMIT) from None
        self.relay.admits.setdefault(self.pool, {}).setdefault(rec["invite"], {})[rec["join"]] = rec
        await trio.lowlevel.checkpoint()

    async def revoke(self, record: bytes) -> None:
        self._ready()
        try:
            node = verify_revocation(self.pool, record)
        except ProofError as exc:
            raise RelayRejected(URL, 403, f"bad revocation: {exc}", code=ErrorCode.BAD_REVOCATION) from None
        self.relay.revoked.setdefault(self.pool, set()).add(node)
        self.relay.rosters.get(self.pool, {}).pop(node, None)
        await trio.lowlevel.checkpoint()

    async def roster(self) -> list[list[bytes]]:
        self._ready()
        await trio.lowlevel.checkpoint()
        roster = self.relay.rosters.get(self.pool, {})
        return [list(roster[peer]) for peer in sorted(roster)]

    def _pool_blobs(self) -> dict[str, bytes]:
        return self.relay.blobs.setdefault(self.pool, {})

    async def has_blob(self, blob: str) -> bool:
        check_blob_name(blob)
        self._ready()
        await trio.lowlevel.checkpoint()
        return self.relay._held(self.pool, blob) is not None

    async def touch_blobs(self, blobs: list[str]) -> list[str]:
        check_touch(blobs)
        self._ready()
        await trio.lowlevel.checkpoint()
        return self.relay._touch(self.pool, blobs)

    async def put_blob(self, data: bytes) -> str:
        self._ready()
        blob = hashlib.sha256(data).hexdigest()
        blobs = self._pool_blobs()
        if self.relay._held(self.pool, blob) is None:
            for held in list(blobs):  # expired ones count against no quota (the relay sweeps them)
                self.relay._held(self.pool, held)
            if len(data) > self.relay.max_blob_bytes:
                raise RelayLimit(URL, 413, f"blob is over the {self.relay.max_blob_bytes}-byte cap",
                                 None, code=ErrorCode.TOO_LARGE)
            if sum(map(len, blobs.values())) + len(data) > self.relay.pool_quota:
                raise RelayLimit(URL, 507, "pool quota exceeded", None, code=ErrorCode.POOL_QUOTA)
            blobs[blob] = bytes(data)
            self.bytes_sent += len(data)
        self.relay.blob_times.setdefault(self.pool, {})[blob] = trio.current_time()  # a re-upload too
        await self._transfer()
        return blob

    async def _transfer(self) -> None:
        seconds = self.relay.peer_blob_seconds.get(self.peer, self.relay.blob_seconds)
        if seconds > 0:
            await trio.sleep(seconds)
        else:
            await trio.lowlevel.checkpoint()

    async def put_blob_file(self, path: Path) -> str:
        return await self.put_blob(path.read_bytes())

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        path.write_bytes(await self.get_blob(blob, max_size=max_size))

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        check_blob_name(blob)
        check_range(start, stop)
        self._ready()
        await self._transfer()
        data = self.relay._serve_blob(self.pool, blob)
        if data is None:
            raise BlobMissing(blob)
        if stop > len(data):
            raise BlobCorrupt(blob, f"range [{start}, {stop}) is past its end ({len(data)} bytes)")
        self.bytes_received += stop - start
        return data[start:stop]

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        check_blob_name(blob)
        self._ready()
        await self._transfer()
        data = self.relay._serve_blob(self.pool, blob)
        if data is None:
            raise BlobMissing(blob)
        if len(data) > max_size:
            raise BlobCorrupt(blob, f"it is {len(data)} bytes, over {max_size}")
        if hashlib.sha256(data).hexdigest() != blob:
            raise BlobCorrupt(blob, "its bytes do not hash to its name")
        self.bytes_received += len(data)
        self.relay.blob_gets[(self.peer, blob)] += 1
        return data

