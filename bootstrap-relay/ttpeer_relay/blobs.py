"""Content-addressed blobs on disk, per pool, with a TTL and a quota.

Theory of operation. A blob lives at ``pools/<pool>/blobs/<sha256>``. An upload
streams into a temporary file in the same directory while hashing and counting;
it is refused as soon as it passes the size cap or the pool's quota, and kept
only if its hash matches its name, after fsync and an atomic rename. So a blob
file that exists is always complete and correct, and a crash leaves at most a
``.part`` file that the next start removes.

The index (size and upload time of every blob) is read from disk once at start
and kept in memory; the file's mtime is its upload time, so TTLs survive
restarts. Re-uploading an existing blob refreshes its TTL, and so does a touch
(``touch_many``: the peers' lease on the pieces of a running job's datasets). Bytes of uploads in
flight are reserved against the quota, so concurrent uploads cannot overshoot it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from ttpeer_wire import ErrorCode

log = logging.getLogger(__name__)

_HASH = re.compile(r"^[0-9a-f]{64}$")
_WRITE_BUFFER = 1 << 20  # bytes handed to the disk thread at a time
_MAX_IOV = 1024  # IOV_MAX on Linux: buffers one writev may take


class BlobError(Exception):
    """An upload was refused; ``status`` and ``code`` are what to answer with."""

    def __init__(self, status: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass
class _Pool:
    blobs: dict[str, tuple[int, float]] = field(default_factory=dict)  # hash -> (size, mtime)
    used: int = 0
    reserved: int = 0


class BlobStore:
    def __init__(
        self,
        root: Path,
        *,
        max_blob_bytes: int,
        ttl: float,
        quota: int,
        max_blobs: int = 100_000,
    ) -> None:
        self.root = root
        self.max_blob_bytes = max_blob_bytes
        self.ttl = ttl
        self.quota = quota
        self.max_blobs = max_blobs
        self._pools: dict[str, _Pool] = {}

    def directory(self, pool: str) -> Path:
        return self.root / pool / "blobs"

    def load(self) -> None:
        """Index every blob on disk and remove leftovers of interrupted uploads (sync)."""
        if not self.root.is_dir():
            return
        for pool_dir in self.root.iterdir():
            blob_dir = pool_dir / "blobs"
            if not blob_dir.is_dir():
                continue
            entry = self._pools.setdefault(pool_dir.name, _Pool())
            for item in blob_dir.iterdir():
                if _HASH.match(item.name):
                    st = item.stat()
                    entry.blobs[item.name] = (st.st_size, st.st_mtime)
                    entry.used += st.st_size
                elif item.name.endswith(".part"):
                    item.unlink(missing_ok=True)

    def stat(self, pool: str, blob: str, now: float) -> int | None:
        """Size of the blob, or None if it is missing or has expired."""
        entry = self._pools.get(pool)
        if entry is None or blob not in entry.blobs:
            return None
        size, mtime = entry.blobs[blob]
        if now - mtime > self.ttl:
            self._delete(pool, blob)
            return None
        return size

    def _forget(self, pool: str, blob: str) -> Path:
        entry = self._pools[pool]
        size, _ = entry.blobs.pop(blob)
        entry.used -= size
        return self.path(pool, blob)

    def _delete(self, pool: str, blob: str) -> None:
        _unlink([self._forget(pool, blob)])

    async def sweep(self, now: float) -> int:
        """Delete every expired blob; returns how many."""
        expired = [
            (pool, blob)
            for pool, entry in self._pools.items()
            for blob, (_, mtime) in entry.blobs.items()
            if now - mtime > self.ttl
        ]
        paths = [self._forget(pool, blob) for pool, blob in expired]
        await trio.to_thread.run_sync(_unlink, paths)
        return len(paths)

    def path(self, pool: str, blob: str) -> Path:
        return self.directory(pool) / blob

    async def touch(self, pool: str, blob: str, now: float) -> None:
        """Restart an existing blob's TTL (a repeated upload)."""
        entry = self._pools[pool]
        size, _ = entry.blobs[blob]
        entry.blobs[blob] = (size, now)
        try:
            await trio.to_thread.run_sync(os.utime, self.path(pool, blob), (now, now))
        except OSError as exc:
            log.warning("could not refresh blob %s: %s", blob, exc)

    async def touch_many(self, pool: str, blobs: list[str], now: float) -> list[str]:
        """Restart the TTL of each of ``blobs`` the pool holds (unexpired), the file times in
        one worker thread; returns the others, in order. Quota and sizes are unchanged."""
        held, missing = [], []
        for blob in blobs:
            (missing if self.stat(pool, blob, now) is None else held).append(blob)
        for blob in held:
            entry = self._pools[pool]
            entry.blobs[blob] = (entry.blobs[blob][0], now)
        if held:
            await trio.to_thread.run_sync(_utime, [self.path(pool, b) for b in held], now)
        return missing

    async def put(self, pool: str, blob: str, body: AsyncIterator[bytes], now: float) -> None:
        """Store the streamed ``body`` as ``blob``. Raises ``BlobError`` (400, 413, 507)."""
        entry = self._pools.setdefault(pool, _Pool())
        if len(entry.blobs) >= self.max_blobs:
            raise BlobError(507, ErrorCode.POOL_QUOTA, "pool quota exceeded")
        directory = self.directory(pool)
        tmp = directory / f"{secrets.token_hex(8)}.part"
        digest = hashlib.sha256()
        size = 0
        try:
            fd = await trio.to_thread.run_sync(_create, tmp)
            try:
                # The body arrives a TLS record (16 KiB) at a time. Chunks are gathered
                # (not copied) and handed to a worker thread a batch at a time, which
                # hashes and writes them (both release the GIL): the event loop serves
                # other requests meanwhile, and the kernel buffers this one's next bytes.
                # (Receiving the next batch while the thread writes measured no faster
                # on two cores.)
                batch: list[bytes] = []
                batched = 0
                async for chunk in body:
                    size += len(chunk)
                    entry.reserved += len(chunk)
                    if size > self.max_blob_bytes:
                        raise BlobError(413, ErrorCode.TOO_LARGE, f"blob is over the {self.max_blob_bytes}-byte cap")
                    if entry.used + entry.reserved > self.quota:
                        raise BlobError(507, ErrorCode.POOL_QUOTA, "pool quota exceeded")
                    batch.append(chunk)
                    batched += len(chunk)
                    if batched >= _WRITE_BUFFER:
                        await trio.to_thread.run_sync(_hash_and_write, fd, digest, batch)
                        batch, batched = [], 0
                await trio.to_thread.run_sync(_hash_and_write, fd, digest, batch)
                await trio.to_thread.run_sync(os.fsync, fd)
            finally:
                os.close(fd)
            if digest.hexdigest() != blob:
                raise BlobError(400, ErrorCode.BAD_BLOB, f"body hashes to {digest.hexdigest()}, not to {blob}")
            await trio.to_thread.run_sync(_commit, tmp, self.path(pool, blob))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise BlobError(507, ErrorCode.DISK_FULL, "the relay's disk is full") from None
            raise
        finally:
            entry.reserved -= size
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: tmp.unlink(missing_ok=True))
        if blob in entry.blobs:  # a concurrent upload of the same bytes finished first
            entry.used -= entry.blobs[blob][0]
        entry.blobs[blob] = (size, now)
        entry.used += size


def _create(tmp: Path) -> int:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _hash_and_write(fd: int, digest: Any, chunks: list[bytes]) -> None:
    """Hash ``chunks`` into ``digest`` and write them all to ``fd`` (a worker thread)."""
    for chunk in chunks:
        digest.update(chunk)
    views = [memoryview(c) for c in chunks if c]
    while views:
        written = os.writev(fd, views[:_MAX_IOV])
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views and written:
            views[0] = views[0][written:]


def _commit(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    try:  # make the rename itself durable
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _utime(paths: list[Path], now: float) -> None:
    for path in paths:
        try:
            os.utime(path, (now, now))
        except OSError as exc:  # the index holds the new time; a restart reads the old one
            log.warning("could not refresh blob %s: %s", path.name, exc)


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete %s: %s", path, exc)
