"""Pool keys: the key epochs this node holds, and the envelopes sealed with them.

Theory of operation. ``PoolKeys`` holds the pool key epochs, oldest first, as the home
stores them: the newest seals, any of them opens (so blobs of old epochs stay readable).
Only the admin adds an epoch (``rotate``, on a revocation or a lost join race); members
take the whole list from a key handover (``handover``/``open_handover``: sealed to one
member, signed by the giver, with the giver's membership proof). The envelopes are made
and opened here: P (gossip, pool-sealed, bound to its sender, after a replay counter), W
(a want of dataset pieces, sealed the same way under its own purpose), K (the handover)
and L (``ended_message``: the records that show a node it is no member). Blobs are sealed
with the same keys by ``Blobs`` (``_blobs.py``).

What breaks it: a key handed to a node that is no member (the node checks membership
before it hands keys), or a key written to the log (``_logging.add_secret`` knows each).
"""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ttpeer import _logging
from ttpeer.net._entropy import random_bytes
from ttpeer.net._seal import COUNTER, SealError, gossip_ad, open_direct, open_sealed, seal, seal_to
from ttpeer.proto import Record, decode, encode, parse, verify_proof

from .._home import Home

GOSSIP = b"ttpeer/gossip/v1"
SEALED = {b"P": GOSSIP, b"W": b"ttpeer/want/v1"}  # a sealed message's kind: gossip, or a want of dataset pieces
KEY_DOMAIN = b"ttpeer/keyshare/v1\n"
MAX_ENDED_RECORDS = 64  # records in one L message: the invite and its winning joins, or revocations


class PoolKeys:
    """The pool key epochs held here, oldest first; the last one seals."""

    def __init__(self, home: Home) -> None:
        self._home = home
        self.keys: list[bytes] = home.pool_keys()

    @property
    def newest(self) -> bytes | None:
        return self.keys[-1] if self.keys else None

    def set(self, keys: list[bytes]) -> None:
        for key in keys:
            _logging.add_secret(key)  # the log filter's second wall knows every epoch's key
        self._home.save_pool_keys(keys)
        self.keys = keys

    def rotate(self) -> None:
        """A new epoch (the admin's, on a revocation or a lost join race)."""
        self.set([*self.keys, random_bytes(32)])

    def seal(self, purpose: bytes, data: bytes) -> bytes:
        assert self.keys, "sealing needs a pool key: callers wait for one"
        return seal(self.keys[-1], purpose, data)

    def open(self, purpose: bytes, data: bytes) -> bytes:
        """Open with whichever epoch's key sealed it, newest first. Raises ``SealError``."""
        for key in reversed(self.keys):
            try:
                return open_sealed(key, purpose, data)
            except SealError:
                continue
        raise SealError("sealed payload does not authenticate under any pool key held here")

    def seal_gossip(self, sender: str, counter: int, payload: bytes, kind: bytes = b"P") -> bytes:
        """A message of ``kind`` (``SEALED``): ``payload`` after its replay counter, bound to its sender."""
        return kind + self.seal(gossip_ad(SEALED[kind], sender), counter.to_bytes(COUNTER, "big") + payload)

    def open_gossip(self, sender: str, body: bytes, kind: bytes = b"P") -> tuple[int, bytes] | None:
        """(counter, payload) of a ``kind`` message from ``sender``; None if too short for a counter."""
        plain = self.open(gossip_ad(SEALED[kind], sender), body)  # raises SealError
        if len(plain) < COUNTER:
            return None
        return int.from_bytes(plain[:COUNTER], "big"), plain[COUNTER:]

    def handover(self, signer: Ed25519PrivateKey, proof: list[bytes], node: str, seal_pub: str) -> bytes:
        """A K message: every epoch's key, sealed to ``node`` and signed by us."""
        keys = b"".join(self.keys)
        body = {"keys": [k.hex() for k in self.keys], "to": node, "proof": [p.hex() for p in proof],
                "sig": signer.sign(KEY_DOMAIN + node.encode() + keys).hex()}
        return b"K" + seal_to(bytes.fromhex(seal_pub), encode(body))


def open_to(seal_key: X25519PrivateKey, body: bytes, *, max_size: int) -> Any:
    """The object in a message sealed to this node alone (K, L). Raises ``SealError``,
    ``RecordError``."""
    return decode(open_direct(seal_key, body), max_size=max_size)


def open_handover(seal_key: X25519PrivateKey, body: bytes, pool: str,
                  me: str) -> tuple[str, list[bytes], list[Record]] | None:
    """(giver, keys, the giver's proof) of a K message to ``me``, or None when it is for
    someone else or holds no usable key. Raises on a forged or malformed one."""
    obj = open_to(seal_key, body, max_size=200_000)
    keys = [bytes.fromhex(k) for k in obj["keys"]]
    proof = [bytes.fromhex(p) for p in obj["proof"]]
    giver = parse(proof[1])["node"]
    verify_proof(pool, giver, proof)
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(giver)).verify(
        bytes.fromhex(obj["sig"]), KEY_DOMAIN + me.encode() + b"".join(keys)
    )
    if obj["to"] != me or not keys or any(len(k) != 32 for k in keys):
        return None
    return giver, keys, [parse(raw) for raw in proof]


def ended_message(node: str, seal_pub: str, records: list[Record]) -> bytes:
    body = encode({"to": node, "records": [r.raw.hex() for r in records[:MAX_ENDED_RECORDS]]})
    return b"L" + seal_to(bytes.fromhex(seal_pub), body)
