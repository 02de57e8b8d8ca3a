"""Pool keys and sealing: the key epochs this node holds and everything sealed with them.

Theory of operation. ``PoolKeys`` holds the pool key epochs, oldest first, as the home
stores them: the newest seals, any of them opens (so blobs of old epochs stay readable).
Only the admin adds an epoch (``rotate``, on a revocation or a lost join race); members
take the whole list from a key handover (``handover``/``open_handover``: sealed to one
member, signed by the giver, with the giver's membership proof). The envelopes are made
and opened here: P (gossip, pool-sealed, bound to its sender, after a replay counter), W
(a want of dataset pieces, sealed the same way under its own purpose), K (the handover)
and L (``ended_message``: the records that show a node it is no member). ``Blobs`` seals
and opens blobs on the transport, in memory for small ones (deltas, task files) and file to
file for model-sized states, which never sit in the daemon's memory.

What breaks it: a key handed to a node that is no member (the node checks membership
before it hands keys), or a key written to the log (``_logging.add_secret`` knows each).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ttpeer import _logging
from ttpeer._chunked import piece_lengths
from ttpeer.errors import DiskError
from ttpeer.net import BlobCorrupt, NetError, Transport
from ttpeer.net._entropy import random_bytes
from ttpeer.net._seal import (
    COUNTER,
    CUT_HEADER,
    TAG,
    CutTable,
    SealError,
    cut_table,
    gossip_ad,
    open_cut,
    open_direct,
    open_sealed,
    open_sealed_file,
    seal,
    seal_cut,
    seal_file,
    seal_to,
)
from ttpeer.proto import RETRY_AFTER, Record, decode, encode, parse, verify_proof

from ._executor import Deltas
from ._home import Home
from ._workfiles import disk_or_job, write_work

log = logging.getLogger("ttpeer.daemon")

GOSSIP = b"ttpeer/gossip/v1"
SEALED = {b"P": GOSSIP, b"W": b"ttpeer/want/v1"}  # a sealed message's kind: gossip, or a want of dataset pieces
BLOB = b"ttpeer/blob/v1"
PIECE_SALT = b"ttpeer/data-piece/v1\n"  # a dataset piece's salt: from its hash (``Blobs.put_piece``)
KEY_DOMAIN = b"ttpeer/keyshare/v1\n"
MAX_BLOB = 8 * 2**30
THREAD_FILE_BYTES = 4 * 2**20  # a larger state is sealed or opened in a thread
OWN_SLICES_KEPT = 8  # reduced slices this peer made, kept in memory for the closes that use them
OWN_DELTAS_KEPT = 32  # this peer's newest deltas kept to aggregate and apply with (no download)
DELTA_UPLOAD_TRIES = 3  # then the delta is given up and its shards trained again
T = TypeVar("T")
RANGES_AT_ONCE = 8  # contributions an aggregator fetches its slice of at once (``Blobs.deltas``)
MAX_ENDED_RECORDS = 64  # records in one L message: the invite and its winning joins, or revocations


class PoolKeys:
    """The pool key epochs held here, oldest first; the last one seals."""

    def __init__(self, home: Home) -> None:
        self._home = home
        self.keys: list[bytes] = home.pool_keys()

    @property
    def newest(self) -> bytes | None:
        return self.keys[-1] if self.keys else None

    def set(self, keys: list[bytes]) -> None:
        for key in keys:
            _logging.add_secret(key)  # the log filter's second wall knows every epoch's key
        self._home.save_pool_keys(keys)
        self.keys = keys

    def rotate(self) -> None:
        """A new epoch (the admin's, on a revocation or a lost join race)."""
        self.set([*self.keys, random_bytes(32)])

    def seal(self, purpose: bytes, data: bytes) -> bytes:
        assert self.keys, "sealing needs a pool key: callers wait for one"
        return seal(self.keys[-1], purpose, data)

    def open(self, purpose: bytes, data: bytes) -> bytes:
        """Open with whichever epoch's key sealed it, newest first. Raises ``SealError``."""
        for key in reversed(self.keys):
            try:
                return open_sealed(key, purpose, data)
            except SealError:
                continue
        raise SealError("sealed payload does not authenticate under any pool key held here")

    def seal_gossip(self, sender: str, counter: int, payload: bytes, kind: bytes = b"P") -> bytes:
        """A message of ``kind`` (``SEALED``): ``payload`` after its replay counter, bound to its sender."""
        return kind + self.seal(gossip_ad(SEALED[kind], sender), counter.to_bytes(COUNTER, "big") + payload)

    def open_gossip(self, sender: str, body: bytes, kind: bytes = b"P") -> tuple[int, bytes] | None:
        """(counter, payload) of a ``kind`` message from ``sender``; None if too short for a counter."""
        plain = self.open(gossip_ad(SEALED[kind], sender), body)  # raises SealError
        if len(plain) < COUNTER:
            return None
        return int.from_bytes(plain[:COUNTER], "big"), plain[COUNTER:]

    def handover(self, signer: Ed25519PrivateKey, proof: list[bytes], node: str, seal_pub: str) -> bytes:
        """A K message: every epoch's key, sealed to ``node`` and signed by us."""
        keys = b"".join(self.keys)
        body = {"keys": [k.hex() for k in self.keys], "to": node, "proof": [p.hex() for p in proof],
                "sig": signer.sign(KEY_DOMAIN + node.encode() + keys).hex()}
        return b"K" + seal_to(bytes.fromhex(seal_pub), encode(body))


def open_to(seal_key: X25519PrivateKey, body: bytes, *, max_size: int) -> Any:
    """The object in a message sealed to this node alone (K, L). Raises ``SealError``,
    ``RecordError``."""
    return decode(open_direct(seal_key, body), max_size=max_size)


def open_handover(seal_key: X25519PrivateKey, body: bytes, pool: str,
                  me: str) -> tuple[str, list[bytes], list[Record]] | None:
    """(giver, keys, the giver's proof) of a K message to ``me``, or None when it is for
    someone else or holds no usable key. Raises on a forged or malformed one."""
    obj = open_to(seal_key, body, max_size=200_000)
    keys = [bytes.fromhex(k) for k in obj["keys"]]
    proof = [bytes.fromhex(p) for p in obj["proof"]]
    giver = parse(proof[1])["node"]
    verify_proof(pool, giver, proof)
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(giver)).verify(
        bytes.fromhex(obj["sig"]), KEY_DOMAIN + me.encode() + b"".join(keys)
    )
    if obj["to"] != me or not keys or any(len(k) != 32 for k in keys):
        return None
    return giver, keys, [parse(raw) for raw in proof]


def ended_message(node: str, seal_pub: str, records: list[Record]) -> bytes:
    body = encode({"to": node, "records": [r.raw.hex() for r in records[:MAX_ENDED_RECORDS]]})
    return b"L" + seal_to(bytes.fromhex(seal_pub), body)


class Blobs:
    """Sealed blobs on the transport, and the work files they pass through."""

    def __init__(self, keys: PoolKeys, transport: Transport, home: Home, reject: Callable[[str], None]) -> None:
        self._keys = keys
        self._transport = transport
        self._home = home
        self._reject = reject  # counts a blob refused as not authentic
        self._fetches = itertools.count()  # names the work files
        self._own: OrderedDict[str, tuple[Path, str]] = OrderedDict()  # blob -> its delta here, sha256
        self._own_states: dict[str, Path] = {}  # state -> an initial state this peer made (``keep_state``)
        self._slices: OrderedDict[str, bytes] = OrderedDict()  # blob -> a reduced slice made here (``keep_slice``)
        # The LAN shortcut (``Datasets.fetch_blob``): (blob, max size, dest, its uploaders) ->
        # whether the blob came from one of them directly, hash checked, into dest.
        self.direct: Callable[[str, int, Path, list[str]], Awaitable[bool]] | None = None
        # Its ranges (``Datasets.fetch_blob_range``): (blob, start, stop, dest, its uploaders)
        # -> whether bytes start .. stop-1 came from one of them directly into dest.
        self.direct_range: Callable[[str, int, int, Path, list[str]], Awaitable[bool]] | None = None

    def keep_state(self, state: str, path: Path) -> None:
        """Keep the state file at ``path`` (moved: an initial state this peer made and
        uploaded), so that fetching ``state`` here takes it instead of downloading it back."""
        dest = self._home.path / "work" / "own" / f"{state.removeprefix('sha256:')}.state"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
        except OSError as exc:
            log.info("could not keep the initial state (%s); it is downloaded when needed", exc)
            return
        self._own_states[state] = dest

    async def take_state(self, state: str, dest: Path) -> bool:
        """``state`` at ``dest`` (moved there) if this peer kept it (``keep_state``); False
        otherwise. It is given once: a state that does not import is fetched."""
        own = self._own_states.pop(state, None)
        if own is None:
            return False
        try:
            os.replace(own, dest)  # one folder, one file system: a rename
        except OSError:
            own.unlink(missing_ok=True)
            return False
        await trio.lowlevel.checkpoint()
        return True

    async def _keep_own(self, blob: str, data: bytes) -> None:
        """Keep ``data``, this peer's delta just uploaded as ``blob``, for the closes that use
        it (the newest ``OWN_DELTAS_KEPT``; ``HOME/work`` is cleared at every start)."""
        path = self._home.path / "work" / "own" / f"{blob}.bin"
        try:
            await off_span(len(data), _write_own, path, data)
        except OSError as exc:  # only a saving: without the copy the delta is downloaded
            log.info("could not keep a copy of this peer's delta (%s); it is downloaded when needed", exc)
            return
        self._own[blob] = (path, hashlib.sha256(data).hexdigest())
        while len(self._own) > OWN_DELTAS_KEPT:
            _blob, (old, _digest) = self._own.popitem(last=False)
            old.unlink(missing_ok=True)

    def keep_slice(self, blob: str, data: bytes) -> None:
        """Keep a reduced slice this peer made (or checked: the same bytes), the plaintext of
        ``blob``, so the close that uses it need not download it back (the newest
        ``OWN_SLICES_KEPT``: a slice is a fraction of one delta)."""
        self._slices[blob] = data
        while len(self._slices) > OWN_SLICES_KEPT:
            self._slices.popitem(last=False)

    def kept_slice(self, blob: str) -> bytes | None:
        return self._slices.get(blob)

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
        await _off_loop(plain, seal_file, key, BLOB, plain, sealed)

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
            await _off_loop(sealed, open_sealed_file, list(reversed(self._keys.keys)), BLOB, sealed, plain)
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
                await self._keep_own(blob, data)
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

    @contextlib.asynccontextmanager
    async def deltas(self, job: Record, contribs: tuple[Record, ...],
                     run: tuple[int, int] | None = None) -> AsyncIterator[Deltas]:
        """The round's contributions as files in ``HOME/work/<job>/``, fetched and opened one
        blob at a time: the node never holds a round's deltas at once (with 16 shards that
        was 16 compressed deltas in the daemon), and the executor reads each file when its
        outer step gets to it. ``run``: chunks ``[first, stop)`` only, of chunked deltas
        (``chunk_run``): an aggregator downloads its slice of every delta, not the deltas,
        ``RANGES_AT_ONCE`` contributions at a time (a slice is a 1/s-th of a delta: one at a
        time, its three requests each cost a round trip per contribution, which on a 50 ms
        path made a small model's sliced round slower than all deltas). This peer's own
        delta is its copy here. The files are in the order of ``contribs`` and are removed
        when the block ends."""
        folder = self._home.path / "work" / job.id
        folder.mkdir(parents=True, exist_ok=True)
        made: list[Path] = []

        async def fetch(c: Record) -> tuple[Path, int]:
            path = folder / f"in-{next(self._fetches)}.bin"
            made.append(path)
            own = self._own.get(c["blob"])
            if own is not None and await off_span(c["size"], _copy_own, *own, path, c["size"]):
                return path, c["samples"]  # this peer's own delta: no download
            if run is not None:
                try:
                    await self.chunk_run(c, *run, path)
                except OSError as exc:
                    raise disk_or_job(folder, exc) from None
            else:
                data = await self.get(c["blob"], max_size=sealed_bound(c), uploaders=[c.author])
                try:
                    write_work(path, data)
                except OSError as exc:  # a full disk stops the daemon, as for any other write
                    raise DiskError(path, exc) from None
                del data
            return path, c["samples"]

        try:
            paths: Deltas = await in_order([functools.partial(fetch, c) for c in contribs],
                                           limit=1 if run is None else RANGES_AT_ONCE)
            yield paths
        finally:
            for path in made:
                path.unlink(missing_ok=True)


async def in_order(calls: Sequence[Callable[[], Awaitable[T]]], *, limit: int) -> list[T]:
    """Await ``calls``, at most ``limit`` at a time; their results in the calls' order. The
    first failure cancels the rest and is raised as itself (not in an exception group:
    callers catch ``NetError`` or ``SealError`` as from one call)."""
    results: list[Any] = [None] * len(calls)
    failed: list[Exception] = []
    gate = trio.Semaphore(limit)

    async def one(i: int, cancel: trio.CancelScope) -> None:
        async with gate:
            try:
                results[i] = await calls[i]()
            except Exception as exc:
                failed.append(exc)
                cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if failed:
        raise failed[0]
    return results


def sealed_bound(contrib: Record) -> int:
    """The most bytes a contribution's sealed blob may take: its delta and the sealing (a
    chunked delta's: the cut table and one tag per piece)."""
    chunks = contrib.body.get("chunks")
    pieces = chunks + 1 if isinstance(chunks, int) else 0
    return contrib["size"] + 64 + CUT_HEADER + (4 + TAG) * pieces


def _write_own(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _copy_own(own: Path, digest: str, dest: Path, size: int) -> bool:
    """``own`` (this peer's delta) at ``dest``, linked or copied; False if it is gone, not
    ``size`` bytes or no longer hashes as it did (then the blob is downloaded)."""
    try:
        if own.stat().st_size != size:
            return False
        try:
            os.link(own, dest)
        except OSError:
            shutil.copyfile(own, dest)
        if file_sha256(dest) != digest:
            dest.unlink(missing_ok=True)
            return False
    except OSError:
        return False
    return True


async def off_span(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``size`` bytes, returning what it returns: in a thread
    when large (as ``_off_loop``), inline when small (the simulator stays exact)."""
    if size > THREAD_FILE_BYTES:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    out = fn(*args, **kwargs)
    await trio.lowlevel.checkpoint()
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def _off_loop(path: Path, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on a file at ``path``: in a thread when the file is large enough that
    the event loop would notice (a model state: about a second of ChaCha20), inline when not (the
    thread hop costs more, and the simulator stays deterministic)."""
    if path.stat().st_size > THREAD_FILE_BYTES:
        await trio.to_thread.run_sync(fn, *args)
    else:
        fn(*args)
        await trio.lowlevel.checkpoint()
