"""Reduced slices as a close reads them: kept here, fetched ahead, or downloaded, each checked.

Theory of operation. A sliced close applies the round's reduced slices, one blob each
(``close_inputs``; an unsliced close, the contributions' deltas). ``result`` finds a
slice's plaintext where it is: the copy kept here (made or checked here), one fetched
ahead of the close, or a download, and checks it against its record. Fetching ahead:
once a round's slices are all signed, the machine says so (``FetchSlices``) before the
close is made or applied; ``start_ahead`` fetches, ``RANGES_AT_ONCE`` at a time, each slice
not held here, and marks each pending at once, so a close started in the same step waits
for it rather than fetch it too. One round's slices at most are held ahead: a new round's
fetch, or the end of the job, drops the last.

What it promises: a slice that does not hash or size as its record says raises
``SliceMismatch`` (the effects' runner reports it refused: it is made again). A fetch
ahead reports nothing: a slice that does not come or does not check is left to the
close, which fetches, checks and refuses it as ever; a bug there costs only the head start.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import AsyncIterator

import trio

from ttpeer.errors import TtpeerError
from ttpeer.net import NetError
from ttpeer.proto import FetchSlices, JobSpec, Record

from .._executor import Deltas
from .._offload import in_order
from ..sealed._blobs import RANGES_AT_ONCE, Blobs
from ..sealed._keys import SealError
from ._deltas import DeltasAhead


class SliceMismatch(TtpeerError):
    """A reduced slice's blob does not hash or size as its record (``record``) says."""

    def __init__(self, record: str, message: str) -> None:
        super().__init__(message)
        self.record = record


class Slices:
    def __init__(self, blobs: Blobs) -> None:
        self._blobs = blobs
        self._ahead: dict[str, bytes] = {}  # blob -> plaintext, of round ``_round``
        self._round: tuple[str, int] | None = None  # (job, round)
        self._pending: dict[str, trio.Event] = {}  # the fetches ahead under way
        self.ahead_used = 0  # slices a close took that had come ahead of it (tests)
        self.deltas_ahead = DeltasAhead(blobs)  # an unsliced round's whole deltas, fetched ahead

    @contextlib.asynccontextmanager
    async def close_inputs(self, job: JobSpec, contribs: tuple[Record, ...],
                           slices: tuple[Record, ...]) -> AsyncIterator[Deltas]:
        """What a close applies: the contributions' deltas, or a sliced close's reduced
        slices, each checked against its record (``result``)."""
        if not slices:
            async with self._blobs.deltas(job, contribs, ahead=functools.partial(self.deltas_ahead.take, job.id)) \
                    as deltas:
                yield deltas
            return

        async def fetch(rec: Record) -> tuple[bytes, int]:
            return await self.result(rec), 1

        # All at once (RANGES_AT_ONCE at a time): together they are one reduced model, held
        # here whichever way they come, and one at a time each cost a round trip.
        yield await in_order([functools.partial(fetch, rec) for rec in slices], limit=RANGES_AT_ONCE)

    async def result(self, rec: Record) -> bytes:
        """The plaintext of the reduced slice of record ``rec``: the copy kept here (made or
        checked here), fetched ahead (waited for while under way), or downloaded. Raises
        ``SliceMismatch`` when it does not size or hash as ``rec`` says."""
        pending = self._pending.get(rec["blob"])
        if pending is not None:  # fetched ahead right now: wait rather than fetch it twice
            await pending.wait()
        data = self._blobs.kept_slice(rec["blob"])
        if data is None and (data := self._ahead.pop(rec["blob"], None)) is not None:
            self.ahead_used += 1
        if data is None:
            data = await self._blobs.get(rec["blob"], max_size=rec["size"] + 64, uploaders=[rec.author])
        if len(data) != rec["size"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
            self._blobs.refused("slice")
            raise SliceMismatch(rec.id, f"slice {rec['slice']} of round {rec['round']} by {rec.author[:12]} "
                                "does not hash as its record says; it is made again")
        return data

    def start_ahead(self, eff: FetchSlices, nursery: trio.Nursery, log: logging.LoggerAdapter[logging.Logger]) -> None:
        """Start fetching ``eff``'s slices not held here (``log``: the effect's). Slices of
        an earlier round still held are dropped: one round's at most."""
        key = (eff.job.id, eff.round)
        if self._round != key:
            self._ahead.clear()
            self._round = key
        todo = list({rec["blob"]: rec for rec in eff.slices if rec["blob"] not in self._ahead and rec["blob"] not in
                     self._pending and self._blobs.kept_slice(rec["blob"]) is None}.values())
        for rec in todo:
            self._pending[rec["blob"]] = trio.Event()
        if todo:
            nursery.start_soon(self._fetch_ahead, key, todo, log)

    def forget_job(self, job: str) -> None:
        """``job`` ended: the slices (and deltas) of its last round that no close read are
        not needed now, nor those still on their way (``_fetch_ahead`` keeps only its round's)."""
        self.deltas_ahead.forget_job(job)
        if self._round is not None and self._round[0] == job:
            self._ahead.clear()
            self._round = None

    async def _fetch_ahead(self, key: tuple[str, int], todo: list[Record],
                           log: logging.LoggerAdapter[logging.Logger]) -> None:
        async def one(rec: Record) -> None:
            blob = rec["blob"]
            try:
                data = await self._blobs.get(blob, max_size=rec["size"] + 64, uploaders=[rec.author])
                if (self._round == key and len(data) == rec["size"]
                        and hashlib.sha256(data).hexdigest() == rec["sha256"]):
                    self._ahead[blob] = data
            except (NetError, SealError, TtpeerError) as exc:
                log.info("fetching slice %d of round %d ahead of its close failed (%s); it is fetched when "
                         "needed", rec["slice"], key[1], exc)
            except Exception:  # a bug here costs only the head start: the close fetches the slice
                log.exception("fetching slice %d of round %d ahead of its close failed", rec["slice"], key[1])
            finally:
                pending = self._pending.pop(blob, None)  # two records naming one blob: fetched once
                if pending is not None:
                    pending.set()

        await in_order([functools.partial(one, rec) for rec in todo], limit=RANGES_AT_ONCE)
