"""Admission: challenges, sessions, and the roster of admitted proofs.

Theory of operation. A peer asks for a nonce (single use, 60 s), signs
``login_message(fingerprint, pool, nonce)`` (``ttpeer_wire``: a domain string, then
those three) with its node key, and presents the signature with its membership
proof [invite, join]. The relay's own
certificate fingerprint is inside the signed message, so a login captured at one
relay is useless at another. The relay holds no pool secret: the proof chains to
the pool id by itself (``verify_proof``).

Admitted proofs form the pool's roster, which peers read to discover each other
and which broadcasts go to. The roster is kept in memory and saved best-effort
to ``pools/<pool>/roster.json``; a lost or corrupt file only means peers show up
again when they next log in. Every table here is bounded.

Revocations: the pool admin posts a root-signed ``revoke`` record; the relay
checks the signature chains to the pool id (``verify_revocation``), drops the
peer from the roster, refuses its sessions from then on, and saves the record
with the roster so a restart keeps refusing it.

Acknowledged joins: members hand the relay the admin's root-signed ``admit`` records
(``verify_admit``). Once an invite's uses are all acknowledged, a login with another
join of that invite is refused (``used_by``): its token was already used, and the
answer says by whom and when. Kept with the roster, bounded like revocations.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from ttpeer_wire import ProofError, Record, parse, token_used_by, verify_admit, verify_proof, verify_revocation

log = logging.getLogger(__name__)

MAX_REVOKED = 4096  # revoked peers remembered per pool
MAX_ADMITS = 4096  # acknowledged joins remembered per pool


def signature_ok(peer: str, sig: str, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(peer)).verify(bytes.fromhex(sig), message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Nonces:
    """Outstanding challenges: single use, short-lived, oldest evicted first."""

    def __init__(self, *, ttl: float = 60.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._table: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def issue(self, pool: str, peer: str, now: float) -> str:
        nonce = secrets.token_hex(32)
        self._table[nonce] = (pool, peer, now + self.ttl)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)
        return nonce

    def take(self, nonce: str, pool: str, peer: str, now: float) -> bool:
        """Consume ``nonce``; True if it was issued to (pool, peer) and is still fresh."""
        entry = self._table.pop(nonce, None)
        return entry is not None and entry[:2] == (pool, peer) and now <= entry[2]


@dataclass(frozen=True, slots=True)
class Session:
    pool: str
    peer: str
    expires: float


class Sessions:
    """Bearer tokens for logged-in peers; the oldest is evicted when the table is full."""

    def __init__(self, *, ttl: float = 3600.0, max_entries: int = 100_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._table: OrderedDict[str, Session] = OrderedDict()

    def open(self, pool: str, peer: str, now: float) -> str:
        token = secrets.token_urlsafe(32)
        self._table[token] = Session(pool, peer, now + self.ttl)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)
        return token

    def get(self, token: str, now: float) -> Session | None:
        session = self._table.get(token)
        if session is not None and now > session.expires:
            del self._table[token]
            return None
        return session


class RosterFull(Exception):
    pass


class Rosters:
    """Admitted membership proofs per pool: ``{pool: {peer: [invite, join]}}``."""

    def __init__(self, root: Path | None, *, max_peers: int = 1024) -> None:
        self.root = root
        self.max_peers = max_peers
        self._pools: dict[str, dict[str, list[bytes]]] = {}
        self._revoked: dict[str, dict[str, bytes]] = {}  # pool -> peer -> revoke record
        self._admits: dict[str, dict[str, dict[str, Record]]] = {}  # pool -> invite -> join id -> admit
        self._save_lock = trio.Lock()

    def admit(self, pool: str, peer: str, proof: list[bytes]) -> bool:
        """Remember ``proof``; True if the roster changed. Raises ``RosterFull``."""
        roster = self._pools.setdefault(pool, {})
        if roster.get(peer) == proof:
            return False
        if peer not in roster and len(roster) >= self.max_peers:
            raise RosterFull(f"the pool already has {len(roster)} peers on this relay")
        roster[peer] = list(proof)
        return True

    def revoke(self, pool: str, record: bytes) -> str:
        """Refuse the peer a root-signed ``record`` revokes; returns it. Raises ``ProofError``,
        ``RosterFull`` (too many revocations remembered for the pool)."""
        peer = verify_revocation(pool, record)
        revoked = self._revoked.setdefault(pool, {})
        if peer not in revoked and len(revoked) >= MAX_REVOKED:
            raise RosterFull(f"the pool already has {len(revoked)} revoked peers on this relay")
        revoked[peer] = record
        self._pools.get(pool, {}).pop(peer, None)
        return peer

    def acknowledge(self, pool: str, raw: bytes) -> Record:
        """Remember a root-signed ``admit``; returns it. Raises ``ProofError``, ``RosterFull``."""
        rec = verify_admit(pool, raw)
        admits = self._admits.setdefault(pool, {})
        if rec["join"] not in admits.get(rec["invite"], {}) and sum(map(len, admits.values())) >= MAX_ADMITS:
            raise RosterFull(f"the pool already has {MAX_ADMITS} acknowledged joins on this relay")
        admits.setdefault(rec["invite"], {})[rec["join"]] = rec
        return rec

    def used_by(self, pool: str, invite: Record, join: str) -> Record | None:
        """The acknowledgement that took the last use of ``invite``, when all its uses are
        acknowledged and ``join`` is not one of them (the login is refused); else None."""
        return token_used_by(self._admits.get(pool, {}).get(invite.id, {}), invite, join)

    def acknowledgements(self, pool: str, invite: str) -> list[bytes]:
        """The ``admit`` records of ``invite`` held, as bytes."""
        return [r.raw for r in self._admits.get(pool, {}).get(invite, {}).values()]

    def is_revoked(self, pool: str, peer: str) -> bool:
        return peer in self._revoked.get(pool, {})

    def peers(self, pool: str) -> list[str]:
        return sorted(self._pools.get(pool, {}))

    def proofs(self, pool: str) -> list[list[bytes]]:
        roster = self._pools.get(pool, {})
        return [roster[peer] for peer in sorted(roster)]

    def _path(self, pool: str) -> Path | None:
        return None if self.root is None else self.root / pool / "roster.json"

    async def save(self, pool: str) -> None:
        """Write the pool's roster atomically; failures are logged, never raised."""
        path = self._path(pool)
        if path is None:
            return
        async with self._save_lock:  # one writer at a time, each with the latest snapshot
            roster = self._pools.get(pool, {})
            revoked = self._revoked.get(pool, {})
            admits = [r.raw.hex() for acked in self._admits.get(pool, {}).values() for r in acked.values()]
            body = json.dumps({"proofs": {p: [r.hex() for r in pr] for p, pr in roster.items()},
                               "revoked": [r.hex() for r in revoked.values()], "admits": admits})
            await trio.to_thread.run_sync(self._write, path, body)

    @staticmethod
    def _write(path: Path, body: str) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(body)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not save %s: %s", path, exc)

    def load(self) -> None:
        """Read every saved roster, keeping only proofs that still verify."""
        if self.root is None or not self.root.is_dir():
            return
        for pool_dir in self.root.iterdir():
            path = pool_dir / "roster.json"
            try:
                data = json.loads(path.read_text())
                for raw in data.get("revoked", []):
                    self.revoke(pool_dir.name, bytes.fromhex(raw))
                for raw in data.get("admits", []):
                    self.acknowledge(pool_dir.name, bytes.fromhex(raw))
                saved = data["proofs"]
                for peer, proof in saved.items():
                    if self.is_revoked(pool_dir.name, peer):
                        continue
                    raw = [bytes.fromhex(r) for r in proof]
                    verify_proof(pool_dir.name, peer, raw)
                    if self.used_by(pool_dir.name, parse(raw[0]), parse(raw[1]).id) is None:
                        self.admit(pool_dir.name, peer, raw)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError, ProofError,
                    RosterFull) as exc:
                log.warning("ignoring the saved roster %s: %s", path, exc)
