"""The relay link: connecting, the outbox, the receive loop, and the protocol clock.

Theory of operation. ``Link`` owns this node's side of the relay: it connects (retrying
with backoff), sends what the node queues in its outbox (each message a few times, with
backoff), and long-polls the relay, handing each message and then each batch to the
node. Every failure goes through one place (``failed``): a relay that is gone stops the
protocol clock, a relay that answers starts it again. All retries wait through one
``Backoff`` (exponential, jittered from the node's seeded generator, so the simulator
stays reproducible).

The protocol clock (``now``) is trio's clock less every relay outage of ours. Losing
the relay is our fault, not the pool's: while we are cut off, nobody's lease runs out in
our view and nobody goes silent, so a relay restart declares no one dead.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import trio
from ttpeer_wire import ErrorCode

from ttpeer.net import NetError, RelayFingerprintMismatch, RelayRejected, RelayUnavailable, Transport

from .._counters import Counters

log = logging.getLogger("ttpeer.daemon")

RECV_WAIT = 20.0
OUTBOX_TRIES = 6  # then a message is dropped: anti-entropy resends what matters


class Backoff:
    """Exponential backoff with jitter: each wait is ``delay`` times 0.5 to 1.5, and the
    delay doubles up to ``cap``."""

    def __init__(self, rng: random.Random, *, first: float = 0.5, cap: float = 30.0) -> None:
        self._rng, self._first, self._cap = rng, first, cap
        self.delay = first

    async def wait(self) -> None:
        await trio.sleep(self.delay * (0.5 + self._rng.random()))
        self.delay = min(self.delay * 2, self._cap)

    def reset(self) -> None:
        self.delay = self._first


class Link:
    def __init__(self, transport: Transport, counters: Counters, rng: random.Random,
                 wake: Callable[[], None]) -> None:
        self.transport = transport
        self._counters = counters
        self._rng = rng
        self._wake = wake  # the deadline in trio time moves when the clock stops or starts
        self._offset = 0.0  # relay outages so far: protocol time stands still while we are cut off
        self._down_since: float | None = None
        self.outbox_send, self.outbox_recv = trio.open_memory_channel[tuple[str | None, bytes]](10_000)

    # -- the protocol clock -------------------------------------------------------------

    def now(self) -> float:
        """Protocol time: trio's clock less every relay outage of ours."""
        return self.trio_now() - self._offset

    def trio_now(self) -> float:
        """Trio's clock, stopped while we are cut off from the relay."""
        return trio.current_time() if self._down_since is None else self._down_since

    def to_trio(self, deadline: float) -> float:
        return deadline + self._offset if self._down_since is None else float("inf")

    def down(self) -> None:
        self._counters.relay_ok = False
        if self._down_since is None:
            self._down_since = trio.current_time()
            self._wake()

    def up(self) -> None:
        self._counters.relay_ok = True
        if self._down_since is not None:
            outage = trio.current_time() - self._down_since
            self._down_since = None
            self._offset += outage
            for peer in self._counters.peers_seen:
                self._counters.peers_seen[peer] += outage
            self._wake()

    def failed(self, exc: NetError) -> None:
        if isinstance(exc, RelayUnavailable):
            self.down()
        self._counters.last_error = str(exc)

    # -- the tasks ------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect, retrying while the relay cannot be reached. Raises
        ``RelayFingerprintMismatch`` (not our relay) and ``RelayRejected`` (it refuses us)."""
        backoff = Backoff(self._rng)
        while True:
            try:
                await self.transport.connect()
                self.up()
                return
            except (RelayFingerprintMismatch, RelayRejected):
                raise
            except NetError as exc:
                self.failed(exc)
                log.warning("relay unreachable (%s); retrying in %.0f s", exc, backoff.delay)
                await backoff.wait()

    async def outbox(self) -> None:
        """Send what is queued in ``outbox_send``: (peer, data), or (None, data) to all."""
        async for peer, data in self.outbox_recv:
            backoff = Backoff(self._rng, cap=15.0)
            for _attempt in range(OUTBOX_TRIES):
                try:
                    if peer is None:
                        await self.transport.broadcast(data)
                    else:
                        await self.transport.send(peer, data)
                    self.up()
                    break
                except NetError as exc:
                    self.failed(exc)
                    await backoff.wait()

    async def receiver(self, on_message: Callable[[str, bytes], None], on_batch: Callable[[], None],
                       on_revoked: Callable[[], None]) -> None:
        """Long-poll the relay: each message to ``on_message``, then ``on_batch`` once per
        batch. Returns after ``on_revoked`` if the relay says we were revoked."""
        cursor = 0
        backoff = Backoff(self._rng)
        while True:
            try:
                messages, cursor = await self.transport.recv(cursor, RECV_WAIT)
                self.up()
                backoff.reset()
            except NetError as exc:
                if revoked_by_relay(exc):
                    on_revoked()
                    return
                self.failed(exc)
                log.warning("relay receive failed (%s); retrying", exc)
                await backoff.wait()
                continue
            for msg in messages:
                self._counters.peers_seen[msg.sender] = trio.current_time()
                on_message(msg.sender, msg.data)
            if messages:  # one decision for the whole batch, not one per message
                on_batch()


def revoked_by_relay(exc: Exception) -> bool:
    return isinstance(exc, RelayRejected) and exc.status == 403 and exc.code == ErrorCode.REVOKED


def token_used_at_relay(exc: Exception) -> bool:
    """The relay refused our login: every use of our token is acknowledged for other machines."""
    return isinstance(exc, RelayRejected) and exc.status == 403 and exc.code == ErrorCode.TOKEN_USED
