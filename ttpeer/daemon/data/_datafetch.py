"""Fetching a job's datasets: each held, or fetched piece by piece; the cache kept in bounds.

Theory of operation. ``ensure`` runs before a peer prepares a job (``fetch_named`` at
submit, for a dataset the submitter does not hold): every dataset the job records is held,
or fetched into an assembly piece by piece, from the sources ``_datasources`` tries in
turn, each piece checked against its hash before it is written at its place; a piece
refused is counted and fetched again. Pieces nobody serves leave the job waiting, with its
phase saying how far it got ("waiting for dataset corpus: 3/10 pieces ..."), retrying with
backoff; it never raises for that. After each pass that missed pieces it broadcasts a
*want* of them (``_dataholder.want_payload``), so that the peers holding the dataset
upload them again. A job the pool ends meanwhile stops the wait (one that finished does
not: the final model is written by the task this peer loads).

A dataset the task reads sample by sample is made ready through its index only
(``open_index``); its pieces come as the shards that read them are trained
(``fetch(pieces=...)``, which may give up ``within`` seconds), or ahead of them
(``prefetch``, one piece at a time, stepping aside while a shard waits).

The cache: fetched datasets (and assemblies) are evicted least recently used past
``cache_bytes``, never one a job this peer has not finished uses (``in_use``), one being
fetched, prefetched or written, nor one added here. One piece of a dataset is written at a
time (``lock``), and every fetch of a dataset shares one set of verified pieces (``done``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import trio
from ttpeer_wire import record_files, samples_hash

from ttpeer.errors import DataError, DiskError, JobError
from ttpeer.net import NetError
from ttpeer.proto import JobSpec, PeerMachine, Record, dataset_sources, job_ended, resolve_dataset

from .._lifetime import Lifetime
from .._workfiles import disk_or_job
from ._dataholder import want_payload
from ._datasources import FetchStats, Sources
from ._datastore import DataStore, Piece, piece_blobs, pieces_of

log = logging.getLogger("ttpeer.daemon")

RETRY_FIRST, RETRY_MAX = 0.5, 15.0  # seconds between passes over pieces not fetched yet


class Fetcher:
    """This peer's fetches of datasets: what each got so far, the assemblies, the prefetches.
    Pieces come from ``sources`` into ``store``, as ``machine``'s records name them;
    prefetches run in ``life``'s nursery; ``want`` broadcasts a want (``want_payload``);
    ``finished`` holds the jobs whose final files this peer wrote (``in_use``)."""

    def __init__(self, store: DataStore, sources: Sources, machine: PeerMachine, life: Lifetime, *,
                 wall: Callable[[], float], want: Callable[[bytes], None], finished: Mapping[str, str],
                 cache_bytes: int) -> None:
        self.store = store
        self._sources = sources
        self._machine = machine
        self._life = life
        self._wall = wall
        self._broadcast_want = want
        self._finished = finished
        self.cache_bytes = cache_bytes
        self.fetches: dict[str, FetchStats] = {}
        self.done: dict[str, set[int]] = {}  # assemblies here: the pieces verified so far
        self._locks: dict[str, trio.Lock] = {}  # one piece of a dataset written at a time
        self._prefetching: dict[str, list[int]] = {}  # dataset -> pieces queued for prefetch
        self._prefetch_running: set[str] = set()
        self._waiting: dict[str, int] = {}  # datasets a fetch waits on (prefetch steps aside)
        self._quiet: dict[str, trio.Event] = {}  # set when no fetch waits on the dataset

    async def ensure(self, job: JobSpec, phase: Callable[[str], None]) -> None:
        """Hold every dataset ``job`` records, fetching what is not here; one its task reads
        sample by sample (``job.samples``) only as far as its index (its pieces come as the
        shards that read them are trained). ``phase`` is told what is being waited for.
        Returns once all are held; raises ``JobError`` if the job ends meanwhile,
        ``DiskError`` if the disk is full."""
        for name, dataset in sorted(job.datasets.items()):
            # Where a shard is not a share of the data (an ensemble's members each read all of
            # it, in their own order), a dataset read sample by sample is fetched whole too.
            if name not in job.samples or not job.mode.shards_split_data:
                await self.fetch(dataset, name, phase, job.record)
            if name in job.samples:
                await self.open_index(dataset, name, job.samples[name], phase, job.record)

    async def fetch_named(self, name: str, *, whole: bool = True) -> str:
        """At submit: fetch the dataset the name ``name`` means here (``whole=False``: only
        its sample index, when its record has one). Returns its id. Raises ``DataError``
        when no member added one of that name."""
        rec = resolve_dataset(self._machine.records, name, self.store.held())
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
            rec = next((r for r in dataset_sources(self._machine.records, dataset)
                        if "samples" in r.body and samples_hash(r.body["samples"]) == digest), None)
            if rec is not None:
                break
            phase(f"waiting for dataset {name}: its record ({dataset[:12]}, with the job's sample index) has not "
                  "reached this peer")
            await trio.sleep(wait)
            wait = min(RETRY_MAX, wait * 2)
        async with self.lock(dataset):
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
            records = dataset_sources(self._machine.records, dataset)
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
        done = self.done.get(dataset)
        queue = self._prefetching.setdefault(dataset, [])
        running = bool(queue) or dataset in self._prefetch_running
        queue += [k for k in pieces if (done is None or k not in done) and k not in queue]
        if running or not queue or not self._life.running:
            return
        self._prefetch_running.add(dataset)

        async def run() -> None:
            try:
                while queue:
                    want = list(queue)
                    records = dataset_sources(self._machine.records, dataset)
                    if not records:
                        break
                    await self._fetch_pass(dataset, name, records, lambda _text: None, want, background=True)
                    del queue[:len(want)]
            except (NetError, JobError, DiskError) as exc:
                log.info("prefetching pieces of dataset %s stopped: %s", dataset[:12], exc)
            finally:
                queue.clear()
                self._prefetch_running.discard(dataset)

        self._life.start_soon(run)

    def _check_job(self, job: Record | None, name: str) -> None:
        if job is not None and job_ended(self._machine.records, job) is not None:
            raise JobError(f"job {job.id[:12]} ended while this peer waited for dataset {name!r}")

    def lock(self, dataset: str) -> trio.Lock:
        return self._locks.setdefault(dataset, trio.Lock())

    async def _started(self, dataset: str, rec: Record) -> set[int]:
        """The assembly of ``dataset`` begun (or resumed): the pieces verified so far, the
        one set every fetch of it shares. Call with its lock held."""
        done = self.done.get(dataset)
        if done is None:
            done = await trio.to_thread.run_sync(self.store.start, dataset, record_files(rec.body))
            meta = {"name": rec["name"], "id": dataset, "origin": "fetching", "used": self._wall()}
            await trio.to_thread.run_sync(lambda: self.store.save_meta(dataset, meta, part=True))
            self.done[dataset] = done
        return done

    async def _fetch_pass(self, dataset: str, name: str, records: list[Record], phase: Callable[[str], None],
                          only: list[int] | None = None, *, background: bool = False) -> tuple[list[int], list[int]]:
        """Fetch every piece (of ``only``) not held yet, once; returns the pieces still
        missing, and those of them whose every copy was refused as damaged."""
        pieces = pieces_of(records[0].body)  # one id, one manifest: any record's pieces
        try:
            async with self.lock(dataset):
                if dataset in self.store.held():
                    return [], []
                done = await self._started(dataset, records[0])
        except OSError as exc:
            raise disk_or_job(self.store.root, exc) from None
        got = self.fetches.setdefault(dataset, FetchStats(len(pieces)))
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
            async with self.lock(dataset):
                if piece.index in done:
                    continue
                phase(f"fetching dataset {name}: {got.done}/{got.total} pieces" if only is None else
                      f"fetching {len(wanted)} pieces of dataset {name} that the task reads "
                      f"({got.done}/{got.total} here)")
                blobs = list(dict.fromkeys(names[piece.index] for names in sources))
                bad_before = got.bad_pieces
                if await self._sources.fetch_piece(dataset, piece, blobs, done, got):
                    got.done += 1
                    got.fetched_bytes += piece.size
                    fetched = True
                else:
                    missing.append(piece.index)
                    if got.bad_pieces > bad_before:
                        damaged.append(piece.index)
        async with self.lock(dataset):
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
            self.forget(gone)

    def forget(self, dataset: str) -> None:
        """This peer's copy of ``dataset`` is gone: nothing of it is remembered as here."""
        self.done.pop(dataset, None)
        self.fetches.pop(dataset, None)

    async def _finish(self, dataset: str, name: str, pieces: list[Piece], got: FetchStats) -> None:
        size = sum(p.size for p in pieces)
        meta = {"name": name, "id": dataset, "origin": "fetched", "bytes": size, "used": self._wall(),
                "pieces": len(pieces), "fetched_bytes": got.fetched_bytes, "url_bytes": got.url_bytes,
                "direct_bytes": got.direct_bytes,
                "bad_pieces": got.refused}
        try:
            await trio.to_thread.run_sync(self.store.finish, dataset, meta)
            self.done.pop(dataset, None)
            await self._evict(dataset)
        except OSError as exc:
            raise disk_or_job(self.store.root, exc) from None
        log.info("fetched dataset %s (%s): %d pieces, %d bytes (%d from members directly, %d from its urls, %d from "
                 "the relay), %d refused", name, dataset[:12], len(pieces), got.fetched_bytes, got.direct_bytes,
                 got.url_bytes, got.fetched_bytes - got.url_bytes - got.direct_bytes, got.refused)

    def _want(self, dataset: str, missing: list[int], damaged: list[int]) -> None:
        self._broadcast_want(want_payload(dataset, missing, damaged))

    def in_use(self) -> set[str]:
        """Datasets of the jobs that have not ended for the pool and whose final model this
        peer has not written (it loads the task for that): never evicted."""
        out: set[str] = set()
        rs = self._machine.records
        for job in rs.jobs():
            ids = job.body.get("datasets")
            if ids and job.id not in self._finished and job_ended(rs, job) is None:
                out |= set(ids.values())
        return out

    def _touch(self, dataset: str, meta: dict[str, Any], name: str) -> None:
        """A job uses ``dataset`` now (LRU), under ``name`` (one more name it answers to)."""
        names = sorted({*meta.get("names", []), meta.get("name", name), name})
        with contextlib.suppress(OSError, DiskError):
            self.store.save_meta(dataset, {**meta, "names": names, "used": self._wall()})
