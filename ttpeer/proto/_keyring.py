"""The key ring: who is handed the pool key, who is told its membership ended, and when.

Theory of operation. A node without the pool key says hello (its invite and join); a
member answers from the records it holds. ``KeyRing`` makes each of those decisions and
remembers what they need between messages; the daemon verifies, decrypts and seals,
and passes in the records, whether it holds a key, and its clocks.

- A hello from a member gets every epoch's key (``HandKeys``), unless it asks after its
  invite expired by our calendar clock (``wall``, plus ``EXPIRY_GRACE``) and has signed
  nothing but its join (``Refuse``): a join's time is the joiner's own claim, so this is
  where a stolen token used late is stopped. A member that took part gets keys whenever.
- A hello from a node that is no member gets the signed records that show why
  (``TellEnded``): its revocations, or its invite and the joins that took its last use.
  At most one such answer per node per ``ENDED_EVERY`` seconds of ``now``.
- A handover of keys (``offer_keys``) is taken when we hold none; else only from a
  current member, and only if it extends the epochs we hold (only the admin makes
  epochs; members pass them on). ``AcceptKeys`` or ``RejectKeys`` with why.
- Our own standing (``check_standing``): revoked or lost is final (``EndMembership``,
  with the acknowledgement that used our token up); a chosen name another machine took
  first is said once (``Renamed``).
- The admin acknowledges every member's join it has not acknowledged yet (``Admit``),
  so that the machine that used an invite first keeps its place (``_membership``).
- The admin rotates the key once for every join newly seen to have lost the race for
  its invite's last use (``Rotate``): it may have been handed the key first. Revoked
  nodes are not counted: their revocation rotated the key already. ``hand_all`` says
  who gets the new epochs: every member but us.
- A message under an epoch we lack means we missed a rotation: ``rehello_due`` allows
  one hello per ``REHELLO_EVERY`` seconds of ``now``.

What it promises: every decision is a function of the records passed and of what the
ring remembers, which only grows. The checks of standing and of lost races run once
per ``RecordSet.membership_version``. What breaks it: a ``now`` that goes backwards
(rate limits would hold longer), records of another pool, or a ring shared by two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ttpeer_wire import Member, Record

from ._ledger import RecordSet
from ._membership import acknowledged, lost_joins, revocations, standing, used_by

EXPIRY_GRACE = 15 * 60.0  # clock skew and a slow first hello, past an invite's expiry
REHELLO_EVERY = 30.0  # at most one hello per this many seconds for messages we cannot open
ENDED_EVERY = 5.0  # at most one "ended" answer per this many seconds to one node

EndedAs = Literal["revoked", "lost"]  # the standings no record that can still arrive undoes


def _final(where: str) -> EndedAs | None:
    return "revoked" if where == "revoked" else "lost" if where == "lost" else None


@dataclass(frozen=True)
class HandKeys:
    """Seal every epoch's key to ``node`` (its X25519 public key ``seal``, hex)."""

    node: str
    seal: str


@dataclass(frozen=True)
class TellEnded:
    """Send ``node`` the signed ``records`` that show it is no member, sealed to ``seal``."""

    node: str
    seal: str
    where: EndedAs
    records: tuple[Record, ...]


@dataclass(frozen=True)
class Refuse:
    """No key for ``node``: ``reason`` ("invite expired"), ``late`` seconds past expiry."""

    node: str
    reason: Literal["invite expired"]
    late: float


@dataclass(frozen=True)
class EndMembership:
    """This node is no member and never will be: stop for good. ``by``: for "lost", the
    acknowledgement of the join that took the token's last use, if held."""

    where: EndedAs
    by: Record | None = None


@dataclass(frozen=True)
class Admit:
    """Admin: sign an ``admit`` for ``member``'s join (of ``at``, the join's time)."""

    member: Member
    at: int


@dataclass(frozen=True)
class Rotate:
    """Admin: make a new pool key epoch; ``lost`` joins newly lost their invite's race."""

    lost: int


@dataclass(frozen=True)
class Renamed:
    """Another machine took the name we ``chose`` first; the pool ``shows`` us so."""

    chose: str
    shows: str


@dataclass(frozen=True)
class AcceptKeys:
    """Take the offered epochs (``epoch``: the newest one's number) from ``giver``."""

    giver: str
    epoch: int


@dataclass(frozen=True)
class RejectKeys:
    """Ignore a handover: "stale" (no newer epoch), "forked" (does not extend ours), or
    "not a member" (the giver is not a current member)."""

    giver: str
    reason: Literal["stale", "forked", "not a member"]


HelloAnswer = HandKeys | TellEnded | Refuse


class KeyRing:
    def __init__(self, pool: str, me: str, name: str, *, admin: bool) -> None:
        self.pool, self.me, self.name, self.admin = pool, me, name, admin
        self._lost_checked = -1  # membership version last checked for lost join races
        self._admits_checked = -1  # membership version last checked for joins to acknowledge
        self._lost_seen: set[str] = set()
        self._rehello_at = 0.0
        self._standing_checked = -1  # membership version last checked for our own standing
        self._told_ended: dict[str, float] = {}  # node -> when we last told it it ended
        self._renamed = False  # said that our chosen name was taken

    def loaded(self, records: RecordSet) -> EndMembership | None:
        """After the log is loaded: our membership ended in an earlier life, or None.
        Lost join races already in the log were answered (by a rotation) back then."""
        where = _final(standing(self.pool, records, self.me))
        if where is not None:
            return EndMembership(where, used_by(self.pool, records, self.me) if where == "lost" else None)
        self._lost_seen = lost_joins(self.pool, records)
        self._lost_checked = records.membership_version
        return None

    def rehello_due(self, now: float) -> bool:
        """Whether to say hello again now (a message under an epoch we lack)."""
        if now < self._rehello_at:
            return False
        self._rehello_at = now + REHELLO_EVERY
        return True

    # -- joining --------------------------------------------------------------------------

    def hello(self, member: Member, expires: float, records: RecordSet, *,
              has_key: bool, now: float, wall: float) -> HelloAnswer | None:
        """Answer the verified hello of ``member`` (whose invite ``expires``, calendar
        time), once its proof is among ``records``. None: nothing to say (we hold no key,
        or told it recently, or its standing is not known yet)."""
        if not has_key:
            return None
        if member.node not in records.members:
            return self.tell_ended(member, records, now)
        late = self.joined_late(member.node, expires, records, wall)
        if late is not None:
            return Refuse(member.node, "invite expired", late)
        return HandKeys(member.node, member.seal)

    def joined_late(self, node: str, expires: float, records: RecordSet, wall: float) -> float | None:
        """Seconds past the invite's expiry if ``node`` asks for the key later than that
        plus ``EXPIRY_GRACE`` and has never signed anything but its join; else None."""
        past = wall - expires
        if past <= EXPIRY_GRACE:
            return None
        if any(r.author == node and r.kind != "join" for r in records):
            return None
        return past

    def tell_ended(self, member: Member, records: RecordSet, now: float) -> TellEnded | None:
        """The records that show ``member`` is no member (signed, so a relay can neither
        forge nor hide a reason in them), at most once per ``ENDED_EVERY`` per node."""
        if now < self._told_ended.get(member.node, -ENDED_EVERY) + ENDED_EVERY:
            return None
        where = _final(standing(self.pool, records, member.node))
        if where == "revoked":
            shown = [r for r in records if r.kind == "revoke" and r["node"] == member.node]
        elif where == "lost":
            winners = [m.join for m in records.members.values() if m.invite == member.invite]
            admits = [r for r in records if r.kind == "admit" and r["invite"] == member.invite]
            shown = [records.by_id[member.invite], *(records.by_id[j] for j in sorted(winners)), *admits]
        else:
            return None
        self._told_ended[member.node] = now
        return TellEnded(member.node, member.seal, where, tuple(shown))

    def offer_keys(self, held: list[bytes], offered: list[bytes], giver: str,
                   records: RecordSet) -> AcceptKeys | RejectKeys:
        """A handover of ``offered`` epochs (oldest first) from ``giver``, whose proof is
        among ``records``, while we hold ``held``."""
        if held:
            if len(offered) <= len(held):
                return RejectKeys(giver, "stale")
            if offered[: len(held)] != held:
                return RejectKeys(giver, "forked")
            if giver not in records.members:
                return RejectKeys(giver, "not a member")
        return AcceptKeys(giver, len(offered) - 1)

    def hand_all(self, records: RecordSet) -> list[HandKeys]:
        """After a rotation: every current member but us gets the keys, by node id."""
        return [HandKeys(n, m.seal) for n, m in sorted(records.members.items()) if n != self.me]

    # -- a membership that ends -----------------------------------------------------------

    def check_standing(self, records: RecordSet) -> EndMembership | Renamed | None:
        """Once per membership change: our membership ended for good (revoked, or our
        join lost the race for its invite's last use), or our name was taken (said once)."""
        if self._standing_checked == records.membership_version:
            return None
        self._standing_checked = records.membership_version
        where = standing(self.pool, records, self.me)
        final = _final(where)
        if final is not None:
            return EndMembership(final, used_by(self.pool, records, self.me) if final == "lost" else None)
        if where == "member" and records.members[self.me].name != self.name and not self._renamed:
            self._renamed = True
            return Renamed(self.name, records.members[self.me].name)
        return None

    def check_admits(self, records: RecordSet) -> list[Admit]:
        """Admin only, once per membership change: the members whose join is not
        acknowledged yet, to acknowledge now (the first machine that used each use keeps it)."""
        if not self.admin or self._admits_checked == records.membership_version:
            return []
        self._admits_checked = records.membership_version
        acked = set().union(*acknowledged(self.pool, records.by_id.values()).values())
        return [Admit(m, records.by_id[m.join]["at"]) for _n, m in sorted(records.members.items())
                if m.join not in acked and m.join in records.by_id]

    def check_lost_races(self, records: RecordSet) -> Rotate | None:
        """Admin only, once per membership change: rotate when a join newly lost its race."""
        if not self.admin or self._lost_checked == records.membership_version:
            return None
        self._lost_checked = records.membership_version
        lost = lost_joins(self.pool, records) - set(revocations(self.pool, records)) - self._lost_seen
        if not lost:
            return None
        self._lost_seen |= lost
        return Rotate(len(lost))
