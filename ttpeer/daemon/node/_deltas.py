"""A round's whole deltas, fetched ahead of its close.

Theory of operation. Once a round closed from all deltas is covered, the machine says so
(``FetchDeltas``, on every peer, the closer too); ``start`` fetches each delta it names into
a work file, ``whole_at_once`` at a time, and marks each pending at once, so a close started
in the same step (the closer's aggregate) waits for it rather than fetch it too. A close
reads them through ``take`` (``Blobs.deltas``' ``ahead``), which moves the file to the
close's own path. So the closer's downloads run side by side, and every other peer's run
while the close is being made. One round's deltas at most are held per job: a later
round's fetch, or the job's end here (``forget_job``), removes the files of the last.

What it promises: nothing is reported and nothing raised; a delta that did not come, did
not open or could not be written is left to the close, which fetches it (and reports its
failure); every pending mark is cleared when its fetch ends, however it ends, so a close
never waits on a fetch that is gone; contributions naming the same blob are fetched once.
Files are in ``HOME/work/<job>/`` (emptied when the daemon starts).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import trio

from ttpeer.errors import DiskError, TtpeerError
from ttpeer.net import NetError
from ttpeer.proto import FetchDeltas, Record

from .._offload import in_order
from ..sealed._blobs import Blobs, whole_at_once
from ..sealed._keys import SealError


class DeltasAhead:
    def __init__(self, blobs: Blobs) -> None:
        self._blobs = blobs
        self._round: dict[str, int] = {}  # job -> the round whose deltas are held ahead
        self._files: dict[str, dict[str, Path]] = {}  # job -> blob -> its file, fetched
        self._pending: dict[str, trio.Event] = {}  # blob -> set when its fetch ahead ended
        self.used = 0  # deltas a close took that had come ahead of it (tests)

    def start(self, eff: FetchDeltas, nursery: trio.Nursery, log: logging.LoggerAdapter[logging.Logger]) -> None:
        """Start fetching ``eff``'s deltas not held or under way here (``log``: the
        effect's). The files of an earlier round of the job are removed."""
        job = eff.job.id
        if self._round.get(job) != eff.round:
            self.forget_job(job)
            self._round[job] = eff.round
        held = self._files.setdefault(job, {})
        todo = list({c["blob"]: c for c in eff.contribs
                     if c["blob"] not in held and c["blob"] not in self._pending}.values())
        marks = {c["blob"]: trio.Event() for c in todo}
        self._pending.update(marks)
        if todo:
            nursery.start_soon(self._fetch, job, eff.round, todo, marks, log)

    async def take(self, job: str, contrib: Record, dest: Path) -> bool:
        """Move ``contrib``'s delta (of ``job``), if it came ahead (waited for while under
        way), to ``dest``; whether it did."""
        blob = contrib["blob"]
        pending = self._pending.get(blob)
        if pending is not None:
            await pending.wait()
        path = self._files.get(job, {}).pop(blob, None)
        if path is None:
            return False
        try:
            os.replace(path, dest)
        except OSError:
            path.unlink(missing_ok=True)
            return False  # the close fetches it
        self.used += 1
        return True

    def forget_job(self, job: str) -> None:
        """Remove what is held ahead for ``job`` (its round ended, or the job did); fetches
        still under way drop their file when they end."""
        for path in self._files.pop(job, {}).values():
            path.unlink(missing_ok=True)
        self._round.pop(job, None)

    async def _fetch(self, job: str, rnd: int, todo: list[Record], marks: dict[str, trio.Event],
                     log: logging.LoggerAdapter[logging.Logger]) -> None:
        async def one(c: Record) -> None:
            blob, path = c["blob"], None
            try:
                path = self._blobs.work_path(job, "ahead")
                await self._blobs.fetch_delta(c, path)
                files = self._files.get(job)
                if self._round.get(job) == rnd and files is not None and blob not in files:
                    files[blob] = path
                    return
            except (NetError, SealError, DiskError, TtpeerError, OSError) as exc:
                log.info("fetching the delta of %s ahead of round %d's close failed (%s); the close fetches it",
                         c.author[:12], rnd, exc)
            except Exception:  # a bug here costs only the head start: the close fetches the delta
                log.exception("fetching the delta of %s ahead of round %d's close failed", c.author[:12], rnd)
            finally:
                self._done(blob, marks[blob])
            if path is not None:
                path.unlink(missing_ok=True)

        try:
            await in_order([functools.partial(one, c) for c in todo], limit=whole_at_once(todo))
        finally:  # cancelled (the daemon stopping): no close may wait on these
            for blob, mark in marks.items():
                self._done(blob, mark)

    def _done(self, blob: str, mark: trio.Event) -> None:
        """Clear ``blob``'s pending ``mark`` (only this fetch's: a later fetch of the same
        blob keeps its own) and wake whoever waits on it."""
        if self._pending.get(blob) is mark:
            del self._pending[blob]
        mark.set()
