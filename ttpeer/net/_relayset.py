"""``RelaySet``: a pool's relays, which of them are live, and one call run on them.

Each relay is ``live``, ``down`` (connected again after a backoff that doubles up to
``MAX_RETRY``), ``connecting``, or ``wrong certificate`` (it presents another certificate
than its pin: retried only every ``WRONG_CERT_RETRY``). The primary is the first live
relay in the pool's order. A call fails only when every relay it was tried on failed; a
relay that fails with ``RelayUnavailable`` is marked down, and ``wake`` is set so that
the owner's revival loop (``MultiRelay.run``) notices. With no relay live, the error
raised is ``none_live``'s: with one relay, that relay's own.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
from ttpeer_wire import ErrorCode

from ._errors import (
    BlobCorrupt,
    BlobMissing,
    NetError,
    RelayFingerprintMismatch,
    RelayLimit,
    RelayRejected,
    RelayUnavailable,
)
from ._transport import Transport

log = logging.getLogger("ttpeer.net")

T = TypeVar("T")

LIVE, DOWN, CONNECTING, WRONG_CERT = "live", "down", "connecting", "wrong certificate"
FIRST_RETRY = 1.0  # seconds before a relay that went down is connected again; doubles ...
MAX_RETRY = 60.0  # ... up to this
WRONG_CERT_RETRY = 300.0  # a relay that is not the one pinned: checked again this rarely


@dataclass
class Relay:
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


class RelaySet:
    """The relays ``relays`` ((url, fingerprint) pairs, in the pool's order), each with the
    transport ``make(url, fingerprint)`` makes for it."""

    def __init__(self, relays: Sequence[tuple[str, str]], make: Callable[[str, str], Transport]) -> None:
        if not relays:
            raise ValueError("a pool has at least one relay")
        self._make = make
        self.all: list[Relay] = [self._new(url, fp) for url, fp in relays]
        self.closing: list[Relay] = []  # removed by replace, for the owner to close
        self.wake = trio.Event()  # set when a relay goes down or the list changes
        self.wrong_certificates = 0

    def _new(self, url: str, fp: str) -> Relay:
        return Relay(url.rstrip("/"), fp.lower(), self._make(url, fp))

    def replace(self, relays: Sequence[tuple[str, str]]) -> None:
        """Use ``relays`` from now on: relays kept keep their connection; new ones start
        connecting; removed ones go to ``closing``."""
        if not relays:
            raise ValueError("a pool has at least one relay")
        old = {(r.url, r.fingerprint): r for r in self.all}
        fresh = [old.pop((url.rstrip("/"), fp.lower())) if (url.rstrip("/"), fp.lower()) in old
                 else self._new(url, fp) for url, fp in relays]
        self.all = fresh
        self.closing += old.values()
        for r in old.values():
            log.info("relay %s is no longer one of the pool's", r.url)
        self.wake.set()

    def describe(self) -> list[dict[str, Any]]:
        """Each relay in the pool's order: url, pin, state, last error, whether it is the primary."""
        primary = self.primary()
        return [{"url": r.url, "fingerprint": r.fingerprint, "state": r.state, "error": r.error,
                 "primary": r is primary} for r in self.all]

    def live(self) -> list[Relay]:
        return [r for r in self.all if r.state == LIVE]

    def primary(self) -> Relay | None:
        return next(iter(self.live()), None)

    @property
    def several(self) -> bool:
        return len(self.all) > 1

    # -- connecting -----------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect every relay at once. Returns when at least one is live; raises (as the
        relay did, with one relay) when none is."""
        errors: dict[str, NetError] = {}
        async with trio.open_nursery() as nursery:
            for r in self.all:
                nursery.start_soon(self.connect_one, r, errors)
        if not self.live():
            raise self.none_live(errors)

    async def connect_one(self, r: Relay, errors: dict[str, NetError]) -> None:
        try:
            await r.client.connect()
        except RelayFingerprintMismatch as exc:
            errors[r.url] = exc
            self.wrong_certificates += 1
            if r.state != WRONG_CERT:
                log.warning("relay %s presents certificate %s, not the pinned %s: skipped (ask the pool "
                            "admin whether it moved; 'ttpeer relay ls' lists the pool's relays)",
                            r.url, exc.got, r.fingerprint)
            self.set_down(r, exc, state=WRONG_CERT, retry=WRONG_CERT_RETRY)
        except NetError as exc:
            errors[r.url] = exc
            self.set_down(r, exc)
        else:
            if r.state != LIVE and self.several:
                log.info("relay %s is live", r.url)
            # The cursor stays: a relay's seqs only grow, across its restarts too.
            r.state, r.error, r.delay = LIVE, None, FIRST_RETRY

    def none_live(self, errors: dict[str, NetError]) -> NetError:
        """The error to raise when no relay is live: with one relay, its own; else a
        revocation first, then what every relay agrees on, else ``RelayUnavailable``."""
        found = [errors[r.url] for r in self.all if r.url in errors]
        if len(self.all) == 1 and found:
            return found[0]
        for exc in found:
            if revoked(exc):
                return exc
        if found and len(found) == len(self.all):
            if all(isinstance(e, RelayFingerprintMismatch) for e in found):
                return found[0]
            if all(isinstance(e, RelayRejected) for e in found):
                return found[0]
        said = "; ".join(f"{r.url}: {r.error or r.state}" for r in self.all)
        return RelayUnavailable(self.all[0].url, f"no relay of the pool answers ({said})")

    def set_down(self, r: Relay, exc: NetError, *, state: str = DOWN, retry: float | None = None) -> None:
        was = r.state
        r.state, r.error = state, str(exc)
        now = trio.current_time()
        if retry is None:
            retry, r.delay = r.delay, min(r.delay * 2, MAX_RETRY)
        r.retry_at = now + retry
        if was == LIVE and self.several:
            log.warning("relay %s went down (%s); %s", r.url, exc,
                        "using the others" if self.live() else "no relay of the pool is live now")
        self.wake.set()

    # -- one call on several relays -------------------------------------------------------

    async def each(self, call: Callable[[Transport], Awaitable[T]]) -> list[T]:
        """``call`` on every live relay at once; the results of those that answered. Raises
        when none did: the first error that is not ``RelayUnavailable``, else one that is."""
        live = self.live()
        if not live:
            raise self.none_live({})
        results: list[T] = []
        errors: dict[str, NetError] = {}

        async def one(r: Relay) -> None:
            try:
                results.append(await call(r.client))
            except RelayUnavailable as exc:
                errors[r.url] = exc
                self.set_down(r, exc)
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
            raise told if told is not None else self.none_live(errors)
        return results

    async def first(self, call: Callable[[Relay], Awaitable[T]], order: list[Relay]) -> T:
        """``call`` on the relays of ``order`` one after another, until one answers. Raises
        the most telling error when none did: a corrupt blob, a limit, a missing blob, then
        ``RelayUnavailable``."""
        if not order:
            raise self.none_live({})
        errors: list[NetError] = []
        for r in order:
            try:
                return await call(r)
            except RelayUnavailable as exc:
                self.set_down(r, exc)
                errors.append(exc)
            except NetError as exc:
                errors.append(exc)
        for kind in (BlobCorrupt, RelayLimit, RelayRejected, BlobMissing):
            found = next((e for e in errors if isinstance(e, kind)), None)
            if found is not None:
                raise found
        raise errors[-1]


def revoked(exc: BaseException) -> bool:
    """Whether ``exc`` is a relay's answer that this peer is revoked."""
    return isinstance(exc, RelayRejected) and exc.status == 403 and exc.code == ErrorCode.REVOKED
