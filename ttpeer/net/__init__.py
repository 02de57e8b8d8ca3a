"""ttpeer's network layer: the relay client and the transports the daemon uses.

``Transport`` is the one interface; ``RelayClient`` speaks it over HTTPS to a
pinned relay, ``MemoryRelay().client(...)`` in memory (with seeded ``Faults``)
for tests and the simulator. Every error is a ``NetError`` (see ``_errors``).
"""

from ._errors import (
    BlobCorrupt,
    BlobMissing,
    NetError,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
)
from ._memory import Faults, MemoryRelay, MemoryTransport
from ._relay_client import RelayClient, login_message
from ._tls import fetch_certificate, fingerprint, pinned_ssl_context
from ._transport import Message, Transport

fingerprint_of = fingerprint  # the name ttpeer.cli imports

__all__ = [
    "BlobCorrupt",
    "BlobMissing",
    "Faults",
    "MemoryRelay",
    "MemoryTransport",
    "Message",
    "NetError",
    "RelayClient",
    "RelayFingerprintMismatch",
    "RelayLimit",
    "RelayRejected",
    "RelayUnavailable",
    "Transport",
    "fetch_certificate",
    "fingerprint",
    "fingerprint_of",
    "login_message",
    "pinned_ssl_context",
]
