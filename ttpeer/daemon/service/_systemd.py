"""The systemd service notification protocol (``sd_notify``), without libsystemd.

A service of ``Type=notify`` is started with ``$NOTIFY_SOCKET``: a Unix datagram
socket (a path, or ``@name`` in the abstract namespace) to which the service
sends newline-separated ``KEY=value`` lines. ttpeer sends ``READY=1`` once the
daemon serves its control socket, ``STATUS=...`` with the job's progress,
``WATCHDOG=1`` every half ``$WATCHDOG_USEC`` while its event loop runs (a wedged
loop stops the pings and systemd restarts the service), and ``STOPPING=1`` on
SIGTERM. Without ``$NOTIFY_SOCKET`` (not under systemd) every call does nothing.

Notifications are best effort and never block: a send that fails (nobody reads,
the queue is full) is logged at debug level and never stops the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping

import trio

log = logging.getLogger("ttpeer.systemd")


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (the watchdog is
        ours only when ``WATCHDOG_PID`` is unset or our pid)."""
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        pid = env.get("WATCHDOG_PID")
        if env.get("WATCHDOG_USEC", "").isdigit() and (not pid or pid == str(os.getpid())):
            usec = int(env["WATCHDOG_USEC"]) or None
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (``ready=1`` -> ``READY=1``). True if sent."""
        if self.address is None:
            return False
        text = "\n".join(f"{k.upper()}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            # Never block the event loop: if the manager is not reading (its queue is full), drop it.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
                s.sendto(text.encode(), target)
            return True
        except OSError as exc:
            log.debug("sd_notify to %s failed: %s", self.address, exc)
            return False

    async def watchdog(self, status: Callable[[], str | None]) -> None:
        """Ping the watchdog (and refresh ``STATUS=``) until cancelled. Runs on the
        event loop on purpose: if the loop stops turning, the pings stop."""
        interval = self.watchdog_interval
        if not self.enabled:
            return
        period = min(interval, 5.0) if interval else 5.0
        last_status = None
        while True:
            fields: dict[str, str | int] = {}
            if interval:
                fields["watchdog"] = 1
            text = status()
            if text and text != last_status:
                fields["status"] = last_status = text
            if fields:
                self.send(**fields)
            await trio.sleep(period)
