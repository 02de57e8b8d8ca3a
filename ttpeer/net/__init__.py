"""ttpeer's network layer: the relay client and the transports the daemon uses.

``Transport`` is the one interface; ``RelayClient`` speaks it over HTTPS to a
pinned relay, ``MemoryRelay().client(...)`` in memory (with seeded ``Faults``)
for tests and the simulator. Every error is a ``NetError`` (see ``_errors``); what
the relay answered is its ``status`` and ``code`` (an ``ErrorCode``). The wire
contract itself (paths, limits, login bytes, fingerprints, codes) is ``ttpeer_wire``.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ttpeer_wire import ErrorCode, fingerprint, login_message
from ttpeer_wire import fingerprint as fingerprint_of

from ._errors import (
    BlobCorrupt,
    BlobMissing,
    NetError,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
)

if TYPE_CHECKING:
    from ._memory import Faults, MemoryRelay, MemoryTransport
    from ._multi import MultiRelay
    from ._relay_client import RelayClient
    from ._tls import fetch_certificate, pinned_ssl_context
    from ._transport import Message, PoolTransport, Transport

# The rest on first use: httpx (with its own command line's click and rich) costs a
# client command such as 'ttpeer status' more than everything else it imports.
_LAZY = {"Faults": "_memory", "MemoryRelay": "_memory", "MemoryTransport": "_memory", "MultiRelay": "_multi",
         "RelayClient": "_relay_client", "fetch_certificate": "_tls", "pinned_ssl_context": "_tls",
         "Message": "_transport", "PoolTransport": "_transport", "Transport": "_transport"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ttpeer.net' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BlobCorrupt",
    "BlobMissing",
    "ErrorCode",
    "Faults",
    "MemoryRelay",
    "MemoryTransport",
    "Message",
    "MultiRelay",
    "NetError",
    "PoolTransport",
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
