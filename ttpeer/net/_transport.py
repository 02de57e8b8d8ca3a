"""The one interface the daemon talks to the relay through.

``RelayClient`` implements it over HTTPS; ``MemoryTransport`` implements it in
memory for tests and the simulator. Both promise the same semantics:

- ``send``/``broadcast`` queue a message in the recipients' mailboxes
  (broadcast: every peer in the pool's roster except the sender);
- ``recv(after, wait)`` first acknowledges (deletes) every message with
  ``seq <= after``, then returns what follows, waiting up to ``wait`` seconds
  for a first message, with the new cursor. Delivery is at-least-once: a peer
  that crashes before acting on messages asks again with its old cursor. Seqs
  only increase, but are opaque: they need not start at 1 or be contiguous.
- blobs are content-addressed by the sha256 hex of their bytes, and fetching
  one checks that hash. The relay keeps a blob ``blob_ttl`` seconds after its last
  upload or touch (``touch_blobs``, a lease its users renew).

Every method raises only ``NetError`` subclasses (see ``ttpeer.errors``). The limits,
paths and error codes both keep are ``ttpeer_wire``'s; ``tests/unit/test_relay_contract.py``
runs one suite against both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import trio
from ttpeer_wire import TOUCH_MAX_BLOBS

_BLOB_NAME = re.compile(r"^[0-9a-f]{64}$")


def check_blob_name(blob: str) -> None:
    """Raise ``ValueError`` unless ``blob`` is a sha256 hex digest (a programming error)."""
    if not isinstance(blob, str) or not _BLOB_NAME.match(blob):
        raise ValueError(f"a blob name is 64 lowercase hex characters, not {blob!r}")


def check_range(start: int, stop: int) -> None:
    """Raise ``ValueError`` unless ``[start, stop)`` is a non-empty byte range."""
    if not 0 <= start < stop:
        raise ValueError(f"a byte range [{start}, {stop}) must start at 0 or later and hold a byte")


def check_touch(blobs: list[str]) -> None:
    """Raise ``ValueError`` unless ``blobs`` is one touch's worth of blob names."""
    if len(blobs) > TOUCH_MAX_BLOBS:
        raise ValueError(f"one touch names at most {TOUCH_MAX_BLOBS} blobs, not {len(blobs)}")
    for blob in blobs:
        check_blob_name(blob)


@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    sender: str  # the sending peer's id (Ed25519 public key, hex)
    data: bytes


@runtime_checkable
class Transport(Protocol):
    async def connect(self) -> None:
        """Check the relay and log in with the membership proof.

        Raises ``RelayFingerprintMismatch``, ``RelayRejected`` (bad proof),
        ``RelayUnavailable``.
        """

    async def send(self, peer: str, data: bytes) -> None:
        """Queue ``data`` for ``peer``. Raises ``RelayLimit`` (too big, mailbox full)."""

    async def broadcast(self, data: bytes) -> int:
        """Queue ``data`` for every other peer in the roster; returns how many got it."""

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        """Acknowledge up to ``after``; return (messages, cursor) within ``wait`` seconds."""

    async def revoke(self, record: bytes) -> None:
        """Hand the relay a root-signed ``revoke`` record: from then on it refuses the
        revoked peer's sessions and drops it from the roster. Raises ``RelayRejected``."""

    async def admit(self, record: bytes) -> None:
        """Hand the relay a root-signed ``admit`` record: once its invite's uses are all
        acknowledged, the relay refuses logins with any other join of it. Raises
        ``RelayRejected``."""

    async def roster(self) -> list[list[bytes]]:
        """Every membership proof ([invite, join]) admitted for this pool."""

    async def put_blob(self, data: bytes) -> str:
        """Store ``data``; returns its sha256 hex. Skips the upload if already there.

        Raises ``RelayLimit`` (size cap, pool quota).
        """

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        """Fetch a blob. Raises ``BlobMissing``, ``BlobCorrupt`` (bad hash, over max_size)."""

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        """Bytes ``start`` .. ``stop``-1 of a blob (an HTTP Range). A range cannot be checked
        against the blob's name: the caller authenticates what it holds (``open_cut``).
        Raises ``BlobMissing``, ``BlobCorrupt`` (other bytes than asked), ValueError for
        an empty or negative range."""

    async def put_blob_file(self, path: Path) -> str:
        """``put_blob`` of the file at ``path``, streamed: never whole in memory. Raises
        as ``put_blob`` does, and ``OSError`` reading the file."""

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        """``get_blob`` into the file ``path``, streamed; no file is left if it fails."""

    async def has_blob(self, blob: str) -> bool:
        """Whether the relay holds the blob now."""

    async def touch_blobs(self, blobs: list[str]) -> list[str]:
        """Restart the TTL of ``blobs`` (at most ``TOUCH_MAX_BLOBS``); returns those the
        relay does not hold, in order. Raises ``ValueError`` (a bad name, too many),
        ``RelayRejected`` with code ``not_found`` (a relay older than the route)."""

    @property
    def blob_ttl(self) -> float | None:
        """Seconds the relay keeps a blob after its last upload or touch, as it said at
        login; None before, or from a relay that does not say."""

    @property
    def bytes_sent(self) -> int:
        """Request bodies sent so far (blobs, messages), for status."""

    @property
    def bytes_received(self) -> int:
        """Response bodies received so far, for status."""

    async def aclose(self) -> None:
        """Release connections; the transport cannot be used after."""


class PoolTransport(Transport, Protocol):
    """What a node drives: a ``Transport`` to the pool's relays as a whole. ``MultiRelay``
    is one over HTTPS relays; a ``MemoryTransport`` is one to the only relay of a test pool."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: keep the relays connected (revive those that go down, connect new
        ones, close removed ones). Started at once."""

    def set_relays(self, relays: Sequence[tuple[str, str]]) -> None:
        """Use ``relays`` ((url, pin) pairs, the newest ``relays`` record's) from now on."""

    def describe(self) -> list[dict[str, Any]]:
        """Each relay in the pool's order: ``url``, ``fingerprint``, ``state``, ``error``,
        ``primary``; empty where there is no such view."""

    def spooled(self, name: str) -> Path | None:
        """The file of this peer's blob ``name`` as uploaded, if kept on disk; else None."""
