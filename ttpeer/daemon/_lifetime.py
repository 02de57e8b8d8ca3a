"""The node's run as its parts see it: where their tasks start, and what stops it.

``Node.run`` opens one nursery and hands it to the ``Lifetime`` (``nursery``); the parts
start their background tasks there (``start_soon``), and where a task is only worth
starting while the node runs (an upload for another peer, a prefetch) they ask
``running`` first. The parts get the lifetime when they are built, before the nursery
exists: it is the one thing of the node that comes later.

``halt`` stops the daemon for an error of the tree (a full disk, a membership that ended):
it is logged and kept in ``fatal``, which the caller of ``Node.run`` raises. ``stop`` ends
the run without one; ``on_stop`` saves first what must outlive it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVarTuple

import trio

from ttpeer.errors import TtpeerError

log = logging.getLogger("ttpeer.daemon")

Args = TypeVarTuple("Args")


class Lifetime:
    def __init__(self, on_stop: Callable[[], None]) -> None:
        self.nursery: trio.Nursery | None = None  # Node.run's, while it runs
        self.fatal: TtpeerError | None = None  # the error the daemon stopped for
        self._on_stop = on_stop

    @property
    def running(self) -> bool:
        return self.nursery is not None

    def start_soon(self, fn: Callable[[*Args], Awaitable[object]], *args: *Args) -> None:
        """Start ``fn(*args)`` in the node's nursery. Raises ``RuntimeError`` before
        ``Node.run`` opened it."""
        if self.nursery is None:
            raise RuntimeError("the node's tasks start only while Node.run runs")
        self.nursery.start_soon(fn, *args)

    def stop(self) -> None:
        """End the run: ``on_stop``, then the nursery cancelled (if it is open)."""
        self._on_stop()
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def halt(self, exc: TtpeerError) -> None:
        """Stop for ``exc``: logged, and kept in ``fatal`` for the caller of ``Node.run``."""
        self.fatal = exc
        log.error("%s", exc)
        self.stop()
