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
  ``RelayUnavailable`` and stop its protocol clock (``daemon/node/_link.py``).

With one relay it is that relay, error for error (and no copies to drop); the spool
still re-sends what a relay that restarted empty lost.

The parts, each in its module: ``RelaySet`` (which relays are live, one call on them),
``Inbox`` (receiving, copies dropped, the cursors) and ``Spool`` (our uploads, to send
again). ``MultiRelay`` composes them into the ``Transport`` and revives relays in ``run``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from ._errors import NetError, RelayUnavailable
from ._inbox import Inbox
from ._relayset import LIVE, MAX_RETRY, Relay, RelaySet
from ._spool import Spool
from ._transport import Message, Transport

log = logging.getLogger("ttpeer.net")

CONNECT_TIMEOUT = 30.0  # one attempt at reviving a relay


class MultiRelay:
    """The ``Transport`` over the relays ``relays`` ((url, fingerprint) pairs, in the pool's
    order); ``make(url, fingerprint)`` makes one relay's transport (a ``RelayClient``).
    ``spool``: a folder for the hard links of uploaded files (None: bytes kept in memory,
    for tests and the simulator). Start ``run`` in a nursery to revive relays that went
    down and send their blobs again."""

    def __init__(self, relays: Sequence[tuple[str, str]], make: Callable[[str, str], Transport], *,
                 spool: Path | None = None) -> None:
        self._relays = RelaySet(relays, make)
        self._inbox = Inbox(self._relays)
        self._spool = Spool(self._relays, spool)
        self._gone_sent = self._gone_received = 0

    # -- the list of relays -----------------------------------------------------------

    def set_relays(self, relays: Sequence[tuple[str, str]]) -> None:
        """Use ``relays`` from now on (the newest ``relays`` record): relays kept keep their
        connection; new ones are connected by ``run``; removed ones are closed by it."""
        self._relays.replace(relays)

    def describe(self) -> list[dict[str, Any]]:
        """Each relay in the pool's order: url, pin, state, last error, whether it is the primary."""
        return self._relays.describe()

    @property
    def peer(self) -> str:
        """This peer's id, as every relay knows it."""
        return str(getattr(self._relays.all[0].client, "peer", ""))

    @property
    def relays(self) -> list[tuple[str, str]]:
        return [(r.url, r.fingerprint) for r in self._relays.all]

    @property
    def resent(self) -> int:
        """Blobs uploaded again because the relay holding them went down."""
        return self._spool.resent

    @property
    def wrong_certificates(self) -> int:
        """Connections refused because a relay presented another certificate than its pin."""
        return self._relays.wrong_certificates

    # -- connecting and reviving --------------------------------------------------------

    async def connect(self) -> None:
        """Connect every relay at once. Returns when at least one is live; raises (as the
        relay did, with one relay) when none is."""
        await self._relays.connect()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: connect relays that are down (when their backoff is over) or new,
        close removed ones, and upload again the blobs only a relay that is down held."""
        task_status.started()
        relays = self._relays
        async with trio.open_nursery() as nursery:
            reviving: set[int] = set()
            while True:
                relays.wake = trio.Event()
                now = trio.current_time()
                while relays.closing:
                    r = relays.closing.pop()
                    self._gone_sent += r.client.bytes_sent
                    self._gone_received += r.client.bytes_received
                    nursery.start_soon(_close, r.client)
                for r in relays.all:
                    if r.state != LIVE and r.retry_at <= now and id(r) not in reviving:
                        reviving.add(id(r))
                        nursery.start_soon(self._revive, r, reviving)
                if self._spool.orphans():
                    await self._spool.resend()
                waits = [r.retry_at for r in relays.all if r.state != LIVE and id(r) not in reviving]
                with trio.move_on_at(min(waits, default=now + MAX_RETRY)):
                    await relays.wake.wait()

    async def _revive(self, r: Relay, reviving: set[int]) -> None:
        try:
            with trio.move_on_after(CONNECT_TIMEOUT) as timer:
                await self._relays.connect_one(r, {})
                if r.state == LIVE:
                    await self._spool.recheck(r)
            if timer.cancelled_caught:
                self._relays.set_down(r, RelayUnavailable(r.url, f"no answer within {CONNECT_TIMEOUT:g} s"))
        finally:
            reviving.discard(id(r))
            self._relays.wake.set()

    # -- messages ------------------------------------------------------------------------

    async def send(self, peer: str, data: bytes) -> None:
        await self._relays.each(lambda c: c.send(peer, data))

    async def broadcast(self, data: bytes) -> int:
        return max(await self._relays.each(lambda c: c.broadcast(data)))

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        """Acknowledge the local seqs up to ``after``; return what follows, from every live
        relay, each message once (see the module docstring)."""
        return await self._inbox.recv(after, wait)

    async def revoke(self, record: bytes) -> None:
        await self._relays.each(lambda c: c.revoke(record))

    async def admit(self, record: bytes) -> None:
        await self._relays.each(lambda c: c.admit(record))

    async def roster(self) -> list[list[bytes]]:
        seen: dict[tuple[bytes, ...], list[bytes]] = {}
        for proofs in await self._relays.each(lambda c: c.roster()):
            for proof in proofs:
                seen.setdefault(tuple(proof), proof)
        return list(seen.values())

    # -- blobs -----------------------------------------------------------------------------

    async def put_blob(self, data: bytes) -> str:
        async def put(r: Relay) -> str:
            name = await r.client.put_blob(data)
            await self._spool.keep(name, r.url, len(data), data=data)
            return name

        return await self._relays.first(put, self._relays.live())

    async def put_blob_file(self, path: Path) -> str:
        async def put(r: Relay) -> str:
            name = await r.client.put_blob_file(path)
            await self._spool.keep(name, r.url, path.stat().st_size, path=path)
            return name

        return await self._relays.first(put, self._relays.live())

    async def get_blob(self, blob: str, *, max_size: int) -> bytes:
        return await self._relays.first(lambda r: r.client.get_blob(blob, max_size=max_size),
                                        self._spool.fetch_order(blob))

    async def get_blob_range(self, blob: str, start: int, stop: int) -> bytes:
        return await self._relays.first(lambda r: r.client.get_blob_range(blob, start, stop),
                                        self._spool.fetch_order(blob))

    async def get_blob_file(self, blob: str, path: Path, *, max_size: int) -> None:
        await self._relays.first(lambda r: r.client.get_blob_file(blob, path, max_size=max_size),
                                 self._spool.fetch_order(blob))

    async def has_blob(self, blob: str) -> bool:
        return any(await self._relays.each(lambda c: c.has_blob(blob)))

    async def touch_blobs(self, blobs: list[str]) -> list[str]:
        """Touch on every live relay; the blobs none of them holds."""
        first, *others = await self._relays.each(lambda c: c.touch_blobs(blobs))
        return [b for b in first if all(b in missing for missing in others)]

    def spooled(self, name: str) -> Path | None:
        """The file of our blob ``name``, sealed as uploaded, if the spool holds it on disk
        (what the LAN shortcut serves: ``daemon/data/_direct.py``)."""
        return self._spool.path(name)

    @property
    def blob_ttl(self) -> float | None:
        ttls = [t for r in self._relays.live() if (t := r.client.blob_ttl) is not None]
        return min(ttls) if ttls else None

    @property
    def bytes_sent(self) -> int:
        return self._gone_sent + sum(r.client.bytes_sent for r in self._relays.all)

    @property
    def bytes_received(self) -> int:
        return self._gone_received + sum(r.client.bytes_received for r in self._relays.all)

    async def aclose(self) -> None:
        for r in [*self._relays.all, *self._relays.closing]:
            with trio.CancelScope(shield=True):
                await _close(r.client)


async def _close(client: Transport) -> None:
    try:
        await client.aclose()
    except NetError as exc:
        log.debug("closing a relay connection: %s", exc)
