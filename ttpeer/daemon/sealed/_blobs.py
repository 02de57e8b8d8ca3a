"""``Blobs``: sealed blobs on the transport, and the work files they pass through.

Everything a peer uploads is sealed with the pool's newest key epoch (``SealingKeys``,
a ``PoolKeys``) under the ``BLOB`` purpose, and opened with any epoch held. Small blobs
(deltas, task files) are sealed and opened in memory; model-sized states file to file,
so they never sit in the daemon's memory; dataset pieces deterministically (their salt
comes from the piece's hash), so a lost piece goes back under its name. A chunked delta
is sealed in cut pieces, so an aggregator fetches only its slice's (``chunk_run``).
Downloads ask the blob's uploaders first when the LAN shortcut is set (``direct``,
``direct_range``), then the relay. A blob that does not open is counted as refused
(``reject``) and raised. What this peer made itself is kept (``OwnCopies``) rather than
downloaded back.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import trio

from ttpeer._chunked import piece_lengths
from ttpeer.net import BlobCorrupt, NetError, Transport
from ttpeer.net._entropy import random_bytes
from ttpeer.net._seal import (
    CUT_HEADER,
    TAG,
    CutTable,
    SealError,
    cut_table,
    open_cut,
    open_sealed_file,
    seal_cut,
    seal_file,
)
from ttpeer.proto import RETRY_AFTER, JobSpec, Record

from .._executor import Deltas
from .._home import Home
from .._offload import file_sha256, in_order, off_loop, off_span
from .._workfiles import disk_or_job, write_work
from ._owncopies import OwnCopies

log = logging.getLogger("ttpeer.daemon")

BLOB = b"ttpeer/blob/v1"
PIECE_SALT = b"ttpeer/data-piece/v1\n"  # a dataset piece's salt: from its hash (``Blobs.put_piece``)
MAX_BLOB = 8 * 2**30
DELTA_UPLOAD_TRIES = 3  # then the delta is given up and its shards trained again
RANGES_AT_ONCE = 8  # contributions an aggregator fetches its slice of at once (``Blobs.deltas``)
AHEAD_BYTES = 64 * 2**20  # whole deltas fetched at once hold at most about this much of the daemon's memory


class SealingKeys(Protocol):
    """What ``Blobs`` uses of the pool's key epochs (``PoolKeys``): oldest first, the last seals."""

    keys: list[bytes]

    @property
    def newest(self) -> bytes | None: ...

    def seal(self, purpose: bytes, data: bytes) -> bytes: ...

    def open(self, purpose: bytes, data: bytes) -> bytes: ...


class Blobs:
    """Sealed blobs on the transport, and the work files they pass through."""

    def __init__(self, keys: SealingKeys, transport: Transport, home: Home, reject: Callable[[str], None]) -> None:
        self._keys = keys
        self._transport = transport
        self._home = home
        self._reject = reject  # counts a blob refused as not authentic
        self._fetches = itertools.count()  # names the work files
        self._own = OwnCopies(home.path / "work" / "own")
        # The LAN shortcut (``Datasets.fetch_blob``): (blob, max size, dest, its uploaders) ->
        # whether the blob came from one of them directly, hash checked, into dest.
        self.direct: Callable[[str, int, Path, list[str]], Awaitable[bool]] | None = None
        # Its ranges (``Datasets.fetch_blob_range``): (blob, start, stop, dest, its uploaders)
        # -> whether bytes start .. stop-1 came from one of them directly into dest.
        self.direct_range: Callable[[str, int, int, Path, list[str]], Awaitable[bool]] | None = None

    def keep_state(self, state: str, path: Path) -> None:
        """``OwnCopies.keep_state``: fetching ``state`` here then takes the file at ``path``."""
        self._own.keep_state(state, path)

    async def take_state(self, state: str, dest: Path) -> bool:
        """``OwnCopies.take_state``: ``state`` moved to ``dest`` if this peer kept it."""
        return await self._own.take_state(state, dest)

    def keep_slice(self, blob: str, data: bytes) -> None:
        """``OwnCopies.keep_slice``: the close that uses the slice ``blob`` need not fetch it."""
        self._own.keep_slice(blob, data)

    def kept_slice(self, blob: str) -> bytes | None:
        return self._own.kept_slice(blob)

    def refused(self, what: str) -> None:
        """Count an input refused as not authentic (status: ``relay.rejected``)."""
        self._reject(what)

    async def put(self, data: bytes) -> str:
        return await self._transport.put_blob(self._keys.seal(BLOB, data))

    async def touch(self, blobs: list[str]) -> list[str]:
        """Restart the relay's TTL of ``blobs`` (at most ``TOUCH_MAX_BLOBS``); returns those it
        does not hold. Raises ``NetError`` (``RelayRejected`` not_found: an older relay)."""
        return await self._transport.touch_blobs(blobs)

    @property
    def relay_ttl(self) -> float | None:
        """The relay's blob TTL in seconds, as it said at login (None: it did not say)."""
        return self._transport.blob_ttl

    async def get(self, blob: str, max_size: int = MAX_BLOB, *, uploaders: list[str] | None = None) -> bytes:
        """The blob ``blob``, opened: from one of its ``uploaders`` directly when one serves
        (the LAN shortcut), else through the relay."""
        assert self._keys.keys, "opening needs a pool key: callers wait for one"
        try:
            sealed = await self._direct_bytes(blob, max_size, uploaders)
            if sealed is None:
                sealed = await self._transport.get_blob(blob, max_size=max_size)
            return self._keys.open(BLOB, sealed)
        except (BlobCorrupt, SealError):
            self._reject("blob")
            raise

    async def _range(self, blob: str, start: int, stop: int, uploaders: list[str], direct: list[bool]) -> bytes:
        """Bytes ``start`` .. ``stop``-1 of the sealed blob ``blob``: from its uploader directly
        when it serves (the LAN shortcut), else one Range request through the relay; appends
        to ``direct`` which it was. Not authenticated: the caller opens its sealed pieces
        (``_open_cut``)."""
        if self.direct_range is not None and uploaders:
            path = self._home.path / "work" / f"direct-{next(self._fetches)}.range"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if await self.direct_range(blob, start, stop, path, uploaders):
                    data = await off_span(stop - start, path.read_bytes)
                    direct.append(True)
                    return data
            except OSError as exc:
                log.info("a range fetched directly could not be read back (%s); fetching it through the relay", exc)
            finally:
                path.unlink(missing_ok=True)
        data = await self._transport.get_blob_range(blob, start, stop)
        direct.append(False)
        return data

    async def _direct_bytes(self, blob: str, max_size: int, uploaders: list[str] | None) -> bytes | None:
        if not uploaders or self.direct is None:
            return None
        path = self._home.path / "work" / f"direct-{next(self._fetches)}.blob"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not await self.direct(blob, max_size, path, uploaders):
                return None
            return await off_span(path.stat().st_size, path.read_bytes)
        except OSError as exc:
            log.info("a blob fetched directly could not be read back (%s); fetching it through the relay", exc)
            return None
        finally:
            path.unlink(missing_ok=True)

    async def seal_file(self, plain: Path, sealed: Path) -> None:
        key = self._keys.newest
        assert key is not None
        await off_loop(plain, seal_file, key, BLOB, plain, sealed)

    async def put_file(self, plain: Path, sealed: Path) -> str:
        """Seal ``plain`` into ``sealed`` and upload it a piece at a time."""
        await self.seal_file(plain, sealed)
        return await self._transport.put_blob_file(sealed)

    async def get_file(self, blob: str, sealed: Path, plain: Path, *, uploaders: list[str] | None = None) -> None:
        """``get`` from file to file: the blob into ``sealed``, opened into ``plain``.
        Raises as ``get`` does, and ``OSError``."""
        try:
            if not (uploaders and self.direct is not None and await self.direct(blob, MAX_BLOB, sealed, uploaders)):
                await self._transport.get_blob_file(blob, sealed, max_size=MAX_BLOB)
            await off_loop(sealed, open_sealed_file, list(reversed(self._keys.keys)), BLOB, sealed, plain)
        except (BlobCorrupt, SealError):
            self._reject("blob")
            raise

    async def put_piece(self, source: Path, span: tuple[int, int], piece_hash: str, sealed: Path, *,
                        blob: str | None = None, fresh: bool = False, upload: bool = True) -> str | None:
        """Seal bytes ``span`` (offset, length) of ``source``, a dataset piece hashing to
        ``piece_hash``, into ``sealed`` and upload it; returns its blob name. Sealing is
        deterministic (the salt comes from the piece's hash): ``blob`` given, the key epoch
        that seals to that name is used, so a lost piece goes back where its record says
        (None if no epoch held here does). ``fresh``: a random salt, so a new name (for a
        piece whose copy on the relay is damaged: the relay keeps a blob it holds).
        ``upload=False``: the name only (``data add --no-relay``; a want uploads it later)."""
        salt = random_bytes(16) if fresh else hashlib.sha256(PIECE_SALT + bytes.fromhex(piece_hash)).digest()[:16]
        for key in reversed(self._keys.keys) if blob is not None else [self._keys.newest]:
            assert key is not None
            await off_span(span[1], seal_file, key, BLOB, source, sealed, salt=salt, span=span)
            if not upload:
                return await trio.to_thread.run_sync(file_sha256, sealed)
            if blob is None or await trio.to_thread.run_sync(file_sha256, sealed) == blob:
                return await self._transport.put_blob_file(sealed)
        return None

    async def get_piece(self, blob: str, size: int, sealed: Path, plain: Path) -> None:
        """Fetch the piece blob ``blob`` (``size`` plaintext bytes) and open it into ``plain``.
        Raises ``BlobMissing``, ``BlobCorrupt``, ``SealError`` (the last two counted as
        refused), ``NetError``, ``OSError``."""
        try:
            await self._transport.get_blob_file(blob, sealed, max_size=size + 4096 + size // 1024)
            await off_span(size, open_sealed_file, list(reversed(self._keys.keys)), BLOB, sealed, plain)
        except (BlobCorrupt, SealError):
            self._reject("blob")
            raise

    async def upload_delta(self, data: bytes, *, cut: bool = False) -> str | None:
        """Upload a delta, retrying a failed upload a few times (the local model has moved
        on, so a delta given up on is trained again); None if every try failed. A copy is
        kept here (``deltas`` reads it instead of downloading this peer's own delta).
        ``cut``: a chunked delta, sealed in its pieces (``seal_cut``: the head, then one per
        chunk) so that an aggregator fetches only its slice's (``deltas`` with a run)."""
        sealed = self._seal_cut(data) if cut else self._keys.seal(BLOB, data)
        for attempt in range(DELTA_UPLOAD_TRIES):
            try:
                blob = await self._transport.put_blob(sealed)
                await self._own.keep_delta(blob, data)
                return blob
            except NetError as exc:
                last = attempt == DELTA_UPLOAD_TRIES - 1
                log.warning("delta upload failed (%s); %s", exc,
                            "its shards will be trained again" if last else "retrying")
                if not last:
                    await trio.sleep(RETRY_AFTER)
        return None

    def _seal_cut(self, data: bytes) -> bytes:
        key = self._keys.newest
        assert key is not None, "sealing needs a pool key: callers wait for one"
        pieces, at = [], 0
        for length in piece_lengths(data):
            pieces.append(data[at:at + length])
            at += length
        return seal_cut(key, BLOB, pieces)

    async def chunk_run(self, contrib: Record, first: int, stop: int, dest: Path) -> None:
        """Chunks ``first`` .. ``stop``-1 of a contribution's chunked delta (sealed in cut
        pieces) into ``dest``: its head at the start and those chunks' frames where they lie
        in the delta, the rest a hole (a sparse file): what ``reduce_slice`` reads. Three
        range requests in two round trips: the table, then the head and the chunks, from the
        uploader directly when it serves; pieces from it that do not open are fetched again
        through the relay (a range cannot be hash-checked before it is opened, and every
        aggregator asking the same uploader would otherwise refuse the slice for good).
        Raises ``SealError`` (counted as refused) if a piece from the relay does not open,
        ``NetError``, ``OSError``."""
        blob, chunks = contrib["blob"], contrib.body.get("chunks")
        if not isinstance(chunks, int) or not 0 <= first < stop <= chunks:
            raise SealError(f"contribution {contrib.id[:12]} holds no chunks [{first}, {stop})")
        direct: list[bool] = []
        try:
            try:
                table, head, frames = await self._cut_run(blob, chunks, first, stop, [contrib.author], direct)
            except (BlobCorrupt, SealError) as exc:
                if not any(direct):
                    raise
                log.warning("chunks of contribution %s fetched from its uploader did not open (%s); "
                            "fetching them through the relay", contrib.id[:12], exc)
                self._reject("direct range")
                table, head, frames = await self._cut_run(blob, chunks, first, stop, [], direct)
        except (BlobCorrupt, SealError):
            self._reject("blob")
            raise
        offset = sum(table.lengths[:first + 1])

        def write() -> None:
            with open(dest, "wb") as f:
                f.write(head[0])
                f.seek(offset)
                for frame in frames:
                    f.write(frame)

        await off_span(sum(map(len, frames)), write)

    async def _cut_run(self, blob: str, chunks: int, first: int, stop: int, uploaders: list[str],
                       direct: list[bool]) -> tuple[CutTable, list[bytes], list[bytes]]:
        """The cut table of ``blob``, its head piece and the pieces of chunks ``first`` ..
        ``stop``-1, opened; from ``uploaders`` directly when one serves, else the relay
        (``direct`` gets, per range, whether it came directly)."""
        table = cut_table(await self._range(blob, 0, CUT_HEADER + 4 * (chunks + 1), uploaders, direct))
        if table.count != chunks + 1:
            raise SealError(f"a delta of {chunks} chunks is sealed in {table.count} pieces")
        head_bytes, frame_bytes = await in_order([  # the two at once: one round trip, not two
            lambda: self._range(blob, *table.span(0, 1), uploaders, direct),
            lambda: self._range(blob, *table.span(first + 1, stop + 1), uploaders, direct)], limit=2)
        return table, self._open_cut(table, 0, 1, head_bytes), self._open_cut(table, first + 1, stop + 1, frame_bytes)

    def _open_cut(self, table: CutTable, first: int, stop: int, data: bytes) -> list[bytes]:
        for key in reversed(self._keys.keys):
            try:
                return open_cut(key, BLOB, table, first, stop, data)
            except SealError:
                continue
        raise SealError("a delta's pieces do not authenticate under any pool key held here")

    @contextlib.contextmanager
    def work_files(self, job: str, what: str) -> Iterator[tuple[Path, Path]]:
        """Two fresh paths in ``HOME/work/<job>/`` for a state and its sealed copy, removed
        when the block ends (a crash leaves them to the startup sweep of ``work/``)."""
        folder = self._home.path / "work" / job
        folder.mkdir(parents=True, exist_ok=True)
        n = next(self._fetches)
        paths = folder / f"{what}-{n}.state", folder / f"{what}-{n}.sealed"
        try:
            yield paths
        except OSError as exc:  # writing or reading a file, in the transport too
            raise disk_or_job(folder, exc) from None
        finally:
            for path in paths:
                path.unlink(missing_ok=True)

    def work_path(self, job: str, what: str) -> Path:
        """A new work file's path in ``HOME/work/<job>/`` (the folder made), named for ``what``."""
        folder = self._home.path / "work" / job
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{what}-{next(self._fetches)}.bin"

    async def fetch_delta(self, contrib: Record, path: Path) -> None:
        """``contrib``'s whole delta, opened, into the file ``path``. Raises ``NetError`` or
        ``SealError`` for the fetch; ``DiskError`` (a full disk stops the daemon, as for any
        other write) or ``JobError`` for the write (``write_work``)."""
        write_work(path, await self.get(contrib["blob"], max_size=sealed_bound(contrib), uploaders=[contrib.author]))

    @contextlib.asynccontextmanager
    async def deltas(self, job: JobSpec, contribs: tuple[Record, ...], run: tuple[int, int] | None = None,
                     ahead: Callable[[Record, Path], Awaitable[bool]] | None = None) -> AsyncIterator[Deltas]:
        """The round's contributions as files in ``HOME/work/<job>/``, which the executor
        reads one at a time when its outer step gets to it. Whole deltas come
        ``whole_at_once`` at a time (as many as fit ``AHEAD_BYTES``: each passes through the
        daemon's memory once, and one at a time each cost a round trip in turn); ``ahead``
        moves a delta fetched ahead of the close into the given path (``DeltasAhead.take``)
        and says whether it did. ``run``: chunks ``[first, stop)`` only, of chunked deltas
        (``chunk_run``): an aggregator downloads its slice of every delta, not the deltas,
        ``RANGES_AT_ONCE`` contributions at a time. This peer's own delta is its copy here.
        The files are in the order of ``contribs`` and are removed when the block ends."""
        made: list[Path] = []

        async def fetch(c: Record) -> tuple[Path, int]:
            path = self.work_path(job.id, "in")
            made.append(path)
            if await self._own.copy_delta(c["blob"], path, c["size"]):
                return path, c["samples"]  # this peer's own delta: no download
            if run is not None:
                try:
                    await self.chunk_run(c, *run, path)
                except OSError as exc:
                    raise disk_or_job(path.parent, exc) from None
            elif ahead is None or not await ahead(c, path):
                await self.fetch_delta(c, path)
            return path, c["samples"]

        try:
            paths: Deltas = await in_order([functools.partial(fetch, c) for c in contribs],
                                           limit=whole_at_once(contribs) if run is None else RANGES_AT_ONCE)
            yield paths
        finally:
            for path in made:
                path.unlink(missing_ok=True)


def whole_at_once(contribs: Sequence[Record]) -> int:
    """How many of ``contribs``' whole deltas to fetch at once: as many as ``AHEAD_BYTES``
    holds of the largest, 1 to ``RANGES_AT_ONCE``."""
    largest = max((sealed_bound(c) for c in contribs), default=1)
    return max(1, min(RANGES_AT_ONCE, AHEAD_BYTES // largest))


def sealed_bound(contrib: Record) -> int:
    """The most bytes a contribution's sealed blob may take: its delta and the sealing (a
    chunked delta's: the cut table and one tag per piece)."""
    chunks = contrib.body.get("chunks")
    pieces = chunks + 1 if isinstance(chunks, int) else 0
    return contrib["size"] + 64 + CUT_HEADER + (4 + TAG) * pieces
