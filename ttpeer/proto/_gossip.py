"""Gossip payloads: records pushed as they are made, and anti-entropy digests.

Theory of operation. A new record is broadcast at once. Every few seconds a peer
broadcasts a digest (short prefixes of the ids it holds); a peer that holds
records missing from someone's digest sends them to that peer. Loss, duplication
and reordering of either payload are harmless: records merge by set union, and
the next digest repairs any gap. Payloads are plain canonical values here; the
daemon seals them before they reach the relay.

A payload may go packed (``pack``: one zstd frame of it), to a peer known to read packed
payloads (``_antientropy`` keeps who sent one): digests and records are hex in JSON, and
packing takes back about half of their bytes. A peer of a version before packing drops a
packed payload as malformed, so nobody sends one to a peer that has not shown it reads
them, except one digest in ``PROBE_EVERY`` (how peers find each other out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import zstandard
from ttpeer_wire import RecordError, decode, encode

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
            yield encode({"t": "records", "r": batch})
            batch, size = [], 32
        batch.append(item)
        size += len(item) + 3
    if batch:
        yield encode({"t": "records", "r": batch})


def digest_payload(ids: Iterable[str], turn: int = 0) -> bytes:
    """A digest of the ids held. Past ``MAX_DIGEST_IDS`` ids the id space is cut into
    equal ranges and each digest (``turn`` counts them) covers one range, so every
    record is compared within a few digests and nobody resends what is held."""
    prefixes = sorted({i[:ID_PREFIX] for i in ids})
    parts = max(1, -(-len(prefixes) // (MAX_DIGEST_IDS // 2)))
    lo, hi = _window(turn % parts, parts)
    chosen = prefixes if parts == 1 else [p for p in prefixes if in_window(p, lo, hi)]
    return encode({"t": "digest", "ids": chosen, "lo": lo, "hi": hi})


WINDOW_HEX = 8  # windows are ranges of the first 32 bits of ids
WINDOW_SPAN = _SPAN = 16**WINDOW_HEX


def _window(index: int, parts: int) -> tuple[int, int]:
    return _SPAN * index // parts, _SPAN * (index + 1) // parts


def in_window(rec_id: str, lo: int, hi: int) -> bool:
    return lo <= int(rec_id[:WINDOW_HEX], 16) < hi


PACKED = b"\x28\xb5\x2f\xfd"  # a zstd frame's magic number: a packed payload (JSON opens with "{")
PACK_LEVEL = 3
PROBE_EVERY = 2  # one digest in this many goes packed whoever may not read it (the probe)


def pack(payload: bytes) -> bytes:
    """``payload`` as one zstd frame (its size declared): what ``unpack`` reads back."""
    return zstandard.ZstdCompressor(level=PACK_LEVEL, write_content_size=True).compress(payload)


def unpack(data: bytes) -> tuple[bytes, bool]:
    """A payload as received: unpacked if it came packed, and whether it did. Raises
    RecordError for a packed payload that declares more than the payload cap, or does not
    decompress to what it declares (read before any allocation: a small hostile frame must
    not ask for gigabytes)."""
    if not data.startswith(PACKED):
        return data, False
    cap = MAX_PAYLOAD_BYTES + 1024
    try:
        declared = zstandard.frame_content_size(data)
        if not 0 <= declared <= cap:
            said = "no size" if declared < 0 else f"{declared} bytes"
            raise RecordError(f"a packed gossip payload declares {said} (it must declare at most {cap} bytes)")
        out = zstandard.ZstdDecompressor(max_window_size=1 << 20).decompress(
            data, max_output_size=declared, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise RecordError(f"a packed gossip payload does not decompress: {exc}") from None
    if len(out) != declared:
        raise RecordError(f"a packed gossip payload is {len(out)} bytes, declared {declared}")
    if out.startswith(PACKED):
        raise RecordError("a packed gossip payload holds another packed payload")
    return out, True


def parse_payload(data: bytes) -> tuple[str, Any]:
    """Returns ("records", [bytes, ...]) or ("digest", (prefixes, lo, hi)), for a payload
    packed or not. Raises RecordError."""
    data, _packed = unpack(data)
    obj = decode(data, max_size=MAX_PAYLOAD_BYTES + 1024, canonical=False)
    if type(obj) is not dict:
        raise RecordError("gossip payload is not an object")
    if obj.get("t") == "records" and type(obj.get("r")) is list and set(obj) == {"t", "r"}:
        try:
            return "records", [bytes.fromhex(x) for x in obj["r"] if type(x) is str]
        except ValueError:
            raise RecordError("gossip records are not hex") from None
    if obj.get("t") == "digest" and set(obj) == {"t", "ids", "lo", "hi"}:
        ids, lo, hi = obj["ids"], obj["lo"], obj["hi"]
        if (
            type(ids) is not list or len(ids) > MAX_DIGEST_IDS
            or not set(map(type, ids)) <= {str} or not set(map(len, ids)) <= {ID_PREFIX}
            or type(lo) is not int or type(hi) is not int or not 0 <= lo < hi <= _SPAN
        ):
            raise RecordError("gossip digest is malformed")
        return "digest", (set(ids), lo, hi)
    raise RecordError("unknown gossip payload")
