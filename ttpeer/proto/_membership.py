"""Who is in the pool: a pure function of the records held.

Theory of operation. The pool id is a hash of the root public key, so an invite
is genuine exactly when its author hashes to the pool id. A join is genuine when
its invite is, it is signed by that invite's key, and it was made before the
invite expired. An invite admits at most ``uses`` joins. The machine that used it first
keeps its place: the admin's daemon acknowledges the joins it sees (a root-signed
``admit`` for each), and an acknowledged join beats any that is not; once every use is
acknowledged the invite admits nobody more, and the other joins are lost for good.
Among joins not acknowledged (the admin was offline), the lowest ids win the uses left,
and such members are provisional until the admin acknowledges them. Every peer that
holds the same records picks the same members, in whatever order they arrived (I1).
A node that joined twice counts once.

Revocation. A root-signed ``revoke`` names a node and the ids of its records that
stay valid (``keep``). The node is no member, whatever joins it holds; of its
records only the kept ones count. "After the revocation" is thus defined by the
record set, not by anyone's clock: every peer holding the same records gives the
same answer, whichever order they arrived in. Several revocations of one node keep
the union of their ``keep`` lists.

Names. Every home defaults to its hostname and joins happen with no admin online, so
two machines may pick one name at once; a join is never refused for its name. Among
the nodes admitted (members and revoked ones: a revoked node keeps its name, so that
``revoke NAME`` never moves on to someone else) that chose one name, the admin keeps
it, then the earliest join (its ``at``, then its id); each other gets the name plus
``-`` and the first 6 hex digits of its node id (more if that is taken too). A pure
function of the records, so every peer shows the same names, and the names of nodes
that chose distinct ones never change.

``ttpeer_wire.verify_proof`` checks the two-record chain (invite, join) a node presents
to the relay from the proof alone, and ``verify_revocation`` a revocation; both are
re-exported by ``ttpeer.proto``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ttpeer_wire import Member, Record, join_fits_invite, pool_id_of


def members(pool: str, records: Iterable[Record]) -> dict[str, Member]:
    """Members of ``pool`` by node id, from any collection of verified records."""
    records = list(records)
    revoked = revocations(pool, records)
    return {n: m for n, m in admitted(pool, records).items() if n not in revoked}


def admitted(pool: str, records: Iterable[Record]) -> dict[str, Member]:
    """Members and revoked nodes (whose joins took a use), each with its pool-unique name."""
    invites: dict[str, Record] = {}
    joins: list[Record] = []
    records = list(records)
    for rec in records:
        if rec.pool != pool:
            continue
        if rec.kind == "invite" and pool_id_of(rec.author) == pool:
            invites[rec.id] = rec
        elif rec.kind == "join":
            joins.append(rec)
    acked = acknowledged(pool, records)
    used: dict[str, int] = {}  # uses taken by joins not acknowledged, per invite
    out: dict[str, Member] = {}
    at: dict[str, int] = {}
    # Acknowledged joins first: the machine the admin saw first keeps its place.
    for join in sorted(joins, key=lambda r: (r.id not in acked.get(r["invite"], ()), r.id)):
        invite = invites.get(join["invite"])
        if invite is None or not join_fits_invite(join, invite) or join["node"] in out:
            continue
        mine = acked.get(invite.id, frozenset())
        if join.id in mine:
            if join.id not in sorted(mine)[: invite["uses"]]:
                continue  # more acknowledged than uses (never made so): the lowest ids count
        elif used.get(invite.id, 0) >= invite["uses"] - len(mine):
            continue  # the uses left are taken, or held for acknowledged joins
        else:
            used[invite.id] = used.get(invite.id, 0) + 1  # a revoked node still used its invite
        out[join["node"]] = Member(
            join["node"], join["seal"], join["name"], invite["role"], join.id, invite.id
        )
        at[join["node"]] = join["at"]
    return _unique_names(out, at)


def acknowledged(pool: str, records: Iterable[Record]) -> dict[str, frozenset[str]]:
    """The joins the admin acknowledged (root-signed ``admit`` records), by invite."""
    out: dict[str, set[str]] = {}
    for rec in records:
        if rec.kind == "admit" and rec.pool == pool and pool_id_of(rec.author) == pool:
            out.setdefault(rec["invite"], set()).add(rec["join"])
    return {invite: frozenset(joins) for invite, joins in out.items()}


def provisional(pool: str, records: Iterable[Record]) -> set[str]:
    """Members whose join the admin has not acknowledged yet (it was offline when they
    joined): until it does, a lower-id join of the same invite can still take the seat."""
    records = list(records)
    acked = set().union(*acknowledged(pool, records).values())
    return {n for n, m in members(pool, records).items() if m.join not in acked}


def _unique_names(nodes: dict[str, Member], at: dict[str, int]) -> dict[str, Member]:
    """Rename all but the first of each chosen name (see the module's theory)."""
    by_name: dict[str, list[Member]] = {}
    for m in nodes.values():
        by_name.setdefault(m.name, []).append(m)
    taken = set(by_name)
    out = dict(nodes)
    for name, group in sorted(by_name.items()):
        group.sort(key=lambda m: (m.role != "admin", at[m.node], m.join))
        for m in group[1:]:
            width = 6
            while f"{name}-{m.node[:width]}" in taken and width < len(m.node):
                width += 2
            out[m.node] = replace(m, name=f"{name}-{m.node[:width]}")
            taken.add(out[m.node].name)
    return out


def lost_joins(pool: str, records: Iterable[Record]) -> set[str]:
    """Nodes holding a genuine join that is not a membership and never will be: every use
    of its invite is acknowledged for other joins (or the node was revoked). They may have
    been handed the pool key before."""
    records = list(records)
    acked = acknowledged(pool, records)
    genuine = {j["node"] for j, invite in _genuine_joins(pool, records)
               if j.id not in acked.get(invite.id, ()) and len(acked.get(invite.id, ())) >= invite["uses"]}
    return genuine - set(members(pool, records))


def used_by(pool: str, records: Iterable[Record], node: str) -> Record | None:
    """For a node whose join lost (``lost_joins``): the acknowledgement that took its
    invite's last use (the latest made), to say who used the token and when."""
    records = list(records)
    join = next((r for r in records if r.kind == "join" and r.pool == pool and r["node"] == node), None)
    if join is None:
        return None
    admits = [r for r in records if r.kind == "admit" and r.pool == pool and pool_id_of(r.author) == pool
              and r["invite"] == join["invite"] and r["join"] != join.id]
    return max(admits, key=lambda r: (r["at"], r["join"]), default=None)


def standing(pool: str, records: Iterable[Record], node: str) -> str:
    """Where ``node`` stands by the records: "member"; "revoked"; "lost" (its genuine
    join is not a membership and every use of its invite is acknowledged for other
    joins, so it never will be one); "waiting" (its join lost a tie-break among joins the
    admin has not acknowledged yet: the admin decides); or "unknown" (no genuine join of
    it is held yet). Only "revoked" and "lost" are final: no record that can still arrive
    makes such a node a member again."""
    records = list(records)
    if node in members(pool, records):
        return "member"
    if node in revocations(pool, records):
        return "revoked"
    if node in lost_joins(pool, records):
        return "lost"
    return "waiting" if any(j["node"] == node for j, _ in _genuine_joins(pool, records)) else "unknown"


def _genuine_joins(pool: str, records: list[Record]) -> list[tuple[Record, Record]]:
    """Every genuine join held, with its invite."""
    invites = {r.id: r for r in records if r.kind == "invite" and r.pool == pool and pool_id_of(r.author) == pool}
    return [(r, invites[r["invite"]]) for r in records if r.kind == "join" and r.pool == pool
            and r["invite"] in invites and join_fits_invite(r, invites[r["invite"]])]


def revocations(pool: str, records: Iterable[Record]) -> dict[str, frozenset[str]]:
    """Revoked nodes of ``pool``, each with the ids of its records that still count."""
    out: dict[str, frozenset[str]] = {}
    for rec in records:
        if rec.kind == "revoke" and rec.pool == pool and pool_id_of(rec.author) == pool:
            out[rec["node"]] = out.get(rec["node"], frozenset()) | frozenset(rec["keep"])
    return out
