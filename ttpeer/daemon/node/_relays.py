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

from ttpeer_wire import MAX_RELAYS

from ttpeer.errors import UsageError
from ttpeer.net import PoolTransport
from ttpeer.proto import PeerMachine, Record, pool_id_of, pool_relays, relay_pairs, sign

from .._home import Home, PoolConfig

log = logging.getLogger("ttpeer.daemon")


class Follower:
    """Applies the newest ``relays`` record of ``machine``'s records to ``transport`` and to
    the pool's config (``cfg``, kept in ``home``'s ``pool.json``)."""

    def __init__(self, machine: PeerMachine, transport: PoolTransport, home: Home, cfg: PoolConfig) -> None:
        self._machine = machine
        self._transport = transport
        self._home = home
        self.cfg = cfg  # the pool's config as this peer uses it: its relays are the list followed
        self._using: tuple[int, str] | None = None  # (n, id) of the record applied

    def current(self) -> list[tuple[str, str]]:
        """The relays the pool uses: the newest root ``relays`` record's, else the config's."""
        rec = pool_relays(self._machine.pool, self._machine.records)
        return relay_pairs(rec) if rec is not None else self.cfg.relay_pairs()

    def loaded(self) -> None:
        """At start: the newest record among those loaded, before the first connection."""
        rec = pool_relays(self._machine.pool, self._machine.records)
        if rec is not None:
            self.follow(rec)

    def follow(self, rec: Record) -> None:
        """Use ``rec``'s relays if it is root-signed and newer than the list in use."""
        if rec.kind != "relays" or pool_id_of(rec.author) != self._machine.pool:
            return
        if self._using is not None and (rec["n"], rec.id) <= self._using:
            return
        self._using = (rec["n"], rec.id)
        pairs = relay_pairs(rec)
        self._transport.set_relays(pairs)
        if pairs != self.cfg.relay_pairs():
            log.info("the pool's relays are now %s", ", ".join(u for u, _ in pairs))
        try:
            self.cfg = self._home.save_relays(pairs)
        except OSError as exc:
            log.warning("could not write the pool's relays to %s/pool.json (%s); they are used until the "
                        "daemon stops", self._home.path, exc)

    def change(self, at: int, *, add: tuple[str, str] | None = None,
               remove: str | None = None) -> tuple[Record | None, str]:
        """The admin's change: add the relay ``add`` (url, fingerprint) or remove the one at
        url ``remove``. Returns the new list's ``relays`` record, signed with the root key
        at calendar time ``at``, for the caller to publish (None when nothing changed), and
        what happened, in words. Raises ``UsageError``; ``HomeError`` without the root key."""
        current = self.current()
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
                    raise UsageError(f"a pool has at most {MAX_RELAYS} relays; remove one first "
                                     "('ttpeer relay rm URL')")
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
        newest = pool_relays(self._machine.pool, self._machine.records)
        body = {"relays": [[u, f] for u, f in new], "n": (newest["n"] if newest is not None else 0) + 1, "at": at}
        return sign("relays", self._machine.pool, body, self._home.root_key()), said
