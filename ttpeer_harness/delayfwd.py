"""A transparent TCP forwarder that delays each direction: the network lab's latency.

The kernel here has no netem, so a lab gateway (a NAT router or the proxy host)
sends its LAN's TCP connections here with ``iptables -t nat ... REDIRECT``; this
process reads each connection's original destination (``SO_ORIGINAL_DST``),
connects to it after ``delay`` seconds (the SYN's trip), and copies bytes both
ways, holding every chunk ``delay`` seconds before writing it on. At most
``_MAX_QUEUED`` bytes wait per direction, so a slow reader slows the writer as a
real link would (the rate itself is ``tbf`` on the veth, not here).

It runs as a script (``python delayfwd.py ADDR PORT DELAY_FILE``), without
importing ttpeer. The delay in seconds is read from DELAY_FILE at start and
again on SIGHUP; connections already open keep theirs.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import sys
from pathlib import Path

SO_ORIGINAL_DST = 80
_CHUNK = 64 * 1024
_MAX_QUEUED = 4 * 1024 * 1024


def _original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


class Forwarder:
    def __init__(self, delay_file: Path) -> None:
        self.delay_file = delay_file
        self.delay = 0.0
        # asyncio holds tasks weakly: a connection whose sockets are all paused would be
        # garbage-collected mid-flight without a strong reference here.
        self.tasks: set[asyncio.Task[None]] = set()
        self.reload()

    def reload(self) -> None:
        self.delay = max(0.0, float(self.delay_file.read_text().strip() or 0))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        delay = self.delay
        try:
            host, port = _original_destination(writer.get_extra_info("socket"))
            await asyncio.sleep(delay)
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_pipe(reader, up_writer, delay))
                group.create_task(_pipe(up_reader, writer, delay))
        except* OSError:
            pass  # either side broke: close both
        finally:
            for w in (writer, up_writer):
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds late; EOF passes on too."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    room = asyncio.Semaphore(_MAX_QUEUED // _CHUNK)

    async def read() -> None:
        while True:
            await room.acquire()
            data = await reader.read(_CHUNK)  # OSError: this side broke, which stops write() too
            await queue.put((loop.time() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            room.release()
            try:
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
            except OSError:
                raise ConnectionError("the far side went away") from None  # stops read() too

    async with asyncio.TaskGroup() as group:
        group.create_task(read())
        group.create_task(write())


async def _main(addr: str, port: int, delay_file: Path) -> None:
    forwarder = Forwarder(delay_file)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, forwarder.reload)
    server = await asyncio.start_server(forwarder.handle, addr, port, reuse_address=True)
    print(f"forwarding on {addr}:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])))
