"""Membership proofs and revocations as the relay checks them, from the bytes alone.

A node logs in at a relay with the two records that admit it: the root-signed invite
and the join signed with that invite's key (``verify_proof``). The pool admin hands the
relay a root-signed revocation (``verify_revocation``) and each acknowledgement of a join
(``verify_admit``: once an invite's uses are all acknowledged, the relay refuses its
other joins). Both need nothing but the
records presented, because the pool id is the hash of the root key: the relay holds no
pool secret. Use limits and revocations held by peers are not judged here; they need
the whole record set (``ttpeer.proto``'s membership views).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._errors import ProofError, RecordError
from ._records import Record, parse, pool_id_of


@dataclass(frozen=True)
class Member:
    node: str  # Ed25519 public key (hex): the peer id
    seal: str  # X25519 public key (hex) for sealing to this member
    name: str
    role: str  # "member" or "admin"
    join: str  # id of the join record
    invite: str  # id of the invite record


def join_fits_invite(join: Record, invite: Record) -> bool:
    """Whether ``join`` is a join made with ``invite``, a genuine root-signed invite,
    before the invite expired."""
    return (
        join.kind == "join"
        and invite.kind == "invite"
        and join.pool == invite.pool
        and pool_id_of(invite.author) == invite.pool
        and join["invite"] == invite.id
        and join.author == invite["key"]
        and join["at"] <= invite["expires"]
    )


def _root_signed(pool: str, raw: bytes, kind: str, what: str) -> Record:
    """``raw`` parsed, if it is a ``kind`` record signed by ``pool``'s root; ``what`` names
    it in the ``ProofError`` raised otherwise."""
    try:
        rec = parse(raw)
    except RecordError as exc:
        raise ProofError(f"{what} is not a valid record: {exc}") from None
    if rec.kind != kind or rec.pool != pool or pool_id_of(rec.author) != pool:
        raise ProofError(f"not {what} signed by this pool's root key")
    return rec


def verify_revocation(pool: str, raw: bytes) -> str:
    """Check that ``raw`` is a revocation signed by ``pool``'s root; returns the revoked
    node. The relay uses it to refuse that node's sessions. Raises ``ProofError``."""
    node: str = _root_signed(pool, raw, "revoke", "a revocation")["node"]
    return node


def verify_admit(pool: str, raw: bytes) -> Record:
    """Check that ``raw`` is an ``admit`` signed by ``pool``'s root; returns it. Raises
    ``ProofError``."""
    return _root_signed(pool, raw, "admit", "an acknowledgement of a join")


def token_used_by(acked: Mapping[str, Record], invite: Record, join: str) -> Record | None:
    """The acknowledgement that took the last use of ``invite`` (``acked``: its ``admit``
    records by join id), when all its uses are acknowledged and ``join`` is not one of
    them: a login with ``join`` is refused. None otherwise."""
    if join in acked or len(acked) < invite["uses"]:
        return None
    return max(acked.values(), key=lambda r: (r["at"], r["join"]))


def token_used_message(admit: Record) -> str:
    """What a machine whose token was used up is told (relay refusals, ``ttpeer join``)."""
    return (f"this token was already used by {admit['name']} at {utc_text(admit['at'])}; "
            "ask the pool admin for a new one ('ttpeer invite')")


def utc_text(seconds: int) -> str:
    """``2026-12-05 14:02 UTC`` for Unix time ``seconds``: the civil date by arithmetic alone
    (H. Hinnant's days-to-civil), so this module reads no clock and imports no time module."""
    days, rest = divmod(seconds, 86400)
    era, doe = divmod(days + 719468, 146097)
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    day = doy - (153 * mp + 2) // 5 + 1
    return f"{year:04d}-{month:02d}-{day:02d} {rest // 3600:02d}:{rest % 3600 // 60:02d} UTC"


def verify_proof(pool: str, peer: str, proof: Sequence[bytes]) -> Member:
    """Check that ``proof`` = [invite, join] admits ``peer`` to ``pool``.

    Raises ``ProofError`` naming the broken link. Use limits are not judged here:
    they need the whole record set, which only peers hold.
    """
    if len(proof) != 2:
        raise ProofError("a membership proof is exactly [invite, join]")
    try:
        invite, join = parse(proof[0]), parse(proof[1])
    except RecordError as exc:
        raise ProofError(f"membership proof has a bad record: {exc}") from None
    if invite.pool != pool or join.pool != pool:
        raise ProofError("membership proof is for another pool")
    if not join_fits_invite(join, invite):
        raise ProofError("join record does not chain to a root-signed invite")
    if join["node"] != peer:
        raise ProofError("membership proof is for another node")
    return Member(join["node"], join["seal"], join["name"], invite["role"], join.id, invite.id)
