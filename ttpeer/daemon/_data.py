"""Datasets that reach the peers: ``data add``, fetching a job's datasets, serving pieces.

Theory of operation. ``Datasets`` is the node's part for data; it runs on the trio thread
and does its file work in worker threads (``_datastore``).

- **add** (``ttpeer data add``): the files are copied into ``HOME/datasets/<id>/files``
  while their pieces are hashed (a file that changes meanwhile is refused, by name), each
  piece is sealed and uploaded once (``Blobs.put_piece``: deterministic sealing, so the
  piece's blob name is a function of the pool key epoch and the piece), and a signed
  ``dataset`` record names the manifest, the id and the blobs. The copy is this peer's
  local source; ``data add`` of files held already uploads nothing new. ``--url`` adds
  https addresses that serve the files too (the record's ``urls``; the first file is read
  back from each before anything is signed), ``--no-relay`` names the blobs without
  uploading them (a want uploads them later).
- **ensure** (before a peer prepares a job, and at submit for a dataset the submitter does
  not hold): every dataset the job records is held, or fetched: piece by piece from the
  blobs of every standing record of that id, each opened and checked against its hash
  before it is written at its place (``DataStore.put_piece``); a piece refused (a blob that
  does not hash to its name, does not open, or opens to other bytes) is counted and fetched
  again. Pieces nobody serves leave the job waiting, with its phase saying how far it got
  ("waiting for dataset corpus: 3/10 pieces ..."), and retrying with backoff; it never
  raises for that. Each piece is asked first of the members that serve directly
  (``_direct``: the LAN shortcut, the dataset's authors first), then of the record's urls,
  then of the relay. A job the pool ends meanwhile stops the wait (one that finished does
  not: the final model is written by the task this peer loads). A record with ``urls``:
  each piece is asked of those first (``_urlsource``, a Range GET), checked by the same
  hash; wrong bytes there are counted but do not mark the relay's copy damaged.
- **keeping pieces fetchable**: a fetcher that misses pieces broadcasts a *want* (a ``W``
  message, sealed as gossip is under a purpose of its own: ``{"want": {"id", "pieces",
  "damaged"}}``, which the protocol machine never sees); every peer holding the dataset
  uploads those pieces again: a piece the relay lost (its TTL, its quota, a restart) under
  the same blob name, one it served damaged under a new name, in a newer record of the same
  id (the relay keeps a blob it holds, so the same name would bring the damaged copy back).
  So a piece stays fetchable while one holder is up. Fetchers try the newest record's first.
- **the pin** (``keep_pinned``): a holder may go offline for good (the desktop that ran
  ``data add``) while the others train for days, and a piece nobody holds whole would
  lapse with the relay's blob TTL. So while a job that names a dataset has not ended for
  the pool (``pinned``), every peer restarts the TTL of the blobs of that dataset's
  newest record (``POST /v1/touch``, 512 a request) every third of the TTL the relay
  told it, within 30 s..1 h; a blob the relay no longer holds goes back under its name
  from a peer holding the dataset whole, else a fetcher's want finds a holder. It is a
  lease: once the job ends, or every peer stops, the pieces lapse with the TTL. Every
  peer touches, not a chosen few: it costs one request per 512 blobs an hour on the
  default 7-day TTL, and no choice to get wrong when the chosen ones are gone.
- **the cache**: fetched datasets are evicted least recently used past ``cache_bytes``,
  never one a job this peer has not finished uses, never one added here.

What breaks it: the only holder gone and a piece lost on the relay anyway (its disk, or
a relay without touches: then the job waits, and says so); a dataset record over the
record cap (``data add`` says to use larger pieces).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import (
    BLOB_TTL,
    DEFAULT_PIECE_SIZE,
    MIN_PIECE_SIZE,
    TOUCH_MAX_BLOBS,
    ErrorCode,
    dataset_id,
    record_files,
    samples_hash,
    urls_problem,
)

from ttpeer.errors import DataError, DiskError, JobError
from ttpeer.net import BlobCorrupt, BlobMissing, NetError, RelayRejected
from ttpeer.proto import (
    Effect,
    PeerMachine,
    Record,
    RecordError,
    dataset_sources,
    decode,
    encode,
    job_ended,
    live_datasets,
    may_remove_dataset,
    resolve_dataset,
    sign,
)

from ._counters import Counters
from ._datastore import (
    DataStore,
    Piece,
    auto_piece_size,
    copy_and_hash,
    parse_format,
    piece_blobs,
    piece_ok,
    pieces_of,
    pieces_of_files,
    sample_index,
    scan,
)
from ._direct import DirectFailed, DirectFetcher, DirectStats
from ._home import Home, PoolConfig
from ._keys import Blobs, SealError, file_sha256, off_span
from ._urlsource import UrlFailed, UrlSource, host_of, shown
from ._workfiles import disk_or_job

log = logging.getLogger("ttpeer.daemon")

MAX_WANT = 256  # pieces named in one want
DEFAULT_CACHE_BYTES = 64 * 2**30
RETRY_FIRST, RETRY_MAX = 0.5, 15.0  # seconds between passes over pieces not fetched yet
REUPLOAD_EVERY = 2.0  # a holder uploads one piece again at most this often
REPAIR_EVERY = 60.0  # ... and under a new name (a new record) at most this often
URL_BACKOFF = 60.0  # a dataset address that did not answer is skipped this long
LACKS_FOR = 30.0  # a member that did not have a piece is not asked for that dataset this long
PIN_MIN, PIN_MAX = 30.0, 3600.0  # seconds between touches of pinned pieces: a third of the TTL, within these
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class Host(Protocol):
    """What the data part uses of the running node (``_node.Node`` is one)."""

    machine: PeerMachine
    me: str
    cfg: PoolConfig
    home: Home
    blobs: Blobs
    counters: Counters
    node_key: Ed25519PrivateKey
    key_event: trio.Event

    @property
    def pool_key(self) -> bytes | None: ...
    nursery: trio.Nursery | None
    phases: dict[str, str]
    finished: dict[str, str]  # job -> the state whose final files this peer wrote

    def wall(self) -> float: ...
    def now(self) -> float: ...
    def process(self, effects: list[Effect], *, wake: bool = True) -> None: ...
    def broadcast_want(self, payload: bytes) -> None: ...


@dataclass
class _Fetch:
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


class Datasets:
    def __init__(self, node: Host, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._node = node
        self.store = DataStore(node.home.path / "datasets")
        self.store.sweep()
        self.cache_bytes = cache_bytes
        self.fetches: dict[str, _Fetch] = {}
        self._reuploaded: dict[tuple[str, int], float] = {}
        self._repaired: dict[tuple[str, int], float] = {}
        self._locks: dict[str, trio.Lock] = {}  # one piece of a dataset written at a time
        self._done: dict[str, set[int]] = {}  # assemblies here: the pieces verified so far
        self._prefetching: dict[str, list[int]] = {}  # dataset -> pieces queued for prefetch
        self._prefetch_running: set[str] = set()
        self._waiting: dict[str, int] = {}  # datasets a fetch waits on (prefetch steps aside)
        self._quiet: dict[str, trio.Event] = {}  # set when no fetch waits on the dataset
        self.reuploads: dict[str, int] = {}  # pieces uploaded again for others, by dataset
        self._names = 0  # work file names
        self.urls = UrlSource()  # the daemon gives it its proxy (``_run``)
        self._url_down: dict[str, float] = {}  # address -> until when it is skipped
        self.direct = DirectFetcher(node.node_key, node.me, lambda: node.pool_key, node.wall)  # the LAN shortcut
        self.direct_stats: DirectStats | None = None  # what this peer served directly (``serve_direct``)
        self._lacks: dict[tuple[str, str], float] = {}  # (member, dataset) -> until when not asked
        self.blob_direct_bytes = 0  # deltas and states fetched from their uploaders directly
        self.blob_direct_refused = 0  # ... that did not hash to their names (then the relay served)

    # -- add -----------------------------------------------------------------------------

    async def add(self, path: str, name: str | None, piece_size: int | None = DEFAULT_PIECE_SIZE,
                  fmt: str | None = None, *, urls: list[str] | None = None, relay: bool = True) -> tuple[Record, bool]:
        """Add the file or folder at ``path`` under ``name`` (default: its base name), with a
        sample index when ``fmt`` names a format (``_datastore.parse_format``).
        ``urls``: https base addresses that serve the files too (checked here first);
        ``relay=False``: upload no piece now (peers fetch from ``urls``; a want uploads).
        Returns the dataset record and whether it is new. Raises ``DataError``, ``DiskError``."""
        source = Path(path).expanduser()
        name = name or source.name
        if not _NAME.fullmatch(name or ""):
            raise DataError(f"dataset name {name!r} must be 1-64 letters, digits, '.', '_' or '-': give --name")
        if piece_size is not None and not MIN_PIECE_SIZE <= piece_size <= 2**30:
            raise DataError(f"--piece-size must be between {MIN_PIECE_SIZE} bytes and 1 GiB, got {piece_size}")
        if fmt is not None:
            parse_format(fmt)  # a bad --format is refused before anything is read
        if urls and (problem := urls_problem(urls)):
            raise DataError(f"--url: {problem}")
        if not relay and not urls:
            raise DataError("--no-relay needs --url: the peers must fetch the pieces from somewhere")
        await self._node.key_event.wait()
        sources = await trio.to_thread.run_sync(scan, source)
        if piece_size is None:
            piece_size = auto_piece_size([f.stat().st_size for _rel, f in sources])
        self.store.root.mkdir(parents=True, exist_ok=True)
        tmp = self.store.root / f"add-{secrets.token_hex(6)}"
        try:
            files = await trio.to_thread.run_sync(copy_and_hash, sources, tmp / "files", piece_size)
            samples = (await trio.to_thread.run_sync(sample_index, tmp / "files", files, piece_size, fmt)
                       if fmt is not None else None)
            await self._check_urls(urls or [], tmp / "files", files, piece_size)
            dataset = dataset_id(piece_size, files)
            size = sum(s for _p, s, _h in files)
            meta = {"name": name, "id": dataset, "origin": "added", "bytes": size, "used": self._node.wall(),
                    "pieces": sum(len(h) for _p, _s, h in files), "fetched_bytes": 0, "bad_pieces": 0}
            if samples is not None:
                meta["samples"] = samples_hash(samples)
            await trio.to_thread.run_sync(self.store.commit_added, tmp, dataset, meta)
        except OSError as exc:
            raise disk_or_job(tmp, exc) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        entries: list[dict[str, Any]] = [{"path": p, "size": s, "pieces": []} for p, s, _h in files]
        body = {"name": name, "id": dataset, "piece_size": piece_size, "at": int(self._node.wall()), "files": entries,
                **({"urls": list(urls)} if urls else {})}
        if samples is not None:
            body["samples"] = samples
            await trio.to_thread.run_sync(lambda: self.store.save_index(dataset, body, part=False))
        mine = [r for r in dataset_sources(self._node.machine.records, dataset)
                if r.author == self._node.me and r["name"] == name and r.body.get("samples") == samples
                and r.body.get("urls") == (urls or None)]
        if mine:
            return mine[0], False
        by_path = {f["path"]: f for f in entries}
        for piece in pieces_of_files(piece_size, files):
            blob = await self._upload(dataset, piece, upload=relay)
            assert blob is not None  # the newest key always seals: put_piece returns its blob
            by_path[piece.path]["pieces"].append([piece.hash, blob])
        try:
            rec = sign("dataset", self._node.cfg.pool, body, self._node.node_key)
        except RecordError as exc:
            raise DataError(f"{source}: {exc}: {meta['pieces']} pieces do not fit one dataset record; "
                            "use a larger --piece-size or add fewer files") from None
        self._node.process(self._node.machine.add_local(rec, self._node.now()))
        log.info("added dataset %s (%s): %d files, %d pieces, %d bytes%s", name, dataset[:12], len(files),
                 meta["pieces"], size, f", served by {', '.join(map(host_of, urls))}" if urls else "")
        return rec, True

    async def _check_urls(self, urls: list[str], copy: Path, files: list[tuple[str, int, list[str]]],
                          piece_size: int) -> None:
        """Refuse ``data add --url`` of an address that does not serve the first file."""
        first = next((rel for rel, size, _h in files if size), None)
        if first is None:
            return
        for url in urls:
            with self._work_file("probe") as probe:
                try:
                    await self.urls.check(url, first, copy / first, piece_size, probe)
                except UrlFailed as exc:
                    status = f" (HTTP {exc.status})" if exc.status is not None else ""
                    raise DataError(f"--url {shown(url)} does not serve the dataset{status}: {exc}; it must serve "
                                    f"each file at URL/<its path>, e.g. {first}. Nothing was added") from None

    async def _upload(self, dataset: str, piece: Piece, *, blob: str | None = None,
                      fresh: bool = False, upload: bool = True) -> str | None:
        with self._work_file() as sealed:
            return await self._node.blobs.put_piece(self.store.files(dataset) / piece.path,
                                                    (piece.offset, piece.size), piece.hash, sealed,
                                                    blob=blob, fresh=fresh, upload=upload)

    @contextlib.contextmanager
    def _work_file(self, suffix: str = "sealed") -> Any:
        folder = self._node.home.path / "work" / "data"
        folder.mkdir(parents=True, exist_ok=True)
        self._names += 1
        path = folder / f"piece-{self._names}.{suffix}"
        try:
            yield path
        except OSError as exc:
            raise disk_or_job(folder, exc) from None
        finally:
            path.unlink(missing_ok=True)

    # -- fetch -----------------------------------------------------------------------------

    async def ensure(self, job: Record, phase: Callable[[str], None]) -> None:
        """Hold every dataset ``job`` records, fetching what is not here; one its task reads
        sample by sample (``job.samples``) only as far as its index (its pieces come as the
        shards that read them are trained). ``phase`` is told what is being waited for.
        Returns once all are held; raises ``JobError`` if the job ends meanwhile,
        ``DiskError`` if the disk is full."""
        sampled = job.body.get("samples") or {}
        for name, dataset in sorted((job.body.get("datasets") or {}).items()):
            # An ensemble's members each read the whole dataset in their own order: fetched whole.
            if name not in sampled or job["mode"] == "ensemble":
                await self.fetch(dataset, name, phase, job)
            if name in sampled:
                await self.open_index(dataset, name, sampled[name], phase, job)

    async def fetch_named(self, name: str, *, whole: bool = True) -> str:
        """At submit: fetch the dataset the name ``name`` means here (``whole=False``: only
        its sample index, when its record has one). Returns its id. Raises ``DataError``
        when no member added one of that name."""
        rec = resolve_dataset(self._node.machine.records, name, self.store.held())
        if rec is None:
            raise DataError(f"the task asks for dataset {name!r}, which no member has added: run "
                            f"'ttpeer data add PATH --name {name}' on a machine that has the files")
        say = lambda text: log.info("%s", text)  # noqa: E731
        if not whole and "samples" not in rec.body:
            raise DataError(f"the task reads dataset {name!r} with dataset_samples, but it was added without a "
                            f"sample index: add it again with 'ttpeer data add PATH --name {name} --format "
                            "lines|npy|tar|parquet|records:BYTES', or read its files with dataset_path")
        if whole or "samples" not in rec.body:
            await self.fetch(rec["id"], name, say, None)
        else:
            await self.open_index(rec["id"], name, samples_hash(rec.body["samples"]), say, None)
        return str(rec["id"])

    async def open_index(self, dataset: str, name: str, digest: str, phase: Callable[[str], None],
                         job: Record | None) -> None:
        """Make ready to read ``dataset`` sample by sample through the index ``digest``: the
        index kept beside its files (held whole, or an assembly begun). Waits for a record
        of that id and index to arrive."""
        wait = RETRY_FIRST
        while True:
            self._check_job(job, name)
            rec = next((r for r in dataset_sources(self._node.machine.records, dataset)
                        if "samples" in r.body and samples_hash(r.body["samples"]) == digest), None)
            if rec is not None:
                break
            phase(f"waiting for dataset {name}: its record ({dataset[:12]}, with the job's sample index) has not "
                  "reached this peer")
            await trio.sleep(wait)
            wait = min(RETRY_MAX, wait * 2)
        async with self._lock(dataset):
            try:
                held = self.store.held()
                if dataset in held:
                    self._touch(dataset, held[dataset], name)
                    await trio.to_thread.run_sync(lambda: self.store.save_index(dataset, rec.body, part=False))
                    return
                await self._started(dataset, rec)
                await trio.to_thread.run_sync(lambda: self.store.save_index(dataset, rec.body, part=True))
            except OSError as exc:
                raise disk_or_job(self.store.root, exc) from None

    async def fetch(self, dataset: str, name: str, phase: Callable[[str], None], job: Record | None,
                    pieces: list[int] | None = None, *, within: float | None = None) -> None:
        """Fetch ``dataset`` (``pieces``: only those of it) until held; see ``ensure``.
        ``within``: give up after that many seconds with ``JobError`` (a shard waiting for
        pieces nobody serves gives its claim back rather than hold it)."""
        if dataset in self.store.held():
            self._touch(dataset, self.store.held()[dataset], name)
            return
        self._waiting[dataset] = self._waiting.get(dataset, 0) + 1
        try:
            await self._fetch_until(dataset, name, phase, job, pieces, within)
        finally:
            self._waiting[dataset] -= 1
            if not self._waiting[dataset]:
                self._quiet.pop(dataset, trio.Event()).set()

    async def _fetch_until(self, dataset: str, name: str, phase: Callable[[str], None], job: Record | None,
                           pieces: list[int] | None, within: float | None) -> None:
        wait = RETRY_FIRST
        deadline = None if within is None else trio.current_time() + within
        while True:
            if deadline is not None and trio.current_time() >= deadline:
                raise JobError(f"pieces of dataset {name!r} were not served within {within:g} s (asked their "
                               "holders again); this peer gives the shard back and tries again later")
            # A job that finished meanwhile still needs its data here: the final model is
            # written by the task this peer loads. Only a job the pool ended stops the wait.
            self._check_job(job, name)
            records = dataset_sources(self._node.machine.records, dataset)
            if not records:
                phase(f"waiting for dataset {name}: its record ({dataset[:12]}) has not reached this peer")
            else:
                with trio.move_on_at(math.inf if deadline is None else deadline):  # a slow source too
                    missing, damaged = await self._fetch_pass(dataset, name, records, phase, pieces)
                    if not missing:
                        return
                if deadline is not None and trio.current_time() >= deadline:
                    continue  # said above
                self._want(dataset, missing, damaged)
                got = self.fetches[dataset]
                phase(f"waiting for dataset {name}: {got.done}/{got.total} pieces "
                      f"({len(missing)} not served yet, asked their holders again"
                      + (f"; {got.bad_pieces} refused as damaged" if got.bad_pieces else "") + ")")
            await trio.sleep(wait if deadline is None else max(0.0, min(wait, deadline - trio.current_time())))
            wait = min(RETRY_MAX, wait * 2)

    def prefetch(self, dataset: str, name: str, pieces: list[int]) -> None:
        """Fetch ``pieces`` of ``dataset`` in the background (the shards this peer is likely
        to train next), one at a time; a piece waits while a fetch that a shard waits on
        runs. Pieces asked for while a prefetch runs join its queue."""
        done = self._done.get(dataset)
        queue = self._prefetching.setdefault(dataset, [])
        running = bool(queue) or dataset in self._prefetch_running
        queue += [k for k in pieces if (done is None or k not in done) and k not in queue]
        if running or not queue or self._node.nursery is None:
            return
        self._prefetch_running.add(dataset)

        async def run() -> None:
            try:
                while queue:
                    want = list(queue)
                    records = dataset_sources(self._node.machine.records, dataset)
                    if not records:
                        break
                    await self._fetch_pass(dataset, name, records, lambda _text: None, want, background=True)
                    del queue[:len(want)]
            except (NetError, JobError, DiskError) as exc:
                log.info("prefetching pieces of dataset %s stopped: %s", dataset[:12], exc)
            finally:
                queue.clear()
                self._prefetch_running.discard(dataset)

        self._node.nursery.start_soon(run)

    def _check_job(self, job: Record | None, name: str) -> None:
        if job is not None and job_ended(self._node.machine.records, job) is not None:
            raise JobError(f"job {job.id[:12]} ended while this peer waited for dataset {name!r}")

    def _lock(self, dataset: str) -> trio.Lock:
        return self._locks.setdefault(dataset, trio.Lock())

    async def _started(self, dataset: str, rec: Record) -> set[int]:
        """The assembly of ``dataset`` begun (or resumed): the pieces verified so far, the
        one set every fetch of it shares. Call with its lock held."""
        done = self._done.get(dataset)
        if done is None:
            done = await trio.to_thread.run_sync(self.store.start, dataset, record_files(rec.body))
            meta = {"name": rec["name"], "id": dataset, "origin": "fetching", "used": self._node.wall()}
            await trio.to_thread.run_sync(lambda: self.store.save_meta(dataset, meta, part=True))
            self._done[dataset] = done
        return done

    async def _fetch_pass(self, dataset: str, name: str, records: list[Record], phase: Callable[[str], None],
                          only: list[int] | None = None, *, background: bool = False) -> tuple[list[int], list[int]]:
        """Fetch every piece (of ``only``) not held yet, once; returns the pieces still
        missing, and those of them whose every copy was refused as damaged."""
        pieces = pieces_of(records[0].body)  # one id, one manifest: any record's pieces
        try:
            async with self._lock(dataset):
                if dataset in self.store.held():
                    return [], []
                done = await self._started(dataset, records[0])
        except OSError as exc:
            raise disk_or_job(self.store.root, exc) from None
        got = self.fetches.setdefault(dataset, _Fetch(len(pieces)))
        got.done = len(done)
        sources = [piece_blobs(r.body) for r in records]  # newest record first
        missing, damaged = [], []
        fetched = False
        if only is not None and not all(0 <= k < len(pieces) for k in only):
            raise JobError(f"the task asked for pieces of dataset {name!r} that it does not have (it has "
                           f"{len(pieces)}): its sample index does not match its files")
        wanted = pieces if only is None else [pieces[k] for k in sorted(set(only))]
        for piece in wanted:
            while background and self._waiting.get(dataset):  # a shard waits: it goes first
                await self._quiet.setdefault(dataset, trio.Event()).wait()
            async with self._lock(dataset):
                if piece.index in done:
                    continue
                phase(f"fetching dataset {name}: {got.done}/{got.total} pieces" if only is None else
                      f"fetching {len(wanted)} pieces of dataset {name} that the task reads "
                      f"({got.done}/{got.total} here)")
                blobs = list(dict.fromkeys(names[piece.index] for names in sources))
                bad_before = got.bad_pieces
                if await self._fetch_piece(dataset, piece, blobs, done, got):
                    got.done += 1
                    got.fetched_bytes += piece.size
                    fetched = True
                else:
                    missing.append(piece.index)
                    if got.bad_pieces > bad_before:
                        damaged.append(piece.index)
        async with self._lock(dataset):
            if len(done) == len(pieces) and dataset not in self.store.held():
                await self._finish(dataset, name, pieces, got)
            elif fetched:  # an assembly grew: the cache's bound holds for assemblies too
                try:
                    await self._evict(dataset)
                except OSError as exc:
                    raise disk_or_job(self.store.root, exc) from None
        return missing, damaged

    async def _evict(self, dataset: str) -> None:
        """The cache's bound, kept: never ``dataset`` (being fetched), a running job's, one
        being prefetched or written (its lock held)."""
        busy = {d for d, lock in self._locks.items() if lock.locked()} | self._prefetch_running | {dataset}
        for gone in await trio.to_thread.run_sync(self.store.evict, self.cache_bytes, self.in_use() | busy):
            self._forget(gone)

    def _forget(self, dataset: str) -> None:
        """This peer's copy of ``dataset`` is gone: nothing of it is remembered as here."""
        self._done.pop(dataset, None)
        self.fetches.pop(dataset, None)

    async def _finish(self, dataset: str, name: str, pieces: list[Piece], got: _Fetch) -> None:
        size = sum(p.size for p in pieces)
        meta = {"name": name, "id": dataset, "origin": "fetched", "bytes": size, "used": self._node.wall(),
                "pieces": len(pieces), "fetched_bytes": got.fetched_bytes, "url_bytes": got.url_bytes,
                "direct_bytes": got.direct_bytes,
                "bad_pieces": got.refused}
        try:
            await trio.to_thread.run_sync(self.store.finish, dataset, meta)
            self._done.pop(dataset, None)
            await self._evict(dataset)
        except OSError as exc:
            raise disk_or_job(self.store.root, exc) from None
        log.info("fetched dataset %s (%s): %d pieces, %d bytes (%d from members directly, %d from its urls, %d from "
                 "the relay), %d refused", name, dataset[:12], len(pieces), got.fetched_bytes, got.direct_bytes,
                 got.url_bytes, got.fetched_bytes - got.url_bytes - got.direct_bytes, got.refused)

    async def _fetch_piece(self, dataset: str, piece: Piece, blobs: list[str], done: set[int],
                           got: _Fetch) -> bool:
        """Fetch ``piece`` from the first of the record's urls, then of ``blobs``, that serves
        it right; False if none did."""
        if await self._fetch_direct(dataset, piece, done, got):
            return True
        if await self._fetch_from_urls(dataset, piece, done, got):
            return True
        for blob in blobs:
            with self._work_file() as sealed, self._work_file("plain") as plain:
                try:
                    await self._node.blobs.get_piece(blob, piece.size, sealed, plain)
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
                    self._node.blobs.refused("dataset piece")
                    log.warning("refused piece %d of dataset %s: its bytes do not hash to the record's",
                                piece.index, dataset[:12])
                    continue
                await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                return True
        return False

    async def _fetch_direct(self, dataset: str, piece: Piece, done: set[int], got: _Fetch) -> bool:
        """Fetch ``piece`` from a member that serves it directly (the dataset's authors
        first); False if none did. A member that lacks the piece is not asked for that
        dataset again for ``LACKS_FOR`` seconds; one that sends wrong bytes counts refused."""
        rs = self._node.machine.records
        now = trio.current_time()
        prefer = [r.author for r in dataset_sources(rs, dataset)]
        for member, route in self.direct.routes(rs, prefer):
            if self._lacks.get((member, dataset), now) > now:
                continue
            with self._work_file("plain") as plain:
                try:
                    await self.direct.get(member, route, dataset, piece.index, piece.size, plain)
                except DirectFailed as exc:
                    if exc.lacks:
                        self._lacks[(member, dataset)] = now + LACKS_FOR
                    log.debug("piece %d of dataset %s not fetched directly: %s", piece.index, dataset[:12], exc)
                    continue
                if not await trio.to_thread.run_sync(piece_ok, plain, piece):
                    got.direct_refused += 1
                    self._node.blobs.refused("dataset piece")
                    self._lacks[(member, dataset)] = now + LACKS_FOR
                    log.warning("refused piece %d of dataset %s from %s directly: its bytes do not hash to the "
                                "record's", piece.index, dataset[:12], member[:12])
                    continue
                await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                got.direct_bytes += piece.size
                return True
        return False

    async def fetch_blob(self, blob: str, max_size: int, dest: Path, uploaders: list[str]) -> bool:
        """Fetch the sealed blob ``blob`` into ``dest`` from one of its ``uploaders`` that serves
        directly (only an uploader holds a delta or a state it sent); False if none did, and
        the relay serves it. Bytes that do not hash to the blob's name are refused."""
        rs = self._node.machine.records
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
                self._node.blobs.refused("blob")
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
        for member, route in self.direct.routes(self._node.machine.records, uploaders):
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

    async def piece_source(self, dataset: str, index: int) -> tuple[Path, int, int] | None:
        """Where piece ``index`` of ``dataset`` lies here, for a member asking directly:
        (file, offset, size), or None when this peer does not hold it."""
        records = dataset_sources(self._node.machine.records, dataset)
        if not records:
            return None
        pieces = pieces_of(records[0].body)
        if not 0 <= index < len(pieces):
            return None
        piece = pieces[index]
        if (self.store.root / dataset / "meta.json").is_file():
            return self.store.files(dataset) / piece.path, piece.offset, piece.size
        if index in self._done.get(dataset, ()):
            return self.store.root / f"{dataset}.part" / "files" / piece.path, piece.offset, piece.size
        return None

    async def _fetch_from_urls(self, dataset: str, piece: Piece, done: set[int], got: _Fetch) -> bool:
        """Fetch ``piece`` from the first address of the dataset's records (newest first)
        that serves it right; False if none did. Wrong bytes count in ``url_refused``, not
        as damaged on the relay (whose copy a want would then replace)."""
        now = trio.current_time()
        urls = [u for u in dict.fromkeys(u for r in dataset_sources(self._node.machine.records, dataset)
                                         for u in r.body.get("urls", ())) if self._url_down.get(u, now) <= now]
        if not urls:
            return False
        async with self.urls.client() as client:
            for url in urls:
                with self._work_file("plain") as plain:
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
                        self._node.blobs.refused("dataset piece")
                        log.warning("refused piece %d of dataset %s from %s: its bytes do not hash to the record's",
                                    piece.index, dataset[:12], host_of(url))
                        continue
                    await trio.to_thread.run_sync(self.store.put_piece, dataset, piece, plain, done)
                    got.url_bytes += piece.size
                    return True
        return False

    def _want(self, dataset: str, missing: list[int], damaged: list[int]) -> None:
        want = {"id": dataset, "pieces": missing[:MAX_WANT], "damaged": damaged[:MAX_WANT]}
        self._node.broadcast_want(encode({"want": want}))

    # -- serving pieces again ---------------------------------------------------------------

    def on_want(self, sender: str, payload: bytes) -> None:
        """A want from ``sender``: upload again the pieces it names that this peer holds.
        A missing piece goes back under its name; a damaged one (the relay keeps a blob it
        holds, damaged or not) under a new name, in a newer record of the dataset."""
        try:
            want = decode(payload, max_size=64 * 1024)["want"]
            dataset, indexes, damaged = want["id"], want["pieces"], want["damaged"]
            if type(dataset) is not str or not all(type(x) is list and len(x) <= MAX_WANT
                                                   for x in (indexes, damaged)):
                return
        except (RecordError, KeyError, TypeError):
            return
        if dataset not in self.store.held() or self._node.nursery is None:
            return
        records = dataset_sources(self._node.machine.records, dataset)
        if not records:
            return
        pieces = pieces_of(records[0].body)
        sources = [piece_blobs(r.body) for r in records]
        now = trio.current_time()

        def due(i: Any, table: dict[tuple[str, int], float], every: float) -> bool:
            if type(i) is not int or not 0 <= i < len(pieces) or now - table.get((dataset, i), -1e9) < every:
                return False
            table[(dataset, i)] = now
            return True

        for i in indexes:
            if i not in damaged and due(i, self._reuploaded, REUPLOAD_EVERY):
                blobs = list(dict.fromkeys(names[i] for names in sources))
                self._node.nursery.start_soon(self._reupload, dataset, pieces[i], blobs, sender)
        repair = [pieces[i] for i in sorted({i for i in damaged if type(i) is int})
                  if due(i, self._repaired, REPAIR_EVERY)]
        if repair:
            self._node.nursery.start_soon(self._repair, dataset, repair, sender)

    async def _reupload(self, dataset: str, piece: Piece, blobs: list[str], sender: str) -> None:
        with self._guard(dataset, piece):
            for blob in blobs:
                if await self._upload(dataset, piece, blob=blob) is not None:
                    self.reuploads[dataset] = self.reuploads.get(dataset, 0) + 1
                    log.info("uploaded piece %d of dataset %s again for %s", piece.index, dataset[:12], sender[:12])

    async def _repair(self, dataset: str, pieces: list[Piece], sender: str) -> None:
        """Upload ``pieces`` under new names and sign a record of the dataset that names them."""
        fresh: dict[int, str] = {}
        for piece in pieces:
            with self._guard(dataset, piece):
                blob = await self._upload(dataset, piece, fresh=True)
                if blob is not None:
                    fresh[piece.index] = blob
        records = dataset_sources(self._node.machine.records, dataset)
        if not fresh or not records:
            return
        newest = records[0].body
        body = json.loads(json.dumps(dict(newest)))  # a deep copy, of plain values
        index = 0
        for f in body["files"]:
            for p in f["pieces"]:
                p[1] = fresh.get(index, p[1])
                index += 1
        body["at"] = max(int(self._node.wall()), int(newest["at"]) + 1)
        rec = sign("dataset", self._node.cfg.pool, body, self._node.node_key)
        self._node.process(self._node.machine.add_local(rec, self._node.now()))
        self.reuploads[dataset] = self.reuploads.get(dataset, 0) + len(fresh)
        log.warning("pieces %s of dataset %s came back damaged from the relay; uploaded under new names for %s",
                    sorted(fresh), dataset[:12], sender[:12])

    @contextlib.contextmanager
    def _guard(self, dataset: str, piece: Piece) -> Iterator[None]:
        """Uploading a piece again for another peer fails alone: logged, never the daemon's end."""
        try:
            yield
        except (NetError, JobError, DiskError) as exc:
            log.warning("could not upload piece %d of dataset %s again: %s", piece.index, dataset[:12], exc)
        except Exception as exc:  # noqa: BLE001 - a bug costs one re-upload, never the daemon
            log.error("uploading piece %d of dataset %s again raised %s (a bug; please report it)",
                      piece.index, dataset[:12], type(exc).__name__, exc_info=exc)

    # -- what is held, removing -----------------------------------------------------------------

    def in_use(self) -> set[str]:
        """Datasets of the jobs that have not ended for the pool and whose final model this
        peer has not written (it loads the task for that): never evicted."""
        out: set[str] = set()
        rs = self._node.machine.records
        for job in rs.jobs():
            ids = job.body.get("datasets")
            if ids and job.id not in self._node.finished and job_ended(rs, job) is None:
                out |= set(ids.values())
        return out

    def _touch(self, dataset: str, meta: dict[str, Any], name: str) -> None:
        """A job uses ``dataset`` now (LRU), under ``name`` (one more name it answers to)."""
        names = sorted({*meta.get("names", []), meta.get("name", name), name})
        with contextlib.suppress(OSError, DiskError):
            self.store.save_meta(dataset, {**meta, "names": names, "used": self._node.wall()})

    def listing(self) -> list[dict[str, Any]]:
        """``data ls``: every dataset of the pool and every one held here."""
        held = self.store.held()
        records = live_datasets(self._node.machine.records)
        out: dict[str, dict[str, Any]] = {}
        for r in records:
            if r["id"] in out:
                continue
            pieces = pieces_of(r.body)
            out[r["id"]] = {"name": r["name"], "id": r["id"], "bytes": sum(p.size for p in pieces),
                            "pieces": len(pieces), "files": len(r["files"])}
        for dataset, meta in held.items():
            out.setdefault(dataset, {"name": meta.get("name"), "id": dataset, "bytes": meta.get("bytes", 0),
                                     "pieces": meta.get("pieces", 0), "files": None})
        for dataset, row in out.items():
            here = held.get(dataset)
            got = self.fetches.get(dataset)
            part = None if here or got else self._done.get(dataset)
            if part is None and not here and not got and (self.store.root / f"{dataset}.part").is_dir():
                part = self.store.part_done(dataset)  # an assembly from before a restart
            row["here"] = here["origin"] if here else ("partial" if got or part else "no")
            row["pieces_here"] = row["pieces"] if here else (got.done if got else len(part or ()))
            row["fetched_bytes"] = here.get("fetched_bytes", 0) if here else (got.fetched_bytes if got else 0)
            row["url_bytes"] = here.get("url_bytes", 0) if here else (got.url_bytes if got else 0)
            row["direct_bytes"] = here.get("direct_bytes", 0) if here else (got.direct_bytes if got else 0)
            row["bad_pieces"] = here.get("bad_pieces", 0) if here else (got.refused if got else 0)
            row["uploaded_again"] = self.reuploads.get(dataset, 0)
        return sorted(out.values(), key=lambda d: (str(d["name"]), d["id"]))

    def job_data(self, job: Record) -> list[dict[str, Any]] | None:
        """Status: how much of ``job``'s data this peer holds and how much it fetched."""
        ids = job.body.get("datasets")
        if not ids:
            return None
        rows = {row["id"]: row for row in self.listing()}
        out = []
        for name, dataset in sorted(ids.items()):
            row = rows.get(dataset, {"bytes": 0, "pieces": 0, "pieces_here": 0, "here": "no", "fetched_bytes": 0,
                                     "bad_pieces": 0})
            out.append({"name": name, "id": dataset, "bytes": row["bytes"], "pieces": row["pieces"],
                        "pieces_here": row["pieces_here"], "here": row["here"],
                        "fetched_bytes": row["fetched_bytes"], "direct_bytes": row.get("direct_bytes", 0),
                        "bad_pieces": row["bad_pieces"]})
        return out

    async def remove(self, text: str, withdraw: bool) -> dict[str, Any]:
        """``data rm``: remove this peer's copy of the dataset named (or id-prefixed) ``text``;
        ``withdraw``: also sign a ``dataset_rm`` for each of its records this peer may
        withdraw (its own; any, for an admin). Raises ``DataError``."""
        rows = [r for r in self.listing() if text in (r["name"], r["id"]) or (len(text) >= 6
                and r["id"].startswith(text))]
        if len({r["id"] for r in rows}) != 1:
            raise DataError(f"{'no dataset' if not rows else f'{len(rows)} datasets'} match {text!r} "
                            "(see 'ttpeer data ls')")
        dataset = rows[0]["id"]
        if dataset in self.in_use():
            raise DataError(f"dataset {text!r} is used by a job that has not ended; cancel it or wait for it")
        removed = dataset in self.store.held() or (self.store.root / f"{dataset}.part").exists()
        async with self._lock(dataset):
            await trio.to_thread.run_sync(self.store.remove, dataset)
            self._forget(dataset)
        withdrawn = []
        if withdraw:
            await self._node.key_event.wait()
            rs = self._node.machine.records
            mine = [r for r in dataset_sources(rs, dataset) if may_remove_dataset(rs, r, self._node.me)]
            if not mine:
                raise DataError(f"only the member who added dataset {text!r} or the pool's admin can withdraw "
                                "its record (this peer's copy was removed)")
            for r in mine:
                rec = sign("dataset_rm", self._node.cfg.pool, {"dataset": r.id, "at": int(self._node.wall())},
                           self._node.node_key)
                self._node.process(self._node.machine.add_local(rec, self._node.now()))
                withdrawn.append(r.id)
        return {"id": dataset, "removed": removed, "withdrawn": withdrawn}


    # -- the pin: a running job's pieces kept on the relay ------------------------------------

    def pinned(self) -> dict[str, Record]:
        """The newest record of every dataset that a job names which has not ended for the
        pool (neither cancelled, failed everywhere, nor past its last round) and which this
        peer has not declined: the pieces its peers keep on the relay."""
        rs, m = self._node.machine.records, self._node.machine
        out: dict[str, Record] = {}
        for job in rs.jobs():
            ids = job.body.get("datasets")
            if not ids or job_ended(rs, job) is not None or m.plan(job).finished(m.chain(job).round):
                continue
            if any(d.author == self._node.me for d in rs.of_job(job.id, "decline")):
                continue  # sat out here: its peers pin it (a job every online peer declined lapses)
            for dataset in ids.values():
                records = dataset_sources(rs, dataset)
                if records and dataset not in out:
                    out[dataset] = records[0]
        return out

    async def keep_pinned(self) -> None:
        """Forever (a task of the node's nursery): touch the pinned pieces (``touch_pinned``)
        every third of the relay's blob TTL, within ``PIN_MIN``..``PIN_MAX``. A failure is
        logged and waits for the next time; a relay without the touch route (an older one)
        is asked again only every ``PIN_MAX`` (it may be upgraded), said once: there pieces
        live with the TTL and a want, as before."""
        said = False
        while True:
            period = pin_period(self._node.blobs.relay_ttl)
            try:
                await self.touch_pinned()
            except RelayRejected as exc:
                if exc.code != ErrorCode.NOT_FOUND:
                    log.warning("touching pinned dataset pieces on the relay was refused: %s", exc)
                else:
                    if not said:
                        log.info("the relay does not take touches (an older relay): the pieces of running jobs' "
                                 "datasets are not pinned there; a holder uploads lost ones again when asked")
                    said, period = True, PIN_MAX
            except NetError as exc:
                log.info("could not touch pinned dataset pieces on the relay (%s); trying again later", exc)
            except Exception as exc:  # noqa: BLE001 - a bug costs one round of touches, never the daemon
                log.error("touching pinned dataset pieces raised %s (a bug; please report it)",
                          type(exc).__name__, exc_info=exc)
            await trio.sleep(period)

    async def touch_pinned(self) -> None:
        """Restart the relay's TTL of every pinned piece's blob, ``TOUCH_MAX_BLOBS`` a request;
        a blob the relay no longer holds goes back under its name if this peer holds its
        dataset whole and the dataset has no urls (else a fetcher's want reaches a holder).
        Raises ``NetError``."""
        pinned = self.pinned()
        names = list(dict.fromkeys(b for rec in pinned.values() for b in piece_blobs(rec.body)))
        touches, lost = self._node.counters.touches, set()
        for start in range(0, len(names), TOUCH_MAX_BLOBS):
            batch = names[start:start + TOUCH_MAX_BLOBS]
            missing = await self._node.blobs.touch(batch)
            touches.requests += 1
            touches.blobs += len(batch) - len(missing)
            touches.missing += len(missing)
            lost |= set(missing)
        if not lost:
            return
        log.info("the relay no longer held %d pinned dataset pieces", len(lost))
        held = self.store.held()
        for dataset, rec in pinned.items():
            # A dataset with urls is served from there first (``--no-relay`` uploads nothing):
            # its lapsed pieces go back only when a fetcher that the urls failed asks (a want).
            if dataset not in held or rec.body.get("urls"):
                continue
            for piece, blob in zip(pieces_of(rec.body), piece_blobs(rec.body), strict=True):
                now = trio.current_time()
                if blob not in lost or now - self._reuploaded.get((dataset, piece.index), -math.inf) < REUPLOAD_EVERY:
                    continue
                self._reuploaded[(dataset, piece.index)] = now  # a want meanwhile does not upload it twice
                with self._guard(dataset, piece):
                    if await self._upload(dataset, piece, blob=blob) is not None:
                        touches.reuploaded += 1
                        self.reuploads[dataset] = self.reuploads.get(dataset, 0) + 1
                        log.info("uploaded piece %d of dataset %s again: its blob had lapsed on the relay",
                                 piece.index, dataset[:12])


def pin_period(ttl: float | None) -> float:
    """Seconds between touches of pinned pieces, for a relay blob TTL of ``ttl`` (None: the
    relay did not say; its default): three touches a TTL, so one lost request costs nothing."""
    return min(PIN_MAX, max(PIN_MIN, (ttl or BLOB_TTL) / 3))

