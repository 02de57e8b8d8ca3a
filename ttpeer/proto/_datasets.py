"""Datasets: which dataset records stand, and what a name means. Pure views of the records.

Theory of operation. A ``dataset`` record (``ttpeer_wire/_dataset.py``) says that its
author published these files under a name, with the blobs that hold their pieces. It
*stands* while its author is a member (or a revocation kept it) and no ``dataset_rm``
naming it was signed by its author or an admin member; anyone else's removal is ignored.
Several records may carry one id (the same files added on two machines, each with its
own blobs): any of them is a source of every piece. A name is only a label: it resolves
to one id by a rule every peer can apply (prefer what the asking peer already holds, then
the newest record, then the smallest record id), and a job records the id it resolved to,
so the name never decides anything after submit.

What breaks it: nothing here reads a clock or a file; ``at`` is the author's calendar time,
used only to prefer the newer of two records of one name.
"""

from __future__ import annotations

from collections.abc import Iterable

from ttpeer_wire import Record

from ._ledger import RecordSet


def may_remove_dataset(rs: RecordSet, rec: Record, node: str) -> bool:
    """Whether ``node`` may withdraw the dataset record ``rec``: its author, or an admin member."""
    member = rs.members.get(node)
    return node == rec.author or (member is not None and member.role == "admin")


def live_datasets(rs: RecordSet) -> list[Record]:
    """Every dataset record that stands, by (name, newest first, id)."""
    records = list(rs)
    rms: dict[str, list[str]] = {}
    for r in records:
        if r.kind == "dataset_rm":
            rms.setdefault(r["dataset"], []).append(r.author)
    out = [r for r in records if r.kind == "dataset" and rs.counts(r)
           and not any(may_remove_dataset(rs, r, who) for who in rms.get(r.id, ()))]
    return sorted(out, key=lambda r: (r["name"], -r["at"], r.id))


def dataset_sources(rs: RecordSet, dataset: str) -> list[Record]:
    """The standing records of the dataset with id ``dataset``, each one a set of blobs,
    newest first (a holder that repaired a piece signs a newer record naming its new blob)."""
    return sorted((r for r in live_datasets(rs) if r["id"] == dataset), key=lambda r: (-r["at"], r.id))


def resolve_dataset(rs: RecordSet, name: str, held: Iterable[str] = ()) -> Record | None:
    """The record the name ``name`` means to a peer holding the dataset ids ``held``: one
    it holds if any, else the newest (then smallest id); None if no record has the name."""
    named = [r for r in live_datasets(rs) if r["name"] == name]
    mine = set(held)
    return min(named, key=lambda r: (r["id"] not in mine, -r["at"], r.id), default=None)


def direct_routes(rs: RecordSet) -> dict[str, Record]:
    """The newest ``direct`` record (where it serves pieces, and its TLS certificate) of
    each member, by member. A revoked member's are ignored, kept or not: a revocation keeps
    what the pool's chains rest on, never an address to fetch from."""
    out: dict[str, Record] = {}
    members = rs.members
    for r in rs:
        if r.kind == "direct" and r.author in members:
            seen = out.get(r.author)
            if seen is None or (r["at"], r.id) > (seen["at"], seen.id):
                out[r.author] = r
    return out
