"""The pool's relays: which ``relays`` record counts, a pure function of the records.

Only the root signs one (``ttpeer relay add``/``rm`` on the admin); the highest ``n``
counts, and of two with one ``n`` the higher record id, so every peer holding the same
records uses the same list, in the same order. A relays record signed by anyone else
(a member, a revoked node) is ignored, kept or not.
"""

from __future__ import annotations

from collections.abc import Iterable

from ttpeer_wire import Record, pool_id_of


def pool_relays(pool: str, records: Iterable[Record]) -> Record | None:
    """The ``relays`` record of ``pool`` that counts, or None while the root signed none."""
    best: Record | None = None
    for rec in records:
        if rec.kind == "relays" and rec.pool == pool and pool_id_of(rec.author) == pool:
            if best is None or (rec["n"], rec.id) > (best["n"], best.id):
                best = rec
    return best


def relay_pairs(rec: Record) -> list[tuple[str, str]]:
    """A relays record's (url, fingerprint) pairs, in order."""
    return [(str(url), str(fp)) for url, fp in rec["relays"]]
