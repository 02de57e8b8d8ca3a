"""Gossip payloads: records pushed as they are made, and anti-entropy digests.

Theory of operation. A new record is broadcast at once. Every few seconds a peer
broadcasts a digest (short prefixes of the ids it holds); a peer that holds
records missing from someone's digest sends them to that peer. Loss, duplication
and reordering of either payload are harmless: records merge by set union, and
the next digest repairs any gap. Payloads are plain canonical values here; the
daemon seals them before they reach the relay.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from . import _codec
from ._errors import RecordError

MAX_PAYLOAD_BYTES = 240 * 1024  # under the relay's 256 KiB mailbox message cap
ID_PREFIX = 16  # hex chars of a record id in a digest: 64 bits, collisions are harmless
MAX_DIGEST_IDS = 12_000


def records_payloads(raws: Iterable[bytes]) -> Iterator[bytes]:
    """Pack record bytes into as few payloads as fit under the size cap."""
    batch: list[str] = []
    size = 32
    for raw in raws:
        item = raw.hex()
        if batch and size + len(item) + 3 > MAX_PAYLOAD_BYTES:
            yield _codec.encode({"t": "records", "r": batch})
            batch, size = [], 32
        batch.append(item)
        size += len(item) + 3
    if batch:
        yield _codec.encode({"t": "records", "r": batch})


def digest_payload(ids: Iterable[str]) -> bytes:
    prefixes = sorted({i[:ID_PREFIX] for i in ids})[-MAX_DIGEST_IDS:]
    return _codec.encode({"t": "digest", "ids": prefixes})


def parse_payload(data: bytes) -> tuple[str, Any]:
    """Returns ("records", [bytes, ...]) or ("digest", set[str]). Raises RecordError."""
    obj = _codec.decode(data, max_size=MAX_PAYLOAD_BYTES + 1024)
    if type(obj) is not dict:
        raise RecordError("gossip payload is not an object")
    if obj.get("t") == "records" and type(obj.get("r")) is list and set(obj) == {"t", "r"}:
        try:
            return "records", [bytes.fromhex(x) for x in obj["r"] if type(x) is str]
        except ValueError:
            raise RecordError("gossip records are not hex") from None
    if obj.get("t") == "digest" and type(obj.get("ids")) is list and set(obj) == {"t", "ids"}:
        ids = obj["ids"]
        if len(ids) > MAX_DIGEST_IDS or not all(type(x) is str and len(x) == ID_PREFIX for x in ids):
            raise RecordError("gossip digest is malformed")
        return "digest", set(ids)
    raise RecordError("unknown gossip payload")
