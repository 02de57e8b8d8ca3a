"""Join tokens: everything a new machine needs, and the pins that keep it safe.

A token is ``ttp1.`` + base64url of a canonical object: relay URLs, the first relay's
certificate fingerprint (``fp``) and, when the pool has several relays, each one's
(``fps``: a token made before there were several has none, and all its relays share
``fp``), the pool id (a hash of the root key), the root-signed
invite record and the invite key's private seed. ``parse_token`` checks the
invite against the pinned pool id before anything is used, so a token for a fake
pool fails here; the relay fingerprint is checked when connecting, before any
request is sent. Tokens are secrets: never log them, never put them in errors.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ._codec import decode, encode
from ._errors import RecordError, TokenError
from ._records import Record, parse, pool_id_of

PREFIX = "ttp1."
MAX_TOKEN = 8192
_FP = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Token:
    relays: tuple[str, ...]
    fingerprint: str
    pool: str
    invite: Record
    seed: bytes  # the invite key's Ed25519 private seed: the secret part
    fingerprints: tuple[str, ...] = ()  # one per relay (empty: all share ``fingerprint``)

    def relay_pairs(self) -> list[tuple[str, str]]:
        """Every relay with its pin, in the pool's order."""
        fps = self.fingerprints or (self.fingerprint,) * len(self.relays)
        return list(zip(self.relays, fps, strict=True))

    def __repr__(self) -> str:  # never print the seed
        return f"Token(pool={self.pool}, relays={self.relays}, invite={self.invite.id[:12]})"


def make_token(relays: list[str], fingerprint: str, invite: Record, seed: bytes, *,
               fingerprints: list[str] | None = None) -> str:
    """A token for ``relays``, the first pinned to ``fingerprint``; ``fingerprints``: one per
    relay (the first ``fingerprint``), for a pool whose relays have certificates of their own."""
    body: dict[str, object] = {
        "relays": relays, "fp": fingerprint, "pool": invite.pool,
        "invite": _b64encode(invite.raw), "seed": seed.hex(),
    }
    if fingerprints is not None and set(fingerprints) != {fingerprint}:
        body["fps"] = fingerprints
    return PREFIX + _b64encode(encode(body))


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _b64decode(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def parse_token(text: str, *, now: float) -> Token:
    """Decode and check a token. Raises ``TokenError`` without echoing the token."""
    text = text.strip()
    if len(text) > MAX_TOKEN or not text.startswith(PREFIX):
        raise TokenError("this is not a ttpeer join token (it should start with 'ttp1.')")
    try:
        raw = _b64decode(text[len(PREFIX) :])
        body = decode(raw, max_size=MAX_TOKEN)
    except (binascii.Error, ValueError, RecordError):
        raise TokenError("the join token is damaged (was it copied whole?)") from None
    if type(body) is not dict or set(body) - {"fps"} != {"relays", "fp", "pool", "invite", "seed"}:
        raise TokenError("the join token is damaged (missing fields)")
    relays, fp, pool = body["relays"], body["fp"], body["pool"]
    if (
        type(relays) is not list or not 1 <= len(relays) <= 8
        or not all(type(u) is str and u.startswith("https://") and len(u) < 256 for u in relays)
    ):
        raise TokenError("the join token names no valid https:// relay")
    if type(fp) is not str or not _FP.fullmatch(fp):
        raise TokenError("the join token has no valid relay fingerprint")
    fps = body.get("fps", [])
    if fps and (type(fps) is not list or len(fps) != len(relays) or fps[0] != fp
                or not all(type(f) is str and _FP.fullmatch(f) for f in fps)):
        raise TokenError("the join token's relay fingerprints are damaged (one per relay, the first as 'fp')")
    try:
        invite = parse(_b64decode(body["invite"]))
        seed = bytes.fromhex(body["seed"])
    except (ValueError, TypeError, RecordError):
        raise TokenError("the join token's invite is damaged or forged") from None
    if invite.kind != "invite" or invite.pool != pool or pool_id_of(invite.author) != pool:
        raise TokenError("the join token's invite is not signed by the root of the pool it names")
    if len(seed) != 32:
        raise TokenError("the join token's invite key is damaged")
    key = Ed25519PrivateKey.from_private_bytes(seed)
    if key.public_key().public_bytes_raw().hex() != invite["key"]:
        raise TokenError("the join token's invite key does not match its invite")
    if now > invite["expires"]:
        raise TokenError("the join token has expired; ask the pool admin for a new one (ttpeer invite)")
    return Token(tuple(relays), fp, pool, invite, seed, tuple(fps))
