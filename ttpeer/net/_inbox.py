"""``Inbox``: what a pool's relays deliver, each message once, under one cursor of its own.

A receive long-polls every live relay at once and returns as soon as any delivered. A
copy that came through another relay is dropped (``_Seen``), while a sender's genuine
resend of the same bytes still gets through. The caller sees local seqs; each relay's
own cursor (``Relay.acked``) moves, acknowledging and so deleting at that relay, only
past messages the caller acknowledged or that were copies: delivery stays at-least-once.
A revocation from any relay ends the receive at once; with one relay, its errors are the
caller's to judge, as they would be without this layer.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import trio
from ttpeer_wire import ErrorCode

from ._errors import NetError, RelayRejected, RelayUnavailable
from ._relayset import Relay, RelaySet, revoked
from ._transport import Message

log = logging.getLogger("ttpeer.net")

SEEN_WINDOW = 120.0  # seconds a delivered message's digest is remembered, to drop copies
SEEN_MAX = 20_000


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


class Inbox:
    """Receiving from the relays of ``relays`` (``Transport.recv`` for all of them)."""

    def __init__(self, relays: RelaySet) -> None:
        self._relays = relays
        self._ready: list[Message] = []
        self._local = self._acked = 0  # the last local seq handed out; the last the caller acknowledged
        self._seen = _Seen()

    async def recv(self, after: int, wait: float) -> tuple[list[Message], int]:
        """Acknowledge the local seqs up to ``after``; return what follows, from every live
        relay, each message once."""
        if after < 0 or wait < 0:  # what a relay answers
            raise RelayRejected(self._relays.all[0].url, 400, "after and wait must not be negative",
                                code=ErrorCode.BAD_REQUEST)
        self._acked = max(self._acked, after)
        for r in self._relays.all:
            _acknowledge(r, self._acked)
        if not self._ready:
            await self._poll(wait)
        out, self._ready = self._ready, []
        return out, out[-1].seq if out else after

    async def _poll(self, wait: float) -> None:
        live = self._relays.live()
        if not live:
            raise self._relays.none_live({})
        revocations: list[NetError] = []
        errors: dict[str, NetError] = {}
        deadline = trio.current_time() + wait
        async with trio.open_nursery() as nursery:
            for r in live:
                nursery.start_soon(self._poll_one, r, deadline, nursery.cancel_scope, revocations, errors)
        if revocations:
            raise revocations[0]
        if not self._relays.several and errors:
            raise next(iter(errors.values()))  # one relay: its errors are the daemon's to judge
        if not self._ready and not self._relays.live():
            raise self._relays.none_live(errors)

    async def _poll_one(self, r: Relay, deadline: float, done: trio.CancelScope,
                        revocations: list[NetError], errors: dict[str, NetError]) -> None:
        while True:
            try:
                messages, _cursor = await r.client.recv(r.acked, max(0.0, deadline - trio.current_time()))
            except NetError as exc:
                errors[r.url] = exc
                if revoked(exc):
                    revocations.append(exc)
                    done.cancel()
                elif isinstance(exc, RelayUnavailable):
                    self._relays.set_down(r, exc)
                elif self._relays.several:
                    log.warning("relay %s refused a receive: %s", r.url, exc)
                    self._relays.set_down(r, exc)
                return
            now = trio.current_time()
            for m in messages:
                if not self._relays.several or self._seen.fresh(r.url, m.sender, m.data, now):
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


def _acknowledge(r: Relay, upto: int) -> None:
    """Move ``r``'s cursor past what it delivered up to local seq ``upto`` and past copies."""
    while r.pending and (r.pending[0][1] is None or r.pending[0][1] <= upto):
        r.acked = max(r.acked, r.pending.popleft()[0])
