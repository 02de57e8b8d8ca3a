"""A relay that attacks the pool it serves, for the simulator.

``HostileRelay`` is a ``MemoryRelay`` (so it also drops, duplicates, delays and
reorders through its ``Faults``) that, while ``hostility`` is set, also does what a
relay operator could do without the pool key:

- tampers with sealed gossip messages in flight: flips one bit, or truncates them;
- replays old messages, to the same or another peer, under their original sender
  (dropped by the receiver's replay window, counted in `replays_dropped`);
- relabels the sender of a real message (refused: the sender is bound into the seal);
- inserts forgeries: gossip sealed under a key that is not the pool's, hellos whose
  membership proof is signed by keys outside the pool, and bytes of no known kind;
- serves tampered blobs: a flipped bit, a truncation, another blob's bytes, or
  bytes past the size the fetcher asked for.

Every decision comes from a ``random.Random`` seeded per (seed, what, n-th time),
like ``Faults``; forgeries and blob attacks take turns through their kinds, so a
short run still makes each. Only sealed gossip (kind ``P``) is tampered,
relabelled or replayed, so that every tampered message is one a peer must refuse;
hellos and key handovers are attacked by the forgeries and by the fuzz tests.
Tampered and forged messages skip the faults (never dropped or delayed), so each
reaches a mailbox. ``injected`` counts what was done, by name: each of
``MESSAGE_ATTACKS`` must show up as one rejected message at the peer it reached,
each of ``BLOB_ATTACKS`` as one rejected blob. ``behave()`` stops every attack and
every fault at once.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ttpeer.net import Faults, MemoryRelay
from ttpeer.net._seal import seal
from ttpeer.proto import encode, pool_id_of, public_hex, sign

GOSSIP = b"ttpeer/gossip/v1"
MESSAGE_ATTACKS = ("flip", "truncate", "relabel", "forge_sealed", "forge_hello", "forge_kind")
BLOB_ATTACKS = ("blob_flip", "blob_truncate", "blob_swap", "blob_oversize")


@dataclass
class Hostility:
    """Per-delivery (or per-fetch) probabilities of each attack."""

    seed: int = 0
    flip: float = 0.05  # of a sealed gossip message: one bit flipped
    truncate: float = 0.05
    replay: float = 0.1  # an old message delivered again
    relabel: float = 0.05  # a real message under another peer's name
    forge: float = 0.05  # a forgery inserted (one of three kinds)
    blob: float = 0.3  # of a blob fetch: tampered bytes served


class HostileRelay(MemoryRelay):
    def __init__(self, *, hostility: Hostility | None = None, faults: Faults | None = None,
                 **limits: int) -> None:
        super().__init__(faults=faults, **limits)
        self.hostility = hostility
        self.injected: Counter[str] = Counter()
        self._history: list[tuple[str, bytes]] = []  # (sender, data) of real sealed gossip
        self._counts: Counter[str] = Counter()

    def behave(self) -> None:
        """From now on: a correct relay, no faults."""
        self.hostility = None
        self.faults = None

    def _rng(self, what: str) -> random.Random:
        assert self.hostility is not None
        self._counts[what] += 1
        return random.Random(f"{self.hostility.seed}/{what}/{self._counts[what]}")

    def _accept(self, pool: str, sender: str, recipient: str, data: bytes) -> None:
        h = self.hostility
        if h is None:
            super()._accept(pool, sender, recipient, data)
            return
        rng = self._rng(f"msg/{sender}/{recipient}")
        box = self._box(pool, recipient)
        sealed = data[:1] in (b"P", b"W") and len(data) > 1
        roll = rng.random()
        if sealed and roll < h.flip:
            bit = rng.randrange(8, 8 * len(data))  # past the kind byte: the sealed part
            tampered = bytearray(data)
            tampered[bit // 8] ^= 1 << (bit % 8)
            self._inject(box, sender, bytes(tampered), "flip")
        elif sealed and roll < h.flip + h.truncate:
            self._inject(box, sender, data[: rng.randrange(1, len(data))], "truncate")
        elif sealed and roll < h.flip + h.truncate + h.relabel and len(self.rosters.get(pool, {})) > 1:
            # Refused: the sender's id is bound into the seal (associated data).
            others = [p for p in self.rosters.get(pool, {}) if p != sender]
            self._inject(box, rng.choice(sorted(others)), data, "relabel")
        else:
            super()._accept(pool, sender, recipient, data)
        if self._history and rng.random() < h.replay:
            old_sender, old = rng.choice(self._history)
            self._inject(box, old_sender, old, "replay")
        if rng.random() < h.forge:
            kinds = ("forge_sealed", "forge_hello", "forge_kind")
            kind = kinds[sum(self.injected[k] for k in kinds) % len(kinds)]  # take turns
            self._inject(box, sender, _forgery(kind, pool, rng), kind)
        if sealed:
            self._history.append((sender, data))
            del self._history[:-256]

    def _inject(self, box: object, sender: str, data: bytes, what: str) -> None:
        self._deliver(box, sender, data)  # type: ignore[arg-type]
        self.injected[what] += 1

    def _serve_blob(self, pool: str, blob: str) -> bytes | None:
        data = super()._serve_blob(pool, blob)
        h = self.hostility
        if h is None or data is None or not data:
            return data
        rng = self._rng(f"blob/{blob}")
        if rng.random() >= h.blob:
            return data
        others = [b for name, b in self.blobs.get(pool, {}).items() if name != blob]
        what = BLOB_ATTACKS[sum(self.injected[a] for a in BLOB_ATTACKS) % len(BLOB_ATTACKS)]  # take turns
        if what == "blob_swap" and not others:
            return data  # nothing to swap in yet: the swap keeps its turn for a later fetch
        self.injected[what] += 1
        if what == "blob_flip":
            bit = rng.randrange(8 * len(data))
            tampered = bytearray(data)
            tampered[bit // 8] ^= 1 << (bit % 8)
            return bytes(tampered)
        if what == "blob_truncate":
            return data[: rng.randrange(len(data))]
        if what == "blob_swap":
            return rng.choice(others)
        return data + os.urandom(2**20)  # past any max_size a fetcher of a small blob gives


def _forgery(kind: str, pool: str, rng: random.Random) -> bytes:
    """A message the relay could make without the pool key."""
    if kind == "forge_sealed":
        key = rng.randbytes(32)  # not the pool's key, which the relay never sees
        body = encode({"t": "records", "r": [rng.randbytes(200).hex()]})
        return b"P" + seal(key, GOSSIP, body)
    if kind == "forge_hello":
        # A proof that names this pool but chains to a root the relay made up.
        root, invite_key, node = (Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)) for _ in range(3))
        body = {"key": public_hex(invite_key), "expires": 2**40, "uses": 100, "role": "member"}
        invite = sign("invite", pool if rng.random() < 0.5 else pool_id_of(public_hex(root)), body, root)
        join = sign("join", invite.pool, {"invite": invite.id, "node": public_hex(node),
                                          "seal": rng.randbytes(32).hex(), "name": "mallory", "at": 1},
                    invite_key)
        return b"H" + encode({"proof": [invite.raw.hex(), join.raw.hex()]})
    return bytes([rng.choice(b"ABCDEFGJLMNOQRSTUVWXYZ")]) + rng.randbytes(rng.randrange(0, 64))
