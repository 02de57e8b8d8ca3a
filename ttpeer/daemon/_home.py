"""The home directory: one peer's identity, pool enrolment and durable state.

    HOME/                      0700
      node.key  seal.key       Ed25519 / X25519 private keys, 0600
      pool.key                 the pool's sealing key (once a member handed it over), 0600
      root.key                 the pool root key: only on the admin machine, 0600
      pool.json                pool id, relays, pinned fingerprint, this node's proof
      records.log              the durable record log (see _recordlog)
      states/<job>/            model states and final results
      blobs/                   sealed blobs this peer published (to re-upload on demand)
      data/                    task data caches
      control.sock             the daemon's control socket, 0600
      daemon.lock              held while a daemon runs on this home
      ended                    why this home is no member any more (revoked, lost its token's race)
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from ttpeer_wire import Record, pool_id_of, public_hex, sign

from ttpeer.errors import HomeError
from ttpeer.net._entropy import new_sealing_key, new_signing_key, random_bytes

from ._files import make_private_dir, write_atomic, write_secret

if TYPE_CHECKING:  # the client commands read a home and import no protocol
    from ttpeer.proto import Token

ENDED = "ended"


def ended_reason(home: Path) -> str | None:
    """Why the membership of the home at ``home`` ended, if it did (``Home.mark_ended``)."""
    try:
        return (home / ENDED).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def shared_data_dir() -> Path:
    """Built-in tasks' data made on this machine, shared by its homes (the per-user cache
    folder; the systemd unit points XDG_CACHE_HOME at its CacheDirectory)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("ttpeer", appauthor=False)) / "data"


@dataclass(frozen=True)
class PoolConfig:
    pool: str
    relays: list[str]
    fingerprint: str
    name: str
    invite: str  # hex of this node's invite record
    join: str  # hex of this node's join record
    # One pin per relay, once the pool has relays with certificates of their own (a
    # pool.json from before has none: every relay is pinned to ``fingerprint``).
    fingerprints: list[str] | None = None

    def relay_pairs(self) -> list[tuple[str, str]]:
        """Every relay of the pool with its certificate pin, in order."""
        fps = self.fingerprints or [self.fingerprint] * len(self.relays)
        return list(zip(self.relays, fps, strict=True))

    @property
    def proof(self) -> list[bytes]:
        return [bytes.fromhex(self.invite), bytes.fromhex(self.join)]


class Home:
    def __init__(self, path: Path) -> None:
        self.path = path.expanduser().absolute()
        self._lock_fd: int | None = None

    # -- layout ----------------------------------------------------------------------

    @property
    def records_log(self) -> Path:
        return self.path / "records.log"

    @property
    def control_socket(self) -> Path:
        return self.path / "control.sock"

    def states(self, job: str) -> Path:
        p = self.path / "states" / job
        p.mkdir(parents=True, exist_ok=True)
        return p

    def state_file(self, job: str, state: str) -> Path:
        """Where the model state ``state`` (``sha256:HEX``) of ``job`` is kept: ``HEX.state``."""
        return self.states(job) / f"{state.removeprefix('sha256:')}.state"

    def held_states(self, job: str) -> set[str]:
        """The states on disk for ``job``, by hash."""
        folder = self.path / "states" / job
        if not folder.exists():
            return set()
        return {"sha256:" + p.stem for p in folder.glob("*.state")}

    @property
    def data_dir(self) -> Path:
        p = self.path / "data"
        p.mkdir(parents=True, exist_ok=True)
        return p

    # -- identity and pool -------------------------------------------------------------

    @property
    def enrolled(self) -> bool:
        return (self.path / "pool.json").exists()

    def config(self) -> PoolConfig:
        try:
            raw = json.loads((self.path / "pool.json").read_text())
            return PoolConfig(**raw)
        except FileNotFoundError:
            if not self.path.is_dir():
                raise HomeError(
                    f"home {self.path} does not exist: pass the --home of an enrolled machine, "
                    "or make one with 'ttpeer pool create' or 'ttpeer join -'"
                ) from None
            raise HomeError(
                f"{self.path} is not enrolled in a pool: run 'ttpeer pool create' or "
                "'ttpeer join -' first (or pass --home)"
            ) from None
        except PermissionError:
            raise HomeError(f"cannot read {self.path}/pool.json: permission denied (run ttpeer as the "
                            "user who owns this home, or pass another --home)") from None
        except (ValueError, TypeError) as exc:
            raise HomeError(f"{self.path}/pool.json is damaged: {exc}") from None

    def node_key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self._read_secret("node.key"))

    def seal_key(self) -> X25519PrivateKey:
        return X25519PrivateKey.from_private_bytes(self._read_secret("seal.key"))

    def root_key(self) -> Ed25519PrivateKey:
        if not (self.path / "root.key").exists():
            raise HomeError("only the pool admin (the machine that ran 'ttpeer pool create') can do this")
        return Ed25519PrivateKey.from_private_bytes(self._read_secret("root.key"))

    def pool_key(self) -> bytes | None:
        p = self.path / "pool.key"
        return self._read_secret("pool.key") if p.exists() else None

    def save_pool_key(self, key: bytes) -> None:
        write_secret(self.path / "pool.key", key)

    def pool_keys(self) -> list[bytes]:
        """Every pool key this home holds, oldest epoch first (the last one seals).
        ``pool.keys`` appears after the first key rotation (``ttpeer revoke``)."""
        p = self.path / "pool.keys"
        if not p.exists():
            key = self.pool_key()
            return [key] if key is not None else []
        data = p.read_bytes()
        if not data or len(data) % 32:
            raise HomeError(f"{p} is damaged (expected 32-byte keys)")
        return [data[i : i + 32] for i in range(0, len(data), 32)]

    def save_pool_keys(self, keys: list[bytes]) -> None:
        """Store every epoch's key; ``pool.key`` is written last, to the newest."""
        write_secret(self.path / "pool.keys", b"".join(keys))
        write_secret(self.path / "pool.key", keys[-1])

    def _read_secret(self, name: str) -> bytes:
        p = self.path / name
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise HomeError(f"{p} is missing: this home is incomplete") from None
        if len(data) != 32:
            raise HomeError(f"{p} is damaged (expected a 32-byte key)")
        return data

    def _new_identity(self) -> tuple[Ed25519PrivateKey, X25519PrivateKey]:
        if self.enrolled:
            raise HomeError(f"{self.path} is already enrolled in pool {self.config().pool}; use another --home")
        make_private_dir(self.path)
        node, seal = new_signing_key(), new_sealing_key()
        write_secret(self.path / "node.key", node.private_bytes_raw())
        write_secret(self.path / "seal.key", seal.private_bytes_raw())
        return node, seal

    def _write_config(self, cfg: PoolConfig) -> None:
        write_atomic(self.path / "pool.json", json.dumps(asdict(cfg), indent=2).encode(), 0o600)

    def _join_record(self, invite: Record, invite_key: Ed25519PrivateKey, name: str, now: float) -> Record:
        node, seal = self._new_identity()
        return sign("join", invite.pool, {
            "invite": invite.id, "node": public_hex(node),
            "seal": seal.public_key().public_bytes_raw().hex(), "name": name, "at": int(now),
        }, invite_key)

    def create_pool(self, relay: str, fingerprint: str, name: str, now: float) -> PoolConfig:
        """Make the root key, the pool key and this node's membership (as admin)."""
        if self.enrolled:
            raise HomeError(f"{self.path} is already enrolled in pool {self.config().pool}; use another --home")
        root = new_signing_key()
        pool = pool_id_of(public_hex(root))
        invite, invite_key = new_invite(root, pool, ttl=3600, uses=1, role="admin", now=now)
        join = self._join_record(invite, invite_key, name, now)
        write_secret(self.path / "root.key", root.private_bytes_raw())
        self.save_pool_key(random_bytes(32))
        cfg = PoolConfig(pool, [relay], fingerprint, name, invite.raw.hex(), join.raw.hex())
        self._write_config(cfg)
        return cfg

    def enroll(self, token: Token, name: str, now: float) -> PoolConfig:
        """Become a member with a verified token: new keys, a join signed by the invite key."""
        join = self._join_record(token.invite, Ed25519PrivateKey.from_private_bytes(token.seed), name, now)
        cfg = PoolConfig(token.pool, list(token.relays), token.fingerprint, name,
                         token.invite.raw.hex(), join.raw.hex(), list(token.fingerprints) or None)
        self._write_config(cfg)
        return cfg

    def save_relays(self, relays: list[tuple[str, str]]) -> PoolConfig:
        """Keep the pool's relays (the newest ``relays`` record's) in pool.json, so that a
        restart and ``ttpeer invite`` use them. Raises ``OSError``."""
        cfg = self.config()
        new = replace(cfg, relays=[u for u, _ in relays], fingerprint=relays[0][1],
                      fingerprints=[fp for _, fp in relays])
        if new != cfg:
            self._write_config(new)
        return new

    # -- a membership that ended ---------------------------------------------------------

    def mark_ended(self, reason: str) -> None:
        """Record that this home's membership is over for good, so that ``status`` and
        ``up`` say why at once instead of suggesting a start that cannot help."""
        write_atomic(self.path / ENDED, reason.encode())

    def ended(self) -> str | None:
        return ended_reason(self.path)

    # -- one daemon per home -------------------------------------------------------------

    def lock(self) -> None:
        fd = os.open(self.path / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HomeError(f"a ttpeer daemon is already running on {self.path}") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def new_invite(
    root: Ed25519PrivateKey, pool: str, *, ttl: float, uses: int, role: str, now: float
) -> tuple[Record, Ed25519PrivateKey]:
    key = new_signing_key()
    invite = sign("invite", pool, {
        "key": public_hex(key), "expires": int(now + ttl), "uses": uses, "role": role,
    }, root)
    return invite, key

