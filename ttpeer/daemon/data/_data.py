"""Datasets that reach the peers: the node's part for data, and ``data add``, ``ls``, ``rm``.

Theory of operation. ``Datasets`` runs on the trio thread and does its file work in
worker threads. It composes parts that each own their fields, and hands the node's calls
to the part that owns them:

- ``DataStore`` (``_datastore``): the cache on disk: datasets held, assemblies, metadata;
- ``Sources`` (``_datasources``): where a piece comes from (members directly, the
  record's urls, the relay) and what each served; deltas and states from their uploaders;
- ``Fetcher`` (``_datafetch``): fetching a job's datasets (``ensure``), the waits and the
  wants, prefetch, the cache's bound;
- ``Holder`` (``_dataholder``): uploading pieces, again when wanted; the pin of running
  jobs' pieces on the relay.

``Datasets`` itself owns what the user asks of this peer's datasets:

- **add** (``ttpeer data add``): the files are copied into ``HOME/datasets/<id>/files``
  while their pieces are hashed (``_dataread``: a file that changes meanwhile is refused,
  by name), each piece is sealed and uploaded once (``Holder.upload``), and a signed
  ``dataset`` record names the manifest, the id and the blobs. The copy is this peer's
  local source; ``data add`` of files held already uploads nothing new. ``--format``
  adds a sample index (``_datasamples``); ``--url`` adds https addresses that serve the
  files too (the record's ``urls``; the first file is read back from each before anything
  is signed), ``--no-relay`` names the blobs without uploading them (a want uploads them
  later).
- **ls**, **rm** (``listing``, ``remove``): every dataset of the pool and how much of it is
  here; a copy removed (never one a running job uses), a record withdrawn by its author or
  an admin (``dataset_rm``).
- **serving directly** (``piece_source``): where a piece lies here, for a member asking.

What breaks it: a dataset record over the record cap (``data add`` says to use larger
pieces).
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import DEFAULT_PIECE_SIZE, MIN_PIECE_SIZE, dataset_id, samples_hash, urls_problem

from ttpeer.errors import DataError
from ttpeer.proto import (
    Effect,
    PeerMachine,
    Record,
    RecordError,
    dataset_sources,
    live_datasets,
    may_remove_dataset,
    sign,
)

from .._counters import Counters
from .._home import Home
from .._lifetime import Lifetime
from .._workfiles import disk_or_job
from ..sealed._blobs import Blobs
from ..sealed._keys import PoolKeys
from ._datafetch import Fetcher
from ._dataholder import Holder
from ._dataread import auto_piece_size, copy_and_hash, scan
from ._datasamples import parse_format, sample_index
from ._datasources import Sources
from ._datastore import DataStore, pieces_of, pieces_of_files
from ._datawork import WorkFiles
from ._direct import DirectFetcher, DirectStats
from ._urlsource import UrlFailed, UrlSource, host_of, shown

log = logging.getLogger("ttpeer.daemon")

DEFAULT_CACHE_BYTES = 64 * 2**30
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class Datasets:
    """The node's part for data (``Node.data``), kept in ``home``: the datasets of
    ``machine``'s records, their pieces sealed with ``keys`` in ``blobs``; tasks start in
    ``life``'s nursery. Records made here are signed with ``node_key`` and handed to
    ``machine`` (``process`` executes the effects); ``key_event`` is set once a pool key
    is held; ``want`` broadcasts a want of pieces; ``finished`` holds the jobs whose final
    files this peer wrote (their data may be evicted)."""

    def __init__(self, home: Home, machine: PeerMachine, blobs: Blobs, keys: PoolKeys, counters: Counters,
                 life: Lifetime, *, node_key: Ed25519PrivateKey, key_event: trio.Event, now: Callable[[], float],
                 wall: Callable[[], float], process: Callable[[list[Effect]], None],
                 want: Callable[[bytes], None], finished: Mapping[str, str],
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._machine = machine
        self._node_key = node_key
        self._key_event = key_event
        self._now, self._wall, self._process = now, wall, process
        self.store = DataStore(home.path / "datasets")
        self.store.sweep()
        self._work = WorkFiles(home.path / "work" / "data")
        direct = DirectFetcher(node_key, machine.me, lambda: keys.newest, wall)  # the LAN shortcut
        self.sources = Sources(self.store, self._work, machine, blobs, direct)
        self.fetcher = Fetcher(self.store, self.sources, machine, life, wall=wall, want=want, finished=finished,
                               cache_bytes=cache_bytes)
        self.holder = Holder(self.store, self._work, machine, blobs, counters.touches, life, node_key=node_key,
                             now=now, wall=wall, process=process)
        self.direct_stats: DirectStats | None = None  # what this peer served directly (``serve_direct``)
        # The node's other calls, answered by the part that owns each.
        self.ensure, self.fetch_named, self.fetch, self.prefetch = (
            self.fetcher.ensure, self.fetcher.fetch_named, self.fetcher.fetch, self.fetcher.prefetch)
        self.fetch_blob, self.fetch_blob_range = self.sources.fetch_blob, self.sources.fetch_blob_range
        self.on_want, self.pinned, self.keep_pinned, self.touch_pinned = (
            self.holder.on_want, self.holder.pinned, self.holder.keep_pinned, self.holder.touch_pinned)

    @property
    def urls(self) -> UrlSource:
        """The dataset addresses' client (the daemon gives it the relay's proxy: ``_run``)."""
        return self.sources.urls

    @urls.setter
    def urls(self, value: UrlSource) -> None:
        self.sources.urls = value

    @property
    def cache_bytes(self) -> int:
        """Fetched datasets are evicted past this many bytes (``Fetcher``)."""
        return self.fetcher.cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: int) -> None:
        self.fetcher.cache_bytes = value

    @property
    def reuploads(self) -> dict[str, int]:
        """Pieces uploaded again for others, by dataset."""
        return self.holder.reuploads

    @property
    def blob_direct_bytes(self) -> int:
        """Deltas and states fetched from their uploaders directly."""
        return self.sources.blob_direct_bytes

    @property
    def blob_direct_refused(self) -> int:
        """... that did not hash to their names (then the relay served them)."""
        return self.sources.blob_direct_refused

    # -- add -----------------------------------------------------------------------------

    async def add(self, path: str, name: str | None, piece_size: int | None = DEFAULT_PIECE_SIZE,
                  fmt: str | None = None, *, urls: list[str] | None = None, relay: bool = True) -> tuple[Record, bool]:
        """Add the file or folder at ``path`` under ``name`` (default: its base name), with a
        sample index when ``fmt`` names a format (``_datasamples.parse_format``).
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
        await self._key_event.wait()
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
            meta = {"name": name, "id": dataset, "origin": "added", "bytes": size, "used": self._wall(),
                    "pieces": sum(len(h) for _p, _s, h in files), "fetched_bytes": 0, "bad_pieces": 0}
            if samples is not None:
                meta["samples"] = samples_hash(samples)
            await trio.to_thread.run_sync(self.store.commit_added, tmp, dataset, meta)
        except OSError as exc:
            raise disk_or_job(tmp, exc) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        entries: list[dict[str, Any]] = [{"path": p, "size": s, "pieces": []} for p, s, _h in files]
        body = {"name": name, "id": dataset, "piece_size": piece_size, "at": int(self._wall()), "files": entries,
                **({"urls": list(urls)} if urls else {})}
        if samples is not None:
            body["samples"] = samples
            await trio.to_thread.run_sync(lambda: self.store.save_index(dataset, body, part=False))
        mine = [r for r in dataset_sources(self._machine.records, dataset)
                if r.author == self._machine.me and r["name"] == name and r.body.get("samples") == samples
                and r.body.get("urls") == (urls or None)]
        if mine:
            return mine[0], False
        by_path = {f["path"]: f for f in entries}
        for piece in pieces_of_files(piece_size, files):
            blob = await self.holder.upload(dataset, piece, upload=relay)
            assert blob is not None  # the newest key always seals: put_piece returns its blob
            by_path[piece.path]["pieces"].append([piece.hash, blob])
        try:
            rec = sign("dataset", self._machine.pool, body, self._node_key)
        except RecordError as exc:
            raise DataError(f"{source}: {exc}: {meta['pieces']} pieces do not fit one dataset record; "
                            "use a larger --piece-size or add fewer files") from None
        self._process(self._machine.add_local(rec, self._now()))
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
            with self._work.file("probe") as probe:
                try:
                    await self.urls.check(url, first, copy / first, piece_size, probe)
                except UrlFailed as exc:
                    status = f" (HTTP {exc.status})" if exc.status is not None else ""
                    raise DataError(f"--url {shown(url)} does not serve the dataset{status}: {exc}; it must serve "
                                    f"each file at URL/<its path>, e.g. {first}. Nothing was added") from None

    # -- what is held, removing, serving directly -------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """``data ls``: every dataset of the pool and every one held here."""
        held = self.store.held()
        records = live_datasets(self._machine.records)
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
            got = self.fetcher.fetches.get(dataset)
            part = None if here or got else self.fetcher.done.get(dataset)
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
        if dataset in self.fetcher.in_use():
            raise DataError(f"dataset {text!r} is used by a job that has not ended; cancel it or wait for it")
        removed = dataset in self.store.held() or (self.store.root / f"{dataset}.part").exists()
        async with self.fetcher.lock(dataset):
            await trio.to_thread.run_sync(self.store.remove, dataset)
            self.fetcher.forget(dataset)
        withdrawn = []
        if withdraw:
            await self._key_event.wait()
            rs = self._machine.records
            mine = [r for r in dataset_sources(rs, dataset) if may_remove_dataset(rs, r, self._machine.me)]
            if not mine:
                raise DataError(f"only the member who added dataset {text!r} or the pool's admin can withdraw "
                                "its record (this peer's copy was removed)")
            for r in mine:
                rec = sign("dataset_rm", self._machine.pool, {"dataset": r.id, "at": int(self._wall())},
                           self._node_key)
                self._process(self._machine.add_local(rec, self._now()))
                withdrawn.append(r.id)
        return {"id": dataset, "removed": removed, "withdrawn": withdrawn}

    async def piece_source(self, dataset: str, index: int) -> tuple[Path, int, int] | None:
        """Where piece ``index`` of ``dataset`` lies here, for a member asking directly:
        (file, offset, size), or None when this peer does not hold it."""
        records = dataset_sources(self._machine.records, dataset)
        if not records:
            return None
        pieces = pieces_of(records[0].body)
        if not 0 <= index < len(pieces):
            return None
        piece = pieces[index]
        if (self.store.root / dataset / "meta.json").is_file():
            return self.store.files(dataset) / piece.path, piece.offset, piece.size
        if index in self.fetcher.done.get(dataset, ()):
            return self.store.root / f"{dataset}.part" / "files" / piece.path, piece.offset, piece.size
        return None
