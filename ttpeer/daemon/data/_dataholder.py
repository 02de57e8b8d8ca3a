"""What a peer holding a dataset does for the others: uploads its pieces, again when they
are wanted or have lapsed, and keeps running jobs' pieces on the relay (the pin).

Theory of operation.

- **upload**: a piece is sealed from the held copy and uploaded (``Blobs.put_piece``:
  deterministic sealing, so the piece's blob name is a function of the pool key epoch and
  the piece); ``data add`` uploads each piece once this way.
- **wants** (``on_want``): a fetcher that misses pieces broadcasts a *want* (a ``W``
  message, sealed as gossip is under a purpose of its own: ``{"want": {"id", "pieces",
  "damaged"}}``, made by ``want_payload``, which the protocol machine never sees); every
  peer holding the dataset uploads those pieces again: a piece the relay lost (its TTL,
  its quota, a restart) under the same blob name, one it served damaged under a new name,
  in a newer record of the same id (the relay keeps a blob it holds, so the same name
  would bring the damaged copy back). So a piece stays fetchable while one holder is up.
  Fetchers try the newest record's first. A piece goes again at most every
  ``REUPLOAD_EVERY`` seconds, under a new name at most every ``REPAIR_EVERY``.
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

An upload for another peer fails alone (``_guard``): logged, never the daemon's end.

What breaks it: the only holder gone and a piece lost on the relay anyway (its disk, or
a relay without touches: then the job waits, and says so).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ttpeer_wire import BLOB_TTL, TOUCH_MAX_BLOBS, ErrorCode

from ttpeer.errors import DiskError, JobError
from ttpeer.net import NetError, RelayRejected
from ttpeer.proto import Effect, PeerMachine, Record, RecordError, dataset_sources, decode, encode, job_ended, sign

from .._counters import Touches
from .._lifetime import Lifetime
from ..sealed._blobs import Blobs
from ._datastore import DataStore, Piece, piece_blobs, pieces_of
from ._datawork import WorkFiles

log = logging.getLogger("ttpeer.daemon")

MAX_WANT = 256  # pieces named in one want
REUPLOAD_EVERY = 2.0  # a holder uploads one piece again at most this often
REPAIR_EVERY = 60.0  # ... and under a new name (a new record) at most this often
PIN_MIN, PIN_MAX = 30.0, 3600.0  # seconds between touches of pinned pieces: a third of the TTL, within these


def want_payload(dataset: str, missing: list[int], damaged: list[int]) -> bytes:
    """The want of ``missing`` pieces of ``dataset`` (``damaged``: those of them whose
    every copy was refused as damaged), as ``on_want`` reads it: at most ``MAX_WANT`` each."""
    want = {"id": dataset, "pieces": missing[:MAX_WANT], "damaged": damaged[:MAX_WANT]}
    return encode({"want": want})


class Holder:
    """The uploads this peer makes of the datasets it holds, and how many it made again.
    Pieces are read from ``store``, sealed in ``work``'s scratch files and put in ``blobs``
    (``touches`` counts the pin's requests); uploads for others run in ``life``'s nursery; a
    record naming pieces under new names is signed with ``node_key`` and handed to
    ``machine`` (``process`` executes its effects)."""

    def __init__(self, store: DataStore, work: WorkFiles, machine: PeerMachine, blobs: Blobs, touches: Touches,
                 life: Lifetime, *, node_key: Ed25519PrivateKey, now: Callable[[], float],
                 wall: Callable[[], float], process: Callable[[list[Effect]], None]) -> None:
        self.store = store
        self._work = work
        self._machine = machine
        self._blobs = blobs
        self._touches = touches
        self._life = life
        self._node_key = node_key
        self._now, self._wall, self._process = now, wall, process
        self.reuploads: dict[str, int] = {}  # pieces uploaded again for others, by dataset
        self._reuploaded: dict[tuple[str, int], float] = {}
        self._repaired: dict[tuple[str, int], float] = {}

    async def upload(self, dataset: str, piece: Piece, *, blob: str | None = None,
                     fresh: bool = False, upload: bool = True) -> str | None:
        """Seal ``piece`` from the held copy and upload it (``Blobs.put_piece``: its
        deterministic name, ``blob`` again, or a ``fresh`` one; ``upload=False``: the name
        only). Returns the blob; None when no key held here seals to ``blob``. Raises
        ``NetError``, ``DiskError``, ``JobError``."""
        with self._work.file() as sealed:
            return await self._blobs.put_piece(self.store.files(dataset) / piece.path,
                                                    (piece.offset, piece.size), piece.hash, sealed,
                                                    blob=blob, fresh=fresh, upload=upload)

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
        if dataset not in self.store.held() or not self._life.running:
            return
        records = dataset_sources(self._machine.records, dataset)
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
                self._life.start_soon(self._reupload, dataset, pieces[i], blobs, sender)
        repair = [pieces[i] for i in sorted({i for i in damaged if type(i) is int})
                  if due(i, self._repaired, REPAIR_EVERY)]
        if repair:
            self._life.start_soon(self._repair, dataset, repair, sender)

    async def _reupload(self, dataset: str, piece: Piece, blobs: list[str], sender: str) -> None:
        with self._guard(dataset, piece):
            for blob in blobs:
                if await self.upload(dataset, piece, blob=blob) is not None:
                    self.reuploads[dataset] = self.reuploads.get(dataset, 0) + 1
                    log.info("uploaded piece %d of dataset %s again for %s", piece.index, dataset[:12], sender[:12])

    async def _repair(self, dataset: str, pieces: list[Piece], sender: str) -> None:
        """Upload ``pieces`` under new names and sign a record of the dataset that names them."""
        fresh: dict[int, str] = {}
        for piece in pieces:
            with self._guard(dataset, piece):
                blob = await self.upload(dataset, piece, fresh=True)
                if blob is not None:
                    fresh[piece.index] = blob
        records = dataset_sources(self._machine.records, dataset)
        if not fresh or not records:
            return
        newest = records[0].body
        body = json.loads(json.dumps(dict(newest)))  # a deep copy, of plain values
        index = 0
        for f in body["files"]:
            for p in f["pieces"]:
                p[1] = fresh.get(index, p[1])
                index += 1
        body["at"] = max(int(self._wall()), int(newest["at"]) + 1)
        rec = sign("dataset", self._machine.pool, body, self._node_key)
        self._process(self._machine.add_local(rec, self._now()))
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

    def pinned(self) -> dict[str, Record]:
        """The newest record of every dataset that a job names which has not ended for the
        pool (neither cancelled, failed everywhere, nor past its last round) and which this
        peer has not declined: the pieces its peers keep on the relay."""
        rs, m = self._machine.records, self._machine
        out: dict[str, Record] = {}
        for job in rs.jobs():
            ids = job.body.get("datasets")
            if not ids or job_ended(rs, job) is not None or m.plan(job).finished(m.chain(job).round):
                continue
            if any(d.author == self._machine.me for d in rs.of_job(job.id, "decline")):
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
            period = pin_period(self._blobs.relay_ttl)
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
        touches, lost = self._touches, set()
        for start in range(0, len(names), TOUCH_MAX_BLOBS):
            batch = names[start:start + TOUCH_MAX_BLOBS]
            missing = await self._blobs.touch(batch)
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
                    if await self.upload(dataset, piece, blob=blob) is not None:
                        touches.reuploaded += 1
                        self.reuploads[dataset] = self.reuploads.get(dataset, 0) + 1
                        log.info("uploaded piece %d of dataset %s again: its blob had lapsed on the relay",
                                 piece.index, dataset[:12])


def pin_period(ttl: float | None) -> float:
    """Seconds between touches of pinned pieces, for a relay blob TTL of ``ttl`` (None: the
    relay did not say; its default): three touches a TTL, so one lost request costs nothing."""
    return min(PIN_MAX, max(PIN_MIN, (ttl or BLOB_TTL) / 3))
