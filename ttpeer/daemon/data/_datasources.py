"""Where a dataset piece comes from, each answer checked against the piece's hash.

Theory of operation. ``Sources.fetch_piece`` asks, in order, the members that serve
directly (``_direct``: the LAN shortcut, the dataset's authors first), then the record's
urls (``_urlsource``, a Range GET), then the relay's blobs of every standing record of
that id (newest first); the first answer that opens and hashes to the record's is written
at its place (``DataStore.put_piece``). A member that lacks the piece is not asked for
that dataset for ``LACKS_FOR`` seconds, nor one that sent wrong bytes; an address that did
not answer is skipped for ``URL_BACKOFF``. Refused pieces are counted by source
(``FetchStats``): only the relay's count as damaged (a want asks a holder to replace
those); wrong bytes from an address or a member leave the relay's copy alone.

Deltas and states come from their uploaders directly the same way (``fetch_blob``,
``fetch_blob_range``: ``Blobs.direct``), else the relay serves them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import trio

from ttpeer.net import BlobCorrupt, BlobMissing, NetError
from ttpeer.proto import PeerMachine, dataset_sources

from .._offload import file_sha256, off_span
from ..sealed._blobs import Blobs
from ..sealed._keys import SealError
from ._datastore import DataStore, Piece, piece_ok
from ._datawork import WorkFiles
from ._direct import DirectFailed, DirectFetcher
from ._urlsource import UrlFailed, UrlSource, host_of

log = logging.getLogger("ttpeer.daemon")

URL_BACKOFF = 60.0  # a dataset address that did not answer is skipped this long
LACKS_FOR = 30.0  # a member that did not have a piece is not asked for that dataset this long


@dataclass
class FetchStats:
    """What this peer has fetched of one dataset (status; kept in meta.json once done)."""

    total: int
    done: int = 0
    fetched_bytes: int = 0
    bad_pieces: int = 0  # refused from the relay (a want calls these damaged)
    url_bytes: int = 0  # of fetched_bytes, from the record's urls
    url_refused: int = 0  # pieces an address served wrong (then fetched from the next source)
    direct_bytes: int = 0  # of fetched_bytes, from members directly (``_direct``)
    direct_refused: int = 0  # pieces a member sent wrong (then fetched from the next source)

    @property
    def refused(self) -> int:
        """Pieces refused from any source (status' ``bad_pieces``)."""
        return self.bad_pieces + self.url_refused + self.direct_refused


class Sources:
    """The sources of dataset pieces and, directly, of deltas and states; what each served.
    Pieces go into ``store`` through ``work``'s scratch files; ``machine``'s records name
    the sources, ``blobs`` are the relay's, ``direct`` the members'."""

    def __init__(self, store: DataStore, work: WorkFiles, machine: PeerMachine, blobs: Blobs,
                 direct: DirectFetcher) -> None:
        self.store = store
        self._work = work
        self._machine = machine
        self._blobs = blobs
        self.urls = UrlSource()  # the daemon gives it its proxy (``_run``)
        self._url_down: dict[str, float] = {}  # address -> until when it is skipped
        self.direct = direct  # the LAN shortcut
        self._lacks: dict[tuple[str, str], float] = {}  # (member, dataset) -> until when not asked
        self.blob_direct_bytes = 0  # deltas and states fetched from their uploaders directly
        self.blob_direct_refused = 0  # ... that did not hash to their names (then the relay served)

    async def fetch_piece(self, dataset: str, piece: Piece, blobs: list[str], done: set[int],
                          got: FetchStats) -> bool:
        """Fetch ``piece`` from the first source that serves it right: a member directly, the
        record's urls, then ``blobs`` on the relay; write it at its place in the assembly and
        add it to ``done``. False if none did. Raises ``DiskError``, ``JobError``."""
        if await self._fetch_direct(dataset, piece, done, got):
            return True
        if await self._fetch_from_urls(dataset, piece, done, got):
            return True
        for blob in blobs:
            with self._work.file() as sealed, self._work.file("plain") as plain:
                try:
                    await self._blobs.get_piece(blob, piece.size, sealed, plain)
                except BlobMissing:
                    continue
                except (BlobCorrupt, SealError) as exc:
                    got.bad_pieces += 1
                    log.warning("refused piece %d of dataset %s: %s", piece.index, dataset[:12], exc)
                    continue
                except NetError as exc:
                    log.info("piece %d of dataset %s not fetched: %s", piece.index, dataset[:12], exc)
                    continue
                if not await trio.to_thread.run_sync(piece_ok, plain, piece):
                    got.bad_pieces += 1
                    self._blobs.refused("dataset piece")
                    log.warning("refused piece %d of dataset %s: its bytes do not hash to the record's",
                                piece.index, dataset[:12])
                    continue
                await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                return True
        return False

    async def _fetch_direct(self, dataset: str, piece: Piece, done: set[int], got: FetchStats) -> bool:
        """Fetch ``piece`` from a member that serves it directly (the dataset's authors
        first); False if none did. A member that lacks the piece is not asked for that
        dataset again for ``LACKS_FOR`` seconds; one that sends wrong bytes counts refused."""
        rs = self._machine.records
        now = trio.current_time()
        prefer = [r.author for r in dataset_sources(rs, dataset)]
        for member, route in self.direct.routes(rs, prefer):
            if self._lacks.get((member, dataset), now) > now:
                continue
            with self._work.file("plain") as plain:
                try:
                    await self.direct.get(member, route, dataset, piece.index, piece.size, plain)
                except DirectFailed as exc:
                    if exc.lacks:
                        self._lacks[(member, dataset)] = now + LACKS_FOR
                    log.debug("piece %d of dataset %s not fetched directly: %s", piece.index, dataset[:12], exc)
                    continue
                if not await trio.to_thread.run_sync(piece_ok, plain, piece):
                    got.direct_refused += 1
                    self._blobs.refused("dataset piece")
                    self._lacks[(member, dataset)] = now + LACKS_FOR
                    log.warning("refused piece %d of dataset %s from %s directly: its bytes do not hash to the "
                                "record's", piece.index, dataset[:12], member[:12])
                    continue
                await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                got.direct_bytes += piece.size
                return True
        return False

    async def _fetch_from_urls(self, dataset: str, piece: Piece, done: set[int], got: FetchStats) -> bool:
        """Fetch ``piece`` from the first address of the dataset's records (newest first)
        that serves it right; False if none did. Wrong bytes count in ``url_refused``, not
        as damaged on the relay (whose copy a want would then replace)."""
        now = trio.current_time()
        urls = [u for u in dict.fromkeys(u for r in dataset_sources(self._machine.records, dataset)
                                         for u in r.body.get("urls", ())) if self._url_down.get(u, now) <= now]
        if not urls:
            return False
        async with self.urls.client() as client:
            for url in urls:
                with self._work.file("plain") as plain:
                    try:
                        await self.urls.get(client, url, piece.path, piece.offset, piece.size, plain)
                    except UrlFailed as exc:
                        if exc.status is None:  # no answer: do not wait for it again on every piece
                            self._url_down[url] = trio.current_time() + URL_BACKOFF
                        log.info("piece %d of dataset %s not fetched from %s: %s", piece.index, dataset[:12],
                                 host_of(url), exc)
                        continue
                    if not await trio.to_thread.run_sync(piece_ok, plain, piece):
                        got.url_refused += 1
                        self._blobs.refused("dataset piece")
                        log.warning("refused piece %d of dataset %s from %s: its bytes do not hash to the record's",
                                    piece.index, dataset[:12], host_of(url))
                        continue
                    await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                    got.url_bytes += piece.size
                    return True
        return False

    async def fetch_blob(self, blob: str, max_size: int, dest: Path, uploaders: list[str]) -> bool:
        """Fetch the sealed blob ``blob`` into ``dest`` from one of its ``uploaders`` that serves
        directly (only an uploader holds a delta or a state it sent); False if none did, and
        the relay serves it. Bytes that do not hash to the blob's name are refused."""
        rs = self._machine.records
        for member, route in self.direct.routes(rs, uploaders):
            if member not in uploaders:
                break  # the others are in order after them, and hold no copy
            try:
                await self.direct.get_blob(member, route, blob, max_size, dest)
            except DirectFailed as exc:
                log.debug("blob %s not fetched directly: %s", blob[:12], exc)
                continue
            size = dest.stat().st_size
            digest = await off_span(size, file_sha256, dest)
            if digest != blob:
                self.blob_direct_refused += 1
                self._blobs.refused("blob")
                log.warning("refused blob %s from %s directly: its bytes do not hash to its name", blob[:12],
                            member[:12])
                continue
            self.blob_direct_bytes += size
            return True
        dest.unlink(missing_ok=True)
        return False

    async def fetch_blob_range(self, blob: str, start: int, stop: int, dest: Path, uploaders: list[str]) -> bool:
        """Fetch bytes ``start`` .. ``stop``-1 of the sealed blob ``blob`` into ``dest`` from
        one of its ``uploaders`` that serves directly; False if none did, and the relay serves
        them. A range has no hash to check: the caller opens its sealed pieces, which only a
        member could have sealed (and the uploader, a member, could as well have uploaded
        other bytes)."""
        for member, route in self.direct.routes(self._machine.records, uploaders):
            if member not in uploaders:
                break  # the others are in order after them, and hold no copy
            try:
                await self.direct.get_range(member, route, blob, start, stop, dest)
            except DirectFailed as exc:
                log.debug("a range of blob %s not fetched directly: %s", blob[:12], exc)
                continue
            self.blob_direct_bytes += stop - start
            return True
        dest.unlink(missing_ok=True)
        return False
