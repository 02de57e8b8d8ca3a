"""Where ttpeer's random bytes come from: keys, the pool key, nonces.

Always the operating system's CSPRNG (``os.urandom``), except inside
``ttpeer.testing.deterministic(seed)``, which the simulator uses so that a run
can be replayed bit for bit: same seed, same keys, same ciphertexts, same record
ids, same outcome. Nothing outside ``ttpeer.testing`` swaps the source.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

_source: Callable[[int], bytes] = os.urandom


def random_bytes(n: int) -> bytes:
    return _source(n)


def new_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(random_bytes(32))


def new_sealing_key() -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(random_bytes(32))


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Replace the source with SHA-256 in counter mode over ``seed`` (tests only:
    the bytes are predictable by design)."""
    global _source
    counter = 0

    def stream(n: int) -> bytes:
        nonlocal counter
        out = b""
        while len(out) < n:
            out += hashlib.sha256(f"ttpeer-sim/{seed}/{counter}".encode()).digest()
            counter += 1
        return out[:n]

    saved, _source = _source, stream
    try:
        yield
    finally:
        _source = saved
