"""A CONNECT proxy per peer that the campaign can cut: the peer's only way to its relays.

Each peer runs with ``HTTPS_PROXY`` set to its own ``Gate``: an HTTP CONNECT proxy on
loopback, served by one asyncio loop in a thread for all of them. ``cut()`` resets every
tunnel the peer has open and refuses new ones (the connection is closed before any
answer), as a link that went down would; ``mend()`` lets it through again. Nothing else
is changed: a cut peer keeps training, and its daemon sees only failed connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Gate:
    """One peer's proxy. ``url`` is what its ``HTTPS_PROXY`` names."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: asyncio.Server) -> None:
        self._loop = loop
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.open = True
        self.tunnels: set[asyncio.StreamWriter] = set()
        self.refused = 0

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._cut)

    def mend(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "open", True)

    def _cut(self) -> None:
        self.open = False
        for writer in list(self.tunnels):
            writer.transport.abort()  # a reset, not a polite close
        self.tunnels.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


class Proxies:
    """The loop thread and every peer's ``Gate``; ``close()`` stops them all."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxies", daemon=True)
        self._thread.start()
        self.gates: list[Gate] = []

    def gate(self) -> Gate:
        return asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=10)

    async def _open(self) -> Gate:
        holder: list[Gate] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            gate = holder[0]
            if not gate.open:
                gate.refused += 1
                writer.transport.abort()
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
                host, _, port = target.rpartition(":")
                if method != "CONNECT" or host not in ("127.0.0.1", "localhost"):
                    writer.write(b"HTTP/1.1 403 Forbidden\r\n\r\n")
                    writer.close()
                    return
            except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
                writer.transport.abort()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            except OSError:  # the relay is down: say so, as a real proxy would
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
                writer.close()
                return
            if not gate.open:  # cut while it connected
                up_writer.transport.abort()
                writer.transport.abort()
                return
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            gate.tunnels.update((writer, up_writer))
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                gate.tunnels.discard(writer)
                gate.tunnels.discard(up_writer)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        gate = Gate(self._loop, server)
        holder.append(gate)
        self.gates.append(gate)
        return gate

    def close(self) -> None:
        async def stop() -> None:
            for gate in self.gates:
                gate._server.close()
                gate._cut()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@contextlib.contextmanager
def proxies() -> Iterator[Proxies]:
    p = Proxies()
    try:
        yield p
    finally:
        p.close()
