"""``MultiRelay``: one ``Transport`` over every relay of a pool.

Theory of operation. A pool lists up to 8 relays (its token and the root-signed
``relays`` record), each pinned by its own certificate fingerprint. No relay is a
single point:

- **Messages go to every live relay.** They are small (records and digests), so the
  copies cost little. A receiver long-polls every relay it reaches at once and hands
  the daemon each message once: a copy that came through another relay is dropped
  (``_Seen``), while a sender's genuine resend of the same bytes still gets through.
  A relay that dies takes no message with it that another relay carried.
- **Blobs go to one relay, the primary:** the first live relay in the pool's order,
  so peers that see the same relays alive use the same one. A download asks the
  primary, then every other live relay. The blobs this peer uploaded are kept (the
  spool: hard links on disk, or bytes in memory for tests) with the relays that hold
  them; when the relay holding one goes down, ``run`` uploads it again to the new
  primary; when a relay comes back after an outage, the ones it lost (it restarted
  empty) are sent again too. So what this peer sent through a dead relay is sent
  again through another, or through the same one once it is back.
- **One cursor.** The daemon sees cursors local to this object. Each relay keeps its
  own, and it moves (acknowledging, so deleting, at the relay) only past messages the
  daemon acknowledged or that were copies: delivery stays at-least-once.
- **Failures.** An operation fails only when every live relay failed; a relay that
  fails with ``RelayUnavailable`` is marked down and ``run`` (a task the daemon starts
  beside its receiver) connects it again with backoff. A relay that presents another
  certificate than its pin is skipped with a warning naming it, and retried rarely (its
  operator may put the right one back). Only when no relay is live does the daemon see
  ``RelayUnavailable`` and stop its protocol clock (``daemon/_link.py``).

With one relay it is that relay, error for error (and no copies to drop); the spool
still re-sends what a relay that restarted empty lost.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio
from ttpeer_wire import TOUCH_MAX_BLOBS, ErrorCode

from ._errors import (
    BlobCorrupt,
    BlobMissing,
    NetError,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
)
from ._transport import Message, Transport

log = logging.getLogger("ttpeer.net")

T = TypeVar("T")

LIVE, DOWN, CONNECTING, WRONG_CERT = "live", "down", "connecting", "wrong certificate"
FIRST_RETRY = 1.0  # seconds before a relay that went down is connected again; doubles ...
MAX_RETRY = 60.0  # ... up to this
WRONG_CERT_RETRY = 300.0  # a relay that is not the one pinned: checked again this rarely
CONNECT_TIMEOUT = 30.0  # one attempt at reviving a relay
SEEN_WINDOW = 120.0  # seconds a delivered message's digest is remembered, to drop copies
SEEN_MAX = 20_000
SPOOL_BLOBS = 64  # the newest uploads kept to send again, at most this many ...
SPOOL_BYTES = 2 * 2**30  # ... and this many bytes


@dataclass
class _Relay:
    url: str
    fingerprint: str
    client: Transport
    state: str = CONNECTING
    error: str | None = None
    retry_at: float = 0.0
    delay: float = FIRST_RETRY
    acked: int = 0  # the cursor this relay is asked with: every message up to it is done
    # (relay seq, local seq or None for a copy) of what it delivered, not yet acknowledged
    pending: deque[tuple[int, int | None]] = field(default_factory=deque)
    sent_before: int = 0  # bytes counted by a client this relay had before


@dataclass
class _Spooled:
    size: int
    holders: set[str]  # urls of relays that took it
    path: Path | None = None
    data: bytes | None = None


class _Seen:
    """How many copies of each recent message each relay delivered: a copy is handed
    on only when its relay has now delivered more of it than any other relay did, so a
    message sent once arrives once, and a message sent twice (a resend of the same bytes)
    twice, whichever relays carried the copies."""

    def __init__(self) -> None:
        self._counts: OrderedDict[bytes, tuple[float, dict[str, int]]] = OrderedDict()

    def fresh(self, relay: str, sender: str, data: bytes, now: float) -> bool:
        while self._counts and (len(self._counts) >= SEEN_MAX
                                or next(iter(self._counts.values()))[0] < now - SEEN_WINDOW):
            self._counts.popitem(last=False)
        digest = hashlib.sha256(sender.encode() + b"\0" + data).digest()
        first, counts = self._counts.get(digest, (now, {}))
        mine = counts.get(relay, 0) + 1
        others = max((n for r, n in counts.items() if r != relay), default=0)
        counts[relay] = mine
        self._counts[digest] = (first, counts)
        return mine > others


class MultiRelay:
    """The ``Transport`` over the relays ``relays`` ((url, fingerprint) pairs, in the pool's
    order); ``make(url, fingerprint)`` makes one relay's transport (a ``RelayClient``).
    ``spool``: a folder for the hard links of uploaded files (None: bytes kept in memory,
    for tests and the simulator). Start ``run`` in a nursery to revive relays that went
    down and send their blobs again."""

    def __init__(self, relays: Sequence[tuple[str, str]], make: Callable[[str, str], Transport], *,
                 spool: Path | None = None) -> None:
        if not relays:
            raise ValueError("a pool has at least one relay")
        self._make, self._spool_dir = make, spool
        self._relays: list[_Relay] = [self._new(url, fp) for url, fp in relays]
        self._closing: list[_Relay] = []  # removed by set_relays, closed by run
        self._ready: list[Message] = []
        self._local = self._acked = 0  # the last local seq handed out; the last the daemon acknowledged
        self._seen = _Seen()
        self._spool: OrderedDict[str, _Spooled] = OrderedDict()
        self._wake = trio.Event()
        self._gone_sent = self._gone_received = 0
        self.resent = 0  # blobs uploaded again because the relay holding them went down
        self.wrong_certificates = 0

    def _new(self, url: str, fp: str) -> _Relay:
        return _Relay(url.rstrip("/"), fp.lower(), self._make(url, fp))

    # -- the list of relays -----------------------------------------------------------

    def set_relays(self, relays: Sequence[tuple[str, str]]) -> None:
        """Use ``relays`` from now on (the newest ``relays`` record): relays kept keep their
        connection; new ones are connected by ``run``; removed ones are closed by it."""
        if not relays:
            raise ValueError("a pool has at least one relay")
        old = {(r.url, r.fingerprint): r for r in self._relays}
        fresh = [old.pop((url.rstrip("/"), fp.lower())) if (url.rstrip("/"), fp.lower()) in old
                 else self._new(url, fp) for url, fp in relays]
        self._relays = fresh
        self._closing += old.values()
        for r in old.values():
            log.info("relay %s is no longer one of the pool's", r.url)
        self._wake.set()

    def describe(self) -> list[dict[str, Any]]:
        """Each relay in the pool's order: url, pin, state, last error, whether it is the primary."""
        primary = self._primary()
        return [{"url": r.url, "fingerprint": r.fingerprint, "state": r.state, "error": r.error,
                 "primary": r is primary} for r in self._relays]

    @property
    def peer(self) -> str:
        """This peer's id, as every relay knows it."""
        return str(getattr(self._relays[0].client, "peer", ""))

    @property
    def relays(self) -> list[tuple[str, str]]:
        return [(r.url, r.fingerprint) for r in self._relays]

    def _live(self) -> list[_Relay]:
        return [r for r in self._relays if r.state == LIVE]

    def _primary(self) -> _Relay | None:
        return next(iter(self._live()), None)

    @property
    def _several(self) -> bool:
        return len(self._relays) > 1

    # -- connecting and reviving --------------------------------------------------------

    async def connect(self) -> None:
        """Connect every relay at once. Returns when at least one is live; raises (as the
        relay did, with one relay) when none is."""
        errors: dict[str, NetError] = {}
        async with trio.open_nursery() as nursery:
            for r in self._relays:
                nursery.start_soon(self._connect_one, r, errors)
        if not self._live():
            raise self._none_live(errors)

    async def _connect_one(self, r: _Relay, errors: dict[str, NetError]) -> None:
        try:
            await r.client.connect()
        except RelayFingerprintMismatch as exc:
            errors[r.url] = exc
            self.wrong_certificates += 1
            if r.state != WRONG_CERT:
                log.warning("relay %s presents certificate %s, not the pinned %s: skipped (ask the pool "
                            "admin whether it moved; 'ttpeer relay ls' lists the pool's relays)",
                            r.url, exc.got, r.fingerprint)
            self._set_down(r, exc, state=WRONG_CERT, retry=WRONG_CERT_RETRY)
        except NetError as exc:
            errors[r.url] = exc
            self._set_down(r, exc)
        else:
            if r.state != LIVE and self._several:
                log.info("relay %s is live", r.url)
            # The cursor stays: a relay's seqs only grow, across its restarts too.
            r.state, r.error, r.delay = LIVE, None, FIRST_RETRY

    def _none_live(self, errors: dict[str, NetError]) -> NetError:
        """The error to raise when no relay is live: with one relay, its own; else a
        revocation first, then what every relay agrees on, else ``RelayUnavailable``."""
        found = [errors[r.url] for r in self._relays if r.url in errors]
        if len(self._relays) == 1 and found:
            return found[0]
        for exc in found:
            if _revoked(exc):
                return exc
        if found and len(found) == len(self._relays):
            if all(isinstance(e, RelayFingerprintMismatch) for e in found):
                return found[0]
            if all(isinstance(e, RelayRejected) for e in found):
                return found[0]
        said = "; ".join(f"{r.url}: {r.error or r.state}" for r in self._relays)
        return RelayUnavailable(self._relays[0].url, f"no relay of the pool answers ({said})")

    def _set_down(self, r: _Relay, exc: NetError, *, state: str = DOWN, retry: float | None = None) -> None:
        was = r.state
        r.state, r.error = state, str(exc)
        now = trio.current_time()
        if retry is None:
            retry, r.delay = r.delay, min(r.delay * 2, MAX_RETRY)
        r.retry_at = now + retry
        if was == LIVE and self._several:
            log.warning("relay %s went down (%s); %s", r.url, exc,
                        "using the others" if self._live() else "no relay of the pool is live now")
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: connect relays that are down (when their backoff is over) or new,
        close removed ones, and upload again the blobs only a relay that is down held."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            reviving: set[int] = set()
            while True:
                self._wake = trio.Event()
                now = trio.current_time()
                while self._closing:
                    r = self._closing.pop()
                    self._gone_sent += r.client.bytes_sent
                    self._gone_received += r.client.bytes_received
                    nursery.start_soon(_close, r.client)
                for r in self._relays:
                    if r.state != LIVE and r.retry_at <= now and id(r) not in reviving:
                        reviving.add(id(r))
                        nursery.start_soon(self._revive, r, reviving)
                if self._orphans():
                    await self._resend()
                waits = [r.retry_at for r in self._relays if r.state != LIVE and id(r) not in reviving]
                with trio.move_on_at(min(waits, default=now + MAX_RETRY)):
                    await self._wake.wait()

    async def _revive(self, r: _Relay, reviving: set[int]) -> None:
        try:
            with trio.move_on_after(CONNECT_TIMEOUT) as timer:
                await self._connect_one(r, {})
                if r.state == LIVE:
                    await self._recheck(r)
            if timer.cancelled_caught:
                self._set_down(r, RelayUnavailable(r.url, f"no answer within {CONNECT_TIMEOUT:g} s"))
        finally:
            reviving.discard(id(r))
            self._wake.set()

    async def _recheck(self, r: _Relay) -> None:
        """A relay back after an outage may have restarted empty: our blobs it no longer
        holds are no longer counted as held by it (so ``run`` sends them again)."""
        names = [name for name, held in self._spool.items() if r.url in held.holders]
        for i in range(0, len(names), TOUCH_MAX_BLOBS):
            try:
                missing = await r.client.touch_blobs(names[i : i + TOUCH_MAX_BLOBS])
            except NetError as exc:
                log.info("could not ask relay %s which of our blobs it kept: %s", r.url, exc)
                return
            for name in missing:
                held = self._spool.get(name)
                if held is not None:
                    held.holders.discard(r.url)

    # -- running one call on several relays --------------------------------------------------

    async def _each(self, call: Callable[[Transport], Awaitable[T]]) -> list[T]:
        """``call`` on every live relay at once; the results of those that answered. Raises
        when none did: the first error that is not ``RelayUnavailable``, else one that is."""
        live = self._live()
        if not live:
            raise self._none_live({})
        results: list[T] = []
        errors: dict[str, NetError] = {}

        async def one(r: _Relay) -> None:
            try:
                results.append(await call(r.client))
            except RelayUnavailable as exc:
                errors[r.url] = exc
                self._set_down(r, exc)
            except NetError as exc:
                errors[r.url] = exc

        if len(live) == 1:
            await one(live[0])
        else:
            async with trio.open_nursery() as nursery:
                for r in live:
                    nursery.start_soon(one, r)
        if not results:
            told = next((e for e in errors.values() if not isinstance(e, RelayUnavailable)), None)
            raise told if told is not None else self._none_live(errors)
        return results

    async def _first(self, call: Callable[[_Relay], Awaitable[T]], order: list[_Relay]) -> T:
        """``call`` on the relays of ``order`` one after another, until one answers. Raises
        the most telling error when none did: a corrupt blob, a limit, a missing blob, then
        ``RelayUnavailable``."""
        if not order:
            raise self._none_live({})
        errors: list[NetError] = []
        for r in order:
            try:
                return await call(r)
            except RelayUnavailable as exc:
                self._set_down(r, exc)
                errors.append(exc)
            except NetError as exc:
                errors.append(exc)
        for kind in (BlobCorrupt, RelayLimit, RelayRejected, BlobMissing):
            found = next((e for e in errors if isinstance(e, kind)), None)
            if found is not None:
                raise found
        raise errors[-1]

    # -- messages ------------------------------------------------------------------------

    async def send(self, peer: str, data: bytes) -> None:
        await self._each(lambda c: c.send(peer, data))

    async def broadcast(self, data: bytes) -> int:
        return max(await self._each(lambda c: c.broadcast(data)))

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        """Acknowledge the local seqs up to ``after``; return what follows, from every live
        relay, each message once (see the module docstring)."""
        if after < 0 or wait < 0:  # what a relay answers
            raise RelayRejected(self._relays[0].url, 400, "after and wait must not be negative",
                                code=ErrorCode.BAD_REQUEST)
        self._acked = max(self._acked, after)
        for r in self._relays:
            _acknowledge(r, self._acked)
        if not self._ready:
            await self._poll(wait)
        out, self._ready = self._ready, []
        return out, out[-1].seq if out else after

    async def _poll(self, wait: float) -> None:
        live = self._live()
        if not live:
            raise self._none_live({})
        revoked: list[NetError] = []
        errors: dict[str, NetError] = {}
        deadline = trio.current_time() + wait
        async with trio.open_nursery() as nursery:
            for r in live:
                nursery.start_soon(self._poll_one, r, deadline, nursery.cancel_scope, revoked, errors)
        if revoked:
            raise revoked[0]
        if not self._several and errors:
            raise next(iter(errors.values()))  # one relay: its errors are the daemon's to judge
        if not self._ready and not self._live():
            raise self._none_live(errors)

    async def _poll_one(self, r: _Relay, deadline: float, done: trio.CancelScope,
                        revoked: list[NetError], errors: dict[str, NetError]) -> None:
        while True:
            try:
                messages, _cursor = await r.client.recv(r.acked, max(0.0, deadline - trio.current_time()))
            except NetError as exc:
                errors[r.url] = exc
                if _revoked(exc):
                    revoked.append(exc)
                    done.cancel()
                elif isinstance(exc, RelayUnavailable):
                    self._set_down(r, exc)
                elif self._several:
                    log.warning("relay %s refused a receive: %s", r.url, exc)
                    self._set_down(r, exc)
                return
            now = trio.current_time()
            for m in messages:
                if not self._several or self._seen.fresh(r.url, m.sender, m.data, now):
                    self._local += 1
                    r.pending.append((m.seq, self._local))
                    self._ready.append(Message(self._local, m.sender, m.data))
                else:
                    r.pending.append((m.seq, None))
            _acknowledge(r, self._acked)  # past the copies, if nothing else is pending
            if self._ready:
                done.cancel()
                return
            if now >= deadline:
                return

    async def revoke(self, record: bytes) -> None:
        await self._each(lambda c: c.revoke(record))

    async def admit(self, record: bytes) -> None:
        await self._each(lambda c: c.admit(record))

    async def roster(self) -> list[list[bytes]]:
        seen: dict[tuple[bytes, ...], list[bytes]] = {}
        for proofs in await self._each(lambda c: c.roster()):
            for proof in proofs:
                seen.setdefault(tuple(proof), proof)
        return list(seen.values())

    # -- blobs -----------------------------------------------------------------------------

    def _fetch_order(self, blob: str) -> list[_Relay]:
        live = self._live()
        held = self._spool.get(blob)
        if held is None:
            return live
        return sorted(live, key=lambda r: r.url not in held.holders)  # stable: the primary first

    async def put_blob(self, data: bytes) -> str:
        async def put(r: _Relay) -> str:
            name = await r.client.put_blob(data)
            await self._keep(name, r.url, len(data), data=data)
            return name

        return await self._first(put, self._live())

    async def put_blob_file(self, path: Path) -> str:
        async def put(r: _Relay) -> str:
            name = await r.client.put_blob_file(path)
            await self._keep(name, r.url, path.stat().st_size, path=path)
            return name

        return await self._first(put, self._live())

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        return await self._first(lambda r: r.client.get_blob(blob, max_size=max_size), self._fetch_order(blob))

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        return await self._first(lambda r: r.client.get_blob_range(blob, start, stop), self._fetch_order(blob))

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        await self._first(lambda r: r.client.get_blob_file(blob, path, max_size=max_size),
                          self._fetch_order(blob))

    async def has_blob(self, blob: str) -> bool:
        return any(await self._each(lambda c: c.has_blob(blob)))

    async def touch_blobs(self, blobs: list[str]) -> list[str]:
        """Touch on every live relay; the blobs none of them holds."""
        first, *others = await self._each(lambda c: c.touch_blobs(blobs))
        return [b for b in first if all(b in missing for missing in others)]

    @property
    def blob_ttl(self) -> float | None:
        ttls = [t for r in self._live() if (t := r.client.blob_ttl) is not None]
        return min(ttls) if ttls else None

    @property
    def bytes_sent(self) -> int:
        return self._gone_sent + sum(r.client.bytes_sent for r in self._relays)

    @property
    def bytes_received(self) -> int:
        return self._gone_received + sum(r.client.bytes_received for r in self._relays)

    # -- the spool: this peer's uploads, to send again --------------------------------------

    async def _keep(self, name: str, url: str, size: int, *, data: bytes | None = None,
                    path: Path | None = None) -> None:
        """Remember that ``url`` took our blob ``name`` (its bytes ``data``, or the file at
        ``path``), to upload it again if that relay goes down or comes back without it."""
        held = self._spool.get(name)
        if held is not None:
            held.holders.add(url)
            self._spool.move_to_end(name)
            return
        try:
            held = await self._spooled(name, size, url, data, path)
        except OSError as exc:
            log.info("could not keep blob %s (%s): it is not sent again if its relay dies", name[:12], exc)
            return
        self._spool[name] = held
        total = sum(s.size for s in self._spool.values())
        while len(self._spool) > SPOOL_BLOBS or (total > SPOOL_BYTES and len(self._spool) > 1):
            _old, gone = self._spool.popitem(last=False)
            total -= gone.size
            if gone.path is not None:
                gone.path.unlink(missing_ok=True)

    async def _spooled(self, name: str, size: int, url: str, data: bytes | None, path: Path | None) -> _Spooled:
        """The spool's copy: a hard link to the uploaded file (free: the daemon's work files
        share its file system), the bytes written to disk, or (no spool folder) in memory."""
        if self._spool_dir is None:
            if data is None:
                assert path is not None
                data = path.read_bytes() if size < 2**20 else await trio.to_thread.run_sync(path.read_bytes)
            return _Spooled(size, {url}, data=data)
        folder, link = self._spool_dir, self._spool_dir / f"{name}.blob"
        folder.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        if path is not None:
            os.link(path, link)
        else:
            assert data is not None
            await trio.to_thread.run_sync(link.write_bytes, data)  # a delta: tens of MB
        return _Spooled(size, {url}, path=link)

    def spooled(self, name: str) -> Path | None:
        """The file of our blob ``name``, sealed as uploaded, if the spool holds it on disk
        (what the LAN shortcut serves: ``daemon/_direct.py``)."""
        held = self._spool.get(name)
        return held.path if held is not None else None

    def _orphans(self) -> list[str]:
        """Blobs of ours that only relays that are down hold (while one is live)."""
        live = {r.url for r in self._live()}
        if not live:
            return []
        return [name for name, s in self._spool.items() if not s.holders & live]

    async def _resend(self) -> None:
        for name in self._orphans():
            held = self._spool.get(name)
            primary = self._primary()
            if held is None or primary is None:
                continue
            try:
                if held.path is not None:
                    got = await primary.client.put_blob_file(held.path)
                else:
                    assert held.data is not None
                    got = await primary.client.put_blob(held.data)
            except RelayUnavailable as exc:
                self._set_down(primary, exc)
                return
            except (NetError, OSError) as exc:
                log.warning("could not send blob %s again through %s: %s", name[:12], primary.url, exc)
                held.holders.add(primary.url)  # not again and again: a fetcher that misses it asks
                continue
            if got == name:
                held.holders.add(primary.url)
                self.resent += 1
                log.info("sent blob %s again through %s (the relay that held it is down)", name[:12], primary.url)

    async def aclose(self) -> None:
        for r in [*self._relays, *self._closing]:
            with trio.CancelScope(shield=True):
                await _close(r.client)


def _acknowledge(r: _Relay, upto: int) -> None:
    """Move ``r``'s cursor past what it delivered up to local seq ``upto`` and past copies."""
    while r.pending and (r.pending[0][1] is None or r.pending[0][1] <= upto):
        r.acked = max(r.acked, r.pending.popleft()[0])


def _revoked(exc: BaseException) -> bool:
    return isinstance(exc, RelayRejected) and exc.status == 403 and exc.code == ErrorCode.REVOKED


async def _close(client: Transport) -> None:
    try:
        await client.aclose()
    except NetError as exc:
        log.debug("closing a relay connection: %s", exc)
