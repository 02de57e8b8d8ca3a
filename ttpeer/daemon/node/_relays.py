"""The pool's relays as the daemon lives them: the admin changes the list, every peer
follows the newest one.

Theory of operation. A pool starts with the relays of its token (``pool.json``). The
admin's ``ttpeer relay add`` / ``rm`` signs a root ``relays`` record with the whole new
list and ``n`` one higher; it spreads like any record. Each peer that persists one newer
than the list it uses (``proto.pool_relays``: the highest ``n`` counts) hands the list to
its transport (``MultiRelay.set_relays``: new relays are connected, removed ones closed)
and writes it to ``pool.json``, so a restart and ``ttpeer invite`` use it. At start the
newest one among the records loaded is applied before the first connection.
"""

from __future__ import annotations

import logging
from typing import Any

from ttpeer_wire import MAX_RELAYS

from ttpeer.errors import UsageError
from ttpeer.proto import Record, RevokeError, pool_id_of, pool_relays, relay_pairs, sign

log = logging.getLogger("ttpeer.daemon")


def relays_now(node: Any) -> list[tuple[str, str]]:
    """The relays the pool uses: the newest root ``relays`` record's, else the config's."""
    rec = pool_relays(node.cfg.pool, node.machine.records)
    return relay_pairs(rec) if rec is not None else node.cfg.relay_pairs()


def change(node: Any, *, add: tuple[str, str] | None = None, remove: str | None = None) -> tuple[Record | None, str]:
    """Add the relay ``add`` (url, fingerprint) or remove the one at url ``remove``: sign and
    publish the new list (admin only). Returns the record (None when nothing changed) and
    what happened, in words. Raises ``RevokeError`` (not the admin), ``UsageError``."""
    if not node.is_admin:
        raise RevokeError("only the pool admin (the machine that ran 'ttpeer pool create') can change the "
                          "pool's relays")
    current = relays_now(node)
    urls = [u for u, _ in current]
    if add is not None:
        url, fp = add[0].rstrip("/"), add[1].lower()
        if (url, fp) in current:
            return None, f"{url} is already one of the pool's relays, with that fingerprint"
        if url in urls:
            new = [(u, fp if u == url else f) for u, f in current]
            said = f"{url} is now pinned to {fp}"
        else:
            if len(current) >= MAX_RELAYS:
                raise UsageError(f"a pool has at most {MAX_RELAYS} relays; remove one first ('ttpeer relay rm URL')")
            new = [*current, (url, fp)]
            said = f"added {url}; the pool has {len(new)} relays"
    else:
        assert remove is not None
        url = remove.rstrip("/")
        if url not in urls:
            raise UsageError(f"{url} is not one of the pool's relays ({', '.join(urls)})")
        if len(current) == 1:
            raise UsageError(f"{url} is the pool's only relay: add another first ('ttpeer relay add URL "
                             "--fingerprint FP'), then remove this one")
        new = [(u, f) for u, f in current if u != url]
        said = f"removed {url}; the pool has {len(new)} relay{'s' if len(new) > 1 else ''}"
    rs = node.machine.records
    newest = pool_relays(node.cfg.pool, rs)
    body = {"relays": [[u, f] for u, f in new], "n": (newest["n"] if newest is not None else 0) + 1,
            "at": int(node.wall())}
    rec = sign("relays", node.cfg.pool, body, node.home.root_key())
    node.process(node.machine.add_local(rec, node.now()))  # persisted: follow() applies it here too
    return rec, said


class Follower:
    """Applies the newest ``relays`` record to the transport and the config."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._using: tuple[int, str] | None = None  # (n, id) of the record applied

    def loaded(self) -> None:
        """At start: the newest record among those loaded, before the first connection."""
        rec = pool_relays(self._node.cfg.pool, self._node.machine.records)
        if rec is not None:
            self.follow(rec)

    def follow(self, rec: Record) -> None:
        """Use ``rec``'s relays if it is root-signed and newer than the list in use."""
        node = self._node
        if rec.kind != "relays" or pool_id_of(rec.author) != node.cfg.pool:
            return
        if self._using is not None and (rec["n"], rec.id) <= self._using:
            return
        self._using = (rec["n"], rec.id)
        pairs = relay_pairs(rec)
        node.transport.set_relays(pairs)
        if pairs != node.cfg.relay_pairs():
            log.info("the pool's relays are now %s", ", ".join(u for u, _ in pairs))
        try:
            node.cfg = node.home.save_relays(pairs)
        except OSError as exc:
            log.warning("could not write the pool's relays to %s/pool.json (%s); they are used until the "
                        "daemon stops", node.home.path, exc)
