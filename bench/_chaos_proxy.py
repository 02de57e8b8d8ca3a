"""A CONNECT proxy per peer that the campaign can cut: the peer's only way to its relays.

Each peer runs with ``HTTPS_PROXY`` set to its own ``Gate``: an HTTP CONNECT proxy on
loopback, served by one asyncio loop in a thread for all of them. ``cut()`` resets every
tunnel the peer has open and refuses new ones (the connection is closed before any
answer), as a link whose router answers would; ``cut(silent=True)`` drops every byte
instead and leaves connections hanging, as a pulled cable would (the daemon notices only
when a request times out). ``mend()`` lets traffic through again; tunnels that were
silenced are then reset, as TCP connections that timed out would be. Nothing else is
changed: a cut peer keeps training.
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
        self.silent = False  # cut, dropping bytes rather than resetting
        self.tunnels: set[asyncio.StreamWriter] = set()
        self.held: set[asyncio.StreamWriter] = set()  # connections made or silenced during a silent cut
        self.refused = 0

    def cut(self, silent: bool = False) -> None:
        self._loop.call_soon_threadsafe(self._cut, silent)

    def mend(self) -> None:
        self._loop.call_soon_threadsafe(self._mend)

    def _cut(self, silent: bool) -> None:
        self.open, self.silent = False, silent
        for writer in list(self.tunnels):
            if silent:
                self.held.add(writer)
            else:
                writer.transport.abort()  # a reset, not a polite close
        if not silent:
            self.tunnels.clear()

    def _mend(self) -> None:
        for writer in list(self.held):
            writer.transport.abort()
            self.tunnels.discard(writer)
        self.held.clear()
        self.open, self.silent = True, False


async def _pipe(gate: Gate, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await reader.read(1 << 16):
            if writer in gate.held or not gate.open:
                continue  # dropped on the floor
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
                if gate.silent:  # nothing answers: the client waits for its own timeout
                    gate.held.add(writer)
                    with contextlib.suppress(OSError):
                        while await reader.read(1 << 16):
                            pass
                    return
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
                await asyncio.gather(_pipe(gate, reader, up_writer), _pipe(gate, up_reader, writer))
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
                gate._cut(False)
                gate._mend()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
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
