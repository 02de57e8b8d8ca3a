"""``Spool``: the blobs this peer uploaded, kept with the relays that hold them, to send again.

A blob goes to one relay (the primary). The spool keeps the newest uploads (hard links
into its folder, or bytes in memory without one, for tests and the simulator) and which
relays took each. When no live relay holds one any more (its relay went down, or came
back after an outage without it: ``recheck``), ``resend`` uploads it to the primary, so
what went through a dead relay is sent again through another, or through the same one
once it is back. A download asks the relays that hold the blob first (``fetch_order``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import trio
from ttpeer_wire import TOUCH_MAX_BLOBS

from ._errors import NetError, RelayUnavailable
from ._relayset import Relay, RelaySet

log = logging.getLogger("ttpeer.net")

SPOOL_BLOBS = 64  # the newest uploads kept to send again, at most this many ...
SPOOL_BYTES = 2 * 2**30  # ... and this many bytes


@dataclass
class _Spooled:
    size: int
    holders: set[str]  # urls of relays that took it
    path: Path | None = None
    data: bytes | None = None


class Spool:
    """This peer's uploads through the relays of ``relays``; ``folder`` holds their hard
    links (None: bytes kept in memory)."""

    def __init__(self, relays: RelaySet, folder: Path | None) -> None:
        self._relays, self._folder = relays, folder
        self._held: OrderedDict[str, _Spooled] = OrderedDict()
        self.resent = 0  # blobs uploaded again because the relay holding them went down

    async def keep(self, name: str, url: str, size: int, *, data: bytes | None = None,
                   path: Path | None = None) -> None:
        """Remember that ``url`` took our blob ``name`` (its bytes ``data``, or the file at
        ``path``), to upload it again if that relay goes down or comes back without it."""
        held = self._held.get(name)
        if held is not None:
            held.holders.add(url)
            self._held.move_to_end(name)
            return
        try:
            held = await self._copy(name, size, url, data, path)
        except OSError as exc:
            log.info("could not keep blob %s (%s): it is not sent again if its relay dies", name[:12], exc)
            return
        self._held[name] = held
        total = sum(s.size for s in self._held.values())
        while len(self._held) > SPOOL_BLOBS or (total > SPOOL_BYTES and len(self._held) > 1):
            _old, gone = self._held.popitem(last=False)
            total -= gone.size
            if gone.path is not None:
                gone.path.unlink(missing_ok=True)

    async def _copy(self, name: str, size: int, url: str, data: bytes | None, path: Path | None) -> _Spooled:
        """The spool's copy: a hard link to the uploaded file (free: the daemon's work files
        share its file system), the bytes written to disk, or (no spool folder) in memory."""
        if self._folder is None:
            if data is None:
                assert path is not None
                data = path.read_bytes() if size < 2**20 else await trio.to_thread.run_sync(path.read_bytes)
            return _Spooled(size, {url}, data=data)
        folder, link = self._folder, self._folder / f"{name}.blob"
        folder.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        if path is not None:
            os.link(path, link)
        else:
            assert data is not None
            await trio.to_thread.run_sync(link.write_bytes, data)  # a delta: tens of MB
        return _Spooled(size, {url}, path=link)

    def path(self, name: str) -> Path | None:
        """The file of our blob ``name``, sealed as uploaded, if the spool holds it on disk."""
        held = self._held.get(name)
        return held.path if held is not None else None

    def fetch_order(self, blob: str) -> list[Relay]:
        """The live relays to download ``blob`` from: those that took it from us first."""
        live = self._relays.live()
        held = self._held.get(blob)
        if held is None:
            return live
        return sorted(live, key=lambda r: r.url not in held.holders)  # stable: the primary first

    async def recheck(self, r: Relay) -> None:
        """A relay back after an outage may have restarted empty: our blobs it no longer
        holds are no longer counted as held by it (so ``resend`` sends them again)."""
        names = [name for name, held in self._held.items() if r.url in held.holders]
        for i in range(0, len(names), TOUCH_MAX_BLOBS):
            try:
                missing = await r.client.touch_blobs(names[i : i + TOUCH_MAX_BLOBS])
            except NetError as exc:
                log.info("could not ask relay %s which of our blobs it kept: %s", r.url, exc)
                return
            for name in missing:
                held = self._held.get(name)
                if held is not None:
                    held.holders.discard(r.url)

    def orphans(self) -> list[str]:
        """Blobs of ours that only relays that are down hold (while one is live)."""
        live = {r.url for r in self._relays.live()}
        if not live:
            return []
        return [name for name, s in self._held.items() if not s.holders & live]

    async def resend(self) -> None:
        """Upload each orphan to the primary; stops when the primary goes down."""
        for name in self.orphans():
            held = self._held.get(name)
            primary = self._relays.primary()
            if held is None or primary is None:
                continue
            try:
                if held.path is not None:
                    got = await primary.client.put_blob_file(held.path)
                else:
                    assert held.data is not None
                    got = await primary.client.put_blob(held.data)
            except RelayUnavailable as exc:
                self._relays.set_down(primary, exc)
                return
            except (NetError, OSError) as exc:
                log.warning("could not send blob %s again through %s: %s", name[:12], primary.url, exc)
                held.holders.add(primary.url)  # not again and again: a fetcher that misses it asks
                continue
            if got == name:
                held.holders.add(primary.url)
                self.resent += 1
                log.info("sent blob %s again through %s (the relay that held it is down)", name[:12], primary.url)
