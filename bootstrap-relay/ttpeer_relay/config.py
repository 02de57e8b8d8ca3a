"""The relay's whole configuration: one dataclass, read once by the CLI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import ttpeer_wire as wire

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class RelayConfig:
    data: Path
    listen: str = "0.0.0.0:8443"
    cert: Path | None = None  # both or neither; neither: self-signed in data/tls/
    key: Path | None = None
    # The defaults of the caps both relays share (ttpeer_wire); the session answer
    # tells each peer the ones in force.
    max_blob_bytes: int = wire.MAX_BLOB_BYTES
    blob_ttl: float = wire.BLOB_TTL
    pool_quota: int = wire.POOL_QUOTA
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    max_json_bytes: int = wire.MAX_JSON_BYTES
    mailbox_messages: int = wire.MAILBOX_MESSAGES
    mailbox_bytes: int = wire.MAILBOX_BYTES
    mailbox_total_bytes: int = 1 * GiB
    rate: float = 50.0  # requests per second, per client IP (no session) or per peer
    burst: int = 200
    session_ttl: float = 3600.0
    handshake_timeout: float = 10.0  # a TLS handshake must finish within this
    idle_timeout: float = 30.0  # a connection without a whole request head is closed after this
    min_body_rate: float = 4 * KiB  # bytes a second, on average, once body_grace has passed
    body_grace: float = 10.0
    max_peers_per_pool: int = 1024
    verbose: bool = False

    @property
    def host(self) -> str:
        return self._split()[0]

    @property
    def port(self) -> int:
        return self._split()[1]

    def _split(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
            raise ValueError(f"--listen must be HOST:PORT, e.g. 0.0.0.0:8443, not {self.listen!r}")
        return host.removeprefix("[").removesuffix("]"), int(port)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        self._split()
        if (self.cert is None) != (self.key is None):
            raise ValueError("--cert and --key go together: give both, or neither")
        for name in ("max_blob_bytes", "pool_quota", "max_message_bytes", "max_json_bytes",
                     "mailbox_messages", "mailbox_bytes", "mailbox_total_bytes", "burst",
                     "max_peers_per_pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("blob_ttl", "rate", "session_ttl", "handshake_timeout", "idle_timeout",
                     "min_body_rate", "body_grace"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def url_host(self) -> str:
        """The listen host as it goes in a URL (IPv6 in brackets)."""
        try:
            return f"[{self.host}]" if ipaddress.ip_address(self.host).version == 6 else self.host
        except ValueError:
            return self.host
