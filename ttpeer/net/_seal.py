"""End-to-end sealing: what the relay carries is ciphertext it cannot open.

- Pool sealing (gossip payloads, blobs): ChaCha20-Poly1305 under the pool key, a
  random 96-bit nonce per message, and a purpose label bound in as associated data
  so a blob can never be replayed as a message or the reverse.
- Pool sealing in pieces (model states, checkpoints: files of any size): a random
  16-byte salt derives a key for this blob alone (HKDF-SHA256 from the pool key),
  then each 1 MiB piece is sealed under it with its index as the nonce and a last-
  piece flag, the STREAM construction: pieces cannot be reordered, dropped or cut
  off at the end, and no piece larger than one MiB is ever in memory.
- Pool sealing in cut pieces (chunked deltas, for aggregation slices): the same
  per-blob key and STREAM nonces, but pieces of the lengths the caller chose (a
  delta's head, then one piece per chunk frame), listed in a table in clear after
  the salt and bound into every piece as associated data: a run of pieces opens
  from its own bytes and the table, so a range fetch takes exactly the chunks it
  needs instead of the 1 MiB pieces around them.
- Direct sealing (handing the pool key to a new member): an ephemeral X25519 key
  agreement with the recipient's sealing key, HKDF-SHA256, ChaCha20-Poly1305.

Opening raises ``SealError`` for anything that does not authenticate; callers drop
the input and keep going.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ttpeer.proto import TtpeerError

from ._entropy import new_sealing_key, random_bytes

T = TypeVar("T")

_POOL_MAGIC = b"TS1P"
_DIRECT_MAGIC = b"TS1D"
_STREAM_MAGIC = b"TS2S"
_CUT_MAGIC = b"TS3C"
MAX_CUT_PIECE = 4 << 20  # plaintext bytes of one cut piece, at most
MAX_CUTS = 1 << 16  # pieces of one cut blob, at most (a 64 G-value model in 1 M-value chunks)
SALT = 16
PIECE = 1 << 20  # plaintext bytes per sealed piece
TAG = 16
NONCE = 12
MAX_SEALED = 2**31 - 1024  # ChaCha20-Poly1305 in cryptography takes at most 2**31 - 1 bytes


class SealError(TtpeerError):
    """Sealed bytes did not authenticate: tampered, truncated, or for another key."""


def seal(key: bytes, purpose: bytes, plaintext: bytes) -> bytes:
    if len(plaintext) > MAX_SEALED:
        raise SealError(f"cannot seal {len(plaintext)} bytes in one piece")
    nonce = random_bytes(NONCE)
    return _POOL_MAGIC + nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, purpose)


def open_sealed(key: bytes, purpose: bytes, data: bytes) -> bytes:
    """Opens any pool format: one piece (``seal``), pieces (``seal_file``) or cut pieces
    (``seal_cut``)."""
    if data[:4] == _CUT_MAGIC:
        table = cut_table(data)
        return b"".join(open_cut(key, purpose, table, 0, table.count, data[table.size:]))
    if data[:4] == _STREAM_MAGIC:
        count = _piece_count(len(data))
        aead = ChaCha20Poly1305(_piece_key(key, data[4:4 + SALT], purpose))
        view, step = memoryview(data)[4 + SALT:], PIECE + TAG
        return b"".join(_open_piece(aead, i, count, view[i * step:(i + 1) * step], purpose) for i in range(count))
    if len(data) < 4 + NONCE + 16 or data[:4] != _POOL_MAGIC:
        raise SealError("not a pool-sealed payload")
    try:
        return ChaCha20Poly1305(key).decrypt(data[4 : 4 + NONCE], data[4 + NONCE :], purpose)
    except InvalidTag:
        raise SealError("sealed payload does not authenticate (tampered or another pool key)") from None


def seal_file(key: bytes, purpose: bytes, source: Path, out: Path, *, salt: bytes | None = None,
              span: tuple[int, int] | None = None) -> int:
    """Seal the file ``source`` into ``out`` in pieces, reading and writing one piece at a
    time; returns the sealed size. Raises ``OSError`` from either file.

    ``span`` = (offset, length) seals that part of the file only. ``salt`` (16 bytes)
    replaces the random one: the same key, salt and bytes then seal to the same blob, which
    a dataset piece needs (any holder can upload it again under the name its record gives;
    the salt comes from the piece's hash, so equal pieces, and only they, share a blob)."""
    if salt is None:
        salt = random_bytes(SALT)
    elif len(salt) != SALT:
        raise ValueError(f"a salt is {SALT} bytes")
    aead = ChaCha20Poly1305(_piece_key(key, salt, purpose))
    offset, size = span if span is not None else (0, source.stat().st_size)
    count = max(1, -(-size // PIECE))
    with open(source, "rb") as src, open(out, "wb") as dst:
        src.seek(offset)
        dst.write(_STREAM_MAGIC + salt)
        left = size
        for index in range(count):
            piece = src.read(min(PIECE, left))
            left -= len(piece)
            dst.write(aead.encrypt(_piece_nonce(index, index == count - 1), piece, purpose))
        if left:
            raise OSError(f"{source} shrank while it was sealed")
        if span is None and src.read(1):
            raise OSError(f"{source} grew while it was sealed")
    return 4 + SALT + size + count * TAG


def open_sealed_file(keys: list[bytes], purpose: bytes, source: Path, out: Path) -> None:
    """Open the pool-sealed file ``source`` (either format) into ``out``, trying each of
    ``keys`` (newest first) on its first piece: one piece in memory at a time for the
    format in pieces. Raises ``SealError`` (``out`` is then removed) and ``OSError``."""
    size = source.stat().st_size
    with open(source, "rb") as src:
        if src.read(4) != _STREAM_MAGIC:
            src.seek(0)
            data = src.read()
            out.write_bytes(_open_any(keys, lambda key: open_sealed(key, purpose, data)))
            return
        salt = src.read(SALT)
        count = _piece_count(size)
        first = src.read(PIECE + TAG)
        aead = _open_any(keys, lambda key: _first_piece(key, salt, purpose, first, count))
        try:
            with open(out, "wb") as dst:
                dst.write(_open_piece(aead, 0, count, first, purpose))
                for index in range(1, count):
                    dst.write(_open_piece(aead, index, count, src.read(PIECE + TAG), purpose))
        except BaseException:
            out.unlink(missing_ok=True)
            raise


class CutTable:
    """The clear head of a ``seal_cut`` blob: its salt and its pieces' plaintext lengths."""

    def __init__(self, raw: bytes, salt: bytes, lengths: tuple[int, ...]) -> None:
        self.raw, self.salt, self.lengths = raw, salt, lengths

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def size(self) -> int:
        """Bytes of the head: what to fetch before any piece."""
        return len(self.raw)

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """The byte range of the sealed blob that holds pieces ``first .. stop-1``."""
        if not 0 <= first < stop <= self.count:
            raise ValueError(f"pieces [{first}, {stop}) are not a run of the blob's {self.count}")
        begin = self.size + sum(self.lengths[:first]) + first * TAG
        return begin, begin + sum(self.lengths[first:stop]) + (stop - first) * TAG


CUT_HEADER = 4 + SALT + 4  # magic, salt, piece count: what tells the head's size


def cut_head_size(prefix: bytes) -> int:
    """The head's size of a ``seal_cut`` blob from its first ``CUT_HEADER`` bytes.
    Raises SealError if they are short, not that format or count too many pieces."""
    if len(prefix) < CUT_HEADER or prefix[:4] != _CUT_MAGIC:
        raise SealError("not a blob sealed in cut pieces (bad magic or cut short)")
    count = int.from_bytes(prefix[4 + SALT:CUT_HEADER], "little")
    if not 1 <= count <= MAX_CUTS:
        raise SealError(f"cut blob claims {count} pieces; at most {MAX_CUTS}")
    return CUT_HEADER + 4 * count


def cut_table(head: bytes) -> CutTable:
    """The head of a ``seal_cut`` blob (its first ``cut_head_size`` bytes, or more),
    checked for shape only: every piece's tag binds the table, so a changed table makes
    every piece fail to open. Raises SealError if it is short or a length is out of range."""
    size = cut_head_size(head)
    if len(head) < size:
        raise SealError(f"cut blob head is {len(head)} bytes; its table needs {size}")
    lengths = tuple(int.from_bytes(head[CUT_HEADER + 4 * k:CUT_HEADER + 4 * (k + 1)], "little")
                    for k in range((size - CUT_HEADER) // 4))
    if any(n > MAX_CUT_PIECE for n in lengths):
        raise SealError(f"cut blob has a piece over {MAX_CUT_PIECE} bytes")
    return CutTable(bytes(head[:size]), bytes(head[4:4 + SALT]), lengths)


def seal_cut(key: bytes, purpose: bytes, pieces: list[bytes], *, salt: bytes | None = None) -> bytes:
    """Seal ``pieces`` (each at most ``MAX_CUT_PIECE`` bytes, at least one) so that any
    run of them opens on its own (``cut_table``, ``open_cut``). Raises ValueError for
    no pieces, too many or one too large."""
    if not 1 <= len(pieces) <= MAX_CUTS or any(len(p) > MAX_CUT_PIECE for p in pieces):
        raise ValueError(f"seal_cut takes 1 to {MAX_CUTS} pieces of at most {MAX_CUT_PIECE} bytes")
    if salt is None:
        salt = random_bytes(SALT)
    elif len(salt) != SALT:
        raise ValueError(f"a salt is {SALT} bytes")
    head = (_CUT_MAGIC + salt + len(pieces).to_bytes(4, "little")
            + b"".join(len(p).to_bytes(4, "little") for p in pieces))
    aead, aad = ChaCha20Poly1305(_cut_key(key, salt, purpose)), _cut_aad(purpose, head)
    last = len(pieces) - 1
    return head + b"".join(aead.encrypt(_piece_nonce(k, k == last), p, aad) for k, p in enumerate(pieces))


def open_cut(key: bytes, purpose: bytes, table: CutTable, first: int, stop: int,
             data: bytes | memoryview) -> list[bytes]:
    """Pieces ``first .. stop-1`` of a ``seal_cut`` blob from their sealed bytes (those at
    ``table.span(first, stop)``). Raises SealError if the bytes are not that long or a
    piece does not authenticate (tampered, moved, from another blob, another key)."""
    begin, end = table.span(first, stop)
    if len(data) != end - begin:
        raise SealError(f"cut pieces [{first}, {stop}) are {end - begin} sealed bytes; got {len(data)}")
    aead, aad = ChaCha20Poly1305(_cut_key(key, table.salt, purpose)), _cut_aad(purpose, table.raw)
    view, offset, out = memoryview(data), 0, []
    for k in range(first, stop):
        size = table.lengths[k] + TAG
        try:
            out.append(aead.decrypt(_piece_nonce(k, k == table.count - 1), bytes(view[offset:offset + size]), aad))
        except InvalidTag:
            raise SealError("sealed piece does not authenticate (tampered, moved, or another pool key)") from None
        offset += size
    return out


def _cut_key(key: bytes, salt: bytes, purpose: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt, b"ttpeer/cut/v1" + purpose).derive(key)


def _cut_aad(purpose: bytes, head: bytes) -> bytes:
    return purpose + hashlib.sha256(head).digest()


def _open_any(keys: list[bytes], attempt: Callable[[bytes], T]) -> T:
    """``attempt(key)`` with each key until one does not raise ``SealError``."""
    for key in keys:
        try:
            return attempt(key)
        except SealError:
            continue
    raise SealError("sealed payload does not authenticate under any pool key held here")


def _first_piece(key: bytes, salt: bytes, purpose: bytes, piece: bytes, count: int) -> ChaCha20Poly1305:
    aead = ChaCha20Poly1305(_piece_key(key, salt, purpose))
    _open_piece(aead, 0, count, piece, purpose)
    return aead


def _piece_count(sealed_size: int) -> int:
    body = sealed_size - 4 - SALT
    if body < TAG:
        raise SealError("sealed payload is cut short")
    return -(-body // (PIECE + TAG))


def _open_piece(aead: ChaCha20Poly1305, index: int, count: int, piece: bytes | memoryview,
                purpose: bytes) -> bytes:
    try:
        return aead.decrypt(_piece_nonce(index, index == count - 1), bytes(piece), purpose)
    except InvalidTag:
        raise SealError("sealed piece does not authenticate (tampered, cut short, or another pool key)") from None


def _piece_key(key: bytes, salt: bytes, purpose: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt, b"ttpeer/pieces/v1" + purpose).derive(key)


def _piece_nonce(index: int, last: bool) -> bytes:
    return index.to_bytes(NONCE - 1, "big") + (b"\x01" if last else b"\x00")


def _direct_key(shared: bytes, eph_pub: bytes, recipient_pub: bytes) -> bytes:
    info = b"ttpeer/direct/v1" + eph_pub + recipient_pub
    return HKDF(hashes.SHA256(), 32, None, info).derive(shared)


def seal_to(recipient_pub: bytes, plaintext: bytes) -> bytes:
    eph = new_sealing_key()
    eph_pub = eph.public_key().public_bytes_raw()
    key = _direct_key(eph.exchange(X25519PublicKey.from_public_bytes(recipient_pub)), eph_pub, recipient_pub)
    return _DIRECT_MAGIC + eph_pub + ChaCha20Poly1305(key).encrypt(bytes(NONCE), plaintext, None)


def open_direct(private: X25519PrivateKey, data: bytes) -> bytes:
    if len(data) < 4 + 32 + 16 or data[:4] != _DIRECT_MAGIC:
        raise SealError("not a direct-sealed payload")
    eph_pub, body = data[4:36], data[36:]
    mine = private.public_key().public_bytes_raw()
    try:
        key = _direct_key(private.exchange(X25519PublicKey.from_public_bytes(eph_pub)), eph_pub, mine)
        return ChaCha20Poly1305(key).decrypt(bytes(NONCE), body, None)
    except (InvalidTag, ValueError):
        raise SealError("direct-sealed payload does not authenticate") from None


# -- replay window for pool-sealed messages ------------------------------------------------

COUNTER = 8  # bytes of the big-endian message counter sealed in front of each gossip payload


def gossip_ad(purpose: bytes, sender: str) -> bytes:
    """Associated data of a gossip message: the purpose and the sender's id, so a message
    the relay re-attributes to another peer does not authenticate."""
    return purpose + bytes.fromhex(sender)


class ReplayWindow:
    """Per-sender sliding windows of message counters already accepted.

    A sender numbers its sealed messages with a counter that only grows (across its
    restarts too: see ``ttpeer.daemon.node._replay``). ``accept`` takes a counter once:
    a duplicate, or one more than ``size`` below the highest seen from that sender,
    is refused. Memory is bounded: ``size`` bits per sender, ``max_senders`` senders
    (the least recently heard is forgotten first)."""

    def __init__(self, *, size: int = 4096, max_senders: int = 4096) -> None:
        self.size = size
        self.max_senders = max_senders
        self._top: dict[str, int] = {}  # sender -> highest counter accepted (insertion order = LRU)
        self._seen: dict[str, int] = {}  # sender -> bitmask: bit i set = counter top - i accepted

    def floor(self, sender: str, counter: int) -> None:
        """Treat every counter up to ``counter`` from ``sender`` as seen (restored marks)."""
        if counter > self._top.get(sender, -1):
            self._top[sender] = counter
            self._seen[sender] = (1 << self.size) - 1

    def accept(self, sender: str, counter: int) -> bool:
        top = self._top.pop(sender, None)
        if top is None:
            if len(self._top) >= self.max_senders:
                oldest = next(iter(self._top))
                del self._top[oldest], self._seen[oldest]
            self._top[sender], self._seen[sender] = counter, 1
            return True
        seen = self._seen[sender]
        if counter > top:
            shift = counter - top
            seen = ((seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            top = counter
            ok = True
        elif top - counter >= self.size or seen >> (top - counter) & 1:
            ok = False
        else:
            seen |= 1 << (top - counter)
            ok = True
        self._top[sender], self._seen[sender] = top, seen
        return ok

    def marks(self) -> dict[str, int]:
        """The highest counter accepted from each sender."""
        return dict(self._top)
