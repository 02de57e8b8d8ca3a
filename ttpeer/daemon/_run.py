"""Run the daemon in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from ttpeer.net import RelayClient
from ttpeer.proto import Timing

from ._control import serve_control
from ._home import Home
from ._node import Node
from ._torch import TorchExecutor

log = logging.getLogger("ttpeer.daemon")


async def run_daemon(
    home: Home, *, device: str = "cpu", task_options: dict[str, Any] | None = None,
    proxy: str | None = None, timing: Timing = Timing(),
) -> None:
    """Serve this home's membership until a signal arrives. Raises ``TtpeerError`` for
    what stops the daemon (another daemon on this home, a relay that is not ours)."""
    home.lock()
    cfg = home.config()
    client = RelayClient(cfg.relays[0], cfg.fingerprint, pool=cfg.pool, peer_key=home.node_key(),
                         proof=cfg.proof, proxy=proxy)
    node = Node(home, client, TorchExecutor(home, device=device, task_options=task_options), timing=timing)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await nursery.start(node.run)
            await nursery.start(serve_control, node, home.control_socket)
            print(f"ttpeer up: node {node.me[:12]} ({cfg.name}) in pool {cfg.pool[:12]}", flush=True)
    finally:
        node.log.close()
        with trio.CancelScope(shield=True):
            await client.aclose()
        home.unlock()
    if node.fatal is not None:
        raise node.fatal


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.warning("received %s: stopping", signal.Signals(sig).name)
            scope.cancel()
            return
