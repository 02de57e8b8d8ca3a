"""Who is in the pool: a pure function of the records held.

Theory of operation. The pool id is a hash of the root public key, so an invite
is genuine exactly when its author hashes to the pool id. A join is genuine when
its invite is, it is signed by that invite's key, and it was made before the
invite expired. An invite admits at most ``uses`` joins; when more race for it,
the joins with the lowest ids win, so every peer that holds the same records
picks the same members (I1). A node that joined twice counts once.

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
    used: dict[str, int] = {}
    out: dict[str, Member] = {}
    at: dict[str, int] = {}
    for join in sorted(joins, key=lambda r: r.id):
        invite = invites.get(join["invite"])
        if invite is None or not join_fits_invite(join, invite):
            continue
        if used.get(invite.id, 0) >= invite["uses"] or join["node"] in out:
            continue
        used[invite.id] = used.get(invite.id, 0) + 1  # a revoked node still used its invite
        out[join["node"]] = Member(
            join["node"], join["seal"], join["name"], invite["role"], join.id, invite.id
        )
        at[join["node"]] = join["at"]
    return _unique_names(out, at)


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
    """Nodes holding a genuine join that is not a membership: they lost a race for an
    invite's last use (or were revoked). They may have been handed the pool key
    before the winner's join reached the peer that handed it over."""
    records = list(records)
    invites = {r.id: r for r in records if r.kind == "invite" and r.pool == pool and pool_id_of(r.author) == pool}
    genuine = {
        r["node"] for r in records
        if r.kind == "join" and r.pool == pool and r["invite"] in invites and join_fits_invite(r, invites[r["invite"]])
    }
    return genuine - set(members(pool, records))


def standing(pool: str, records: Iterable[Record], node: str) -> str:
    """Where ``node`` stands by the records: "member"; "revoked"; "lost" (its genuine
    join lost the race for its invite's last use, so it never will be one); or
    "unknown" (no genuine join of it is held yet). Only "revoked" and "lost" are final:
    no record that can still arrive makes such a node a member again."""
    records = list(records)
    if node in members(pool, records):
        return "member"
    if node in revocations(pool, records):
        return "revoked"
    return "lost" if node in lost_joins(pool, records) else "unknown"


def revocations(pool: str, records: Iterable[Record]) -> dict[str, frozenset[str]]:
    """Revoked nodes of ``pool``, each with the ids of its records that still count."""
    out: dict[str, frozenset[str]] = {}
    for rec in records:
        if rec.kind == "revoke" and rec.pool == pool and pool_id_of(rec.author) == pool:
            out[rec["node"]] = out.get(rec["node"], frozenset()) | frozenset(rec["keep"])
    return out
