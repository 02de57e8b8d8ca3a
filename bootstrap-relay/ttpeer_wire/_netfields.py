"""Record fields that name places on the network: hosts, addresses, relays, certificates.

Validators as ``_records.SCHEMAS`` uses them: each takes a decoded value and says whether
it is well formed; nothing here resolves or connects.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

_HEXSTR = re.compile(r"^([0-9a-f]{2})+$")


MAX_DIRECT_ADDRS = 4
MAX_CERT_BYTES = 2048
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_ok(host: str) -> bool:
    """Whether ``host`` is an IPv4 address, an IPv6 address in brackets, or a DNS name."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return 0 < len(host) <= 253 and all(_LABEL.match(label) for label in host.split("."))


def direct_addrs(v: Any) -> bool:
    """Where a member serves blobs directly: 1-4 ``host:port`` (an IPv6 host in brackets)."""
    def addr(a: Any) -> bool:
        if type(a) is not str or len(a) > 300:
            return False
        host, _, port = a.rpartition(":")
        return host_ok(host) and port.isascii() and port.isdigit() and port[0] != "0" and 1 <= int(port) <= 65535

    return type(v) is list and 1 <= len(v) <= MAX_DIRECT_ADDRS and all(map(addr, v)) and len(set(v)) == len(v)


MAX_RELAYS = 8
_RELAY_FP = re.compile(r"^sha256:[0-9a-f]{64}$")


def relay_list(v: Any) -> bool:
    """A pool's relays, in order: 1-8 ``[https url, "sha256:" + 64 hex]``, no url twice."""
    def relay(r: Any) -> bool:
        return (type(r) is list and len(r) == 2 and type(r[0]) is str and r[0].startswith("https://")
                and 8 < len(r[0]) < 256 and type(r[1]) is str and _RELAY_FP.fullmatch(r[1]) is not None)

    return (type(v) is list and 1 <= len(v) <= MAX_RELAYS and all(map(relay, v))
            and len({r[0] for r in v}) == len(v))


def certificate(v: Any) -> bool:
    """A DER X.509 certificate in hex, at most ``MAX_CERT_BYTES`` bytes."""
    if type(v) is not str or not 2 <= len(v) <= 2 * MAX_CERT_BYTES or not _HEXSTR.fullmatch(v):
        return False
    # Here, not at the top: x509 is most of this package's import time, and the client
    # commands (status, --help) import the errors through it but never read a certificate.
    from cryptography import x509

    try:
        x509.load_der_x509_certificate(bytes.fromhex(v))
    except ValueError:
        return False
    return True
